"""Run the numerics tests under every BLAS kernel set this CPU can run.

OpenBLAS picks its kernels by CPU, and each kernel set sums in its own order,
so float32 results differ from machine to machine. This runs the tests that
compare logits (parity with transformers, quantized parity, cache and trim
equalities) once per setting: the kernel sets ``OPENBLAS_CORETYPE`` forces
(the CPU's own, Haswell, Zen, Sandybridge), each on 1 and 2 threads, and MLX's
own reference BLAS (``T5_SPEC_NO_BLAS=1``). With ``--decoding`` it adds the
greedy-identity and sampling tests. For each setting it prints the tests
passed and failed and, per kind of check, the largest error and its bound,
which the tests print on ``numerics:`` lines.

    python tests/numerics_sweep.py               # about 5 minutes on 2 busy cores
    python tests/numerics_sweep.py --decoding    # 9 to 18 minutes per setting there

It exits non-zero if any setting fails. Every log is kept in ``--logs``.
Kernel sets need the CPU's instructions: SkylakeX (AVX-512) cannot run on a
CPU without them, so it is left out; on Linux only (cpu/blas.py loads OpenBLAS
there).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NUMERICS_TESTS = [
    "tests/test_model.py",
    "tests/test_quantize.py::test_quantized_model_equals_its_dequantized_twin",
    "tests/test_quantize.py::test_layers_too_narrow_for_the_group_stay_float",
]
DECODING_TESTS = [
    "tests/test_decoder.py",
    "tests/test_drafting.py",
    "tests/test_sampling_distribution.py",
    "tests/test_quantize.py::test_greedy_speculative_output_equals_quantized_main_model",
]
KERNEL_SETS = [None, "Haswell", "Zen", "Sandybridge"]  # None: OpenBLAS's own choice
THREADS = [1, 2]
# The environment variables a setting sets; every other one is left as it is.
SETTING_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "T5_SPEC_NO_BLAS")
# A line the tests print through fixtures.assert_within: "numerics: KIND CASE: error E bound B".
NUMERICS_LINE = re.compile(r"^numerics: (\S+) (\S+): error (\S+)(?: bound (\S+))?$")
SUMMARY_LINE = re.compile(r"^=*\s*(\d+ (?:passed|failed).*) in [\d.]+s")


@dataclass
class Outcome:
    """What one pytest run under one setting reported."""

    setting: str
    kernels: str
    summary: str
    returncode: int
    # Per kind of check, its case nearest its bound: (error / bound, error, bound, case).
    largest: dict[str, tuple[float, float, float, str]] = field(default_factory=dict)
    # The largest of our parity error over transformers' own float32 error, and its case.
    ratio: tuple[float, str] = (0.0, "")


def settings() -> list[tuple[str, dict[str, str]]]:
    """(label, environment variables) of every setting swept."""
    swept = [
        (
            f"{kernels or 'native'}, {threads} thread{'s' if threads > 1 else ''}",
            {
                "OPENBLAS_NUM_THREADS": str(threads),
                **({"OPENBLAS_CORETYPE": kernels} if kernels else {}),
            },
        )
        for kernels in KERNEL_SETS
        for threads in THREADS
    ]
    return [*swept, ("MLX's reference BLAS", {"T5_SPEC_NO_BLAS": "1"})]


def environment(variables: dict[str, str]) -> dict[str, str]:
    """This process's environment with the setting's variables, and no others of them."""
    inherited = {k: v for k, v in os.environ.items() if k not in SETTING_VARIABLES}
    return {**inherited, **variables}


def kernels_in_use(env: dict[str, str]) -> str:
    """The OpenBLAS kernel set and thread count cpu/blas.py's library reports under ``env``:
    proof that the setting reached it."""
    probe = (
        "import ctypes\n"
        "from cpu import blas\n"
        "path = blas.loaded_library()\n"
        "if path is None:\n"
        "    print(blas.status())\n"
        "else:\n"
        "    core = ctypes.CDLL(path).openblas_get_corename\n"
        "    core.restype = ctypes.c_char_p\n"
        "    print(f'OpenBLAS {core().decode()}, {blas.num_threads()} threads')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return run.stdout.strip() or f"cannot tell: {(run.stderr.strip().splitlines() or ['?'])[-1]}"


def run_tests(label: str, variables: dict[str, str], tests: list[str], log: Path) -> Outcome:
    """Run ``tests`` under one setting, keep the log, and read what it reported."""
    env = environment(variables)
    kernels = kernels_in_use(env)
    command = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *tests]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    log.write_text(run.stdout + run.stderr)
    lines = run.stdout.splitlines()
    summaries = [m.group(1) for m in map(SUMMARY_LINE.match, lines) if m]
    outcome = Outcome(label, kernels, summaries[-1] if summaries else "no summary", run.returncode)
    transformers_error = {}
    for match in filter(None, map(NUMERICS_LINE.match, lines)):
        kind, case, error, bound = match.groups()
        if bound is None:  # transformers' own float32 error, for the ratio
            transformers_error[case] = float(error)
            continue
        check = (float(error) / float(bound), float(error), float(bound), case)
        outcome.largest[kind] = max(outcome.largest.get(kind, check), check)
        if kind == "parity" and case in transformers_error:
            outcome.ratio = max(outcome.ratio, (float(error) / transformers_error[case], case))
    return outcome


def report(outcome: Outcome) -> str:
    """One setting's results in a few lines."""
    lines = [f"{outcome.setting} ({outcome.kernels}): {outcome.summary}"]
    for kind, (_, error, bound, case) in sorted(outcome.largest.items()):
        lines.append(f"    {kind:9} largest error {error:.2e} (bound {bound:.2e}) in {case}")
    if outcome.ratio[1]:
        ratio, case = outcome.ratio
        lines.append(
            f"    parity error / transformers' float32 error: at most {ratio:.2f} ({case})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--decoding", action="store_true", help="also the greedy-identity and sampling tests"
    )
    parser.add_argument(
        "--logs", type=Path, default=Path("numerics-sweep-logs"), help="where the logs go"
    )
    args = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        print(
            "error: the sweep forces OpenBLAS kernel sets, which load on Linux only",
            file=sys.stderr,
        )
        return 2
    args.logs.mkdir(parents=True, exist_ok=True)
    tests = NUMERICS_TESTS + (DECODING_TESTS if args.decoding else [])
    outcomes = []
    for label, variables in settings():
        log = args.logs / (re.sub(r"\W+", "-", label).strip("-") + ".log")
        outcomes.append(run_tests(label, variables, tests, log))
        print(report(outcomes[-1]), flush=True)
    failed = [outcome.setting for outcome in outcomes if outcome.returncode != 0]
    ratio, case = max(outcome.ratio for outcome in outcomes)
    print(
        f"{len(outcomes) - len(failed)} of {len(outcomes)} settings green"
        + (f"; failed: {', '.join(failed)}" if failed else "")
        + (f"; parity error / transformers' error at most {ratio:.2f} ({case})" if case else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
