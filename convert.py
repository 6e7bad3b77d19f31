"""Convert a Hugging Face T5 checkpoint into a directory ``main.py`` can load.

    python convert.py --model t5-small
    python convert.py --model google/flan-t5-large --dtype bfloat16
    python convert.py --model path/to/hf_checkpoint --out mlx_models/mine

The output directory holds ``weights.npz`` (MLX parameter names),
``config.json`` and the tokenizer files, so running needs no network.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

# Before mlx.core: on Linux it loads an optimized BLAS, which MLX binds to only if loaded first.
import blas  # noqa: F401  # isort: skip
import mlx.core as mx

from cli import ArgumentParser
from model import T5, ModelArgs

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "spiece.model"]

# Hugging Face sub-layer positions inside a block, by stack.
SUBLAYERS = {
    "encoder": ("self_attn", "ff"),
    "decoder": ("self_attn", "cross_attn", "ff"),
}
PROJECTIONS = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "out_proj"}


def default_output(model: str) -> Path:
    """Where ``model`` is written unless ``--out`` says otherwise."""
    name = Path(model).name if Path(model).is_dir() else model.replace("/", "-")
    return Path("mlx_models") / name


def fetch_checkpoint(model: str) -> Path:
    """A local checkpoint directory, or a Hugging Face hub id downloaded to the hub cache."""
    if Path(model).is_dir():
        return Path(model)
    from huggingface_hub import list_repo_files, snapshot_download

    try:
        files = list_repo_files(model)
        patterns = list(DOWNLOAD_PATTERNS)
        if not any(f.endswith(".safetensors") for f in files):
            patterns.append("*.bin")
        print(f"Downloading {model} from the Hugging Face Hub ...", flush=True)
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as error:  # noqa: BLE001 - the hub client raises many kinds, all fatal here
        raise ValueError(
            f"{model!r} is neither a local directory nor a model on the Hugging Face Hub "
            f"that can be downloaded ({type(error).__name__}: {str(error).splitlines()[0]})"
        ) from None


def weight_files(checkpoint: Path) -> list[Path]:
    """The checkpoint's weight shards, safetensors first."""
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index = checkpoint / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [checkpoint / shard for shard in shards]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (checkpoint / name).is_file():
            return [checkpoint / name]
    raise ValueError(f"no model.safetensors or pytorch_model.bin in {checkpoint}")


def read_shard(file: Path) -> dict[str, mx.array]:
    """Tensors of one shard. ``.bin`` files need torch and are read with
    ``weights_only=True``, so a checkpoint cannot run code on this machine."""
    if not file.is_file():
        raise ValueError(f"missing weight file {file}")
    if file.suffix == ".safetensors":
        try:
            return mx.load(str(file))
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"cannot read {file}: {error}") from None
    try:
        import torch
    except ImportError:
        raise ValueError(
            f"{file.parent} has only PyTorch .bin weights; install torch to read them, "
            "or use a checkpoint with safetensors"
        ) from None
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - a refused or broken pickle raises many kinds
        raise ValueError(f"cannot read {file}: {str(error).splitlines()[0]}") from None
    return {name: mx.array(tensor.float().numpy()) for name, tensor in state.items()}


def read_tokenizer(checkpoint: Path):
    """The checkpoint's tokenizer; saving it with the weights makes the
    output self-contained (and writes tokenizer.json, fast to load)."""
    from transformers import AutoTokenizer

    if not any((checkpoint / name).is_file() for name in ("spiece.model", "tokenizer.json")):
        raise ValueError(f"no tokenizer (spiece.model or tokenizer.json) in {checkpoint}")
    try:
        return AutoTokenizer.from_pretrained(str(checkpoint))
    except (OSError, ValueError, ImportError) as error:
        raise ValueError(f"cannot read the tokenizer in {checkpoint}: {error}") from None


def mlx_name(hf_name: str) -> str | None:
    """The MLX parameter name for a Hugging Face T5 tensor name (None: not needed)."""
    if hf_name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
        return None  # copies of shared.weight
    if hf_name in ("shared.weight", "lm_head.weight"):
        return hf_name
    stack, rest = hf_name.split(".", 1)
    if rest == "final_layer_norm.weight":
        return f"{stack}.norm.weight"
    match = re.fullmatch(r"block\.(\d+)\.layer\.(\d+)\.(.+)", rest)
    if stack not in SUBLAYERS or match is None:
        raise ValueError(f"unexpected tensor {hf_name!r}: is this a T5 checkpoint?")
    block, position, leaf = match.groups()
    sublayer = SUBLAYERS[stack][int(position)]
    prefix = f"{stack}.layers.{block}"
    if leaf == "layer_norm.weight":
        return f"{prefix}.{sublayer}_norm.weight"
    if leaf.endswith("relative_attention_bias.weight"):
        return f"{stack}.position_bias.embeddings.weight"
    module, name = leaf.split(".", 1)
    if module in ("SelfAttention", "EncDecAttention"):
        projection, _ = name.split(".")
        return f"{prefix}.{sublayer}.{PROJECTIONS[projection]}.weight"
    if module == "DenseReluDense":
        return f"{prefix}.ff.{name}"
    raise ValueError(f"unexpected tensor {hf_name!r}: is this a T5 checkpoint?")


