"""Beam search for T5, as transformers' ``generate(num_beams=N)`` runs it:
the same hypotheses, scores and stopping rules, for a batch of prompts
decoded together (N rows per prompt).

At each step every beam's next-token log-probabilities (float32
``log_softmax``, then the bans of ``no_repeat_ngram_size`` and
``min_tokens``) are added to its score, and each prompt keeps the 2N best
(beam, token) continuations of all its beams. Those among the N best that
end (the end-of-sequence token, or the last token ``max_tokens`` allows)
become finished hypotheses, scored ``sum of log-probabilities / length **
length_penalty`` (length: the tokens generated, the end-of-sequence token
included); the N best that do not end are the next step's beams, and each
beam's decoder cache becomes its parent's (``DecoderCache.take_beams``).
A prompt keeps its N best finished hypotheses; its search ends, as
``early_stopping`` says, once N have finished (True), or once its best beam
could no longer beat the worst of them (False: at the beam's current length;
"never": at the longest length it may reach when ``length_penalty`` > 0).
A prompt whose search ended leaves the batch, and a waiting prompt joins it.

A prompt's encoder output and keys and values of cross-attention are held
once for its N beams (``DecoderCache``'s ``beams``).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx
import numpy as np

from cache import DecoderCache
from model import T5
from speculative import GenerationResult

EARLY_STOPPING = (True, False, "never")

# The score of a beam that does not exist yet: at the first step every beam
# of a prompt holds the start token alone and only the first continues, so
# that the first step's continuations are distinct (transformers' value).
NO_BEAM = -1e9


@dataclass(frozen=True)
class BeamOptions:
    """How beam search decodes, with the names and meanings of
    transformers' ``generate``: ``num_beams`` beams per prompt (1: no beam
    search), finished hypotheses scored ``sum of log-probabilities / length
    ** length_penalty``, ``early_stopping`` True, False or "never",
    ``no_repeat_ngram_size`` (0: off) forbidding any n-gram of that size to
    occur twice, the ``num_return_sequences`` best hypotheses returned; and
    ``min_tokens``, the tokens generated before the end-of-sequence token is
    allowed (transformers' ``min_length`` less one: that counts the decoder's
    start token). And how fast, never what: with ``draft_levels`` > 0 (and
    a draft model) speculative beam search, the draft's tree of that many
    levels of ``draft_width`` nodes (0: 2N) per pass (``speculative_beam``).
    ``ValueError`` for a value out of range."""

    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    no_repeat_ngram_size: int = 0
    num_return_sequences: int = 1
    min_tokens: int = 0
    draft_levels: int = 0
    draft_width: int = 0

    def __post_init__(self):
        if not (isinstance(self.num_beams, int) and self.num_beams >= 1):
            raise ValueError(f"num_beams must be an integer >= 1, got {self.num_beams!r}")
        returned = self.num_return_sequences
        if not (isinstance(returned, int) and 1 <= returned <= self.num_beams):
            raise ValueError(
                f"num_return_sequences must be an integer from 1 to num_beams "
                f"({self.num_beams}), got {returned!r}"
            )
        if not any(self.early_stopping is value for value in EARLY_STOPPING):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {self.early_stopping!r}"
            )
        for name in ("no_repeat_ngram_size", "min_tokens", "draft_levels", "draft_width"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not isinstance(self.length_penalty, (int, float)):
            raise TypeError(f"length_penalty must be a number, got {self.length_penalty!r}")


@dataclass
class Hypothesis:
    """A finished hypothesis: its generated tokens (without the
    end-of-sequence token), its score, and whether it ended with the
    end-of-sequence token (else ``max_tokens`` ended it)."""

    tokens: list[int]
    score: float
    ended: bool


@dataclass
class BeamSearchResult(GenerationResult):
    """The result of beam search: ``tokens`` and ``text`` are the best
    hypothesis's; ``sequences`` the ``num_return_sequences`` best, best first,
    with ``texts`` theirs."""

    sequences: list[Hypothesis] = dataclasses.field(default_factory=list)
    texts: list[str] = dataclasses.field(default_factory=list)
    levels: int = 0  # steps of beam search; n_steps counts the main model's passes


def divided(score: np.float32, length: int, length_penalty: float) -> np.float32:
    """``score / length ** length_penalty`` in float32, as transformers computes it."""
    return np.float32(score) / np.float32(length**length_penalty)


@dataclass
class PromptBeams:
    """The search of one prompt: its running beams (the start token and the
    tokens so far, with their summed log-probabilities) and its best
    finished hypotheses, best first."""

    sequences: list[list[int]]
    scores: np.ndarray  # float32 [num_beams]
    started: float  # time.perf_counter() when its prompt's encoding began
    prompt_time: float  # seconds encoding it (its share of its joining pass)
    finished: list[Hypothesis] = dataclasses.field(default_factory=list)
    steps: int = 0  # the main model's passes
    levels: int = 0  # steps of beam search: the tokens of each beam
    done: bool = False

    @classmethod
    def start(
        cls, start_token: int, num_beams: int, started: float, prompt_time: float
    ) -> PromptBeams:
        scores = np.full(num_beams, NO_BEAM, np.float32)
        scores[0] = 0.0
        return cls([[start_token] for _ in range(num_beams)], scores, started, prompt_time)

    def banned(self, options: BeamOptions, eos: int) -> list[tuple[int, int]]:
        """(beam, token) pairs no beam may take next: tokens that would
        repeat an n-gram of ``no_repeat_ngram_size``, and the end of
        sequence before ``min_tokens``. Transformers' n-grams include the
        start token."""
        pairs = []
        size = options.no_repeat_ngram_size
        for beam, sequence in enumerate(self.sequences):
            if len(sequence) - 1 < options.min_tokens:
                pairs.append((beam, eos))
            if size and len(sequence) >= size:
                prefix = sequence[len(sequence) - size + 1 :]
                for i in range(len(sequence) - size + 1):
                    if sequence[i : i + size - 1] == prefix:
                        pairs.append((beam, sequence[i + size - 1]))
        return pairs

    def advance(
        self,
        scores: np.ndarray,
        beams: np.ndarray,
        tokens: np.ndarray,
        options: BeamOptions,
        max_tokens: int,
        eos: int,
    ) -> list[int]:
        """One step, given the 2N best continuations, best first: their
        summed log-probabilities, parent beams and tokens. Adds the N best's
        finished hypotheses, takes the N best unfinished as beams, and says
        whether the search ended; returns each new beam's parent."""
        num_beams = options.num_beams
        length = len(self.sequences[0])  # tokens generated once this step's are added
        self.levels = length
        at_limit = length >= max_tokens
        ends = [at_limit or token == eos for token in tokens.tolist()]
        for k in range(num_beams):
            if ends[k]:
                generated = self.sequences[beams[k]][1:] + [int(tokens[k])]
                ended = bool(tokens[k] == eos)
                score = divided(scores[k], length, options.length_penalty)
                self.finished.append(
                    Hypothesis(generated[:-1] if ended else generated, score, ended)
                )
        # Best first; of equal scores, the earlier-found first.
        self.finished.sort(key=lambda hypothesis: -hypothesis.score)
        del self.finished[num_beams:]
        running = [k for k in range(len(tokens)) if not ends[k]][:num_beams]
        parents = [int(beams[k]) for k in running]
        self.sequences = [self.sequences[beams[k]] + [int(tokens[k])] for k in running]
        self.scores = scores[running]
        full = len(self.finished) == num_beams
        stops = (full and options.early_stopping is True) or not self.could_improve(
            options, max_tokens, length
        )
        self.done = at_limit or stops
        return parents

    def could_improve(self, options: BeamOptions, max_tokens: int, length: int) -> bool:
        """Whether the best beam, at ``length`` tokens, could still score
        above the worst of N finished hypotheses (True while fewer have
        finished): at its current length, or with early_stopping "never" and
        a positive length penalty, at the longest it may grow."""
        if len(self.finished) < options.num_beams or not len(self.scores):
            return True
        if options.early_stopping == "never" and options.length_penalty > 0:
            length = max_tokens
        best = divided(self.scores[0], length, options.length_penalty)
        return bool(best > self.finished[-1].score)


