"""``--num-draft auto``: before every round, the draft length with the most
expected tokens per unit of time.

The rule (``best_num_draft``) is the paper's: a round of g draft tokens
yields ``(1 - a^(g+1)) / (1 - a)`` tokens, ``a`` the rate at which the main
model accepted the draft tokens it tested so far, and costs ``r(g)`` plain
steps. ``r(g)`` is timed once per decoder and batch size
(``Auto.measure_costs``, ``pass_times``) on a bounded piece of the first
prompt. The draft model is lazy under auto: it encodes the rows' prompts
only when auto first drafts, and what starting it costs weighs on that
choice (``DraftStart``). ``docs/how-it-works.md`` says why each part is
there, with what it was measured to add.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from cache import DecoderCache
from drafting import DRAFT_SOURCES, Drafter, ModelDrafter, RowState, Tested
from model import T5, ModelArgs
from sampling import RowSampling, Sampling

# The most draft tokens "auto" proposes per round.
MAX_AUTO_DRAFT = 16
# Before a batch's first tested draft token, "auto" assumes this acceptance
# rate, weighted as this many tested tokens.
PRIOR_ACCEPTANCE = 0.75
PRIOR_WEIGHT = 4
# The calibration times passes over at most this many tokens of the first
# prompt, so that its cost does not grow with the prompt: a pass's cost
# over that of a plain step changes little with the keys it attends to.
CALIBRATION_PROMPT_TOKENS = 64


# Token counts per row at which ``pass_times`` times a pass. A pass's time
# grows smoothly with its width, linearly once the products are wide: it is
# interpolated in between and extrapolated past the last, since timing every
# width takes seconds at many rows (docs/how-it-works.md).
TIMED_PASS_LENGTHS = (1, 2, 3, 4, 6, 9)


def pass_times(
    model: T5,
    encoder_output: mx.array,
    max_length: int,
    batch_size: int = 1,
    drafter: ModelDrafter | None = None,
    repeats: int = 3,
) -> list[float]:
    """Median seconds of one decoder pass of ``model`` over ``batch_size``
    rows of 1 .. ``max_length`` tokens, after one cached token: timed at the
    ``TIMED_PASS_LENGTHS`` up to ``max_length``, in rounds so that drift hits
    every length, and interpolated (past the last, extrapolated) from them.

    With a ``drafter`` (for the same rows), each pass over n tokens is timed
    as a round runs it: the drafter proposes the n - 1 tokens the pass takes
    after the cached one (none for n = 1, a plain step).

    Passes over more tokens are timed on rows that end at different
    columns, as rows that accept different numbers of draft tokens do: their
    cache writes are a scatter, which costs more than the one write of even
    rows (docs/how-it-works.md). A plain step is timed on even rows, as
    regular decoding takes it."""
    lengths = [n for n in TIMED_PASS_LENGTHS if n <= max_length]
    start = mx.full((batch_size, 1), model.args.decoder_start_token_id)

    def cache_after(tokens: int) -> DecoderCache:
        cache = model.make_cache(mx.repeat(encoder_output, batch_size, axis=0))
        mx.eval(model.decode(mx.repeat(start, tokens, axis=1), cache))
        return cache

    even, uneven = cache_after(1), cache_after(2)
    uneven.trim([row % 2 for row in range(batch_size)])
    greedy = RowSampling([Sampling()] * batch_size)
    sequences = [[model.args.decoder_start_token_id]] * batch_size

    def pass_inputs(length: int) -> mx.array:
        if drafter is None or length == 1:
            return mx.repeat(start, length, axis=1)
        draft = drafter.propose(sequences, greedy, {"model": length - 1}, [length - 1] * batch_size)
        return mx.concatenate([start, draft.tokens], axis=1)

    times = [[] for _ in lengths]
    for _ in range(repeats):
        for i, length in enumerate(lengths):
            cache = even if length == 1 else uneven
            tic = time.perf_counter()
            mx.eval(model.decode(pass_inputs(length), cache))
            times[i].append(time.perf_counter() - tic)
            cache.trim(length)
    return piecewise_linear(lengths, [statistics.median(t) for t in times], max_length)


def piecewise_linear(lengths: list[int], values: list[float], max_length: int) -> list[float]:
    """Values at 1 .. ``max_length`` of the line through (``lengths[i]``,
    ``values[i]``), extended past the last point along the last segment."""
    widths = np.arange(1, max_length + 1)
    result = np.interp(widths, lengths, values)
    if len(lengths) > 1:
        slope = (values[-1] - values[-2]) / (lengths[-1] - lengths[-2])
        past = widths > lengths[-1]
        result[past] = values[-1] + slope * (widths[past] - lengths[-1])
    return result.tolist()


def expected_tokens_per_round(alpha: float, num_draft: int) -> float:
    """Leviathan et al., eq. 1: the expected tokens a round of ``num_draft``
    draft tokens yields when each is accepted with probability ``alpha``,
    ``(1 - alpha^(g+1)) / (1 - alpha)``."""
    if alpha >= 1:
        return num_draft + 1
    return (1 - alpha ** (num_draft + 1)) / (1 - alpha)


def best_num_draft(alpha: float, round_costs: list[float], start_cost: float = 0.0) -> int:
    """The g in 0 .. len(round_costs) - 1 with the most expected tokens per
    unit of time, when each draft token is accepted with probability
    ``alpha`` (``expected_tokens_per_round``) and a round of g costs
    ``round_costs[g]``: the time of a round that drafts g tokens and
    verifies them in a main pass over g + 1, relative to a plain main-model
    step (``round_costs[0] == 1``). g = 0 is that plain step, one token per
    pass: the choice when drafting does not pay. ``start_cost``: plain
    steps per token that drafting costs besides its rounds (starting the
    draft model, see ``DraftStart``)."""

    def tokens_per_step(g: int) -> float:
        tokens = expected_tokens_per_round(alpha, g)
        return tokens / (round_costs[g] + (start_cost * tokens if g else 0.0))

    return max(range(len(round_costs)), key=tokens_per_step)


def draft_start_cost(
    start_seconds: float, tokens_left: int, plain_seconds: float, rows: int
) -> float:
    """What starting a lazy draft model costs, in plain steps per token:
    ``start_seconds`` to encode its rows' prompts and catch its cache up on
    their tokens so far, spread over the ``tokens_left`` that ``rows`` rows
    may still generate, a plain step over them taking ``plain_seconds``.
    Drafting must beat a plain step by that much to pay for it: where a
    drafted round's tokens are worth about what it costs (many rows), the
    draft model's encoding, and a catch-up pass for a start late in a
    batch, decide whether drafting pays (docs/benchmark-log.md, 2026-11-26)."""
    return start_seconds / tokens_left / (plain_seconds / rows)


class AutoDraftLength:
    """Draft tokens per round for ``"auto"``: the g that ``best_num_draft``
    picks from the calibrated round costs and the acceptance so far, kept
    apart for each draft source.

    One g serves every row of a batch: the rows share the pair and so its
    acceptance, and a verify pass costs what its longest row costs, so a
    row drafting fewer tokens than the others would save nothing. The rate
    moves only where tokens are tested: once auto chooses g = 0 (drafting
    does not pay at the batch's rate and costs) it stays there for the
    batch; the next batch starts from the prior."""

    def __init__(
        self,
        round_costs: dict[int, dict[str, list[float]]],
        start: DraftStart | None = None,
        calibration_seconds: float = 0.0,
    ):
        # Per number of rows calibrated, per source: see best_num_draft.
        self.round_costs = round_costs
        self.calibrated_rows = sorted(round_costs)
        # Per source: draft tokens [accepted, tested], the prior's included.
        self.counts = {
            source: [PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_WEIGHT] for source in DRAFT_SOURCES
        }
        self.start = start  # what starting a lazy draft model costs; None: nothing to start
        self.calibration_seconds = calibration_seconds

    def plan(self, rows: list[RowState], limits: list[int], drafter: Drafter) -> dict[str, int]:
        """The draft length of the next round over ``rows`` for each source
        (0 for a source not calibrated: the decoder has none of it)."""
        start_cost = 0.0
        if self.start is not None and drafter.start_pending:
            start_cost = self.start.cost(rows, limits)
        calibrated = self.round_costs[self.calibrated_rows[0]]
        return {
            source: self.choose(source, len(rows), start_cost) if source in calibrated else 0
            for source in DRAFT_SOURCES
        }

    def observe(self, rows: list[RowState], outcome: Tested) -> None:
        """What a round over ``rows`` gave: the draft tokens each live row
        had tested and accepted."""
        draft = outcome.draft
        for row, length, source, accepted, rejected in zip(
            rows, draft.lengths, draft.sources, outcome.accepted, outcome.rejected
        ):
            if row.live and length > 0:
                self.update(source, accepted, accepted + int(rejected))

    def choose(self, source: str, batch_size: int = 1, start_cost: float = 0.0) -> int:
        """Draft tokens for the next round from ``source`` over ``batch_size``
        rows, weighed by the costs calibrated at the fewest rows at least
        as many (or the most); 0: a plain step. ``start_cost``: what
        starting the draft model would cost, in plain steps per token the
        rows have left (see ``draft_start_cost``); model drafts only."""
        rows = next((n for n in self.calibrated_rows if n >= batch_size), self.calibrated_rows[-1])
        start_cost = start_cost if source == "model" else 0.0
        return best_num_draft(self.rate(source), self.round_costs[rows][source], start_cost)

    def rate(self, source: str) -> float:
        """The share of ``source``'s tested draft tokens accepted, the prior's included."""
        accepted, tested = self.counts[source]
        return accepted / tested

    def update(self, source: str, num_accepted: int, num_tested: int) -> None:
        """A round tested ``num_tested`` draft tokens of a row and accepted
        ``num_accepted`` of them."""
        self.counts[source][0] += num_accepted
        self.counts[source][1] += num_tested


@dataclass
class DraftStart:
    """What starting a lazy draft model costs a batch: its encoding of the
    rows' prompts, then a pass that catches its cache up on every token the
    rows generated so far (``draft_start_cost``), estimated from the main
    model's prompt time per multiply-add and the draft model's
    ``prompt_work`` and ``decode_work``."""

    main_args: ModelArgs
    draft_args: ModelArgs
    plain_step_seconds: dict[int, float]  # calibrated, per number of rows

    def cost(self, rows: list[RowState], limits: list[int]) -> float:
        """The start's cost over the tokens ``rows`` have left, in plain steps
        over the fewest rows at least as many as the batch's that a plain
        step was calibrated over; 0 with none."""
        known = [n for n in self.plain_step_seconds if n >= len(rows)]
        if not known:
            return 0.0
        plain = self.plain_step_seconds[min(known)]
        live = [row for row in rows if row.live]
        prompt_tokens = sum(row.prompt_tokens for row in live)
        prompt_seconds = sum(row.prompt_seconds for row in live)
        seconds_per_work = prompt_seconds / (self.main_args.prompt_work * prompt_tokens)
        # The catch-up pass is padded to the longest row's tokens.
        catch_up = len(live) * max(row.tokens for row in live)
        work = self.draft_args.prompt_work * prompt_tokens + self.draft_args.decode_work * catch_up
        tokens_left = sum(limit + 1 for limit in limits if limit > 0)
        return draft_start_cost(seconds_per_work * work, tokens_left, plain, len(live))


class Auto:
    """What "auto" calibrated for ``model`` drafted by ``draft_model`` (or
    None) and lookup of n-grams up to ``prompt_lookup`` tokens (0: none),
    kept from batch to batch, and the rule it gives each batch
    (``for_batch``)."""

    def __init__(self, model: T5, draft_model: T5 | None, prompt_lookup: int):
        self.model, self.draft_model = model, draft_model
        self.sources = ["model"] if draft_model is not None else []
        self.sources += ["lookup"] if prompt_lookup else []
        self.costs = {}  # round costs per source and batch size: see measure_costs
        # Per batch size, the seconds of a plain step measure_costs timed.
        self.plain_step_seconds: dict[int, float] = {}

    def for_batch(self, prompt_ids: Sequence[int], batch_sizes: Sequence[int]) -> AutoDraftLength:
        """The rule for a batch whose first prompt is ``prompt_ids``, its
        costs measured at each of ``batch_sizes`` rows (now, if not yet)."""
        tic = time.perf_counter()
        costs = {rows: self.measure_costs(prompt_ids, rows) for rows in batch_sizes}
        start = None
        if self.draft_model is not None:
            start = DraftStart(self.model.args, self.draft_model.args, self.plain_step_seconds)
        return AutoDraftLength(costs, start, time.perf_counter() - tic)

    def measure_costs(
        self, prompt_ids: Sequence[int], batch_size: int = 1
    ) -> dict[str, list[float]]:
        """What "auto" weighs at ``batch_size`` rows, for each draft source
        (the draft model, lookup): the time of a round drafting g = 0 ..
        MAX_AUTO_DRAFT tokens per row and verifying them, over that of a
        plain step of the main model, timed on the first
        ``CALIBRATION_PROMPT_TOKENS`` of ``prompt_ids`` once per batch size.
        A model's draft tokens are timed in the round, between main passes,
        because drafting there costs more than drafting alone (see
        docs/how-it-works.md). Looking up draft tokens costs next to
        nothing, so a lookup round costs its verify pass."""
        prompt_ids = list(prompt_ids)[:CALIBRATION_PROMPT_TOKENS]
        costs, encoder_output = {}, None
        for source in self.sources:
            key = source, batch_size
            if key not in self.costs:
                drafter = None
                if source == "model":
                    drafter = ModelDrafter(self.draft_model, [prompt_ids] * batch_size)
                if encoder_output is None:  # once for both sources of hybrid drafting
                    encoder_output = self.model.encode(mx.array([prompt_ids]))
                times = pass_times(
                    self.model, encoder_output, MAX_AUTO_DRAFT + 1, batch_size, drafter
                )
                self.costs[key] = [t / times[0] for t in times]
                self.plain_step_seconds[batch_size] = times[0]
            costs[source] = self.costs[key]
        return costs
