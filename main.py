r"""Generate text with a T5 model, speculatively, from models converted by convert.py.

python main.py                                   # t5-11b with a t5-small draft
python main.py --prompt "summarize: ..." --num-draft 3 --delta 0.1
python main.py --regular-decode                  # the main model alone
python main.py --draft-model-name none --prompt-lookup 3 --num-draft auto --show-draft
python main.py --prompts prompts.txt --batch-size 8 > outputs.txt
python main.py --prompts - --output results.jsonl < prompts.txt

Standard output is the generated text alone; everything else (Loading lines,
notes, the summary) goes to standard error, so the text can be piped.

--prompts FILE decodes every line of FILE (- : standard input) as a prompt,
--batch-size at a time. Blank lines are skipped: prompt i is the i-th
non-blank line, counted from 0. Standard output gets one line per prompt, in
input order, each as soon as it and those before it are done; a line break
in a text is written as the two characters \n (a carriage return \r, a
backslash \\), so line i is always prompt i's text. With --output FILE, a new
file, each prompt's JSON object ({"index", "text", "tokens", "n_accepted",
"n_draft", "seed"}) is written and flushed as soon as it is done, in completion
order, and nothing else goes to standard output.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from cli import (
    FULL_FLOAT32_NOTE,
    NON_NEGATIVE,
    POSITIVE,
    ArgumentParser,
    InOrderLines,
    JsonLines,
    add_drafting_options,
    checked,
    format_bytes,
    full_float32,
    open_output,
    quiet_transformers,
    read_prompt,
    read_prompts,
    refuse_existing,
    seed,
)

CPU_QUANTIZED_NOTE = (
    "note: on the CPU, MLX's quantized matrix products slow down with every row, so prompt "
    "processing and speculative verify passes are many times slower than in float32; "
    "for speed here, convert with --dtype float32 and no -q (see docs/linux.md)"
)
CPU_HALF_NOTE = (
    "note: on the CPU, MLX's bfloat16 and float16 matrix products are about half as fast as "
    "its float32 ones; for speed here, convert with --dtype float32 (see docs/linux.md)"
)
# Accepted draft tokens, with --show-draft on a terminal.
DRAFT_COLOUR, RESET = "\033[32m", "\033[0m"
DEFAULT_PROMPT = (
    "translate English to German: The old bridge across the river was closed "
    "for repairs, so we took the ferry to the market."
)
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_TOKENS = 100


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Speculative decoding with T5 models in MLX.", epilog=FULL_FLOAT32_NOTE
    )
    add = parser.add_argument
    add("--model-name", default="t5-11b", help="main model: converted name or directory")
    add(
        "--draft-model-name",
        default="t5-small",
        help="draft model: converted name or directory; none: no draft model (needs --prompt-lookup)",
    )
    add(
        "--prompt",
        help=f"the input text; - reads it from standard input (default: {DEFAULT_PROMPT})",
    )
    add(
        "--prompts",
        metavar="FILE",
        help="decode every prompt of FILE, one a line (-: standard input); blank lines are "
        "skipped, so prompt i is the i-th non-blank line from 0; the texts go to standard "
        "output one line per prompt, in input order, a line break in a text written \\n "
        "(a carriage return \\r, a backslash \\\\)",
    )
    add(
        "--batch-size",
        type=POSITIVE,
        metavar="N",
        help=f"with --prompts: prompts decoded together (default: {DEFAULT_BATCH_SIZE})",
    )
    add(
        "--output",
        metavar="FILE",
        help="with --prompts: write the results to FILE (a new file; -: standard output) "
        "as JSON Lines "
        '({"index", "text", "tokens", "n_accepted", "n_draft", "seed"}), each line as soon as its '
        "prompt is done (so in completion order); nothing then goes to standard output",
    )
    add_drafting_options(parser, num_draft_default=5)
    add(
        "--max-tokens",
        "-m",
        type=POSITIVE,
        help="most tokens to generate; with --task, the task's max_length less one "
        f"(default: {DEFAULT_MAX_TOKENS})",
    )
    add(
        "--temp",
        type=checked(float, lambda t: t >= 0, ">= 0"),
        default=0.0,
        help="sampling temperature (0: greedy)",
    )
    add(
        "--top-p",
        type=checked(float, lambda p: 0 < p <= 1, "in (0, 1]"),
        default=1.0,
        help="nucleus mass, in (0, 1]",
    )
    add("--top-k", type=NON_NEGATIVE, default=0, help="sample among the k likeliest (0: all)")
    add(
        "--seed",
        type=seed,
        help="random seed for sampling, an integer in [0, 2**64) (default: drawn, and named "
        "in the summary)",
    )
    add("--regular-decode", action="store_true", help="decode with the main model alone")
    add_beam_options(parser)
    add(
        "--data-parallel",
        action="store_true",
        help="with --prompts, launched in a group (mlx.launch): each process holds both models "
        "whole and decodes a share of the prompts (default in a group: the main model split "
        "across the processes; see docs/distributed.md)",
    )
    add("--show-draft", action="store_true", help="colour accepted draft tokens on a terminal")
    return parser


def add_beam_options(parser: ArgumentParser) -> None:
    """--num-beams and the options of beam search, and --task."""
    add = parser.add_argument
    add(
        "--num-beams",
        type=POSITIVE,
        metavar="N",
        help="beam search with N beams, with the main model alone, as transformers' generate "
        "(default: 1, no beam search, or the --task's)",
    )
    add(
        "--num-return-sequences",
        type=POSITIVE,
        metavar="K",
        help="with --num-beams: the K best hypotheses (K <= N), each on a line, or with "
        "--output in each record's sequences, with its score (default: 1)",
    )
    add(
        "--length-penalty",
        type=float,
        help="with --num-beams: a finished hypothesis scores its summed log-probabilities "
        "over its length to this power (default: 1.0, or the --task's)",
    )
    add(
        "--early-stopping",
        type=early_stopping,
        metavar="{true,false,never}",
        help="with --num-beams: a prompt's search ends once N hypotheses finished (true), "
        "once its best beam cannot beat them at its length (false), or at any length "
        "(never) (default: false, or the --task's)",
    )
    add(
        "--no-repeat-ngram-size",
        type=NON_NEGATIVE,
        metavar="N",
        help="with --num-beams: no n-gram of N tokens occurs twice (0: off; default: 0, or "
        "the --task's)",
    )
    add(
        "--draft-levels",
        type=NON_NEGATIVE,
        metavar="G",
        help="with --num-beams and a draft model: speculative beam search, the draft's tree "
        "of G levels of 2N candidates checked per pass of the main model, the same output "
        "(default: 0, plain beam search; docs/how-it-works.md says where it pays)",
    )
    add(
        "--task",
        metavar="NAME",
        help="the model's settings for task NAME (its config's task_specific_params, e.g. "
        "summarization, translation_en_to_de): the prompts' prefix, beams and lengths, as "
        "transformers' pipelines apply them; a flag given wins",
    )


def early_stopping(text: str) -> bool | str:
    """An argparse type: --early-stopping's true, false or never."""
    values = {"true": True, "false": False, "never": "never"}
    if text.lower() not in values:
        raise argparse.ArgumentTypeError(f"{text!r} is not true, false or never")
    return values[text.lower()]


