"""Regular and speculative decoding (Leviathan et al., arXiv 2211.17192) for T5 in MLX.

One speculative round:

1. the draft model proposes ``g`` tokens x_1..x_g, one at a time, from its
   distributions q_1..q_g;
2. the main model scores the last accepted token and x_1..x_g in one pass,
   giving its distributions p_1..p_{g+1};
3. each x_i is accepted in turn until the first rejection; the round then
   adds one token of the main model's own: a replacement for the rejected
   token, or one more token after x_g when all were accepted.

So every round costs one main-model pass and adds between 1 and g+1 tokens.
The host waits once per round, for the accepted count and the next token.

A batch of prompts runs the same rounds, all rows in each pass: every row
proposes its own draft tokens, is verified by the same rule and keeps its
own number of them (the caches keep a length per row). Rows that finish
leave the batch and waiting prompts take their places. A single prompt is
a batch of one. Drafters and the draft-length rule live in ``drafting.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

# First: the fast BLAS on Linux must load before mlx (see model.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from cache import DecoderCache, compacted_rows
from distributed import shared_draft_length
from drafting import (
    DRAFT_SOURCES,
    MAX_AUTO_DRAFT,
    Deliveries,
    Draft,
    DraftLength,
    HybridDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    RoundTimes,
    acceptance_counts,
    draft_start_cost,
    pass_times,
    trim_to,
)
from loading import check_draft_compatible
from model import T5, Slices, encoder_passes
from sampling import SEEDS, RowSampling, Sampling, is_seed, row_key, split_keys, verify


@dataclass
class GenerationResult:
    """The tokens and text generated so far, and what it cost."""

    tokens: list[int]
    text: str = ""
    n_draft: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens accepted
    n_rejected: int = 0  # draft tokens tested and rejected (at most one per round)
    n_steps: int = 0  # main-model decoder passes
    from_draft: list[bool] = dataclasses.field(
        default_factory=list
    )  # per token: an accepted draft token
    draft_lengths: list[int] = dataclasses.field(
        default_factory=list
    )  # per round: draft tokens proposed
    n_lookup_rounds: int = 0  # rounds drafted by prompt lookup
    prompt_tokens: int = 0  # tokens of the prompt, end-of-sequence included
    # Seconds encoding the prompt (both models, cross-attention too); the
    # prompts that start a batch share their batch's time evenly.
    prompt_time: float = 0.0
    # Seconds "auto" spent measuring costs before this generation's batch began.
    calibration_time: float = 0.0
    elapsed: float = 0.0  # seconds in all, from the start of the prompt's processing
    finished: bool = False  # the last result of this generation

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


@dataclass
class Row:
    """One prompt being decoded in a batch, or waiting for a place in it."""

    uid: int  # the generator's name for it
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None
    sequence: list[int] = dataclasses.field(default_factory=list)  # start token + generated
    result: GenerationResult | None = None  # set when the row joins the batch
    key: mx.array | None = None  # its stream of random numbers, from the seed
    start: float = 0.0  # time.perf_counter() when its prompt processing began
    # Its own draft tokens accepted and tested, per source and position (see DraftLength).
    acceptance: dict[str, np.ndarray] = dataclasses.field(default_factory=acceptance_counts)


GREEDY = Sampling()


# A place freed by a finished or cancelled prompt stays in the caches, free
# for a waiting prompt at the start of this many rounds (decoding nothing of
# use meanwhile): a server's next request, which usually arrives during the
# round after, takes it without the caches being shrunk and grown again.
HOLD_FREE_ROWS = 2

# A list of prompts is decoded longest first within runs of this many batches'
# worth (``longest_first``): on the benchmark pair's 32 prompts, whole calls
# of regular decoding took 0.95x, 0.94x and 0.88x the time at B = 4, 8 and 16
# (docs/benchmarks.md).
SORT_WINDOW = 4

# While rows decode, a generator that interleaves encoding with its rounds
# spends at most this share of its time encoding joining prompts, on
# average: the rows keep at least 1 - ENCODING_SHARE of their tokens/s
# (issue 49 asks for three quarters). What a pass encodes within
# JOINING_ROUNDS rounds' time per prompt is not held back: a server's usual
# request joins at once, where held to the share, at 8 rows of the
# benchmark pair, requests of 30-odd tokens queued for their encoding and
# waited up to 10 s for their first token (0.05 s alone).
ENCODING_SHARE = 0.2

# Rounds' time, per prompt, a pass encodes at once (see ENCODING_SHARE).
# Two, not one: at few rows a round is shorter than a usual prompt's
# encoding (on the benchmark pair, 13 ms at 1 row against 20 ms for a
# 25-token prompt, both models), and with one, of 8 requests sent at once
# to a server, those after the first pass queued 6 to 21 rounds for the
# rest of their encoding: 0.2 to 1.1 s to their first tokens.
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
        return self.caches is not None


class BatchGenerator:
    """Rows of one batch decoded together, one round (one main-model pass)
    per call of ``next``. Prompts ``insert``ed wait in a queue and take the
    places of finished rows (or new places, up to ``max_batch_size``) at the
    start of the next round; the prompts that join in one round are encoded
    together. Each row has its own ``max_tokens``, sampling settings and
    random stream. Not thread-safe: one thread owns a generator and MLX."""

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        *,
        speculative: bool = True,
        max_batch_size: int = 8,
        cost_batch_size: int | None = None,
        prompt_progress: Callable[[int, int], None] | None = None,
        interleave_encoding: bool = False,
    ):
        if not (isinstance(max_batch_size, int) and max_batch_size >= 1):
            raise ValueError(f"batch_size must be >= 1, got {max_batch_size!r}")
        self.decoder = decoder
        self.speculative = speculative and decoder.drafting != "none"
        self.max_batch_size = max_batch_size
        # "auto" weighs the costs measured at this many rows (default: the first rows' number).
        self.cost_batch_size = cost_batch_size
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
        self.drafter = None
        self.draft_length: DraftLength | None = None
        self.uids = itertools.count()

    def __len__(self) -> int:
        """Prompts decoding, encoding or waiting."""
        encoding = sum(len(e.rows) - len(e.cancelled) for e in self.encodings)
        return len(self.waiting) + encoding + sum(row is not None for row in self.rows)

    def insert(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 100,
        sampling: Sampling = GREEDY,
        seed: int | None = None,
    ) -> int:
        """Queue ``prompt`` (text, or token ids) and return its uid, which
        the events of ``next`` name. A seeded prompt draws the same random
        numbers whatever else the batch holds."""
        self.check_options(max_tokens, seed)
        row = Row(next(self.uids), self.decoder.prompt_ids(prompt), max_tokens, sampling, seed)
        self.waiting.append(row)
        return row.uid

    @staticmethod
    def check_options(max_tokens: int, seed: int | None) -> None:
        """``ValueError`` unless ``insert`` takes ``max_tokens`` and ``seed``."""
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        if seed is not None and not is_seed(seed):
            raise ValueError(f"seed must be {SEEDS}, got {seed!r}")

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

    def next(self) -> list[tuple[int, GenerationResult]]:
        """Run one round over every row and return ``(uid, result)`` for each:
        a new result object every time, ``result.finished`` on a prompt's
        last (end of sequence or its ``max_tokens``). Empty when nothing
        decodes (prompts may be encoding)."""
        round_start = time.perf_counter()
        shared_seconds = self._admit()
        self._drop_free_rows()
        live = [row for row in self.rows if row is not None]
        if not live:
            return []
        tic = time.perf_counter()
        decoder = self.decoder
        # A free place decodes the start token again and drafts nothing
        # (its limit is 0); it samples as a live row does, so that the batch
        # keeps one rule where its rows share one.
        start = [decoder.model.args.decoder_start_token_id]
        # One stand-in for every free place: nothing of it is updated.
        free = Row(-1, [], 1, live[0].sampling, seed=None, sequence=start, key=GREEDY_KEY)
        rows = [row or free for row in self.rows]
        sampling = RowSampling([row.sampling for row in rows])
        sequences = [row.sequence for row in rows]
        # Never propose more tokens than a row may still generate.
        limits = [row.max_tokens - len(row.result.tokens) - 1 if row.result else 0 for row in rows]
        verify_keys = draft_keys = next_keys = None
        if not sampling.greedy:
            row_keys = mx.stack([row.key for row in rows])
            next_keys, verify_keys, draft_keys = split_keys(row_keys, 3)
        draft = None
        encoded_before = self.drafter.encoding_time if self.drafter is not None else 0.0
        if self.drafter is not None and not self.draft_length.allows_drafting(len(rows)):
            # A plain step: to judge drafting by, or drafting was measured not
            # to pay here, and then the draft model costs nothing meanwhile.
            started = self._started_model_drafter()
            if started is not None and self.draft_length.deliveries.vetoes(len(rows)):
                started.suspend()
        elif self.drafter is not None and max(limits) > 0:
            drafting_rows = [row.acceptance for row, limit in zip(rows, limits) if limit > 0]
            choose = functools.partial(
                self.draft_length.choose,
                batch_size=len(rows),
                rows=drafting_rows,
                start_cost=self._draft_start_cost(live, limits),
            )
            draft = self.drafter.propose(sequences, sampling, choose, limits, draft_keys)
        draft = draft or Draft.empty(len(rows))
        # The main cache holds every accepted position of a row but its
        # last token, which is the next input.
        trim_to(self.main_cache, sequences)
        inputs = mx.concatenate([mx.array([[s[-1]] for s in sequences]), draft.tokens], axis=1)
        logits = decoder.model.decode(inputs, self.main_cache)
        num_accepted, next_tokens = verify(
            draft.tokens,
            draft.probs,
            logits,
            sampling,
            decoder.delta,
            mx.array(draft.lengths),
            verify_keys,
        )
        mx.eval(num_accepted, next_tokens, draft.tokens, next_keys)

        self.rounds += 1
        # A lazy drafter's first proposal encoded the live rows' prompts:
        # their prompt processing, shared evenly, not the round's.
        encoding_time = 0.0
        if self.drafter is not None:
            encoding_time = self.drafter.encoding_time - encoded_before
        events = []
        delivered = 0  # tokens, over every row
        eos = decoder.model.args.eos_token_id
        for i, (row, accepted, next_token, draft_tokens) in enumerate(
            zip(rows, num_accepted.tolist(), next_tokens.tolist(), draft.tokens.tolist())
        ):
            if row.result is None:  # a free place
                continue
            if next_keys is not None:
                row.key = next_keys[i]
            num_draft = draft.lengths[i]
            new_tokens = draft_tokens[:accepted] + [next_token]
            rejected = accepted < num_draft
            finished = eos in new_tokens
            if finished:
                end = new_tokens.index(eos)
                if end < accepted:  # the draft's own EOS: later draft tokens went untested
                    accepted, rejected = end + 1, False
                new_tokens = new_tokens[:end]
            result = row.result
            result.prompt_time += encoding_time / len(live)
            if num_draft > 0:
                self.draft_length.update(
                    draft.sources[i], accepted, accepted + int(rejected), row.acceptance
                )
                result.draft_lengths.append(num_draft)
                result.n_lookup_rounds += draft.sources[i] == "lookup"
            result.n_steps += 1
            result.n_draft += num_draft
            result.n_accepted += accepted
            result.n_rejected += int(rejected)
            row.sequence += new_tokens
            delivered += len(new_tokens)
            result.tokens += new_tokens
            result.from_draft += [j < accepted for j in range(len(new_tokens))]
            result.text = decoder.tokenizer.decode(result.tokens, skip_special_tokens=True)
            result.finished = finished or len(result.tokens) >= row.max_tokens
            result.elapsed = time.perf_counter() - row.start
            events.append((row.uid, snapshot(result)))
            if result.finished:
                self._free(i)
        end = time.perf_counter()
        round_seconds = end - tic
        if self.draft_length is not None:
            self.draft_length.timed(draft, round_seconds - encoding_time)
            self.draft_length.delivered(
                len(rows), any(draft.lengths), delivered, end - round_start - shared_seconds
            )
        # Room for encoding at most one round's time at once.
        credit = self.encoding_credit + round_seconds * ENCODING_SHARE / (1 - ENCODING_SHARE)
        self.encoding_credit = min(credit, round_seconds)
        self.round_seconds = round_seconds
        return events

    def _model_drafter(self) -> ModelDrafter | None:
        """The drafter's draft model (a hybrid drafter's too), if any."""
        drafter = self.drafter.model if isinstance(self.drafter, HybridDrafter) else self.drafter
        return drafter if isinstance(drafter, ModelDrafter) else None

    def _started_model_drafter(self) -> ModelDrafter | None:
        """The drafter's draft model, if started."""
        drafter = self._model_drafter()
        return drafter if drafter is not None and drafter.cache is not None else None

    def _draft_start_cost(self, live: list[Row], limits: list[int]) -> float:
        """What a lazy draft model that has not started would cost to start
        (``draft_start_cost``): its encoding of the rows' prompts, then a
        pass that catches its cache up on every token the rows generated so
        far, estimated from the main model's prompt time per multiply-add
        and the draft model's ``prompt_work`` and ``decode_work``; over the
        tokens the rows have left, in plain steps over the fewest rows at
        least as many as the batch's that a plain step was timed or
        calibrated over. 0 once started, or with none."""
        if self.decoder.draft_model is None or self._started_model_drafter():
            return 0.0
        decoder = self.decoder
        timed = self.draft_length.times.seconds
        timed_plain = {rows for rows, rounds in timed.items() if ("plain", 0) in rounds}
        known = [n for n in timed_plain | decoder.plain_step_seconds.keys() if n >= len(self.rows)]
        if not known:
            return 0.0
        rows = min(known)
        if rows in timed_plain:  # the loop's own timings before the calibration's
            plain = statistics.median(timed[rows]["plain", 0])
        else:
            plain = decoder.plain_step_seconds[rows]
        prompt_tokens = sum(row.result.prompt_tokens for row in live)
        prompt_seconds = sum(row.result.prompt_time for row in live)
        seconds_per_work = prompt_seconds / (decoder.model.args.prompt_work * prompt_tokens)
        draft_args = decoder.draft_model.args
        # The catch-up pass is padded to the longest row's tokens.
        catch_up = len(live) * max(len(row.sequence) for row in live)
        work = draft_args.prompt_work * prompt_tokens + draft_args.decode_work * catch_up
        tokens_left = sum(limit + 1 for limit in limits if limit > 0)
        return draft_start_cost(seconds_per_work * work, tokens_left, plain, len(live))

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

    def _admit(self) -> float:
        """Start encoding waiting prompts while places allow (the prompts of
        each encoder pass together), then encode, shortest prompts first:
        all of it, or, interleaving, slices while the rounds' share of time
        allows (``_next_encoding``). Prompts whose encoding ends take free
        rows, then new ones up to ``max_batch_size``. The seconds spent on
        what every mode pays alike (see ``Deliveries``): encoding the joining
        prompts and auto's calibration."""
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
        shared_seconds = 0.0
        while self.encodings:
            encoding = self._next_encoding(sliced, idle_since)
            if encoding is None:
                break
            sliced = True
            seconds = encoding.seconds
            ended = encoding.advance()
            if self.interleave_encoding and any(self.rows):
                # Charged past its free seconds (see ENCODING_SHARE).
                free = max(0.0, encoding.free_seconds(self.round_seconds) - seconds)
                self.encoding_credit -= max(0.0, encoding.seconds - seconds - free)
            shared_seconds += encoding.seconds - seconds
            if ended:
                self.encodings.remove(encoding)
                shared_seconds += self._join(encoding)
        return shared_seconds

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
        drafter = self._model_drafter()
        if (drafter is None and self.decoder.lazy_drafting) or (
            drafter is not None and drafter.cache is None
        ):
            return cache, None
        draft_on_layer = None if self.decoder.lazy_drafting else on_layer
        return cache, (yield from draft_model.prompt_cache_slices(prompts, draft_on_layer))

    def _join(self, encoding: Encoding) -> float:
        """Give the prompts of ``encoding``, which has ended, places in the
        batch: free rows first, then new ones; the seconds auto's
        calibration took (the first rows')."""
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
        if self.draft_length is None:
            # The first rows: those of every pass that began with these, in the order they came.
            first = joining + [row for other in self.encodings for row in other.rows]
            calibration_time = self._calibrate(sorted(first, key=lambda row: row.uid))
        for place, row in zip(places, joining):
            row.sequence = [self.decoder.model.args.decoder_start_token_id]
            row.key = row_key(row.seed) if not row.sampling.greedy else GREEDY_KEY
            row.result = GenerationResult(
                [],
                prompt_tokens=len(row.prompt_ids),
                prompt_time=prompt_time,
                calibration_time=calibration_time,
            )
            self.rows[place] = row
        # Cancelled while encoding; another row of the pass is live.
        for place, row in zip(places, joining):
            if row.uid in encoding.cancelled:
                self._free(place)
        return calibration_time

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

    def _calibrate(self, joining: list[Row]) -> float:
        """Set up the draft length rule for the generator's first rows; the
        seconds "auto" spent measuring its costs."""
        if not self.speculative:
            return 0.0
        decoder = self.decoder
        batch_size = self.cost_batch_size or len(joining)
        costs, tic = {}, time.perf_counter()
        if decoder.num_draft == "auto":
            costs = decoder.measure_costs(joining[0].prompt_ids, batch_size)
        # Acceptance depends on the pair, how lookup matches, sampling and delta;
        # round times on the pair, how lookup matches and whether rows sample.
        drafting = decoder.drafting, decoder.prompt_lookup, id(decoder.draft_model)
        sampling = joining[0].sampling
        earlier = decoder.acceptance.setdefault(
            (*drafting, sampling, decoder.delta), acceptance_counts()
        )
        times = decoder.round_times.setdefault((*drafting, sampling.greedy), RoundTimes())
        # What choices deliver depends on acceptance and round times alike.
        deliveries = decoder.deliveries.setdefault(
            (*drafting, sampling, decoder.delta), Deliveries()
        )
        draft_length = DraftLength(decoder.num_draft, costs, earlier, times, deliveries)
        # In a group, rank 0's choices: every rank must run the same rounds.
        self.draft_length = shared_draft_length(draft_length, decoder.group)
        return time.perf_counter() - tic if decoder.num_draft == "auto" else 0.0


