"""Two checkouts of this repository in one process, whole calls interleaved:
the library's speed before and after a change, on the same models, with
drift hitting both alike.

    python benchmarks/compare_checkouts.py --before ../old --after . \\
        --model-name benchmark_models/main --draft-model-name benchmark_models/draft \\
        --prompts benchmark_models/prompts-32.txt --batch-sizes 1,8 --rounds 7

Each checkout's modules are imported from its own directory and swapped
into ``sys.modules`` around its calls (its lazy imports then find its own
modules); the ``cpu`` package, which loads the BLAS into the process, is
imported once and shared. Each checkout loads the models through its own
``loading.load``. Per batch size and mode (regular, draft model at
``--num-draft``): an untimed warm-up call each, then ``--rounds`` rounds of
one call per checkout, the order alternating. Prints, per cell, the
median of the rounds' ratios after / before of tokens per second, with
their range, and whether every output was the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

SHARED = ("cpu",)  # imported once, from the first checkout


def project_modules(root: Path) -> set[str]:
    """The names of the checkout's top-level modules (``*.py`` in ``root``)."""
    return {path.stem for path in root.glob("*.py")}


class Checkout:
    """One checkout's modules, imported from ``root``, and a decoder of its own."""

    def __init__(self, root: Path, names: set[str]):
        self.root, self.names = root.resolve(), names
        for name in names:
            sys.modules.pop(name, None)
        sys.path.insert(0, str(self.root))
        try:
            import decoder  # noqa: F401  # the checkout's, from its root
            import loading  # noqa: F401
        finally:
            sys.path.remove(str(self.root))
        self.modules = {name: sys.modules[name] for name in names if name in sys.modules}

    @contextmanager
    def active(self):
        """This checkout's modules in ``sys.modules`` while the block runs."""
        saved = {name: sys.modules.pop(name, None) for name in self.names}
        sys.modules.update(self.modules)  # the others' stay out: lazy imports find its own
        sys.path.insert(0, str(self.root))
        try:
            yield
        finally:
            # Modules the block imported (lazily) are this checkout's too.
            self.modules.update(
                {name: sys.modules[name] for name in self.names if name in sys.modules}
            )
            sys.path.remove(str(self.root))
            for name, module in saved.items():
                if module is None:
                    sys.modules.pop(name, None)
                else:
                    sys.modules[name] = module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--draft-model-name", required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--num-draft", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--limit", type=int, help="the first N prompts only")
    args = parser.parse_args(argv)
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[: args.limit] if args.limit else prompts
    sizes = [int(size) for size in args.batch_sizes.split(",")]

    names = (project_modules(args.before) | project_modules(args.after)) - set(SHARED)
    sys.path.insert(0, str(args.before.resolve()))
    import cpu  # noqa: F401  # shared: it loads the BLAS MLX binds to, once

    sys.path.pop(0)
    checkouts = {"before": Checkout(args.before, names), "after": Checkout(args.after, names)}
    decoders = {}
    for label, checkout in checkouts.items():
        with checkout.active():
            loading = checkout.modules["loading"]
            decoders[label] = loading.load(
                args.model_name, args.draft_model_name, num_draft=args.num_draft
            )

    def call(label: str, mode: str, batch_size: int) -> tuple[float, list]:
        decoder = decoders[label]
        run = decoder.generate_batch if mode == "regular" else decoder.speculative_decode_batch
        with checkouts[label].active():
            tic = time.perf_counter()
            results = run(prompts, batch_size=batch_size, max_tokens=args.max_tokens)
            seconds = time.perf_counter() - tic
        tokens = [list(result.tokens) for result in results]
        return sum(map(len, tokens)) / seconds, tokens

    cells = [(size, mode) for size in sizes for mode in ("regular", f"g = {args.num_draft}")]
    for size, mode in cells:  # warm-up, untimed
        for label in checkouts:
            call(label, mode, size)
    ratios = {cell: [] for cell in cells}
    same = dict.fromkeys(cells, True)
    for number in range(args.rounds):
        order = ["before", "after"] if number % 2 == 0 else ["after", "before"]
        for cell in cells:
            speeds, outputs = {}, {}
            for label in order:
                speeds[label], outputs[label] = call(label, cell[1], cell[0])
            ratios[cell].append(speeds["after"] / speeds["before"])
            same[cell] &= outputs["after"] == outputs["before"]
            print(
                f"round {number + 1}, B = {cell[0]}, {cell[1]}: "
                f"before {speeds['before']:.1f}, after {speeds['after']:.1f} tokens/s",
                flush=True,
            )
    print("\n| B | mode | after / before, median (range) | same outputs |")
    print("| --- | --- | --- | --- |")
    for cell, values in ratios.items():
        print(
            f"| {cell[0]} | {cell[1]} | {statistics.median(values):.2f} "
            f"({min(values):.2f}-{max(values):.2f}) | {'yes' if same[cell] else 'NO'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
