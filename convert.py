"""Convert a Hugging Face T5 checkpoint into a directory ``main.py`` can load.

    python convert.py --model t5-small
    python convert.py --model google/flan-t5-large --dtype bfloat16
    python convert.py --model path/to/hf_checkpoint --out mlx_models/mine
    python convert.py --model t5-11b -q                 # 4-bit: mlx_models/t5-11b-4bit
    python convert.py --model t5-small --dtype float32 --force   # replace mlx_models/t5-small

The output directory holds ``weights.safetensors`` (MLX parameter names),
``config.json`` and the tokenizer files, so running needs no network.
convert.py never deletes or replaces what it did not write.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

# Before mlx.core: on Linux it loads an optimized BLAS, which MLX binds to only if loaded first.
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx
from mlx import nn

from cli import ArgumentParser, format_bytes, quiet_transformers, script_command
from layout import WEIGHTS_FILE, default_output, is_converted, read_config, written_by_convert
from loading import stacked_projections
from model import T5, ModelArgs, quantizable_layers

if TYPE_CHECKING:  # torch is needed only to read .bin weights
    import torch

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "spiece.model"]

# Hugging Face sub-layer positions inside a block, by stack.
SUBLAYERS = {
    "encoder": ("self_attn", "ff"),
    "decoder": ("self_attn", "cross_attn", "ff"),
}
PROJECTIONS = {"q": "query_proj", "k": "key_proj", "v": "value_proj", "o": "out_proj"}


# What each quantization mode of mx.quantize takes: bits, then group sizes; defaults first.
QUANTIZATION_MODES = {
    "affine": ((4, 2, 3, 5, 6, 8), (64, 32, 128)),
    "mxfp4": ((4,), (32,)),
    "mxfp8": ((8,), (32,)),
    "nvfp4": ((4,), (16,)),
}


def mode_runs(mode: str) -> bool:
    """Whether this platform's MLX runs a quantized linear layer and a
    quantized embedding (looked up and used as a linear layer) in ``mode``."""
    bits, group_size = (choices[0] for choices in QUANTIZATION_MODES[mode])
    settings = {"group_size": group_size, "bits": bits, "mode": mode}
    try:
        linear = nn.QuantizedLinear(2 * group_size, 8, bias=False, **settings)
        embedding = nn.QuantizedEmbedding(8, 2 * group_size, **settings)
        mx.eval(linear(embedding(mx.array([1]))), embedding.as_linear(mx.ones((1, 2 * group_size))))
    except (ValueError, RuntimeError):
        return False
    return True


def choice_list(choices) -> str:
    """``choices`` in increasing order: "2, 3, 4, 5, 6 or 8"."""
    ordered = [str(choice) for choice in sorted(choices)]
    return ordered[0] if len(ordered) == 1 else f"{', '.join(ordered[:-1])} or {ordered[-1]}"


def quantization_settings(bits: int | None, group_size: int | None, mode: str) -> dict:
    """``{"group_size", "bits", "mode"}`` with the mode's defaults filled in;
    ``ValueError`` for what the mode does not take or this platform cannot run."""
    bit_choices, group_choices = QUANTIZATION_MODES[mode]
    bits = bit_choices[0] if bits is None else bits
    group_size = group_choices[0] if group_size is None else group_size
    if bits not in bit_choices:
        raise ValueError(f"--q-mode {mode} takes --q-bits {choice_list(bit_choices)}")
    if group_size not in group_choices:
        raise ValueError(f"--q-mode {mode} takes --q-group-size {choice_list(group_choices)}")
    if not mode_runs(mode):
        raise ValueError(f"--q-mode {mode} does not run on this platform's MLX; use affine")
    return {"group_size": group_size, "bits": bits, "mode": mode}


def check_output(out: Path, model: str, force: bool) -> None:
    """Refuse an ``out`` whose replacement could lose what convert.py did not
    write: the checkpoint ``model`` itself, a directory inside it or holding
    it, or an existing path other than convert.py's output (an empty
    directory holds nothing to lose); an earlier conversion only with ``force``."""
    if Path(model).is_dir():
        source, target = Path(model).resolve(), out.resolve()
        if target == source or source in target.parents or target in source.parents:
            raise ValueError(
                f"the output {out} and the checkpoint {model} overlap; "
                "choose an output directory outside the checkpoint with --out"
            )
    if not out.is_symlink() and (not out.exists() or out.is_dir() and not any(out.iterdir())):
        return  # nothing there to lose
    if not written_by_convert(out):
        raise ValueError(
            f"{out} exists and is not a model directory convert.py wrote; "
            "nothing was changed: choose another directory with --out"
        )
    if not force:
        source = read_config(out).get("converted_from")
        raise ValueError(
            f"{out} already holds a conversion{f' of {source}' if source else ''}; "
            "add --force to replace it, or choose another directory with --out"
        )


def move_into_place(staging: Path, out: Path) -> None:
    """Rename ``staging`` to ``out``. An earlier ``out`` (checked by
    ``check_output``) is moved aside first and deleted only once the new one
    is in place, so a failure keeps it."""
    if not out.exists():
        os.replace(staging, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
    os.replace(out, aside)
    try:
        os.replace(staging, out)
    except BaseException:
        os.replace(aside, out)
        raise
    shutil.rmtree(aside)


def first_line(error: BaseException) -> str:
    """The first non-empty line of an error's message (hub errors span many)."""
    return next((line for line in str(error).splitlines() if line.strip()), "")


