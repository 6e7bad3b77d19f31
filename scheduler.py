"""The batch a prompt joins: places, prompts joining and leaving, and the
rounds that decode it (``speculative.speculative_round``).

A ``BatchGenerator`` holds the rows of one batch in the places of its
caches. Prompts wait in a queue, are encoded (together, in slices between
rounds when a server interleaves them), take the places of finished rows
or new ones, and leave when they finish; a freed place is held for a few
rounds for the next prompt. Each call of ``next`` runs one round over every
row and returns the rows' results.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip

from cache import DecoderCache, compacted_rows
from detokenizer import StreamingDetokenizer
from drafting import Drafter, DraftLength, RowState
from model import T5, Slices, encoder_passes
from sampling import Noise, RowSampling, Sampling, draw_seed
from speculative import GenerationResult, Options, RoundOutcome, speculative_round

DEFAULT_OPTIONS = Options()


class Decoding(Protocol):
    """What a batch needs of the decoder it decodes for (the Python API's
    ``decoder.SpeculativeDecoder`` is one): the models, the acceptance
    relaxation, the tokenizer, and the drafters and draft-length rules of
    its batches."""

    model: T5
    draft_model: T5 | None
    tokenizer: object
    delta: float

    @property
    def drafting(self) -> str:
        """The drafting mode: "draft model", "prompt lookup", "hybrid" or "none"."""

    @property
    def lazy_drafting(self) -> bool:
        """Whether the draft model encodes a batch's prompts only when it first drafts."""

    @property
    def byte_ids(self) -> frozenset[int]:
        """The tokenizer's byte pieces (``detokenizer.byte_piece_ids``)."""

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of ``prompt``; ``TypeError`` or ``ValueError`` if it has none."""

    def drafter(self, prompts: list[list[int]], cache: DecoderCache | None = None) -> Drafter:
        """A drafter for a batch of ``prompts``; ``cache``: the draft model's, if encoded."""

    def draft_length(self, prompts: list[list[int]], batch_sizes: list[int]) -> DraftLength:
        """The draft-length rule of a batch whose first rows are ``prompts``."""


@dataclass
class Row:
    """One prompt being decoded in a batch, or waiting for a place in it."""

    uid: int  # the generator's name for it
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int  # its noise's (see sampling.Noise)
    sequence: list[int] = dataclasses.field(default_factory=list)  # start token + generated
    result: GenerationResult | None = None  # set when the row joins the batch
    detokenizer: StreamingDetokenizer | None = None  # its text; set as it joins
    start: float = 0.0  # time.perf_counter() when its prompt processing began


# A place freed by a finished or cancelled prompt stays in the caches, free
# for a waiting prompt at the start of this many rounds (decoding nothing of
# use meanwhile): a server's next request, which usually arrives during the
# round after, takes it without the caches being shrunk and grown again.
HOLD_FREE_ROWS = 2

# While rows decode, a generator that interleaves encoding with its rounds
# spends at most this share of its time encoding joining prompts, on
# average: the rows keep at least 1 - ENCODING_SHARE of their tokens/s.
# What a pass encodes within JOINING_ROUNDS rounds' time per prompt is not
# held back: a server's usual request joins at once, where held to the
# share it would queue behind busy rows for seconds (docs/serving.md).
ENCODING_SHARE = 0.2

# Rounds' time, per prompt, a pass encodes at once (see ENCODING_SHARE).
# Two: at few rows a round is shorter than a usual prompt's encoding, so
# that with one, requests sent together would wait many rounds for the rest
# of their encoding (docs/serving.md).
JOINING_ROUNDS = 2

# With no row decoding, ``next`` encodes for about this long and returns, so
# that a prompt sent meanwhile (a short one beside a long one) can start.
IDLE_ENCODING_SECONDS = 0.1


