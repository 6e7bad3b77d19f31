"""Attention on the CPU, with a softmax whose exp is not MLX's scalar loop.

``prepare`` gives every attention of a model :func:`attention` in place of
``model.attention`` (MLX's fused attention): both compute ``softmax(q k^T +
mask) v``, this one over many scores with :func:`softmax_cpu`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

LOG2_E = math.log2(math.e)
# ln 2 split in two, so n * LN2_HIGH is exact for the n that occur.
LN2_HIGH, LN2_LOW = 0.693145751953125, 1.428606765330187e-06
# 1/k! for k = 7 .. 1: e^r's Taylor polynomial, highest term first.
TAYLOR = tuple(1 / math.factorial(k) for k in range(7, 0, -1))


class CompiledPerShape:
    """``mx.compile(function)``, traced for each shape of its arguments,
    that forgets the shapes it traced once it holds ``MAX_TRACED_SHAPES``:
    MLX keeps every shape's trace while the compiled function lives (about
    40 KB each), and a decoder's keys grow by one at every pass, prompts
    come in every length (docs/linux.md). Per shape, because compiled once
    for every shape (``shapeless=True``) the softmax below is slower over
    long prompts, and MLX 0.32 crashes on it over a single key."""

    def __init__(self, function: Callable):
        self.function = function
        self._forget()

    def _forget(self) -> None:
        # Dropping the compiled function erases its traces from MLX's cache.
        self.compiled = mx.compile(self.function)
        self.shapes = set()

    def __call__(self, *arrays: mx.array):
        shapes = tuple(array.shape for array in arrays)
        if shapes not in self.shapes:
            if len(self.shapes) >= MAX_TRACED_SHAPES:
                self._forget()
            self.shapes.add(shapes)
        return self.compiled(*arrays)


# Shapes a CompiledPerShape keeps traced: a few hundred cost a few MB.
MAX_TRACED_SHAPES = 256


@CompiledPerShape
def softmax_cpu(scores: mx.array) -> mx.array:
    """Softmax over the last axis of float32 ``scores``, with exp computed as
    2^n e^r (n an integer, |r| <= ln(2)/2, e^r by its Taylor polynomial,
    relative error ~1e-6). MLX's own exp is a scalar loop on the CPU, where
    long prompts' encoders spend much of their time (cpu/README.md).
    Scores 87 or more below the row's largest (masked ones: -inf) get weight
    e^-87 ~ 1e-38 instead of 0, which no float32 sum can tell apart."""
    x = mx.maximum(scores - scores.max(axis=-1, keepdims=True), -87.0)
    n = mx.floor(x * LOG2_E + 0.5)
    r = x - n * LN2_HIGH - n * LN2_LOW
    taylor = TAYLOR[0]
    for coefficient in TAYLOR[1:]:
        taylor = taylor * r + coefficient
    taylor = taylor * r + 1.0
    two_to_n = ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # the float32 bits of 2^n
    exp = taylor * two_to_n
    return exp / exp.sum(axis=-1, keepdims=True)


# Fewer scores than this (a decoder step of a few rows) take less time in
# MLX's exp than calling a compiled function adds; a step of many rows has
# enough scores for softmax_cpu to pay (cpu/README.md, docs/benchmarks.md,
# 2026-11-25).
SOFTMAX_CPU_MIN_SCORES = 1 << 11


def attention(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
    """``model.attention`` as the CPU computes it fastest: MLX's fused
    attention over few scores, else the same steps with :func:`softmax_cpu`
    (MLX's CPU attention computes them with its slow exp)."""
    num_scores = math.prod(queries.shape[:-1]) * keys.shape[-2]
    if num_scores < SOFTMAX_CPU_MIN_SCORES:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=mask)
    scores = (queries @ keys.swapaxes(-1, -2) + mask).astype(mx.float32)
    return softmax_cpu(scores).astype(values.dtype) @ values
