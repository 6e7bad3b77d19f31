"""The batch benchmark: throughput against batch size, ours and the peers'.

    python benchmarks/benchmark.py --model-name MAIN --draft-model-name DRAFT \\
        --batch-sizes 1,2,4,8,16,32 [--num-draft 3,5,auto] [--delta 0] [--temp 0] [--num-beams N] \\
        [--max-tokens 64] [--repeats R] [--prompts FILE] [--output OUTPUT] \\
        [--compare-hf --hf-model HF_DIR] [--compare-ct2 [--ct2-cache DIR]] [--hf-threads N]

benchmark.py runs this when ``--batch-sizes`` is given. At each batch size B
the whole prompt file is decoded in one call, by

- our regular decoding, ``SpeculativeDecoder.generate_batch``, and
  speculative decoding, ``speculative_decode_batch``, with each
  ``--num-draft`` value (``auto`` included) and each ``--delta``: rows leave
  the batch as they finish and waiting prompts take their place;
- with ``--compare-hf``, transformers' batched greedy ``generate`` on the
  original checkpoint ``--hf-model``, B prompts at a time
  (``transformers_worker.py --batch``);
- with ``--compare-ct2``, CTranslate2 float32 and int8 on a copy of that
  checkpoint made by its own converter (``ctranslate2_worker.py``).

With ``--num-beams N`` (N > 1) the engines are beam search instead, at
temperature 0: ours (``generate_batch(num_beams=N)``, transformers'
defaults: length penalty 1, early_stopping False), transformers' batched
``generate(num_beams=N)`` and CTranslate2 float32's ``beam_size=N`` (its
own stopping rule: a batch entry ends when its best hypothesis has; its
length penalty 1 too). Each is compared with our beam search at B = 1.
``--draft-levels 1,2,3`` adds our speculative beam search with a draft tree
of each number of levels (``draft_levels``); its "tokens/pass" column is
the steps of beam search (levels) per main-model pass.

The peers run in processes of their own, which never load the OpenBLAS that
MLX computes on, on as many threads as it (``--hf-threads`` to choose); they
decode greedily, so they run at temperature 0 only. Every (temperature, B,
engine) is warmed up by an untimed call on the first B prompts (``auto``
measures its costs at B there), then timed in turn with the others,
``--repeats`` times, so that drift in machine speed affects all alike.

Reported per row: generated tokens per second over the whole file (the wall
clock of the whole call, prompt processing included, which for ours is also
reported apart: prompt tokens per second of the summed ``prompt_time``); the
ratio to our regular decoding at the same B and to our single-prompt (B = 1)
regular decoding; for speculative decoding alpha, tokens per main pass (per
row) and draft tokens per drafted round. At temperature 0 every engine's
outputs are compared with our B = 1 regular outputs, token for token (tokens
without the start token, cut at end-of-sequence): our regular and exact
(delta 0) speculative decoding must equal them at every B; the peers'
agreement is reported. Results go to a Markdown table naming the machine,
OUTPUT.csv, OUTPUT.json and, when matplotlib is installed, OUTPUT.png
(tokens/s against B, one line per engine).

Optional dependencies: ``pip install -r benchmarks/requirements.txt``
(matplotlib for the plot, ctranslate2 for ``--compare-ct2``).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from reporting import format_table, machine_name, pyplot, save_with_legend_below, write_tables
from workers import Worker

from cpu import blas

WARM_UP_TOKENS = 8


@dataclass(frozen=True)
class Engine:
    """One way to decode the prompt file: ours ("regular", "speculative") or a
    peer's ("transformers" greedy, "ctranslate2" float32 or int8)."""

    name: str
    mode: str
    num_draft: int | str | None = None
    delta: float | None = None
    num_beams: int = 1  # beam search with this many beams, above 1

    @property
    def ours(self) -> bool:
        return self.name == "ours"

    @property
    def exact(self) -> bool:
        """Ours, and bound to give the regular tokens at temperature 0."""
        return self.ours and not self.delta

    @property
    def label(self) -> str:
        if self.num_beams > 1:
            mode = "" if self.mode == "beam" else f" {self.mode}"
            levels = f" g={self.num_draft}" if self.mode == "speculative" else ""
            return f"{self.name}{mode} beam N={self.num_beams}{levels}"
        if self.mode != "speculative":
            return f"{self.name} {self.mode}"
        delta = f", delta {self.delta:g}" if self.delta else ""
        return f"ours speculative g={self.num_draft}{delta}"