# The beam settings a task may give (transformers' names are the flags'),
# those that only beam search takes, and the defaults of all.
BEAM_SETTINGS = ("num_beams", "length_penalty", "early_stopping", "no_repeat_ngram_size")
BEAM_ONLY = (
    "num_return_sequences",
    "length_penalty",
    "early_stopping",
    "no_repeat_ngram_size",
    "draft_levels",
)
BEAM_DEFAULTS = {
    "num_beams": 1,
    "num_return_sequences": 1,
    "length_penalty": 1.0,
    "early_stopping": False,
    "no_repeat_ngram_size": 0,
    "draft_levels": 0,
}


def task_settings(config: dict, task: str) -> dict:
    """The settings of ``task`` in a converted model's ``config``; ``ValueError``
    naming the model's tasks if it has no such task."""
    tasks = config.get("task_specific_params") or {}
    if task not in tasks:
        known = ", ".join(sorted(tasks)) if tasks else "none"
        raise ValueError(f"--task {task}: the model has no such task (its tasks: {known})")
    return tasks[task]


def apply_task(args: argparse.Namespace, settings: dict) -> None:
    """Fill in from a task's ``settings`` the flags not given (beams, lengths),
    as transformers' pipelines do: its max_length and min_length count the
    decoder's start token."""
    for name in BEAM_SETTINGS:
        if getattr(args, name) is None and name in settings:
            setattr(args, name, settings[name])
    if args.max_tokens is None and "max_length" in settings:
        args.max_tokens = max(1, settings["max_length"] - 1)
    if "min_length" in settings:
        args.min_tokens = max(0, settings["min_length"] - 1)


