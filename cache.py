"""The decoder's caches: what it keeps between passes for a batch of rows
that each have their own length (rows of a speculative batch accept
different numbers of draft tokens, and rows join a running batch at
different times), trimmed back row by row when drafts are rejected."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import cpu  # noqa: F401  # isort: skip  (first: see cpu/__init__.py)
import mlx.core as mx
import numpy as np


def keep_buffer_rows(buffer: mx.array, rows: list[int]) -> mx.array:
    """A buffer whose first ``len(rows)`` rows (axis 0) are ``buffer[rows]``;
    rows past them are left unused. When ``rows`` is in the order of
    ``compacted_rows``, only the rows moving into dropped places are copied,
    into ``buffer`` itself; otherwise all are gathered into a new buffer.
    In place, because gathering a batch's caches into new memory costs
    first touches of fresh pages (docs/benchmark-log.md, 2026-11-28)."""
    moved = [i for i, row in enumerate(rows) if row != i]
    if any(rows[i] < len(rows) for i in moved):
        return buffer[mx.array(rows)]
    if moved:
        source = buffer[mx.array([rows[i] for i in moved])]
        mx.eval(source)  # first, so that the writes below reuse buffer's memory
        for k, i in enumerate(moved):  # row writes: faster than a scatter
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
    row's positions are scattered, which on the CPU costs about as much as
    copying the whole storage). A row with nothing cached starts at the
    batch's column; the columns before a row's start are hidden by the mask
    (``DecoderCache.reserve``). Storage grows in chunks of ``step``
    columns, so appending is a write, not a concatenation; growing also
    aligns every row's end to the same column.
    ``trim`` only moves a row's end marker: what lies past it is hidden by
    the causal mask (it is "later" than every query of the row) and
    overwritten by the row's next tokens. The storage may hold more rows
    than the batch (rows that left it, see ``keep_buffer_rows``): the batch
    is its first ``len(lengths)``.
    """

    # Small, because a batch's first pass fills all its storage with zeros,
    # touching fresh pages (docs/benchmark-log.md, 2026-11-25).
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

    def keep_new(self, kept: list[list[int]], count: int) -> None:
        """Of the last ``count`` positions of row i keep those at
        ``kept[i]`` (indices among them, increasing, at least one), moved to
        follow the row's earlier positions; forget the others."""
        batch = len(kept)
        width = max(map(len, kept))
        # Short rows repeat their last index: written twice, then trimmed.
        padded = [row + row[-1:] * (width - len(row)) for row in kept]
        firsts = mx.array([end - count for end in self.ends])[:, None]
        sources, targets = firsts + mx.array(padded), firsts + mx.arange(width)
        _, heads, _, dim = self.keys.shape
        shape = (batch, heads, width, dim)
        sources = mx.broadcast_to(sources[:, None, :, None], shape)
        targets = mx.broadcast_to(targets[:, None, :, None], shape)
        for name in ("keys", "values"):
            buffer = getattr(self, name)
            rows = buffer[:batch]
            taken = mx.take_along_axis(rows, sources, axis=2)
            buffer[:batch] = mx.put_along_axis(rows, targets, taken, axis=2)
        self.lengths = [n - count + len(row) for n, row in zip(self.lengths, kept, strict=True)]

    def fork(self) -> KVCache:
        """A copy that changes apart from this cache (their storage is
        shared until either writes)."""
        other = KVCache()
        if self.keys is not None:
            other.keys, other.values = mx.array(self.keys), mx.array(self.values)
        other.lengths, other.starts = list(self.lengths), list(self.starts)
        return other

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


