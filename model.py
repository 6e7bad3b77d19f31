"""T5 encoder-decoder in MLX, with a trimmable decoder cache.

The model computes the same function as Hugging Face's
``T5ForConditionalGeneration``: relative position buckets added to the
attention scores (no 1/sqrt(d) scaling), RMS norms before every sub-layer,
and either a ReLU (T5 v1.0) or a gated-GELU (T5 v1.1, FLAN-T5, mT5)
feed-forward block.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path

# First, so that importing this module (or decoder) from Python gets the fast
# BLAS on Linux too: MLX binds to an optimized BLAS only if it is loaded before mlx.
import blas  # isort: skip
import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from cli import LEGACY_WEIGHTS_FILE, WEIGHTS_FILE


@dataclass
class ModelArgs:
    """The hyper-parameters ``convert.py`` writes to ``config.json``."""

    vocab_size: int
    d_model: int
    d_kv: int
    d_ff: int
    num_layers: int
    num_decoder_layers: int
    num_heads: int
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    feed_forward_proj: str = "relu"
    # The output projection is the input embedding (no separate lm_head).
    tie_word_embeddings: bool = True
    # Original T5 multiplies the decoder output by d_model**-0.5 before the
    # output projection; T5 v1.1 and its descendants do not.
    scale_decoder_outputs: bool = True
    decoder_start_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 0
    # {"group_size": G, "bits": B, "mode": M} for a model convert.py quantized.
    quantization: dict | None = None

    @property
    def _layer_work(self) -> tuple[int, int]:
        """Multiply-adds per token of one attention projection (query, key,
        value or output) and of one feed-forward block."""
        projection = self.num_heads * self.d_kv * self.d_model
        gated = self.feed_forward_proj.startswith("gated-")
        return projection, (3 if gated else 2) * self.d_ff * self.d_model

    @property
    def prompt_work(self) -> int:
        """Multiply-adds per prompt token of ``T5.prompt_cache``: the
        encoder's products and each decoder layer's cross-attention keys and
        values."""
        projection, feed_forward = self._layer_work
        encoder_layer = 4 * projection + feed_forward
        return self.num_layers * encoder_layer + self.num_decoder_layers * 2 * projection

    @property
    def decode_work(self) -> int:
        """Multiply-adds per input token of ``T5.decode``, its attention over
        the keys aside (that grows with them): each decoder layer's
        self-attention projections, cross-attention queries and output,
        feed-forward, then the output projection."""
        projection, feed_forward = self._layer_work
        decoder_layer = 6 * projection + feed_forward
        return self.num_decoder_layers * decoder_layer + self.d_model * self.vocab_size

    @classmethod
    def from_dict(cls, config: dict) -> ModelArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names})


ACTIVATIONS = {
    "relu": nn.relu,
    # Hugging Face maps "gated-gelu" to the tanh approximation ("gelu_new").
    "gated-gelu": nn.gelu_approx,
    "gelu": nn.gelu,
    "silu": nn.silu,
    "gated-silu": nn.silu,
    "gated-relu": nn.relu,
}


def relative_position_bucket(
    relative_position: mx.array,
    bidirectional: bool,
    num_buckets: int,
    max_distance: int,
) -> mx.array:
    """Map key-minus-query distances to T5's buckets: exact for small
    distances, logarithmic up to ``max_distance``, one bucket beyond.
    A causal decoder only sees the past, so it spends no buckets on the future."""
    buckets = 0
    if bidirectional:
        num_buckets //= 2
        buckets = (relative_position > 0).astype(mx.int32) * num_buckets
        distance = mx.abs(relative_position)
    else:
        distance = -mx.minimum(relative_position, 0)
    max_exact = num_buckets // 2
    # Same float32 operations, in the same order, as the reference, so
    # distances on a bucket boundary land in the same bucket.
    log_ratio = mx.log(distance.astype(mx.float32) / max_exact)
    large = max_exact + (
        log_ratio / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).astype(mx.int32)
    large = mx.minimum(large, num_buckets - 1)
    return buckets + mx.where(distance < max_exact, distance, large)


class RelativePositionBias(nn.Module):
    """A learned scalar per head and distance bucket, added to attention scores."""

    def __init__(self, args: ModelArgs, bidirectional: bool):
        super().__init__()
        self.bidirectional = bidirectional
        self.num_buckets = args.relative_attention_num_buckets
        self.max_distance = args.relative_attention_max_distance
        self.embeddings = nn.Embedding(self.num_buckets, args.num_heads)

    def __call__(self, query_positions: mx.array, key_length: int) -> mx.array:
        """Bias [B, heads, T, key_length] for queries at ``query_positions``
        [B, T] (each row of a batch has its own) and keys at 0 .. key_length - 1."""
        buckets = relative_position_bucket(
            mx.arange(key_length) - query_positions[..., None],
            self.bidirectional,
            self.num_buckets,
            self.max_distance,
        )
        return self.embeddings(buckets).transpose(0, 3, 1, 2)

    def table(self, length: int) -> mx.array:
        """Bias [heads, 2 * length - 1] for every key - query distance from
        -(length - 1) to length - 1: the bias depends on that distance alone."""
        distances = mx.arange(-(length - 1), length)
        buckets = relative_position_bucket(
            distances, self.bidirectional, self.num_buckets, self.max_distance
        )
        return self.embeddings(buckets).T


# On the CPU, products over at most this many rows (decoder steps, verify
# passes, short prompts) may take Linear's weight-streaming form.
STREAMING_ROWS = 512


class Linear(nn.Linear):
    """``x W^T`` without bias. On the CPU, in the form :func:`store_for_cpu`
    measured fastest for the weight's shape (docs/benchmarks.md): ``x W^T``
    with ``W`` as it is stored, or kept transposed in memory, or over at
    most ``STREAMING_ROWS`` rows as ``(W x^T)^T``, every row of the batch in
    one product, so that OpenBLAS streams ``W`` through its kernels instead
    of first copying it into its packed layout."""

    def __init__(self, input_dims: int, output_dims: int):
        super().__init__(input_dims, output_dims, bias=False)
        self.streaming = False

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if not (self.streaming and rows <= STREAMING_ROWS):
            return x @ self.weight.T
        # Rows as they are: in a shapeless compiled function (RowsFunction), a
        # reshape would keep the shape of its first call.
        if x.ndim == 2:
            return (self.weight @ x.T).T
        return self(x.reshape(rows, x.shape[-1])).reshape(*x.shape[:-1], -1)


LOG2_E = math.log2(math.e)
# ln 2 split in two, so n * LN2_HIGH is exact for the n that occur.
LN2_HIGH, LN2_LOW = 0.693145751953125, 1.428606765330187e-06
# 1/k! for k = 7 .. 1: e^r's Taylor polynomial, highest term first.
TAYLOR = tuple(1 / math.factorial(k) for k in range(7, 0, -1))


class CompiledPerShape:
    """``mx.compile(function)``, traced for each shape of its arguments,
    that forgets the shapes it traced once it holds ``MAX_TRACED_SHAPES``:
    MLX keeps every shape's trace while the compiled function lives (about
    40 KB each; 10,000 shapes grew a process by 360 MB), and a decoder's
    keys grow by one at every pass, prompts come in every length. (The
    softmax below compiled once for every shape, ``shapeless=True``, took
    1.25x the time over long prompts, and MLX 0.32 crashed on it over a
    single key: docs/benchmarks.md.)"""

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
    relative error ~1e-6). MLX's own exp is a scalar loop on the CPU (about
    13 ns per value here): a 400-token encoder spent 40% of its time in it.
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
# MLX's exp than calling a compiled function adds. At 32 rows x 16 heads x 60
# keys, attention took 0.74x the time through softmax_cpu (a one-row step
# 1.24x); regular decoding of the benchmark pair's file at B = 32 made 4-5%
# more tokens/s than with this at 65,536 (docs/benchmarks.md).
SOFTMAX_CPU_MIN_SCORES = 1 << 11


def attention(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
    """``softmax(q k^T + mask) v`` for each head; T5 has no 1/sqrt(d) scaling."""
    num_scores = math.prod(queries.shape[:-1]) * keys.shape[-2]
    if mx.default_device() == mx.gpu or num_scores < SOFTMAX_CPU_MIN_SCORES:
        return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=mask)
    # On the CPU that call computes these same steps, with the slow exp.
    scores = (queries @ keys.swapaxes(-1, -2) + mask).astype(mx.float32)
    return softmax_cpu(scores).astype(values.dtype) @ values


# The encoder's self-attention runs over blocks of queries, each block's
# float32 scores taking at most this many bytes: memory grows with the
# prompt's length, not its square (no [B, heads, S, S] array exists), and a
# block's scores stay in the CPU's caches while softmax reads them (on the
# benchmark pair's draft, 8 MB blocks were the fastest or within 5% of it
# at 2,500 and 10,000 tokens, against 2, 16 and 64 MB).
ENCODER_BLOCK_BYTES = 1 << 23


def encoder_block_size(batch_size: int, num_heads: int, length: int) -> int:
    """Queries per block of encoder self-attention over ``batch_size``
    prompts of ``length`` tokens: all of them when their float32 scores
    take at most ``ENCODER_BLOCK_BYTES``."""
    block_size = ENCODER_BLOCK_BYTES // (4 * batch_size * num_heads * length)
    return max(1, min(length, block_size))


@dataclass
class BlockMask:
    """The additive mask of encoder self-attention, made one block of
    queries at a time: the relative position bias plus each row's padding."""

    bias_table: mx.array  # [heads, 2 S - 1]: RelativePositionBias.table, contiguous
    padding: mx.array | None  # [B, 1, 1, S]; None: no row is padded
    length: int
    block_size: int

    def blocks(self) -> list[tuple[int, int]]:
        """(start, stop) of each block of queries."""
        return [
            (start, min(start + self.block_size, self.length))
            for start in range(0, self.length, self.block_size)
        ]

    def __call__(self, start: int, stop: int) -> mx.array:
        """The mask [B or 1, heads, stop - start, S] of queries start .. stop - 1."""
        heads, width = self.bias_table.shape
        # Query q reads the table from distance -q on, one step back per
        # query: a strided view of the table, not a gather of S^2 values.
        bias = mx.as_strided(
            self.bias_table,
            (1, heads, stop - start, self.length),
            (0, width, -1, 1),
            offset=self.length - 1 - start,
        )
        return bias if self.padding is None else bias + self.padding

    def attend(self, queries: mx.array, keys: mx.array, values: mx.array) -> mx.array:
        """``attention`` over every block of queries [B, heads, S, d_kv]."""
        outputs = []
        for start, stop in self.blocks():
            outputs.append(attention(queries[:, :, start:stop], keys, values, self(start, stop)))
            mx.eval(outputs[-1])  # so that one block's scores exist at a time
        return mx.concatenate(outputs, axis=2)


