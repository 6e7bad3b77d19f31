"""Choosing tokens from logits, and the acceptance rule of speculative decoding.

Every token is chosen by the Gumbel-max rule: the token at a row's output
position t is argmax(log p_t + G_t), where p_t is the row's sampling
distribution there and G_t is Gumbel noise over the vocabulary drawn from
the row's seed and t alone. That is an exact sample of p_t, and which
sample it is depends on nothing else: not on the round, the draft length,
the drafter or the other rows of the batch. Drafters propose with the same
noise and the verify pass accepts a draft token when it is the main model's
own choice, so a seed gives the text of plain decoding whatever drafts it
(Daliri, Musco and Suresh, arXiv 2408.07978). Greedy decoding is the same
rule without noise.

Every row of a batch has its own settings (``Sampling``) and seed, so that
rows with different temperatures share one pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
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


def draw_seed() -> int:
    """A seed for a row given none, from MLX's random state (which belongs
    to the thread that draws)."""
    high, low = mx.random.randint(0, 2**31, shape=(2,)).tolist()
    return high << 31 | low


# SplitMix64 (Steele, Lea and Flood, 2014): its increment and its finalizer,
# a bijection of 64-bit integers that mixes every input bit into every output bit.
SPLITMIX_INCREMENT = np.uint64(0x9E3779B97F4A7C15)


def _splitmix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def noise_keys(seeds: Sequence[int], positions: Sequence[int]) -> mx.array:
    """The random key [B, 2] of the noise of row i (seed ``seeds[i]``) at
    output position ``positions[i]``. For seed s and position t it is the
    (t + 1)-th output of SplitMix64 whose state starts at s mixed: it
    depends on s and t alone, and nearby seeds and positions get unrelated
    keys."""
    start = _splitmix(np.array(seeds, dtype=np.uint64))
    steps = np.array(positions, dtype=np.uint64) + np.uint64(1)
    bits = _splitmix(start + steps * SPLITMIX_INCREMENT)
    halves = np.stack([bits >> np.uint64(32), bits & np.uint64(0xFFFFFFFF)], axis=-1)
    return mx.array(halves.astype(np.uint32))


def gumbel(keys: mx.array, vocab_size: int) -> mx.array:
    """Gumbel noise [..., vocab_size], drawn with each key of ``keys`` [..., 2]."""

    def draw(key: mx.array) -> mx.array:
        return mx.random.gumbel(shape=(vocab_size,), key=key)

    for _ in range(keys.ndim - 1):
        draw = mx.vmap(draw)
    return draw(keys)


class RowSampling:
    """The ``Sampling`` of each row of a batch, applied to all rows at once."""

    def __init__(self, settings: Sequence[Sampling]):
        self.settings = tuple(settings)
        self.greedy = all(s.greedy for s in self.settings)  # the argmax fast path
        self.any_greedy = any(s.greedy for s in self.settings)
        self.greedy_rows = [s.greedy for s in self.settings]
        # Greedy rows divide by 1: their logits are only compared with each other.
        self.temps = [s.temp or 1.0 for s in self.settings]
        # Greedy rows keep every token: delta's relaxation weighs them all.
        self.top_k = [0 if s.greedy else s.top_k for s in self.settings]
        self.top_p = [1.0 if s.greedy else s.top_p for s in self.settings]

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

    def log_weights(self, logits: mx.array) -> mx.array:
        """Each row's sampling distribution over the last axis of ``logits``
        [B, ..., vocabulary], as logits: log p plus a constant per
        distribution, -inf outside the row's top-k and top-p. Greedy rows'
        logits as they are: their argmax is the greedy token."""
        if self.greedy:
            return logits
        vocab_size = logits.shape[-1]
        logits = logits.astype(mx.float32) / self._per_row(self.temps, logits.ndim)
        if any(0 < k < vocab_size for k in self.top_k):
            descending = -mx.sort(-logits, axis=-1)
            kth = [k - 1 if 0 < k < vocab_size else vocab_size - 1 for k in self.top_k]
            index = mx.broadcast_to(self._per_row(kth, logits.ndim), logits.shape[:-1] + (1,))
            kth_largest = mx.take_along_axis(descending, index, axis=-1)
            logits = mx.where(logits < kth_largest, -mx.inf, logits)
        if any(p < 1 for p in self.top_p):
            top_p = self._per_row(self.top_p, logits.ndim)
            probs = mx.softmax(logits, axis=-1)
            descending = -mx.sort(-probs, axis=-1)
            mass_before = mx.cumsum(descending, axis=-1) - descending
            # The smallest kept probability: tokens before it hold < top_p.
            num_kept = (mass_before < top_p).sum(axis=-1, keepdims=True)
            smallest_kept = mx.take_along_axis(descending, num_kept - 1, axis=-1)
            logits = mx.where((top_p < 1) & (probs < smallest_kept), -mx.inf, logits)
        return logits

    def probabilities(self, logits: mx.array) -> mx.array:
        """Each row's sampling distribution over the last axis of ``logits``
        [B, ..., vocabulary]; one-hot at the argmax in greedy rows."""
        argmax_one_hot = mx.arange(logits.shape[-1]) == mx.argmax(logits, axis=-1, keepdims=True)
        if self.greedy:
            return argmax_one_hot.astype(mx.float32)
        probs = mx.softmax(self.log_weights(logits), axis=-1)
        if self.any_greedy:
            greedy_rows = self._per_row(self.greedy_rows, logits.ndim)
            probs = mx.where(greedy_rows, argmax_one_hot.astype(mx.float32), probs)
        return probs

    def scores(self, logits: mx.array, noise: mx.array | None) -> mx.array:
        """log p + G for every row and position of ``logits`` [B, ..., vocabulary]
        (up to a constant per distribution), ``noise`` being G (zero in greedy
        rows; None: no noise, every row greedy). Its argmax is the token."""
        weights = self.log_weights(logits)
        return weights if noise is None else weights + noise


class Noise:
    """The Gumbel noise of one round: at offset j, each row's noise at its
    output position ``positions[i] + j``, from its seed and that position
    alone (``noise_keys``); zero in greedy rows. Each offset is drawn once,
    for the drafter and the verify pass alike."""

    def __init__(
        self, sampling: RowSampling, seeds: Sequence[int], positions: Sequence[int], vocab: int
    ):
        self.seeds, self.positions, self.vocab_size = list(seeds), np.array(positions), vocab
        self.greedy_rows = mx.array(sampling.greedy_rows)[:, None] if sampling.any_greedy else None
        self.drawn: list[mx.array] = []

    def at(self, offset: int) -> mx.array:
        """The noise [B, vocabulary] at each row's position + ``offset``."""
        while len(self.drawn) <= offset:
            keys = noise_keys(self.seeds, self.positions + len(self.drawn))
            noise = gumbel(keys, self.vocab_size)
            if self.greedy_rows is not None:
                noise = mx.where(self.greedy_rows, 0.0, noise)
            self.drawn.append(noise)
        return self.drawn[offset]

    def first(self, num: int) -> mx.array:
        """The noise [B, num, vocabulary] at offsets 0 .. ``num`` - 1."""
        return mx.stack([self.at(offset) for offset in range(num)], axis=1)