@dataclass
class BatchRow:
    """One engine at one temperature and batch size, per call (the mean over repeats)."""

    temp: float
    batch_size: int
    engine: str
    mode: str
    num_draft: int | str | None
    delta: float | None
    num_beams: int
    tokens: float  # generated over the whole file
    seconds: float  # the wall clock of the whole call
    tokens_per_s: float
    prompt_seconds: float | None  # ours: the summed prompt_time
    calibration_seconds: float | None  # ours: auto measuring its costs (warm-ups take it)
    prompt_tokens_per_s: float | None
    vs_regular: float | None  # tokens/s over our regular decoding's (beam search's) at the same B
    vs_single: float | None  # ... and at B = 1
    alpha: float | None
    tokens_per_pass: float | None  # per row and main-model pass
    mean_draft: float | None  # draft tokens per drafted round
    same_as_single: str | None  # prompts whose tokens equal our B = 1 regular (beam) ones
    identical: bool | None  # ours and exact: all of them do


COLUMNS = [
    ("temp", "temp", "{:g}"),
    ("batch_size", "B", "{}"),
    ("engine", "engine", "{}"),
    ("mode", "mode", "{}"),
    ("num_draft", "g", "{}"),
    ("delta", "delta", "{:g}"),
    ("num_beams", "N", "{}"),
    ("tokens", "tokens", "{:.0f}"),
    ("seconds", "seconds", "{:.2f}"),
    ("tokens_per_s", "tok/s", "{:.1f}"),
    ("prompt_seconds", "prompt s", "{:.2f}"),
    ("prompt_tokens_per_s", "prompt tok/s", "{:.0f}"),
    ("vs_regular", "x regular", "{:.2f}x"),
    ("vs_single", "x B=1 regular", "{:.2f}x"),
    ("alpha", "alpha", "{:.3f}"),
    ("tokens_per_pass", "tok/pass", "{:.2f}"),
    ("mean_draft", "mean g", "{:.2f}"),
    ("same_as_single", "= B=1 regular", "{}"),
    ("identical", "identical", "{}"),
]

TOTALS = (
    "calls", "seconds", "tokens", "prompt_time", "prompt_tokens", "accepted", "rejected",
    "passes", "proposed", "rounds", "same", "calibration", "levels",
)  # fmt: skip


def peer_threads(args: argparse.Namespace) -> int:
    """The threads the peers compute on: --hf-threads, else as many as MLX's
    matrix products run on (the BLAS's), else 0 (the peer's default)."""
    return args.hf_threads or blas.num_threads() or 0


def validate_batches(args: argparse.Namespace) -> None:
    """What benchmark.py's ``validate`` checks in addition for the batch benchmark."""
    if not args.batch_sizes:
        raise ValueError("--compare-ct2 needs --batch-sizes")
    if args.prompt_lookup:
        raise ValueError("--prompt-lookup is not measured with --batch-sizes")
    if args.compare_hf or args.compare_ct2:
        if args.hf_model is None or not (args.hf_model / "config.json").is_file():
            raise ValueError(
                "--compare-hf and --compare-ct2 need --hf-model, a Hugging Face checkpoint directory"
            )
        if 0 not in args.temp:
            raise ValueError("the peers decode greedily: --temp must include 0")
    if args.num_beams > 1 and args.temp != [0]:
        raise ValueError("beam search does not sample: --num-beams needs --temp 0")
    if args.compare_ct2 and importlib.util.find_spec("ctranslate2") is None:
        raise ValueError(
            "--compare-ct2 needs ctranslate2: pip install -r benchmarks/requirements.txt"
        )


def baseline(args: argparse.Namespace) -> Engine:
    """Our engine the others are compared with: regular decoding, or beam search."""
    if args.num_beams > 1:
        return Engine("ours", "beam", num_beams=args.num_beams)
    return Engine("ours", "regular")