class Attention(nn.Module):
    """Multi-head attention without score scaling; T5 folds it into the
    weights. The queries, keys and values of the subclasses come from their
    projections; this attends and projects the result back."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.head_dim = args.d_kv
        self.out_proj = Linear(args.num_heads * args.d_kv, args.d_model)

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array | BlockMask
    ) -> mx.array:
        """The output [B, length, d_model] for [B, heads, length, d_kv] ``queries``."""
        return self.out_proj(self.heads_side_by_side(queries, keys, values, mask))

    def heads_side_by_side(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array | BlockMask
    ) -> mx.array:
        """The heads' outputs [B, length, heads * d_kv], before ``out_proj``."""
        if isinstance(mask, BlockMask):
            out = mask.attend(queries, keys, values)
        else:
            out = attention(queries, keys, values, mask)
        batch, _, length, _ = out.shape
        return out.transpose(0, 2, 1, 3).reshape(batch, length, -1)


class SelfAttention(Attention):
    """Attention of a sequence over itself. Its queries, keys and values
    come from one product with the three projections stacked (``qkv_proj``,
    [3 * heads * d_kv, d_model]): one weight read and one product instead
    of three, which made a decoder pass of the benchmark pair's main model
    0.93x the time at 1 row and 0.94x at 8 (docs/benchmarks.md)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.qkv_proj = Linear(args.d_model, 3 * args.num_heads * args.d_kv)

    def queries_keys_values(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values of ``x`` [B, length, d_model], split
        into heads: each [B, heads, length, d_kv], contiguous."""
        # Copied out of their heads' views once, for the attention's
        # products: a product copies a view whose rows are not packed, and
        # the keys', read transposed, as a transpose, several times slower
        # than this copy (the benchmark pair's 32 prompts were encoded in
        # 0.92-0.93x the time).
        return tuple(map(mx.contiguous, self.split_stacked(self.qkv_proj(x))))

    def split_stacked(self, stacked: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values [B, heads, length, d_kv] from the
        output [B, length, 3 * heads * d_kv] of ``qkv_proj``."""
        batch, length, _ = stacked.shape
        stacked = stacked.reshape(batch, length, 3 * self.num_heads, self.head_dim)
        stacked = stacked.transpose(0, 2, 1, 3)
        heads = self.num_heads
        return stacked[:, :heads], stacked[:, heads : 2 * heads], stacked[:, 2 * heads :]


class CrossAttention(Attention):
    """Attention of the decoder over the encoder's output, whose keys and
    values are computed once per prompt."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        inner_dim = args.num_heads * args.d_kv
        self.query_proj = Linear(args.d_model, inner_dim)
        self.key_proj = Linear(args.d_model, inner_dim)
        self.value_proj = Linear(args.d_model, inner_dim)

    def split_heads(self, x: mx.array) -> mx.array:
        """[B, heads, length, d_kv] from ``x`` [B, length, heads * d_kv]."""
        batch, length, _ = x.shape
        return x.reshape(batch, length, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)

    def keys_values(self, memory: mx.array) -> tuple[mx.array, mx.array]:
        """Keys and values of ``memory`` [B, length, d_model], split into
        heads: [B, heads, length, d_kv]."""
        return self.split_heads(self.key_proj(memory)), self.split_heads(self.value_proj(memory))


class FeedForward(nn.Module):
    """``wo(act(wi x))``, or ``wo(act(wi_0 x) * wi_1 x)`` for the gated variants."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        if args.feed_forward_proj not in ACTIVATIONS:
            raise ValueError(
                f"unsupported feed_forward_proj {args.feed_forward_proj!r}; "
                f"expected one of {', '.join(ACTIVATIONS)}"
            )
        self.activation = ACTIVATIONS[args.feed_forward_proj]
        self.gated = args.feed_forward_proj.startswith("gated-")
        if self.gated:
            self.wi_0 = Linear(args.d_model, args.d_ff)
            self.wi_1 = Linear(args.d_model, args.d_ff)
        else:
            self.wi = Linear(args.d_model, args.d_ff)
        self.wo = Linear(args.d_ff, args.d_model)

    def __call__(self, x: mx.array) -> mx.array:
        if self.gated:
            return self.wo(self.activation(self.wi_0(x)) * self.wi_1(x))
        return self.wo(self.activation(self.wi(x)))


def clamp_float16(x: mx.array) -> mx.array:
    """Keep float16 activations finite. T5 v1.0 residual streams exceed the
    float16 range; like the reference, clip just below the largest value."""
    if x.dtype != mx.float16:
        return x
    limit = float(mx.finfo(mx.float16).max) - 1000
    return mx.clip(x, -limit, limit)


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.self_attn = SelfAttention(args)
        self.ff_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.ff = FeedForward(args)

    def __call__(self, x: mx.array, mask: mx.array | BlockMask) -> mx.array:
        y = self.self_attn_norm(x)
        queries, keys, values = self.self_attn.queries_keys_values(y)
        x = clamp_float16(x + self.self_attn.attend(queries, keys, values, mask))
        return clamp_float16(x + self.ff(self.ff_norm(x)))


def keep_buffer_rows(buffer: mx.array, rows: list[int]) -> mx.array:
    """A buffer whose first ``len(rows)`` rows (axis 0) are ``buffer[rows]``;
    rows past them are left unused. When ``rows`` is in the order of
    ``compacted_rows``, only the rows moving into dropped places are copied,
    into ``buffer`` itself; otherwise all are gathered into a new buffer.
    (Gathering every cache of a 32-row batch of the benchmark pair into new
    memory took 50-800 ms, mostly first touches of fresh pages.)"""
    moved = [i for i, row in enumerate(rows) if row != i]
    if any(rows[i] < len(rows) for i in moved):
        return buffer[mx.array(rows)]
    if moved:
        source = buffer[mx.array([rows[i] for i in moved])]
        mx.eval(source)  # first, so that the writes below reuse buffer's memory
        for k, i in enumerate(moved):  # row writes: a scatter took 3x as long
            buffer[i : i + 1] = source[k : k + 1]
    return buffer


def compacted_rows(staying: list[bool]) -> list[int]:
    """The rows to keep, where ``staying[i]`` says whether row i stays, in
    the order ``keep_buffer_rows`` copies least for: the staying rows among the
    first ``sum(staying)`` keep their places, and those past them fill the
    places of the rows that leave."""
    count = sum(staying)
    order = list(range(count))
    holes = [i for i in order if not staying[i]]
    tail = [i for i in range(count, len(staying)) if staying[i]]
    for hole, row in zip(holes, tail, strict=True):
        order[hole] = row
    return order


class KVCache:
    """Self-attention keys and values of one decoder layer, for a batch of
    rows that each have their own length (rows of a speculative batch
    accept different numbers of draft tokens, and rows join a running batch
    at different times).

    Row i's position p lies at column ``starts[i] + p`` of the storage, so
    that rows which joined later write where the others do: one write
    covers every row while their columns agree (with different columns each
    row's positions are scattered, which on the CPU cost as much as copying
    the whole storage: 4 ms of a 37 ms step at 32 rows). A row with nothing
    cached starts at the batch's column; the columns before a row's start
    are hidden by the mask (``DecoderCache.reserve``). Storage grows in
    chunks of ``step`` columns, so appending is a write, not a
    concatenation; growing also aligns every row's end to the same column.
    ``trim`` only moves a row's end marker: what lies past it is hidden by
    the causal mask (it is "later" than every query of the row) and
    overwritten by the row's next tokens. The storage may hold more rows
    than the batch (rows that left it, see ``keep_buffer_rows``): the batch
    is its first ``len(lengths)``.
    """

    # Small, because a batch's first pass fills all its storage with zeros,
    # touching fresh pages: with 256, the first pass of 32 rows of the
    # benchmark pair took 0.3-0.8 s (a later pass 0.07 s), with 64 0.09-0.2 s,
    # and regular decoding of its 32 prompts at B = 32 went from 173 to 204
    # tokens/s, whole calls (docs/benchmarks.md).
    step = 64

    def __init__(self, batch_size: int = 1):
        self.keys: mx.array | None = None  # [rows held, heads, capacity, d_kv]
        self.values: mx.array | None = None
        self.lengths = [0] * batch_size
        self.starts = [0] * batch_size  # the column of each row's position 0

    @property
    def ends(self) -> list[int]:
        """The column after each row's last cached position."""
        return [start + n for start, n in zip(self.starts, self.lengths, strict=True)]

    def reserve(self, length: int) -> None:
        """Make room for ``length`` more positions in every row: rows with
        nothing cached start at the batch's last column, and the storage
        grows if it must."""
        column = max((end for end, n in zip(self.ends, self.lengths) if n > 0), default=0)
        self.starts = [start if n > 0 else column for start, n in zip(self.starts, self.lengths)]
        if self.keys is None:  # the first write allocates
            return
        if column + length > self.keys.shape[2] or len(self.lengths) > self.keys.shape[0]:
            self._grow(length)

    def _grow(self, length: int) -> None:
        """Storage for ``length`` positions past the longest row, every row
        moved to end where it does: one write for all rows again."""
        rows, longest = len(self.lengths), max(self.lengths)
        held, heads, _, dim = self.keys.shape
        capacity = self.step * math.ceil((longest + length) / self.step)
        starts = [longest - n for n in self.lengths]
        grown = []
        for old in (self.keys, self.values):
            # Zeros, not memory past the old storage's end, in rows admitted past it.
            new = mx.zeros((rows, heads, capacity, dim), old.dtype)
            for i in range(min(rows, held)):  # a slice per row: a gather cost 5 ns a value
                n, start = self.lengths[i], self.starts[i]
                if n:
                    new[i : i + 1, :, starts[i] : longest] = old[i : i + 1, :, start : start + n]
            grown.append(new)
        self.keys, self.values = grown
        self.starts = starts

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Append [B, heads, T, d_kv] keys/values to every row; return the
        cache up to the last column written."""
        batch, heads, length, dim = keys.shape
        self.reserve(length)
        if self.keys is None:
            capacity = self.step * math.ceil(length / self.step)
            self.keys = mx.zeros((batch, heads, capacity, dim), keys.dtype)
            self.values = mx.zeros((batch, heads, capacity, dim), values.dtype)
        ends = self.ends
        end = max(ends) + length
        if min(ends) == max(ends):  # one write for all rows
            self.keys[:batch, :, ends[0] : end, :] = keys
            self.values[:batch, :, ends[0] : end, :] = values
        else:
            # Every row held is written: the unused ones at 0, with zeros.
            held = self.keys.shape[0]
            columns = mx.array(ends + [0] * (held - batch))[:, None] + mx.arange(length)
            index = mx.broadcast_to(columns[:, None, :, None], (held, heads, length, dim))
            self.keys = mx.put_along_axis(self.keys, index, pad_to(keys, held, 0), axis=2)
            self.values = mx.put_along_axis(self.values, index, pad_to(values, held, 0), axis=2)
        self.lengths = [n + length for n in self.lengths]
        return self.keys[:batch, :, :end, :], self.values[:batch, :, :end, :]

    def trim(self, counts: int | list[int]) -> None:
        """Forget the last ``counts[i]`` positions of row i (one number: of every row)."""
        if isinstance(counts, int):
            counts = [counts] * len(self.lengths)
        self.lengths = [max(0, n - c) for n, c in zip(self.lengths, counts, strict=True)]

    def admit(self, rows: list[int]) -> None:
        """Empty ``rows`` for new prompts; rows at or past the batch size are
        added (the storage grows at the next write if it holds too few)."""
        added = max(rows) + 1 - len(self.lengths)
        self.lengths += [0] * added
        self.starts += [0] * added
        for row in rows:
            self.lengths[row] = 0

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order (see ``keep_buffer_rows``)."""
        if self.keys is not None:
            # Rows admitted past the storage have none yet: zeros, not memory
            # past the buffer's end.
            held = max(rows) + 1
            self.keys = keep_buffer_rows(pad_to(self.keys, held, 0), rows)
            self.values = keep_buffer_rows(pad_to(self.values, held, 0), rows)
        self.lengths = [self.lengths[row] for row in rows]
        self.starts = [self.starts[row] for row in rows]


def pad_to(x: mx.array, length: int, axis: int) -> mx.array:
    """``x`` with zeros appended along ``axis`` up to ``length``."""
    if x.shape[axis] >= length:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, length - x.shape[axis])
    return mx.pad(x, widths)