@dataclass
class Encoding:
    """Prompts joining the batch together (one encoder pass), encoded
    slice by slice; they take places in the batch when it ends."""

    rows: list[Row]
    slices: Slices[tuple[DecoderCache, DecoderCache | None]]  # main's cache, draft's or None
    caches: tuple[DecoderCache, DecoderCache | None] | None = None  # set when it ends
    seconds: float = 0.0  # spent in its slices
    done: int = 0  # slices computed
    cancelled: set[int] = dataclasses.field(default_factory=set)  # uids

    def free_seconds(self, round_seconds: float) -> float:
        """The seconds it encodes at once while rows decode rounds of
        ``round_seconds`` (see JOINING_ROUNDS)."""
        return JOINING_ROUNDS * len(self.rows) * round_seconds

    @property
    def longest(self) -> int:
        """Its longest prompt's tokens: the shortest prompts encode first (a
        pass of several short prompts, which the first requests to a server
        make, not behind every single one that comes after it)."""
        return max(len(row.prompt_ids) for row in self.rows)

    def advance(self) -> bool:
        """Compute one slice; whether the encoding has ended."""
        tic = time.perf_counter()
        try:
            next(self.slices)
        except StopIteration as end:
            self.caches = end.value
        self.seconds += time.perf_counter() - tic
        self.done += 1
        return self.caches is not None


# A list of prompts is decoded longest first within runs of this many
# batches' worth (``longest_first``).
SORT_WINDOW = 4


def longest_first(prompts: list[list[int]], window: int) -> list[int]:
    """The indices of ``prompts`` in the order a batch takes them: each run
    of ``window`` prompts longest first (ties in input order), so that
    prompts joining together need little padding, a batch's cross-attention
    rarely widens for a longer prompt (a copy of every row), and its last
    rounds decode short prompts rather than one long one over empty rows;
    output order lags input order by at most a window."""
    order = []
    for start in range(0, len(prompts), window):
        run = range(start, min(start + window, len(prompts)))
        order += sorted(run, key=lambda i: -len(prompts[i]))
    return order


def iter_rounds(generator: BatchGenerator) -> Iterator[list[tuple[int, GenerationResult]]]:
    """The events of every round of ``generator`` until nothing decodes or waits."""
    while len(generator):
        yield generator.next()