def start_cache(model: T5, prompts: Sequence[Sequence[int]], num_beams: int) -> DecoderCache:
    """The decoder cache of ``prompts``' beams: each prompt's keys and values
    of cross-attention once, and ``num_beams`` rows of decoder positions."""
    cache = model.prompt_cache(prompts)
    return DecoderCache(cache.cross_buffers, cache.prompt_lengths, num_beams)


def advance(
    searches: Sequence[PromptBeams],
    logits: mx.array,
    options: BeamOptions,
    max_tokens: int,
    eos: int,
) -> list[list[int] | None]:
    """One step of the ``searches`` (N rows each, in order), given each
    beam's next-token ``logits`` [rows, vocab]; returns each search's new
    beams' parents (indices among its beams), or None where it ended."""
    num_beams = options.num_beams
    logits = logits.astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    banned = [
        (i * num_beams + beam, token)
        for i, search in enumerate(searches)
        for beam, token in search.banned(options, eos)
    ]
    if banned:
        rows, tokens = zip(*banned)
        log_probs[mx.array(rows), mx.array(tokens)] = -mx.inf
    beam_scores = np.concatenate([search.scores for search in searches])
    totals = (log_probs + mx.array(beam_scores)[:, None]).reshape(len(searches), -1)
    scores, flat = best_continuations(totals, 2 * num_beams)
    vocab_size = log_probs.shape[-1]
    chosen = []
    for i, search in enumerate(searches):
        beams, tokens = np.divmod(flat[i], vocab_size)
        parents = search.advance(scores[i], beams, tokens, options, max_tokens, eos)
        chosen.append(None if search.done else parents)
    return chosen