class DecoderCache:
    """What the decoder keeps between steps for a batch of prompts: a
    trimmable self-attention cache per layer, and the cross-attention keys
    and values of each prompt's encoder output, computed once per prompt.
    Prompts of different lengths share a cross-attention width, the
    longest's; each row's padding is masked."""

    def __init__(
        self,
        cross_keys_values: list[tuple[mx.array, mx.array]],
        prompt_lengths: list[int],
    ):
        self.self_attn = [KVCache(len(prompt_lengths)) for _ in cross_keys_values]
        # Per layer, [rows held, heads, prompt width, d_kv]: the batch is
        # the first len(prompt_lengths) rows, as in KVCache.
        self.cross_buffers = cross_keys_values
        self.prompt_lengths = prompt_lengths
        self._update_memory_mask()

    @property
    def cross_keys_values(self) -> list[tuple[mx.array, mx.array]]:
        """Per layer, the cross-attention keys and values of the batch's rows."""
        batch = len(self.prompt_lengths)
        return [(keys[:batch], values[:batch]) for keys, values in self.cross_buffers]

    def _update_memory_mask(self) -> None:
        keys = self.cross_buffers[0][0]
        real = mx.arange(keys.shape[2]) < mx.array(self.prompt_lengths)[:, None]
        self.memory_mask = padding_mask(real, keys.dtype)

    @property
    def lengths(self) -> list[int]:
        """Decoder positions cached, per row."""
        return self.self_attn[0].lengths

    def reserve(self, length: int) -> tuple[mx.array, mx.array]:
        """Make room for ``length`` new tokens in every row (see
        ``KVCache.reserve``) and return the storage columns [B, length]
        they will take, and the mask [B, length, columns] that hides from
        each of them the columns that are not its row's earlier positions
        (later ones, or before the row's start)."""
        for cache in self.self_attn:
            cache.reserve(length)
        first = self.self_attn[0]
        columns = mx.array(first.ends)[:, None] + mx.arange(length)
        key_columns = mx.arange(max(first.ends) + length)
        starts = mx.array(first.starts)[:, None, None]
        hidden = (key_columns > columns[..., None]) | (key_columns < starts)
        return columns, hidden

    @property
    def offset(self) -> int:
        """Decoder positions cached in a batch of one."""
        (length,) = self.lengths
        return length

    def trim(self, counts: int | list[int]) -> None:
        """Forget the last ``counts[i]`` decoder positions of row i in every layer."""
        for cache in self.self_attn:
            cache.trim(counts)

    def admit(self, rows: list[int], cache: DecoderCache) -> None:
        """Give ``rows`` the prompts of the fresh ``cache`` (one row each, in
        order), with no decoder positions; rows at or past the batch size are
        added. A longer prompt widens every row's cross-attention."""
        width = max(self.cross_buffers[0][0].shape[2], max(cache.prompt_lengths))
        batch_size = max(len(self.prompt_lengths), max(rows) + 1)
        cross = []
        for batch_kv, new_kv in zip(self.cross_buffers, cache.cross_keys_values):
            arrays = []
            for buffer, new_array in zip(batch_kv, new_kv):
                buffer = pad_to(pad_to(buffer, width, 2), batch_size, 0)
                # A slice per row: written in place, where a scatter by row
                # index took 8 ms per prompt joining a batch of 8.
                for i, row in enumerate(rows):
                    buffer[row : row + 1] = pad_to(new_array[i : i + 1], width, 2)
                arrays.append(buffer)
            cross.append(tuple(arrays))
        # Replaced before they are computed, so that the writes reuse the buffers' memory.
        self.cross_buffers = cross
        mx.eval(cross)
        self.prompt_lengths += [0] * (batch_size - len(self.prompt_lengths))
        for row, length in zip(rows, cache.prompt_lengths, strict=True):
            self.prompt_lengths[row] = length
        self._update_memory_mask()
        for layer_cache in self.self_attn:
            layer_cache.admit(rows)

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order."""
        self.cross_buffers = [
            (keep_buffer_rows(keys, rows), keep_buffer_rows(values, rows))
            for keys, values in self.cross_buffers
        ]
        self.prompt_lengths = [self.prompt_lengths[row] for row in rows]
        self._update_memory_mask()
        for cache in self.self_attn:
            cache.keep_rows(rows)


def joined_caches(caches: list[DecoderCache], rows: list[int]) -> DecoderCache:
    """One cache of the fresh ``caches``' rows: row i is ``rows[i]`` of
    their rows taken in turn. Each layer's keys and values are copied once,
    and the parts freed layer by layer, so that memory grows by one layer's
    (admitting the caches one by one copied every layer at each, 30% of the
    prompt time of 32 prompts encoded in 7 passes)."""
    width = max(cache.cross_buffers[0][0].shape[2] for cache in caches)
    index = None if rows == sorted(rows) else mx.array(rows)
    cross = []
    for layer in range(len(caches[0].cross_buffers)):
        pair = []
        for j in range(2):  # keys, values
            joined = mx.concatenate([pad_to(c.cross_buffers[layer][j], width, 2) for c in caches])
            pair.append(joined if index is None else joined[index])
        mx.eval(pair)
        cross.append(tuple(pair))
        for cache in caches:
            cache.cross_buffers[layer] = None
    lengths = [length for cache in caches for length in cache.prompt_lengths]
    return DecoderCache(cross, [lengths[row] for row in rows])


# Prompts of a batch are encoded in one padded pass when the longest is at
# most this many times the shortest: padding is work for nothing, and a pass
# more costs little once it holds a few prompts. The 32 prompts of the
# benchmark pair's file (8 to 67 tokens) took 1.31 s in 7 passes at 1.25,
# 1.45-1.47 s in 5 or 3 at 1.5 and 2, 1.54 s in 11 at 1.1.
ENCODE_TOGETHER_RATIO = 1.25


def encoder_passes(prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """The indices of ``prompts`` that each encoder pass takes, shortest
    first: a pass takes the prompts of up to ``ENCODE_TOGETHER_RATIO`` times
    the length of its shortest."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    passes = [[order[0]]]
    for i in order[1:]:
        if len(prompts[i]) > ENCODE_TOGETHER_RATIO * len(prompts[passes[-1][0]]):
            passes.append([])
        passes[-1].append(i)
    return passes


