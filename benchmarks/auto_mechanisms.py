"""What each of ``--num-draft auto``'s mechanisms adds: whole calls interleaved
in one process.

    python benchmarks/auto_mechanisms.py --model-name MAIN --draft-model-name DRAFT \\
        --prompts FILE [--batch-sizes 1,8,32] [--num-draft 2,3,4] [--rounds 3] \\
        [--max-tokens 48] [--without all|none|NAME,...] [--output OUTPUT.json]

At each batch size B the prompt file is decoded in one call by each engine:
regular decoding, speculative decoding at each fixed ``--num-draft``, auto,
auto again (a second decoder of its own: the runs' noise, auto against
itself) and auto without each mechanism of ``MECHANISMS`` (the library's
code with that one mechanism switched off around the engine's calls). Each
engine has a decoder of its own, so that what auto carries from call to
call (costs, acceptance, round times, verdicts) is its own, and an untimed
warm-up call (8 tokens a prompt), where auto calibrates. Then ``--rounds``
rounds, in each one call of every engine, the order rotating from round to
round, so that drift in the machine's speed hits all alike.

Reported per B and engine: the median seconds of a whole call (prompts
included), and the median over rounds of its time over auto's in the same
round; for auto, the better of regular decoding and the best fixed g over
auto. At temperature 0 every output must equal regular decoding's; a
mismatch stops the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from unittest import mock

# The example's modules live one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Full float32 (outputs are compared token for token), then the BLAS: both
# before anything imports mlx.
from cli import full_float32  # isort: skip

full_float32()
from cpu import blas  # noqa: F401  # isort: skip

import auto
import decoder
from loading import load_model, load_tokenizer

WARM_UP_TOKENS = 8


def linear_costs(self, prompt_ids, batch_size=1):
    """``Auto.measure_costs`` without timing anything: the paper's round cost
    ``1 + g c``, c the draft model's multiply-adds per token over the main
    model's (lookup: free drafts, a verify pass as cheap as a step)."""
    draft_model, model = self.draft_model, self.model
    step = draft_model.args.decode_work / model.args.decode_work if draft_model else 0.0
    costs = {"model": [1 + g * step for g in range(auto.MAX_AUTO_DRAFT + 1)]}
    costs["lookup"] = [1.0] * (auto.MAX_AUTO_DRAFT + 1)
    return costs


def patched(target, name, value) -> Callable[[decoder.SpeculativeDecoder], AbstractContextManager]:
    return lambda engine: mock.patch.object(target, name, value)


# name: (what it is, how to switch it off around an engine's calls)
MECHANISMS: dict[str, tuple[str, Callable]] = {
    "calibration": (
        "round costs 1 + g c from the models' sizes, no timing",
        patched(auto.Auto, "measure_costs", linear_costs),
    ),
    "start cost": (
        "starting the lazy draft model weighs nothing",
        patched(auto.DraftStart, "cost", lambda self, rows, limits: 0.0),
    ),
    "lazy draft model": (
        "the draft model encodes every prompt as it joins",
        patched(decoder.SpeculativeDecoder, "lazy_drafting", False),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--draft-model-name", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--num-draft", default="2,3,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--without", default="all", help="mechanisms to switch off (comma-separated), all or none"
    )
    parser.add_argument("--output", help="a JSON file for every call's seconds")
    args = parser.parse_args()

    named = {"all": list(MECHANISMS), "none": []}
    without = named[args.without] if args.without in named else args.without.split(",")
    unknown = [name for name in without if name not in MECHANISMS]
    if unknown:
        parser.error(f"unknown mechanism {unknown[0]!r}; known: {', '.join(MECHANISMS)}")
    model, draft = load_model(args.model_name), load_model(args.draft_model_name)
    tokenizer = load_tokenizer(args.model_name)
    prompts = [line.strip() for line in Path(args.prompts).read_text().splitlines() if line.strip()]

    # engine name: (num_draft, speculative, switch)
    engines = {"regular": (3, False, None)}
    engines |= {f"g = {g}": (int(g), True, None) for g in args.num_draft.split(",")}
    engines |= {"auto": ("auto", True, None), "auto again": ("auto", True, None)}
    engines |= {f"without {name}": ("auto", True, MECHANISMS[name][1]) for name in without}

    seconds: dict[str, dict[str, list[float]]] = {}
    calibration: dict[str, dict[str, float]] = {}
    for batch_size in map(int, args.batch_sizes.split(",")):
        decoders = {
            name: decoder.SpeculativeDecoder(model, draft, tokenizer, num_draft=num_draft)
            for name, (num_draft, _, _) in engines.items()
        }

        reference = None
        cell_calibration = calibration.setdefault(str(batch_size), {})
        for name in engines:
            _, results = call(engines[name], decoders[name], prompts, batch_size, WARM_UP_TOKENS)
            cell_calibration[name] = max(result.calibration_time for result in results)
        cell = seconds.setdefault(str(batch_size), {name: [] for name in engines})
        names = list(engines)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                elapsed, results = call(
                    engines[name], decoders[name], prompts, batch_size, args.max_tokens
                )
                tokens = [list(result.tokens) for result in results]
                reference = reference or tokens
                if tokens != reference:
                    sys.exit(f"B = {batch_size}, {name}: the tokens differ from the first engine's")
                cell[name].append(elapsed)
            print(f"B = {batch_size}, round {round_index + 1} of {args.rounds}", flush=True)
            if args.output:
                Path(args.output).write_text(
                    json.dumps({"seconds": seconds, "calibration": calibration}, indent=1)
                )
        report(batch_size, cell)


def call(engine, decoder_, prompts, batch_size, max_tokens) -> tuple[float, list]:
    """Seconds of one whole call of ``engine`` (see ``main``) by ``decoder_``, and its results."""
    _, speculative, switch = engine
    run = decoder_.speculative_decode_batch if speculative else decoder_.generate_batch
    with ExitStack() as stack:
        if switch is not None:
            stack.enter_context(switch(decoder_))
        tic = time.perf_counter()
        results = run(prompts, batch_size=batch_size, max_tokens=max_tokens)
        return time.perf_counter() - tic, results


def report(batch_size: int, cell: dict[str, list[float]]) -> None:
    """A Markdown table of one batch size's calls."""
    auto_seconds = cell["auto"]
    print(f"\nB = {batch_size}: median seconds per call; median over rounds of its time / auto's")
    print("| engine | seconds | time / auto's |")
    print("| --- | --- | --- |")
    for name, times in cell.items():
        ratios = [t / a for t, a in zip(times, auto_seconds)]
        print(f"| {name} | {statistics.median(times):.3f} | {statistics.median(ratios):.3f} |")
    fixed = [name for name in cell if name.startswith("g = ")] + ["regular"]
    better = min(statistics.median(cell[name]) for name in fixed)
    print(
        f"auto over the better of regular and the best fixed g: "
        f"{better / statistics.median(auto_seconds):.3f}x"
    )


if __name__ == "__main__":
    main()
