"""Command-line helpers shared by main.py, convert.py and the benchmark tools.

Nothing here imports mlx, so a command can check its arguments before the
(slow) imports and before anything is loaded.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class ArgumentParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (no usage text), exit status 2."""

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


def num_draft(text: str) -> int | str:
    """An argparse type: draft tokens per round, >= 1, or ``auto``."""
    if text == "auto":
        return text
    try:
        return POSITIVE(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 1 or auto") from None


def resolve_model(name: str) -> Path:
    """A directory written by convert.py: ``name`` itself, or ``mlx_models/<name>``."""
    for path in (Path(name), Path("mlx_models") / name.replace("/", "-")):
        if (path / "config.json").is_file() and (path / "weights.npz").is_file():
            return path
    raise FileNotFoundError(
        f"model {name!r} is not converted; run: python convert.py --model {name}"
    )


def read_prompt(prompt: str) -> str:
    """The prompt text; ``-`` reads it from standard input (for long documents)."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise ValueError("the prompt is empty")
    return text
