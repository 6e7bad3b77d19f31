"""benchmark.py: the paper's speedup formula, and a run end to end on the tiny pair."""

import csv
import json
import shutil
import subprocess
import sys

import pytest
from benchmark import predicted_speedup
from conftest import ROOT
from fixtures import EOS_ID
from limits import decoder_step_bytes
from workers import Worker

from model import T5, ModelArgs


def run_benchmark(main_dir, draft_dir, *options: str) -> subprocess.CompletedProcess:
    """``benchmark.py`` on the tiny pair, in a child process, as a user runs
    it; its standard error is not a terminal, so it must hold no progress-bar
    frames (a log would fill with them)."""
    run = subprocess.run(
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
    # (text=True reads a frame's \r as a new line: look for the bar's label.)
    assert "decoding:" not in run.stderr, "a progress bar on standard error, not a terminal"
    return run


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

    # Verify-aware: a main pass over g + 1 tokens costing v one-token passes instead of 1.
    assert predicted_speedup(0.75, 3, 0.1, 1.5) == pytest.approx((1 - 0.75**4) / (0.25 * 1.8))
    assert predicted_speedup(0.75, 3, 0.1, 1.0) == predicted_speedup(0.75, 3, 0.1)


@pytest.mark.parametrize("tied", [True, False])
def test_decoder_step_bytes_counts_the_weights_one_step_reads(tied):
    args = ModelArgs(
        vocab_size=100, d_model=16, d_kv=4, num_heads=2, d_ff=24, num_layers=1,
        num_decoder_layers=3, feed_forward_proj="relu" if tied else "gated-gelu",
        tie_word_embeddings=tied,
    )  # fmt: skip
    inner, feed_forward = 4 * 2, 24 * (1 if tied else 2)
    # Per decoder layer: self-attention q, k, v, o; cross-attention q and o (its keys and
    # values are computed once per prompt); the feed-forward block; three norms.
    layer = 4 * 16 * inner + 2 * 16 * inner + feed_forward * 16 + 24 * 16 + 3 * 16
    # Three layers, the final norm and the output projection (the embedding when tied).
    expected = 4 * (3 * layer + 16 + 100 * 16)
    assert decoder_step_bytes(T5(args)) == expected


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
    # (Whether auto drafts at all here depends on the round costs it times, and
    # the random pair's lookup drafts are rarely accepted: a fixed g always drafts.)
    assert all(float(r["lookup_rounds"]) == 0 for r in rows if r["drafting"] == "draft model")
    assert float(rows[2]["lookup_rounds"]) > 0  # prompt lookup, g = 3
    # The paper's prediction needs one fixed g and a draft model.
    assert [r["predicted_speedup"] != "" for r in rows] == [True] + [False] * 5
    assert report["repeats"] == 2
    # auto's round costs, per source of the hybrid mode: g = 0 .. 16, g = 0 a plain step.
    round_costs = report["auto_round_costs"]
    assert sorted(round_costs) == ["lookup", "model"]
    assert all(len(costs) == 17 and costs[0] == 1 for costs in round_costs.values())
    # Against the machine: the bandwidth bound, v(k) for the verify passes of g = 0 .. 16.
    machine = report["machine"]
    assert machine["bandwidth_gb_per_s"] > 0 and machine["main_step_gb"] > 0
    assert machine["bound_tokens_per_s"] == pytest.approx(
        machine["bandwidth_gb_per_s"] / machine["main_step_gb"]
    )
    assert len(machine["verify_costs"]) == 17 and machine["verify_costs"][0] == 1
    regular = machine["regular"]["temp 0"]
    assert regular["bound_share"] == pytest.approx(
        regular["tokens_per_s"] / machine["bound_tokens_per_s"]
    )
    assert regular["prompt_tokens_per_s"] > 0
    # The verify-aware prediction uses v(g + 1) of the machine section.
    row = rows[0]
    assert float(row["verify_cost"]) == pytest.approx(machine["verify_costs"][2])
    assert float(row["loop_efficiency"]) == pytest.approx(
        float(row["speedup"]) / float(row["verify_aware_speedup"]), rel=1e-4
    )


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
    assert set(report["prompt_tokens_per_s"]) == {"transformers", "ours"}
    assert report["prompt_vs_transformers"] > 0


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


def test_batch_benchmark_measures_every_batch_size(hf_pair, converted_pair, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "translate English to German: the house is small.\n"
        "summarize: the dog sees the apple in the green garden.\n"
        "Le chat est très petit.\n"
    )
    run = batch_against_transformers(
        converted_pair, hf_pair, prompts, tmp_path / "batch", "--num-draft", "2,auto"
    )
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader((tmp_path / "batch.csv").open()))
    assert [(r["batch_size"], r["engine"], r["mode"], r["num_draft"]) for r in rows] == [
        (size, *engine)
        for size in ("1", "2")
        for engine in (
            ("ours", "regular", ""),
            ("ours", "speculative", "2"),
            ("ours", "speculative", "auto"),
            ("transformers", "greedy", ""),
        )
    ]
    assert all(float(r["tokens_per_s"]) > 0 and float(r["tokens"]) > 0 for r in rows)
    # Our batched outputs, regular and exact speculative, are B = 1 regular's, token for token.
    ours = [r for r in rows if r["engine"] == "ours"]
    assert all(r["identical"] == "True" and r["same_as_single"] == "3/3" for r in ours)
    assert all(float(r["prompt_tokens_per_s"]) > 0 for r in ours)
    assert all(float(r["vs_single"]) > 0 for r in ours if r["num_draft"])
    # alpha where rounds drafted: every fixed g; auto may see no hope in the
    # tiny draft, which costs what its main model costs, and never draft.
    assert all(r["alpha"] for r in ours if r["num_draft"] == "2")
    assert all(bool(r["alpha"]) == bool(r["mean_draft"]) for r in ours if r["num_draft"])
    # The peer's agreement is reported, not required.
    assert all(r["same_as_single"].endswith("/3") for r in rows if r["engine"] != "ours")
    report = json.loads((tmp_path / "batch.json").read_text())
    # auto measured its costs in the untimed warm-up at each B, not in a timed call.
    ours = [r for r in report["rows"] if r["engine"] == "ours"]
    assert all(r["calibration_seconds"] < 0.01 * r["seconds"] for r in ours)
    assert report["identical"] and report["batch_sizes"] == [1, 2] and report["prompts"] == 3
    assert report["peers"]["transformers greedy"]["torch_threads"] == 1
    assert report["machine"] in run.stdout and "| B |" in run.stdout  # a Markdown table


