"""T5 encoder-decoder in MLX, with a trimmable decoder cache.

The model computes the same function as Hugging Face's
``T5ForConditionalGeneration``: relative position buckets added to the
attention scores (no 1/sqrt(d) scaling), RMS norms before every sub-layer,
and either a ReLU (T5 v1.0) or a gated-GELU (T5 v1.1, FLAN-T5, mT5)
feed-forward block.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

# First, so that importing this module (or decoder) from Python gets the fast
# BLAS on Linux too: MLX binds to an optimized BLAS only if it is loaded before mlx.
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx
from mlx import nn
from mlx.nn.layers.distributed import shard_inplace, shard_linear
from mlx.utils import tree_flatten

from cache import DecoderCache, KVCache, Tree, joined_caches, padding_mask


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

    def __call__(self, query_positions: mx.array, key_positions: mx.array) -> mx.array:
        """Bias [B, heads, T, S] for queries at ``query_positions`` [B, T]
        and keys at ``key_positions`` [S] or [B, S] (each row of a batch
        has its own)."""
        buckets = relative_position_bucket(
            mx.expand_dims(key_positions, -2) - query_positions[..., None],
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


def attention(queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array) -> mx.array:
    """``softmax(q k^T + mask) v`` for each head; T5 has no 1/sqrt(d) scaling."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=1.0, mask=mask)


AttentionFunction = Callable[[mx.array, mx.array, mx.array, mx.array], mx.array]


def side_by_side(heads: mx.array) -> mx.array:
    """Attention's output [B, heads, length, d_kv] as [B, length, heads * d_kv]."""
    batch, _, length, _ = heads.shape
    return heads.transpose(0, 2, 1, 3).reshape(batch, length, -1)


# The encoder's self-attention runs over blocks of queries, each block's
# float32 scores taking at most this many bytes: memory grows with the
# prompt's length, not its square (no [B, heads, S, S] array exists), and a
# block's scores stay in the CPU's caches while softmax reads them
# (docs/converting.md).
ENCODER_BLOCK_BYTES = 1 << 23


def encoder_block_size(batch_size: int, num_heads: int, length: int) -> int:
    """Queries per block of encoder self-attention over ``batch_size``
    prompts of ``length`` tokens: all of them when their float32 scores
    take at most ``ENCODER_BLOCK_BYTES``."""
    block_size = ENCODER_BLOCK_BYTES // (4 * batch_size * num_heads * length)
    return max(1, min(length, block_size))


# The encoder works in slices of about this many multiply-adds (a block of
# 8 MB of scores is about as much attention), so that a batch can decode
# between two of them (see ``T5.prompt_cache_slices``): a slice takes less
# time on the CPU than a round over one row (docs/benchmark-log.md, 2026-11-28).
ENCODER_SLICE_WORK = 1 << 29

T = TypeVar("T")
# Work done slice by slice: a generator that yields None after each slice
# (computed) and returns its result; ``run_to_end`` does all of it at once.
Slices = Generator[None, None, T]
BlockMaskFunction = Callable[[int, int], mx.array]


def run_to_end(slices: Slices[T]) -> T:
    """What ``slices`` returns, every slice computed in turn."""
    while True:
        try:
            next(slices)
        except StopIteration as end:
            return end.value


