"""Command-line helpers shared by main.py, server.py, convert.py and the
benchmark tools: argument checks and their one-line errors.

Nothing here imports mlx, so a command can check its arguments before the
(slow) imports and before anything is loaded.
"""

from __future__ import annotations

import argparse
import os
import sys

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


def seed(text: str) -> int:
    """An argparse type: a seed ``sampling.is_seed`` takes (imported here:
    sampling imports MLX, which the other checks do not need)."""
    from sampling import SEEDS, is_seed

    return checked(int, is_seed, SEEDS)(text)


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
