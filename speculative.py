"""Speculative decoding (Leviathan, Kalman and Matias, arXiv 2211.17192) for
T5 in MLX: the round, what it gives each row, and the options and results
of a generation. Read this file first.

``speculative_round`` is the algorithm: a drafter proposes up to g tokens
per row, the main model scores them all in one pass, ``sampling.verify``
accepts a prefix of them and adds one token of the main model's own. Every
token is the Gumbel-max choice argmax(log p + G) of its distribution p,
with noise G drawn from the row's seed and the token's position alone: the
draft model proposes argmax(log q + G) with the same noise, and a draft
token is accepted exactly when it is the main model's choice. So a round
adds the tokens plain decoding would, whatever was drafted, at the cost of
one main-model pass (the host waits once per round). The rows of a batch
run the same rounds, each with its own draft tokens and its own number
accepted (the caches keep a length per row).

Around it: where drafts come from, ``drafting.py``; how many,
``drafting.FixedDraftLength`` or ``auto.py``; the batch whose rounds these
are, ``scheduler.BatchGenerator``; the Python API, ``decoder.SpeculativeDecoder``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from cache import DecoderCache
from drafting import Draft, Drafter, trim_to
from model import T5
from sampling import SEEDS, Noise, RowSampling, Sampling, is_seed, verify


def speculative_round(
    model: T5,
    cache: DecoderCache,
    drafter: Drafter | None,
    num_draft: Mapping[str, int],
    sequences: list[list[int]],
    limits: list[int],
    sampling: RowSampling,
    delta: float,
    noise: Noise | None,
    eos: int,
) -> RoundOutcome:
    """One round over every row of a batch: draft up to g tokens, score them
    in one pass of the main model, accept, and trim what was rejected.

    Row i holds ``sequences[i]`` (the start token and the tokens so far) and
    may add ``limits[i] + 1`` more; ``cache``, the main model's, holds every
    position of it but the last token, the pass's first input. ``drafter``
    (None: a plain decoding step) proposes ``num_draft[source]`` tokens per
    row from each draft source (``drafting.DRAFT_SOURCES``) with the rows'
    ``noise`` at their next positions (None: every row greedy); ``verify``
    decides, by ``sampling`` and ``delta``; ``eos`` ends a row's text.
    """
    # Draft: x_1 .. x_g per row (fewer where a row may add fewer).
    draft = None
    if drafter is not None and max(limits) > 0:
        draft = drafter.propose(sequences, sampling, num_draft, limits, noise)
    draft = draft or Draft.empty(len(sequences))
    # Trim: the cache drops the positions the last round rejected (and a
    # freed row's), back to each row's accepted tokens.
    trim_to(cache, sequences)
    # Score: p_1 .. p_{g+1} from one pass over each row's last token and its draft.
    last = mx.array([[sequence[-1]] for sequence in sequences])
    logits = model.decode(mx.concatenate([last, draft.tokens], axis=1), cache)
    # Accept x_1 .. x_n, up to the first rejection, then one token of the
    # main model's own: the recovered token in place of x_{n+1}, or the
    # bonus token after x_g when all were accepted.
    positions = None if noise is None else noise.first(draft.tokens.shape[1] + 1)
    lengths = mx.array(draft.lengths)
    num_accepted, next_tokens = verify(draft.tokens, logits, sampling, delta, lengths, positions)
    mx.eval(num_accepted, next_tokens, draft.tokens)  # the host waits once per round
    outcome = RoundOutcome(draft)
    rounds = zip(num_accepted.tolist(), next_tokens.tolist(), draft.tokens.tolist(), draft.lengths)
    for accepted, next_token, draft_tokens, proposed in rounds:
        tokens = draft_tokens[:accepted] + [next_token]
        rejected = accepted < proposed
        ended = eos in tokens
        if ended:  # the text ends before its end-of-sequence token
            end = tokens.index(eos)
            if end < accepted:  # the draft's own: the draft tokens after it went untested
                accepted, rejected = end + 1, False
            tokens = tokens[:end]
        outcome.add(accepted, rejected, tokens, ended)
    return outcome


@dataclass
class RoundOutcome:
    """What one round gave each row of its batch."""

    draft: Draft  # the tokens proposed
    accepted: list[int] = dataclasses.field(default_factory=list)  # draft tokens accepted
    rejected: list[bool] = dataclasses.field(default_factory=list)  # a draft token rejected
    # The accepted draft tokens and the main model's own, up to any end of sequence.
    new_tokens: list[list[int]] = dataclasses.field(default_factory=list)
    ended: list[bool] = dataclasses.field(default_factory=list)  # the end of sequence came

    def add(self, accepted: int, rejected: bool, tokens: list[int], ended: bool) -> None:
        """The next row's outcome."""
        self.accepted.append(accepted)
        self.rejected.append(rejected)
        self.new_tokens.append(tokens)
        self.ended.append(ended)


@dataclass(frozen=True)
class Options:
    """How a prompt is decoded: at most ``max_tokens`` new tokens, sampled
    at ``temp`` (0: greedy) from the ``top_k`` likeliest tokens (0: all)
    holding ``top_p`` of the probability, with the noise of ``seed``
    (None: one drawn from MLX's random state, named by ``result.seed``).
    The one spelling of these settings: the Python API, ``main.py``, the
    server and data parallel all decode with one. ``ValueError`` for a
    value out of range."""

    max_tokens: int = 100
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self):
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not is_seed(self.seed):
            raise ValueError(f"seed must be {SEEDS}, got {self.seed!r}")
        Sampling(self.temp, self.top_p, self.top_k)  # checks temp, top_p and top_k

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_p, self.top_k)


@dataclass
class GenerationResult:
    """The tokens and text generated so far, and what it cost. In the events
    of a generation, the lists of an unfinished result are views
    (``scheduler.Prefix``) of the growing lists of its last, finished one."""

    tokens: Sequence[int]
    # Their text, ``tokenizer.decode(tokens, skip_special_tokens=True)``,
    # less, before the last result, the end that later tokens may still
    # change (a character whose bytes have not all come).
    text: str = ""
    n_draft: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens accepted
    n_rejected: int = 0  # draft tokens tested and rejected (at most one per round)
    n_steps: int = 0  # main-model decoder passes
    # Per token: whether it is an accepted draft token.
    from_draft: Sequence[bool] = dataclasses.field(default_factory=list)
    # Per round: the draft tokens proposed.
    draft_lengths: Sequence[int] = dataclasses.field(default_factory=list)
    n_lookup_rounds: int = 0  # rounds drafted by prompt lookup
    prompt_tokens: int = 0  # tokens of the prompt, end-of-sequence included
    # Seconds encoding the prompt (both models, cross-attention too); the
    # prompts that start a batch share their batch's time evenly.
    prompt_time: float = 0.0
    # Seconds "auto" spent measuring costs before this generation's batch began.
    calibration_time: float = 0.0
    elapsed: float = 0.0  # seconds in all, from the start of the prompt's processing
    finished: bool = False  # the last result of this generation
    seed: int = 0  # the seed of its noise: given, or drawn (it repeats the generation)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token."""
        return self.n_accepted / self.n_draft if self.n_draft else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_time(self) -> float:
        """Seconds spent generating, after the prompt was processed."""
        return self.elapsed - self.prompt_time - self.calibration_time

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generation (prompt processing excluded)."""
        return len(self.tokens) / self.generation_time if self.generation_time > 0 else 0.0
