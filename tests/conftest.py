"""Shared fixtures: tiny Hugging Face T5 checkpoints built at test time,
converted with convert.py exactly as a user would."""

import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# Before anything imports mlx (convert does): float32 products at full precision on
# every backend, as the commands ask (the bounds are float32's), and on Linux an
# optimized BLAS for MLX.
from cli import full_float32  # isort: skip

full_float32()
import cpu  # noqa: F401  # isort: skip
from fixtures import PARITY_QK_SCALE, build_checkpoint, train_tokenizer

import convert

WIDTH_64 = {"d_model": 64, "d_ff": 128, "num_heads": 4, "d_kv": 16}
# Checkpoints whose logits are compared with an exact (float64) reference: not so sharp that
# float32 round-off alone moves them (see fixtures.PARITY_QK_SCALE).
PARITY = {"qk_scale": PARITY_QK_SCALE}

# Each architecture the converter and the model must handle.
CHECKPOINTS = {
    # Original T5: ReLU, tied embeddings, decoder output scaled by d_model**-0.5.
    "relu_tied": {"feed_forward_proj": "relu", "tied": True, **PARITY},
    # T5 v1.1 / FLAN-T5: gated GELU, a separate lm_head, no scaling.
    "gated_untied": {"feed_forward_proj": "gated-gelu", "tied": False, "seed": 1, **PARITY},
    "deep_decoder": {"num_layers": 2, "num_decoder_layers": 3, "seed": 2, **PARITY},
    # num_heads * d_kv = 64 != d_model = 32, as in T5-11B.
    "wide_heads": {"num_heads": 4, "d_kv": 16, "d_model": 32, "seed": 3, **PARITY},
    # Original T5 whose residual stream leaves the float16 range.
    "overflowing": {"feed_forward_proj": "relu", "tied": True, "seed": 5},
    # The main model of the decoding tests.
    "main": {"feed_forward_proj": "gated-gelu", "tied": False, "seed": 4},
    # One head and a wide feed-forward block: tests/test_memory.py's other shapes.
    "wide_relu": {"num_heads": 1, "d_kv": 32, "d_ff": 1024, "seed": 11},
    "wide_gated": {
        "feed_forward_proj": "gated-gelu",
        "tied": False,
        "num_heads": 1,
        "d_kv": 32,
        "d_ff": 1024,
        "seed": 12,
    },
    # Split across 2 processes (tests/test_distributed.py): each rank's share of
    # every weight at least 32 KB, above which MLX copies a slice into a buffer
    # of its own (a smaller one may stay in its whole tensor's).
    "split": {"d_model": 128, "num_heads": 4, "d_kv": 32, "d_ff": 256, "seed": 13},
    # d_model 64: quantization groups of 32 and of 64 both divide every input width.
    # Their quantized logits are compared with a float64 twin's: PARITY too.
    "relu_tied_64": {"feed_forward_proj": "relu", "tied": True, **WIDTH_64, "seed": 6, **PARITY},
    "gated_untied_64": {
        "feed_forward_proj": "gated-gelu",
        "tied": False,
        **WIDTH_64,
        "seed": 7,
        **PARITY,
    },
    # d_ff 96: with groups of 64 the feed-forward output projections stay float.
    "narrow_ff": {
        "feed_forward_proj": "relu",
        "tied": True,
        **WIDTH_64,
        "d_ff": 96,
        "seed": 8,
        **PARITY,
    },
}


def scale_tensors(file: Path, name_part: str, factor: float) -> None:
    """Multiply every tensor of a safetensors file whose name contains ``name_part``."""
    tensors = load_file(file)
    for name in tensors:
        if name_part in name:
            tensors[name] = tensors[name] * factor
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory, tokenizer_dir):
    """``hf_checkpoint(name)``: the Hugging Face directory of a CHECKPOINTS entry."""
    built = {}

    def build(name: str) -> Path:
        if name not in built:
            directory = tmp_path_factory.mktemp(f"hf-{name}")
            built[name] = build_checkpoint(
                directory, tokenizer_dir=tokenizer_dir, **CHECKPOINTS[name]
            )
            if name == "overflowing":
                scale_tensors(built[name] / "model.safetensors", "DenseReluDense.wo", 10000.0)
        return built[name]

    return build


@pytest.fixture(scope="session")
def converted(tmp_path_factory, hf_checkpoint):
    """``converted(name, dtype)``: a CHECKPOINTS entry run through convert.py."""
    done = {}

    def run(name: str, dtype: str = "float32") -> Path:
        if (name, dtype) not in done:
            out = tmp_path_factory.mktemp("mlx") / f"{name}-{dtype}"
            convert.convert(str(hf_checkpoint(name)), out, dtype)
            done[name, dtype] = out
        return done[name, dtype]

    return run


@pytest.fixture(scope="session")
def main_checkpoint(hf_checkpoint):
    return hf_checkpoint("main")


# Noise on the draft's output projection, relative to its spread: enough that
# the draft disagrees with the main model at some positions, not at most.
DRAFT_NOISE = 0.15


@pytest.fixture(scope="session")
def hf_pair(tmp_path_factory, main_checkpoint):
    """Hugging Face checkpoints of the main model and of its draft: the main
    model with a perturbed output projection, so that the two agree on most
    tokens but not all. (Perturbing every weight of these tiny random models
    leaves a draft that agrees with almost nothing.)"""
    hf_draft = tmp_path_factory.mktemp("hf-draft")
    shutil.copytree(main_checkpoint, hf_draft, dirs_exist_ok=True)
    tensors = load_file(hf_draft / "model.safetensors")
    lm_head = tensors["lm_head.weight"]
    noise = torch.randn(lm_head.shape, generator=torch.Generator().manual_seed(0))
    tensors["lm_head.weight"] = lm_head + noise * lm_head.std() * DRAFT_NOISE
    save_file(tensors, hf_draft / "model.safetensors", metadata={"format": "pt"})
    return main_checkpoint, hf_draft


@pytest.fixture(scope="session")
def converted_pair(tmp_path_factory, hf_pair, converted):
    """``hf_pair`` converted: the main model's and the draft's directories."""
    out = tmp_path_factory.mktemp("mlx") / "draft"
    convert.convert(str(hf_pair[1]), out, "float32")
    return converted("main"), out


@pytest.fixture(scope="session")
def decoding_pair(converted_pair):
    """(main model, draft model, tokenizer), loaded."""
    from loading import load_model, load_tokenizer

    main_dir, draft_dir = converted_pair
    return load_model(main_dir), load_model(draft_dir), load_tokenizer(main_dir)


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, hf_checkpoint, hf_pair):
    """``quantized(name, bits, group_size, mode, dtype)``: a CHECKPOINTS entry, or
    ``"draft"`` (the draft of ``hf_pair``), run through convert.py with quantization."""
    done = {}

    def run(
        name: str,
        bits: int = 4,
        group_size: int = 64,
        mode: str = "affine",
        dtype: str = "float32",
    ) -> Path:
        key = name, bits, group_size, mode, dtype
        if key not in done:
            source = hf_pair[1] if name == "draft" else hf_checkpoint(name)
            quantization = convert.quantization_settings(bits, group_size, mode)
            out = tmp_path_factory.mktemp("mlx") / "-".join(map(str, key))
            convert.convert(str(source), out, dtype, quantization)
            done[key] = out
        return done[key]

    return run
