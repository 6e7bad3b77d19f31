"""Measure speculative decoding against regular decoding, and against the paper's prediction.

    python benchmarks/benchmark.py --model-name MAIN --draft-model-name DRAFT \\
        [--num-draft 1,2,3,5,8,auto] [--prompt-lookup N [--lookup-num-draft auto]] \\
        [--delta 0,0.1,0.5] [--temp 0,1] [--max-tokens 64] [--repeats R] \\
        [--prompts FILE] [--output benchmark_results] [--compare-hf --hf-model DIR --hf-draft DIR [--hf-threads N]]
    python benchmarks/benchmark.py --model-name MAIN --draft-model-name DRAFT \\
        --batch-sizes 1,2,4,8,16,32 [--num-beams N] [...]: the batch benchmark (batch.py describes it)

Without ``--batch-sizes``, prompts are decoded one at a time. The modes: the
draft model with each ``--num-draft`` value (``auto`` included) and, with
``--prompt-lookup N``, prompt lookup alone (no draft model) and hybrid
(lookup, then the draft model) with each ``--lookup-num-draft`` value. For
every temperature, each prompt is decoded regularly and then in every mode
and delta, in turn, prompt after prompt (``--repeats`` times), so that drift
in machine speed affects all alike.
Reported per mode and delta:

- generation tokens/s of regular and speculative decoding (prompt
  processing excluded: it is reported apart), and the speedup;
- alpha, the acceptance rate of the draft tokens the main model actually
  tested: accepted / (accepted + rejected). A round stops at its first
  rejection; the draft tokens after it were never tested and do not count;
- tokens per main-model pass, draft tokens per drafted round (mean g) and
  the share of rounds drafted by prompt lookup;
- c, the measured time of one draft step over one main step;
- for the draft model with a fixed g, the speedup the paper predicts from
  alpha and c, (1 - alpha^(g+1)) / ((1 - alpha)(g c + 1)); the verify-aware
  prediction, with the measured cost v(g+1) of a main pass over g + 1 tokens
  (in one-token passes) in place of the paper's 1; the loop's efficiency,
  measured / verify-aware prediction; and the per-pass efficiency, measured
  / (tokens per pass / (g c + v(g+1))), which takes the tokens per pass as
  measured instead of from alpha (acceptance is not independent from token
  to token), so it shows what the rounds cost against what c and v predict;
- the share of the bandwidth bound reached: tokens/s over the single-token
  steps per second that the machine's memory bandwidth allows the main model.

Before the table: the memory bandwidth (a large array copy), the bytes of
weights a main-model decoder step reads, that bound, regular decoding's share
of it, prompt processing tokens/s, and v(k) for k = 1 .. 17.

At temperature 0 it also checks that the speculative tokens equal the regular
ones. Results go to a table, OUTPUT.csv, OUTPUT.json and, when matplotlib is
installed, OUTPUT.png (speedup against num_draft, one line per delta).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# The example's modules live one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Full float32 on every backend (the benchmark checks outputs for
# identity), then an optimized BLAS on Linux: both before anything imports mlx.
from cli import full_float32  # isort: skip

full_float32()
from cpu import blas  # isort: skip
from batch import peer_threads, run_batches, validate_batches
from limits import decoder_step_bytes, memory_bandwidth
from reporting import format_table, pyplot, save_with_legend_below, write_tables
from workers import Worker

from auto import MAX_AUTO_DRAFT, expected_tokens_per_round, pass_times
from cli import POSITIVE, ArgumentParser, num_draft

PROMPTS = [
    "translate English to German: The museum opens at nine and closes early on Sundays.",
    "translate English to French: My sister bought fresh bread at the bakery this morning.",
    "translate English to German: We will meet at the station after the meeting.",
    (
        "summarize: The city council met on Tuesday to discuss the new bridge. After a long "
        "debate about costs and traffic, the members agreed to start construction next spring."
    ),
    (
        "summarize: Heavy rain fell across the region for three days. Several roads were closed, "
        "and farmers said the water would help their crops after a dry summer."
    ),
    (
        "question: What is the capital of France? context: Paris is the capital and largest "
        "city of France, on the river Seine."
    ),
    (
        "question: When was the library built? context: The old library was built in 1885 "
        "and restored in 1990 after a fire."
    ),
]


@dataclass(frozen=True)
class Mode:
    """One way to draft: ``drafting`` is "draft model", "prompt lookup" or "hybrid"."""

    drafting: str
    num_draft: int | str
    delta: float


@dataclass
class Row:
    """The measurements of one mode at one temperature, summed over all prompts."""

    temp: float
    delta: float
    drafting: str
    num_draft: int | str
    regular_tokens_per_s: float  # generation only, as every tokens/s here
    speculative_tokens_per_s: float
    speedup: float
    bound_share: float  # speculative tokens/s over the main model's bandwidth bound
    alpha: float
    tokens_per_pass: float
    mean_draft: float  # draft tokens per drafted round
    lookup_rounds: float  # share of rounds drafted by prompt lookup
    cost_ratio: float
    predicted_speedup: float | None  # the draft model with a fixed g only
    efficiency: float | None
    verify_cost: float | None  # v(g + 1)
    verify_aware_speedup: float | None
    loop_efficiency: float | None  # measured / verify-aware prediction
    pass_efficiency: float | None  # measured / (tokens per pass / (g c + v(g + 1)))
    identical: bool | None  # temperature 0 only


def predicted_speedup(
    alpha: float, num_draft: int, cost_ratio: float, verify_cost: float = 1.0
) -> float:
    """Leviathan et al., eq. 1: expected walltime improvement. The paper takes
    a main pass over g + 1 tokens to cost as much as one over a single token
    (``verify_cost`` 1); pass the measured v(g + 1) for the verify-aware form."""
    return expected_tokens_per_round(alpha, num_draft) / (num_draft * cost_ratio + verify_cost)


def step_time(model, prompt_ids, steps: int = 24) -> float:
    """Seconds per single-token decoder step of ``model`` with a warm cache."""
    import mlx.core as mx

    cache = model.make_cache(model.encode(prompt_ids))
    token = mx.array([[model.args.decoder_start_token_id]])
    mx.eval(model.decode(token, cache))  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        logits = model.decode(token, cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    return (time.perf_counter() - start) / steps


def measure_machine(model, draft_model, prompt_ids) -> dict:
    """The memory bandwidth, the bytes a decoder step of each model reads, the
    main model's bound in single-token steps per second, and v(k)."""
    bandwidth = memory_bandwidth()
    step_bytes = decoder_step_bytes(model)
    # k = 1 .. MAX_AUTO_DRAFT + 1 tokens: the verify passes of g = 0 .. 16.
    times = pass_times(model, model.encode(prompt_ids), MAX_AUTO_DRAFT + 1, repeats=9)
    return {
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "main_step_gb": step_bytes / 1e9,
        "draft_step_gb": decoder_step_bytes(draft_model) / 1e9,
        "bound_tokens_per_s": bandwidth / step_bytes,
        "verify_costs": [t / times[0] for t in times],
    }