def check_t5(hf_config: dict) -> None:
    model_type = hf_config.get("model_type")
    if model_type not in ("t5", "mt5"):
        raise ValueError(f"config.json has model_type {model_type!r}; expected a T5 model")


def model_config(hf_config: dict, has_lm_head: bool) -> dict:
    """The fields of ``model.ModelArgs`` from a Hugging Face T5 config.

    Whether the decoder output is scaled by d_model**-0.5 is told by
    ``scale_decoder_outputs`` (transformers 5) or else by
    ``tie_word_embeddings`` (older configs: false for T5 v1.1). The output
    projection is untied exactly when the checkpoint holds ``lm_head.weight``.
    """
    check_t5(hf_config)
    eos = hf_config.get("eos_token_id", 1)
    return {
        "model_type": "t5",
        "vocab_size": hf_config["vocab_size"],
        "d_model": hf_config["d_model"],
        "d_kv": hf_config["d_kv"],
        "d_ff": hf_config["d_ff"],
        "num_layers": hf_config["num_layers"],
        "num_decoder_layers": hf_config.get("num_decoder_layers") or hf_config["num_layers"],
        "num_heads": hf_config["num_heads"],
        "relative_attention_num_buckets": hf_config.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": hf_config.get("relative_attention_max_distance", 128),
        "layer_norm_epsilon": hf_config.get("layer_norm_epsilon", 1e-6),
        "feed_forward_proj": hf_config.get("feed_forward_proj", "relu"),
        "tie_word_embeddings": not has_lm_head,
        "scale_decoder_outputs": hf_config.get(
            "scale_decoder_outputs",
            hf_config.get("tie_word_embeddings", True) is not False,
        ),
        "decoder_start_token_id": hf_config.get("decoder_start_token_id", 0) or 0,
        "eos_token_id": eos[0] if isinstance(eos, list) else eos,
        "pad_token_id": hf_config.get("pad_token_id", 0),
    }


def convert(model: str, out: Path, dtype: str = "bfloat16") -> Path:
    """Convert ``model`` (hub id or local directory) into ``out``; returns ``out``.

    The result appears all at once: it is assembled in a temporary directory
    beside ``out`` and renamed into place, so an interrupted run leaves no
    directory that looks converted.
    """
    checkpoint = fetch_checkpoint(model)
    config_file = checkpoint / "config.json"
    if not config_file.is_file():
        raise ValueError(f"no config.json in {checkpoint}")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"cannot read {config_file}: {error}") from None
    check_t5(hf_config)
    tokenizer = read_tokenizer(checkpoint)

    weights = {}
    shards = weight_files(checkpoint)
    for number, shard in enumerate(shards, 1):
        print(f"[{number}/{len(shards)}] reading {shard.name}", flush=True)
        for hf_name, tensor in read_shard(shard).items():
            name = mlx_name(hf_name)
            if name is not None:
                weights[name] = tensor.astype(DTYPES[dtype])
    if "shared.weight" not in weights:
        raise ValueError(f"{checkpoint} has no shared.weight: is this a T5 checkpoint?")
    config = model_config(hf_config, "lm_head.weight" in weights)
    try:  # every tensor the model needs, none it doesn't, all of the right shape
        T5(ModelArgs.from_dict(config)).load_weights(list(weights.items()))
    except ValueError as error:
        reason = " ".join(str(error).split())  # MLX's message spans lines
        raise ValueError(f"{checkpoint} does not match its config.json: {reason}") from None

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    # mkdtemp makes a private directory; give the result the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(str(staging))
        size_gb = sum(w.nbytes for w in weights.values()) / 1e9
        print(f"writing {len(weights)} tensors ({size_gb:.2f} GB, {dtype})", flush=True)
        mx.savez(str(staging / "weights.npz"), **weights)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description="Convert a Hugging Face T5 checkpoint to MLX.")
    parser.add_argument(
        "--model",
        required=True,
        help="hub id (t5-small, google/flan-t5-large) or local directory",
    )
    parser.add_argument("--out", type=Path, help="output directory (default: mlx_models/<name>)")
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="parameter type of the converted weights (default: bfloat16)",
    )
    args = parser.parse_args(argv)
    out = args.out or default_output(args.model)
    try:
        convert(args.model, out, args.dtype)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"Saved to {out}")
    print(f"Use it as the main model: python main.py --model-name {out}")
    print(f"or as the draft model:    python main.py --draft-model-name {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