# Greedy rows draw nothing; a batch that samples in other rows splits this
# key for them too, and never uses what it gives.
GREEDY_KEY = mx.random.key(0)


def snapshot(result: GenerationResult) -> GenerationResult:
    """A copy of ``result`` that later rounds do not change."""
    return dataclasses.replace(
        result,
        tokens=list(result.tokens),
        from_draft=list(result.from_draft),
        draft_lengths=list(result.draft_lengths),
    )


class SpeculativeDecoder:
    """Decodes with ``model``. Drafts come from ``draft_model``, from prompt
    lookup of n-grams up to ``prompt_lookup`` tokens long (0: off), or from
    both (lookup first). ``num_draft`` is the number of draft tokens per
    round, or ``"auto"``; ``delta`` in [0, 1] relaxes acceptance.
    ``group``: the processes ``model`` is split across (see
    ``distributed.py``), whose ranks take rank 0's timing decisions."""

    def __init__(
        self,
        model: T5,
        draft_model: T5 | None,
        tokenizer,
        num_draft: int | str = 5,
        delta: float = 0.0,
        prompt_lookup: int = 0,
        group: mx.distributed.Group | None = None,
    ):
        if num_draft != "auto" and not (isinstance(num_draft, int) and num_draft >= 1):
            raise ValueError(f"num_draft must be >= 1 or 'auto', got {num_draft!r}")
        if not 0 <= delta <= 1:
            raise ValueError(f"delta must be in [0, 1], got {delta}")
        if not (isinstance(prompt_lookup, int) and prompt_lookup >= 0):
            raise ValueError(f"prompt_lookup must be an integer >= 0, got {prompt_lookup!r}")
        if draft_model is not None:
            check_draft_compatible(model.args, draft_model.args)
        self.model = model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.num_draft = num_draft
        self.delta = delta
        self.prompt_lookup = prompt_lookup
        self._costs = {}  # round costs per source, draft model and batch size: see measure_costs
        # Per batch size, the seconds of a plain step measure_costs timed.
        self.plain_step_seconds: dict[int, float] = {}
        self.acceptance = {}  # per way of drafting: see DraftLength
        self.round_times = {}  # per way of drafting: see RoundTimes
        self.deliveries = {}  # per way of drafting: see Deliveries
        # The processes the main model is split across (distributed.py), or None.
        self.group = group

    @property
    def drafting(self) -> str:
        """The drafting mode: "draft model", "prompt lookup", "hybrid" or "none"."""
        if self.prompt_lookup and self.draft_model is not None:
            return "hybrid"
        if self.prompt_lookup:
            return "prompt lookup"
        return "none" if self.draft_model is None else "draft model"

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of ``prompt``: text, or token ids as they are.
        ``TypeError`` for anything else, ``ValueError`` for an empty prompt
        or an id outside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            return self.tokenizer(prompt).input_ids
        if not isinstance(prompt, Sequence) or not all(
            isinstance(token, int) and not isinstance(token, bool) for token in prompt
        ):
            raise TypeError(
                "a prompt must be a string or a sequence of token ids (int), "
                f"got {type(prompt).__name__}"
            )
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab_size = self.model.args.vocab_size
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(
                f"token id {outside[0]} is outside the vocabulary (0 .. {vocab_size - 1})"
            )
        return list(prompt)

    @property
    def lazy_drafting(self) -> bool:
        """Whether the draft model encodes a batch's prompts only when it
        first drafts (see ``ModelDrafter``): with "auto", which may not."""
        return self.num_draft == "auto" and self.draft_model is not None

    def drafter(self, prompts: list[list[int]], cache: DecoderCache | None = None):
        """A drafter for a batch of ``prompts`` (token ids); ``cache``: the
        draft model's cache of them, where encoded already."""
        vocab_size = self.model.args.vocab_size
        if self.drafting == "prompt lookup":
            return PromptLookupDrafter(prompts, vocab_size, self.prompt_lookup)
        model_drafter = ModelDrafter(self.draft_model, prompts, self.lazy_drafting, cache)
        if self.drafting == "draft model":
            return model_drafter
        # Single-token matches are weak; the draft model does better there.
        lookup = PromptLookupDrafter(
            prompts, vocab_size, self.prompt_lookup, min(2, self.prompt_lookup)
        )
        return HybridDrafter(lookup, model_drafter)

    def measure_costs(
        self, prompt_ids: Sequence[int], batch_size: int = 1
    ) -> dict[str, list[float]]:
        """What "auto" weighs at ``batch_size`` rows, for each draft source
        this decoder drafts from: the time of a round drafting g = 0 ..
        MAX_AUTO_DRAFT tokens per row and verifying them, over that of a
        plain main step, timed on ``prompt_ids`` once per decoder (and draft
        model) and batch size. A model's draft tokens are timed in the round,
        between main passes, because drafting there costs more than drafting
        alone (see docs/how-it-works.md). Looking up draft tokens costs next
        to nothing, so a lookup round costs its verify pass."""
        prompt_ids = list(prompt_ids)
        sources = {"draft model": ["model"], "prompt lookup": ["lookup"], "hybrid": DRAFT_SOURCES}
        costs, encoder_output = {}, None
        for source in sources.get(self.drafting, []):
            key = source, id(self.draft_model) if source == "model" else None, batch_size
            if key not in self._costs:
                drafter = None
                if source == "model":
                    drafter = ModelDrafter(self.draft_model, [prompt_ids] * batch_size)
                if encoder_output is None:  # once for both sources of hybrid drafting
                    encoder_output = self.model.encode(mx.array([prompt_ids]))
                times = pass_times(
                    self.model, encoder_output, MAX_AUTO_DRAFT + 1, batch_size, drafter
                )
                self._costs[key] = [t / times[0] for t in times]
                self.plain_step_seconds[batch_size] = times[0]
            costs[source] = self._costs[key]
        return costs

    def batch_generator(
        self, *, speculative: bool = True, max_batch_size: int = 8, **kwargs
    ) -> BatchGenerator:
        """A ``BatchGenerator`` decoding with this decoder: prompts join it
        while it runs (``insert``), one round per ``next``."""
        return BatchGenerator(
            self, speculative=speculative, max_batch_size=max_batch_size, **kwargs
        )

    def stream_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        speculative: bool = True,
        batch_size: int = 8,
        max_tokens: int = 100,
        temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        prompt_progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Decode ``prompts``, ``batch_size`` at a time, and yield ``(index,
        result)`` for every prompt in the batch after every main-model pass
        (a new result object each time); ``result.finished`` marks a
        prompt's last. Prompts are taken longest first within each run of
        ``SORT_WINDOW * batch_size`` (``longest_first``). A prompt that
        finishes (end of sequence or ``max_tokens``) leaves the batch and
        the next waiting prompt takes its place. Regular decoding
        (``speculative=False``, or nothing to draft with) is the same loop
        with no draft tokens. With ``seed``,
        every prompt draws the random numbers it would draw alone, so it
        gets the text it gets alone (for a fixed ``num_draft``).
        ``prompt_progress(done, total)`` follows the encoding of prompts:
        called with 0, then after each encoder layer (main and draft
        models, each padded pass), whenever prompts join the batch."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        return self._stream(
            prompts,
            speculative=speculative,
            batch_size=batch_size,
            max_tokens=max_tokens,
            sampling=Sampling(temp, top_p, top_k),
            seed=seed,
            name_prompts=True,
            prompt_progress=prompt_progress,
        )

    def _stream(
        self,
        prompts,
        *,
        speculative,
        batch_size,
        max_tokens,
        sampling,
        seed,
        name_prompts,
        prompt_progress,
    ) -> Iterator[tuple[int, GenerationResult]]:
        generator = self.batch_generator(
            speculative=speculative, max_batch_size=batch_size, prompt_progress=prompt_progress
        )
        generator.check_options(max_tokens, seed)
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.prompt_ids(prompt))
            except (TypeError, ValueError) as error:
                if not name_prompts:
                    raise
                raise type(error)(f"prompt {i}: {error}") from None
        index = {}
        for i in longest_first(ids, SORT_WINDOW * batch_size):
            uid = generator.insert(ids[i], max_tokens=max_tokens, sampling=sampling, seed=seed)
            index[uid] = i
        return ((index[uid], result) for events in iter_rounds(generator) for uid, result in events)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        speculative: bool = True,
        max_tokens: int = 100,
        temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        prompt_progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[GenerationResult]:
        """Decode ``prompt`` and yield the running result after every
        main-model pass (a new object each time): a batch of one.
        ``prompt_progress`` as for ``stream_batch``."""
        events = self._stream(
            [prompt],
            speculative=speculative,
            batch_size=1,
            max_tokens=max_tokens,
            sampling=Sampling(temp, top_p, top_k),
            seed=seed,
            name_prompts=False,
            prompt_progress=prompt_progress,
        )
        return (result for _, result in events)

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Regular decoding with the main model alone. Takes the keyword
        arguments of ``stream``: max_tokens, temp, top_p, top_k, seed."""
        return _last(self.stream(prompt, speculative=False, **kwargs))

    def speculative_decode(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Speculative decoding; same arguments as ``generate``."""
        return _last(self.stream(prompt, speculative=True, **kwargs))

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **kwargs
    ) -> list[GenerationResult]:
        """Regular decoding of every prompt, ``batch_size`` at a time;
        results in input order. Takes the keyword arguments of ``stream``."""
        return _finished(
            self.stream_batch(prompts, speculative=False, batch_size=batch_size, **kwargs)
        )

    def speculative_decode_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **kwargs
    ) -> list[GenerationResult]:
        """Speculative decoding of every prompt; same arguments as ``generate_batch``."""
        return _finished(
            self.stream_batch(prompts, speculative=True, batch_size=batch_size, **kwargs)
        )


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


def _last(results: Iterator[GenerationResult]) -> GenerationResult:
    result = None
    for result in results:
        pass
    return result


def _finished(results: Iterator[tuple[int, GenerationResult]]) -> list[GenerationResult]:
    """The finished results of ``stream_batch``, in input order."""
    finished = {index: result for index, result in results if result.finished}
    return [finished[index] for index in sorted(finished)]
