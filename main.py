"""Generate text with a T5 model, speculatively, from models converted by convert.py.

python main.py                                   # t5-11b with a t5-small draft
python main.py --prompt "summarize: ..." --num-draft 3 --delta 0.1
python main.py --regular-decode                  # the main model alone
python main.py --draft-model-name none --prompt-lookup 3 --num-draft auto --show-draft

Standard output is the generated text alone; everything else (Loading lines,
notes, the summary) goes to standard error, so the text can be piped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from pathlib import Path

from cli import (
    NON_NEGATIVE,
    POSITIVE,
    SEED,
    ArgumentParser,
    checked,
    format_bytes,
    num_draft,
    quiet_transformers,
    read_prompt,
    resolve_model,
)

# What check_memory proposes when the models do not fit: convert.py -q's default.
FOUR_BIT = {"group_size": 64, "bits": 4, "mode": "affine"}
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


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description="Speculative decoding with T5 models in MLX.")
    add = parser.add_argument
    add("--model-name", default="t5-11b", help="main model: converted name or directory")
    add(
        "--draft-model-name",
        default="t5-small",
        help="draft model: converted name or directory; none: no draft model (needs --prompt-lookup)",
    )
    add("--prompt", default=DEFAULT_PROMPT, help="the input text; - reads it from standard input")
    add(
        "--num-draft",
        type=num_draft,
        default=5,
        help="draft tokens per main-model pass, or auto: chosen before every round",
    )
    add(
        "--prompt-lookup",
        type=NON_NEGATIVE,
        default=0,
        help="draft from n-grams up to N tokens long found in the prompt or output (0: off)",
    )
    add(
        "--delta",
        type=checked(float, lambda d: 0 <= d <= 1, "in [0, 1]"),
        default=0.0,
        help="acceptance relaxation in [0, 1]: 0 is exact, 1 accepts every draft token",
    )
    add("--max-tokens", "-m", type=POSITIVE, default=100, help="most tokens to generate")
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
        help="nucleus mass",
    )
    add("--top-k", type=NON_NEGATIVE, default=0, help="sample among the k likeliest (0: all)")
    add("--seed", type=SEED, default=0, help="random seed for sampling")
    add("--regular-decode", action="store_true", help="decode with the main model alone")
    add("--show-draft", action="store_true", help="colour accepted draft tokens on a terminal")
    return parser


def drafting_summary(result, drafting: str, num_draft: int | str) -> str:
    """The drafting mode, the draft length and, with prompt lookup, how often it drafted."""
    line = f"Drafting: {drafting}, "
    lengths = result.draft_lengths
    if num_draft == "auto" and lengths:
        line += f"g auto: average {sum(lengths) / len(lengths):.1f}, range {min(lengths)}-{max(lengths)}"
    elif num_draft == "auto":
        line += "g auto: no round drafted"
    else:
        line += f"g = {num_draft}"
    if drafting != "draft model":
        line += f"; prompt lookup drafted {result.n_lookup_rounds} of {result.n_steps} rounds"
    return line


def print_summary(result, drafting: str, num_draft: int | str) -> None:
    """The numbers of a run, in mlx-lm's layout (prompt and generation apart),
    on standard error: standard output is the generated text alone."""
    import mlx.core as mx

    lines = [
        "=" * 40,
        f"Prompt: {result.prompt_tokens} tokens, {result.prompt_tokens_per_second:.1f} tokens/s",
        f"Generation: {len(result.tokens)} tokens, {result.tokens_per_second:.1f} tokens/s",
        f"Main-model passes: {result.n_steps}",
    ]
    if drafting != "none":
        lines.append(
            f"Draft tokens accepted: {result.n_accepted}/{result.n_draft} "
            f"({100 * result.acceptance_rate:.1f}%)"
        )
        lines.append(drafting_summary(result, drafting, num_draft))
    lines.append(f"Peak memory: {format_bytes(mx.get_peak_memory())}")
    print("\n".join(lines), file=sys.stderr)


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


def available_memory() -> int:
    """Bytes MLX can use: the recommended working set on Apple silicon, else
    the physical memory."""
    import mlx.core as mx

    info = mx.device_info()
    if "max_recommended_working_set_size" in info:
        return info["max_recommended_working_set_size"]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def runtime_bytes(path: Path, prompt_tokens: int, max_tokens: int) -> int:
    """An estimate of what a converted model needs besides its weights: the
    decoder's self- and cross-attention caches and the encoder's activations
    for a prompt of ``prompt_tokens``."""
    from decoder import MAX_AUTO_DRAFT
    from model import KVCache, load_config

    args = load_config(path)
    config = json.loads((path / "config.json").read_text())
    value_bytes = 2 if config.get("dtype", "float32") in ("bfloat16", "float16") else 4
    inner = args.num_heads * args.d_kv
    decoded = KVCache.step * math.ceil((max_tokens + MAX_AUTO_DRAFT + 1) / KVCache.step)
    cache = 2 * args.num_decoder_layers * (prompt_tokens + decoded) * inner
    activations = prompt_tokens * (2 * args.d_ff + 4 * inner + args.num_heads * prompt_tokens)
    return (cache + activations) * value_bytes


def check_memory(model_name: str, paths: list[Path], prompt_tokens: int, max_tokens: int) -> None:
    """Raise ``MemoryError``, saying what would fit, when the models at
    ``paths`` (the main model's directory, then the draft's, if any) would not
    fit in memory together."""
    import mlx.core as mx

    from model import load_config, parameter_bytes

    weights = [(path / "weights.npz").stat().st_size for path in paths]
    runtime = [runtime_bytes(path, prompt_tokens, max_tokens) for path in paths]
    needed, available = sum(weights) + sum(runtime), available_memory()
    if needed <= available:
        return
    message = (
        f"{' and '.join(map(str, paths))} need about {format_bytes(needed)}, "
        f"more than the {format_bytes(available)} this machine has for MLX"
    )
    main_args = load_config(paths[0])
    if main_args.quantization is None:
        four_bit = parameter_bytes(main_args, mx.bfloat16, FOUR_BIT)
        message += f"; with 4-bit weights the main model needs {format_bytes(four_bit)}"
        if needed - weights[0] + four_bit <= available:
            source = "<its checkpoint>" if Path(model_name).is_dir() else model_name
            message += f", which fits: python convert.py --model {source} -q"
        else:
            message += ", still too much"
    elif len(paths) > 1 and weights[0] + runtime[0] <= available:
        message += "; the main model alone fits: --draft-model-name none --prompt-lookup 3"
    raise MemoryError(message)


def stop_at_once(signum: int, frame) -> None:
    """Ctrl-C before generation (or after it): end the run at once, with a
    note. The KeyboardInterrupt Python would raise can land in an object's
    ``__del__`` while modules import, where Python prints a traceback and
    carries on."""
    print("interrupted", file=sys.stderr, flush=True)
    os._exit(130)


def run(args: argparse.Namespace) -> int:
    """Generate as ``args`` say; the exit status (130: interrupted)."""
    prompt = read_prompt(args.prompt)
    # mlx, transformers and the models load only once the arguments are known good.
    # blas first: on Linux it loads an optimized BLAS, which MLX uses only if loaded before it.
    import blas  # noqa: F401  # isort: skip
    import mlx.core as mx

    from decoder import SpeculativeDecoder, check_draft_directories, load_tokenizer
    from model import load_model

    paths = [resolve_model(args.model_name)]
    if not args.regular_decode and args.draft_model_name != "none":
        paths.append(resolve_model(args.draft_model_name))
        check_draft_directories(*paths)
    tokenizer = load_tokenizer(paths[0])
    check_memory(args.model_name, paths, len(tokenizer(prompt).input_ids), args.max_tokens)
    models = []
    for path, role in zip(paths, ("", "draft ")):
        print(f"Loading {role}{path}", file=sys.stderr)
        models.append(load_model(path))
    if mx.default_device() == mx.cpu:
        if any(model.args.quantization for model in models):
            print(CPU_QUANTIZED_NOTE, file=sys.stderr)
        elif any(model.dtype != mx.float32 for model in models):
            print(CPU_HALF_NOTE, file=sys.stderr)
    decoder = SpeculativeDecoder(
        models[0],
        models[1] if len(models) > 1 else None,
        tokenizer,
        args.num_draft,
        args.delta,
        0 if args.regular_decode else args.prompt_lookup,
    )
    # Colour codes only for a terminal: redirected output stays plain text.
    show_draft = args.show_draft and sys.stdout.isatty()

    printed, num_printed = "", 0
    result = None
    interrupted = False
    try:
        # While generating, Ctrl-C stops it: the text so far and its summary are kept.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for result in decoder.stream(
            prompt,
            speculative=not args.regular_decode,
            max_tokens=args.max_tokens,
            temp=args.temp,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
        ):
            if result.text.startswith(printed):
                text = new_text(result, decoder.tokenizer, printed, num_printed, show_draft)
                print(text, end="", flush=True)
                printed, num_printed = result.text, len(result.tokens)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, stop_at_once)
    print()
    if interrupted:
        print("interrupted", file=sys.stderr)
    if result is not None:
        print_summary(result, decoder.drafting, args.num_draft)
    return 130 if interrupted else 0


def main(argv: list[str] | None = None) -> int:
    previous_handler = signal.signal(signal.SIGINT, stop_at_once)
    quiet_transformers()
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        if args.draft_model_name == "none" and not args.prompt_lookup and not args.regular_decode:
            parser.error(
                "--draft-model-name none leaves nothing to draft with: add --prompt-lookup N "
                "(N >= 1), or use --regular-decode"
            )
        return run(args)
    except (ValueError, OSError, MemoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous_handler)


if __name__ == "__main__":
    sys.exit(main())
