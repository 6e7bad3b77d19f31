"""Groups of processes (distributed.py): 2 ranks on this machine over the
ring backend, started as ``mlx.launch`` starts them (MLX_RANK and a
hostfile of 127.0.0.1 ports), each bounded in time and always stopped."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlx.utils import tree_flatten

import data_parallel
import distributed
from decoder import SpeculativeDecoder
from loading import load_model, load_tokenizer
from speculative import GenerationResult

ROOT = Path(__file__).resolve().parents[1]
MAIN_PY = str(ROOT / "main.py")
PROMPTS = [
    "translate English to German: the house is small.",
    "summarize: the cat sat on the mat and looked at the dog.",
    "the weather",
    "translate English to German: the old bridge across the river was closed.",
    "question: where is the house?",
]
MAX_TOKENS = 16
# Seconds a group may take: two processes importing mlx and transformers on a busy machine.
GROUP_SECONDS = 120
# Seconds the other rank may take to end once one failed.
FAILURE_SECONDS = 10


def free_ports(count: int) -> list[int]:
    """Ports of 127.0.0.1 that the system has just given out and taken back."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def start_group(commands: list[list[str]], tmp_path: Path) -> list[subprocess.Popen]:
    """One process per command (rank = its place), connected as a ring on
    127.0.0.1, as ``mlx.launch --backend ring`` starts them."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(len(commands))]))
    return [
        subprocess.Popen(
            [sys.executable, *command],
            cwd=tmp_path,
            env={
                **os.environ,
                "HF_HUB_OFFLINE": "1",
                "MLX_HOSTFILE": str(hostfile),
                "MLX_RANK": str(rank),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, command in enumerate(commands)
    ]


def finish(processes: list[subprocess.Popen], seconds: float) -> list[subprocess.CompletedProcess]:
    """Each process's exit status and output, once all have ended within
    ``seconds``; any still running then is killed, and the test fails."""
    deadline = time.monotonic() + seconds
    results = []
    try:
        for process in processes:
            stdout, stderr = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            results.append(
                subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
            )
    finally:
        stop(processes)
    return results


def stop(processes: list[subprocess.Popen]) -> None:
    """Kill whatever of ``processes`` still runs, and reap it."""
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def run_group(commands: list[list[str]], tmp_path: Path) -> list[subprocess.CompletedProcess]:
    """``start_group``, then ``finish``."""
    return finish(start_group(commands, tmp_path), GROUP_SECONDS)


def main_args(converted_pair, *args: str) -> list[str]:
    main_dir, draft_dir = converted_pair
    return [
        MAIN_PY,
        "--model-name",
        str(main_dir),
        "--draft-model-name",
        str(draft_dir),
        "-m",
        str(MAX_TOKENS),
        *args,
    ]


@pytest.fixture(scope="module")
def greedy_texts(decoding_pair) -> list[str]:
    """Each of PROMPTS decoded greedily by the whole main model alone, in this process."""
    main, draft, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(main, draft, tokenizer)
    return [decoder.generate(prompt, max_tokens=MAX_TOKENS).text for prompt in PROMPTS]


def assert_silent(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stderr
    assert result.stdout == "" and result.stderr == "", "a rank other than 0 wrote"


# --- tensor parallel ---------------------------------------------------------


def test_tensor_parallel_prompt_equals_single_process(converted_pair, greedy_texts, tmp_path):
    """Split across 2 ranks, --prompt's greedy text is the whole model's;
    rank 0 alone writes it and the summary."""
    command = main_args(converted_pair, "--prompt", PROMPTS[0], "--num-draft", "3")
    first, second = run_group([command, command], tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout == greedy_texts[0] + "\n"
    assert "(split across 2 processes)" in first.stderr
    assert "Draft tokens accepted" in first.stderr
    assert_silent(second)


def test_tensor_parallel_sampling_takes_rank_zeros_drawn_seed(
    converted_pair, decoding_pair, tmp_path
):
    """Sampled without a seed, the ranks take the seed rank 0 drew (each
    drawing its own would split the noise): the text is the whole model's
    with the seed the summary names."""
    command = main_args(converted_pair, "--prompt", PROMPTS[1], "--temp", "0.8", "--num-draft", "3")
    first, second = run_group([command, command], tmp_path)
    assert first.returncode == 0, first.stderr
    assert_silent(second)
    seed = int(re.search(r"Seed: (\d+)", first.stderr)[1])
    main, draft, tokenizer = decoding_pair
    alone = SpeculativeDecoder(main, draft, tokenizer, num_draft=3).speculative_decode(
        PROMPTS[1], max_tokens=MAX_TOKENS, temp=0.8, seed=seed
    )
    assert first.stdout == alone.text + "\n"


def test_tensor_parallel_prompts_auto_equals_single_process(converted_pair, greedy_texts, tmp_path):
    """--prompts with auto's draft length (rank 0's choices) and --output:
    every prompt's greedy text is the whole model's; one file, rank 0's."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    output = tmp_path / "out.jsonl"
    command = main_args(
        converted_pair,
        "--prompts",
        str(prompts),
        "--batch-size",
        "2",
        "--num-draft",
        "auto",
        "--prompt-lookup",
        "2",
        "--output",
        str(output),
    )
    first, second = run_group([command, command], tmp_path)
    assert first.returncode == 0, first.stderr
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert {record["index"]: record["text"] for record in records} == dict(enumerate(greedy_texts))
    assert "g auto" in first.stderr
    assert_silent(second)


