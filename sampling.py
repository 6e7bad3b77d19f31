"""Choosing tokens from logits, and the acceptance rule of speculative decoding
(Leviathan et al., arXiv 2211.17192).

Every row of a batch has its own settings (``Sampling``) and its own stream of
random numbers (a key per row, from which each round draws), so that rows with
different temperatures share one pass and a seeded row draws the same numbers
whatever else is in its batch. Greedy decoding is the point-mass case of
sampling: its distribution is one-hot at the argmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# First: the fast BLAS on Linux must load before mlx (see model.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

SEEDS = "an integer in [0, 2**64)"  # what mx.random.seed takes


def is_seed(value: object) -> bool:
    """Whether ``value`` is one of SEEDS."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**64


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen from logits. ``temp == 0`` means greedy (argmax);
    otherwise softmax(logits / temp), restricted to the ``top_k`` likeliest
    tokens (0: all) and to the smallest set whose probability reaches ``top_p``."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if not 0 <= self.temp < float("inf"):  # nan fails this too
            raise ValueError(f"temperature must be a number >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top-k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def probabilities(self, logits: mx.array) -> mx.array:
        """The sampling distribution over the last axis of ``logits`` (one-hot
        at the argmax when greedy)."""
        return RowSampling([self]).probabilities(logits)

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """One token per row of ``logits`` [B, vocabulary], from MLX's global
        random state, and the distribution it was drawn from (None when greedy)."""
        return RowSampling([self]).sample(logits)


def split_keys(keys: mx.array, num: int) -> list[mx.array]:
    """``num`` independent keys [B, 2] from every row's key in ``keys`` [B, 2]."""
    split = mx.vmap(lambda key: mx.random.split(key, num))(keys)
    return [split[:, i] for i in range(num)]


def row_key(seed: int | None) -> mx.array:
    """A row's random key: from ``seed``, or without one from MLX's random
    state (which belongs to the thread that draws)."""
    if seed is None:
        high, low = mx.random.randint(0, 2**31, shape=(2,)).tolist()
        seed = high << 31 | low
    return mx.random.key(seed)


def position_keys(keys: mx.array, num: int) -> mx.array:
    """A key [B, num, 2] per row and position, split off each row's key in
    ``keys`` [B, 2] one after another, so that position j gets the same key
    however many positions a round has."""
    chain = []
    for _ in range(num):
        keys, key = split_keys(keys, 2)
        chain.append(key)
    return mx.stack(chain, axis=1)


def _per_key(draw, keys: mx.array):
    """``draw(key, ...)`` mapped over every key of ``keys`` [..., 2]."""
    for _ in range(keys.ndim - 1):
        draw = mx.vmap(draw)
    return draw


def uniform(keys: mx.array | None, shape: tuple[int, ...]) -> mx.array:
    """Uniform numbers in [0, 1) of ``shape``, each drawn with its own key of
    ``keys`` [*shape, 2] (None: from the global random state)."""
    if keys is None:
        return mx.random.uniform(shape=shape)
    return _per_key(lambda key: mx.random.uniform(key=key), keys)(keys)


def categorical(keys: mx.array | None, probs: mx.array) -> mx.array:
    """One index per distribution over the last axis of ``probs`` [..., V],
    each drawn with its own key of ``keys`` [..., 2] (None: the global
    random state)."""
    log_probs = mx.log(probs)
    if keys is None:
        return mx.random.categorical(log_probs)
    draw = _per_key(lambda key, row: mx.random.categorical(row, key=key), keys)
    return draw(keys, log_probs)


class RowSampling:
    """The ``Sampling`` of each row of a batch, applied to all rows at once."""

    def __init__(self, settings: Sequence[Sampling]):
        self.settings = tuple(settings)
        self.greedy = all(s.greedy for s in self.settings)  # the argmax fast path
        self.any_greedy = any(s.greedy for s in self.settings)
        self.greedy_rows = [s.greedy for s in self.settings]
        # Greedy rows divide by 1: their logits are only used for the argmax.
        self.temps = [s.temp or 1.0 for s in self.settings]
        self.top_k = [s.top_k for s in self.settings]
        self.top_p = [s.top_p for s in self.settings]

    @classmethod
    def of(cls, sampling: Sampling | RowSampling) -> RowSampling:
        """``sampling`` for every row, or the per-row settings as they are."""
        return sampling if isinstance(sampling, RowSampling) else cls([sampling])

    @staticmethod
    def _per_row(values: list, ndim: int) -> mx.array:
        """Each row's value of ``values``, shaped to broadcast over arrays of
        ``ndim`` dimensions: one number when every row has the same, so
        that a single setting applies to arrays of any shape."""
        if len(set(values)) == 1:
            return mx.array(values[0])
        return mx.array(values).reshape(-1, *[1] * (ndim - 1))

    def probabilities(self, logits: mx.array) -> mx.array:
        """Each row's sampling distribution over the last axis of ``logits``
        [B, ..., vocabulary]; one-hot at the argmax in greedy rows."""
        vocab_size = logits.shape[-1]
        argmax_one_hot = mx.arange(vocab_size) == mx.argmax(logits, axis=-1, keepdims=True)
        if self.greedy:
            return argmax_one_hot.astype(mx.float32)
        logits = logits.astype(mx.float32) / self._per_row(self.temps, logits.ndim)
        if any(0 < k < vocab_size for k in self.top_k):
            descending = -mx.sort(-logits, axis=-1)
            kth = [k - 1 if 0 < k < vocab_size else vocab_size - 1 for k in self.top_k]
            index = mx.broadcast_to(self._per_row(kth, logits.ndim), logits.shape[:-1] + (1,))
            kth_largest = mx.take_along_axis(descending, index, axis=-1)
            logits = mx.where(logits < kth_largest, -mx.inf, logits)
        probs = mx.softmax(logits, axis=-1)
        if any(p < 1 for p in self.top_p):
            top_p = self._per_row(self.top_p, logits.ndim)
            descending = -mx.sort(-probs, axis=-1)
            mass_before = mx.cumsum(descending, axis=-1) - descending
            # The smallest kept probability: tokens before it hold < top_p.
            num_kept = (mass_before < top_p).sum(axis=-1, keepdims=True)
            smallest_kept = mx.take_along_axis(descending, num_kept - 1, axis=-1)
            nucleus = mx.where(probs < smallest_kept, 0.0, probs)
            nucleus = nucleus / nucleus.sum(axis=-1, keepdims=True)
            probs = mx.where(top_p < 1, nucleus, probs)
        if self.any_greedy:
            greedy_rows = self._per_row(self.greedy_rows, logits.ndim)
            probs = mx.where(greedy_rows, argmax_one_hot.astype(mx.float32), probs)
        return probs

    def sample(
        self, logits: mx.array, keys: mx.array | None = None
    ) -> tuple[mx.array, mx.array | None]:
        """One token per distribution in ``logits`` [B, ..., vocabulary], each
        drawn with its key in ``keys`` [B, ..., 2] (None: the global random
        state), and the distributions drawn from (None when every row is greedy)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1), None
        probs = self.probabilities(logits)
        return categorical(keys, probs), probs


def verify(
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    main_logits: mx.array,
    sampling: Sampling | RowSampling,
    delta: float,
    draft_lengths: mx.array | None = None,
    keys: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Decide, for every row of a batch, how many of its draft tokens the
    main model accepts, and the token that follows them.

    ``draft_tokens`` is [B, g]; row i proposed its first ``draft_lengths[i]``
    (default: all g). ``main_logits`` is [B, g + 1, vocabulary]: position j
    scores the position of draft token j, position g the one after all of
    them. ``sampling`` is one setting for every row or one per row; row i
    draws its random numbers from ``keys[i]``, a key per position (None: the
    global random state). Returns ``(num_accepted, next_token)``, each [B].

    Sampling (temp > 0): x_i is accepted when ``u * (1 - delta) * q(x) <= p(x)``
    with u uniform in (0, 1]; for delta = 0 that is probability min(1, p/q),
    the paper's rule, and a rejected token is replaced by a sample from
    normalize(max(0, p - q)). Greedy (temp = 0): x_i is accepted when it is
    the main model's argmax or, for delta > 0, when ``p(x) >= (1 - delta) *
    max p`` with p the main model's softmax; a rejected token is replaced by
    the argmax. In both, delta = 1 accepts every draft token. A row that
    accepted all its draft tokens adds one sampled from p (its q is zero
    past its length, so the residual there is p itself).
    """
    batch_size, num_draft = draft_tokens.shape
    sampling = RowSampling.of(sampling)
    acceptance_keys = candidate_keys = None
    if keys is not None and not sampling.greedy:
        # A key per position: a row draws what it would draw in a round of another length.
        acceptance, candidate = split_keys(keys, 2)
        acceptance_keys = position_keys(acceptance, num_draft) if num_draft else None
        candidate_keys = position_keys(candidate, num_draft + 1)
    if num_draft == 0:  # nothing to verify: an ordinary decoding step
        return mx.zeros(batch_size, mx.int32), sampling.sample(main_logits, candidate_keys)[0][:, 0]
    if not sampling.greedy:
        probs = sampling.probabilities(main_logits)
        p = mx.take_along_axis(probs[:, :num_draft], draft_tokens[..., None], axis=-1)[..., 0]
        q = mx.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
        u = 1 - uniform(acceptance_keys, (batch_size, num_draft))
        accepted = u * (1 - delta) * q <= p
        # Position i < g: the replacement should x_i be rejected; position g: the extra token.
        residual = mx.maximum(probs[:, :num_draft] - draft_probs, 0)
        candidates = categorical(
            candidate_keys, mx.concatenate([residual, probs[:, num_draft:]], axis=1)
        )
    if sampling.any_greedy:
        main_tokens = mx.argmax(main_logits, axis=-1)
        greedy_accepted = draft_tokens == main_tokens[:, :num_draft]
        if delta > 0:
            probs = mx.softmax(main_logits[:, :num_draft].astype(mx.float32), axis=-1)
            chosen = mx.take_along_axis(probs, draft_tokens[..., None], axis=-1)[..., 0]
            greedy_accepted = greedy_accepted | (chosen >= (1 - delta) * probs.max(axis=-1))
        if sampling.greedy:
            accepted, candidates = greedy_accepted, main_tokens
        else:
            greedy_rows = mx.array(sampling.greedy_rows)[:, None]
            accepted = mx.where(greedy_rows, greedy_accepted, accepted)
            candidates = mx.where(greedy_rows, main_tokens, candidates)
    if draft_lengths is not None:
        accepted = accepted & (mx.arange(num_draft) < draft_lengths[:, None])
    num_accepted = mx.cumprod(accepted.astype(mx.int32), axis=1).sum(axis=1)
    next_token = mx.take_along_axis(candidates, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token
