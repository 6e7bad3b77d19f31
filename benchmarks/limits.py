"""What the machine allows: memory bandwidth and the bytes a decoder step reads.

A decoder step with one new token reads every weight it uses once and does
little arithmetic per byte, so its speed is bounded by memory bandwidth: at
most ``bandwidth / bytes_per_step`` steps per second.
"""

from __future__ import annotations

import time

import numpy as np
from mlx.utils import tree_flatten


def memory_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second moved by a large array copy (read and write counted),
    the best of ``repeats``."""
    source = np.ones(megabytes * 2**20 // 4, dtype=np.float32)
    target = np.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def decoder_step_bytes(model) -> int:
    """Bytes of weights one single-token decoder step reads: the decoder's
    parameters except the cross-attention keys/values projections (applied
    once per prompt) and the position-bias table (a few rows), plus the
    output projection (the shared embedding when tied)."""
    total = 0
    for name, weight in tree_flatten(model.decoder.parameters()):
        if ".cross_attn.key_proj." in name or ".cross_attn.value_proj." in name:
            continue
        if name.startswith("position_bias"):
            continue
        total += weight.nbytes
    output = model.shared if model.args.tie_word_embeddings else model.lm_head
    return total + sum(weight.nbytes for _, weight in tree_flatten(output.parameters()))
