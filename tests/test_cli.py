"""cli.py, what the commands share: parsing arguments imports no MLX; a
seed argument is what ``sampling.is_seed`` takes; one-line errors; sizes
and commands as messages name them."""

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

import cli
from sampling import is_seed

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", ["main", "server"])
def test_parsing_arguments_imports_no_mlx(command):
    """A command checks its arguments, --seed included, before MLX loads:
    its argument errors come without MLX's import time."""
    script = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); import {command};"
        f"{command}.build_parser().parse_args(['--seed', '5'] if {command!r} == 'main' else []);"
        "print('mlx' in sys.modules, 'mlx.core' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.split() == ["False", "False"], result.stderr


@pytest.mark.parametrize("text", ["0", "1", str(2**64 - 1), str(2**64), "-1", "1.5", "x"])
def test_a_seed_argument_is_what_sampling_takes(text):
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is not None and is_seed(value):
        assert cli.seed(text) == value
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            cli.seed(text)


def test_argument_errors_are_one_line(capsys):
    parser = cli.ArgumentParser()
    parser.add_argument("--n", type=cli.POSITIVE)
    with pytest.raises(SystemExit) as exit_info:
        parser.parse_args(["--n", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "error: argument --n: 0 is not >= 1\n"


def test_sizes_and_commands_as_messages_name_them(tmp_path, monkeypatch):
    assert cli.format_bytes(2.5e9) == "2.500 GB"
    assert cli.format_bytes(5e7) == "50.00 MB"
    monkeypatch.chdir(ROOT)
    assert cli.script_command("convert.py").endswith(" convert.py")
    monkeypatch.chdir(tmp_path)
    assert cli.script_command("convert.py").endswith(f" {ROOT / 'convert.py'}")