def describe_machine(machine: dict) -> str:
    """The lines printed before the table."""
    lines = [
        (
            f"memory bandwidth {machine['bandwidth_gb_per_s']:.1f} GB/s; a decoder step reads "
            f"{machine['main_step_gb']:.3f} GB (main), {machine['draft_step_gb']:.3f} GB "
            f"(draft): at most {machine['bound_tokens_per_s']:.1f} main-model steps/s"
        ),
        "v(k), a main pass over k tokens in one-token passes: "
        + ", ".join(f"{k}: {v:.2f}" for k, v in enumerate(machine["verify_costs"], 1)),
    ]
    for name, regular in machine["regular"].items():
        lines.append(
            f"regular decoding at {name}: {regular['tokens_per_s']:.1f} tokens/s, "
            f"{regular['bound_share']:.0%} of the bound; prompt processing "
            f"{regular['prompt_tokens_per_s']:.0f} tokens/s "
            f"(prompts of {regular['mean_prompt_tokens']:.0f} tokens on average)"
        )
    return "\n".join(lines)


def parse_list(kind, name: str | None = None):
    def parse(text: str) -> list:
        try:
            return [kind(item.strip()) for item in text.split(",") if item.strip()]
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a list of {name or kind.__name__}"
            ) from None

    return parse


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--model-name", required=True, help="main model: converted name or directory")
    add("--draft-model-name", required=True, help="draft model: converted name or directory")
    draft_lengths = parse_list(num_draft, "integers >= 1 or auto")
    add("--num-draft", type=draft_lengths, default=[1, 2, 3, 5, 8], help="e.g. 1,2,3,5,8,auto")
    add("--prompt-lookup", type=int, default=0, help="also prompt lookup and hybrid (0: not)")
    add(
        "--lookup-num-draft",
        type=draft_lengths,
        default=["auto"],
        help="num_draft of prompt lookup and hybrid, e.g. 3,auto",
    )
    add("--repeats", type=int, default=1, help="decode every prompt this many times per mode")
    add("--delta", type=parse_list(float), default=[0.0], help="e.g. 0,0.1,0.5")
    add("--temp", type=parse_list(float), default=[0.0, 1.0], help="e.g. 0,1")
    add("--max-tokens", type=int, default=64, help="tokens per prompt")
    add("--prompts", type=Path, help="a file with one prompt per line (default: built-in)")
    add("--seed", type=int, default=0, help="random seed for sampling")
    add("--output", type=Path, default=Path("benchmark_results"), help="prefix of output files")
    add("--compare-hf", action="store_true", help="also time transformers (needs torch)")
    add("--hf-model", type=Path, help="Hugging Face checkpoint of the main model")
    add("--hf-draft", type=Path, help="Hugging Face checkpoint of the draft model")
    add(
        "--hf-threads",
        type=int,
        help="torch (and CTranslate2) threads (default: as many as the BLAS MLX uses, "
        "else the peer's default)",
    )
    add(
        "--batch-sizes",
        type=parse_list(POSITIVE, "integers >= 1"),
        help="the batch benchmark (batch.py): throughput at each batch size, e.g. 1,2,4,8,16,32",
    )
    add(
        "--compare-ct2",
        action="store_true",
        help="with --batch-sizes: also CTranslate2 float32 and int8 on --hf-model",
    )
    add(
        "--num-beams",
        type=POSITIVE,
        default=1,
        help="with --batch-sizes: beam search with N beams instead, ours and the peers' "
        "(transformers' num_beams, CTranslate2 float32's beam_size)",
    )
    add(
        "--draft-levels",
        type=parse_list(POSITIVE, "integers >= 1"),
        default=[],
        help="with --num-beams: also speculative beam search with a draft tree of each "
        "number of levels, e.g. 1,2,3,4",
    )
    add(
        "--ct2-cache",
        type=Path,
        help="where CTranslate2's copies of --hf-model are kept (default: ctranslate2-models "
        "beside --output)",
    )
    return parser


