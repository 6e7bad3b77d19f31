"""Where draft tokens come from, and how many to propose per round.

A drafter proposes draft tokens for every row of a batch at once:
``ModelDrafter`` (a small model), ``PromptLookupDrafter`` (the tokens that
followed an earlier occurrence of the output's last n-gram, no model at all)
or ``HybridDrafter`` (lookup where it matches, the model elsewhere). The
draft model proposes with the main model's rule and noise (``sampling``):
its token is argmax(log q + G) where the main model's is argmax(log p + G),
so that it is accepted exactly when the two agree. ``sampling.verify``
judges every draft token alike, whoever proposed it.

Every drafter is a ``Drafter``. A ``DraftLength`` says how many tokens a
round drafts from each source (``DRAFT_SOURCES``): ``FixedDraftLength``,
or ``auto.AutoDraftLength`` for ``--num-draft auto``. Its plan is a value,
the round's g per source, which a group of processes shares once per round
(``distributed.RankZeroDraftLength``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from cache import DecoderCache
from model import T5, ModelArgs
from sampling import Noise, RowSampling

# Where draft tokens come from: a draft model, or prompt lookup.
DRAFT_SOURCES = ("model", "lookup")


class IncompatibleDraftError(ValueError):
    """The draft model cannot propose tokens for the main model."""


def check_draft_compatible(
    main_args: ModelArgs,
    draft_args: ModelArgs,
    main_name: str = "main model",
    draft_name: str = "draft model",
    main_vocab: dict[str, int] | None = None,
    draft_vocab: dict[str, int] | None = None,
) -> None:
    """Raise ``IncompatibleDraftError`` unless the draft model speaks the main
    model's vocabulary: same output size, same special tokens and, when
    given, the same tokenizer vocabulary."""
    for field in (
        "vocab_size",
        "decoder_start_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        main_value, draft_value = getattr(main_args, field), getattr(draft_args, field)
        if main_value != draft_value:
            raise IncompatibleDraftError(
                f"draft model {draft_name} does not match main model {main_name}: "
                f"{field} is {draft_value} in the draft and {main_value} in the main model"
            )
    if main_vocab is not None and draft_vocab is not None and main_vocab != draft_vocab:
        differing = len({index for _, index in main_vocab.items() ^ draft_vocab.items()})
        raise IncompatibleDraftError(
            f"draft model {draft_name} does not match main model {main_name}: "
            f"their tokenizers differ in {differing} vocabulary entries"
        )


@dataclass
class Draft:
    """Tokens proposed for one round, for every row of the batch."""

    tokens: mx.array  # [B, g]: each row's tokens, right-padded with 0 past its length
    lengths: list[int]  # per row: tokens proposed (<= g)
    sources: list[str]  # per row: whose acceptance estimate the round updates

    @classmethod
    def empty(cls, batch_size: int) -> Draft:
        """No draft token for any row: the round is a plain decoding step."""
        return cls(mx.zeros((batch_size, 0), mx.int32), [0] * batch_size, ["none"] * batch_size)


class Drafter(Protocol):
    """What the loop asks of a source of draft tokens for a batch's rows."""

    # Seconds its proposals spent encoding the rows' prompts (a lazy draft model's).
    encoding_time: float

    def propose(
        self,
        sequences: list[list[int]],
        sampling: RowSampling,
        num_draft: Mapping[str, int],
        limits: list[int],
        noise: Noise | None = None,
    ) -> Draft | None:
        """Up to ``num_draft[source]`` tokens for each row of ``sequences`` (its
        start token and tokens so far), at most ``limits[i]`` for row i,
        drafted with the rows' ``noise`` (None: greedy); None when no row
        gets any."""

    def admit(
        self, rows: list[int], prompts: list[list[int]], cache: DecoderCache | None = None
    ) -> None:
        """Give ``rows`` (restarted, or added past the batch) ``prompts``,
        with the draft model's ``cache`` of them where encoded already."""

    def keep_rows(self, rows: list[int]) -> None:
        """Keep only ``rows``, in that order."""

    @property
    def start_pending(self) -> bool:
        """Whether a lazy draft model has yet to encode the rows' prompts (see
        ``ModelDrafter``): it neither drafts nor encodes joining prompts until then."""