def engines(args: argparse.Namespace) -> list[Engine]:
    """Ours (the baseline first: the others are compared with it), then the peers'."""
    if args.num_beams > 1:
        found = [baseline(args)]
        found += [
            Engine("ours", "speculative", levels, num_beams=args.num_beams)
            for levels in args.draft_levels
        ]
        if args.compare_hf:
            found.append(Engine("transformers", "beam", num_beams=args.num_beams))
        if args.compare_ct2:
            found.append(Engine("ctranslate2", "float32", num_beams=args.num_beams))
        return found
    found = [baseline(args)]
    found += [
        Engine("ours", "speculative", g, delta) for delta in args.delta for g in args.num_draft
    ]
    if args.compare_hf:
        found.append(Engine("transformers", "greedy"))
    if args.compare_ct2:
        found += [Engine("ctranslate2", "float32"), Engine("ctranslate2", "int8")]
    return found


def start_workers(args: argparse.Namespace, stack: ExitStack) -> dict[Engine, Worker]:
    """A worker process for each peer, loaded and warmed up, ended by ``stack``."""
    threads = peer_threads(args)
    cache = args.ct2_cache or args.output.parent / "ctranslate2-models"
    workers = {}
    for engine in engines(args):
        if engine.name == "transformers":
            command = ("transformers_worker.py", "--batch", args.hf_model, threads)
        elif engine.name == "ctranslate2":
            command = ("ctranslate2_worker.py", args.hf_model, cache, engine.mode, threads)
        else:
            continue
        workers[engine] = stack.enter_context(Worker(*command))
    return workers


def decode(decoder, workers, engine: Engine, prompts, batch_size: int, options: dict):
    """Decode ``prompts`` with ``engine`` in one call: its wall clock, the
    tokens of every prompt, and our GenerationResults (None for a peer)."""
    if not engine.ours:
        request = {"prompts": prompts, "batch_size": batch_size, **options}
        if engine.num_beams > 1:
            request["num_beams"] = engine.num_beams
        answer = workers[engine].ask(request)
        return answer["seconds"], answer["tokens"], None
    if engine.num_beams > 1:
        options = {**options, "num_beams": engine.num_beams}
        if engine.mode == "speculative":
            options["draft_levels"] = engine.num_draft
        call = decoder.generate_batch
    elif engine.mode == "speculative":
        decoder.num_draft, decoder.delta = engine.num_draft, engine.delta
        call = decoder.speculative_decode_batch
    else:
        call = decoder.generate_batch
    start = time.perf_counter()
    results = call(prompts, batch_size=batch_size, **options)
    seconds = time.perf_counter() - start
    return seconds, [result.tokens for result in results], results


def add_up(totals: dict, seconds: float, tokens: list[list[int]], results, reference) -> None:
    """Add one call to its TOTALS; ``reference``: the tokens to compare with, or None."""
    totals["calls"] += 1
    totals["seconds"] += seconds
    totals["tokens"] += sum(map(len, tokens))
    if reference is not None:
        totals["same"] += sum(a == b for a, b in zip(tokens, reference, strict=True))
    if results:
        # Measured once per call, before its first batch; each of those rows reports it.
        totals["calibration"] += max(result.calibration_time for result in results)
    for result in results or []:
        totals["prompt_time"] += result.prompt_time
        totals["prompt_tokens"] += result.prompt_tokens
        totals["accepted"] += result.n_accepted
        totals["rejected"] += result.n_rejected
        totals["passes"] += result.n_steps
        totals["levels"] += getattr(result, "levels", 0)
        totals["proposed"] += result.n_draft
        totals["rounds"] += len(result.draft_lengths)


def call_options(args: argparse.Namespace, temp: float) -> dict:
    """The keyword arguments of every call at ``temp`` (the peers' greedy at 0)."""
    return {"max_tokens": args.max_tokens, **({"temp": temp, "seed": args.seed} if temp else {})}


def timed_runs(args: argparse.Namespace) -> list[tuple[float, int, Engine]]:
    """(temperature, B, engine) of every timed call of a repeat, in order:
    B = 1 first, our regular decoding first at each B."""
    return [
        (temp, batch_size, engine)
        for temp in args.temp
        for batch_size in sorted(set(args.batch_sizes))
        for engine in engines(args)
        if engine.ours or temp == 0
    ]