def validate(args: argparse.Namespace) -> None:
    if not args.num_draft or not args.lookup_num_draft:
        raise ValueError("--num-draft and --lookup-num-draft need at least one value")
    if args.prompt_lookup < 0:
        raise ValueError("--prompt-lookup must be >= 0")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if not args.delta or not all(0 <= d <= 1 for d in args.delta):
        raise ValueError("--delta values must be in [0, 1]")
    if not args.temp or min(args.temp) < 0:
        raise ValueError("--temp values must be >= 0")
    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.hf_threads is not None and args.hf_threads < 1:
        raise ValueError("--hf-threads must be >= 1")
    # Found out now, not after the whole run.
    output_dir = args.output.parent
    if output_dir.exists() and not os.access(output_dir, os.W_OK):
        raise ValueError(f"cannot write results to {output_dir}")
    if args.batch_sizes or args.compare_ct2:
        validate_batches(args)
    elif args.compare_hf:
        if all(g == "auto" for g in args.num_draft):
            raise ValueError("--compare-hf needs a --num-draft value other than auto")
        for flag, path in (("--hf-model", args.hf_model), ("--hf-draft", args.hf_draft)):
            if path is None or not (path / "config.json").is_file():
                raise ValueError(f"--compare-hf needs {flag}, a Hugging Face checkpoint directory")


def read_prompts(path: Path | None) -> list[str]:
    if path is None:
        return PROMPTS
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def modes(args: argparse.Namespace) -> list[Mode]:
    drafting = [("draft model", g) for g in args.num_draft]
    if args.prompt_lookup:
        for kind in ("prompt lookup", "hybrid"):
            drafting += [(kind, g) for g in args.lookup_num_draft]
    return [Mode(kind, g, delta) for delta in args.delta for kind, g in drafting]


def drafting_decoders(model, draft_model, tokenizer, prompt_lookup: int) -> dict:
    """A decoder per drafting mode, all of the same loaded models: each
    keeps its own auto calibration, of its own draft sources."""
    from decoder import SpeculativeDecoder

    return {
        drafting: SpeculativeDecoder(
            model,
            None if drafting == "prompt lookup" else draft_model,
            tokenizer,
            prompt_lookup=0 if drafting == "draft model" else prompt_lookup,
        )
        for drafting in ("draft model", "prompt lookup", "hybrid")
    }