def fetch_checkpoint(model: str) -> Path:
    """A local checkpoint directory, or a Hugging Face hub id: its files in the
    hub cache, downloaded when the hub is reachable, else those the cache
    holds (with ``HF_HUB_OFFLINE=1``, the hub is not asked at all).
    ``ValueError`` tells apart no such model, a gated one, a refusal, no
    network and offline mode."""
    if Path(model).is_dir():
        return Path(model)
    if model.startswith(("/", "./", "../", "~")):  # a path, never a hub id: do not ask the hub
        state = "is not a directory" if Path(model).expanduser().exists() else "does not exist"
        raise ValueError(f"--model {model}: {state}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    print(f"Fetching {model} from the Hugging Face Hub or its cache ...", flush=True)
    try:
        checkpoint = Path(snapshot_download(model, allow_patterns=DOWNLOAD_PATTERNS))
        if not any(checkpoint.glob("*.safetensors")):  # an older checkpoint: PyTorch weights only
            checkpoint = Path(snapshot_download(model, allow_patterns=["*.bin"]))
    except HFValidationError:
        raise ValueError(f"{model!r} is neither a local directory nor a hub model id") from None
    except GatedRepoError:
        raise ValueError(
            f"{model!r} is gated on the Hugging Face Hub: accept its conditions at "
            f"https://huggingface.co/{model}, then log in with: hf auth login"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{model!r} is neither a local directory nor a model on the Hugging Face Hub "
            "(the hub has no such repository; a private one needs: hf auth login)"
        ) from None
    except HfHubHTTPError as error:  # e.g. a token the hub does not accept
        raise ValueError(
            f"the Hugging Face Hub refused {model!r} ({first_line(error)}); "
            "check your login: hf auth login"
        ) from None
    except LocalEntryNotFoundError as error:  # the hub was not asked or did not answer
        cause = error.__cause__
        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE=1 forbids downloading it"
        elif isinstance(cause, HfHubHTTPError):
            reason = f"the Hugging Face Hub failed ({first_line(cause)}); try again later"
        else:
            reason = (
                f"the Hugging Face Hub cannot be reached ({first_line(cause or error)}): check "
                "the network, or give a local checkpoint directory (HF_HUB_OFFLINE=1 converts "
                "models the cache holds without asking the hub)"
            )
        raise ValueError(
            f"{model!r} is neither a local directory nor (completely) in the Hugging Face "
            f"cache, and {reason}"
        ) from None
    except Exception as error:  # noqa: BLE001 - a download can fail in many ways, all fatal here
        raise ValueError(
            f"downloading {model!r} from the Hugging Face Hub failed "
            f"({type(error).__name__}: {first_line(error)})"
        ) from None
    return checkpoint


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
    """Tensors of one shard, lazily: a tensor's bytes are read when it is
    evaluated. ``.bin`` files need torch (see ``read_pytorch_shard``)."""
    if not file.is_file():
        raise ValueError(f"missing weight file {file}")
    if file.suffix == ".safetensors":
        try:
            return mx.load(str(file))
        except (RuntimeError, ValueError) as error:
            raise ValueError(f"cannot read {file}: {error}") from None
    return read_pytorch_shard(file)


# Tensor types MLX reads from safetensors as they are (by torch's name): safetensors'
# name and bytes per value. A .bin's tensors of other types are written as float32.
SAFETENSORS_TYPES = {"float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2)}
# torch.save's format since torch 1.6 is a zip archive, whose tensors can be memory-mapped.
ZIP_MAGIC = b"PK\x03\x04"
MADV_DONTNEED = 4  # the same on Linux and macOS


def read_pytorch_shard(file: Path) -> dict[str, mx.array]:
    """Tensors of a ``pytorch_model.bin`` shard, read with ``weights_only=True``
    (a checkpoint cannot run code here), as lazy MLX arrays.

    MLX reads only safetensors lazily, so the tensors are copied one at a
    time into a temporary safetensors file beside the shard (in their own
    type: as many bytes as the shard's), which is unlinked as soon as MLX
    has opened it. A zip-format file (torch 1.6 and later) is memory-mapped
    and each tensor's pages are released once copied, so memory never holds
    more than one tensor; a legacy file can only be loaded whole, which is
    said before it starts.
    """
    try:
        import torch
    except ImportError:
        raise ValueError(
            f"{file.parent} has only PyTorch .bin weights; install torch to read them, "
            "or use a checkpoint with safetensors"
        ) from None
    with file.open("rb") as stream:
        mapped = stream.read(len(ZIP_MAGIC)) == ZIP_MAGIC
    if not mapped:
        print(
            f"{file.name} is in PyTorch's legacy format, which cannot be memory-mapped: "
            f"it is loaded whole, about {file.stat().st_size / 1e9:.2f} GB of memory",
            flush=True,
        )
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=mapped)
    except Exception as error:  # noqa: BLE001 - a refused or broken pickle raises many kinds
        raise ValueError(f"cannot read {file}: {str(error).splitlines()[0]}") from None
    if not isinstance(state, dict) or not all(
        isinstance(tensor, torch.Tensor) for tensor in state.values()
    ):
        raise ValueError(f"cannot read {file}: it holds no dictionary of tensors")
    try:
        descriptor, staging = tempfile.mkstemp(
            prefix=f".{file.name}.", suffix=".safetensors", dir=file.parent
        )
    except OSError:  # a read-only checkpoint directory
        descriptor, staging = tempfile.mkstemp(suffix=".safetensors")
    try:
        with os.fdopen(descriptor, "wb") as stream:
            write_safetensors(stream, state, release_pages=mapped)
        return mx.load(staging)  # opens the file: unlinking it below keeps the bytes
    finally:
        os.unlink(staging)


def stored_type(tensor: torch.Tensor) -> str:
    """The type ``tensor`` is written in: its own, if MLX reads it, else float32."""
    name = str(tensor.dtype).removeprefix("torch.")
    return name if name in SAFETENSORS_TYPES else "float32"


def write_safetensors(
    stream: BinaryIO, state: dict[str, torch.Tensor], release_pages: bool
) -> None:
    """Write ``state`` to ``stream`` in the safetensors format (header length,
    JSON header, the tensors' bytes), one tensor at a time, emptying ``state``.
    ``release_pages``: the tensors are memory-mapped, and the pages each one
    was read through are given back once it is written (they would otherwise
    stay resident until the whole shard is done)."""
    import torch

    header, offset = {}, 0
    for name, tensor in state.items():
        kind, width = SAFETENSORS_TYPES[stored_type(tensor)]
        end = offset + width * tensor.numel()
        header[name] = {"dtype": kind, "shape": list(tensor.shape), "data_offsets": [offset, end]}
        offset = end
    header_bytes = json.dumps(header).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)  # the format aligns the tensors to 8 bytes
    stream.write(len(header_bytes).to_bytes(8, "little") + header_bytes)
    libc = ctypes.CDLL(None)
    for name in list(state):
        tensor = state.pop(name)
        stored = tensor.to(getattr(torch, stored_type(tensor))).reshape(-1)  # copies if strided
        stream.write(stored.view(torch.uint8).numpy().data)
        if release_pages:
            storage = tensor.untyped_storage()
            start = storage.data_ptr() - storage.data_ptr() % mmap.PAGESIZE
            length = storage.data_ptr() + storage.nbytes() - start
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), MADV_DONTNEED)


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