def test_each_rank_holds_its_share(converted, quantized, tmp_path):
    """Each rank loads only its share of the main model: the bytes active
    after loading are those of the parameters it holds whole (embeddings,
    norms, output projection) and half of the others (the position bias
    tables aside: a slice that small may stay in its table's buffer); its
    peak while loading adds at most the largest layer. A 4-bit model split
    across 2 ranks decodes the whole model's greedy tokens."""
    path, four_bit = converted("split"), quantized("gated_untied_64", bits=4, group_size=32)
    script = f"""
import sys; sys.path.insert(0, {str(ROOT)!r})
import json, cpu, mlx.core as mx, distributed
from loading import load_model
from decoder import SpeculativeDecoder
from loading import load_tokenizer
group = distributed.init_group()
model = load_model({str(path)!r}, group)
active, peak = mx.get_active_memory(), mx.get_peak_memory()
decoder = SpeculativeDecoder(load_model({str(four_bit)!r}, group), None, load_tokenizer({str(four_bit)!r}), group=group)
tokens = decoder.generate({PROMPTS[1]!r}, max_tokens={MAX_TOKENS}).tokens
print(json.dumps({{"active": active, "peak": peak, "tokens": tokens}}))
"""
    results = run_group([["-c", script]] * 2, tmp_path)
    assert all(result.returncode == 0 for result in results), results[0].stderr
    whole = load_model(path)
    replicated, split = 0, 0
    for name, parameter in tree_flatten(whole.parameters()):
        if name.startswith(("shared", "lm_head")) or "norm" in name:
            replicated += parameter.nbytes
        else:
            split += parameter.nbytes
    tables = sum(
        stack.position_bias.embeddings.weight.nbytes for stack in (whole.encoder, whole.decoder)
    )
    largest_layer = max(
        sum(parameter.nbytes for _, parameter in tree_flatten(layer.parameters()))
        for layer in whole.encoder.layers + whole.decoder.layers
    )
    share = replicated + split // 2
    four_bit_whole = SpeculativeDecoder(load_model(four_bit), None, load_tokenizer(four_bit))
    expected_tokens = four_bit_whole.generate(PROMPTS[1], max_tokens=MAX_TOKENS).tokens
    for result in results:
        report = json.loads(result.stdout)
        assert share <= report["active"] <= share + tables // 2
        assert report["peak"] <= share + tables // 2 + largest_layer
        assert report["tokens"] == expected_tokens