@dataclass(frozen=True)
class Tree:
    """How a batch's new tokens attend to one another when they form a
    tree in each row rather than a chain: each token sees its row's cached
    positions and its ancestors among the new tokens (itself included),
    and lies at its depth past the row's end. ``depths`` [B, T] (int32) and
    ``visible`` [B, T, T] (bool: token t sees new token u)."""

    depths: mx.array
    visible: mx.array

    @classmethod
    def from_parents(cls, parents: np.ndarray) -> Tree:
        """The tree of ``parents`` [B, T]: each new token's parent's index
        among its row's new tokens, earlier than its own, or -1 for a root."""
        batch, length = parents.shape
        rows = np.arange(batch)
        depths = np.zeros((batch, length), np.int32)
        visible = np.zeros((batch, length, length), bool)
        for t in range(length):
            parent = parents[:, t]
            has_parent = parent >= 0
            visible[has_parent, t] = visible[rows[has_parent], parent[has_parent]]
            depths[has_parent, t] = depths[rows[has_parent], parent[has_parent]] + 1
            visible[:, t, t] = True
        return cls(mx.array(depths), mx.array(visible))


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
        beams: int = 1,
    ):
        # Beam search decodes ``beams`` rows per prompt, the rows of prompt j
        # being j * beams .. (j + 1) * beams - 1; they share its keys and
        # values of cross-attention, held once (see ``DecoderLayer``).
        self.beams = beams
        self.self_attn = [KVCache(len(prompt_lengths) * beams) for _ in cross_keys_values]
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

    def reserve(self, length: int, tree: Tree | None = None) -> tuple[mx.array, mx.array, mx.array]:
        """Make room for ``length`` new tokens in every row (see
        ``KVCache.reserve``) and return the positions [B, length] of the new
        tokens and those of the keys ([columns], or [B, columns] with a
        ``tree``), both counted in storage columns, and the mask [B, length,
        columns] that hides from each new token the keys it does not see:
        its row's later columns and those before its start, and with a
        ``tree`` the new tokens that are not its ancestors. Without a tree
        the new tokens form a chain: token t's position is its column."""
        for cache in self.self_attn:
            cache.reserve(length)
        first = self.self_attn[0]
        ends = mx.array(first.ends)[:, None]
        key_columns = mx.arange(max(first.ends) + length)
        before_start = key_columns < mx.array(first.starts)[:, None]
        if tree is None:
            columns = ends + mx.arange(length)
            hidden = (key_columns > columns[..., None]) | before_start[:, None]
            return columns, key_columns, hidden
        # A new token's key lies at its row's end plus its index among the
        # new tokens, and its position is the row's end plus its depth.
        new = key_columns - ends
        inside = (new >= 0) & (new < length)
        index = mx.clip(new, 0, length - 1)
        key_positions = mx.where(
            inside, ends + mx.take_along_axis(tree.depths, index, axis=1), key_columns
        )
        index = mx.broadcast_to(index[:, None], (index.shape[0], length, index.shape[1]))
        ancestors = mx.take_along_axis(tree.visible, index, axis=2)
        hidden = (before_start | (new >= length))[:, None] | (inside[:, None] & ~ancestors)
        return ends + tree.depths, key_positions, hidden

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
        added. The cross-attention takes the width of the longest prompt
        then in the batch: wider for a longer one, narrower when the
        longest was replaced."""
        batch_size = max(len(self.prompt_lengths), max(rows) + 1)
        self.prompt_lengths += [0] * (batch_size - len(self.prompt_lengths))
        for row, length in zip(rows, cache.prompt_lengths, strict=True):
            self.prompt_lengths[row] = length
        self._fit_width()
        width = max(self.prompt_lengths)
        cross = []
        for batch_kv, new_kv in zip(self.cross_buffers, cache.cross_keys_values):
            arrays = []
            for buffer, new_array in zip(batch_kv, new_kv):
                buffer = pad_to(pad_to(buffer, width, 2), batch_size, 0)
                # A slice per row: written in place, cheaper than a scatter by
                # row index (docs/benchmark-log.md, 2026-11-28).
                for i, row in enumerate(rows):
                    buffer[row : row + 1] = pad_to(new_array[i : i + 1], width, 2)
                arrays.append(buffer)
            cross.append(tuple(arrays))
        # Replaced before they are computed, so that the writes reuse the buffers' memory.
        self.cross_buffers = cross
        mx.eval(cross)
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
        self._fit_width()
        self._update_memory_mask()
        for cache in self.self_attn:
            cache.keep_rows(rows)

    def add_prompts(self, cache: DecoderCache) -> DecoderCache:
        """This cache with the prompts of the fresh ``cache`` (of as many
        beams) after its own, their rows with no decoder positions; the
        cross-attention takes the width of the longest prompt."""
        width = max(self.cross_buffers[0][0].shape[2], cache.cross_buffers[0][0].shape[2])
        self.cross_buffers = [
            tuple(
                mx.concatenate([pad_to(old, width, 2), pad_to(new, width, 2)])
                for old, new in zip(pair, new_pair)
            )
            for pair, new_pair in zip(self.cross_keys_values, cache.cross_keys_values)
        ]
        first = len(self.prompt_lengths) * self.beams
        self.prompt_lengths = self.prompt_lengths + cache.prompt_lengths
        self._update_memory_mask()
        rows = list(range(first, len(self.prompt_lengths) * self.beams))
        for layer_cache in self.self_attn:
            layer_cache.admit(rows)
        return self

    def take_beams(self, parents: list[int], beams: int | None = None) -> None:
        """Beam search's step: row i takes the decoder positions of row
        ``parents[i]``, a row of the same prompt, each prompt taking
        ``beams`` rows (default: as many as it had). The prompts whose rows
        no parent names leave the batch (their search ended); the others
        keep their order."""
        prompts = sorted({parent // self.beams for parent in parents})
        self.beams = beams or self.beams
        if prompts != list(range(len(self.prompt_lengths))):
            self.cross_buffers = [
                (keys[mx.array(prompts)], values[mx.array(prompts)])
                for keys, values in self.cross_buffers
            ]
            self.prompt_lengths = [self.prompt_lengths[j] for j in prompts]
            self._fit_width()
            self._update_memory_mask()
        for cache in self.self_attn:
            cache.keep_rows(parents)

    def keep_new(self, kept: list[list[int]], count: int) -> None:
        """Of the last ``count`` decoder positions of row i keep those at
        ``kept[i]`` in every layer (``KVCache.keep_new``): a tree's path."""
        for cache in self.self_attn:
            cache.keep_new(kept, count)

    def fork(self) -> DecoderCache:
        """A copy that changes apart from this cache; the keys and values of
        cross-attention, which neither changes, are shared."""
        other = copy.copy(self)
        other.self_attn = [cache.fork() for cache in self.self_attn]
        other.cross_buffers = list(self.cross_buffers)
        other.prompt_lengths = list(self.prompt_lengths)
        return other

    def _fit_width(self) -> None:
        """Cut the cross-attention buffers to the longest prompt of the
        batch once a longer one has left it: every row's decoding step
        attends over the whole width, so a long prompt that finished would
        otherwise slow every row until the batch empties (docs/serving.md).
        Copied, so that the wide buffers are freed."""
        width = max(self.prompt_lengths)
        if width < self.cross_buffers[0][0].shape[2]:
            self.cross_buffers = [
                tuple(mx.contiguous(buffer[:, :, :width]) for buffer in pair)
                for pair in self.cross_buffers
            ]


def joined_caches(caches: list[DecoderCache], rows: list[int]) -> DecoderCache:
    """One cache of the fresh ``caches``' rows: row i is ``rows[i]`` of
    their rows taken in turn. Each layer's keys and values are copied once,
    and the parts freed layer by layer, so that memory grows by one layer's;
    admitting the caches one by one would copy every layer at each
    (docs/benchmark-log.md, 2026-11-28)."""
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


def padding_mask(mask: mx.array | None, dtype: mx.Dtype) -> mx.array:
    """Additive key mask [B, 1, 1, S] from a [B, S] array of 1 (token) / 0 (padding)."""
    if mask is None:
        return mx.zeros((1, 1, 1, 1), dtype)
    return mx.where(mask.astype(mx.bool_), 0.0, -mx.inf).astype(dtype)[:, None, None, :]