@dataclass(frozen=True)
class RowState:
    """What a draft-length rule is told of a row of the round: a free place
    (not ``live``), or a prompt of ``prompt_tokens`` tokens, encoded in
    ``prompt_seconds``, that has ``tokens`` tokens so far (its start token
    included)."""

    live: bool
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    tokens: int = 0


class Tested(Protocol):
    """What a round tested, per row, as a draft-length rule reads it
    (``speculative.RoundOutcome`` is one): the draft, how many of each
    row's draft tokens were accepted, and whether one was rejected."""

    draft: Draft
    accepted: list[int]
    rejected: list[bool]


class DraftLength(Protocol):
    """How many tokens the rounds of a batch draft: asked before every round
    (``plan``), told what the round gave (``observe``). ``FixedDraftLength``
    and ``auto.AutoDraftLength``."""

    calibration_seconds: float  # spent measuring before the batch's first round

    def plan(self, rows: list[RowState], limits: list[int], drafter: Drafter) -> dict[str, int]:
        """The draft tokens per row of the next round over ``rows`` (at most
        ``limits[i]`` for row i) from each of ``DRAFT_SOURCES`` (0 from
        every source: a plain step)."""

    def observe(self, rows: list[RowState], outcome: Tested) -> None:
        """What the round over ``rows`` gave."""


@dataclass
class FixedDraftLength:
    """``num_draft`` draft tokens every round."""

    num_draft: int
    calibration_seconds: float = 0.0

    def plan(self, rows: list[RowState], limits: list[int], drafter: Drafter) -> dict[str, int]:
        return dict.fromkeys(DRAFT_SOURCES, self.num_draft)

    def observe(self, rows: list[RowState], outcome: Tested) -> None:
        pass


def trim_to(cache: DecoderCache, sequences: list[list[int]]) -> list[list[int]]:
    """Trim each row of ``cache`` to its accepted sequence (keeping every
    position whose token was accepted) and return the tokens each row has
    yet to process. The last token of a sequence is never cached: it is the
    next input."""
    cache.trim([max(0, n - (len(s) - 1)) for n, s in zip(cache.lengths, sequences, strict=True)])
    return [s[n:] for n, s in zip(cache.lengths, sequences)]


def decode_pending(model: T5, cache: DecoderCache, pending: list[list[int]]) -> mx.array:
    """Feed each row its own ``pending`` tokens (right-padded into one
    pass; the padding is trimmed away afterwards) and return the logits
    [B, vocabulary] after each row's last one."""
    width = max(map(len, pending))
    inputs = mx.array([tokens + [0] * (width - len(tokens)) for tokens in pending])
    logits = model.decode(inputs, cache)
    cache.trim([width - len(tokens) for tokens in pending])
    last = mx.array([len(tokens) - 1 for tokens in pending])
    return mx.take_along_axis(logits, last[:, None, None], axis=1)[:, 0]


