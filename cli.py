"""Command-line helpers shared by main.py, convert.py and the benchmark tools
(and the seed check, by the decoder too).

Nothing here imports mlx, so a command can check its arguments before the
(slow) imports and before anything is loaded.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import sys
from pathlib import Path

# The weights convert.py writes (safetensors, which MLX reads itself), and
# those of conversions by earlier versions (see model.weights_file).
WEIGHTS_FILE = "weights.safetensors"
LEGACY_WEIGHTS_FILE = "weights.npz"
# Every name convert.py writes into a model directory: the weights, config.json
# and the tokenizer's files (those any transformers version saves for T5).
CONVERTED_FILES = frozenset(
    {
        WEIGHTS_FILE,
        LEGACY_WEIGHTS_FILE,
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "spiece.model",
    }
)


def quiet_transformers() -> None:
    """Silence transformers' advisory warnings, such as that PyTorch was not
    found: the commands use only its tokenizers, which need no PyTorch (the
    README's install has none). Call before transformers is imported."""
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


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

SEEDS = "an integer in [0, 2**64)"  # what mx.random.seed takes


def is_seed(value: object) -> bool:
    """Whether ``value`` is one of SEEDS (the decoder checks seeds with this too)."""
    return isinstance(value, int) and 0 <= value < 2**64


SEED = checked(int, is_seed, SEEDS)


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


def format_bytes(size: float) -> str:
    """``size`` bytes in GB, or in MB below 0.1 GB."""
    return f"{size / 1e9:.3f} GB" if size >= 1e8 else f"{size / 1e6:.2f} MB"


def is_converted(path: Path) -> bool:
    """Whether ``path`` holds a converted model: config.json and weights."""
    weights = (path / WEIGHTS_FILE, path / LEGACY_WEIGHTS_FILE)
    return (path / "config.json").is_file() and any(file.is_file() for file in weights)


def read_config(path: Path) -> dict:
    """The JSON object in ``path/config.json``; empty if there is none."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def written_by_convert(path: Path) -> bool:
    """Whether ``path`` is a directory convert.py wrote, with nothing added:
    a converted model whose config.json names its source (``converted_from``)
    or, written before convert.py recorded that, is a T5 config, and no
    files but CONVERTED_FILES."""
    if path.is_symlink() or not is_converted(path):
        return False
    if any(entry.name not in CONVERTED_FILES or not entry.is_file() for entry in path.iterdir()):
        return False
    config = read_config(path)
    return "converted_from" in config or config.get("model_type") == "t5"


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a Hugging Face checkpoint directory: config.json
    and safetensors or PyTorch weights."""
    weights = any(path.glob("*.safetensors")) or any(path.glob("*.bin"))
    return (path / "config.json").is_file() and weights


def default_output(model: str, quantization: dict | None = None) -> Path:
    """Where convert.py writes ``model`` unless ``--out`` says otherwise: the
    mlx-community names, ``<name>-4bit`` (affine) or ``<name>-mxfp4``, when quantized."""
    name = Path(model).resolve().name if Path(model).is_dir() else model.replace("/", "-")
    if quantization:
        mode = quantization["mode"]
        name += f"-{quantization['bits']}bit" if mode == "affine" else f"-{mode}"
    return Path("mlx_models") / name


def conversions_of(checkpoint: Path) -> list[Path]:
    """The conversions of the directory ``checkpoint`` in mlx_models/, told
    by the source their config.json records."""
    source = str(checkpoint.resolve())
    return sorted(
        path
        for path in Path("mlx_models").glob("*")
        if is_converted(path) and read_config(path).get("converted_from") == source
    )


def free_output(checkpoint: Path) -> Path:
    """convert.py's default output for ``checkpoint`` or, where something else
    is, the first free ``<name>-2``, ``<name>-3``, ..."""
    out = default_output(str(checkpoint))
    numbered = (out.with_name(f"{out.name}-{number}") for number in itertools.count(2))
    candidates = itertools.chain([out], numbered)
    return next(path for path in candidates if not path.exists() and not path.is_symlink())


def python_command() -> str:
    """How to run this Python in advice a user copies: its path relative to
    the current directory when it lies below it (``.venv/bin/python`` after
    the README's quick start), else the absolute path."""
    executable = Path(sys.executable)
    try:
        return str(executable.relative_to(Path.cwd()))
    except ValueError:
        return str(executable)


def resolve_model(name: str) -> Path:
    """A directory written by convert.py: ``name`` itself, ``mlx_models/<name>``
    or, for a Hugging Face checkpoint directory, its one conversion in
    mlx_models/ (said on standard error). Otherwise ``FileNotFoundError``
    with the convert.py command to run and what to give afterwards."""
    for path in (Path(name), Path("mlx_models") / name.replace("/", "-")):
        if is_converted(path):
            return path
    if not is_checkpoint(Path(name)):
        looked = Path.cwd() / "mlx_models" / name.replace("/", "-")
        raise FileNotFoundError(
            f"model {name!r} is not converted: no converted model at {name} nor at {looked}; "
            f"for a Hugging Face hub id or checkpoint, run: "
            f"{python_command()} convert.py --model {name}"
        )
    conversions = conversions_of(Path(name))
    if len(conversions) == 1:
        print(
            f"{name} is a Hugging Face checkpoint: using its conversion {conversions[0]}",
            file=sys.stderr,
        )
        return conversions[0]
    if conversions:
        raise FileNotFoundError(
            f"{name} is a Hugging Face checkpoint converted more than once "
            f"({', '.join(map(str, conversions))}): give one of those instead"
        )
    out = free_output(Path(name))
    raise FileNotFoundError(
        f"{name} is a Hugging Face checkpoint, not converted yet; run: {python_command()} convert.py "
        f"--model {shlex.quote(name)} --out {shlex.quote(str(out))}, then give {out} in its place"
    )


def read_prompt(prompt: str) -> str:
    """The prompt text; ``-`` reads it from standard input (for long documents)."""
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise ValueError("the prompt is empty")
    return text