class BatchGenerator:
    """Rows of one batch decoded together, one round (one main-model pass)
    per call of ``next``. Prompts ``insert``ed wait in a queue and take the
    places of finished rows (or new places, up to ``max_batch_size``) at the
    start of the next round; the prompts that join in one round are encoded
    together. Each row has its own ``max_tokens``, sampling settings and
    random stream. Not thread-safe: one thread owns a generator and MLX."""

    def __init__(
        self,
        decoder: Decoding,
        *,
        speculative: bool = True,
        max_batch_size: int = 8,
        cost_batch_sizes: list[int] | None = None,
        prompt_progress: Callable[[int, int], None] | None = None,
        interleave_encoding: bool = False,
    ):
        if not (isinstance(max_batch_size, int) and max_batch_size >= 1):
            raise ValueError(f"batch_size must be >= 1, got {max_batch_size!r}")
        self.decoder = decoder
        self.speculative = speculative and decoder.drafting != "none"
        self.max_batch_size = max_batch_size
        # "auto" weighs the costs measured at these numbers of rows, each
        # round those of the fewest at least its rows (default: the first rows').
        self.cost_batch_sizes = cost_batch_sizes
        # Called as prompts are encoded: (0, total) first, then (k, total)
        # after each of the total encoder layers of the main and draft models.
        self.prompt_progress = prompt_progress
        # Encode joining prompts in slices between rounds (a server: a long
        # prompt stalls no row), or whole before the round (a known list of
        # prompts: each joins as soon as it can).
        self.interleave_encoding = interleave_encoding
        self.encodings: list[Encoding] = []  # shortest prompts first
        # Seconds of encoding the rounds have left room for (ENCODING_SHARE),
        # and the last round's.
        self.encoding_credit = 0.0
        self.round_seconds = 0.0
        self.waiting: deque[Row] = deque()
        self.rows: list[Row | None] = []  # one per row of the caches; None: a free place
        self.freed: dict[int, int] = {}  # free place -> the round it was freed in
        self.rounds = 0  # rounds run
        self.main_cache: DecoderCache | None = None
        self.drafter: Drafter | None = None
        self.draft_length: DraftLength | None = None
        self.uids = itertools.count()

    def __len__(self) -> int:
        """Prompts decoding, encoding or waiting."""
        encoding = sum(len(e.rows) - len(e.cancelled) for e in self.encodings)
        return len(self.waiting) + encoding + sum(row is not None for row in self.rows)

    def insert(self, prompt: str | Sequence[int], options: Options = DEFAULT_OPTIONS) -> int:
        """Queue ``prompt`` (text, or token ids), to be decoded as ``options``
        say, and return its uid, which the events of ``next`` name. Without
        a seed one is drawn from MLX's random state (``result.seed`` names
        it). A seed fixes the prompt's text: the text regular decoding gives
        it alone, whatever else the batch holds and whatever drafts it (with
        delta 0)."""
        seed = draw_seed() if options.seed is None else options.seed
        prompt_ids = self.decoder.prompt_ids(prompt)
        row = Row(next(self.uids), prompt_ids, options.max_tokens, options.sampling, seed)
        self.waiting.append(row)
        return row.uid

    def cancel(self, uid: int) -> None:
        """Stop decoding ``uid``: it leaves the queue, or its row is freed
        (for a waiting prompt to take, or dropped from the caches)."""
        for row in self.waiting:
            if row.uid == uid:
                self.waiting.remove(row)
                return
        for encoding in self.encodings:
            if uid in (row.uid for row in encoding.rows):
                # Its pass goes on for the others; its row is freed as it joins.
                encoding.cancelled.add(uid)
                if len(encoding.cancelled) == len(encoding.rows):
                    self.encodings.remove(encoding)
                return
        for i, row in enumerate(self.rows):
            if row is not None and row.uid == uid:
                self._free(i)
                return

    def next(self, encoding_slices: int | None = None) -> list[tuple[int, GenerationResult]]:
        """Run one round over every row and return ``(uid, result)`` for each:
        a new result object every time, ``result.finished`` on a prompt's
        last (end of sequence or its ``max_tokens``). Empty when nothing
        decodes (prompts may be encoding). ``encoding_slices``: interleaving,
        the number of encoding slices to compute first (``encoding_budget``);
        None: as many as the timings allow, judged slice by slice."""
        # 1. Places: joining prompts encode and take places; places free too long leave.
        self._admit(encoding_slices)
        self._drop_free_rows()
        live = [row for row in self.rows if row is not None]
        if not live:
            return []
        tic = time.perf_counter()
        # 2. Plan: each row's tokens left, its random numbers, the draft length.
        rows = self._round_rows(live)
        sampling = RowSampling([row.sampling for row in rows])
        # Never propose more tokens than a row may still generate.
        limits = [row.max_tokens - len(row.result.tokens) - 1 if row.result else 0 for row in rows]
        noise = None
        if not sampling.greedy:
            # Each row's noise at its next output positions, from its seed alone.
            positions = [len(row.result.tokens) if row.result else 0 for row in rows]
            seeds = [row.seed for row in rows]
            noise = Noise(sampling, seeds, positions, self.decoder.model.args.vocab_size)
        num_draft, states = {}, None
        if self.drafter is not None and max(limits) > 0:
            states = [row_state(row) for row in rows]
            num_draft = self.draft_length.plan(states, limits, self.drafter)
        # 3. The round.
        encoded_before = self.drafter.encoding_time if self.drafter is not None else 0.0
        outcome = speculative_round(
            self.decoder.model,
            self.main_cache,
            self.drafter if any(num_draft.values()) else None,
            num_draft,
            [row.sequence for row in rows],
            limits,
            sampling,
            self.decoder.delta,
            noise,
            self.decoder.model.args.eos_token_id,
        )
        self.rounds += 1
        # A lazy drafter's first proposal encoded the live rows' prompts:
        # their prompt processing, shared evenly, not the round's.
        encoding_time = 0.0
        if self.drafter is not None:
            encoding_time = self.drafter.encoding_time - encoded_before
        # 4. Results: every live row takes its new tokens; finished rows leave.
        events = self._deliver(rows, outcome, encoding_time / len(live))
        # 5. Measure: the acceptance, for the draft length; the round's time,
        # for the encoding of prompts that join.
        if self.draft_length is not None:
            self.draft_length.observe(states or [row_state(row) for row in rows], outcome)
        round_seconds = time.perf_counter() - tic
        # Room for encoding at most one round's time at once.
        credit = self.encoding_credit + round_seconds * ENCODING_SHARE / (1 - ENCODING_SHARE)
        self.encoding_credit = min(credit, round_seconds)
        self.round_seconds = round_seconds
        return events

    def _round_rows(self, live: list[Row]) -> list[Row]:
        """The rows of the round, one per place: a free place decodes the
        start token again and drafts nothing (its limit is 0); it samples as
        a live row does, so that the batch keeps one rule where its rows
        share one. One stand-in serves every free place: nothing of it is updated."""
        start = [self.decoder.model.args.decoder_start_token_id]
        free = Row(-1, [], 1, live[0].sampling, seed=0, sequence=start)
        return [row or free for row in self.rows]

    def _deliver(
        self,
        rows: list[Row],
        outcome: RoundOutcome,
        prompt_seconds: float,
    ) -> list[tuple[int, GenerationResult]]:
        """Give each live row of ``rows`` what ``outcome`` brought it; a row
        that finished leaves. The events of the round: a snapshot of every
        live row's result."""
        events = []
        draft = outcome.draft
        for i, row in enumerate(rows):
            if row.result is None:  # a free place
                continue
            accepted, rejected, new_tokens = (
                outcome.accepted[i],
                outcome.rejected[i],
                outcome.new_tokens[i],
            )
            result = row.result
            result.prompt_time += prompt_seconds
            if draft.lengths[i] > 0:
                result.draft_lengths.append(draft.lengths[i])
                result.n_lookup_rounds += draft.sources[i] == "lookup"
            result.n_steps += 1
            result.n_draft += draft.lengths[i]
            result.n_accepted += accepted
            result.n_rejected += int(rejected)
            row.sequence += new_tokens
            result.tokens += new_tokens
            result.from_draft += [j < accepted for j in range(len(new_tokens))]
            result.finished = outcome.ended[i] or len(result.tokens) >= row.max_tokens
            result.text += row.detokenizer.add(new_tokens, last=result.finished)
            result.elapsed = time.perf_counter() - row.start
            events.append((row.uid, snapshot(result)))
            if result.finished:
                self._free(i)
        return events

    def _free(self, place: int) -> None:
        """Free ``place`` for a waiting prompt; it leaves the caches when
        none takes it within ``HOLD_FREE_ROWS`` rounds."""
        self.rows[place] = None
        self.freed[place] = self.rounds
        if not any(self.rows):  # an idle generator holds no cache
            self._drop_free_rows()

    def _drop_free_rows(self) -> None:
        """Remove from the caches the free places held long enough (all of
        them when no prompt decodes)."""
        idle = not any(self.rows)
        staying = [
            row is not None or (not idle and self.rounds - self.freed[i] < HOLD_FREE_ROWS)
            for i, row in enumerate(self.rows)
        ]
        if all(staying):
            return
        # Rows from the end take the places that leave: the caches copy those rows alone.
        kept = compacted_rows(staying)
        self.freed = {
            new: self.freed[old] for new, old in enumerate(kept) if self.rows[old] is None
        }
        self.rows = [self.rows[i] for i in kept]
        if not kept:  # an idle generator holds no cache
            self.main_cache = self.drafter = None
            return
        self.main_cache.keep_rows(kept)
        if self.drafter is not None:
            self.drafter.keep_rows(kept)

    def _admit(self, budget: int | None = None) -> None:
        """Start encoding waiting prompts while places allow (the prompts of
        each encoder pass together), then encode, shortest prompts first:
        all of it, or, interleaving, ``budget`` slices, or with None, slices
        while the rounds' share of time allows (``_next_encoding``). Prompts
        whose encoding ends take free rows, then new ones up to
        ``max_batch_size``."""
        encoding = sum(len(e.rows) for e in self.encodings)
        capacity = self.rows.count(None) + self.max_batch_size - len(self.rows) - encoding
        joining = [self.waiting.popleft() for _ in range(min(capacity, len(self.waiting)))]
        if joining:
            prompts = [row.prompt_ids for row in joining]
            on_layer = self._layer_progress(prompts)
            start = time.perf_counter()
            for group in encoder_passes(prompts):
                rows = [joining[i] for i in group]
                for row in rows:
                    row.start = start
                slices = self._encoding_slices([row.prompt_ids for row in rows], on_layer)
                self.encodings.append(Encoding(rows, slices))
            self.encodings.sort(key=lambda e: e.longest)
        idle_since, sliced = time.perf_counter(), False
        while self.encodings and budget != 0:
            if budget is None:
                encoding = self._next_encoding(sliced, idle_since)
            else:
                encoding, budget = self.encodings[0], budget - 1
            if encoding is None:
                break
            sliced = True
            seconds = encoding.seconds
            ended = encoding.advance()
            if self.interleave_encoding and any(self.rows):
                # Charged past its free seconds (see ENCODING_SHARE).
                free = max(0.0, encoding.free_seconds(self.round_seconds) - seconds)
                self.encoding_credit -= max(0.0, encoding.seconds - seconds - free)
            if ended:
                self.encodings.remove(encoding)
                self._join(encoding)

    def encoding_budget(self) -> int:
        """The encoding slices the next round may compute, judged before it
        from the slices timed so far, as ``_next_encoding`` judges each
        slice: the first pass's free seconds left or the credit (with no row
        decoding, IDLE_ENCODING_SECONDS), over the seconds of its slices. At
        least one while a pass waits, and one for a pass not yet begun (it
        times it). A group's rank 0 decides this for every rank, whose
        timings differ (``engine.follow``)."""
        if not self.encodings:
            return int(bool(self.waiting))
        first = self.encodings[0]
        if not first.done:
            return 1
        seconds = IDLE_ENCODING_SECONDS
        if any(self.rows):
            free = first.free_seconds(self.round_seconds) - first.seconds
            seconds = max(free, self.encoding_credit)
        return max(1, int(seconds / (first.seconds / first.done)))

    def _next_encoding(self, sliced: bool, idle_since: float) -> Encoding | None:
        """The pass to encode a slice of next, or None for none now: the
        first (``encodings`` in order) or, interleaving while rows decode,
        the first that has encoded for less than its free seconds, else the
        first while the credit lasts; interleaving with no row decoding,
        for IDLE_ENCODING_SECONDS at most."""
        if not self.interleave_encoding:
            return self.encodings[0]
        if not any(self.rows):
            idle = sliced and time.perf_counter() - idle_since >= IDLE_ENCODING_SECONDS
            return None if idle else self.encodings[0]
        fresh = [e for e in self.encodings if e.seconds < e.free_seconds(self.round_seconds)]
        if fresh:
            return fresh[0]
        return self.encodings[0] if self.encoding_credit > 0 else None

    def _encoding_slices(
        self, prompts: list[list[int]], on_layer: Callable[[], None] | None
    ) -> Slices[tuple[DecoderCache, DecoderCache | None]]:
        """The main model's cache of ``prompts``, then the draft model's
        where the drafter would encode them as they join, in slices."""
        cache = yield from self.decoder.model.prompt_cache_slices(prompts, on_layer)
        draft_model = self.decoder.draft_model
        if not self.speculative or draft_model is None:
            return cache, None
        # A lazy drafter encodes nothing before it has started.
        if (self.drafter is None and self.decoder.lazy_drafting) or (
            self.drafter is not None and self.drafter.start_pending
        ):
            return cache, None
        draft_on_layer = None if self.decoder.lazy_drafting else on_layer
        return cache, (yield from draft_model.prompt_cache_slices(prompts, draft_on_layer))

    def _join(self, encoding: Encoding) -> None:
        """Give the prompts of ``encoding``, which has ended, places in the
        batch: free rows first, then new ones."""
        joining = encoding.rows
        places = [i for i, row in enumerate(self.rows) if row is None][: len(joining)]
        for place in places:
            del self.freed[place]
        places += range(len(self.rows), len(self.rows) + len(joining) - len(places))
        self.rows += [None] * (max(places) + 1 - len(self.rows))
        prompts = [row.prompt_ids for row in joining]
        cache, draft_cache = encoding.caches
        if self.main_cache is None:
            self.main_cache = cache
            if self.speculative:
                self.drafter = self.decoder.drafter(prompts, draft_cache)
        else:
            self.main_cache.admit(places, cache)
            if self.drafter is not None:
                self.drafter.admit(places, prompts, draft_cache)
        prompt_time = encoding.seconds / len(joining)
        calibration_time = 0.0
        if self.draft_length is None and self.speculative:
            # The first rows: those of every pass that began with these, in the order they came.
            first = sorted(
                joining + [row for other in self.encodings for row in other.rows],
                key=lambda row: row.uid,
            )
            self.draft_length = self.decoder.draft_length(
                [row.prompt_ids for row in first], self.cost_batch_sizes or [len(first)]
            )
            calibration_time = self.draft_length.calibration_seconds
        for place, row in zip(places, joining):
            row.sequence = [self.decoder.model.args.decoder_start_token_id]
            row.result = GenerationResult(
                [],
                prompt_tokens=len(row.prompt_ids),
                prompt_time=prompt_time,
                calibration_time=calibration_time,
                seed=row.seed,
            )
            row.detokenizer = StreamingDetokenizer(self.decoder.tokenizer, self.decoder.byte_ids)
            self.rows[place] = row
        # Cancelled while encoding; another row of the pass is live.
        for place, row in zip(places, joining):
            if row.uid in encoding.cancelled:
                self._free(place)

    def _layer_progress(self, prompts: list[list[int]]) -> Callable[[], None] | None:
        """What the encoders call after each layer, to report ``prompts``'
        progress to ``prompt_progress``; None without one."""
        if self.prompt_progress is None:
            return None
        models = [self.decoder.model]
        draft_model = self.decoder.draft_model
        if self.speculative and draft_model is not None and not self.decoder.lazy_drafting:
            models.append(draft_model)
        total = len(encoder_passes(prompts)) * sum(model.args.num_layers for model in models)
        done = itertools.count(1)
        self.prompt_progress(0, total)

        def on_layer() -> None:
            self.prompt_progress(next(done), total)

        return on_layer