def resolve_beams(args: argparse.Namespace) -> None:
    """Fill in the beam settings no flag or task gave, and refuse those that
    do not go together (``ValueError``: one line)."""
    for name, default in BEAM_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.max_tokens is None:
        args.max_tokens = DEFAULT_MAX_TOKENS
    if args.num_beams == 1:
        args.min_tokens = 0  # a task's, for its beams
        if args.beam_flags:
            flag = "--" + args.beam_flags[0].replace("_", "-")
            raise ValueError(f"{flag} goes with beam search: add --num-beams N (N > 1)")
    if args.num_return_sequences > args.num_beams:
        raise ValueError(
            f"--num-return-sequences {args.num_return_sequences} is more than the "
            f"{args.num_beams} beams (--num-beams)"
        )
    if args.num_beams > 1 and args.show_draft:
        raise ValueError("--show-draft colours draft tokens; beam search (--num-beams) has none")
    if args.num_beams > 1 and args.temp > 0:
        raise ValueError(
            "beam search (--num-beams > 1) does not sample: give --temp 0, or no --num-beams"
        )


def beam_options(args: argparse.Namespace) -> dict:
    """The keyword arguments of ``SpeculativeDecoder.beam_search_batch`` that ``args`` give."""
    return {
        "max_tokens": args.max_tokens,
        "num_beams": args.num_beams,
        "num_return_sequences": args.num_return_sequences,
        "length_penalty": args.length_penalty,
        "early_stopping": args.early_stopping,
        "no_repeat_ngram_size": args.no_repeat_ngram_size,
        "min_tokens": args.min_tokens or 0,
        "draft_levels": args.draft_levels,
    }


def drafting_summary(result, drafting: str, num_draft: int | str) -> str:
    """The drafting mode, the draft length and, with prompt lookup, how often it drafted."""
    line = f"Drafting: {drafting}, "
    lengths = result.draft_lengths
    if num_draft == "auto" and lengths:
        # Rounds where auto chose a plain step drafted nothing: say how many did draft.
        line += (
            f"g auto: {len(lengths)} of {result.n_steps} rounds drafted, "
            f"average {sum(lengths) / len(lengths):.1f}, range {min(lengths)}-{max(lengths)}"
        )
    elif num_draft == "auto":
        line += "g auto: no round drafted"
    else:
        line += f"g = {num_draft}"
    if drafting != "draft model":
        line += f"; prompt lookup drafted {result.n_lookup_rounds} of {result.n_steps} rounds"
    return line


def calibration_summary(seconds: float, num_draft: int | str) -> list[str]:
    """The line for auto's cost measurement, with ``--num-draft auto``: its
    time is kept out of the prompt and generation speeds. (With a fixed
    draft length the decoder still reports the microseconds of deciding not
    to measure.)"""
    if num_draft != "auto":
        return []
    return [f"Calibration: {seconds:.1f} s (auto's one-time cost measurement)"]


def print_summary(result, drafting: str, num_draft: int | str, sampled: bool = False) -> None:
    """The numbers of a run, in mlx-lm's layout (prompt and generation apart),
    on standard error: standard output is the generated text alone. A
    ``sampled`` run names its seed."""
    lines = [
        "=" * 40,
        f"Prompt: {result.prompt_tokens} tokens, {result.prompt_tokens_per_second:.1f} tokens/s",
        f"Generation: {len(result.tokens)} tokens, {result.tokens_per_second:.1f} tokens/s",
        f"Main-model passes: {result.n_steps}",
    ]
    print("\n".join(lines + summary_end(result, drafting, num_draft, sampled)), file=sys.stderr)


