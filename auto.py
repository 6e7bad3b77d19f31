"""``--num-draft auto``: the draft length with the most expected tokens per
second, chosen before every round, and all that it measures to choose it.

The cost model (``best_num_draft``) weighs the tokens a round of g draft
tokens is expected to yield, from the acceptance measured at each draft
position (``AutoDraftLength``), against what such a round costs relative
to a plain step: calibrated once per decoder and batch size
(``Auto.measure_costs``, ``pass_times``), then corrected by the rounds the
loop timed (``RoundTimes``). What the choices deliver is judged too
(``Deliveries``), and drafting vetoed where it was measured not to pay. A
lazy draft model starts only when auto first drafts, and what starting it
costs weighs on that choice (``DraftStart``). ``Auto``, one per decoder,
keeps what outlasts a batch: calibrated costs, acceptance, round times and
verdicts.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# First: the fast BLAS on Linux must load before mlx (see model.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from cache import DecoderCache
from drafting import Draft, Drafter, ModelDrafter
from model import T5, ModelArgs
from sampling import RowSampling, Sampling

# The most draft tokens "auto" proposes per round.
MAX_AUTO_DRAFT = 16
# Every this many rounds "auto" drafts one token more than it judges best,
# or in turn (when it drafts) none: so that it keeps testing the position
# past its choice, and timing plain rounds (see AutoDraftLength).
PROBE_EVERY = 8
# A probe drafts one token more only where a longer draft would pay were
# the next this many tokens tested at each position all accepted; where
# even that would not pay, only every HOPELESS_PROBE_EVERY rounds (a
# multiple of 2 * PROBE_EVERY): often enough to notice costs or acceptance
# that changed, too rarely to cost much.
PROBE_OPTIMISM = 4
HOPELESS_PROBE_EVERY = 64
# While it drafts, every this many rounds (a multiple of 2 * PROBE_EVERY)
# the probe is a plain step instead, so that plain rounds stay timed. Rare,
# because where drafting pays each costs what it does not deliver
# (docs/benchmarks.md, 2026-11-27).
PLAIN_PROBE_EVERY = 8 * PROBE_EVERY
# "auto" weighs the median time of the last this many rounds of each length.
TIMED_ROUNDS = 9
# Before a generation's first tested draft token at a given position, "auto"
# assumes this acceptance rate there, weighted as this many tested tokens.
PRIOR_ACCEPTANCE = 0.75
PRIOR_WEIGHT = 4
# Rounds timed over more rows stand in for the batch's own only up to this
# factor of it, and over fewer rows never: a round's cost relative to a plain
# step grows with the rows, so that fewer rows' timings understate it
# (docs/benchmarks.md, 2026-11-25 and 2026-11-26).
NEAREST_ROWS_RATIO = 1.5
# "auto" judges its choices by the tokens they deliver (``Deliveries``): per
# bucket of batch sizes (``rows_bucket``), the seconds and tokens of the last
# JUDGED_WINDOW rounds that drafted and of those that did not. A bucket is
# judged once JUDGED_ROUNDS rounds drafted, and a trial of drafting where it
# lost is that many rounds: over fewer, the draft model's start, paid by the
# first drafted round, weighs too much (docs/benchmarks.md, 2026-11-28).
JUDGED_ROUNDS = 8
JUDGED_WINDOW = 32
# Drafting is vetoed where its seconds per token exceed plain steps' by more
# than this many standard errors of the difference: a drafted round's tokens
# vary from 1 to g + 1, so that the mean of a few rounds is too noisy to
# judge by alone (docs/how-it-works.md). One error is enough: where drafting
# pays much its mean is many errors ahead either way, and where it is close
# a wrong veto costs little, while a wider margin keeps drafting where it
# loses (docs/benchmarks.md, 2026-11-27).
VETO_ERRORS = 1.0
# Plain steps first in a bucket not yet judged, to judge drafting against.
PLAIN_FIRST = 4
# Where drafting lost, the plain time to run before the next trial is what
# the last one lost over this share: trials cost at most this share of the
# time where drafting never pays.
EXPLORATION_SHARE = 0.02
DRAFT_SOURCES = ("model", "lookup")
# After a drafted round the draft model's cache lacks at most this many of
# a row's tokens: the last draft token and the main model's own.
STEADY_CATCH_UP = 2


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
        draft = drafter.propose(
            sequences, greedy, lambda source: length - 1, [length - 1] * batch_size
        )
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


def best_num_draft(
    acceptance: np.ndarray, round_costs: list[float], start_cost: float = 0.0
) -> int:
    """The g in 0 .. len(round_costs) - 1 with the most expected tokens per
    unit of time. ``acceptance[i]`` is the probability that draft token i + 1
    is accepted once the tokens before it were, so a round of g yields
    ``1 + a_1 + a_1 a_2 + ... + a_1 ... a_g`` tokens (eq. 1 when every a_i is
    the same alpha); with one such row of rates per row of a batch, the
    batch's mean. The round costs ``round_costs[g]``: the time of a round
    that drafts g tokens and verifies them in a main pass over g + 1,
    relative to a plain main-model step (``round_costs[0] == 1``). g = 0 is
    that plain step, one token per pass: the choice when drafting does not
    pay. ``start_cost``: plain steps per token that drafting costs besides
    its rounds (starting the draft model, see ``DraftLength.choose``)."""
    rates = np.atleast_2d(acceptance)[:, : len(round_costs) - 1]
    reach = np.cumprod(rates, axis=1)  # a_1 ... a_i
    # Index g: the tokens a round of g draft tokens yields, per row.
    tokens = 1 + np.concatenate([np.zeros((len(rates), 1)), np.cumsum(reach, axis=1)], axis=1)
    per_round = tokens.mean(axis=0)
    costs = [cost + (start_cost * per_round[g] if g else 0.0) for g, cost in enumerate(round_costs)]
    return max(range(len(round_costs)), key=lambda g: per_round[g] / costs[g])


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
    batch, decide whether drafting pays (docs/benchmarks.md, 2026-11-26)."""
    return start_seconds / tokens_left / (plain_seconds / rows)