def slice_positions(length: int, batch_size: int, work_per_position: int) -> int:
    """Positions per slice of a product over ``batch_size`` rows of
    ``length`` positions costing ``work_per_position`` multiply-adds each:
    at most ``ENCODER_SLICE_WORK`` a slice."""
    return max(1, min(length, ENCODER_SLICE_WORK // (batch_size * work_per_position)))


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
        """The mask [B or 1, heads, stop - start, S] of queries start .. stop - 1,
        a plain array: fused attention kernels may refuse a view whose strides
        run backwards (cuDNN's does, in half precision), and one block's mask
        is no larger than its scores, which the block's size bounds."""
        heads, width = self.bias_table.shape
        # Query q reads the table from distance -q on, one step back per
        # query: a strided view of the table, not a gather of S^2 values.
        bias = mx.as_strided(
            self.bias_table,
            (1, heads, stop - start, self.length),
            (0, width, -1, 1),
            offset=self.length - 1 - start,
        )
        # The sum with the padding is an array of its own; the view alone is copied.
        return mx.contiguous(bias) if self.padding is None else bias + self.padding


class Attention(nn.Module):
    """Multi-head attention without score scaling; T5 folds it into the
    weights. The queries, keys and values of the subclasses come from their
    projections; this attends and projects the result back."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.head_dim = args.d_kv
        self.out_proj = nn.Linear(args.num_heads * args.d_kv, args.d_model, bias=False)
        # A backend may give its own at load (T5.use_attention).
        self.attention = attention

    def heads_side_by_side(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array
    ) -> mx.array:
        """The heads' outputs [B, length, heads * d_kv], before ``out_proj``."""
        return side_by_side(self.attention(queries, keys, values, mask))

    def attend(
        self, queries: mx.array, keys: mx.array, values: mx.array, mask: mx.array
    ) -> mx.array:
        """The attention's output [B, length, d_model]: the heads' outputs
        through ``out_proj``."""
        return self.out_proj(self.heads_side_by_side(queries, keys, values, mask))


class SelfAttention(Attention):
    """Attention of a sequence over itself. Its queries, keys and values
    come from one product with the three projections stacked (``qkv_proj``,
    [3 * heads * d_kv, d_model]): one weight read and one product for the
    three, which makes a decoder pass faster (docs/benchmark-log.md, 2026-11-26)."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.qkv_proj = nn.Linear(args.d_model, 3 * args.num_heads * args.d_kv, bias=False)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        """Every position of ``x`` [B, S, d_model] attending over all of
        them, ``mask`` added to the scores: [B, S, d_model]."""
        return self.attend(*self.queries_keys_values(self.qkv_proj(x)), mask)

    def queries_keys_values(self, stacked: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Queries, keys and values from the output [B, length, 3 * heads *
        d_kv] of ``qkv_proj``, split into heads: each [B, heads, length,
        d_kv], contiguous."""
        # Copied out of their heads' views once, for the attention's
        # products: a product copies a view whose rows are not packed, and
        # the keys', read transposed, as a transpose, several times slower
        # than this copy (docs/benchmark-log.md, 2026-11-26).
        return tuple(map(mx.contiguous, self.split_stacked(stacked)))

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
        self.query_proj = nn.Linear(args.d_model, inner_dim, bias=False)
        self.key_proj = nn.Linear(args.d_model, inner_dim, bias=False)
        self.value_proj = nn.Linear(args.d_model, inner_dim, bias=False)

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
            self.wi_0 = nn.Linear(args.d_model, args.d_ff, bias=False)
            self.wi_1 = nn.Linear(args.d_model, args.d_ff, bias=False)
        else:
            self.wi = nn.Linear(args.d_model, args.d_ff, bias=False)
        self.wo = nn.Linear(args.d_ff, args.d_model, bias=False)

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
    """Self-attention over the prompt, then the feed-forward block, each
    after a norm and added to its input."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.self_attn = SelfAttention(args)
        self.ff_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.ff = FeedForward(args)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        """The layer's output for ``x`` [B, S, d_model]; ``mask`` is added
        to the attention scores (the position bias and each row's padding).
        ``slices`` computes the same in slices."""
        x = clamp_float16(x + self.self_attn(self.self_attn_norm(x), mask))
        return clamp_float16(x + self.ff(self.ff_norm(x)))

    def slices(
        self, x: mx.array, blocks: list[tuple[int, int]], block_mask: BlockMaskFunction
    ) -> Slices[mx.array]:
        """``__call__`` in slices, from the same pieces: the attention's
        products over ``blocks`` of positions, then the rest over the same
        blocks of queries (``block_mask(start, stop)`` their mask); yields
        after each slice, computed."""
        stacked = []
        for start, stop in blocks:
            stacked.append(self.self_attn.qkv_proj(self.self_attn_norm(x[:, start:stop])))
            yield mx.eval(stacked[-1])
        queries, keys, values = self.self_attn.queries_keys_values(mx.concatenate(stacked, 1))
        outputs = []
        for start, stop in blocks:
            attended = self.self_attn.attend(
                queries[:, :, start:stop], keys, values, block_mask(start, stop)
            )
            y = clamp_float16(x[:, start:stop] + attended)
            outputs.append(clamp_float16(y + self.ff(self.ff_norm(y))))
            # One block's scores exist at a time.
            yield mx.eval(outputs[-1])
        return mx.concatenate(outputs, axis=1)


# Prompts of a batch are encoded in one padded pass when the longest is at
# most this many times the shortest: padding is work for nothing, and a pass
# more costs little once it holds a few prompts. 1.25 encodes the benchmark
# pair's prompts fastest of 1.1, 1.25, 1.5 and 2 (docs/benchmark-log.md, 2026-11-25).
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
    every N (``mx.compile``, shapeless; else once per N): MLX fuses its
    element-wise work, and Python builds no graph for it at each call. The
    arrays of ``module``'s children are inputs of every call, so that later
    changes to them (a weight's layout, see ``cpu.prepare``) are seen.
    ``module`` holds its RowsFunctions, so they hold it weakly: a reference
    cycle would keep a dropped model's weights until Python's cyclic
    collector ran."""

    def __init__(self, function: Callable, module: nn.Module, shapeless: bool = True):
        module_ref = weakref.ref(module)
        self.compiled = mx.compile(
            lambda *args: function(module_ref(), *args), inputs=dict(module), shapeless=shapeless
        )

    def __call__(self, rows: mx.array, *arrays: mx.array):
        return self.compiled(rows, *arrays)


class DecoderLayer(nn.Module):
    """Self-attention over the cached positions, cross-attention over the
    prompt, and the feed-forward block. What lies around the two attentions
    (norms, projections, residual sums, the feed-forward block) works on the
    positions as rows [B * T, d_model], in ``RowsFunction``s: a decoder pass
    is a graph of about a thousand small operations, which MLX runs one at a
    time, so fewer of them and less Python per pass make passes faster,
    most over few rows (docs/benchmark-log.md, 2026-11-26)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.self_attn = SelfAttention(args)
        self.cross_attn_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.cross_attn = CrossAttention(args)
        self.ff_norm = nn.RMSNorm(args.d_model, eps=args.layer_norm_epsilon)
        self.ff = FeedForward(args)
        self.compile_rows()

    def compile_rows(self, shapeless: bool = True) -> None:
        """Compile the work around the attentions (``RowsFunction``), for
        any number of rows at once unless not ``shapeless``: a layer split
        across processes sums across them there (``T5.shard``),
        which has no shapeless form."""
        self.self_attention_inputs = RowsFunction(
            DecoderLayer._self_attention_inputs, self, shapeless
        )
        self.after_self_attention = RowsFunction(
            DecoderLayer._after_self_attention, self, shapeless
        )
        self.after_cross_attention = RowsFunction(
            DecoderLayer._after_cross_attention, self, shapeless
        )

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
        # Beam search's rows of one prompt share its keys and values, held
        # once: their queries attend as one row's (nothing is causal here).
        prompts = cross_keys_values[0].shape[0]
        queries = self.cross_attn.split_heads(queries.reshape(prompts, -1, queries.shape[-1]))
        heads = self.cross_attn.heads_side_by_side(queries, *cross_keys_values, memory_mask)
        x = self.after_cross_attention(x, heads.reshape(batch * length, -1))
        return x.reshape(batch, length, d_model)


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
            self.lm_head = nn.Linear(args.d_model, args.vocab_size, bias=False)

    @property
    def dtype(self) -> mx.Dtype:
        """The floating-point type of the parameters (a quantized embedding's
        weight is packed integers, so ask a norm)."""
        return self.decoder.norm.weight.dtype

    def use_attention(self, function: AttentionFunction) -> None:
        """Compute every attention of the model with ``function`` (of the
        signature of :func:`attention`, the same function) from now on."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.attention = function

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
        real tokens with 1 and padding with 0. ``encode_slices``, all of it."""
        return run_to_end(self.encode_slices(inputs, mask, on_layer))

    def encode_slices(
        self,
        inputs: mx.array,
        mask: mx.array | None = None,
        on_layer: Callable[[], None] | None = None,
    ) -> Slices[mx.array]:
        """``encode`` in slices: each layer over blocks of positions, its
        products over their rows and its attention over them as queries
        (``EncoderLayer.slices``), each computed before the next is built;
        ``on_layer()`` is called after each layer (progress)."""
        x = self.embed(inputs)
        batch, length = inputs.shape
        projection, feed_forward = self.args._layer_work
        attn_mask = BlockMask(
            mx.contiguous(self.encoder.position_bias.table(length)),
            None if mask is None else padding_mask(mask, x.dtype),
            length,
            min(
                encoder_block_size(batch, self.args.num_heads, length),
                slice_positions(length, batch, 4 * projection + feed_forward),
            ),
        )
        blocks, block_mask = attn_mask.blocks(), attn_mask
        if len(blocks) == 1:  # one block: one mask, made once for every layer
            whole_mask = attn_mask(0, length)
            block_mask = lambda start, stop: whole_mask
        for layer in self.encoder.layers:
            x = yield from layer.slices(x, blocks, block_mask)
            if on_layer is not None:
                on_layer()
        return self.encoder.norm(x)

    def make_cache(self, memory: mx.array, mask: mx.array | None = None) -> DecoderCache:
        """A fresh decoder cache for the encoder output ``memory``; ``mask``
        marks each row's real tokens with 1 and its right padding with 0.
        ``cache_slices``, all of it."""
        return run_to_end(self.cache_slices(memory, mask))

    def cache_slices(self, memory: mx.array, mask: mx.array | None = None) -> Slices[DecoderCache]:
        """``make_cache`` in slices: each decoder layer's cross-attention
        keys and values over blocks of positions, then joined."""
        batch, length, _ = memory.shape
        projection, _ = self.args._layer_work
        step = slice_positions(length, batch, 2 * projection)
        cross = []
        for layer in self.decoder.layers:
            keys, values = [], []
            for start in range(0, length, step):
                block_keys, block_values = layer.cross_attn.keys_values(
                    memory[:, start : start + step]
                )
                keys.append(block_keys)
                values.append(block_values)
                yield mx.eval(block_keys, block_values)
            # Read at every step: stored row-contiguous per head, so each
            # step's products read them in place instead of copying them first.
            cross.append(
                tuple(mx.contiguous(mx.concatenate(parts, axis=2)) for parts in (keys, values))
            )
            yield mx.eval(cross[-1])
        prompt_lengths = [length] * batch if mask is None else mask.sum(axis=1).tolist()
        return DecoderCache(cross, prompt_lengths)

    def prompt_cache(
        self, prompts: Sequence[Sequence[int]], on_layer: Callable[[], None] | None = None
    ) -> DecoderCache:
        """A fresh decoder cache for ``prompts`` (token ids), one row each in
        order, encoded in the passes of ``encoder_passes``; ``on_layer()`` is
        called after each encoder layer of each pass. Computed here, so that
        prompt processing ends when it returns."""
        return run_to_end(self.prompt_cache_slices(prompts, on_layer))

    def prompt_cache_slices(
        self, prompts: Sequence[Sequence[int]], on_layer: Callable[[], None] | None = None
    ) -> Slices[DecoderCache]:
        """``prompt_cache`` in slices (``encode_slices``, ``cache_slices``):
        the same work in the same products, which a batch interleaves with
        its rounds so that a long prompt joining it stalls no row."""
        passes = encoder_passes(prompts)
        caches = []
        for group in passes:
            caches.append((yield from self._encoded([prompts[i] for i in group], on_layer)))
        order = [i for group in passes for i in group]
        if len(caches) == 1 and order == sorted(order):
            return caches[0]
        return joined_caches(caches, [order.index(i) for i in range(len(prompts))])

    def _encoded(
        self, prompts: Sequence[Sequence[int]], on_layer: Callable[[], None] | None
    ) -> Slices[DecoderCache]:
        """A fresh decoder cache for ``prompts``, encoded in one padded pass, in slices."""
        width = max(map(len, prompts))
        pad = [self.args.pad_token_id]
        inputs = mx.array([list(ids) + pad * (width - len(ids)) for ids in prompts])
        mask = None
        if any(len(ids) < width for ids in prompts):
            mask = mx.arange(width) < mx.array([len(ids) for ids in prompts])[:, None]
        memory = yield from self.encode_slices(inputs, mask, on_layer)
        return (yield from self.cache_slices(memory, mask))

    def decode(
        self, decoder_inputs: mx.array, cache: DecoderCache, tree: Tree | None = None
    ) -> mx.array:
        """Logits [B, T, vocab] for the next token after each of the T new
        decoder tokens of every row; appends them to ``cache``, each row
        after its own cached positions. The new tokens of a row follow one
        another, or with a ``tree`` each follows its ancestors alone
        (``cache.Tree``: speculative beam search's candidates)."""
        x = self.embed(decoder_inputs)
        length = decoder_inputs.shape[1]
        query_positions, key_positions, hidden = cache.reserve(length, tree)
        # Positions are counted in storage columns (a tree's new tokens at
        # the row's end plus their depth): key minus query is the same.
        # Relative position buckets do not hide the future, so the mask does;
        # it also hides whatever lies past a row's own length or before its
        # start.
        self_mask = self.decoder.position_bias(query_positions, key_positions)
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

    def shard(self, group: mx.distributed.Group) -> None:
        """Split the attention heads and feed-forward hidden units across the
        processes of ``group`` (tensor parallel), in place, keeping this
        one's share: the query, key and value projections and the
        feed-forward input projections by output rows (a self-attention's
        stacked ``qkv_proj`` as three segments), the output projections by
        input columns, summed across the processes, and the position bias
        tables by head. Each layer is computed once split, so that a model
        loaded lazily is read one layer at a time and never held whole.
        ``ValueError`` when the model does not divide (``check_divisible``)."""
        check_divisible(self.args, group.size())

        def split(module: nn.Module, name: str, sharding: str, segments: int = 1) -> None:
            layer = shard_linear(getattr(module, name), sharding, segments=segments, group=group)
            setattr(module, name, layer)

        for stack in (self.encoder, self.decoder):
            shard_inplace(stack.position_bias, lambda path, weight: -1, group=group)
            mx.eval(stack.position_bias.parameters())
            for layer in stack.layers:
                for module in layer.modules():
                    if isinstance(module, SelfAttention):
                        split(module, "qkv_proj", "all-to-sharded", segments=3)
                    elif isinstance(module, CrossAttention):
                        for name in ("query_proj", "key_proj", "value_proj"):
                            split(module, name, "all-to-sharded")
                    elif isinstance(module, FeedForward):
                        for name in ("wi_0", "wi_1") if module.gated else ("wi",):
                            split(module, name, "all-to-sharded")
                        split(module, "wo", "sharded-to-all")
                    if isinstance(module, Attention):
                        split(module, "out_proj", "sharded-to-all")
                        module.num_heads //= group.size()
                if isinstance(layer, DecoderLayer):
                    # A sum across processes has no shapeless form (mx.compile).
                    layer.compile_rows(shapeless=False)
                mx.eval(layer.parameters())


def check_divisible(args: ModelArgs, ranks: int, name: str = "the main model") -> None:
    """``ValueError`` unless a model of ``args`` splits evenly across
    ``ranks``: its heads, its feed-forward width and, quantized, the groups
    of its layers split by input columns (each rank's columns whole groups)."""
    cannot = f"cannot split {name} across {ranks} processes"
    if args.num_heads % ranks:
        raise ValueError(f"{cannot}: its {args.num_heads} attention heads do not divide by {ranks}")
    if args.d_ff % ranks:
        raise ValueError(f"{cannot}: its feed-forward width {args.d_ff} does not divide by {ranks}")
    if args.quantization is None:
        return
    group_size = args.quantization["group_size"]
    for width in (args.num_heads * args.d_kv, args.d_ff):
        if (width // ranks) % group_size:
            raise ValueError(
                f"{cannot}: the {width // ranks} input columns each would hold of a "
                f"{width}-wide quantized layer are not whole groups of {group_size}"
            )


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
