"""Command-line helpers shared by main.py, server.py, convert.py and the
benchmark tools: argument checks and their one-line errors, prompt files
and the files results go to, and how messages name sizes and commands.

Nothing here imports MLX, so a command can check its arguments before the
(slow) imports and before anything is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from layout import REPOSITORY

# MLX multiplies float32 matrices at TF32 precision (10 bits of mantissa) on
# NVIDIA GPUs and M5-class Apple GPUs unless this is 0 when MLX starts: the
# text would then be the main model's at TF32, not at float32
# (docs/how-it-works.md#what-exact-means-on-each-backend).
TF32_VARIABLE = "MLX_ENABLE_TF32"
FULL_FLOAT32_NOTE = (
    f"Float32 products run at full precision: the command sets {TF32_VARIABLE}=0 "
    "before MLX starts, unless you set it."
)


def full_float32() -> None:
    """Ask MLX for float32 products at full precision (no TF32) unless the
    user set ``TF32_VARIABLE``. Call before MLX computes anything."""
    os.environ.setdefault(TF32_VARIABLE, "0")


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that ends each option's text with its default, unless it has none
    (None, or off for a flag) or the text already tells it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or action.default is False:
            return text
        return text if "default" in text else f"{text} (default: %(default)s)"


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage text), exit
    status 2, and whose help shows the defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"error: {message}\n")


def checked(kind: type, condition, requirement: str):
    """An argparse type: a ``kind`` value that satisfies ``condition``."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid {kind.__name__}") from None
        if not condition(value):
            raise argparse.ArgumentTypeError(f"{text} is not {requirement}")
        return value

    return parse


POSITIVE = checked(int, lambda n: n >= 1, ">= 1")
NON_NEGATIVE = checked(int, lambda n: n >= 0, ">= 0")


# An argparse type: a seed as sampling.is_seed takes it (sampling imports
# MLX, which checking arguments does not need; tests/test_cli.py holds the two alike).
seed = checked(int, lambda n: 0 <= n < 2**64, "an integer in [0, 2**64)")


def num_draft(text: str) -> int | str:
    """An argparse type: draft tokens per round, >= 1, or ``auto``."""
    if text == "auto":
        return text
    try:
        return POSITIVE(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1 or auto") from None


def add_drafting_options(parser: argparse.ArgumentParser, num_draft_default: int | str) -> None:
    """--num-draft, --prompt-lookup and --delta, as main.py and server.py take them."""
    add = parser.add_argument
    add(
        "--num-draft",
        type=num_draft,
        default=num_draft_default,
        help="draft tokens per main-model pass, or auto: chosen before every round",
    )
    add(
        "--prompt-lookup",
        type=NON_NEGATIVE,
        default=0,
        help="draft from n-grams up to N tokens long found in the prompt or output (0: off)",
    )
    add(
        "--delta",
        type=checked(float, lambda d: 0 <= d <= 1, "in [0, 1]"),
        default=0.0,
        help="acceptance relaxation in [0, 1]: 0 is exact, 1 accepts every draft token",
    )


def read_prompt(prompt: str) -> str:
    """The prompt text; ``-`` reads it from standard input (for long documents)."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise ValueError("the prompt is empty")
    return text


def quiet_transformers() -> None:
    """Silence transformers' advisory warnings, such as that PyTorch was not
    found: only its tokenizers are used, which need no PyTorch (the README's
    install has none). Takes effect when transformers is first imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def format_bytes(size: float) -> str:
    """``size`` bytes in GB, or in MB below 0.1 GB."""
    return f"{size / 1e9:.3f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"


def from_here(path: Path) -> str:
    """``path`` as a user types it in the current directory: relative where
    it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def script_command(script: str) -> str:
    """How to run this repository's ``script`` (``convert.py``, ``main.py``)
    in advice a user copies, from the current directory: this Python, then
    the script (``.venv/bin/python convert.py`` in the checkout after the
    README's quick start; absolute paths elsewhere)."""
    return f"{from_here(Path(sys.executable))} {from_here(REPOSITORY / script)}"


def read_prompts(source: str) -> list[str]:
    """The prompts of ``--prompts``: the non-blank lines of the file
    ``source`` (``-``: standard input)."""
    if source == "-" and sys.stdin.isatty():  # otherwise a blank screen waits for typing
        print("reading prompts from standard input, one per line; end with Ctrl-D", file=sys.stderr)
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"--prompts {source}: no such file") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"--prompts {source}: not UTF-8 text ({error})") from None
    except OSError as error:
        raise ValueError(f"--prompts {source}: {error.strerror or error}") from None
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts {source}: no prompts (empty, or only blank lines)")
    return prompts


def refuse_existing(path: str) -> None:
    """Refuse, before anything loads, an --output that cannot be written:
    something already at ``path`` (--output writes only a new file, never
    over one it did not write), no name, or a directory that takes no new
    file. ``-`` is standard output."""
    if path == "-":
        return
    if not path:
        raise ValueError("--output '': give a new file's name, or - for standard output")
    if os.path.lexists(path):
        raise FileExistsError(f"--output {path} already exists; give a new file's name")
    parent = Path(path).parent
    if not parent.is_dir():
        raise FileNotFoundError(f"--output {path}: no directory {parent}")
    try:  # the one sure test that a file can be made there; nothing stays behind
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as error:
        raise ValueError(f"--output {path}: cannot write in {parent} ({error.strerror})") from None


def one_line(text: str) -> str:
    """``text`` on one line: a backslash written \\\\, a line break \\n, a
    carriage return \\r (undone by reading each \\ and the character after it
    as a pair)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")


class InOrderLines:
    """Finished texts on ``file``, one line per prompt, in input order: each
    as soon as it and every prompt before it are done."""

    def __init__(self, file):
        self.file = file
        self.waiting = {}  # finished, behind an unfinished prompt
        self.printed = 0

    def add(self, index: int, result) -> None:
        self.waiting[index] = result.text
        while self.printed in self.waiting:
            self.file.write(one_line(self.waiting.pop(self.printed)) + "\n")
            self.printed += 1
        self.file.flush()


class JsonLines:
    """Finished results as JSON Lines on ``file``, in completion order, each
    flushed at once."""

    def __init__(self, file):
        self.file = file
        self.waiting = {}  # never any: every result is written at once

    def add(self, index: int, result) -> None:
        record = {
            "index": index,
            "text": result.text,
            "tokens": result.tokens,
            "n_accepted": result.n_accepted,
            "n_draft": result.n_draft,
            "seed": result.seed,
        }
        if hasattr(result, "sequences"):  # beam search's best hypotheses (beam.BeamSearchResult)
            record["score"] = float(result.sequences[0].score)
            record["sequences"] = [
                {"text": text, "tokens": hypothesis.tokens, "score": float(hypothesis.score)}
                for text, hypothesis in zip(result.texts, result.sequences, strict=True)
            ]
        self.file.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()


def open_output(path: str | None):
    """Standard output (left open), or the new file ``path``: mode "x" never
    writes over a file that appeared since ``refuse_existing`` looked."""
    if path is None or path == "-":
        return contextlib.nullcontext(sys.stdout)
    try:
        return open(path, "x", encoding="utf-8")
    except FileExistsError:
        refuse_existing(path)
        raise