def summary_end(result, drafting: str, num_draft: int | str, sampled: bool) -> list[str]:
    """The summary's last lines: the seed when ``sampled``, acceptance and
    drafting when drafting, auto's calibration, peak memory."""
    import mlx.core as mx

    lines = [f"Seed: {result.seed}"] if sampled else []
    if drafting != "none":
        lines.append(
            f"Draft tokens accepted: {result.n_accepted}/{result.n_draft} "
            f"({100 * result.acceptance_rate:.1f}%)"
        )
        lines.append(drafting_summary(result, drafting, num_draft))
    lines += calibration_summary(result.calibration_time, num_draft)
    lines.append(f"Peak memory: {format_bytes(mx.get_peak_memory())}")
    return lines


def print_batch_summary(
    results: dict,
    num_prompts: int,
    wall_time: float,
    drafting: str,
    num_draft: int | str,
    seed: int | None = None,
) -> None:
    """The numbers of a --prompts run (``results``: each started prompt's
    latest result, by index), on standard error: throughput is generated
    tokens per second of wall time since loading; prompt processing is
    counted apart too. With ``seed``, the seed every prompt sampled with."""
    from speculative import GenerationResult

    started = list(results.values())
    total = GenerationResult(
        [token for result in started for token in result.tokens],
        n_draft=sum(result.n_draft for result in started),
        n_accepted=sum(result.n_accepted for result in started),
        n_steps=sum(result.n_steps for result in started),
        draft_lengths=[length for result in started for length in result.draft_lengths],
        n_lookup_rounds=sum(result.n_lookup_rounds for result in started),
        prompt_tokens=sum(result.prompt_tokens for result in started),
        prompt_time=sum(result.prompt_time for result in started),
        # Measured once, before the first batch; its rows each carry it.
        calibration_time=max((result.calibration_time for result in started), default=0.0),
        seed=seed or 0,
    )
    finished = sum(result.finished for result in started)
    generated = len(total.tokens)
    # As in the single-prompt summary, auto's one-time calibration is not generation.
    decoding_time = wall_time - total.calibration_time
    throughput = generated / decoding_time if decoding_time > 0 else 0.0
    lines = [
        "=" * 40,
        f"Prompts: {finished} of {num_prompts} finished",
        f"Prompt processing: {total.prompt_tokens} tokens, {total.prompt_tokens_per_second:.1f} "
        + "tokens/s",
        f"Generation: {generated} tokens, {throughput:.1f} tokens/s "
        + f"({decoding_time:.1f} s of wall time after loading)",
        f"Main-model passes: {total.n_steps} (counted per prompt)",
    ]
    sampled = seed is not None
    print("\n".join(lines + summary_end(total, drafting, num_draft, sampled)), file=sys.stderr)


def new_text(result, tokenizer, printed: str, num_printed: int, show_draft: bool) -> str:
    """The text of ``result`` after ``printed`` (its first ``num_printed``
    tokens); with ``show_draft``, the accepted draft tokens that start it,
    coloured."""
    text = result.text[len(printed) :]
    if not show_draft or not any(result.from_draft[num_printed : num_printed + 1]):
        return text
    drafted = result.from_draft[num_printed:] + [False]
    draft_end = num_printed + drafted.index(False)
    boundary = len(tokenizer.decode(result.tokens[:draft_end], skip_special_tokens=True))
    boundary -= len(printed)
    return f"{DRAFT_COLOUR}{text[:boundary]}{RESET}{text[boundary:]}"


