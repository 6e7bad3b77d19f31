"""The memory table of docs/converting.md: the weights of the T5 family at each precision.

    python benchmarks/memory_table.py

Sizes come from ``model.parameter_bytes``, the shapes of the real models'
configs (below, as published on the Hugging Face Hub) quantized as
``convert.py -q`` would; ``tests/test_convert.py`` checks ``parameter_bytes``
against the files ``convert.py`` writes.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The example's modules live one folder up.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from model import ModelArgs, parameter_bytes

VOCAB_SIZE = 32128
ORIGINAL = {"feed_forward_proj": "relu", "tie_word_embeddings": True}
V1_1 = {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False}
# name: d_model, d_kv, d_ff, encoder and decoder layers, heads, layout
CONFIGS = {
    "t5-small": (512, 64, 2048, 6, 8, ORIGINAL),
    "t5-base": (768, 64, 3072, 12, 12, ORIGINAL),
    "t5-large": (1024, 64, 4096, 24, 16, ORIGINAL),
    "t5-3b": (1024, 128, 16384, 24, 32, ORIGINAL),
    "t5-11b": (1024, 128, 65536, 24, 128, ORIGINAL),
    "flan-t5-small": (512, 64, 1024, 8, 6, V1_1),
    "flan-t5-base": (768, 64, 2048, 12, 12, V1_1),
    "flan-t5-large": (1024, 64, 2816, 24, 16, V1_1),
    "flan-t5-xl": (2048, 64, 5120, 24, 32, V1_1),
    "flan-t5-xxl": (4096, 64, 10240, 24, 64, V1_1),
}
PRECISIONS = {
    "float32": (mx.float32, None),
    "bfloat16": (mx.bfloat16, None),
    "8-bit": (mx.bfloat16, {"group_size": 64, "bits": 8, "mode": "affine"}),
    "4-bit": (mx.bfloat16, {"group_size": 64, "bits": 4, "mode": "affine"}),
}


def model_args(name: str) -> ModelArgs:
    d_model, d_kv, d_ff, layers, heads, layout = CONFIGS[name]
    return ModelArgs(
        vocab_size=VOCAB_SIZE,
        d_model=d_model,
        d_kv=d_kv,
        d_ff=d_ff,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        scale_decoder_outputs=layout["tie_word_embeddings"],
        **layout,
    )


def main() -> None:
    print("| model | parameters | " + " | ".join(PRECISIONS) + " |")
    print("| --- | --- |" + " --- |" * len(PRECISIONS))
    for name in CONFIGS:
        args = model_args(name)
        parameters = parameter_bytes(args, mx.float32) // 4
        sizes = [parameter_bytes(args, *precision) / 1e9 for precision in PRECISIONS.values()]
        print(
            f"| {name} | {parameters / 1e9:.2f}B | "
            + " | ".join(f"{size:.2f} GB" for size in sizes)
            + " |"
        )


if __name__ == "__main__":
    main()