# --- data parallel -----------------------------------------------------------


def test_data_parallel_equals_single_process(converted_pair, greedy_texts, tmp_path):
    """--data-parallel: each rank decodes a share of the prompts; rank 0
    writes every prompt's line in input order, each the whole model's
    greedy text, and the summary counts every prompt."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    command = main_args(
        converted_pair, "--prompts", str(prompts), "--batch-size", "2", "--data-parallel"
    )
    first, second = run_group([command, command], tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == greedy_texts
    assert f"Prompts: {len(PROMPTS)} of {len(PROMPTS)} finished" in first.stderr
    assert_silent(second)


PLAN_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
import distributed
from drafting import FixedDraftLength, RowState

group = distributed.init_group()
# Each rank's own rule would draft another number of tokens.
rule = distributed.shared_draft_length(FixedDraftLength(3 + 4 * group.rank()), group)
print(json.dumps([rule.plan([RowState(True)], [9], None) for _ in range(2)]))
"""


def test_every_rank_takes_rank_zeros_plan(tmp_path):
    """In a group, a round's draft lengths are rank 0's plan, on every rank
    (one sum per round), whatever each rank's own rule says."""
    command = ["-c", PLAN_SCRIPT.format(root=str(ROOT))]
    results = run_group([command, command], tmp_path)
    plans = [json.loads(result.stdout) for result in results]
    assert all(result.returncode == 0 for result in results), [r.stderr for r in results]
    assert plans[0] == plans[1] == [{"model": 3, "lookup": 3}] * 2


def test_balanced_shares():
    """The costliest prompt first, each to the least loaded rank; shares in input order."""
    assert data_parallel.balanced_shares([5, 1, 4, 2, 3], 2) == [[0, 1, 3], [2, 4]]
    assert data_parallel.balanced_shares([1], 3) == [[0], [], []]


def test_result_round_trip(decoding_pair):
    """A finished result survives data parallel's numbers whole."""
    tokenizer = decoding_pair[2]
    result = GenerationResult(
        [5, 17, 9],
        text=tokenizer.decode([5, 17, 9], skip_special_tokens=True),
        n_draft=4,
        n_accepted=2,
        n_rejected=1,
        n_steps=2,
        draft_lengths=[3, 1],
        n_lookup_rounds=1,
        prompt_tokens=7,
        prompt_time=0.5,
        calibration_time=0.25,
        elapsed=1.5,
        finished=True,
        seed=2**64 - 12345,
    )
    row = data_parallel.packed(11, result, MAX_TOKENS + 1)
    assert data_parallel.unpacked(row, MAX_TOKENS + 1, tokenizer) == (11, result)


# --- failures ----------------------------------------------------------------


