"""Where decoding time goes, against what the machine allows.

A decoder step with one new token reads every weight it uses once and does
little arithmetic per byte, so its speed is bounded by memory bandwidth:
at most ``bandwidth / bytes_per_step`` steps per second. A speculative round
adds a main pass over ``g + 1`` tokens, whose cost ``v(g + 1)`` (in one-token
passes) the paper's formula takes to be 1; on a CPU it is not, so the
verify-aware prediction uses the measured value.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
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
    return total + sum(w.nbytes for _, w in tree_flatten(output.parameters()))


def pass_costs(model, prompt_ids: mx.array, lengths: list[int], repeats: int = 15) -> dict:
    """``{k: v(k)}``: the time of a main-model decoder pass over ``k`` new
    tokens relative to a one-token pass, medians over ``repeats`` interleaved
    rounds on a warm cache of 16 positions."""
    cache = model.make_cache(model.encode(prompt_ids))
    start_token = model.args.decoder_start_token_id
    mx.eval(model.decode(mx.array([[start_token] * 16]), cache))
    times = {k: [] for k in sorted({1, *lengths})}
    for _ in range(repeats):
        for k, samples in times.items():
            tokens = mx.array([[start_token] * k])
            start = time.perf_counter()
            mx.eval(model.decode(tokens, cache))
            samples.append(time.perf_counter() - start)
            cache.trim(k)
    one = statistics.median(times[1])
    return {k: statistics.median(samples) / one for k, samples in times.items()}


def verify_aware_speedup(alpha: float, num_draft: int, cost_ratio: float, verify_cost: float):
    """The paper's expected speedup with the main pass over ``g + 1`` tokens
    costing ``verify_cost`` one-token passes instead of one."""
    tokens = num_draft + 1 if alpha >= 1 else (1 - alpha ** (num_draft + 1)) / (1 - alpha)
    return tokens / (num_draft * cost_ratio + verify_cost)