def stop_at_once(signum: int, frame) -> None:
    """Ctrl-C before generation (or after it): end the run at once, with a
    note. The KeyboardInterrupt Python would raise can land in an object's
    ``__del__`` while modules import, where Python prints a traceback and
    carries on."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def run(args: argparse.Namespace) -> int:
    """Generate as ``args`` say, alone or as one process of a group that
    ``mlx.launch`` started (see distributed.py); the exit status (130:
    interrupted)."""
    from distributed import failures_end_group, init_group, silence_other_ranks

    group = init_group()
    silence_other_ranks(group)
    with failures_end_group(group):
        return generate(args, group)


def generate(args: argparse.Namespace, group) -> int:
    """``run``'s work, in ``group`` (None: alone): the main model split
    across it, or with --data-parallel the prompts spread over it."""
    if group is not None and group.rank() != 0:
        args.output = None  # rank 0 writes; the others' standard output goes nowhere
    if args.output is not None:
        refuse_existing(args.output)
    if args.prompts is None:
        prompts = [read_prompt(args.prompt)]
    else:
        prompts = read_prompts(args.prompts)
    # mlx, transformers and the models load only once the arguments are known good.
    # cpu first: on Linux it loads an optimized BLAS, which MLX uses only if loaded before it.
    import cpu  # noqa: F401  # isort: skip
    import mlx.core as mx

    from distributed import rank_zero_seed
    from layout import read_config
    from loading import load_checked, load_tokenizer, model_paths, resolve_model
    from sampling import draw_seed

    if args.task is not None:
        settings = task_settings(read_config(resolve_model(args.model_name)), args.task)
        apply_task(args, settings)
        prompts = [settings.get("prefix", "") + prompt for prompt in prompts]
    resolve_beams(args)
    if args.num_beams > 1:
        if group is not None or args.data_parallel:
            raise ValueError(
                "beam search runs in one process: not with --data-parallel nor in a group "
                "(mlx.launch)"
            )
        if args.draft_levels and draft_model_name(args) is None:
            raise ValueError("--draft-levels drafts with a draft model: give --draft-model-name")
        if args.draft_levels and args.prompt_lookup:
            raise ValueError(
                "--prompt-lookup: speculative beam search (--draft-levels) drafts with the "
                "draft model alone"
            )
        if not args.draft_levels:
            if draft_model_name(args) is not None or (
                args.prompt_lookup and not args.regular_decode
            ):
                print(
                    "note: beam search (--num-beams > 1) runs with the main model alone "
                    "(no draft model, no prompt lookup) unless --draft-levels G is given",
                    file=sys.stderr,
                )
            args.regular_decode = True

    if args.seed is None:  # drawn, so that the summary can name it
        args.seed = draw_seed() if group is None else rank_zero_seed(draw_seed(), group)

    paths = model_paths(args.model_name, draft_model_name(args))
    tokenizer = load_tokenizer(paths[0])
    longest = max(map(len, tokenizer(prompts).input_ids))
    batch_size = min(args.batch_size, len(prompts)) if args.prompts is not None else 1
    if args.data_parallel and group is None:
        print(
            "note: --data-parallel: this process was not started in a group (mlx.launch), "
            "so it decodes every prompt itself",
            file=sys.stderr,
        )
    decoder = load_checked(
        args.model_name,
        paths,
        prompt_tokens=longest,
        # A speculative beam pass holds each beam's tree past its positions.
        max_tokens=args.max_tokens + 2 * args.num_beams * args.draft_levels,
        batch_size=batch_size * args.num_beams,
        group=None if args.data_parallel else group,  # the main model split across it
        tokenizer=tokenizer,
        num_draft=args.num_draft,
        delta=args.delta,
        prompt_lookup=0 if args.regular_decode else args.prompt_lookup,
    )
    models = [decoder.model] + ([decoder.draft_model] if decoder.draft_model else [])
    if mx.default_device() == mx.cpu:
        if any(model.args.quantization for model in models):
            print(CPU_QUANTIZED_NOTE, file=sys.stderr)
        elif any(model.dtype != mx.float32 for model in models):
            print(CPU_HALF_NOTE, file=sys.stderr)
    if args.prompts is None:
        return generate_one(args, decoder, prompts[0], group)
    return generate_all(args, decoder, prompts, group)


def draft_model_name(args: argparse.Namespace) -> str | None:
    """The draft model ``args`` ask for; None for none."""
    if args.regular_decode or args.draft_model_name == "none":
        return None
    return args.draft_model_name


def options_of(args: argparse.Namespace):
    """The ``speculative.Options`` that ``args`` give."""
    from speculative import Options

    return Options(args.max_tokens, args.temp, args.top_p, args.top_k, args.seed)


# A bar for prompt processing appears only once it has taken this many seconds.
PROMPT_BAR_DELAY = 0.5


def terminal_width() -> int | None:
    """Columns for a bar on standard error, two short of the terminal: the
    "^C" a terminal echoes on Ctrl-C then fits on the bar's line, instead of
    wrapping it onto a second line where the bar's last frame is drawn
    again. None when standard error is not a terminal."""
    if not sys.stderr.isatty():
        return None
    return os.get_terminal_size(sys.stderr.fileno()).columns - 2


class PromptProgress:
    """The ``prompt_progress`` of ``stream`` and ``stream_batch``: on a
    terminal, a bar of encoder layers computed, with elapsed and remaining
    time, shown once encoding has taken ``PROMPT_BAR_DELAY`` seconds and
    cleared when it ends; nothing otherwise."""

    def __init__(self, label: str, position: int = 0):
        self.label, self.position = label, position
        self.bar = None

    def __call__(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if done == 0:
            self.close()
            self.bar = tqdm(
                total=total,
                desc=self.label,
                unit="layer",
                file=sys.stderr,
                disable=terminal_width() is None,
                ncols=terminal_width(),
                delay=PROMPT_BAR_DELAY,
                leave=False,
                position=self.position,
                bar_format="{desc}: {n}/{total} {unit} [{elapsed}<{remaining}]",
            )
            return
        self.bar.update(done - self.bar.n)
        if done == total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def generate_one(args: argparse.Namespace, decoder, prompt: str, group=None) -> int:
    """Stream the text for ``prompt`` to standard output, then the summary to
    standard error; the exit status (130: interrupted). ``group``: the
    processes the main model is split across, or None."""
    if args.num_beams > 1:
        return beam_search_one(args, decoder, prompt)
    # Colour codes only for a terminal: redirected output stays plain text.
    show_draft = args.show_draft and sys.stdout.isatty()

    printed, num_printed = "", 0
    result = None
    stopped = None
    progress = PromptProgress("processing the prompt")
    try:
        # While generating, Ctrl-C stops it: the text so far and its summary are kept.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        stream = decoder.stream(
            prompt,
            options=options_of(args),
            speculative=not args.regular_decode,
            prompt_progress=progress,
        )
        for result in stream:
            if result.text.startswith(printed):
                text = new_text(result, decoder.tokenizer, printed, num_printed, show_draft)
                print(text, end="", flush=True)
                printed, num_printed = result.text, len(result.tokens)
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - see stopping
        stopped = stopping(error, group)
    finally:
        progress.close()
        signal.signal(signal.SIGINT, stop_at_once)
    if result is not None or stopped is None:
        print()
    say_interrupted(stopped)
    if result is not None:
        print_summary(result, decoder.drafting, args.num_draft, sampled=args.temp > 0)
    return exit_status(stopped)


def beam_search_one(args: argparse.Namespace, decoder, prompt: str) -> int:
    """Beam search for ``prompt``: its best hypotheses' texts to standard
    output, a line each (``cli.one_line``) if more than one, then the summary."""
    from cli import one_line

    try:  # Ctrl-C stops the search: there is no text before it ends
        signal.signal(signal.SIGINT, signal.default_int_handler)
        [(_, result)] = decoder.beam_search_batch([prompt], batch_size=1, **beam_options(args))
    except KeyboardInterrupt as stopped:
        say_interrupted(stopped)
        return 130
    finally:
        signal.signal(signal.SIGINT, stop_at_once)
    texts = result.texts
    print("\n".join(map(one_line, texts)) if len(texts) > 1 else texts[0])
    print_summary(result, "none", args.num_draft)
    return 0


def stopping(error: BaseException, group) -> BaseException:
    """``error``, which stopped generation, if the run still writes its
    summary: Ctrl-C, or in a ``group`` (None: alone) SIGTERM or any failure
    (another rank's, found at a sum); else raised again at once."""
    if isinstance(error, KeyboardInterrupt) or group is not None:
        return error
    raise error


def say_interrupted(stopped: BaseException | None) -> None:
    """Say "interrupted" before the summary when Ctrl-C ``stopped`` the run."""
    if type(stopped) is KeyboardInterrupt:
        print("interrupted", file=sys.stderr)


def exit_status(stopped: BaseException | None) -> int:
    """The exit status of a run that ``stopped`` ended early (None: it did
    not), once its summary is written: 130 after Ctrl-C; in a group,
    ``stopped`` raised again, for ``distributed.failures_end_group`` to end
    the process with its one line after the summary."""
    if stopped is None:
        return 0
    if type(stopped) is not KeyboardInterrupt:
        raise stopped
    return 130


def generate_all(args: argparse.Namespace, decoder, prompts: list[str], group=None) -> int:
    """Decode ``prompts`` in batches: each finished text to standard output
    (one line each, in input order) or to the --output file (JSON Lines, as
    they finish), a progress bar on standard error if it is a terminal, then
    the summary; the exit status (130: interrupted). ``group``: the
    processes the main model is split across or, with --data-parallel, that
    share the prompts (``data_parallel.data_parallel_stream``); None alone."""
    from tqdm import tqdm

    from data_parallel import data_parallel_stream

    results = {}
    stopped = None
    with open_output(args.output) as file:
        sink = InOrderLines(file) if args.output is None else JsonLines(file)
        if args.num_draft == "auto" and decoder.drafting != "none":
            print("calibrating the draft length (auto)...", file=sys.stderr, flush=True)
        width = terminal_width()
        bar = tqdm(
            total=len(prompts), unit="prompt", file=sys.stderr, disable=width is None, ncols=width
        )
        progress = PromptProgress("processing prompts", position=1)
        start = time.perf_counter()
        try:
            # Ctrl-C stops the run: what finished is written already, the summary follows.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            how = {
                "speculative": not args.regular_decode,
                "batch_size": args.batch_size,
                "prompt_progress": progress,
            }
            if args.num_beams > 1:
                events = decoder.beam_search_batch(
                    prompts, batch_size=args.batch_size, **beam_options(args)
                )
            elif args.data_parallel and group is not None:
                events = data_parallel_stream(decoder, prompts, options_of(args), group, **how)
            else:
                events = decoder.stream_batch(prompts, options=options_of(args), **how)
            for index, result in events:
                results[index] = result
                if result.finished:
                    # The bar is cleared while a line goes to the same terminal.
                    with tqdm.external_write_mode(file=file):
                        sink.add(index, result)
                    bar.update()
        except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - see stopping
            stopped = stopping(error, group)
        finally:
            signal.signal(signal.SIGINT, stop_at_once)
            progress.close()
            bar.close()
    wall_time = time.perf_counter() - start
    say_interrupted(stopped)
    if sink.waiting:
        held = len(sink.waiting)
        print(
            "note: standard output, in input order, stops before the first unfinished prompt: "
            f"{held} finished after it {'is' if held == 1 else 'are'} not written "
            "(--output FILE keeps every finished prompt)",
            file=sys.stderr,
        )
    seed = args.seed if args.temp > 0 else None
    print_batch_summary(results, len(prompts), wall_time, decoder.drafting, args.num_draft, seed)
    return exit_status(stopped)