def read_checkpoint(checkpoint: Path) -> dict[str, mx.array]:
    """Every tensor the model needs, by MLX name. Safetensors are read lazily:
    a tensor's bytes are loaded only when it is converted."""
    tensors = {}
    shards = weight_files(checkpoint)
    for number, shard in enumerate(shards, 1):
        print(f"[{number}/{len(shards)}] reading {shard.name}", flush=True)
        for hf_name, tensor in read_shard(shard).items():
            name = mlx_name(hf_name)
            if name is not None:
                tensors[name] = tensor
    if "shared.weight" not in tensors:
        raise ValueError(f"{checkpoint} has no shared.weight: is this a T5 checkpoint?")
    return tensors


def check_shapes(checkpoint: Path, config: dict, tensors: dict[str, mx.array]) -> None:
    """Every tensor the model needs, none it doesn't, all of the right shape."""
    try:
        T5(ModelArgs.from_dict(config)).load_weights(list(tensors.items()))
    except ValueError as error:
        reason = " ".join(str(error).split())  # MLX's message spans lines
        raise ValueError(f"{checkpoint} does not match its config.json: {reason}") from None


def describe_layers(paths: set[str]) -> str:
    """``encoder.layers.*.ff.wo (6), ...``: layer paths, one entry per kind."""
    kinds = Counter(re.sub(r"layers\.\d+\.", "layers.*.", path) for path in paths)
    return ", ".join(
        f"{kind} ({count})" if count > 1 else kind for kind, count in sorted(kinds.items())
    )


