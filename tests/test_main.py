"""main.py end to end: each test launches ``python main.py`` on converted tiny models."""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import io
import json
import os
import pty
import random
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import mlx.core as mx
import pytest
from fixtures import train_tokenizer

import cli
import convert
import loading
import main as main_module
from auto import Auto
from cli import TF32_VARIABLE
from decoder import SpeculativeDecoder
from loading import load_model, load_tokenizer, script_command
from speculative import GenerationResult

ROOT = Path(__file__).resolve().parents[1]
MAIN_PY = ROOT / "main.py"
PROMPT = "translate English to German: the house is small."
MAX_TOKENS = 20
SEPARATOR = "=" * 40
STATS = re.compile(
    r"Prompt: (\d+) tokens, ([\d.]+) tokens/s\n"
    r"Generation: (\d+) tokens, ([\d.]+) tokens/s\n"
    r"Main-model passes: (\d+)\n"
)
ACCEPTANCE = re.compile(r"Draft tokens accepted: (\d+)/(\d+) \(([\d.]+)%\)")
DRAFTING = re.compile(
    r"Drafting: (.+?), g (= \d+|auto: \d+ of \d+ rounds drafted, average [\d.]+, range \d+-\d+"
    r"|auto: no round drafted)"
)
COLOUR_CODE = re.compile(r"\x1b\[\d+m")
PEAK_MEMORY = re.compile(r"Peak memory: ([\d.]+) [MG]B")
CALIBRATION = re.compile(r"Calibration: ([\d.]+) s \(auto's one-time cost measurement\)")
GENERATE = ["--prompt", PROMPT, "-m", str(MAX_TOKENS)]
SAMPLE = ["--temp", "1", "--top-p", "0.9", "--top-k", "20", "--seed", "3"]


# --- helpers -----------------------------------------------------------------