class RowsFunction:
    """``function(module, rows, *arrays)`` of rows [N, d], compiled once for
    every N (``mx.compile``, shapeless): MLX fuses its element-wise work, and
    Python builds no graph for it at each call. The arrays of ``module``'s
    children are inputs of every call, so that later changes to them (a
    weight's layout) are seen. ``module`` holds its RowsFunctions, so they
    hold it weakly: a reference cycle would keep a dropped model's weights
    until Python's cyclic collector ran. A shapeless compilation keeps the
    branches taken at its first call, and Linear takes another form past
    ``STREAMING_ROWS`` rows: one compilation each side of it. (Compiling one
    function twice gives one compilation: MLX tells them apart by the
    function object.)"""

    def __init__(self, function: Callable, module: nn.Module):
        module_ref = weakref.ref(module)
        self.few_rows, self.many_rows = (
            mx.compile(
                lambda *args: function(module_ref(), *args), inputs=dict(module), shapeless=True
            )
            for _ in range(2)
        )

    def __call__(self, rows: mx.array, *arrays: mx.array):
        compiled = self.few_rows if rows.shape[0] <= STREAMING_ROWS else self.many_rows
        return compiled(rows, *arrays)


class DecoderLayer(nn.Module):
    """Self-attention over the cached positions, cross-attention over the
    prompt, and the feed-forward block. What lies around the two attentions
    (norms, projections, residual sums, the feed-forward block) works on the
    positions as rows [B * T, d_model], in ``RowsFunction``s: a decoder pass
    is a graph of about a thousand small operations, which MLX runs one at a
    time, so fewer of them and less Python per pass pays: on the benchmark
    pair, a pass of its main model took 0.92x the time at 1 row and 0.97x
    at 8, one of its draft 0.84x and 0.92x; at 32 rows, the same
    (docs/benchmarks.md)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.self_attn = SelfAttention(args)
        self.cross_attn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.cross_attn = CrossAttention(args)
        self.ff_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.ff = FeedForward(args)
        self.self_attention_inputs = RowsFunction(DecoderLayer._self_attention_inputs, self)
        self.after_self_attention = RowsFunction(DecoderLayer._after_self_attention, self)
        self.after_cross_attention = RowsFunction(DecoderLayer._after_cross_attention, self)

    def _self_attention_inputs(self, x: mx.array) -> mx.array:
        return self.self_attn.qkv_proj(self.self_attn_norm(x))

    def _after_self_attention(self, x: mx.array, heads: mx.array) -> tuple[mx.array, mx.array]:
        x = clamp_float16(x + self.self_attn.out_proj(heads))
        return x, self.cross_attn.query_proj(self.cross_attn_norm(x))

    def _after_cross_attention(self, x: mx.array, heads: mx.array) -> mx.array:
        x = clamp_float16(x + self.cross_attn.out_proj(heads))
        return clamp_float16(x + self.ff(self.ff_norm(x)))

    def __call__(
        self,
        x: mx.array,
        self_mask: mx.array,
        cache: KVCache,
        cross_keys_values: tuple[mx.array, mx.array],
        memory_mask: mx.array,
    ) -> mx.array:
        batch, length, d_model = x.shape
        x = x.reshape(batch * length, d_model)
        stacked = self.self_attention_inputs(x).reshape(batch, length, -1)
        queries, keys, values = self.self_attn.split_stacked(stacked)
        keys, values = cache.update_and_fetch(keys, values)
        heads = self.self_attn.heads_side_by_side(queries, keys, values, self_mask)
        x, queries = self.after_self_attention(x, heads.reshape(batch * length, -1))
        queries = self.cross_attn.split_heads(queries.reshape(batch, length, -1))
        heads = self.cross_attn.heads_side_by_side(queries, *cross_keys_values, memory_mask)
        x = self.after_cross_attention(x, heads.reshape(batch * length, -1))
        return x.reshape(batch, length, d_model)


def padding_mask(mask: mx.array | None, dtype: mx.Dtype) -> mx.array:
    """Additive key mask [B, 1, 1, S] from a [B, S] array of 1 (token) / 0 (padding)."""
    if mask is None:
        return mx.zeros((1, 1, 1, 1), dtype)
    return mx.where(mask.astype(mx.bool_), 0.0, -mx.inf).astype(dtype)[:, None, None, :]


class Stack(nn.Module):
    """The layers of the encoder or the decoder, their shared position bias
    and their final norm."""

    def __init__(self, args: ModelArgs, layer_class: type, num_layers: int, bidirectional: bool):
        super().__init__()
        self.position_bias = RelativePositionBias(args, bidirectional)
        self.layers = [layer_class(args) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)


class T5(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.shared = nn.Embedding(args.vocab_size, args.d_model)
        self.encoder = Stack(args, EncoderLayer, args.num_layers, bidirectional=True)
        self.decoder = Stack(args, DecoderLayer, args.num_decoder_layers, bidirectional=False)
        if not args.tie_word_embeddings:
            self.lm_head = Linear(args.d_model, args.vocab_size)

    @property
    def dtype(self) -> mx.Dtype:
        """The floating-point type of the parameters (a quantized embedding's
        weight is packed integers, so ask a norm)."""
        return self.decoder.norm.weight.dtype

    def embed(self, tokens: mx.array) -> mx.array:
        # A quantized embedding dequantizes to its scales' type; keep the model's.
        return self.shared(tokens).astype(self.dtype)

    def encode(
        self,
        inputs: mx.array,
        mask: mx.array | None = None,
        on_layer: Callable[[], None] | None = None,
    ) -> mx.array:
        """Encoder output [B, S, d_model] for token ids [B, S]; ``mask`` marks
        real tokens with 1 and padding with 0. Each layer is computed before
        the next is built, and ``on_layer()`` called after it (progress)."""
        x = self.embed(inputs)
        batch, length = inputs.shape
        attn_mask = BlockMask(
            mx.contiguous(self.encoder.position_bias.table(length)),
            None if mask is None else padding_mask(mask, x.dtype),
            length,
            encoder_block_size(batch, self.args.num_heads, length),
        )
        if len(attn_mask.blocks()) == 1:  # one block: one mask, made once for every layer
            attn_mask = attn_mask(0, length)
        for layer in self.encoder.layers:
            x = layer(x, attn_mask)
            mx.eval(x)  # one layer's blocks at a time
            if on_layer is not None:
                on_layer()
        return self.encoder.norm(x)

    def make_cache(self, memory: mx.array, mask: mx.array | None = None) -> DecoderCache:
        """A fresh decoder cache for the encoder output ``memory``; ``mask``
        marks each row's real tokens with 1 and its right padding with 0."""
        # Read at every step: stored row-contiguous per head, so each step's
        # products read them in place instead of copying them first.
        cross = [
            tuple(map(mx.contiguous, layer.cross_attn.keys_values(memory)))
            for layer in self.decoder.layers
        ]
        batch, length, _ = memory.shape
        prompt_lengths = [length] * batch if mask is None else mask.sum(axis=1).tolist()
        return DecoderCache(cross, prompt_lengths)

    def prompt_cache(
        self, prompts: Sequence[Sequence[int]], on_layer: Callable[[], None] | None = None
    ) -> DecoderCache:
        """A fresh decoder cache for ``prompts`` (token ids), one row each in
        order, encoded in the passes of ``encoder_passes``; ``on_layer()`` is
        called after each encoder layer of each pass. Computed here, so that
        prompt processing ends when it returns."""
        passes = encoder_passes(prompts)
        caches = [self._encoded([prompts[i] for i in group], on_layer) for group in passes]
        order = [i for group in passes for i in group]
        if len(caches) == 1 and order == sorted(order):
            mx.eval(caches[0].cross_keys_values)
            return caches[0]
        return joined_caches(caches, [order.index(i) for i in range(len(prompts))])

    def _encoded(
        self, prompts: Sequence[Sequence[int]], on_layer: Callable[[], None] | None
    ) -> DecoderCache:
        """A fresh decoder cache for ``prompts``, encoded in one padded pass."""
        width = max(map(len, prompts))
        pad = [self.args.pad_token_id]
        inputs = mx.array([list(ids) + pad * (width - len(ids)) for ids in prompts])
        mask = None
        if any(len(ids) < width for ids in prompts):
            mask = mx.arange(width) < mx.array([len(ids) for ids in prompts])[:, None]
        return self.make_cache(self.encode(inputs, mask, on_layer), mask)

    def decode(self, decoder_inputs: mx.array, cache: DecoderCache) -> mx.array:
        """Logits [B, T, vocab] for the next token after each of the T new
        decoder tokens of every row; appends them to ``cache``, each row
        after its own cached positions."""
        x = self.embed(decoder_inputs)
        length = decoder_inputs.shape[1]
        columns, hidden = cache.reserve(length)
        # Key minus query column is key minus query position: the bias
        # works on columns. Relative position buckets do not hide the
        # future, so the mask does; it also hides whatever lies past a row's
        # own length or before its start.
        self_mask = self.decoder.position_bias(columns, hidden.shape[-1])
        self_mask = mx.where(hidden[:, None], -mx.inf, self_mask).astype(x.dtype)
        for layer, layer_cache, cross in zip(
            self.decoder.layers, cache.self_attn, cache.cross_keys_values
        ):
            x = layer(x, self_mask, layer_cache, cross, cache.memory_mask)
        x = self.decoder.norm(x)
        if self.args.scale_decoder_outputs:
            x = x * self.args.d_model**-0.5
        if self.args.tie_word_embeddings:
            return self.shared.as_linear(x)
        return self.lm_head(x)

    def __call__(
        self, inputs: mx.array, decoder_inputs: mx.array, mask: mx.array | None = None
    ) -> mx.array:
        """Logits [B, T, vocab] for a whole decoder sequence; keeps no state."""
        memory = self.encode(inputs, mask)
        return self.decode(decoder_inputs, self.make_cache(memory, mask))