def main(argv: list[str] | None = None) -> int:
    previous_handler = signal.signal(signal.SIGINT, stop_at_once)
    quiet_transformers()
    full_float32()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        check_arguments(parser, args)
        return run(args)
    except BrokenPipeError:
        # The reader of standard output left (as `| head` does): stop quietly,
        # as command-line tools do, with the status a shell gives them (128 +
        # SIGPIPE); what Python still holds for standard output goes nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (ValueError, OSError, MemoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous_handler)


def check_arguments(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (``parser.error``) arguments that do not go together; fill in
    the defaults that depend on --prompts."""
    # What no flag or task gives is filled in once the task is read (resolve_beams).
    args.beam_flags = [name for name in BEAM_ONLY if getattr(args, name) is not None]
    args.min_tokens = 0
    beams = args.task is not None or (args.num_beams is not None and args.num_beams > 1)
    if (
        args.draft_model_name == "none"
        and not args.prompt_lookup
        and not args.regular_decode
        and not beams
    ):
        parser.error(
            "--draft-model-name none leaves nothing to draft with: add --prompt-lookup N "
            "(N >= 1), or use --regular-decode"
        )
    if args.prompts is None:
        for option, value in (
            ("--batch-size", args.batch_size),
            ("--output", args.output),
            ("--data-parallel", args.data_parallel or None),
        ):
            if value is not None:
                parser.error(f"{option} goes with --prompts FILE (a file of prompts)")
        if args.prompt is None:
            args.prompt = DEFAULT_PROMPT
        return
    if args.prompt is not None:
        parser.error("--prompt and --prompts: give one of them")
    if args.show_draft:
        parser.error("--show-draft colours one prompt's text; it does not go with --prompts")
    if args.batch_size is None:
        args.batch_size = DEFAULT_BATCH_SIZE


if __name__ == "__main__":
    sys.exit(main())