def acceptance_counts() -> dict[str, np.ndarray]:
    """For each draft source, zero [accepted, tested] counts per draft position."""
    return {source: np.zeros((2, MAX_AUTO_DRAFT)) for source in DRAFT_SOURCES}


def round_source(draft: Draft) -> str:
    """The kind of round that drafted ``draft``: "plain" when no row drafted,
    "model" when any row drafted from the model (its draft steps cost the
    round most), else "lookup"."""
    sources = {source for source, length in zip(draft.sources, draft.lengths) if length}
    if not sources:
        return "plain"
    return "model" if "model" in sources else "lookup"


class RoundTimes:
    """The seconds that rounds of each draft source, draft length and number
    of rows took, as the loop ran them: the last ``TIMED_ROUNDS`` of each.
    They correct what the calibration (``pass_times``) measured: a few
    rounds on rows of one prompt, which is noisy and leaves out what rounds
    of real rows pay besides. Rounds compare only at the same number of
    rows: a batch whose prompts are finishing runs faster with every row it
    drops. Rows that no plain and drafted rounds were both timed over (a
    batch's last rounds, as its prompts finish) take the timings of the
    fewest more rows, up to ``NEAREST_ROWS_RATIO`` times their number."""

    def __init__(self):
        # Per number of rows, per (source or "plain", draft length): seconds.
        self.seconds: dict[int, dict[tuple[str, int], deque[float]]] = {}

    def record(self, source: str, num_draft: int, batch_size: int, seconds: float) -> None:
        """A round over ``batch_size`` rows drafting up to ``num_draft`` tokens
        per row from ``source`` (``round_source``) took ``seconds``."""
        kind = ("plain", 0) if source == "plain" else (source, num_draft)
        rounds = self.seconds.setdefault(batch_size, {})
        rounds.setdefault(kind, deque(maxlen=TIMED_ROUNDS)).append(seconds)

    def costs(self, source: str, calibrated: list[float], batch_size: int) -> list[float]:
        """``calibrated`` round costs of ``source`` (see ``best_num_draft``)
        corrected by the rounds timed over ``batch_size`` rows, or the
        fewest more rows (up to ``NEAREST_ROWS_RATIO`` times as many) that
        both plain and drafted rounds were timed over: what each length
        costs over a plain step, as calibrated, times one factor, the least
        squares fit (weighted by rounds timed) to the timed lengths' median
        over that of plain rounds. One factor for all lengths: a length's
        own median over a few rounds is noisy enough to steer auto to the
        wrong g (docs/how-it-works.md). Calibrated as they are until both
        were timed."""
        timed = [
            rows
            for rows, rounds in self.seconds.items()
            if ("plain", 0) in rounds
            and any(kind[0] == source for kind in rounds)
            and batch_size <= rows <= NEAREST_ROWS_RATIO * batch_size
        ]
        if not timed:
            return calibrated
        rounds = self.seconds[min(timed)]
        plain = statistics.median(rounds["plain", 0])
        measured = {
            num_draft: statistics.median(times) / plain
            for (kind, num_draft), times in rounds.items()
            if kind == source
        }
        weights = np.array([len(rounds[source, num_draft]) for num_draft in measured])
        extra_measured = np.array(list(measured.values())) - 1
        extra_calibrated = np.array([calibrated[num_draft] for num_draft in measured]) - 1
        denominator = np.sum(weights * extra_calibrated**2)
        if denominator <= 0:
            return calibrated
        scale = np.sum(weights * extra_measured * extra_calibrated) / denominator
        return [1.0 + scale * (cost - 1) for cost in calibrated]