def configure(decoders: dict, mode: Mode):
    """The decoder of ``mode``'s drafting (``drafting_decoders``), set to
    draft as ``mode`` says."""
    decoder = decoders[mode.drafting]
    decoder.num_draft, decoder.delta = mode.num_draft, mode.delta
    return decoder


@dataclass
class Costs:
    """What the predictions and the bandwidth share need, measured once."""

    cost_ratio: float  # a draft step's time over a main step's
    verify_costs: list[float]  # [k - 1]: v(k), a main pass over k tokens in one-token passes
    bound: float  # single-token main steps per second the memory bandwidth allows


def run_temperature(decoders, prompts, temp, all_modes, args, costs, progress):
    """Decode every prompt regularly and then in each mode, prompt after
    prompt: one Row per mode, and regular decoding's totals."""
    regular = dict.fromkeys(("time", "tokens", "prompt_time", "prompt_tokens"), 0)
    totals = {mode: dict.fromkeys(TOTALS, 0) for mode in all_modes}
    identical = dict.fromkeys(all_modes, True)
    for repeat in range(args.repeats):
        for number, prompt in enumerate(prompts):
            options = {"max_tokens": args.max_tokens, "temp": temp, "seed": args.seed + number}
            reference = decoders["draft model"].generate(prompt, **options)
            for name, value in count(reference).items():
                if name in regular:
                    regular[name] += value
            for mode in all_modes:
                result = configure(decoders, mode).speculative_decode(prompt, **options)
                for name, value in count(result).items():
                    totals[mode][name] += value
                identical[mode] &= result.tokens == reference.tokens
            progress.update(1)
    regular_speed = regular["tokens"] / regular["time"]
    rows = [
        make_row(temp, mode, totals[mode], regular_speed, costs, identical[mode])
        for mode in all_modes
    ]
    return rows, regular


TOTALS = (
    "time", "tokens", "accepted", "rejected", "passes", "proposed", "rounds", "lookup",
    "prompt_time", "prompt_tokens",
)  # fmt: skip


def count(result) -> dict[str, float]:
    """What one run adds to its mode's TOTALS."""
    return {
        "time": result.generation_time,
        "tokens": len(result.tokens),
        "accepted": result.n_accepted,
        "rejected": result.n_rejected,
        "passes": result.n_steps,
        "proposed": result.n_draft,
        "rounds": len(result.draft_lengths),
        "lookup": result.n_lookup_rounds,
        "prompt_time": result.prompt_time,
        "prompt_tokens": result.prompt_tokens,
    }


def make_row(temp, mode: Mode, totals: dict, regular_speed, costs: Costs, identical) -> Row:
    speed = totals["tokens"] / totals["time"]
    tested = totals["accepted"] + totals["rejected"]
    alpha = totals["accepted"] / tested if tested else 0.0
    predicted = verify_cost = verify_aware = None
    if mode.drafting == "draft model" and mode.num_draft != "auto":
        predicted = predicted_speedup(alpha, mode.num_draft, costs.cost_ratio)
        if mode.num_draft < len(costs.verify_costs):
            verify_cost = costs.verify_costs[mode.num_draft]
            verify_aware = predicted_speedup(alpha, mode.num_draft, costs.cost_ratio, verify_cost)
    speedup = speed / regular_speed
    tokens_per_pass = totals["tokens"] / totals["passes"]
    pass_efficiency = None
    if verify_cost is not None:
        round_cost = mode.num_draft * costs.cost_ratio + verify_cost
        pass_efficiency = speedup * round_cost / tokens_per_pass
    return Row(
        temp=temp,
        delta=mode.delta,
        drafting=mode.drafting,
        num_draft=mode.num_draft,
        regular_tokens_per_s=regular_speed,
        speculative_tokens_per_s=speed,
        speedup=speedup,
        bound_share=speed / costs.bound,
        alpha=alpha,
        tokens_per_pass=tokens_per_pass,
        mean_draft=totals["proposed"] / totals["rounds"] if totals["rounds"] else 0.0,
        lookup_rounds=totals["lookup"] / totals["passes"],
        cost_ratio=costs.cost_ratio,
        predicted_speedup=predicted,
        efficiency=speedup / predicted if predicted else None,
        verify_cost=verify_cost,
        verify_aware_speedup=verify_aware,
        loop_efficiency=speedup / verify_aware if verify_aware else None,
        pass_efficiency=pass_efficiency,
        identical=identical if temp == 0 else None,
    )