class BeamCache:
    """``model``'s decoder cache of the beams of a batch's prompts
    (``num_beams`` rows each): prompts join it, and after each step each
    row continues its parent's."""

    def __init__(self, model: T5, num_beams: int):
        self.model, self.num_beams = model, num_beams
        self.cache: DecoderCache | None = None

    def add_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        """Encode ``prompts``, whose beams follow the batch's."""
        fresh = start_cache(self.model, prompts, self.num_beams)
        self.cache = fresh if self.cache is None else self.cache.add_prompts(fresh)

    def keep(self, parents: list[int]) -> None:
        """Row i of the next pass continues row ``parents[i]``; the prompts
        whose rows no parent names leave the batch."""
        if parents:
            self.cache.take_beams(parents)
        else:
            self.cache = None


class BeamStep(BeamCache):
    """The main model's pass of plain beam search: every beam's next token."""

    def __init__(self, model: T5, options: BeamOptions, max_tokens: int):
        super().__init__(model, options.num_beams)
        self.options, self.max_tokens = options, max_tokens

    def __call__(self, searches: Sequence[PromptBeams]) -> None:
        """One step of the ``searches`` (the batch's prompts, in order)."""
        last = [sequence[-1] for search in searches for sequence in search.sequences]
        logits = self.model.decode(mx.array(last)[:, None], self.cache)[:, -1]
        chosen = advance(
            searches, logits, self.options, self.max_tokens, self.model.args.eos_token_id
        )
        num_beams = self.options.num_beams
        self.keep(
            [i * num_beams + beam for i, beams in enumerate(chosen) if beams for beam in beams]
        )
        for search in searches:
            search.steps += 1


def beam_search(
    model: T5,
    prompts: Sequence[Sequence[int]],
    batch_size: int,
    max_tokens: int,
    options: BeamOptions,
    step: BeamStep | None = None,
) -> Iterator[tuple[int, PromptBeams]]:
    """Beam search over ``prompts`` (token ids), at most ``max_tokens`` new
    tokens each, ``batch_size`` prompts decoded together (N rows each): a
    prompt whose search ends leaves the batch, and the next waiting prompt
    (in the order given) joins it. Each pass is ``step``'s (default: a
    ``BeamStep``, one token per beam). Yields ``(index, search)`` as each
    prompt's search ends (its ``finished`` hypotheses, best first)."""
    step = step or BeamStep(model, options, max_tokens)
    start_token = model.args.decoder_start_token_id
    waiting = deque(range(len(prompts)))
    searches: dict[int, PromptBeams] = {}
    active: list[int] = []  # the prompts in the batch, in its order
    while active or waiting:
        joining = [waiting.popleft() for _ in range(min(len(waiting), batch_size - len(active)))]
        if joining:
            started = time.perf_counter()
            step.add_prompts([prompts[i] for i in joining])
            seconds = (time.perf_counter() - started) / len(joining)
            for i in joining:
                searches[i] = PromptBeams.start(start_token, options.num_beams, started, seconds)
            active += joining
        step([searches[j] for j in active])
        for j in active:
            if searches[j].done:
                yield j, searches.pop(j)
        active = [j for j in active if j in searches]


def best_continuations(totals: mx.array, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` largest values of each row of ``totals`` and their indices,
    largest first (of equal values, the lower index first)."""
    top = mx.argpartition(-totals, kth=k - 1, axis=-1)[:, :k]
    values = mx.take_along_axis(totals, top, axis=-1)
    values, top = np.array(values), np.array(top)
    order = np.lexsort((top, -values), axis=-1)
    return np.take_along_axis(values, order, -1), np.take_along_axis(top, order, -1)