def rows_bucket(batch_size: int) -> int:
    """The bucket of batch sizes whose rounds ``Deliveries`` compares:
    ceil(2 log2(rows)), half an octave wide with a power of two at its top
    (1; 2; 3-4; 5; 6-8; 9-11; 12-16; 17-22; 23-32; ...), so that a batch of
    B whose rows finish is judged at B's size until it has dropped to 0.7 B."""
    return int(np.ceil(2 * np.log2(batch_size)))


def seconds_per_token(rounds: deque[tuple[float, int]]) -> tuple[float, float]:
    """Seconds per delivered token over ``rounds`` of (seconds, tokens), and
    its standard error (a ratio of sums: from the spread of each round's
    seconds less the ratio times its tokens)."""
    if not rounds:
        return 0.0, 0.0
    seconds, tokens = np.array(rounds, dtype=float).T
    ratio = seconds.sum() / max(tokens.sum(), 1)
    if len(rounds) < 2:
        return ratio, 0.0
    residuals = seconds - ratio * tokens
    variance = len(rounds) * np.sum(residuals**2) / (len(rounds) - 1)
    return ratio, float(np.sqrt(variance) / max(tokens.sum(), 1))


@dataclass
class Verdict:
    """What the rounds over one bucket of batch sizes delivered, and whether
    drafting there is vetoed: see ``Deliveries``."""

    # (seconds, tokens) of the last JUDGED_WINDOW rounds that drafted nothing, and that drafted.
    plain: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=JUDGED_WINDOW))
    drafted: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=JUDGED_WINDOW))
    vetoed: bool = False
    trial: int = 0  # drafted rounds left of a trial of drafting, while vetoed
    wait: float = 0.0  # plain seconds to run before the next trial, while vetoed
    # Seconds and tokens of the drafted rounds since the last trial began (or the first).
    explored: tuple[float, int] = (0.0, 0)

    def judge(self) -> None:
        """Veto drafting if its rounds delivered fewer tokens per second than
        plain ones, by more than VETO_ERRORS standard errors (once both
        were measured), and then wait, before the next trial, for plain
        rounds of the time the rounds drafted since the last trial began
        lost over EXPLORATION_SHARE."""
        if len(self.plain) < PLAIN_FIRST or len(self.drafted) < JUDGED_ROUNDS:
            return
        plain, plain_error = seconds_per_token(self.plain)
        drafted, drafted_error = seconds_per_token(self.drafted)
        self.vetoed = drafted - plain > VETO_ERRORS * np.hypot(plain_error, drafted_error)
        if self.vetoed:
            seconds, tokens = self.explored
            self.wait = (seconds - tokens * plain) / EXPLORATION_SHARE
            self.explored = (0.0, 0)