def convert_tensors(
    tensors: dict[str, mx.array], dtype: str, quantization: dict | None, layers: set[str]
) -> dict[str, mx.array]:
    """Cast every tensor to ``dtype`` and quantize the weights of ``layers``,
    one tensor at a time, emptying ``tensors``: each result is evaluated
    while only it holds the source, so the float copy is freed at once and
    memory holds the output and one input tensor."""
    weights = {}
    total = len(tensors)
    last_report = time.monotonic()  # progress every few seconds, for big models
    for number, name in enumerate(list(tensors), 1):
        tensor = tensors.pop(name).astype(DTYPES[dtype])
        layer = name.removesuffix(".weight")
        if layer in layers:
            # Quantized layers hold weight, scales and (affine only) biases.
            packed = mx.quantize(tensor, **quantization)
            converted = dict(zip((f"{layer}.weight", f"{layer}.scales", f"{layer}.biases"), packed))
        else:
            converted = {name: tensor}
        del tensor
        mx.eval(converted)
        weights.update(converted)
        if time.monotonic() - last_report > 5:
            print(f"converted {number}/{total} tensors", flush=True)
            last_report = time.monotonic()
    return weights


def convert(
    model: str,
    out: Path,
    dtype: str = "bfloat16",
    quantization: dict | None = None,
    force: bool = False,
) -> Path:
    """Convert ``model`` (hub id or local directory) into ``out``; returns ``out``.

    ``quantization`` (``{"group_size", "bits", "mode"}``, see
    ``quantization_settings``) quantizes the layers ``quantizable_layers``
    names; the rest is cast to ``dtype``, which also sets the type of the
    quantization scales. An existing ``out`` is refused before any work
    unless it is empty or, with ``force``, an earlier conversion (see
    ``check_output``). The result appears all at once: it is assembled in
    a temporary directory beside ``out`` and renamed into place, so an
    interrupted run leaves no directory that looks converted.
    """
    if is_converted(Path(model)):
        raise ValueError(
            f"{model} is already converted; use it as it is: "
            f"{script_command('main.py')} --model-name {model}"
        )
    check_output(out, model, force)
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

    tensors = stacked_projections(read_checkpoint(checkpoint))
    config = model_config(hf_config, "lm_head.weight" in tensors)
    check_shapes(checkpoint, config, tensors)
    config["dtype"] = dtype  # for main.py's memory estimate; loading reads the weights' own
    if "task_specific_params" in hf_config:  # main.py --task: each task's prefix, beams, lengths
        config["task_specific_params"] = hf_config["task_specific_params"]
    # Marks the output as convert.py's (see cli.written_by_convert) and names its source.
    config["converted_from"] = str(Path(model).resolve()) if Path(model).is_dir() else model
    layers = set()
    if quantization:
        group_size = quantization["group_size"]
        layers, too_narrow = quantizable_layers(T5(ModelArgs.from_dict(config)), group_size)
        if too_narrow:
            print(
                f"kept in {dtype}, input width not a multiple of {group_size}: "
                f"{describe_layers(too_narrow)}",
                flush=True,
            )
        config["quantization"] = quantization
    weights = convert_tensors(tensors, dtype, quantization, layers)

    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    # mkdtemp makes a private directory; give the result the usual permissions.
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)
    try:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tokenizer.save_pretrained(str(staging))
        size = format_bytes(sum(w.nbytes for w in weights.values()))
        precision = dtype
        if quantization:
            precision += f", {len(layers)} layers {quantization['bits']}-bit {quantization['mode']}"
            precision += f" in groups of {quantization['group_size']}"
        print(f"writing {len(weights)} tensors ({size}, {precision})", flush=True)
        mx.save_safetensors(str(staging / WEIGHTS_FILE), weights)
        check_output(out, model, force)  # again: something may have appeared there meanwhile
        move_into_place(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    quiet_transformers()
    parser = ArgumentParser(description="Convert a Hugging Face T5 checkpoint to MLX.")
    parser.add_argument(
        "--model",
        required=True,
        help="hub id (t5-small, google/flan-t5-large) or local directory",
    )
    parser.add_argument(
        "--out", type=Path, help="output directory (default: mlx_models/<name>[-4bit])"
    )
    parser.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default="bfloat16",
        help="type of the floating-point parameters and scales (default: bfloat16)",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier conversion in the output directory (never anything else)",
    )
    parser.add_argument("-q", "--quantize", action="store_true", help="quantize the weights")
    parser.add_argument(
        "--q-bits",
        type=int,
        help="bits per quantized weight: 2, 3, 4, 5, 6 or 8 in affine mode (default: 4, or "
        "the mode's)",
    )
    parser.add_argument(
        "--q-group-size",
        type=int,
        help="weights sharing one scale: 32, 64 or 128 in affine mode (default: 64, or the mode's)",
    )
    parser.add_argument(
        "--q-mode",
        choices=list(QUANTIZATION_MODES),
        default="affine",
        help="quantization mode (default: affine)",
    )
    args = parser.parse_args(argv)
    quantization = None
    if args.quantize:
        try:
            quantization = quantization_settings(args.q_bits, args.q_group_size, args.q_mode)
        except ValueError as error:
            parser.error(str(error))
    elif args.q_bits or args.q_group_size or args.q_mode != "affine":
        parser.error("--q-bits, --q-group-size and --q-mode need -q/--quantize")
    out = args.out or default_output(args.model, quantization)
    try:
        convert(args.model, out, args.dtype, quantization, args.force)
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the staging directory is already gone
        print("interrupted: nothing written", file=sys.stderr)
        return 130
    print(f"Saved to {out}")
    main_py = script_command("main.py")
    print(f"Use it as the main model: {main_py} --model-name {out}")
    print(f"or as the draft model:    {main_py} --draft-model-name {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