def batch_against_transformers(converted_pair, hf_pair, prompts, output, *options: str):
    """The batch benchmark at B = 2 and 1, 10 greedy tokens of ``prompts``,
    transformers (one thread) beside ours, with ``options``."""
    return run_benchmark(
        *converted_pair,
        "--batch-sizes", "2,1",
        "--temp", "0",
        "--max-tokens", "10",
        "--prompts", str(prompts),
        "--compare-hf",
        "--hf-model", str(hf_pair[0]),
        "--hf-threads", "1",
        "--output", str(output),
        *options,
    )  # fmt: skip


def test_batch_benchmark_measures_beam_search(hf_pair, converted_pair, tmp_path):
    """--num-beams: ours and transformers' beam search at each B, each
    compared with ours at B = 1; transformers' at B = 1 is ours."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    run = batch_against_transformers(
        converted_pair, hf_pair, prompts, tmp_path / "beams", "--num-beams", "3"
    )
    assert run.returncode == 0, run.stderr
    rows = list(csv.DictReader((tmp_path / "beams.csv").open()))
    assert [(r["batch_size"], r["engine"], r["mode"], r["num_beams"]) for r in rows] == [
        (size, engine, "beam", "3") for size in ("1", "2") for engine in ("ours", "transformers")
    ]
    ours = [r for r in rows if r["engine"] == "ours"]
    assert all(r["identical"] == "True" and r["same_as_single"] == "3/3" for r in ours)
    assert next(r["same_as_single"] for r in rows if r["engine"] == "transformers") == "3/3"
    assert "fastest of ours: beam N=3" in run.stdout and "transformers beam N=3" in run.stdout


def test_batch_benchmark_refuses_what_it_cannot_measure(converted_pair, tmp_path):
    for setting, message in (
        (["--compare-ct2"], "--compare-ct2 needs --batch-sizes"),
        (["--batch-sizes", "1", "--prompt-lookup", "2"], "--prompt-lookup is not measured"),
        (["--batch-sizes", "0"], "argument --batch-sizes: '0' is not a list of integers >= 1"),
        (["--batch-sizes", "1", "--compare-hf"], "--compare-hf and --compare-ct2 need --hf-model"),
        (["--batch-sizes", "1", "--num-beams", "2", "--temp", "0,1"], "beam search does not"),
    ):
        run = run_benchmark(*converted_pair, *setting, "--output", str(tmp_path / "out"))
        assert run.returncode != 0
        assert run.stderr.startswith(f"error: {message}"), run.stderr


PROMPTS = [
    "translate English to German: the house is small.",
    "summarize: the dog sees the apple in the green garden.",
    "Le chat est très petit.",
]


@pytest.mark.parametrize("peer", ["transformers", "ctranslate2 float32", "ctranslate2 int8"])
def test_peer_workers_answer_batch_requests(peer, hf_pair, tmp_path):
    if peer.startswith("ctranslate2"):
        pytest.importorskip("ctranslate2")
        command = ("ctranslate2_worker.py", hf_pair[0], tmp_path, peer.split()[1], 1)
    else:
        command = ("transformers_worker.py", "--batch", hf_pair[0], 1)
    request = {"prompts": PROMPTS, "batch_size": 2, "max_tokens": 12}
    with Worker(*command) as worker:
        batched = worker.ask(request)
        one_by_one = worker.ask({**request, "batch_size": 1})
        alone = [worker.ask({**request, "prompts": [p], "batch_size": 1}) for p in PROMPTS]
    assert batched["seconds"] > 0
    tokens = batched["tokens"]
    # One answer per prompt, without the start token, cut before EOS ...
    assert len(tokens) == 3 and all(0 < len(t) <= 12 and EOS_ID not in t for t in tokens)
    # ... in input order (CTranslate2 sorts the prompts by length).
    assert one_by_one["tokens"] == [answer["tokens"][0] for answer in alone]
    if peer.startswith("ctranslate2"):
        # Converted once by CTranslate2's converter, then taken from the cache.
        assert worker.ready["convert_seconds"] > 0
        with Worker(*command) as again:
            assert again.ready["convert_seconds"] == 0
            assert again.ready["model_dir"] == worker.ready["model_dir"]


def test_build_writes_more_prompts_of_the_pairs_style(tokenizer_dir, tmp_path):
    from build_benchmark_pair import NUM_EVAL_PROMPTS, write_prompts

    (tmp_path / "hf-draft").mkdir()
    shutil.copy(tokenizer_dir / "spiece.model", tmp_path / "hf-draft")
    path = write_prompts(tmp_path, 0, 14)
    prompts = path.read_text().splitlines()
    assert path.name == "prompts-14.txt" and len(set(prompts)) == 14
    assert all(p.split(":")[0] in ("continue", "restore", "fill") for p in prompts)
    # The build's own evaluation prompts (prompts.txt) come first, the same draw then goes on.
    (tmp_path / "prompts.txt").write_text("".join(f"{p}\n" for p in prompts[:NUM_EVAL_PROMPTS]))
    assert write_prompts(tmp_path, 0, 12).read_text().splitlines() == prompts[:12]
    # A pair built with another seed has other prompts.txt: refused, not silently mixed.
    with pytest.raises(SystemExit, match="another --seed"):
        write_prompts(tmp_path, 1, 12)


def test_the_pair_grows_from_a_draft_given_with_its_settings(tmp_path):
    """``build_benchmark_pair.py --draft DIR``: a draft trained with the
    build's settings is copied into OUT/hf-draft (and taken again as it is
    there); one trained otherwise, one without its record, or another draft
    already in OUT are refused, and nothing is written over."""
    from build_benchmark_pair import TRAINING_RECORD, adopt_draft

    settings = {"seed": 0, "train_steps": 3000}
    source = tmp_path / "trained"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"weights")
    (source / TRAINING_RECORD).write_text(json.dumps({"settings": settings}))
    target = tmp_path / "out" / "hf-draft"
    target.parent.mkdir()
    adopt_draft(source, target, settings)
    assert (target / "model.safetensors").read_bytes() == b"weights"
    adopt_draft(source, target, settings)  # already there: taken as it is
    with pytest.raises(ValueError, match=r"other settings \(seed: seed 0\)"):
        adopt_draft(source, tmp_path / "elsewhere", {**settings, "seed": 1})
    with pytest.raises(ValueError, match=f"no {TRAINING_RECORD}"):
        adopt_draft(tmp_path / "out", tmp_path / "elsewhere", settings)
    (target / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ValueError, match="already holds another draft"):
        adopt_draft(source, target, settings)
    assert (target / "model.safetensors").read_bytes() == b"other weights"
    assert not (tmp_path / "elsewhere").exists()