def assert_error_ends(result: subprocess.CompletedProcess, words: str) -> None:
    """A rank that ended with status 1 and, last, one ``error:`` line holding ``words``."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("error:") and words in lines[-1], result.stderr


def test_failing_rank_ends_the_group(converted_pair, tmp_path):
    """Bad input on one rank (a model path missing there): it says so, and
    rank 0 ends at its next sum with an error naming the broken group."""
    good = main_args(converted_pair, "--prompt", PROMPTS[0])
    bad = [*good, "--model-name", str(tmp_path / "missing")]
    first, second = run_group([good, bad], tmp_path)
    assert_error_ends(second, "rank 1 of 2: model")
    assert_error_ends(first, distributed.GROUP_BROKEN)
    assert first.stdout == ""


def test_killed_rank_ends_the_group(converted_pair, tmp_path):
    """A rank killed while the group decodes (data parallel: the ranks sum
    only once per round) ends rank 0 within seconds, with a one-line error."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 40) + "\n")
    command = main_args(converted_pair, "--prompts", str(prompts), "--data-parallel", "-m", "200")
    processes = start_group([command, command], tmp_path)
    try:
        selector = selectors.DefaultSelector()
        selector.register(processes[0].stdout, selectors.EVENT_READ)
        assert selector.select(timeout=GROUP_SECONDS), "rank 0 wrote no line"
        processes[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        first = finish(processes[:1], FAILURE_SECONDS)[0]
        assert time.monotonic() - killed < FAILURE_SECONDS
    finally:
        stop(processes)
    assert_error_ends(first, distributed.GROUP_BROKEN)


def launcher_ports() -> int:
    """A port of 127.0.0.1 whose next one is free too, for ``mlx.launch
    --starting-port`` (rank r listens on port + r)."""
    for _ in range(20):
        port = free_ports(1)[0]
        with socket.socket() as first, socket.socket() as second:
            try:
                first.bind(("127.0.0.1", port))
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two free ports in a row")


def rank_process(launcher: subprocess.Popen, rank: int) -> int:
    """The process id of ``rank`` among ``launcher``'s children (it sets
    ``MLX_RANK`` and then runs the command in place of its shell)."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            parent = re.search(r"PPid:\s+(\d+)", status.read_text())
            environment = (status.parent / "environ").read_bytes().split(b"\0")
        except OSError:  # ended meanwhile, or another user's
            continue
        if parent and int(parent[1]) == launcher.pid and f"MLX_RANK={rank}".encode() in environment:
            return int(status.parent.name)
    raise AssertionError(f"mlx.launch has no rank {rank}")


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks through /proc")
def test_rank_terminated_under_mlx_launch(converted_pair, tmp_path):
    """Under the real ``mlx.launch``: rank 1 gets SIGTERM mid-run. It says
    so in its own line; the launcher then sends rank 0 SIGTERM, and rank 0
    writes its summary of what finished and its own ``error:`` line. Unless
    MLX never returns from rank 0's sum (the ring backend says it failed its
    pending tasks): then only the line, TERMINATE_GRACE seconds later."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 40) + "\n")
    # Data parallel: the ranks sum between rounds, where a lost peer is
    # usually an error, not inside a pass (see test_sigterm_ends_a_rank_stuck_in_mlx).
    command = main_args(converted_pair, "--prompts", str(prompts), "-m", "200", "--data-parallel")
    launcher = subprocess.Popen(
        [
            str(Path(sys.executable).with_name("mlx.launch")),
            *("-n", "2", "--backend", "ring", "--starting-port", str(launcher_ports())),
            *("--python", sys.executable, *command),
        ],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        selector = selectors.DefaultSelector()
        selector.register(launcher.stdout, selectors.EVENT_READ)
        assert selector.select(timeout=GROUP_SECONDS), "rank 0 wrote no line"
        os.kill(rank_process(launcher, 1), signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=FAILURE_SECONDS * 3)
    finally:
        stop([launcher])
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 2, stderr
    assert any(line.startswith("error: rank 1 of 2: stopped by SIGTERM") for line in errors)
    assert any(not line.startswith("error: rank") for line in errors), stderr
    assert stdout.strip(), "rank 0's finished lines"
    if "Failing pending tasks" not in stderr:  # rank 0's main thread returned from MLX
        assert re.search(r"Prompts: \d+ of 200 finished", stderr), stderr


STUCK_RANK = """
import ctypes, sys
sys.path.insert(0, {root!r})
import distributed

class Group:  # rank 1 of 2, as far as the failure lines go
    def rank(self): return 1
    def size(self): return 2

libc, mutex = ctypes.CDLL(None), ctypes.create_string_buffer(64)  # zeros: a plain mutex
with distributed.failures_end_group(Group()):
    libc.pthread_mutex_lock(mutex)
    print("stuck", flush=True)
    # Locked again: waits in C for ever, running no signal handler, as MLX
    # can wait on a sum whose peer has gone.
    libc.pthread_mutex_lock(mutex)
"""


@pytest.mark.parametrize("reader", ["reading", "gone"])
def test_sigterm_ends_a_rank_stuck_in_mlx(tmp_path, reader):
    """A rank whose main thread waits in native code (as in a sum whose
    peer has gone) still ends after SIGTERM: TERMINATE_GRACE seconds later,
    with its line, status 1; also when nobody reads its standard error any
    more (its line then fails to be written, as under a launcher that left)."""
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK_RANK.format(root=str(ROOT))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline() == "stuck\n"
        time.sleep(0.5)  # into the native wait
        if reader == "gone":
            process.stderr.close()
        process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        if reader == "gone":
            process.wait(timeout=distributed.TERMINATE_GRACE + FAILURE_SECONDS)
            stderr = None
        else:
            _, stderr = process.communicate(timeout=distributed.TERMINATE_GRACE + FAILURE_SECONDS)
        waited = time.monotonic() - sent
    finally:
        stop([process])
    assert process.returncode == 1
    if stderr is None:
        return
    assert stderr == f"error: rank 1 of 2: {distributed.TERMINATED}\n"
    assert waited >= distributed.TERMINATE_GRACE


def test_data_parallel_alone_says_so(converted_pair, tmp_path):
    """--data-parallel in a process started alone: a note, then every prompt decoded."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2]) + "\n")
    result = subprocess.run(
        [sys.executable, *main_args(converted_pair, "--prompts", str(prompts), "--data-parallel")],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=GROUP_SECONDS,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "note: --data-parallel: this process was not started in a group" in result.stderr
    assert len(result.stdout.splitlines()) == 2


def test_indivisible_model_refused():
    """Heads or a feed-forward width that do not divide among the ranks, or
    quantized groups that would be cut: a one-line reason."""
    from model import ModelArgs, check_divisible

    sizes = {"vocab_size": 100, "d_model": 64, "num_layers": 1, "num_decoder_layers": 1}
    args = ModelArgs(**sizes, d_kv=16, d_ff=90, num_heads=3)
    with pytest.raises(ValueError, match="its 3 attention heads do not divide by 2"):
        check_divisible(args, 2)
    args.num_heads = 4
    with pytest.raises(ValueError, match="its feed-forward width 90 does not divide by 4"):
        check_divisible(args, 4)
    args.d_ff = 128
    check_divisible(args, 4)
    args.quantization = {"group_size": 64, "bits": 4, "mode": "affine"}
    with pytest.raises(ValueError, match="the 32 input columns .* not whole groups of 64"):
        check_divisible(args, 2)


def test_memory_check_counts_each_rank_share(converted_pair, monkeypatch):
    """The memory check counts each rank's share of the main model: what
    one process would need, less a byte, refuses the pair alone and fits
    when the main model is split in 2 (its weights and caches halved)."""
    import loading
    from loading import weights_file

    paths = list(converted_pair)
    weights = [weights_file(path).stat().st_size for path in paths]
    rows = [loading.runtime_bytes(path, 20, MAX_TOKENS) for path in paths]
    needed = sum(weights) + sum(rows)
    monkeypatch.setattr(loading, "available_memory", lambda: needed - 1)
    with pytest.raises(MemoryError):
        loading.check_memory("main", paths, 20, MAX_TOKENS)
    loading.check_memory("main", paths, 20, MAX_TOKENS, shards=2)
    split_needed = (weights[0] + rows[0]) / 2 + weights[1] + rows[1]
    monkeypatch.setattr(loading, "available_memory", lambda: int(split_needed) - 1)
    with pytest.raises(MemoryError):
        loading.check_memory("main", paths, 20, MAX_TOKENS, shards=2)


def test_data_parallel_needs_prompts(capsys):
    """--data-parallel spreads a prompt file: with one prompt, a one-line refusal."""
    import main as main_module

    with pytest.raises(SystemExit) as exit_info:
        main_module.main(["--data-parallel", "--prompt", PROMPTS[0]])
    assert exit_info.value.code != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--data-parallel goes with --prompts FILE" in error