def quantizable_layers(model: T5, group_size: int) -> tuple[set[str], set[str]]:
    """Which layers a quantized conversion quantizes: the paths of every
    attention and feed-forward projection, ``lm_head`` and the shared
    embedding (which also serves as the tied output projection), and apart,
    those of them that stay in floating point because their input width is
    not a multiple of ``group_size``.

    The relative position bias tables are embeddings too, but they hold a
    few numbers per head, read a few rows at a time: they stay in floating
    point, chosen by path (their shape would not tell them apart in T5-11B).
    """
    quantized, too_narrow = set(), set()
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding)) or "position_bias" in path:
            continue
        fits = module.weight.shape[-1] % group_size == 0
        (quantized if fits else too_narrow).add(path)
    return quantized, too_narrow


def quantize(model: T5, quantization: dict, layers: set[str]) -> None:
    """Replace the layers at ``layers`` paths by their quantized forms, with
    ``quantization`` = {"group_size", "bits", "mode"}, in place."""
    nn.quantize(model, **quantization, class_predicate=lambda path, _: path in layers)


def parameter_bytes(args: ModelArgs, dtype: mx.Dtype, quantization: dict | None = None) -> int:
    """Bytes of the parameters of a T5 with ``args`` in ``dtype``, quantized
    as convert.py would quantize them; from the shapes alone (MLX is lazy,
    so the model built here is never computed)."""
    model = T5(args)
    model.set_dtype(dtype)
    if quantization:
        quantize(model, quantization, quantizable_layers(model, quantization["group_size"])[0])
    return sum(parameter.nbytes for _, parameter in tree_flatten(model.parameters()))