def measure(args, prompts, decoder, workers, progress) -> dict:
    """TOTALS per (temperature, B, engine), every call timed in turn with the others."""
    runs = timed_runs(args)
    # Warm-ups first, untimed: auto measures its costs at each B here.
    for temp, batch_size, engine in runs:
        first = {**call_options(args, temp), "max_tokens": min(WARM_UP_TOKENS, args.max_tokens)}
        decode(decoder, workers, engine, prompts[:batch_size], batch_size, first)
    totals, references = {}, {}
    if 0 in args.temp and 1 not in args.batch_sizes:
        # Nothing timed at B = 1: the reference, untimed.
        regular = Engine("ours", "regular")
        references[0] = decode(decoder, workers, regular, prompts, 1, call_options(args, 0))[1]
    for _ in range(args.repeats):
        for temp, batch_size, engine in runs:
            run = decode(decoder, workers, engine, prompts, batch_size, call_options(args, temp))
            if temp == 0 and temp not in references:  # B = 1, regular: the first call
                references[temp] = run[1]
            counts = totals.setdefault((temp, batch_size, engine), dict.fromkeys(TOTALS, 0))
            add_up(counts, *run, references.get(temp))
            progress.update(1)
    return totals


def make_rows(totals: dict, num_prompts: int, base: Engine) -> list[BatchRow]:
    regular = {
        (temp, batch_size): t["tokens"] / t["seconds"]
        for (temp, batch_size, engine), t in totals.items()
        if engine == base
    }
    rows = []
    for (temp, batch_size, engine), t in totals.items():
        speed = t["tokens"] / t["seconds"]
        tested = t["accepted"] + t["rejected"]
        speculative = engine.mode == "speculative"
        same = None if temp else t["same"] / t["calls"]
        rows.append(
            BatchRow(
                temp=temp,
                batch_size=batch_size,
                engine=engine.name,
                mode=engine.mode,
                num_draft=engine.num_draft,
                delta=engine.delta,
                num_beams=engine.num_beams,
                tokens=t["tokens"] / t["calls"],
                seconds=t["seconds"] / t["calls"],
                tokens_per_s=speed,
                prompt_seconds=t["prompt_time"] / t["calls"] if engine.ours else None,
                calibration_seconds=t["calibration"] / t["calls"] if engine.ours else None,
                prompt_tokens_per_s=(
                    t["prompt_tokens"] / t["prompt_time"] if t["prompt_time"] else None
                ),
                vs_regular=speed / regular[temp, batch_size],
                vs_single=speed / regular[temp, 1] if (temp, 1) in regular else None,
                alpha=t["accepted"] / tested if speculative and tested else None,
                tokens_per_pass=(t["levels"] or t["tokens"]) / t["passes"] if t["passes"] else None,
                mean_draft=t["proposed"] / t["rounds"] if t["rounds"] else None,
                same_as_single=None if same is None else f"{same:g}/{num_prompts}",
                identical=same == num_prompts if same is not None and engine.exact else None,
            )
        )
    return rows


def summary(rows: list[BatchRow], base: Engine) -> list[str]:
    """At each B (temperature 0): what the targets compare."""
    lines = []
    for batch_size in sorted({row.batch_size for row in rows}):
        at = {_label(row): row for row in rows if row.temp == 0 and row.batch_size == batch_size}
        if base.label not in at:
            continue
        regular, auto = at[base.label], at.get("ours speculative g=auto")
        best = max((row for row in at.values() if row.engine == "ours"), key=_speed)
        parts = []
        if regular.vs_single is not None:
            name = base.label.removeprefix("ours ")
            parts.append(f"{name} {regular.vs_single:.2f}x B=1 {name}")
        if auto:
            parts.append(f"auto {auto.vs_regular:.2f}x regular")
        parts.append(f"fastest of ours: {_label(best).removeprefix('ours ')}")
        ratios = [("fastest", best)] + ([("auto", auto)] if auto else [])
        for peer, peer_row in at.items():
            if peer_row.engine != "ours":
                parts.append(
                    f"{peer} {_speed(peer_row):.1f} tok/s, ours "
                    + " and ".join(
                        f"{name} {_speed(row) / _speed(peer_row):.2f}x" for name, row in ratios
                    )
                )
        lines.append(f"B {batch_size}: " + "; ".join(parts))
    return lines