COLUMNS = [
    ("temp", "temp", "{:g}"),
    ("delta", "delta", "{:g}"),
    ("drafting", "drafting", "{}"),
    ("num_draft", "g", "{}"),
    ("regular_tokens_per_s", "regular tok/s", "{:.1f}"),
    ("speculative_tokens_per_s", "spec tok/s", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("bound_share", "of bound", "{:.0%}"),
    ("alpha", "alpha", "{:.3f}"),
    ("tokens_per_pass", "tok/pass", "{:.2f}"),
    ("mean_draft", "mean g", "{:.2f}"),
    ("lookup_rounds", "lookup", "{:.0%}"),
    ("cost_ratio", "c", "{:.3f}"),
    ("predicted_speedup", "predicted", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.2f}"),
    ("verify_cost", "v(g+1)", "{:.2f}"),
    ("verify_aware_speedup", "verify-aware", "{:.2f}x"),
    ("loop_efficiency", "loop eff.", "{:.2f}"),
    ("pass_efficiency", "per pass", "{:.2f}"),
    ("identical", "= regular", "{}"),
]


def write_outputs(rows: list[Row], extra: dict, output: Path) -> list[Path]:
    """OUTPUT.csv, OUTPUT.json and, with matplotlib, OUTPUT.png."""
    written = write_tables(rows, COLUMNS, extra, output)
    plt = pyplot()
    if plt is None:
        return written
    temps = sorted({row.temp for row in rows})
    figure, axes = plt.subplots(1, len(temps), figsize=(5 * len(temps), 4), squeeze=False)
    for axis, temp in zip(axes[0], temps):
        for delta in sorted({row.delta for row in rows}):
            selected = [r for r in rows if r.temp == temp and r.delta == delta]
            fixed = [r for r in selected if r.drafting == "draft model" and r.num_draft != "auto"]
            (line,) = axis.plot(
                [r.num_draft for r in fixed],
                [r.speedup for r in fixed],
                marker="o",
                label=f"draft model, delta {delta:g}",
            )
            # Modes without one fixed g: a level line each, in the same colour.
            styles = iter(["--", ":", "-."] * len(selected))
            for row in (r for r in selected if r not in fixed):
                axis.axhline(
                    row.speedup,
                    color=line.get_color(),
                    linestyle=next(styles),
                    linewidth=1,
                    label=f"{row.drafting} g={row.num_draft}, delta {delta:g}",
                )
        axis.axhline(1.0, color="gray", linewidth=0.8)
        axis.set(title=f"temperature {temp:g}", xlabel="num_draft", ylabel="speedup")
    written.append(output.with_suffix(".png"))
    save_with_legend_below(figure, axes[0], written[-1])
    return written


def compare_with_transformers(args, prompts, decoder, num_draft: int) -> dict:
    """Greedy and assisted generation in transformers on the original
    checkpoints, on the same prompts, timed the same way (prompt processing
    included), prompt by prompt in turn with ours; assisted generation and
    ours draft ``num_draft`` tokens per round. transformers runs in a process
    of its own (``transformers_worker.py``): in this one, the OpenBLAS loaded
    for MLX would slow torch down. Prompt processing apart: tokenizing and the
    encoder pass in transformers, and ours, which also computes the
    cross-attention keys and values (transformers does that in its first
    decoder step)."""
    times = {"greedy": 0.0, "assisted": 0.0, "ours_regular": 0.0, "ours_speculative": 0.0}
    tokens = dict.fromkeys(times, 0)
    prompt_times = {"transformers": 0.0, "ours": 0.0}
    prompt_tokens = 0
    matches = 0
    decoder.num_draft, decoder.delta = num_draft, 0.0
    options = (args.hf_model, args.hf_draft, peer_threads(args), num_draft, args.max_tokens)
    with Worker("transformers_worker.py", *options) as worker:
        for prompt in prompts:
            timed = worker.ask(prompt)
            prompt_times["transformers"] += timed["prompt_time"]
            prompt_tokens += timed["prompt_tokens"]
            for name in ("greedy", "assisted"):
                times[name] += timed[f"{name}_time"]
                tokens[name] += len(timed[f"{name}_tokens"])
            for name, run in (
                ("ours_regular", decoder.generate),
                ("ours_speculative", decoder.speculative_decode),
            ):
                result = run(prompt, max_tokens=args.max_tokens)
                times[name] += result.elapsed
                tokens[name] += len(result.tokens)
                if name == "ours_regular":
                    prompt_times["ours"] += result.prompt_time
            matches += result.tokens == timed["greedy_tokens"]
    speeds = {name: tokens[name] / times[name] for name in times}
    prompt_speeds = {name: prompt_tokens / seconds for name, seconds in prompt_times.items()}
    return {
        "tokens_per_s": speeds,
        "prompt_tokens_per_s": prompt_speeds,
        "prompt_vs_transformers": prompt_speeds["ours"] / prompt_speeds["transformers"],
        "num_draft": num_draft,
        "torch_threads": worker.ready["torch_threads"],
        "transformers_device": worker.ready.get("device", "cpu"),
        "regular_vs_transformers_greedy": speeds["ours_regular"] / speeds["greedy"],
        "speculative_vs_transformers_assisted": speeds["ours_speculative"] / speeds["assisted"],
        "greedy_tokens_match": f"{matches}/{len(prompts)}",
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        prompts = read_prompts(args.prompts)
        import mlx.core as mx
        from tqdm import tqdm

        from loading import check_draft_directories, load_model, load_tokenizer, resolve_model

        model_path = resolve_model(args.model_name)
        draft_path = resolve_model(args.draft_model_name)
        check_draft_directories(model_path, draft_path)
        model, draft_model = load_model(model_path), load_model(draft_path)
        tokenizer = load_tokenizer(model_path)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1

    decoders = drafting_decoders(model, draft_model, tokenizer, args.prompt_lookup)
    if args.batch_sizes:
        return run_batches(args, prompts, decoders["draft model"], model_path, draft_path)
    all_modes = modes(args)
    # Warm-up; auto measures its costs here, on its first use.
    for mode in all_modes:
        configure(decoders, mode).speculative_decode(prompts[0], max_tokens=8)
    prompt_ids = mx.array([tokenizer(prompts[0]).input_ids])
    machine = measure_machine(model, draft_model, prompt_ids)
    costs = Costs(
        cost_ratio=step_time(draft_model, prompt_ids) / step_time(model, prompt_ids),
        verify_costs=machine["verify_costs"],
        bound=machine["bound_tokens_per_s"],
    )
    rows, regular = [], {}
    total = len(args.temp) * args.repeats * len(prompts)
    # disable=None: the bar only on a terminal, never as \r frames in a log.
    with tqdm(total=total, desc="decoding", file=sys.stderr, disable=None) as progress:
        for temp in args.temp:
            temp_rows, regular[temp] = run_temperature(
                decoders, prompts, temp, all_modes, args, costs, progress
            )
            rows += temp_rows
    machine["regular"] = {
        f"temp {temp:g}": {
            "tokens_per_s": totals["tokens"] / totals["time"],
            "bound_share": totals["tokens"] / totals["time"] / costs.bound,
            "prompt_tokens_per_s": totals["prompt_tokens"] / totals["prompt_time"],
            "mean_prompt_tokens": totals["prompt_tokens"] / (args.repeats * len(prompts)),
        }
        for temp, totals in regular.items()
    }
    print(describe_machine(machine))
    print(format_table(rows, COLUMNS))
    round_costs = decoders["hybrid"].auto.measure_costs(prompt_ids[0].tolist())
    extra = {
        "model": str(model_path),
        "draft_model": str(draft_path),
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "prompt_lookup": args.prompt_lookup,
        # What auto measured per draft source: a round drafting g tokens / a plain step.
        "auto_round_costs": round_costs,
        "blas": blas.loaded_library(),
        "blas_threads": blas.num_threads(),
        "mlx_device": str(mx.default_device()),
        "machine": machine,
    }
    if args.compare_hf:
        # Assisted generation drafts as many tokens as our fastest exact greedy
        # setting (temperature 0, delta 0: the comparison runs with those).
        fixed_g = [r for r in rows if r.drafting == "draft model" and r.num_draft != "auto"]
        exact = [row for row in fixed_g if row.temp == 0 and row.delta == 0]
        best = max(exact or fixed_g, key=lambda row: row.speedup).num_draft
        decoder = decoders["draft model"]
        extra["transformers"] = compare_with_transformers(args, prompts, decoder, best)
        print(json.dumps(extra["transformers"], indent=2))
    try:
        written = write_outputs(rows, extra, args.output)
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