def verify(
    draft_tokens: mx.array,
    main_logits: mx.array,
    sampling: Sampling | RowSampling,
    delta: float,
    draft_lengths: mx.array | None = None,
    noise: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Decide, for every row of a batch, how many of its draft tokens the
    main model accepts, and the token that follows them.

    ``draft_tokens`` is [B, g]; row i proposed its first ``draft_lengths[i]``
    (default: all g). ``main_logits`` is [B, g + 1, vocabulary]: position j
    scores the position of draft token j, position g the one after all of
    them. ``sampling`` is one setting for every row or one per row; ``noise``
    [B, g + 1, vocabulary] is the Gumbel noise G of each row at those
    positions (zero in greedy rows; None: no noise). Returns
    ``(num_accepted, next_token)``, each [B].

    The rule: with s_j = log p_j + G_j (p_j the row's sampling distribution,
    see ``RowSampling.scores``), the main model's token at position j is
    y_j = argmax s_j. Draft token x_j is accepted when x_j = y_j or, for
    delta > 0, when s_j(x_j) >= max s_j + log(1 - delta); the token after
    the accepted ones is y_j at the first rejection, or y_g when every draft
    token was accepted. Greedy rows are the same rule without noise (delta's
    test is then p(x_j) >= (1 - delta) max p_j, p the softmax of the logits),
    and delta = 1 accepts every draft token. At delta = 0 the tokens are
    those of plain decoding with the same noise, whatever was drafted.

    This is not Leviathan et al.'s rule, which accepts x_j with probability
    min(1, p(x_j) / q(x_j)) and resamples from norm(max(0, p - q)) on a
    rejection: both keep the main model's distribution, but only this one
    keeps a seed's text whatever drafts it. What it costs: a draft token is
    guaranteed to be accepted with probability (1 - TV) / (1 + TV) rather
    than 1 - TV, TV the total variation distance between p and the draft's
    q; measured on the benchmark pair at temperature 1, about 3% fewer
    tokens per pass (docs/how-it-works.md#the-acceptance-rule).
    """
    sampling = RowSampling.of(sampling)
    num_draft = draft_tokens.shape[1]
    scores = sampling.scores(main_logits, noise)
    main_tokens = mx.argmax(scores, axis=-1)
    accepted = draft_tokens == main_tokens[:, :num_draft]
    if delta > 0 and num_draft:
        drafted = mx.take_along_axis(scores[:, :num_draft], draft_tokens[..., None], axis=-1)
        margin = math.log(1 - delta) if delta < 1 else -math.inf
        accepted = accepted | (drafted[..., 0] >= scores[:, :num_draft].max(axis=-1) + margin)
    if draft_lengths is not None:
        accepted = accepted & (mx.arange(num_draft) < draft_lengths[:, None])
    num_accepted = mx.cumprod(accepted.astype(mx.int32), axis=1).sum(axis=1)
    next_token = mx.take_along_axis(main_tokens, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token