class Deliveries:
    """auto's choices judged by what they deliver: the wall-clock seconds
    per token delivered of the loop's rounds that drafted against those
    that did not, at the batch's size (``rows_bucket``). A round's seconds
    are all that the loop waits for from the round's start to its tokens
    (the draft model's encoding of the rows' prompts when it starts, and its
    catch-up passes, included), so the same on a backend that computes
    lazily (MLX on a GPU) as on one whose passes end when they return; only
    what every mode pays about alike is left out (the encoding of joining
    prompts, the main model's and, once it has started, the draft model's,
    which is a small share of it; and auto's calibration).

    A bucket not yet judged first takes PLAIN_FIRST plain steps, so that
    drafting is judged against plain steps of the same rows; then the cost
    model (``DraftLength.choose``) decides, and once JUDGED_ROUNDS rounds
    drafted, every round is judged by the last JUDGED_WINDOW of each kind:
    where drafted rounds delivered fewer tokens per second than plain ones,
    by more than VETO_ERRORS standard errors of the difference (a drafted
    round's tokens vary with its acceptance), drafting is vetoed (the draft
    model dropped: see ``ModelDrafter.suspend``). Conditions change
    (acceptance, rows, the machine's load), so a vetoed bucket tries
    drafting again, after plain rounds that ran the time the last trial
    lost over EXPLORATION_SHARE, for JUDGED_ROUNDS drafted rounds (the cost
    model may choose plain steps meanwhile), judged on their own; kept up
    if they do not lose, vetoed again if they do."""

    def __init__(self):
        self.verdicts: dict[int, Verdict] = {}  # per rows_bucket

    def allows_drafting(self, batch_size: int) -> bool:
        """Whether a round over ``batch_size`` rows may draft."""
        verdict = self.verdicts.get(rows_bucket(batch_size), Verdict())
        if len(verdict.plain) < PLAIN_FIRST:
            return False
        return not verdict.vetoed or verdict.trial > 0

    def vetoes(self, batch_size: int) -> bool:
        """Whether drafting over ``batch_size`` rows was measured not to pay
        (and no trial runs)."""
        verdict = self.verdicts.get(rows_bucket(batch_size), Verdict())
        return verdict.vetoed and not verdict.trial

    def record(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A round over ``batch_size`` rows, which drafted or not, delivered
        ``tokens`` in ``seconds``."""
        verdict = self.verdicts.setdefault(rows_bucket(batch_size), Verdict())
        if drafted:
            verdict.drafted.append((seconds, tokens))
            explored_seconds, explored_tokens = verdict.explored
            verdict.explored = (explored_seconds + seconds, explored_tokens + tokens)
        else:
            verdict.plain.append((seconds, tokens))
        if not verdict.vetoed:
            verdict.judge()
        elif verdict.trial:  # counted in drafted rounds: the cost model may choose plain steps
            verdict.trial -= drafted
            if not verdict.trial:
                verdict.judge()
        else:
            verdict.wait -= seconds
            if verdict.wait <= 0:  # a trial, judged by its own rounds
                verdict.trial = JUDGED_ROUNDS
                verdict.drafted.clear()


class AutoDraftLength:
    """Draft tokens per round for ``"auto"``: the g that
    ``best_num_draft`` picks from the round costs and the acceptance so far,
    kept apart for each draft source and each position in the draft:
    acceptance is not independent from token to token (a draft that got past
    its first tokens tends to go on agreeing), so one rate for all positions
    misjudges long drafts.

    One g serves every row of a batch: the rows share the pair and so its
    acceptance, and a verify pass costs what its longest row costs, so a
    row drafting fewer tokens than the others would save nothing.

    Every PROBE_EVERY-th round it drafts one token more than its choice: a
    rate moves only where tokens are tested, so without that a position
    that an unlucky start made look poor (or a draft that stopped paying
    for itself, at g = 0) would never be drafted, and so never corrected,
    again. It does so while a longer draft would pay were the next
    PROBE_OPTIMISM tokens tested at each position accepted (spread over a
    batch's rows: see ``rates``); once the tests
    leave no such hope (or the rounds' costs leave none, as at 32 rows of
    the benchmark pair), only every HOPELESS_PROBE_EVERY rounds. When it
    drafts, every PLAIN_PROBE_EVERY-th round, starting with the first
    probe, is a plain step instead: ``times`` measures drafted rounds
    against plain ones, so it needs both.

    ``earlier`` holds, per source, the [accepted, tested] counts per position
    of the decoder's earlier generations, and is updated too. This
    generation starts from their rate (itself starting from the prior),
    weighted as PRIOR_WEIGHT tokens, so its own rounds soon outweigh it.
    ``times`` (``RoundTimes``, shared with the decoder's earlier generations
    drafting the same way) holds what rounds took.

    All of that weighs rounds; ``deliveries`` (``Deliveries``, shared with
    the decoder's earlier generations drafting the same way) judges what
    the choices delivered, everything included, and vetoes drafting where
    it was measured not to pay (``allows_drafting``)."""

    def __init__(
        self,
        round_costs: dict[str, list[float]],
        earlier: dict[str, np.ndarray] | None = None,
        times: RoundTimes | None = None,
        deliveries: Deliveries | None = None,
        start: DraftStart | None = None,
        calibration_seconds: float = 0.0,
    ):
        self.round_costs = round_costs  # per source, calibrated: see best_num_draft
        self.times = RoundTimes() if times is None else times
        self.deliveries = Deliveries() if deliveries is None else deliveries
        self.earlier = acceptance_counts() if earlier is None else earlier
        self.counts = {}  # per source: [accepted, tested] per position, prior included
        for source, (accepted, tested) in self.earlier.items():
            rate = (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tested + PRIOR_WEIGHT)
            self.counts[source] = np.stack([rate * PRIOR_WEIGHT, np.full_like(rate, PRIOR_WEIGHT)])
        self.rounds = dict.fromkeys(DRAFT_SOURCES, 0)  # rounds "auto" chose a length for
        self.row_counts: dict[int, dict[str, np.ndarray]] = {}  # per row uid: see choose
        self.start = start  # what starting a lazy draft model costs; None: nothing to start
        self.calibration_seconds = calibration_seconds

    def plan(self, rows: list, limits: list[int], drafter: Drafter) -> Callable[[str], int] | None:
        """The draft length of the next round over ``rows`` (the scheduler's,
        ``row.result`` None for a free place) for each source, or None for a
        plain step: where ``deliveries`` does not allow drafting, and then,
        where drafting was measured not to pay, with the draft model dropped."""
        if not self.deliveries.allows_drafting(len(rows)):
            if self.deliveries.vetoes(len(rows)):
                drafter.suspend()
            return None
        self.row_counts = {
            row.uid: self.row_counts.get(row.uid) or acceptance_counts()
            for row in rows
            if row.result is not None
        }
        drafting = [self.row_counts[row.uid] for row, limit in zip(rows, limits) if limit > 0]
        start_cost = 0.0
        if self.start is not None and drafter.start_pending:
            start_cost = self.start.cost(rows, limits, self.times)
        return functools.partial(
            self.choose, batch_size=len(rows), rows=drafting, start_cost=start_cost
        )

    def observe(self, rows: list, outcome, round_seconds: float, delivered_seconds: float) -> None:
        """What a round over ``rows`` gave (``outcome``, a ``decoder.RoundOutcome``): the draft tokens each
        row had tested and accepted; ``round_seconds``, its time from its
        drafting to its results; ``delivered_seconds``, all the loop waited
        for its tokens (see ``Deliveries``)."""
        draft = outcome.draft
        for row, length, source, accepted, rejected in zip(
            rows, draft.lengths, draft.sources, outcome.accepted, outcome.rejected
        ):
            if row.result is not None and length > 0:
                counts = self.row_counts.setdefault(row.uid, acceptance_counts())
                self.update(source, accepted, accepted + int(rejected), counts)
        self.timed(draft, round_seconds)
        delivered = sum(len(tokens) for tokens in outcome.new_tokens)
        self.deliveries.record(len(rows), any(draft.lengths), delivered, delivered_seconds)

    def choose(
        self,
        source: str,
        batch_size: int = 1,
        rows: list[dict[str, np.ndarray]] | None = None,
        start_cost: float = 0.0,
    ) -> int:
        """Draft tokens for the next round from ``source``, over ``batch_size``
        rows; 0: a plain step. ``rows``: the counts (``acceptance_counts``)
        of each row that may draft, which ``update`` keeps. A row's rates
        start from those of every other row (and the prior), weighted as
        PRIOR_WEIGHT tokens, so a row that the draft keeps failing (a prompt
        unlike the others) soon weighs as it is, not as the batch's mean;
        a row alone has the generation's rates. ``start_cost``: what
        starting the draft model would cost, in plain steps per token the
        rows have left (see ``draft_start_cost``); model drafts only."""
        costs = self.times.costs(source, self.round_costs[source], batch_size)
        start_cost = start_cost if source == "model" else 0.0
        num_draft = best_num_draft(self.rates(source, rows), costs, start_cost)
        self.rounds[source] += 1
        if self.rounds[source] % PROBE_EVERY:
            return num_draft
        if num_draft > 0 and self.rounds[source] % PLAIN_PROBE_EVERY == PROBE_EVERY:
            return 0
        hopeful = self.rates(source, rows, luck=PROBE_OPTIMISM)
        # The rare probe without hope, but not one that would start the draft
        # model: that cost is what it weighs.
        if best_num_draft(hopeful, costs, start_cost) > num_draft or (
            self.rounds[source] % HOPELESS_PROBE_EVERY == 0 and not start_cost
        ):
            return min(num_draft + 1, MAX_AUTO_DRAFT)
        return num_draft

    def rates(
        self, source: str, rows: list[dict[str, np.ndarray]] | None = None, luck: int = 0
    ) -> np.ndarray:
        """The acceptance rate at each draft position of ``source``: the
        generation's, or one row of them for each of ``rows`` (see
        ``choose``). With ``luck``, as if the next ``luck`` tokens tested at
        each position were accepted, spread over the rows: a batch's probe
        tests a token in every row, and a row of many, each just joined
        with its 4-token prior from the others, would otherwise make a
        large batch hopeful all the time."""
        accepted, tested = self.counts[source]
        if not rows:
            return (accepted + luck) / (tested + luck)
        row_accepted, row_tested = np.stack([row[source] for row in rows], axis=1)
        others = (accepted - row_accepted) / (tested - row_tested)
        row_luck = luck / len(rows)
        return (row_accepted + others * PRIOR_WEIGHT + row_luck) / (
            row_tested + PRIOR_WEIGHT + row_luck
        )

    def update(
        self,
        source: str,
        num_accepted: int,
        num_tested: int,
        row: dict[str, np.ndarray] | None = None,
    ) -> None:
        """A round tested the first ``num_tested`` draft tokens of a row and
        accepted the first ``num_accepted`` of them; ``row``: that row's own
        counts (see ``choose``)."""
        counts = [self.counts[source], self.earlier[source]]
        if row is not None:
            counts.append(row[source])
        for array in counts:
            array[0, :num_accepted] += 1
            array[1, :num_tested] += 1

    def timed(self, draft: Draft, seconds: float) -> None:
        """A round that drafted ``draft`` took ``seconds``, from its drafting
        to its results. Not when the draft model first caught up on the
        tokens of plain steps (more than ``STEADY_CATCH_UP`` in a row):
        that is paid once per return to drafting, not by every drafted round."""
        if draft.caught_up <= STEADY_CATCH_UP:
            batch_size = len(draft.lengths)
            self.times.record(round_source(draft), max(draft.lengths), batch_size, seconds)


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

    def cost(self, rows: list, limits: list[int], times: RoundTimes) -> float:
        """The start's cost over the tokens ``rows`` have left, in plain steps
        over the fewest rows at least as many as the batch's that a plain
        step was timed (``times``) or calibrated over; 0 with none."""
        timed = times.seconds
        timed_plain = {n for n, rounds in timed.items() if ("plain", 0) in rounds}
        known = [n for n in timed_plain | self.plain_step_seconds.keys() if n >= len(rows)]
        if not known:
            return 0.0
        nearest = min(known)
        if nearest in timed_plain:  # the loop's own timings before the calibration's
            plain = statistics.median(timed[nearest]["plain", 0])
        else:
            plain = self.plain_step_seconds[nearest]
        live = [row for row in rows if row.result is not None]
        prompt_tokens = sum(row.result.prompt_tokens for row in live)
        prompt_seconds = sum(row.result.prompt_time for row in live)
        seconds_per_work = prompt_seconds / (self.main_args.prompt_work * prompt_tokens)
        # The catch-up pass is padded to the longest row's tokens.
        catch_up = len(live) * max(len(row.sequence) for row in live)
        work = self.draft_args.prompt_work * prompt_tokens + self.draft_args.decode_work * catch_up
        tokens_left = sum(limit + 1 for limit in limits if limit > 0)
        return draft_start_cost(seconds_per_work * work, tokens_left, plain, len(live))


class Auto:
    """What "auto" measured for a decoder, kept from batch to batch, and the
    rule it gives each batch (``for_batch``). A decoder's draft model,
    lookup and delta may change between batches (the benchmarks change
    them): what it keeps is kept apart for each."""

    def __init__(self):
        self.costs = {}  # round costs per source, draft model and batch size: see measure_costs
        # Per batch size, the seconds of a plain step measure_costs timed.
        self.plain_step_seconds: dict[int, float] = {}
        self.acceptance = {}  # per way of drafting: see AutoDraftLength
        self.round_times = {}  # per way of drafting: see RoundTimes
        self.deliveries = {}  # per way of drafting: see Deliveries

    def for_batch(
        self,
        model: T5,
        draft_model: T5 | None,
        prompt_lookup: int,
        delta: float,
        prompt_ids: Sequence[int],
        sampling: Sampling,
        batch_size: int,
    ) -> AutoDraftLength:
        """The rule for a batch of ``model``'s drafted by ``draft_model`` (or
        None) and lookup of n-grams up to ``prompt_lookup`` tokens (0: none),
        accepting with ``delta``, whose first prompt is ``prompt_ids``,
        sampled by ``sampling``, its costs weighed at ``batch_size`` rows
        (measured now if not yet)."""
        tic = time.perf_counter()
        costs = self.measure_costs(model, draft_model, prompt_lookup, prompt_ids, batch_size)
        # Acceptance depends on the pair, how lookup matches, sampling and delta;
        # round times on the pair, how lookup matches and whether rows sample.
        drafting = id(draft_model), prompt_lookup
        way = (*drafting, sampling, delta)
        earlier = self.acceptance.setdefault(way, acceptance_counts())
        times = self.round_times.setdefault((*drafting, sampling.greedy), RoundTimes())
        # What choices deliver depends on acceptance and round times alike.
        deliveries = self.deliveries.setdefault(way, Deliveries())
        start = None
        if draft_model is not None:
            start = DraftStart(model.args, draft_model.args, self.plain_step_seconds)
        seconds = time.perf_counter() - tic
        return AutoDraftLength(costs, earlier, times, deliveries, start, seconds)

    def measure_costs(
        self,
        model: T5,
        draft_model: T5 | None,
        prompt_lookup: int,
        prompt_ids: Sequence[int],
        batch_size: int = 1,
    ) -> dict[str, list[float]]:
        """What "auto" weighs at ``batch_size`` rows, for each draft source
        (``draft_model``, lookup): the time of a round drafting g = 0 ..
        MAX_AUTO_DRAFT tokens per row and verifying them, over that of a
        plain step of ``model``, timed on ``prompt_ids`` once per draft
        model and batch size. A model's draft tokens are timed in the
        round, between main passes, because drafting there costs more than
        drafting alone (see docs/how-it-works.md). Looking up draft tokens
        costs next to nothing, so a lookup round costs its verify pass."""
        prompt_ids = list(prompt_ids)
        sources = ["model"] if draft_model is not None else []
        sources += ["lookup"] if prompt_lookup else []
        costs, encoder_output = {}, None
        for source in sources:
            key = source, id(draft_model) if source == "model" else None, batch_size
            if key not in self.costs:
                drafter = None
                if source == "model":
                    drafter = ModelDrafter(draft_model, [prompt_ids] * batch_size)
                if encoder_output is None:  # once for both sources of hybrid drafting
                    encoder_output = model.encode(mx.array([prompt_ids]))
                times = pass_times(model, encoder_output, MAX_AUTO_DRAFT + 1, batch_size, drafter)
                self.costs[key] = [t / times[0] for t in times]
                self.plain_step_seconds[batch_size] = times[0]
            costs[source] = self.costs[key]
        return costs