def _speed(row: BatchRow) -> float:
    return row.tokens_per_s


def _label(row: BatchRow) -> str:
    return Engine(row.engine, row.mode, row.num_draft, row.delta, row.num_beams).label


def plot(rows: list[BatchRow], path: Path) -> bool:
    """Tokens/s against B, one line per engine, a panel per temperature; False
    without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    temps = sorted({row.temp for row in rows})
    figure, axes = plt.subplots(1, len(temps), figsize=(6 * len(temps), 4.5), squeeze=False)
    for axis, temp in zip(axes[0], temps):
        selected = [row for row in rows if row.temp == temp]
        for label in dict.fromkeys(_label(row) for row in selected):
            line = sorted((r.batch_size, r.tokens_per_s) for r in selected if _label(r) == label)
            axis.plot(*zip(*line), marker="o", label=label)
        sizes = sorted({row.batch_size for row in selected})
        axis.set_xscale("log", base=2)
        axis.set_xticks(sizes, [str(size) for size in sizes])
        speeds = [row.tokens_per_s for row in selected]
        if max(speeds) > 10 * min(speeds):  # engines far apart: each still readable
            axis.set_yscale("log")
        else:
            axis.set_ylim(bottom=0)
        axis.grid(alpha=0.3)
        axis.set(title=f"temperature {temp:g}", xlabel="batch size", ylabel="tokens/s")
    # Every panel draws our engines in the same order; the first has the peers too.
    save_with_legend_below(figure, axes[0], path, panel_height=4.5)
    return True


def run_batches(args, prompts: list[str], decoder, model_path, draft_path) -> int:
    """The batch benchmark (see the module docstring); benchmark.py's exit status."""
    import mlx.core as mx
    from tqdm import tqdm

    calls = args.repeats * len(timed_runs(args))
    with ExitStack() as stack:
        workers = start_workers(args, stack)
        # disable=None: the bar only on a terminal, never as \r frames in a log.
        with tqdm(total=calls, desc="decoding", file=sys.stderr, disable=None) as progress:
            totals = measure(args, prompts, decoder, workers, progress)
        peers = {engine.label: worker.ready for engine, worker in workers.items()}
    base = baseline(args)
    rows = make_rows(totals, len(prompts), base)
    machine = machine_name()
    threads = blas.num_threads()
    device = str(mx.default_device())
    print(
        f"machine: {machine}; MLX {mx.__version__} on {device}, {threads or 'its own'} BLAS threads"
    )
    for label, ready in peers.items():
        print(f"{label}: " + ", ".join(f"{k} {v}" for k, v in ready.items() if k != "ready"))
    print(f"{len(prompts)} prompts, at most {args.max_tokens} tokens each; {args.repeats} repeats")
    print(format_table(rows, COLUMNS, markdown=True))
    print("\n".join(summary(rows, base)))
    failed = [_label(r) + f" at B {r.batch_size}" for r in rows if r.identical is False]
    if failed:
        print(f"IDENTITY CHECK FAILED (outputs differ from B=1 {base.label}): " + ", ".join(failed))
    extra = {
        "machine": machine,
        "mlx": mx.__version__,
        "mlx_device": device,
        "blas": blas.loaded_library(),
        "blas_threads": threads,
        "peers": peers,
        "model": str(model_path),
        "draft_model": str(draft_path),
        "hf_model": str(args.hf_model) if args.hf_model else None,
        "prompts_file": str(args.prompts) if args.prompts else None,
        "prompts": len(prompts),
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "batch_sizes": sorted(set(args.batch_sizes)),
        "num_beams": args.num_beams,
        "identical": not failed,
        "summary": summary(rows, base),
    }
    try:
        written = write_tables(rows, COLUMNS, extra, args.output)
        if plot(rows, args.output.with_suffix(".png")):
            written.append(args.output.with_suffix(".png"))
    except OSError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0
