"""benchmark.py: the paper's speedup formula, and a run end to end on the tiny pair."""

import csv
import json
import subprocess
import sys

import pytest
from benchmark import predicted_speedup
from conftest import ROOT


def run_benchmark(main_dir, draft_dir, *options: str) -> subprocess.CompletedProcess:
    """``benchmark.py`` on the tiny pair, in a child process, as a user runs it."""
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "benchmark.py"),
            "--model-name", str(main_dir),
            "--draft-model-name", str(draft_dir),
            *options,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )  # fmt: skip


def test_predicted_speedup_follows_the_paper():
    # alpha = 0.75, g = 3, c = 0.1: (1 - 0.75^4) / (0.25 * 1.3)
    assert predicted_speedup(0.75, 3, 0.1) == pytest.approx((1 - 0.75**4) / (0.25 * 1.3))
    # A draft that is never accepted only costs time; one always accepted gives g + 1 tokens.
    assert predicted_speedup(0.0, 4, 0.2) == pytest.approx(1 / 1.8)
    assert predicted_speedup(1.0, 4, 0.0) == pytest.approx(5.0)
    # The reference points: about 2.2x at c = 0.1 and 1.7x at c = 0.2.
    assert max(predicted_speedup(0.75, g, 0.1) for g in range(1, 10)) == pytest.approx(
        2.2, abs=0.05
    )
    assert max(predicted_speedup(0.75, g, 0.2) for g in range(1, 10)) == pytest.approx(
        1.7, abs=0.05
    )


def run_greedy(converted_pair, output, *options: str) -> tuple[str, list[dict], dict]:
    """A successful greedy 12-token ``benchmark.py`` run: (stdout, CSV rows, JSON report)."""
    run = run_benchmark(
        *converted_pair, *options, "--temp", "0", "--max-tokens", "12", "--output", str(output)
    )
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader(output.with_suffix(".csv").open()))
    return run.stdout, rows, json.loads(output.with_suffix(".json").read_text())


def test_benchmark_runs_and_writes_its_results(converted_pair, tmp_path):
    stdout, rows, report = run_greedy(
        converted_pair, tmp_path / "results", "--num-draft", "1,3", "--delta", "0,1"
    )
    assert [(r["delta"], r["num_draft"]) for r in rows] == [
        ("0.0", "1"),
        ("0.0", "3"),
        ("1.0", "1"),
        ("1.0", "3"),
    ]
    # Exact greedy decoding reproduces the regular tokens; delta = 1 accepts everything.
    assert all(r["identical"] == "True" for r in rows if r["delta"] == "0.0")
    assert all(float(r["alpha"]) == 1.0 for r in rows if r["delta"] == "1.0")
    assert len(report["rows"]) == 4 and report["max_tokens"] == 12
    assert not list(tmp_path.glob(".*.partial"))  # each file written whole, then renamed
    assert "speedup" in stdout and "predicted" in stdout


def test_benchmark_compares_every_drafting_mode(converted_pair, tmp_path):
    _, rows, report = run_greedy(
        converted_pair, tmp_path / "results",
        "--num-draft", "2,auto",
        "--prompt-lookup", "2",
        "--lookup-num-draft", "3,auto",
        "--repeats", "2",
    )  # fmt: skip
    assert [(r["drafting"], r["num_draft"]) for r in rows] == [
        ("draft model", "2"),
        ("draft model", "auto"),
        ("prompt lookup", "3"),
        ("prompt lookup", "auto"),
        ("hybrid", "3"),
        ("hybrid", "auto"),
    ]
    assert all(r["identical"] == "True" for r in rows)
    # Only lookup drafts without the draft model; only the draft model drafts alone.
    assert all(float(r["lookup_rounds"]) == 0 for r in rows if r["drafting"] == "draft model")
    assert all(float(r["lookup_rounds"]) > 0 for r in rows if r["drafting"] == "prompt lookup")
    # The paper's prediction needs one fixed g and a draft model.
    assert [r["predicted_speedup"] != "" for r in rows] == [True] + [False] * 5
    assert report["repeats"] == 2 and len(report["auto_verify_costs"]) == 17


def test_benchmark_compares_with_transformers(hf_pair, converted_pair, tmp_path):
    (hf_main, hf_draft), (main_dir, draft_dir) = hf_pair, converted_pair
    output = tmp_path / "results"
    run = run_benchmark(
        main_dir, draft_dir,
        "--num-draft", "2",
        "--temp", "0",
        "--max-tokens", "10",
        "--compare-hf",
        "--hf-model", str(hf_main),
        "--hf-draft", str(hf_draft),
        "--hf-threads", "1",
        "--output", str(output),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    report = json.loads(output.with_suffix(".json").read_text())["transformers"]
    # transformers' greedy generate and our regular decoding agree token for token.
    prompts = report["greedy_tokens_match"].split("/")[1]
    assert report["greedy_tokens_match"] == f"{prompts}/{prompts}"
    assert report["num_draft"] == 2 and report["torch_threads"] == 1
    assert set(report["tokens_per_s"]) == {"greedy", "assisted", "ours_regular", "ours_speculative"}
    assert all(speed > 0 for speed in report["tokens_per_s"].values())


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (["--delta", "0,2"], "--delta values must be in [0, 1]"),
        (["--hf-threads", "0"], "--hf-threads must be >= 1"),
        (["--num-draft", "x"], "argument --num-draft: 'x' is not a list of integers >= 1 or auto"),
        (["--num-draft", "0"], "argument --num-draft: '0' is not a list of integers >= 1 or auto"),
        (["--prompt-lookup", "-1"], "--prompt-lookup must be >= 0"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ],
)
def test_benchmark_refuses_bad_settings(setting, message, converted_pair):
    main_dir, draft_dir = converted_pair
    run = run_benchmark(main_dir, draft_dir, *setting)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [f"error: {message}"]
