"""What a directory convert.py writes holds, and where it writes it: the
names ``model.py`` reads, ``convert.py`` writes and ``loading.py`` looks for."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

# Where convert.py writes models by default, relative to the directory it
# runs in; models are looked up there, then in this repository's.
MODELS_DIRECTORY = "mlx_models"
REPOSITORY = Path(__file__).resolve().parent  # the commands' own directory
REPOSITORY_MODELS = REPOSITORY / MODELS_DIRECTORY

# The weights convert.py writes (safetensors, which MLX reads itself), and
# those of conversions by earlier versions (see loading.weights_file).
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
    return Path(MODELS_DIRECTORY) / name


def conversions_of(checkpoint: Path) -> list[Path]:
    """The conversions of the directory ``checkpoint`` in mlx_models/, told
    by the source their config.json records."""
    source = str(checkpoint.resolve())
    return sorted(
        path
        for path in Path(MODELS_DIRECTORY).glob("*")
        if is_converted(path) and read_config(path).get("converted_from") == source
    )


def free_output(checkpoint: Path) -> Path:
    """convert.py's default output for ``checkpoint`` or, where something else
    is, the first free ``<name>-2``, ``<name>-3``, ..."""
    out = default_output(str(checkpoint))
    numbered = (out.with_name(f"{out.name}-{number}") for number in itertools.count(2))
    candidates = itertools.chain([out], numbered)
    return next(path for path in candidates if not path.exists() and not path.is_symlink())