def run_main(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python main.py ARGS`` in ``cwd``, offline."""
    return run_main_concurrently(list(args), cwd=cwd)[0]


def start_main(args, cwd: Path) -> subprocess.Popen:
    """``python main.py ARGS`` started in ``cwd``, offline, its output piped as text."""
    return subprocess.Popen(
        [sys.executable, str(MAIN_PY), *args],
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_main_concurrently(*arg_lists: list[str], cwd: Path) -> list[subprocess.CompletedProcess]:
    """Several ``python main.py`` runs at once (each spends seconds importing mlx)."""
    processes = [start_main(args, cwd) for args in arg_lists]
    results = []
    for process in processes:
        try:
            stdout, stderr = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        results.append(
            subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
        )
    return results


def run_main_with_input(*args: str, stdin: str, cwd: Path) -> subprocess.CompletedProcess:
    """``python main.py ARGS`` in ``cwd``, offline, with ``stdin`` as its standard input."""
    return subprocess.run(
        [sys.executable, str(MAIN_PY), *args],
        input=stdin,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def assert_one_line_error(result: subprocess.CompletedProcess) -> str:
    """A failed run whose stderr, after any "Loading ..." lines, is exactly one
    ``error:`` line; returns that line."""
    assert result.returncode != 0, f"main.py accepted bad input; its output:\n{result.stdout}"
    assert "Traceback" not in result.stderr, f"main.py crashed:\n{result.stderr}"
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and not line.startswith("Loading ")
    ]
    assert len(lines) == 1, f"expected one error line, got:\n{result.stderr}"
    assert lines[0].startswith("error:"), result.stderr
    return lines[0]


def generated_text(stdout: str) -> str:
    """The text main.py generated: its whole standard output, less the newline ending it."""
    assert stdout.endswith("\n") and SEPARATOR not in stdout, stdout
    return stdout[:-1]


def stats(stderr: str) -> tuple[int, float, int]:
    """(tokens generated, generation tokens/s, main-model passes) from the
    summary main.py writes to standard error, after checking the prompt and
    peak-memory lines."""
    match = STATS.search(stderr)
    assert match, stderr
    prompt_tokens, prompt_tokens_per_second = int(match[1]), float(match[2])
    assert prompt_tokens > 0 and prompt_tokens_per_second > 0, stderr
    peak = PEAK_MEMORY.search(stderr)
    assert peak and float(peak[1]) > 0, stderr
    return int(match[3]), float(match[4]), int(match[5])


def copy_model(source: Path, destination: Path) -> Path:
    shutil.copytree(source, destination)
    return destination


# --- fixtures ----------------------------------------------------------------


@pytest.fixture(scope="module")
def models(converted_pair) -> tuple[Path, Path]:
    """(main directory, draft directory), as absolute paths."""
    main_dir, draft_dir = converted_pair
    return main_dir.resolve(), draft_dir.resolve()


@pytest.fixture(scope="module")
def greedy_reference(models):
    """The main model's greedy output for PROMPT, computed in this process."""
    main_dir, _ = models
    decoder = SpeculativeDecoder(load_model(main_dir), None, load_tokenizer(main_dir))
    result = decoder.generate(PROMPT, max_tokens=MAX_TOKENS)
    assert result.text.strip(), "the fixture model generates no text"
    return result


def model_args(models) -> list[str]:
    main_dir, draft_dir = models
    return ["--model-name", str(main_dir), "--draft-model-name", str(draft_dir)]


# --- successful runs ---------------------------------------------------------------


def test_speculative_run_prints_greedy_text_and_stats(models, greedy_reference, tmp_path):
    """``main.py > out.txt`` writes the generated text and a newline to the
    file, nothing else; the rest (Loading lines, the summary) is on stderr."""
    result = run_main(*model_args(models), *GENERATE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == greedy_reference.text + "\n"
    assert result.stderr.startswith(f"Loading {models[0]}\nLoading draft {models[1]}\n")
    tokens, tokens_per_second, passes = stats(result.stderr)
    assert tokens == len(greedy_reference.tokens)
    assert tokens_per_second > 0
    assert 1 <= passes <= tokens + 1
    match = ACCEPTANCE.search(result.stderr)
    assert match, result.stderr
    accepted, proposed, percent = int(match[1]), int(match[2]), float(match[3])
    assert 0 <= accepted <= proposed
    assert proposed > 0
    assert percent == pytest.approx(100 * accepted / proposed, abs=0.05)


# Runs a script (argv[1], with the arguments after it) as ``python SCRIPT``
# would, where torch cannot be imported: the README's install has none.
WITHOUT_TORCH = r"""
import os, runpy, sys

sys.modules["torch"] = None  # importlib.util.find_spec("torch") is None now
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_without_torch_no_pytorch_advice(hf_pair, greedy_reference, tmp_path):
    """As installed by the README (no torch), convert.py and main.py work and
    print nothing about PyTorch: they use only transformers' tokenizers."""
    out = tmp_path / "main"
    environment = {**os.environ, "HF_HUB_OFFLINE": "1"}
    conversion, generation = (
        subprocess.run(
            [sys.executable, "-c", WITHOUT_TORCH, str(ROOT / script), *args],
            cwd=tmp_path,
            env=environment,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        for script, args in [
            ("convert.py", ["--model", str(hf_pair[0]), "--out", str(out), "--dtype", "float32"]),
            ("main.py", ["--model-name", str(out), "--regular-decode", *GENERATE]),
        ]
    )
    for result in (conversion, generation):
        assert result.returncode == 0, result.stderr
        assert "PyTorch" not in result.stderr
    assert generated_text(generation.stdout) == greedy_reference.text


def test_prompt_from_standard_input(models, greedy_reference, tmp_path):
    """``--prompt -`` reads the prompt from standard input; the summary counts its tokens."""
    result, empty = (
        run_main_with_input(
            *model_args(models), "--prompt", "-", "-m", str(MAX_TOKENS), stdin=text, cwd=tmp_path
        )
        for text in (PROMPT, " \n")
    )
    assert result.returncode == 0, result.stderr
    assert generated_text(result.stdout) == greedy_reference.text
    prompt_tokens = len(load_tokenizer(models[0])(PROMPT).input_ids)
    assert STATS.search(result.stderr)[1] == str(prompt_tokens)
    assert "prompt is empty" in assert_one_line_error(empty)


def test_regular_decode_prints_the_same_text(models, greedy_reference, tmp_path):
    main_dir, _ = models
    result = run_main("--model-name", str(main_dir), "--regular-decode", *GENERATE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert generated_text(result.stdout) == greedy_reference.text
    tokens, _, passes = stats(result.stderr)
    assert tokens == len(greedy_reference.tokens)
    assert passes in (tokens, tokens + 1)  # one token per pass, plus a final EOS pass
    assert "Draft tokens accepted" not in result.stderr
    assert "Loading draft" not in result.stderr


@pytest.mark.parametrize("regular", [False, True], ids=["speculative", "regular"])
def test_sampling_is_reproducible_with_a_seed(regular, models, tmp_path):
    args = [*model_args(models), *GENERATE, *SAMPLE] + (["--regular-decode"] if regular else [])
    first, second = run_main_concurrently(args, args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert generated_text(first.stdout).strip()
    assert generated_text(first.stdout) == generated_text(second.stdout)
    assert stats(first.stderr)[0] == stats(second.stderr)[0]


SEED_LINE = re.compile(r"^Seed: (\d+)$", re.MULTILINE)


def test_a_seeded_text_is_the_regular_text_whatever_drafts_it(models, tmp_path):
    """--seed at temperature > 0: the draft model (g = 3 and auto), prompt
    lookup and hybrid drafting print --regular-decode's text, and the
    summary names the seed."""
    modes = [
        ["--regular-decode"],
        ["--num-draft", "3"],
        ["--num-draft", "auto"],
        ["--draft-model-name", "none", "--prompt-lookup", "2"],
        ["--prompt-lookup", "3", "--num-draft", "auto"],
    ]
    runs = run_main_concurrently(
        *[[*model_args(models), *GENERATE, *SAMPLE, *mode] for mode in modes], cwd=tmp_path
    )
    for run in runs:
        assert run.returncode == 0, run.stderr
        assert SEED_LINE.search(run.stderr)[1] == "3", run.stderr
    texts = [generated_text(run.stdout) for run in runs]
    assert texts[0].strip()
    assert texts == [texts[0]] * len(modes)


def test_without_a_seed_one_is_drawn_and_named(models, tmp_path):
    """An unseeded sampled run names its seed in the summary, and with
    --prompts --output in every JSON line; given again, it repeats the text."""
    args = [*model_args(models), *GENERATE, "--temp", "1"]
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    batch = [*model_args(models), "--prompts", "prompts.txt", *BATCH, "--temp", "1"]
    first, second, batched = run_main_concurrently(
        args, args, [*batch, "--output", "out.jsonl"], cwd=tmp_path
    )
    seeds = [SEED_LINE.search(run.stderr)[1] for run in (first, second, batched)]
    assert seeds[0] != seeds[1]
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {str(record["seed"]) for record in records} == {seeds[2]}
    again, batched_again = run_main_concurrently(
        [*args, "--seed", seeds[0]], [*batch, "--seed", seeds[2]], cwd=tmp_path
    )
    assert generated_text(again.stdout) == generated_text(first.stdout)
    texts = {record["index"]: cli.one_line(record["text"]) for record in records}
    assert batched_again.stdout == "".join(f"{texts[i]}\n" for i in sorted(texts))


def run_main_on_a_terminal(
    *args: str, cwd: Path, stream: str = "stdout", prompt_bar_delay: float | None = None
) -> tuple[str, str]:
    """``python main.py ARGS`` with its standard output (or, ``stream`` =
    "stderr", its standard error) on a pseudo-terminal; what it wrote there,
    with the terminal's line ends undone, and what it wrote to the other.
    ``prompt_bar_delay`` replaces ``main.PROMPT_BAR_DELAY``."""
    command = [sys.executable, str(MAIN_PY), *args]
    if prompt_bar_delay is not None:
        code = (
            f"import sys; sys.path.insert(0, {str(ROOT)!r}); import main; "
            f"main.PROMPT_BAR_DELAY = {prompt_bar_delay}; sys.exit(main.main(sys.argv[1:]))"
        )
        command = [sys.executable, "-c", code, *args]
    terminal, child_end = pty.openpty()
    # 24 rows of 80 columns: a new pseudo-terminal has 0 of each, too narrow for a progress bar.
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    streams = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, stream: child_end}
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        stdin=subprocess.DEVNULL,
        **streams,
    )
    os.close(child_end)
    output = b""
    while True:
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # Linux: the child closed the terminal
            break
        if not chunk:
            break
        output += chunk
    os.close(terminal)
    other = (process.stderr if stream == "stdout" else process.stdout).read().decode()
    assert process.wait(timeout=300) == 0, other if stream == "stdout" else output
    return output.decode().replace("\r\n", "\n"), other


def test_show_draft_colours_accepted_draft_tokens_on_a_terminal_only(
    models, greedy_reference, tmp_path
):
    args = [*model_args(models), *GENERATE, "--show-draft", "--num-draft", "3"]
    piped = run_main(*args, cwd=tmp_path)
    assert piped.returncode == 0, piped.stderr
    assert "\x1b" not in piped.stdout
    assert generated_text(piped.stdout) == greedy_reference.text
    on_terminal, summary = run_main_on_a_terminal(*args, cwd=tmp_path)
    coloured = generated_text(on_terminal)
    assert COLOUR_CODE.search(coloured), on_terminal
    assert COLOUR_CODE.sub("", coloured) == greedy_reference.text
    accepted = int(ACCEPTANCE.search(summary)[1])
    assert accepted > 0


@pytest.mark.parametrize(
    ("args", "mode", "draft_length"),
    [
        (["--num-draft", "auto"], "draft model", "auto"),
        (["--draft-model-name", "none", "--prompt-lookup", "2"], "prompt lookup", "= 5"),
        (["--prompt-lookup", "3", "--num-draft", "auto"], "hybrid", "auto"),
    ],
    ids=["auto", "lookup", "hybrid"],
)
def test_drafting_modes_print_the_greedy_text_and_their_mode(
    args, mode, draft_length, models, greedy_reference, tmp_path
):
    result = run_main(*model_args(models), *GENERATE, *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert generated_text(result.stdout) == greedy_reference.text
    assert ("Loading draft" in result.stderr) == (mode != "prompt lookup")
    drafting = DRAFTING.search(result.stderr)
    assert drafting, result.stderr
    assert drafting[1] == mode and drafting[2].startswith(draft_length)
    assert bool(CALIBRATION.search(result.stderr)) == (draft_length == "auto"), result.stderr


def test_calibration_is_apart_from_prompt_and_generation_speed(models, monkeypatch, capsys):
    """auto's cost measurement, made to last a second, is the summary's
    Calibration line and lowers neither the prompt's tokens/s nor the
    generation's."""
    measure_costs = Auto.measure_costs

    def slow_measure_costs(*args, **kwargs):
        time.sleep(1)
        return measure_costs(*args, **kwargs)

    monkeypatch.setattr(Auto, "measure_costs", slow_measure_costs)
    assert main_module.main([*model_args(models), *GENERATE, "--num-draft", "auto"]) == 0
    summary = capsys.readouterr().err
    assert float(CALIBRATION.search(summary)[1]) >= 1, summary
    match = STATS.search(summary)
    prompt_tokens, prompt_speed = int(match[1]), float(match[2])
    tokens, speed = int(match[3]), float(match[4])
    assert prompt_speed > prompt_tokens and speed > tokens, summary  # each took under a second


# Runs main.py (argv[2:]) as ``python main.py`` would, and sends the process
# SIGINT, as Ctrl-C does, the first time it imports the module named argv[1].
INTERRUPTED_AT_IMPORT = r"""
import builtins, os, runpy, signal, sys

target, main_py = sys.argv[1], sys.argv[2]
real_import = builtins.__import__


def interrupting_import(name, *args, **kwargs):
    global target
    if name == target:
        target = None
        os.kill(os.getpid(), signal.SIGINT)
    return real_import(name, *args, **kwargs)


builtins.__import__ = interrupting_import
sys.argv = sys.argv[2:]
sys.path.insert(0, os.path.dirname(main_py))
runpy.run_path(main_py, run_name="__main__")
"""


@pytest.mark.parametrize("module", ["cpu", "transformers"])
def test_ctrl_c_while_importing_says_interrupted(module, models, tmp_path):
    """Ctrl-C during the imports: exit status 130 and one "interrupted" line,
    never a traceback (cpu is imported first, transformers last and slowest)."""
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_AT_IMPORT, module, str(MAIN_PY), *model_args(models)],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert (result.returncode, result.stderr, result.stdout) == (130, "interrupted\n", "")


def interrupt_main(*args: str, cwd: Path, wait) -> tuple[int, str, str]:
    """``python main.py ARGS`` in ``cwd``, sent SIGINT (as by Ctrl-C) once
    ``wait(process)`` returns what it read of standard output; the exit
    status, all of standard output and standard error."""
    process = start_main(args, cwd)
    try:
        read = wait(process)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        process.kill()
    return process.returncode, read + stdout, stderr


def test_ctrl_c_while_generating_keeps_the_text_and_summary(models, tmp_path):
    """Ctrl-C once text is streaming: the line ended, "interrupted" and the
    summary of what was generated on stderr, exit status 130, no traceback."""
    main_dir, _ = models
    returncode, stdout, stderr = interrupt_main(
        *("--model-name", str(main_dir), "--regular-decode", "--prompt", PROMPT, "-m", "1000000"),
        cwd=tmp_path,
        wait=lambda process: process.stdout.read(1),  # generation has started
    )
    assert returncode == 130, stderr
    assert "Traceback" not in stderr
    text = generated_text(stdout)
    lines = stderr.splitlines()
    assert lines[1:3] == ["interrupted", SEPARATOR], stderr
    assert stats(stderr)[0] >= len(text.split()) > 0


def test_drafting_summary_says_which_g_ran():
    drafted = GenerationResult(tokens=[], draft_lengths=[1, 3, 2], n_steps=5, n_lookup_rounds=2)
    summary = main_module.drafting_summary(drafted, "draft model", "auto")
    assert summary == "Drafting: draft model, g auto: 3 of 5 rounds drafted, average 2.0, range 1-3"
    summary = main_module.drafting_summary(drafted, "hybrid", 4)
    assert summary == "Drafting: hybrid, g = 4; prompt lookup drafted 2 of 5 rounds"
    plain = GenerationResult(tokens=[], n_steps=5)
    summary = main_module.drafting_summary(plain, "draft model", "auto")
    assert summary == "Drafting: draft model, g auto: no round drafted"


def test_help_shows_the_defaults():
    help_text = " ".join(main_module.build_parser().format_help().split())
    for default in ("t5-11b", "t5-small", "5", "100", "0.0", "1.0", "0"):
        assert f"(default: {default})" in help_text
    assert "(default: None)" not in help_text and "(default: False)" not in help_text


@pytest.mark.parametrize("command", ["main", "server"])
@pytest.mark.parametrize("user_setting", [None, "1"])
def test_commands_ask_for_full_float32_unless_the_user_chose(command, user_setting, monkeypatch):
    """main.py and server.py set MLX_ENABLE_TF32=0 before they run (MLX on
    NVIDIA and M5-class GPUs multiplies float32 at TF32 precision without
    it), keep a value the user set, and say so in their help."""
    module = importlib.import_module(command)
    seen = []
    runner = "run" if command == "main" else "serve"
    monkeypatch.setattr(
        module, runner, lambda args, *group: seen.append(os.environ.get(TF32_VARIABLE)) or 0
    )
    if user_setting is None:
        monkeypatch.delenv(TF32_VARIABLE, raising=False)
    else:
        monkeypatch.setenv(TF32_VARIABLE, user_setting)
    assert module.main(["--model-name", "any"]) == 0
    assert seen == [user_setting or "0"]
    assert "MLX_ENABLE_TF32=0" in " ".join(module.build_parser().format_help().split())


def test_the_commands_import_no_mlx_before_they_run():
    """Importing main and server loads no MLX, so the setting above comes
    before MLX starts."""
    probe = "import sys; import main, server; print('mlx.core' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_model_names_resolve_under_mlx_models(models, greedy_reference, tmp_path):
    """``NAME`` -> mlx_models/NAME and ``org/NAME`` -> mlx_models/org-NAME, from the cwd."""
    main_dir, draft_dir = models
    (tmp_path / "mlx_models").mkdir()
    (tmp_path / "mlx_models" / "tiny-main").symlink_to(main_dir, target_is_directory=True)
    copy_model(draft_dir, tmp_path / "mlx_models" / "org-tiny")
    names = ["--model-name", "tiny-main", "--draft-model-name", "org/tiny"]
    result = run_main(*names, *GENERATE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"Loading {Path('mlx_models', 'tiny-main')}" in result.stderr
    assert f"Loading draft {Path('mlx_models', 'org-tiny')}" in result.stderr
    assert generated_text(result.stdout) == greedy_reference.text


def test_resolve_model_finds_convert_default_output(tmp_path, monkeypatch):
    """Where convert.py writes a hub id by default is where main.py looks for it."""
    monkeypatch.chdir(tmp_path)
    for name in ("t5-small", "google/flan-t5-small"):
        out = convert.default_output(name)
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        (out / "weights.safetensors").write_bytes(b"")
        assert loading.resolve_model(name) == out


def test_checkpoint_directory_advice_works_when_followed(hf_pair, converted, tmp_path):
    """--model-name path/to/ckpt/main, the Hugging Face checkpoint itself:
    the error names the convert.py command (avoiding an output taken by
    another checkpoint's conversion) and what to give afterwards; both then
    run, the checkpoint's path saying which conversion it used."""
    checkpoint = Path("ckpt", "main")
    shutil.copytree(hf_pair[0], tmp_path / checkpoint)
    copy_model(converted("relu_tied"), tmp_path / "mlx_models" / "main")  # another checkpoint's
    run = ["--regular-decode", *GENERATE]
    advice = assert_one_line_error(run_main("--model-name", str(checkpoint), *run, cwd=tmp_path))
    match = re.search(r"run: (\S+ \S*convert\.py .+), then give (\S+) in its place", advice)
    assert match, advice
    command, out = shlex.split(match[1]), match[2]
    assert out == str(Path("mlx_models", "main-2"))
    assert command[0] == sys.executable  # the Python that runs main.py, which has mlx
    conversion = subprocess.run(  # as written: convert.py named where it is, from here
        [*command, "--dtype", "float32"],
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert conversion.returncode == 0, conversion.stderr
    by_conversion, by_checkpoint = run_main_concurrently(
        ["--model-name", out, *run], ["--model-name", str(checkpoint), *run], cwd=tmp_path
    )
    for result in (by_conversion, by_checkpoint):
        assert result.returncode == 0, result.stderr
        assert generated_text(result.stdout).strip()
    assert f"using its conversion {out}" in by_checkpoint.stderr


def test_readme_python_snippet_runs_outside_the_repository(models, tmp_path):
    """The README's first Python snippet, run as the README says from another
    directory (a copy of the repository on PYTHONPATH, the tiny pair in its
    mlx_models/ under the README's names), without torch as the README
    installs: it prints the texts, and nothing on standard error."""
    readme = (ROOT / "README.md").read_text()
    said, snippet = re.search(
        r"From Python \((.*?)\):\n\n```python\n(.*?)```", readme, re.DOTALL
    ).groups()
    assert (
        "PYTHONPATH=/path/to/this/repository /path/to/this/repository/.venv/bin/python script.py"
        in " ".join(said.split())
    )
    repository, elsewhere = tmp_path / "repository", tmp_path / "elsewhere"
    shutil.copytree(ROOT / "cpu", repository / "cpu", ignore=shutil.ignore_patterns("__pycache__"))
    for module in ROOT.glob("*.py"):
        shutil.copy(module, repository)
    (repository / "mlx_models").mkdir()
    for name, directory in zip(("t5-11b", "t5-small"), models):
        (repository / "mlx_models" / name).symlink_to(directory, target_is_directory=True)
    elsewhere.mkdir()
    (elsewhere / "script.py").write_text(snippet)
    result = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, "script.py"],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(repository), "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert result.stderr == ""


# --- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "mentioned"),
    [
        (["--delta", "-0.1"], "--delta"),
        (["--delta", "1.5"], "--delta"),
        (["--delta", "half"], "--delta"),
        (["--num-draft", "0"], "--num-draft"),
        (["--num-draft", "foo"], "--num-draft"),
        (["--prompt-lookup", "-1"], "--prompt-lookup"),
        (["--prompt-lookup", "two"], "--prompt-lookup"),
        (["--draft-model-name", "none"], "--prompt-lookup"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["-m", "0"], "--max-tokens"),
        (["--temp", "-1"], "--temp"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "1.5"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--seed", "-3", "--temp", "1"], "--seed"),
        (["--seed", str(2**64)], "--seed"),
        (["--prompt", ""], "prompt"),
        (["--prompt", "   "], "prompt"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_bad_arguments_give_one_line_error(args, mentioned, models, tmp_path):
    result = run_main(*model_args(models), *args, cwd=tmp_path)
    assert mentioned in assert_one_line_error(result)
    assert "Loading" not in result.stderr


@pytest.mark.parametrize("role", ["--model-name", "--draft-model-name"])
def test_unconverted_model_names_the_convert_command(role, models, tmp_path):
    main_dir, draft_dir = models
    names = {"--model-name": str(main_dir), "--draft-model-name": str(draft_dir)}
    names[role] = "no-such-org/no-such-t5"
    result = run_main(*[x for pair in names.items() for x in pair], "-m", "3", cwd=tmp_path)
    message = assert_one_line_error(result)
    # From another directory, the hint names convert.py where it is.
    assert f"{sys.executable} {ROOT / 'convert.py'} --model no-such-org/no-such-t5" in message
    # Where it looked: mlx_models/ of the current directory and of the repository, each once.
    for directory in (tmp_path, ROOT):
        place = str(directory / "mlx_models" / "no-such-org-no-such-t5")
        assert message.count(place) == 1
    assert "Loading" not in result.stderr


def test_unconverted_model_from_the_checkout_names_each_place_once(models):
    result = run_main(
        "--model-name", "no-such-t5", "--draft-model-name", str(models[1]), "-m", "3", cwd=ROOT
    )
    message = assert_one_line_error(result)
    assert message.count("mlx_models/no-such-t5") == 1
    assert " nor at " not in message
    assert "convert.py --model no-such-t5" in message
    assert (ROOT / message.split("run: ")[1].split()[1]).is_file()


@pytest.mark.parametrize(
    "name",
    ["{tmp}/models/t5-larg", "./t5-larg", "models/t5-larg", "a/b/c", "{tmp}/not-a-model"],
    ids=["absolute", "relative", "below a directory", "two slashes", "not a model"],
)
def test_a_missing_model_path_is_named_without_convert_advice(name, models, tmp_path):
    """A path that holds no model is said to be missing (or not a model),
    not to be converted: convert.py could not take it either."""
    (tmp_path / "models").mkdir()
    (tmp_path / "not-a-model").mkdir()
    name = name.format(tmp=tmp_path)
    result = run_main("--model-name", name, "--draft-model-name", str(models[1]), cwd=tmp_path)
    message = assert_one_line_error(result)
    assert name in message
    assert "convert.py" not in message or "not-a-model" in name
    assert ("not a model" if "not-a-model" in name else "no such directory") in message


def test_a_long_prompt_gets_no_tokenizer_length_warning(models, tmp_path):
    """transformers warns of indexing errors past the 512 tokens that T5's
    tokenizers record (as the test pair's main model does here); T5's
    relative positions have no limit, and such prompts decode correctly."""
    main_dir = copy_model(models[0], tmp_path / "main")
    config_file = main_dir / "tokenizer_config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "model_max_length": 512})
    )
    prompt = "the dog ran " * 300
    assert len(load_tokenizer(models[0])(prompt).input_ids) > 512
    names = ["--model-name", str(main_dir), "--draft-model-name", str(models[1])]
    result = run_main(*names, "--prompt", prompt, "-m", "3", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "sequence length" not in result.stderr and "indexing errors" not in result.stderr


def truncate_weights(directory: Path) -> None:
    weights = directory / "weights.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)


def randomize_weights(directory: Path) -> None:
    weights = directory / "weights.safetensors"
    weights.write_bytes(random.Random(0).randbytes(weights.stat().st_size))


def replace_tokenizer(directory: Path) -> None:
    """Swap in a tokenizer with a different (150-piece) vocabulary."""
    for file in directory.iterdir():
        if file.name not in ("config.json", "weights.safetensors"):
            file.unlink()
    train_tokenizer(directory, vocab_size=150)


def change_vocab_size(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    config["vocab_size"] = 256
    (directory / "config.json").write_text(json.dumps(config))


def remove_config_field(directory: Path) -> None:
    config = json.loads((directory / "config.json").read_text())
    del config["d_model"]
    (directory / "config.json").write_text(json.dumps(config))


def break_config_json(directory: Path) -> None:
    (directory / "config.json").write_text('{"vocab_size": 200,')


def remove_tokenizer(directory: Path) -> None:
    for file in directory.iterdir():
        if file.name not in ("config.json", "weights.safetensors"):
            file.unlink()


@pytest.mark.parametrize(
    ("role", "damage", "mentioned"),
    [
        ("main", truncate_weights, "convert"),
        ("draft", randomize_weights, "convert"),
        ("draft", replace_tokenizer, "tokenizer"),
        ("draft", change_vocab_size, "vocab_size"),
        ("draft", remove_config_field, "d_model"),
        ("draft", break_config_json, "config.json"),
        ("main", remove_tokenizer, "tokenizer"),
    ],
    ids=[
        "main-truncated-weights",
        "draft-corrupt-weights",
        "draft-other-tokenizer",
        "draft-other-vocab-size",
        "draft-config-missing-field",
        "draft-config-not-json",
        "main-without-tokenizer",
    ],
)
def test_bad_model_directories_give_one_line_error(role, damage, mentioned, models, tmp_path):
    """A damaged or incompatible model directory: one ``error:`` line naming it."""
    main_dir, draft_dir = models
    bad = copy_model(main_dir if role == "main" else draft_dir, tmp_path / "bad")
    damage(bad)
    if role == "main":
        args = ["--model-name", str(bad), "--regular-decode"]
    else:
        args = ["--model-name", str(main_dir), "--draft-model-name", str(bad)]
    result = run_main(*args, "--prompt", PROMPT, "-m", "5", cwd=tmp_path)
    message = assert_one_line_error(result)
    assert str(bad) in message
    assert mentioned in message
    if damage in (replace_tokenizer, change_vocab_size):
        # An incompatible draft is found before any weights are loaded.
        assert str(main_dir) in message
        assert "Loading" not in result.stderr


# --- memory ----------------------------------------------------------------------


def needed_bytes(models) -> int:
    """What main.py reckons the pair needs for GENERATE."""
    prompt_tokens = len(load_tokenizer(models[0])(PROMPT).input_ids)
    return sum(
        (path / "weights.safetensors").stat().st_size
        + loading.runtime_bytes(path, prompt_tokens, MAX_TOKENS)
        for path in models
    )


@pytest.mark.parametrize(
    ("short_by", "advice"),
    [
        # Just too little: 4-bit weights for the main model would fit.
        (1, "which fits: {convert} --model"),
        # Far too little: not even 4-bit weights fit.
        (0.99, "still too much"),
    ],
    ids=["4-bit-fits", "nothing-fits"],
)
def test_models_that_do_not_fit_are_refused_before_loading(
    short_by, advice, models, monkeypatch, capsys
):
    needed = needed_bytes(models)
    available = needed - short_by if short_by >= 1 else needed * (1 - short_by)
    monkeypatch.setattr(loading, "available_memory", lambda: int(available))
    assert main_module.main([*model_args(models), *GENERATE]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    advice = advice.format(convert=script_command("convert.py"))
    assert line.startswith("error: ") and "more than the" in line and advice in line


def test_models_that_fit_run(models, greedy_reference, monkeypatch, capsys):
    monkeypatch.setattr(loading, "available_memory", lambda: needed_bytes(models))
    assert main_module.main([*model_args(models), *GENERATE]) == 0
    assert generated_text(capsys.readouterr().out) == greedy_reference.text


def test_quantized_model_on_the_cpu_gets_a_note(hf_pair, models, tmp_path):
    quantized = convert.convert(
        str(hf_pair[0]),
        tmp_path / "main-4bit",
        "float32",
        convert.quantization_settings(4, 32, "affine"),
    )
    decoder = SpeculativeDecoder(load_model(quantized), None, load_tokenizer(quantized))
    expected = decoder.generate(PROMPT, max_tokens=MAX_TOKENS).text
    result = run_main(
        "--model-name",
        str(quantized),
        "--draft-model-name",
        str(models[1]),
        *GENERATE,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert generated_text(result.stdout) == expected
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [main_module.CPU_QUANTIZED_NOTE]


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the note is for the CPU")
def test_bfloat16_model_on_the_cpu_gets_a_note(converted, models, tmp_path):
    """bfloat16 (convert.py's default) is slow on the CPU: one note says so;
    float32 models get none."""
    bfloat16, float32 = run_main_concurrently(
        ["--model-name", str(converted("main", "bfloat16")), "--regular-decode", *GENERATE],
        ["--model-name", str(models[0]), "--regular-decode", *GENERATE],
        cwd=tmp_path,
    )
    for result, expected in ((bfloat16, [main_module.CPU_HALF_NOTE]), (float32, [])):
        assert result.returncode == 0, result.stderr
        assert [line for line in result.stderr.splitlines() if line.startswith("note:")] == expected


# --- many prompts: --prompts ---------------------------------------------------------

BATCH_PROMPTS = [  # the longest (24 tokens) not first: the memory check must find it
    "hi",
    "summarize: the dog sees the apple in the green garden.",
    "translate English to German: the house is small.",
    "Le chat est très petit.",
    "the dog",
]
# Blank lines (skipped), a Windows line end and no final line end.
PROMPTS_FILE = "\n".join(BATCH_PROMPTS[:2]) + "\n\n  \n" + "\r\n".join(BATCH_PROMPTS[2:])
BATCH = ["--batch-size", "2", "-m", str(MAX_TOKENS)]  # refilled rows, finishing out of order
BATCH_STATS = re.compile(
    r"Prompts: (\d+) of (\d+) finished\n"
    r"Prompt processing: (\d+) tokens, ([\d.]+) tokens/s\n"
    r"Generation: (\d+) tokens, ([\d.]+) tokens/s \(([\d.]+) s of wall time after loading\)\n"
)


@pytest.fixture(scope="module")
def single_results(models) -> list[dict]:
    """Each of BATCH_PROMPTS through main.py's single-prompt path alone (in
    this process, greedy, drafted): its text, and its tokens (from the
    library, whose text must be the same)."""
    main_dir, draft_dir = models
    decoder = SpeculativeDecoder(
        load_model(main_dir), load_model(draft_dir), load_tokenizer(main_dir)
    )
    results = []
    for prompt in BATCH_PROMPTS:
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(io.StringIO()):
            assert main_module.main([*model_args(models), "--prompt", prompt, *BATCH[2:]]) == 0
        text = generated_text(stdout.getvalue())
        alone = decoder.speculative_decode(prompt, max_tokens=MAX_TOKENS)
        assert alone.text == text
        results.append({"text": text, "tokens": alone.tokens})
    assert len({result["text"] for result in results}) == len(BATCH_PROMPTS)
    return results


def batch_stats(stderr: str, prompts: int = len(BATCH_PROMPTS)) -> tuple[int, int]:
    """(finished prompts, generated tokens) from a --prompts run's summary,
    after checking its other lines."""
    match = BATCH_STATS.search(stderr)
    assert match, stderr
    assert int(match[2]) == prompts, stderr
    assert int(match[3]) > 0 and float(match[4]) > 0, stderr
    assert float(match[6]) > 0 and float(match[7]) >= 0, stderr
    peak = PEAK_MEMORY.search(stderr)
    assert peak and float(peak[1]) > 0, stderr
    return int(match[1]), int(match[5])


def test_prompts_file_gives_one_line_per_prompt_in_input_order(models, single_results, tmp_path):
    """--prompts FILE: standard output is each prompt's text, one line each in
    input order, the text of the prompt run alone; blank lines are skipped."""
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    result = run_main(*model_args(models), "--prompts", "prompts.txt", *BATCH, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "".join(f"{single['text']}\n" for single in single_results)
    assert batch_stats(result.stderr) == (
        len(BATCH_PROMPTS),
        sum(len(single["tokens"]) for single in single_results),
    )
    accepted, proposed = map(int, ACCEPTANCE.search(result.stderr).groups()[:2])
    assert 0 < accepted <= proposed
    assert DRAFTING.search(result.stderr)[1] == "draft model"
    assert not CALIBRATION.search(result.stderr)
    assert "prompt/s" not in result.stderr  # no progress bar: standard error is not a terminal


def test_output_writes_json_lines_as_prompts_finish(models, single_results, tmp_path):
    """--prompts - --output FILE: one JSON object per prompt, in completion
    order, each with its index, text, tokens and acceptance; nothing on
    standard output."""
    result = run_main_with_input(
        *model_args(models),
        *("--prompts", "-", "--output", "out.jsonl", *BATCH),
        stdin=PROMPTS_FILE,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    indices = [record["index"] for record in records]
    assert sorted(indices) == list(range(len(BATCH_PROMPTS)))
    # Completion order: the input order broken, else the in-order test proves little.
    assert indices != sorted(indices)
    for record in records:
        assert set(record) == {"index", "text", "tokens", "n_accepted", "n_draft", "seed"}
        single = single_results[record["index"]]
        assert (record["text"], record["tokens"]) == (single["text"], single["tokens"])
        assert 0 <= record["n_accepted"] <= record["n_draft"]
    assert sum(record["n_draft"] for record in records) > 0
    finished, tokens = batch_stats(result.stderr)
    assert (finished, tokens) == (len(records), sum(len(r["tokens"]) for r in records))
    match = ACCEPTANCE.search(result.stderr)
    assert int(match[1]) == sum(record["n_accepted"] for record in records)
    assert int(match[2]) == sum(record["n_draft"] for record in records)


def test_existing_output_file_is_refused_untouched(models, tmp_path):
    """--output never writes over a file: refused before anything is loaded."""
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    (tmp_path / "out.jsonl").write_text("earlier results\n")
    result = run_main(
        *model_args(models), "--prompts", "prompts.txt", "--output", "out.jsonl", cwd=tmp_path
    )
    assert "out.jsonl already exists" in assert_one_line_error(result)
    assert "Loading" not in result.stderr and result.stdout == ""
    assert (tmp_path / "out.jsonl").read_text() == "earlier results\n"


def fake_result(text: str, finished: bool) -> GenerationResult:
    return GenerationResult([7, 8], text, prompt_tokens=3, prompt_time=0.001, finished=finished)


def fake_stream_batch(texts: list[str]):
    """A stand-in for SpeculativeDecoder.stream_batch that finishes the
    prompts last first, prompt i with ``texts[i]``."""

    def stream_batch(self, prompts, **kwargs):
        assert len(prompts) == len(texts)
        for index in reversed(range(len(texts))):
            yield index, fake_result(texts[index], finished=True)

    return stream_batch


def test_line_breaks_in_texts_are_escaped_and_order_kept(models, monkeypatch, capsys, tmp_path):
    """Prompts finishing last first still come out in input order, and a text
    with line breaks stays on its line: \\n, \\r and \\ escaped."""
    texts = ["one\ntwo", "back\\slash\\n", "carriage\r\nreturn", "plain"]
    monkeypatch.setattr(SpeculativeDecoder, "stream_batch", fake_stream_batch(texts))
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"prompt {i}" for i in range(len(texts))))
    assert main_module.main([*model_args(models), "--prompts", str(prompts)]) == 0
    lines = capsys.readouterr().out.split("\n")
    assert lines == [
        "one\\ntwo",
        "back\\\\slash\\\\n",
        "carriage\\r\\nreturn",
        "plain",
        "",
    ]
    assert [cli.one_line(text) for text in texts] == lines[:-1]


@pytest.mark.parametrize("output", [True, False], ids=["output-file", "stdout"])
def test_finished_line_is_written_at_once_and_kept_on_ctrl_c(
    output, models, monkeypatch, capsys, tmp_path
):
    """--output: a finished prompt's line is in the file (flushed) before the
    next main-model pass, and Ctrl-C then keeps it. Standard output cannot
    write it before the unfinished prompts ahead of it, and says so. Both:
    exit 130, "interrupted" and the partial summary on stderr."""
    path = tmp_path / "out.jsonl"
    on_disk = []

    def stream_batch(self, prompts, **kwargs):
        yield 2, fake_result("done", finished=True)
        on_disk.append(path.read_text() if output else None)
        yield 0, fake_result("half", finished=False)
        raise KeyboardInterrupt

    monkeypatch.setattr(SpeculativeDecoder, "stream_batch", stream_batch)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\nc\n")
    run = [*model_args(models), "--prompts", str(prompts)]
    assert main_module.main(run + (["--output", str(path)] if output else [])) == 130
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "interrupted\n" in captured.err
    assert batch_stats(captured.err, 3) == (1, 4)
    if output:
        line = (
            '{"index": 2, "text": "done", "tokens": [7, 8], "n_accepted": 0, "n_draft": 0, '
            '"seed": 0}\n'
        )
        assert on_disk == [line]
        assert path.read_text() == line
        assert "note:" not in captured.err
    else:
        note = "stops before the first unfinished prompt: 1 finished after it is not written"
        assert note in captured.err


@pytest.mark.parametrize(
    ("args", "files", "mentioned"),
    [
        (["--prompts", "missing.txt"], {}, "missing.txt: no such file"),
        (["--prompts", "p.txt"], {"p.txt": ""}, "no prompts"),
        (["--prompts", "p.txt"], {"p.txt": "\n  \n\t\n"}, "no prompts"),
        (["--prompts", "-"], {}, "no prompts"),  # empty standard input
        (["--prompts", "p.txt", "--batch-size", "0"], {"p.txt": "hi"}, "--batch-size"),
        (["--prompts", "p.txt", "--prompt", "hi"], {"p.txt": "hi"}, "--prompt"),
        (["--prompts", "p.txt", "--show-draft"], {"p.txt": "hi"}, "--show-draft"),
        (["--batch-size", "4"], {}, "--batch-size goes with --prompts"),
        (["--output", "o.jsonl"], {}, "--output goes with --prompts"),
        (["--prompts", "p.txt", "--output", "no/o.jsonl"], {"p.txt": "hi"}, "no directory"),
    ],
    ids=[
        "missing-file",
        "empty-file",
        "blank-lines-only",
        "empty-stdin",
        "batch-size-0",
        "prompt-and-prompts",
        "show-draft",
        "batch-size-alone",
        "output-alone",
        "output-directory-missing",
    ],
)
def test_bad_prompts_arguments_give_one_line_error(args, files, mentioned, models, tmp_path):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    result = run_main_with_input(*model_args(models), *args, stdin="", cwd=tmp_path)
    assert mentioned in assert_one_line_error(result)
    assert "Loading" not in result.stderr and result.stdout == ""
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(files)


def test_batch_that_does_not_fit_names_a_batch_size_that_does(
    models, single_results, monkeypatch, capsys, tmp_path
):
    """The memory check counts min(--batch-size, prompts) rows of the longest
    prompt and names the largest batch size that fits; that one runs."""
    longest = max(len(ids) for ids in load_tokenizer(models[0])(BATCH_PROMPTS).input_ids)
    weights = sum((path / "weights.safetensors").stat().st_size for path in models)
    row = sum(loading.runtime_bytes(path, longest, MAX_TOKENS) for path in models)
    monkeypatch.setattr(loading, "available_memory", lambda: weights + 2 * row + row // 2)
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    run = [*model_args(models), "--prompts", str(tmp_path / "prompts.txt"), "-m", str(MAX_TOKENS)]
    assert main_module.main(run) == 1  # the default batch size, 8: 5 rows, as many as prompts
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    needed = loading.format_bytes(weights + len(BATCH_PROMPTS) * row)
    assert f"need about {needed} for a batch of {len(BATCH_PROMPTS)}" in line, line
    assert line.startswith("error: ") and line.endswith("; --batch-size 2 fits"), line
    assert main_module.main([*run, "--batch-size", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "".join(f"{single['text']}\n" for single in single_results)


@pytest.mark.parametrize("output", [False, True], ids=["stdout", "output-file"])
def test_ctrl_c_during_a_batch_keeps_the_finished_prompts(output, models, tmp_path):
    """Ctrl-C once prompts have finished: their lines are kept (flushed),
    "interrupted" and the partial summary on stderr, exit status 130."""
    num_prompts = 40 * len(BATCH_PROMPTS)
    (tmp_path / "prompts.txt").write_text("\n".join(BATCH_PROMPTS * 40))
    results = tmp_path / "out.jsonl"

    def first_prompt_done(process: subprocess.Popen) -> str:
        if not output:
            return process.stdout.readline()
        deadline = time.monotonic() + 300  # a prompt is done once its line is in the file
        while not (results.exists() and results.read_text().endswith("\n")):
            assert time.monotonic() < deadline and process.poll() is None
            time.sleep(0.02)
        return ""

    returncode, stdout, stderr = interrupt_main(
        *model_args(models),
        *("--prompts", "prompts.txt", "--batch-size", "2", "-m", "60"),
        *(["--output", str(results)] if output else []),
        cwd=tmp_path,
        wait=first_prompt_done,
    )
    assert returncode == 130, stderr
    assert "Traceback" not in stderr
    # Standard output's note on finished prompts it holds back may come between.
    assert re.search(rf"\ninterrupted\n(note: [^\n]+\n)?{SEPARATOR}\n", stderr), stderr
    finished, tokens = batch_stats(stderr, num_prompts)
    assert 1 <= finished < num_prompts, stderr
    if output:
        assert stdout == ""
        records = [json.loads(line) for line in results.read_text().splitlines()]
        assert len(records) == finished
        assert all(record["text"] and record["tokens"] for record in records)
        assert tokens >= sum(len(record["tokens"]) for record in records)
    else:
        lines = stdout.splitlines(keepends=True)
        assert 1 <= len(lines) <= finished and all(line.endswith("\n") for line in lines)
        assert all(line.strip() for line in lines)


def test_progress_bar_on_a_terminal(models, single_results, tmp_path):
    """With standard error on a terminal, a progress bar counts the prompts
    there; standard output keeps the texts alone. (With auto, whose
    calibration the summary gives.)"""
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    args = [*model_args(models), "--prompts", "prompts.txt", *BATCH, "--num-draft", "auto"]
    on_terminal, stdout = run_main_on_a_terminal(*args, cwd=tmp_path, stream="stderr")
    assert stdout == "".join(f"{single['text']}\n" for single in single_results)
    total = len(BATCH_PROMPTS)
    assert f"{total}/{total}" in on_terminal and "prompt/s" in on_terminal, on_terminal
    assert batch_stats(on_terminal)[0] == total
    assert float(CALIBRATION.search(on_terminal)[1]) >= 0
    assert on_terminal.index("calibrating the draft length") < on_terminal.index(f"{total}/{total}")
    # Room for the "^C" a terminal echoes on Ctrl-C (80 columns here).
    frames = [frame for frame in re.split("[\r\n]", on_terminal) if "prompt/s" in frame]
    assert frames and max(map(len, frames)) <= 78, frames


@pytest.mark.parametrize(
    ("output", "mentioned"),
    [("", "--output ''"), ("/proc/results.jsonl", "--output /proc/results.jsonl: cannot write")],
    ids=["empty name", "a directory that takes no file"],
)
def test_unwritable_output_is_refused_before_loading(output, mentioned, models, tmp_path):
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    result = run_main(
        *model_args(models), "--prompts", "prompts.txt", "--output", output, cwd=tmp_path
    )
    assert mentioned in assert_one_line_error(result)
    assert "Loading" not in result.stderr
    assert not Path("/proc/results.jsonl").exists()


def test_output_dash_writes_json_lines_to_standard_output(models, single_results, tmp_path):
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    result = run_main(
        *model_args(models), "--prompts", "prompts.txt", *BATCH, "--output", "-", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    records = sorted(
        (json.loads(line) for line in result.stdout.splitlines()), key=lambda r: r["index"]
    )
    assert [r["text"] for r in records] == [single["text"] for single in single_results]
    assert not (tmp_path / "-").exists()


def test_too_many_tokens_names_max_tokens_and_what_fits(models, monkeypatch, capsys):
    needed = needed_bytes(models)
    monkeypatch.setattr(loading, "available_memory", lambda: needed)
    assert main_module.main([*model_args(models), "--prompt", PROMPT, "-m", "10000000"]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    fits = re.search(r"--max-tokens 10000000 does not fit; --max-tokens (\d+) fits", line)
    assert fits, line
    prompt_tokens = len(load_tokenizer(models[0])(PROMPT).input_ids)
    largest = int(fits[1])
    assert largest >= MAX_TOKENS  # the run the memory was measured for fits
    per_row = [loading.runtime_bytes(path, prompt_tokens, largest + 300) for path in models]
    weights = sum((path / "weights.safetensors").stat().st_size for path in models)
    assert weights + sum(per_row) > needed  # a cache chunk more does not
    assert "4-bit" not in line


def test_a_reader_that_leaves_ends_the_run_quietly(models, tmp_path):
    """``main.py --prompts ... | head -1``: no error, no traceback."""
    (tmp_path / "prompts.txt").write_text("\n".join(BATCH_PROMPTS * 20))
    command = [sys.executable, str(ROOT / "main.py"), *model_args(models)]
    command += ["--prompts", "prompts.txt", "--batch-size", "2", "-m", "6"]
    process = subprocess.Popen(
        command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdout.readline()
    process.stdout.close()  # as head does after its line
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == 141
    assert "error" not in stderr and "Traceback" not in stderr and "Exception" not in stderr, stderr


def test_help_gives_the_allowed_ranges():
    help_text = " ".join(main_module.build_parser().format_help().split())
    assert "in (0, 1]" in help_text and "an integer in [0, 2**64)" in help_text


class TypedInput(io.StringIO):
    """Standard input from a terminal: what a user types."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_prompts_from_a_terminal_get_a_hint(terminal, monkeypatch, capsys):
    typed = (TypedInput if terminal else io.StringIO)("first\n\nsecond\n")
    monkeypatch.setattr(sys, "stdin", typed)
    assert cli.read_prompts("-") == ["first", "second"]
    hinted = "reading prompts from standard input" in capsys.readouterr().err
    assert hinted == terminal


def test_the_batch_summary_keeps_calibration_apart(capsys):
    """auto's calibration is neither generation time nor silent: 2 of the 3
    seconds calibrated, so 40 tokens make 40 tokens/s; passes are counted."""
    results = {
        i: GenerationResult([7] * 20, n_steps=9, calibration_time=2.0, finished=True)
        for i in range(2)
    }
    main_module.print_batch_summary(results, 2, 3.0, "draft model", "auto")
    stderr = capsys.readouterr().err
    assert "Generation: 40 tokens, 40.0 tokens/s (1.0 s of wall time" in stderr
    assert "Main-model passes: 18" in stderr and "Calibration: 2.0 s" in stderr


@pytest.mark.parametrize("prompts", [False, True], ids=["--prompt", "--prompts"])
def test_prompt_processing_shows_its_progress_on_a_terminal_only(
    prompts, models, greedy_reference, single_results, tmp_path
):
    """On a terminal, a bar counts the encoder layers computed (the main
    model's and the draft's: 2 + 2 per padded pass) once processing takes longer
    than main.PROMPT_BAR_DELAY (here 0), and is cleared; redirected, nothing."""
    (tmp_path / "prompts.txt").write_text(PROMPTS_FILE)
    args = [*model_args(models), *(["--prompts", "prompts.txt", *BATCH] if prompts else GENERATE)]
    label = "processing prompts" if prompts else "processing the prompt"
    on_terminal, stdout = run_main_on_a_terminal(
        *args, cwd=tmp_path, stream="stderr", prompt_bar_delay=0
    )
    if prompts:
        assert stdout == "".join(f"{single['text']}\n" for single in single_results)
    else:
        assert generated_text(stdout) == greedy_reference.text
    # tqdm draws at most every 0.1 s: the frames seen may stop short of the end.
    assert re.search(f"{label}: \\d/(4|8) layer \\[", on_terminal), on_terminal
    redirected = run_main(*args, cwd=tmp_path)
    assert redirected.returncode == 0 and f"{label}:" not in redirected.stderr