def row_state(row: Row) -> RowState:
    """What a draft-length rule is told of ``row``: a free place's stand-in,
    or a prompt being decoded."""
    if row.result is None:
        return RowState(live=False)
    return RowState(True, row.result.prompt_tokens, row.result.prompt_time, len(row.sequence))


T = TypeVar("T")


class Prefix(Sequence[T]):
    """The items that ``items``, a list that only grows, holds now: a
    snapshot of it that copies nothing. Read-only; equal to a list of the
    same items."""

    __slots__ = ("items", "length")

    def __init__(self, items: list[T]):
        self.items = items
        self.length = len(items)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int | slice):
        if isinstance(index, slice):
            return [self.items[i] for i in range(*index.indices(self.length))]
        if not -self.length <= index < self.length:
            raise IndexError("Prefix index out of range")
        return self.items[index % self.length]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self.items, self.length)

    def __eq__(self, other) -> bool:
        if not isinstance(other, (list, Prefix)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # equal to a list, which has none

    def __repr__(self) -> str:
        return repr(list(self))


def snapshot(result: GenerationResult) -> GenerationResult:
    """``result`` as later rounds leave it: its lists only grow, so views of
    them as they stand now (``Prefix``), not copies, which would make a
    round's time grow with the output; a finished result, itself."""
    if result.finished:
        return result
    return dataclasses.replace(
        result,
        tokens=Prefix(result.tokens),
        from_draft=Prefix(result.from_draft),
        draft_lengths=Prefix(result.draft_lengths),
    )