# A self-attention's projections, in the order SelfAttention.qkv_proj stacks them.
STACKED_PROJECTIONS = ("query_proj", "key_proj", "value_proj")


def stacked_projections(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """``weights`` (by parameter name) with each self-attention's query, key
    and value projections stacked into its ``qkv_proj`` (see
    ``SelfAttention``), as convert.py writes them; lazily. A quantized
    layer's weight, scales and biases are stacked alike: its groups lie
    along the inputs, so each output row keeps its own."""
    stacked = dict(weights)
    pattern = re.compile(r"(.+\.self_attn)\.query_proj\.(weight|scales|biases)")
    for name in weights:
        if match := pattern.fullmatch(name):
            layer, kind = match.groups()
            names = [f"{layer}.{projection}.{kind}" for projection in STACKED_PROJECTIONS]
            if all(name in stacked for name in names):  # else loading says what is missing
                parts = [stacked.pop(name) for name in names]
                stacked[f"{layer}.qkv_proj.{kind}"] = mx.concatenate(parts, axis=0)
    return stacked


def weights_file(path: str | Path) -> Path:
    """The weights of the converted model at ``path``: its ``WEIGHTS_FILE``
    (safetensors), or the ``LEGACY_WEIGHTS_FILE`` (.npz) of an earlier
    conversion; ``FileNotFoundError`` if it has neither.

    MLX reads each member of an .npz through Python, and the last reader's
    reference can be dropped on MLX's I/O thread after the interpreter has
    begun to exit: a script that loaded such a model and ended at once
    aborted (SIGABRT, "terminate called without an active exception") in 9
    runs of 16, and 0 of 16 from safetensors, which also loaded 2.7x faster."""
    for name in (WEIGHTS_FILE, LEGACY_WEIGHTS_FILE):
        if (Path(path) / name).is_file():
            return Path(path) / name
    raise FileNotFoundError(f"{Path(path) / WEIGHTS_FILE} does not exist")


def load_config(path: str | Path) -> ModelArgs:
    """The ``ModelArgs`` in ``path/config.json``; ``ValueError`` if unreadable."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} does not exist")
    try:
        return ModelArgs.from_dict(json.loads(config_file.read_text()))
    except (ValueError, TypeError) as error:  # bad JSON, missing or odd fields
        raise ValueError(
            f"cannot read {config_file}: {error}; convert the model again with convert.py"
        ) from None


# The ways ``Linear`` can compute ``x W^T`` on the CPU. Which one is fastest
# depends on the weight's shape and on the CPU: on the EPYCs measured
# before, weights with more outputs than inputs ran 1.1-1.7x faster kept
# transposed and the others streamed; on a Zen 5 the plain form beat or
# matched both at every shape; on a Zen 4 with few_rows.c's broadcast
# kernel, the transposed form of weights with 256 inputs took 0.62-0.72x
# the plain form's time (docs/benchmarks.md).
PRODUCT_FORMS = ("plain", "streaming", "transposed")
# Rows at which store_for_cpu times the forms: a decoder step of one prompt,
# and of a batch or a verify pass.
TIMED_ROWS = (1, 8)
# Weights smaller than this (in elements) keep the plain form: their
# products take a few microseconds, too few to matter. The 256 x 256
# projections of the benchmark pair's draft are timed: at 8 rows OpenBLAS
# took 46 us for them plain, few_rows.c's broadcast kernel 36 transposed,
# and a draft pass at 8 rows took 0.86x the time with them transposed
# (docs/benchmarks.md).
TIMED_FORM_MIN_SIZE = 1 << 16
# Another form replaces the plain one only when it takes at most this share
# of its time, so that near-ties do not make two loads of a model on one
# machine compute differently.
FORM_MARGIN = 0.9


def fastest_form(times: dict[str, float]) -> str:
    """The form in ``times`` (seconds per form) to compute with: the fastest,
    unless it saves less than ``1 - FORM_MARGIN`` of the plain form's time."""
    fastest = min(times, key=times.get)
    return fastest if times[fastest] <= FORM_MARGIN * times["plain"] else "plain"


# store_for_cpu times each form over this many bytes of weights, taken in
# turn, so that each product reads its weight from memory as a decoder pass
# does, not from a cache (last-level caches here: 32 MB)...
TIMED_FORM_BYTES = 64 << 20
# ...and each timing evaluates the products of up to this many bytes of them
# in one graph: evaluating a graph costs tens of microseconds here, more
# than a small weight's product.
TIMED_GRAPH_BYTES = 16 << 20


def form_times(
    shape: tuple[int, int], dtype: mx.Dtype, forms: Sequence[str], repeats: int = 7
) -> dict[str, float]:
    """Seconds of ``x W^T`` for a weight of ``shape`` in each of ``forms``
    (``PRODUCT_FORMS``) at each of ``TIMED_ROWS`` rows, summed over the rows:
    medians of ``repeats`` timings, the forms interleaved, on throwaway
    weights of ``TIMED_FORM_BYTES`` in all, ``TIMED_GRAPH_BYTES`` of them
    a timing."""
    weight_bytes = math.prod(shape) * dtype.size
    count = max(1, TIMED_FORM_BYTES // weight_bytes)
    per_timing = max(1, min(count, TIMED_GRAPH_BYTES // weight_bytes))
    turn = itertools.count()
    weights = [mx.ones(shape, dtype) for _ in range(count)]
    stored_transposed = [mx.contiguous(w.T) for w in weights] if "transposed" in forms else []
    mx.eval(weights, stored_transposed)
    products = {
        "plain": lambda x, i: x @ weights[i].T,
        "streaming": lambda x, i: (weights[i] @ x.T).T,
        "transposed": lambda x, i: x @ stored_transposed[i],
    }
    totals = dict.fromkeys(forms, 0.0)
    for rows in TIMED_ROWS:
        x = mx.ones((rows, shape[1]), dtype)
        times = {form: [] for form in forms}
        for _ in range(repeats):
            for form in forms:
                taken = [next(turn) % count for _ in range(per_timing)]
                tic = time.perf_counter()
                mx.eval([products[form](x, i) for i in taken])
                times[form].append((time.perf_counter() - tic) / per_timing)
        for form in forms:
            totals[form] += statistics.median(times[form])
    return totals


# The forms store_for_cpu chose, by blas.machine_key, shape, type and forms
# timed, in blas.cache_directory(): timing them took 0.75 s of the 0.98 s
# that loading the benchmark pair's main model took.
FORMS_FILE = "forms.json"


def chosen_form(shape: tuple[int, int], dtype: mx.Dtype, forms: Sequence[str]) -> str:
    """``fastest_form`` of ``form_times`` for a weight of ``shape``: timed
    once per machine and remembered in the cache (when it can be written),
    so that later loads take the same form at once. A choice timed while
    other processes kept the CPUs busy (``OtherProcesses``) is taken but
    not remembered: the next load times it again."""
    directory = blas.cache_directory()
    key = f"{blas.machine_key()} {shape[0]}x{shape[1]} {dtype} {'/'.join(forms)}"
    chosen = read_forms(directory)
    if key not in chosen:
        others = OtherProcesses()
        chosen[key] = fastest_form(form_times(shape, dtype, forms))
        if directory is not None and not others.were_busy():
            write_forms(directory, {**read_forms(directory), key: chosen[key]})
    return chosen[key]


def machine_cpu_seconds() -> float | None:
    """CPU seconds the machine's processors have spent busy since it booted
    (Linux's ``/proc/stat``, time taken by the hypervisor included); None
    where that cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# Other processes that use more than this share of a CPU while the forms are
# timed make the timings unfit to keep. On a 2-core Zen 4, while each shape
# of the benchmark pair was timed, a busy loop in another process took 0.6-0.9
# of a CPU, a loop of numpy products 1.1-1.2, a quiet machine at most 0.14;
# with the numpy loop, 2 to 4 of five shapes took another form than on the
# quiet machine, in each of four loads (docs/benchmarks.md).
BUSY_SHARE = 0.25
# /proc/stat counts in ticks (100 a second), on every CPU: what other
# processes used can read up to about this much too high on a quiet machine.
TICKS_SLACK_SECONDS = 0.02


class OtherProcesses:
    """How much CPU time processes other than this one take from the
    moment it is made: the machine's busy time minus this process's own
    (every thread's, OpenBLAS's included)."""

    def __init__(self):
        self.machine = machine_cpu_seconds()
        self.own = time.process_time()
        self.start = time.perf_counter()

    def were_busy(self) -> bool:
        """Whether they used more than ``BUSY_SHARE`` of a CPU on average
        since; False where the machine's CPU time cannot be read."""
        machine = machine_cpu_seconds()
        if machine is None or self.machine is None:
            return False
        elsewhere = (machine - self.machine) - (time.process_time() - self.own)
        elapsed = time.perf_counter() - self.start
        return elsewhere > BUSY_SHARE * elapsed + TICKS_SLACK_SECONDS


def read_forms(directory: Path | None) -> dict[str, str]:
    """The forms remembered in ``directory``; none if it holds no readable file."""
    try:
        forms = json.loads((directory / FORMS_FILE).read_text())
    except (TypeError, OSError, ValueError):  # no directory, no file, a broken one
        return {}
    return forms if isinstance(forms, dict) else {}


def write_forms(directory: Path, forms: dict[str, str]) -> None:
    """Replace ``directory``'s forms file with ``forms`` whole, or leave it
    as it is if it cannot be written."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        descriptor, staging = tempfile.mkstemp(suffix=".tmp", dir=directory)
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w") as file:
            json.dump(forms, file, indent=0)
        os.replace(staging, directory / FORMS_FILE)
    except OSError:
        os.unlink(staging)


def store_for_cpu(model: T5) -> None:
    """Choose, for each shape of float32 weight in ``model``, the form of
    ``x W^T`` that this CPU computes fastest (``PRODUCT_FORMS``, timed by
    :func:`form_times`), and lay out and mark its weights for it. The
    output projection, when it is the embedding, is timed plain or
    transposed. Shapes do not change, only where elements lie and the order
    OpenBLAS sums in, so every form computes the same function within
    round-off. In place, one weight at a time: memory grows by one weight
    while laying out, by twice ``TIMED_FORM_BYTES`` (or two weights) while
    timing. Each shape is timed once per machine (``chosen_form``).

    Half-precision products are not OpenBLAS's: they keep the plain form."""
    by_shape = {}
    for module in model.modules():
        if type(module) is Linear and module.weight.dtype == mx.float32:
            by_shape.setdefault(module.weight.shape, []).append(module)
    tied = model.args.tie_word_embeddings and type(model.shared) is nn.Embedding
    for modules in by_shape.values():
        weight = modules[0].weight
        if weight.size < TIMED_FORM_MIN_SIZE:
            continue
        form = chosen_form(weight.shape, weight.dtype, PRODUCT_FORMS)
        for module in modules:
            use_form(module, form)
    weight = model.shared.weight
    timed = tied and weight.dtype == mx.float32 and weight.size >= TIMED_FORM_MIN_SIZE
    forms = ("plain", "transposed")
    if timed and chosen_form(weight.shape, weight.dtype, forms) == "transposed":
        model.shared.weight = transposed_in_memory(weight)


def use_form(module: Linear, form: str) -> None:
    """Compute ``module``'s products in ``form`` (of ``PRODUCT_FORMS``) from
    now on; its weight was laid out as stored."""
    module.streaming = form == "streaming"
    if form == "transposed":
        module.weight = transposed_in_memory(module.weight)


def transposed_in_memory(weight: mx.array) -> mx.array:
    """``weight``, same shape, laid out as its transpose: [out, in] read as
    [in, out] row by row."""
    transposed = mx.contiguous(weight.T)
    mx.eval(transposed)
    return transposed.T


def load_model(path: str | Path) -> T5:
    """Load a model directory written by ``convert.py``, quantized or not.

    Raises ``FileNotFoundError`` if a file is missing and ``ValueError`` if
    the weights are unreadable or do not fit the configuration.
    """
    path = Path(path)
    args = load_config(path)
    file = weights_file(path)
    if file.name == LEGACY_WEIGHTS_FILE:
        print(
            f"note: {file} is the format of earlier conversions, which can abort the "
            f"process as it exits; convert the model again to write {WEIGHTS_FILE}",
            file=sys.stderr,
        )
    try:
        weights = mx.load(str(file))
        if file.name == LEGACY_WEIGHTS_FILE:
            weights = stacked_projections(weights)
        model = T5(args)
        if args.quantization:
            # The layers convert.py quantized are those whose weights have scales.
            scaled = {name.removesuffix(".scales") for name in weights if name.endswith(".scales")}
            quantize(model, args.quantization, scaled)
        model.load_weights(list(weights.items()))
        del weights  # the model holds them now: each weight store_for_cpu copies is freed
        if mx.default_device() == mx.cpu:
            store_for_cpu(model)
        mx.eval(model.parameters())
    except (ValueError, RuntimeError) as error:
        reason = " ".join(str(error).split())  # MLX's message spans lines
        raise ValueError(
            f"cannot load the weights in {file}: {reason}; convert the model again with convert.py"
        ) from None
    return model