class ModelDrafter:
    """Drafts with a small model, one token at a time for all rows at once;
    each row has its own place in the draft model's cache.

    A ``lazy`` drafter encodes its rows' prompts when it first proposes
    tokens, not before: auto may never draft (at many rows a round of one
    draft token costs over twice a plain step), and encoding a batch's
    prompts for the draft model costs several plain steps
    (docs/benchmark-log.md, 2026-11-26). The rows' sequences catch up in the
    draft cache when it proposes, as after plain steps."""

    source = "model"

    def __init__(
        self,
        model: T5,
        prompts: list[list[int]],
        lazy: bool = False,
        cache: DecoderCache | None = None,
    ):
        """``cache``: the draft model's cache of ``prompts``, encoded already
        (the drafter has started, lazy or not); else a drafter that is not
        lazy encodes them."""
        self.model = model
        self.lazy = lazy
        if cache is None and not lazy:
            cache = model.prompt_cache(prompts)
        # Per row (lazy): the prompt, for the proposal that first encodes them.
        self.prompts = [list(ids) for ids in prompts] if lazy else []
        self.cache = cache
        self.encoding_time = 0.0  # seconds proposals spent encoding prompts (lazy)
        self.fed = 0  # draft tokens of the last proposal fed into the cache

    def admit(
        self, rows: list[int], prompts: list[list[int]], cache: DecoderCache | None = None
    ) -> None:
        """Give ``rows`` (restarted, or added past the batch) ``prompts``,
        whose cache is ``cache`` where encoded already; a lazy drafter keeps
        their tokens too, and one that has not started only those."""
        if self.lazy:
            self.prompts += [[]] * (max(rows) + 1 - len(self.prompts))
            for row, ids in zip(rows, prompts, strict=True):
                self.prompts[row] = list(ids)
        if self.cache is not None:
            self.cache.admit(rows, cache if cache is not None else self.model.prompt_cache(prompts))

    def keep_rows(self, rows: list[int]) -> None:
        if self.lazy:
            self.prompts = [self.prompts[row] for row in rows]
        if self.cache is not None:
            self.cache.keep_rows(rows)

    @property
    def start_pending(self) -> bool:
        return self.cache is None

    def propose(
        self,
        sequences: list[list[int]],
        sampling: RowSampling,
        num_draft: Mapping[str, int],
        limits: list[int],
        noise: Noise | None = None,
    ) -> Draft | None:
        """``num_draft["model"]`` tokens per row, at most ``limits[i]`` for row
        i, without waiting for them (the last one is not fed back); None
        when no row gets any. Row i's j-th token is argmax(log q + G) with
        G its ``noise`` at offset j (None: no noise, every row greedy)."""
        width = min(num_draft.get(self.source, 0), max(limits))
        if width == 0:
            return None
        if self.cache is None:
            tic = time.perf_counter()
            self.cache = self.model.prompt_cache(self.prompts)
            self.encoding_time += time.perf_counter() - tic
        pending = trim_to(self.cache, sequences)
        logits = decode_pending(self.model, self.cache, pending)
        tokens = []
        for step in range(width):
            step_noise = None if noise is None else noise.at(step)
            token = mx.argmax(sampling.scores(logits, step_noise), axis=-1)
            # Start computing this token while Python builds the next step's
            # graph; nothing waits for it until the round's single eval.
            mx.async_eval(token)
            tokens.append(token)
            if step < width - 1:
                logits = self.model.decode(token[:, None], self.cache)[:, -1]
        self.fed = width - 1
        lengths = [min(width, limit) for limit in limits]
        sources = [self.source] * len(limits)
        draft = Draft(mx.stack(tokens, axis=1), lengths, sources)
        return mask_past_lengths(draft)

    def withdraw(self, rows: list[bool]) -> None:
        """Forget the last proposal in the rows marked True (another drafter's
        tokens were used there), so the cache holds accepted tokens only."""
        self.cache.trim([self.fed if row else 0 for row in rows])


def mask_past_lengths(draft: Draft) -> Draft:
    """``draft`` with each row's tokens past its length zeroed."""
    width = draft.tokens.shape[1]
    kept = mx.arange(width) < mx.array(draft.lengths)[:, None]
    draft.tokens = mx.where(kept, draft.tokens, 0)
    return draft


def find_continuation(tokens: list[int], max_ngram: int, min_ngram: int = 1) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest
    n-gram (``max_ngram`` down to ``min_ngram``) that ends ``tokens``; empty
    when none occurs earlier."""
    array = np.array(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        # Windows of tokens[:-1] end before the last token, so the n-gram
        # never matches itself and something always follows a match.
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)
        matches = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if matches.size:
            return tokens[matches[-1] + n :]
    return []


class PromptLookupDrafter:
    """Drafts, for each row, the tokens that followed the output's last
    n-gram where it occurred before, in the prompt or in the output
    (prompt-lookup decoding). The proposal is deterministic: it needs no noise."""

    source = "lookup"
    encoding_time = 0.0  # it encodes nothing
    start_pending = False  # it has no model to start

    def __init__(self, prompts: list[list[int]], max_ngram: int, min_ngram: int = 1):
        self.prompts = [list(ids) for ids in prompts]
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def admit(
        self, rows: list[int], prompts: list[list[int]], cache: DecoderCache | None = None
    ) -> None:
        """Give ``rows`` (restarted, or added past the batch) ``prompts``
        (no encoder: ``cache`` is always None)."""
        self.prompts += [[]] * (max(rows) + 1 - len(self.prompts))
        for row, ids in zip(rows, prompts, strict=True):
            self.prompts[row] = list(ids)

    def keep_rows(self, rows: list[int]) -> None:
        self.prompts = [self.prompts[row] for row in rows]

    def propose(
        self,
        sequences: list[list[int]],
        sampling: RowSampling,
        num_draft: Mapping[str, int],
        limits: list[int],
        noise: Noise | None = None,
    ) -> Draft | None:
        """Up to ``num_draft["lookup"]`` tokens per row, at most ``limits[i]``
        for row i; a row with no matching n-gram gets none. None when no
        row gets any."""
        found = []
        for prompt, sequence in zip(self.prompts, sequences, strict=True):
            output = sequence[1:]  # without the start token
            found.append(
                find_continuation(prompt + output, self.max_ngram, self.min_ngram) if output else []
            )
        if not any(found):
            return None
        most = num_draft.get(self.source, 0)
        found = [tokens[: min(most, limit)] for tokens, limit in zip(found, limits)]
        width = max(map(len, found))
        if width == 0:
            return None
        tokens = mx.array([row + [0] * (width - len(row)) for row in found])
        lengths = [len(row) for row in found]
        sources = [self.source if n else "none" for n in lengths]
        return mask_past_lengths(Draft(tokens, lengths, sources))


class HybridDrafter:
    """Prompt lookup in the rows where it finds a match, the draft model in
    the others."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model

    @property
    def encoding_time(self) -> float:
        return self.model.encoding_time

    def admit(
        self, rows: list[int], prompts: list[list[int]], cache: DecoderCache | None = None
    ) -> None:
        """Give ``rows`` (restarted, or added past the batch) ``prompts``,
        with the draft model's ``cache`` of them where encoded already."""
        self.lookup.admit(rows, prompts)
        self.model.admit(rows, prompts, cache)

    def keep_rows(self, rows: list[int]) -> None:
        self.lookup.keep_rows(rows)
        self.model.keep_rows(rows)

    @property
    def start_pending(self) -> bool:
        return self.model.start_pending

    def propose(
        self,
        sequences: list[list[int]],
        sampling: RowSampling,
        num_draft: Mapping[str, int],
        limits: list[int],
        noise: Noise | None = None,
    ) -> Draft | None:
        looked_up = self.lookup.propose(sequences, sampling, num_draft, limits)
        if looked_up is not None and all(looked_up.lengths):
            return looked_up
        modelled = self.model.propose(sequences, sampling, num_draft, limits, noise)
        if looked_up is None or modelled is None:
            return looked_up or modelled
        use_lookup = [n > 0 for n in looked_up.lengths]
        self.model.withdraw(use_lookup)
        return merge_drafts(looked_up, modelled, use_lookup)


def make_drafter(
    draft_model: T5 | None,
    prompt_lookup: int,
    prompts: list[list[int]],
    lazy: bool = False,
    cache: DecoderCache | None = None,
) -> Drafter:
    """The drafter for a batch of ``prompts``: the draft model (``lazy`` or
    not, its ``cache`` of the prompts where encoded already), prompt lookup
    of n-grams up to ``prompt_lookup`` tokens (0: none), or both."""
    if draft_model is None:
        return PromptLookupDrafter(prompts, prompt_lookup)
    model_drafter = ModelDrafter(draft_model, prompts, lazy, cache)
    if not prompt_lookup:
        return model_drafter
    # Single-token matches are weak; the draft model does better there.
    lookup = PromptLookupDrafter(prompts, prompt_lookup, min(2, prompt_lookup))
    return HybridDrafter(lookup, model_drafter)


def merge_drafts(first: Draft, second: Draft, use_first: list[bool]) -> Draft:
    """Row i of ``first`` where ``use_first[i]``, of ``second`` elsewhere."""
    width = max(first.tokens.shape[1], second.tokens.shape[1])
    padded = [mx.pad(d.tokens, [(0, 0), (0, width - d.tokens.shape[1])]) for d in (first, second)]
    return Draft(
        mx.where(mx.array(use_first)[:, None], *padded),
        [a if use else b for a, b, use in zip(first.lengths, second.lengths, use_first)],
        [a if use else b for a, b, use in zip(first.sources, second.sources, use_first)],
    )
