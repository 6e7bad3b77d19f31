"""Drafting modes: prompt lookup, hybrid and ``num_draft="auto"`` keep the main
model's greedy output; the auto rule's formula; ``from_draft``."""

from collections import Counter

import mlx.core as mx
import pytest
from fixtures import auto_costs, cheap_drafts, linear_round_costs, unjudged

from auto import (
    EXPLORATION_SHARE,
    HOPELESS_PROBE_EVERY,
    JUDGED_ROUNDS,
    JUDGED_WINDOW,
    MAX_AUTO_DRAFT,
    PLAIN_FIRST,
    PROBE_EVERY,
    STEADY_CATCH_UP,
    TIMED_ROUNDS,
    AutoDraftLength,
    Deliveries,
    RoundTimes,
    acceptance_counts,
    best_num_draft,
    draft_start_cost,
    expected_tokens_per_round,
    pass_times,
    piecewise_linear,
    rows_bucket,
)
from cache import compacted_rows
from decoder import SpeculativeDecoder
from drafting import Draft, FixedDraftLength, ModelDrafter, find_continuation
from sampling import RowSampling, Sampling

PROMPTS = [
    "restore: the house is small and the garden is green behind the old wall.",
    "restore: the children walked to the old market by the river in the morning.",
    "restore: where is the big red book? the book lies on the kitchen table.",
]
MAX_TOKENS = 40


class CopyingModel:
    """The main model, nudged to copy its prompt: at four output positions of
    five, the prompt token at that position gets a large logit bonus; at the
    fifth the model chooses alone. Its output copies long spans of the
    prompt but not all of it, as a restoring or correcting model does. It
    never ends a sequence, so every run fills max_tokens. The decoder sees
    only ``args``, ``prompt_cache`` (and its slices), ``decode`` and (measuring costs for
    auto) ``encode`` and ``make_cache``; one prompt at a time."""

    def __init__(self, model):
        self.model = model
        self.args = model.args

    def prompt_cache(self, prompts: list[list[int]], on_layer=None):
        (prompt,) = prompts
        self.source = mx.array(prompt[:-1])  # the prompt without its end of sequence
        return self.model.prompt_cache(prompts, on_layer)

    def prompt_cache_slices(self, prompts: list[list[int]], on_layer=None):
        (prompt,) = prompts
        self.source = mx.array(prompt[:-1])  # the prompt without its end of sequence
        return self.model.prompt_cache_slices(prompts, on_layer)

    def encode(self, prompt_ids: mx.array) -> mx.array:
        self.source = prompt_ids[0, :-1]  # the prompt without its end of sequence
        return self.model.encode(prompt_ids)

    def make_cache(self, encoder_output: mx.array):
        return self.model.make_cache(encoder_output)

    def decode(self, inputs: mx.array, cache) -> mx.array:
        positions = cache.offset + mx.arange(inputs.shape[1])
        logits = self.model.decode(inputs, cache)
        copied = self.source[positions % self.source.shape[0]]
        vocabulary = mx.arange(logits.shape[-1])
        bonus = (vocabulary == copied[:, None]) & (positions % 5 != 4)[:, None]
        return mx.where(vocabulary == self.args.eos_token_id, -mx.inf, logits + 100.0 * bonus)


@pytest.fixture(scope="module")
def copying_pair(decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    return CopyingModel(model), draft_model, tokenizer


def decode_all(decoder: SpeculativeDecoder, **options) -> dict[str, int]:
    """Decode every prompt regularly and speculatively, check that the tokens
    are equal, and return the speculative runs' totals."""
    totals = dict.fromkeys(
        ["proposed", "accepted", "rejected", "lookup_rounds", "rounds", "passes"], 0
    )
    for prompt in PROMPTS:
        regular = decoder.generate(prompt, max_tokens=MAX_TOKENS, **options)
        speculative = decoder.speculative_decode(prompt, max_tokens=MAX_TOKENS, **options)
        assert speculative.tokens == regular.tokens
        totals["proposed"] += speculative.n_draft
        totals["accepted"] += speculative.n_accepted
        totals["rejected"] += speculative.n_rejected
        totals["lookup_rounds"] += speculative.n_lookup_rounds
        totals["rounds"] += len(speculative.draft_lengths)
        totals["passes"] += speculative.n_steps
    return totals


def test_expected_tokens_per_round_is_the_papers():
    assert expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)  # 1 + 0.5 + 0.25
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 3) == 4.0


def test_pass_times_between_and_past_the_timed_lengths():
    """auto's v(k): the timed values at the timed lengths, the line between
    them in between, and the last segment's line past the last one."""
    values = piecewise_linear([1, 2, 4, 9], [1.0, 1.5, 2.0, 4.0], 12)
    assert len(values) == 12
    assert values[:4] == pytest.approx([1.0, 1.5, 1.75, 2.0])
    assert values[8] == pytest.approx(4.0)
    assert values[5] == pytest.approx(2.0 + 2 * 0.4)  # 6, on the segment from 4 to 9
    assert values[11] == pytest.approx(4.0 + 3 * 0.4)  # 12, the 4-to-9 line extended
    assert piecewise_linear([1], [3.0], 1) == [3.0]


def test_best_num_draft():
    # alpha 0.75, a draft step 0.1 main steps, verify passes as cheap as a step:
    # (1 - 0.75^(g+1)) / (0.25 (1 + 0.1 g)) is 2.179 at g = 4, 2.192 at g = 5 and 2.166 at g = 6.
    cheap = linear_round_costs(0.1)
    assert best_num_draft([0.75] * 16, cheap) == 5
    # A round of 4 draft tokens 10% cheaper than the line: g = 4 gives 3.051 / 1.3.
    assert best_num_draft([0.75] * 16, cheap[:4] + [1.3] + cheap[5:]) == 4
    # g = 1 yields 1.4 tokens for 1.3 passes; g = 2 1.56 for 1.6.
    assert best_num_draft([0.4] * 16, linear_round_costs(0.3)) == 1
    # Drafting does not pay (1.2 tokens for 1.5 passes at g = 1): a plain step.
    assert best_num_draft([0.2] * 16, linear_round_costs(0.5)) == 0
    assert best_num_draft([0.99] * 16, linear_round_costs(0.0)) == 16
    # Per position: a second token never accepted is never worth drafting.
    assert best_num_draft([0.9, 0.0] + [0.9] * 14, cheap) == 1


def test_auto_weighs_starting_the_draft_model():
    # A draft model whose prompts take 50 ms to encode, for 16 rows with 160
    # tokens left, a plain step over them taking 28 ms: 50 / 160 / (28 / 16).
    assert draft_start_cost(0.050, 160, 0.028, 16) == pytest.approx(0.1786, abs=1e-4)
    # At acceptance 0.8 with draft steps of 0.5 plain steps, g = 2 yields 2.44
    # tokens for 2.0 steps (1.22x); each token carrying 0.1 steps of the start,
    # 2.44 for 2.244 (1.09x); carrying 0.25, 2.44 for 2.61 (0.93x), g = 1
    # 1.8 for 1.95 (0.92x): a plain step.
    costs = linear_round_costs(0.5)
    assert best_num_draft([0.8] * 16, costs) == 2
    assert best_num_draft([0.8] * 16, costs, start_cost=0.1) == 2
    assert best_num_draft([0.8] * 16, costs, start_cost=0.25) == 0
    # In auto, a start cost weighs on model drafts only, and no probe without
    # hope starts the draft model.
    length = accepting(AutoDraftLength(auto_costs(0.5)), 0.8)
    for _ in range(HOPELESS_PROBE_EVERY):
        assert length.choose("model", 16, start_cost=0.25) == 0
    assert length.choose("lookup", 16, start_cost=0.25) > 0


def test_starting_the_lazy_draft_model_is_weighed_until_it_starts(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    cheap_drafts(decoder)
    decoder.auto.plain_step_seconds[2] = 0.010  # as if calibrated at 2 rows
    generator = decoder.batch_generator(max_batch_size=2)
    for prompt in PROMPTS[:2]:
        generator.insert(prompt, max_tokens=MAX_TOKENS)
    generator._admit()  # the prompts join, as a round starts
    assert generator.drafter.start_pending  # lazy: not started
    live, limits = list(generator.rows), [MAX_TOKENS - 1] * 2
    start = generator.draft_length.start

    def start_cost() -> float:
        """The start cost the rule weighs in the next round's choice."""
        return generator.draft_length.plan(live, limits, generator.drafter).keywords["start_cost"]

    # The draft model's work at the main model's prompt seconds per
    # multiply-add: encoding the prompts, then catching up on each row's
    # tokens (the start token so far); over the 2 x 40 tokens left, in plain
    # steps of 10 ms over 2 rows.
    main_args, draft_args = decoder.model.args, decoder.draft_model.args
    prompt_tokens = sum(row.result.prompt_tokens for row in live)
    seconds_per_work = sum(row.result.prompt_time for row in live) / (
        main_args.prompt_work * prompt_tokens
    )
    encoding = seconds_per_work * draft_args.prompt_work * prompt_tokens
    catch_up = seconds_per_work * draft_args.decode_work * 2
    expected = (encoding + catch_up) / (2 * MAX_TOKENS) / (0.010 / 2)
    assert expected > 0
    assert start_cost() == pytest.approx(expected)
    # Rows that generated tokens before it starts add a longer catch-up,
    # padded to the longest row.
    live[0].sequence += [5] * 9
    longer = (encoding + catch_up * 10) / (2 * MAX_TOKENS) / (0.010 / 2)
    assert start_cost() == pytest.approx(longer)
    live[0].sequence = live[0].sequence[:1]
    # Weighed by a plain step over the fewest more rows, never fewer.
    start.plain_step_seconds = {1: 0.005, 4: 0.020, 8: 0.030}
    assert start_cost() == pytest.approx(expected / 2)
    start.plain_step_seconds = {1: 0.005}
    assert start_cost() == 0
    start.plain_step_seconds = {2: 0.010}
    for _ in range(MAX_TOKENS):  # cheap drafts: auto drafts within a few rounds
        generator.next()
        if not generator.drafter.start_pending:
            break
    assert start_cost() == 0


def test_auto_draft_length_follows_acceptance():
    length = AutoDraftLength(auto_costs(0.1))
    assert length.choose("model") == 5  # the prior, alpha 0.75
    for _ in range(20):
        length.update("model", 0, 1)  # every tested token rejected
        length.update("lookup", 6, 6)  # every one accepted
    assert length.choose("model") == 1
    assert length.choose("lookup") == 16
    assert FixedDraftLength(3).plan([], [3], None)("model") == 3


def test_auto_stops_drafting_a_draft_that_does_not_pay_and_probes_it_while_it_might():
    # A round of one draft token costs 1.55 plain steps: it pays above 0.55 acceptance.
    length = AutoDraftLength(auto_costs(0.55))
    for _ in range(3):
        length.update("model", 0, 1)  # the prior (3 of 4) and 3 rejections: 3 of 7
    choices = []
    for _ in range(4 * PROBE_EVERY):
        num_draft = length.choose("model")
        if num_draft:
            length.update("model", 0, num_draft)  # every probe rejected
        choices.append(num_draft)
    # Plain steps, but one token drafted every PROBE_EVERY rounds (a probe)
    # while 4 more accepted tokens would make it pay: 7 of 11, 7 of 12, and
    # after the second probe's rejection no longer (7 of 13, 0.54).
    assert choices == ([0] * (PROBE_EVERY - 1) + [1]) * 2 + [0] * 2 * PROBE_EVERY
    for _ in range(40):
        length.update("model", 1, 1)  # the draft agreeing again (a new prompt, say)
    assert length.choose("model") >= 1


@pytest.mark.parametrize(
    ("rejections", "rounds"),
    [(5, 25 * PROBE_EVERY), (10, 2 * HOPELESS_PROBE_EVERY + 25 * PROBE_EVERY)],
    ids=["hope left", "no hope left"],
)
def test_auto_recovers_a_position_an_unlucky_start_made_look_poor(rejections, rounds):
    length = AutoDraftLength(auto_costs(0.3))
    for _ in range(rejections):
        length.update("model", 1, 2)  # at first every second token rejected
    assert length.choose("model") == 1
    for _ in range(rounds):
        num_draft = length.choose("model")
        length.update("model", num_draft, num_draft)  # from now on every one accepted
    # Only the probes test the second position, and they find it agreeing:
    # every PROBE_EVERY rounds while 4 more accepted tokens would make g = 2
    # pay (0 of 5 tested), else every HOPELESS_PROBE_EVERY (0 of 10) until
    # they would.
    assert length.choose("model") > 2


def test_prompts_joining_a_batch_share_the_probes_luck():
    # A round of one draft token costs 1.3 plain steps; the generation
    # accepted 5 of its 100 first draft tokens: no drafting, and no hope left.
    length = accepting(AutoDraftLength(auto_costs(0.3)), 0.05)
    old = acceptance_counts()
    length.update("model", 0, 1, old)
    # Three prompts just joined: nothing of their own tested. The 4 lucky
    # tokens spread over the 4 rows (0.26 for a new row): 1.25 tokens for 1.3.
    rows = [old] + [acceptance_counts() for _ in range(3)]
    choices = [length.choose("model", 4, rows) for _ in range(2 * PROBE_EVERY)]
    # Luck added to each row (0.54 for a new one: 1.52 tokens) would have
    # probed every PROBE_EVERY-th round, at whatever cost.
    assert choices == [0] * (2 * PROBE_EVERY)
    # Once those rows agree, they are drafted for again.
    for row in rows[1:]:
        for _ in range(20):
            length.update("model", 1, 1, row)
    assert length.choose("model", 4, rows) >= 1


def test_auto_probes_with_a_plain_step_then_one_token_more():
    length = AutoDraftLength(auto_costs(0.1))  # the prior alone: g = 5
    choices = [length.choose("model") for _ in range(2 * PROBE_EVERY)]
    assert choices == [5] * (PROBE_EVERY - 1) + [0] + [5] * (PROBE_EVERY - 1) + [6]


def test_round_times_correct_the_calibrated_costs():
    calibrated = linear_round_costs(0.1)
    times = RoundTimes()
    times.record("model", 1, 8, 0.020)
    assert times.costs("model", calibrated, 8) == calibrated  # no plain round timed yet
    for seconds in (0.010, 0.011, 0.009):
        times.record("plain", 0, 8, seconds)
    for seconds in (0.020, 0.021):
        times.record("model", 1, 8, seconds)
    times.record("model", 3, 8, 0.022)
    # Rounds over other numbers of rows count only where 8 rows were not timed.
    times.record("plain", 0, 5, 0.001)
    times.record("model", 2, 5, 0.100)
    costs = times.costs("model", calibrated, 8)
    # The calibrated cost over a plain step, scaled by one factor: the least
    # squares fit to the medians of the timed rounds over the plain ones
    # (g = 1: 2.0, over 3 rounds; g = 3: 2.2, over 1), weighted by rounds.
    scale = (3 * 1.0 * 0.1 + 1.2 * 0.3) / (3 * 0.1**2 + 0.3**2)
    assert scale == pytest.approx(5.5)
    assert costs == pytest.approx([1.0 + scale * 0.1 * g for g in range(len(calibrated))])
    # One factor: noise in one length's rounds moves every length alike, so
    # that the costs keep the calibration's order.
    assert costs == sorted(costs)
    # Lookup rounds were not timed: their calibrated costs stand.
    assert times.costs("lookup", linear_round_costs(0.0), 8) == linear_round_costs(0.0)
    # Elsewhere, the fewest more rows timed, up to 1.5x as many: 8 rows for 6 and 7,
    # 5 rows for 4 (where g = 2 cost 100 plain rounds); never fewer rows (a round's
    # cost over a plain step grows with the rows): 10 and 12 rows keep their
    # calibrated costs, as do 1 and 3.
    assert times.costs("model", calibrated, 6) == times.costs("model", calibrated, 7) == costs
    assert times.costs("model", calibrated, 4)[2] == pytest.approx(100.0)
    for rows in (1, 3, 10, 12):
        assert times.costs("model", calibrated, rows) == calibrated
    times.record("plain", 0, 9, 0.010)
    assert times.costs("model", calibrated, 7) == costs  # 9 rows: no drafted round timed


def run_timed_rounds(length: AutoDraftLength, round_seconds, rounds: int) -> list[int]:
    """Let ``length`` choose ``rounds`` model rounds over 2 rows, each of
    which takes ``round_seconds(g)``; the choices."""
    choices = []
    for _ in range(rounds):
        num_draft = length.choose("model", 2)
        source = "model" if num_draft else "none"
        draft = Draft(mx.zeros((2, num_draft), mx.int32), [num_draft] * 2, [source] * 2)
        length.timed(draft, round_seconds(num_draft))
        choices.append(num_draft)
    return choices


def accepting(length: AutoDraftLength, rate: float, tests: int = 100) -> AutoDraftLength:
    """``length`` after ``tests`` one-token rounds accepting at ``rate``."""
    for i in range(tests):
        length.update("model", int(i < rate * tests), 1)
    return length


def test_auto_stops_drafting_where_its_rounds_cost_more_than_calibrated():
    # Calibrated, a draft step costs 0.1 plain steps: at acceptance 0.8 drafting pays.
    length = accepting(AutoDraftLength(auto_costs(0.1)), 0.8)
    # But each drafted token makes the round a plain round longer:
    # 1.8 tokens for 2 plain rounds' time at g = 1.
    choices = run_timed_rounds(length, lambda g: 0.01 * (1 + g), 4 * PROBE_EVERY)
    assert choices[0] >= 1
    assert list(length.times.seconds) == [2]  # filed by rows
    # Once a probe timed a plain round: plain steps, and no probe, since
    # even were the next 4 tokens accepted (0.81) drafting would not pay.
    assert choices[-2 * PROBE_EVERY :] == [0] * 2 * PROBE_EVERY
    # 2 rows' timings do not stand in for 3 (a round costs more over more rows):
    # nothing timed over 3 to 4.5 rows, so the calibrated costs, where drafting pays.
    assert length.choose("model", 3) >= 1


def test_auto_drafts_where_its_rounds_cost_less_than_calibrated():
    # Calibrated, a draft step costs 0.5 plain steps: at acceptance 0.4 no g pays.
    length = accepting(AutoDraftLength(auto_costs(0.5)), 0.4)
    # But a round of g costs 1 + 0.1 g plain rounds: 1.4 tokens for 1.1 at g = 1.
    rounds = HOPELESS_PROBE_EVERY + 2 * PROBE_EVERY
    choices = run_timed_rounds(length, lambda g: 0.01 * (1 + 0.1 * g), rounds)
    # No hope at the calibrated costs: plain steps until the rare probe.
    assert choices[: HOPELESS_PROBE_EVERY - 1] == [0] * (HOPELESS_PROBE_EVERY - 1)
    # Once it timed a drafted round: drafting, probing with a plain round
    # and one token more in turn.
    assert [g > 0 for g in choices[-2 * PROBE_EVERY :]] == [True] * (PROBE_EVERY - 1) + [False] + [
        True
    ] * PROBE_EVERY


def test_auto_times_each_round_by_source_draft_length_and_rows(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    results = [decoder.speculative_decode(prompt, max_tokens=MAX_TOKENS) for prompt in PROMPTS]
    rounds = Counter()
    for result in results:
        rounds.update(("model", num_draft) for num_draft in result.draft_lengths)
        rounds["plain", 0] += result.n_steps - len(result.draft_lengths)
    # One decoder's generations share their timings, the last TIMED_ROUNDS of
    # each kind, here all over one row: every plain round's, and a drafted
    # one's unless the draft model first caught up on plain rounds' tokens.
    (times,) = decoder.auto.round_times.values()
    assert list(times.seconds) == [1]
    timed = {kind: len(seconds) for kind, seconds in times.seconds[1].items()}
    assert timed.pop(("plain", 0)) == min(rounds.pop(("plain", 0)), TIMED_ROUNDS)
    assert timed.keys() <= rounds.keys()
    assert all(0 < count <= min(rounds[kind], TIMED_ROUNDS) for kind, count in timed.items())


def test_auto_leaves_out_rounds_that_caught_up_on_plain_steps(decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    drafter = ModelDrafter(draft_model, [tokenizer(PROMPTS[0]).input_ids])
    start = model.args.decoder_start_token_id
    greedy = RowSampling([Sampling()])
    # The first proposal feeds the start token; after a drafted round whose
    # two tokens were accepted, the last of them and the main model's own.
    first = drafter.propose([[start]], greedy, lambda source: 2, [2])
    assert first.caught_up == 1
    accepted = [start, *first.tokens[0].tolist(), 9]
    second = drafter.propose([accepted], greedy, lambda source: 2, [2])
    assert second.caught_up == STEADY_CATCH_UP == 2
    # Both accepted again, then two plain steps: two tokens more.
    accepted += [*second.tokens[0].tolist(), 9, 9, 9]
    later = drafter.propose([accepted], greedy, lambda source: 2, [2])
    assert later.caught_up == 4
    length = AutoDraftLength(auto_costs(0.1))
    length.timed(first, 0.01)
    length.timed(later, 0.05)  # left out: its catch-up is paid once, after plain steps
    assert list(length.times.seconds[1]["model", 2]) == [0.01]


def test_auto_weighs_each_row_by_its_own_acceptance():
    length = accepting(AutoDraftLength(auto_costs(0.3)), 0.8)
    good, bad = acceptance_counts(), acceptance_counts()
    for _ in range(10):
        length.update("model", 1, 1, good)
        length.update("model", 0, 1, bad)  # a prompt the draft keeps failing
    # The batch's rates say drafting pays (0.75 at the first position).
    assert length.choose("model") >= 1
    # Not for that row alone: from the others' 0.82 weighted as 4 tokens
    # and its own 0 in 10, 0.23, and 1.23 tokens for 1.3 plain steps.
    assert length.choose("model", 1, [bad]) == 0
    # With a row that agrees (0.92): (1.92 + 1.23) / 2 tokens for 1.3.
    assert length.choose("model", 2, [bad, good]) >= 1


def test_batch_rows_keep_their_own_acceptance(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    cheap_drafts(decoder)
    generator = decoder.batch_generator(max_batch_size=2)
    for prompt in PROMPTS[:2]:
        generator.insert(prompt, max_tokens=MAX_TOKENS)
    generator.next()  # prompts join; "auto" starts
    chosen_for = []
    choose = generator.draft_length.choose

    def spy(source, batch_size=1, rows=None, start_cost=0.0):
        chosen_for.append(rows)
        return choose(source, batch_size, rows, start_cost)

    generator.draft_length.choose = spy
    for _ in range(10):
        generator.next()
    assert chosen_for and all(
        [id(row) for row in rows]
        == [id(generator.draft_length.row_counts[row.uid]) for row in generator.rows]
        for rows in chosen_for
    )
    for row in generator.rows:
        accepted, tested = generator.draft_length.row_counts[row.uid]["model"]
        assert accepted.sum() == row.result.n_accepted
        assert tested.sum() == row.result.n_accepted + row.result.n_rejected > 0


def test_a_lazy_model_drafter_encodes_its_rows_prompts_when_it_first_drafts(decoding_pair):
    """Rows admitted and dropped before a lazy drafter first drafts draft
    as an eager drafter's rows do; encoding is timed as the drafter's own."""
    model, draft_model, tokenizer = decoding_pair
    prompts = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    drafters = [ModelDrafter(draft_model, prompts[:2], lazy=lazy) for lazy in (False, True)]
    start = model.args.decoder_start_token_id
    for drafter in drafters:
        drafter.admit([1, 2], [prompts[2], prompts[0]])  # row 1 restarted, row 2 added
        drafter.keep_rows(compacted_rows([False, True, True]))  # row 0 leaves, row 2 takes it
    eager, lazy = drafters
    assert lazy.cache is None and lazy.encoding_time == 0.0
    # A row that made plain steps before: the draft cache catches up.
    sequences = [[start, 5, 7], [start]]
    greedy = RowSampling([Sampling()] * 2)
    drafts = [drafter.propose(sequences, greedy, lambda source: 3, [3, 3]) for drafter in drafters]
    assert lazy.cache is not None and lazy.encoding_time > 0.0 == eager.encoding_time
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    # Differently ordered prompts would draft otherwise.
    wrong = ModelDrafter(draft_model, [prompts[1], prompts[0]])
    assert wrong.propose(sequences, greedy, lambda source: 3, [3, 3]).tokens.tolist() != (
        drafts[0].tokens.tolist()
    )
    # Suspended, the lazy drafter drops its cache and drafts again as the
    # eager drafter does: from the prompts of the rows that joined and left
    # while it drafted, caught up on their tokens.
    first_draft_token = drafts[0].tokens.tolist()[0][0]
    for drafter in drafters:
        drafter.admit([2], [prompts[1]])
        drafter.keep_rows([2, 0])  # a new row 0; row 0 now row 1
    lazy.suspend()
    assert lazy.cache is None
    # Row 1 accepted its first draft token, then made a plain step.
    sequences = [[start, 4], [start, 5, 7, first_draft_token, 9]]
    drafts = [drafter.propose(sequences, greedy, lambda source: 2, [2, 2]) for drafter in drafters]
    assert lazy.cache is not None
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()


def test_auto_starts_from_the_acceptance_of_earlier_generations():
    costs = auto_costs(0.1)
    earlier = acceptance_counts()
    first = AutoDraftLength(costs, earlier)
    assert first.choose("model") == 5  # the prior
    for _ in range(30):
        first.update("model", 0, 1)
    second = AutoDraftLength(costs, earlier)
    # The first position's rate so far, (0 + 0.75 * 4) / (30 + 4): not worth drafting.
    assert second.choose("model") == 0
    assert second.choose("lookup") == AutoDraftLength(costs).choose("lookup")
    for _ in range(8):
        second.update("model", 3, 3)  # this generation's own rounds outweigh it
    assert second.choose("model") >= 3


def test_auto_draft_length_learns_each_position():
    length = AutoDraftLength(auto_costs(0.1))
    for _ in range(50):
        length.update("model", 1, 2)  # the first token accepted, the second rejected
    # One rate for both positions, 0.5, would choose g = 2 (1.75 / 1.2 > 1.5 / 1.1).
    assert length.choose("model") == 1


@pytest.mark.parametrize(
    ("tokens", "max_ngram", "min_ngram", "expected"),
    [
        ([5, 6, 7, 8, 5, 6], 3, 1, [7, 8, 5, 6]),  # the 2-gram 5 6 occurred at the start
        ([1, 2, 9, 1, 2, 8, 1, 2], 2, 1, [8, 1, 2]),  # its latest earlier occurrence
        ([3, 4, 5, 1, 4, 5, 2, 3, 4, 5], 3, 1, [1, 4, 5, 2, 3, 4, 5]),  # the longest n-gram
        ([3, 4, 5, 1, 4, 5, 2, 3, 4, 5], 2, 1, [2, 3, 4, 5]),  # no longer than max_ngram
        ([7, 1, 2, 7], 2, 1, [1, 2, 7]),  # a single token
        ([7, 1, 2, 7], 2, 2, []),  # single tokens ignored
        ([1, 2, 3], 3, 1, []),  # nothing repeats
        ([4], 2, 1, []),
    ],
)
def test_find_continuation(tokens, max_ngram, min_ngram, expected):
    assert find_continuation(tokens, max_ngram, min_ngram) == expected


@pytest.mark.parametrize("prompt_lookup", [1, 2, 4])
@pytest.mark.parametrize("num_draft", [1, 3, 8, "auto"])
def test_prompt_lookup_keeps_the_greedy_output(prompt_lookup, num_draft, copying_pair):
    model, _, tokenizer = copying_pair
    decoder = SpeculativeDecoder(
        model, None, tokenizer, num_draft=num_draft, prompt_lookup=prompt_lookup
    )
    unjudged(decoder)  # the tiny models' rounds are too short to judge by their times
    totals = decode_all(decoder)
    # Lookup drafted most rounds; the tokens it proposed that were tested
    # were often right and sometimes wrong.
    assert totals["lookup_rounds"] == totals["rounds"] > totals["passes"] / 2
    assert 0.5 < totals["accepted"] / (totals["accepted"] + totals["rejected"]) < 0.97


@pytest.mark.parametrize("num_draft", [3, "auto"])
def test_hybrid_keeps_the_greedy_output(num_draft, copying_pair):
    decoder = SpeculativeDecoder(*copying_pair, num_draft=num_draft, prompt_lookup=3)
    cheap_drafts(decoder)
    totals = decode_all(decoder)
    # Both drafters drafted: lookup where a 2- or 3-gram matched, the model elsewhere.
    assert 0 < totals["lookup_rounds"] < totals["rounds"]
    assert totals["accepted"] > 0 and totals["rejected"] > 0


def test_auto_with_a_draft_model_keeps_the_greedy_output(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    cheap_drafts(decoder)
    totals = decode_all(decoder)
    assert 0.3 < totals["accepted"] / totals["proposed"] < 0.97
    assert totals["lookup_rounds"] == 0


def test_auto_that_mostly_steps_plainly_keeps_the_greedy_output(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    # Drafting pays only above 85% acceptance: plain steps, with a one-token
    # probe every PROBE_EVERY rounds (while 4 more accepted tokens would make
    # it pay) after which the draft model catches up.
    cheap_drafts(decoder, draft_cost=0.85)
    totals = decode_all(decoder)
    assert 0 < totals["rounds"] < totals["passes"] / (PROBE_EVERY - 2)
    assert totals["proposed"] == totals["rounds"]


def test_auto_times_the_rounds_of_each_draft_source(decoding_pair):
    """auto's costs: per draft source the decoder drafts from, a round of g =
    0 .. MAX_AUTO_DRAFT draft tokens over a plain step; a model's rounds are
    timed with their draft steps, a lookup's are its verify pass alone."""
    model, _, tokenizer = decoding_pair
    prompt_ids = tokenizer(PROMPTS[0]).input_ids
    decoders = {
        drafting: SpeculativeDecoder(*pair, num_draft="auto", prompt_lookup=lookup)
        for drafting, pair, lookup in [
            ("draft model", decoding_pair, 0),
            ("prompt lookup", (model, None, tokenizer), 2),
            ("hybrid", decoding_pair, 2),
        ]
    }
    costs = {
        drafting: decoder.auto.measure_costs(
            decoder.model, decoder.draft_model, decoder.prompt_lookup, prompt_ids
        )
        for drafting, decoder in decoders.items()
    }
    assert {drafting: sorted(c) for drafting, c in costs.items()} == {
        "draft model": ["model"],
        "prompt lookup": ["lookup"],
        "hybrid": ["lookup", "model"],
    }
    for by_source in costs.values():
        assert all(len(c) == MAX_AUTO_DRAFT + 1 and c[0] == 1 for c in by_source.values())
    # The tiny draft model costs about what its main model does: eight draft
    # steps add several plain steps' worth to a round of g = 8.
    hybrid = costs["hybrid"]
    assert hybrid["model"][8] > hybrid["lookup"][8] + 2


class RecordingPasses:
    """A model that records, for every decoder pass, its number of tokens
    and where each row of the cache ended before it."""

    def __init__(self, model):
        self.model, self.passes = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode(self, inputs: mx.array, cache):
        self.passes.append((inputs.shape[1], cache.self_attn[0].ends))
        return self.model.decode(inputs, cache)


def test_calibration_times_drafted_passes_on_rows_that_end_apart(decoding_pair):
    """Rows that accepted different numbers of tokens end at different
    columns, where a pass's cache writes are a scatter: auto's calibration
    times passes over several tokens so, and a plain step on even rows."""
    model, _, tokenizer = decoding_pair
    recording = RecordingPasses(model)
    encoder_output = model.encode(mx.array([tokenizer(PROMPTS[0]).input_ids]))
    pass_times(recording, encoder_output, 4, batch_size=2, repeats=1)
    timed = recording.passes[2:]  # after the passes that fill the two caches
    assert sorted(length for length, _ in timed) == [1, 2, 3, 4]
    assert all((len(set(ends)) > 1) == (length > 1) for length, ends in timed)


@pytest.mark.parametrize(
    ("prompt_lookup", "num_draft", "temp", "with_draft_model"),
    [(0, 3, 0.0, True), (0, "auto", 1.0, True), (2, 4, 0.0, False), (3, "auto", 1.0, True)],
)
def test_from_draft_marks_the_accepted_draft_tokens(
    prompt_lookup, num_draft, temp, with_draft_model, copying_pair
):
    model, draft_model, tokenizer = copying_pair
    decoder = SpeculativeDecoder(
        model,
        draft_model if with_draft_model else None,
        tokenizer,
        num_draft=num_draft,
        prompt_lookup=prompt_lookup,
    )
    cheap_drafts(decoder)
    for prompt in PROMPTS:
        result = decoder.speculative_decode(prompt, max_tokens=MAX_TOKENS, temp=temp, seed=1)
        assert len(result.tokens) == len(result.from_draft) == MAX_TOKENS
        assert sum(result.from_draft) == result.n_accepted > 0
        # Each main-model pass adds exactly one token of its own, after the accepted ones.
        assert result.from_draft.count(False) == result.n_steps
        assert sum(result.draft_lengths) == result.n_draft


def test_bad_drafting_arguments_are_refused(decoding_pair):
    with pytest.raises(ValueError, match="num_draft"):
        SpeculativeDecoder(*decoding_pair, num_draft="fast")
    with pytest.raises(ValueError, match="prompt_lookup"):
        SpeculativeDecoder(*decoding_pair, prompt_lookup=-1)


def run_deliveries(deliveries: Deliveries, deliver, rounds: int, batch_size: int = 8) -> list[bool]:
    """Let ``deliveries`` judge ``rounds`` rounds over ``batch_size`` rows,
    each drafting where it is allowed (a cost model that always would) and
    delivering ``deliver(drafted, round)``: (tokens, seconds), a faked clock.
    Whether each round drafted."""
    drafted = []
    for i in range(rounds):
        drafts = deliveries.allows_drafting(batch_size)
        tokens, seconds = deliver(drafts, i)
        deliveries.record(batch_size, drafts, tokens, seconds)
        drafted.append(drafts)
    return drafted


def plain_or_drafted(plain: tuple[int, float], drafted: tuple[int, float]):
    """``deliver`` for ``run_deliveries``: the same (tokens, seconds) every round of each kind."""
    return lambda drafts, i: drafted if drafts else plain


def test_drafting_that_delivers_less_than_plain_steps_is_abandoned():
    # 8 rows: a plain step delivers 8 tokens in 10 ms; a drafted round 14 in
    # 20 ms, 0.875x the tokens per second.
    deliveries = Deliveries()
    drafted = run_deliveries(deliveries, plain_or_drafted((8, 0.010), (14, 0.020)), 300)
    # Plain steps first, then the rounds the cost model drafts, judged once
    # JUDGED_ROUNDS drafted: abandoned.
    judged = PLAIN_FIRST + JUDGED_ROUNDS
    assert drafted[:judged] == [False] * PLAIN_FIRST + [True] * JUDGED_ROUNDS
    assert deliveries.vetoes(8)
    # Those rounds lost 8 x (20 - 14 x 10 / 8) = 20 ms: the next trial after
    # 20 / EXPLORATION_SHARE = 1000 ms of plain steps, 100 of them.
    wait = round(JUDGED_ROUNDS * (0.020 - 14 * 0.010 / 8) / EXPLORATION_SHARE / 0.010)
    assert wait == 100
    trial = judged + wait
    assert drafted[judged:trial] == [False] * wait
    assert drafted[trial : trial + JUDGED_ROUNDS + 1] == [True] * JUDGED_ROUNDS + [False]


def test_noisy_drafted_rounds_are_judged_by_their_mean_and_its_error():
    """At one row a drafted round delivers 1 to g + 1 tokens: here six
    rounds of 1 token, then six of 4, each in 13 ms, against plain steps of
    1 token in 7 ms. On average drafting delivers 1.35x the tokens per
    second; 8 rounds with six of 1 token among them deliver 0.94x. Judged
    on the last JUDGED_WINDOW rounds, within VETO_ERRORS standard errors,
    drafting is kept."""
    deliveries = Deliveries()

    def deliver(drafts: bool, i: int) -> tuple[int, float]:
        return ((1 if (i // 6) % 2 else 4), 0.013) if drafts else (1, 0.007)

    drafted = run_deliveries(deliveries, deliver, 500, batch_size=1)
    assert drafted == [False] * PLAIN_FIRST + [True] * (500 - PLAIN_FIRST)
    # Where each round delivers as the worst of those windows, it is vetoed.
    deliveries = Deliveries()
    run_deliveries(deliveries, plain_or_drafted((1, 0.007), (14 / 8, 0.013)), 50, batch_size=1)
    assert deliveries.vetoes(1)


def test_a_trial_waits_for_the_cost_models_drafted_rounds():
    """A vetoed bucket's trial lasts JUDGED_ROUNDS drafted rounds, however
    many plain steps the cost model chooses meanwhile (starting the draft
    model may not pay yet): counted in rounds, a trial of plain steps was
    judged on no drafted round, and the bucket stayed vetoed for good."""
    deliveries = Deliveries()
    run_deliveries(
        deliveries, plain_or_drafted((8, 0.010), (14, 0.020)), PLAIN_FIRST + JUDGED_ROUNDS
    )
    assert deliveries.vetoes(8)
    while deliveries.vetoes(8):
        deliveries.record(8, False, 8, 0.010)
    for _ in range(3 * JUDGED_ROUNDS):  # the cost model chooses plain steps
        assert deliveries.allows_drafting(8)
        deliveries.record(8, False, 8, 0.010)
    # Drafted rounds now deliver 1.6x the tokens per second: the trial finds it.
    drafted = run_deliveries(deliveries, plain_or_drafted((8, 0.010), (20, 0.0156)), 100)
    assert all(drafted)
    assert not deliveries.vetoes(8)


def test_drafting_that_delivers_more_than_plain_steps_is_kept():
    # A drafted round delivers 14 tokens in 15 ms: 1.07x the tokens per second.
    deliveries = Deliveries()
    drafted = run_deliveries(deliveries, plain_or_drafted((8, 0.010), (14, 0.015)), 500)
    assert drafted == [False] * PLAIN_FIRST + [True] * (500 - PLAIN_FIRST)
    assert not deliveries.vetoes(8)


def test_deliveries_are_judged_by_everything_a_round_waits_for():
    """Costs outside the rounds the cost model weighs count: a draft model
    that catches up on the rows' tokens (3 plain steps) every fourth
    drafted round. Rounds that paid 1.07x the tokens per second lose with
    it, and are vetoed once their mean is that many standard errors
    behind (``VETO_ERRORS``), within JUDGED_WINDOW drafted rounds."""
    deliveries = Deliveries()

    def deliver(drafts: bool, i: int) -> tuple[int, float]:
        if not drafts:
            return 8, 0.010
        return 14, 0.015 + (0.030 if (i - PLAIN_FIRST) % 4 == 0 else 0.0)

    drafted = run_deliveries(deliveries, deliver, PLAIN_FIRST + JUDGED_WINDOW + 1)
    assert drafted[: PLAIN_FIRST + JUDGED_ROUNDS] == [False] * PLAIN_FIRST + [True] * JUDGED_ROUNDS
    assert deliveries.vetoes(8)
    assert drafted[-1] is False


def test_drafting_is_judged_at_the_batchs_size():
    """A verdict holds for its bucket of batch sizes (``rows_bucket``): 32
    rows' for the 23 to 32 a batch of 32 drops to as its rows finish, not
    for 16 rows."""
    assert [rows_bucket(n) for n in (1, 2, 3, 4, 5, 8, 16, 17, 22, 23, 32)] == [
        0, 2, 4, 4, 5, 6, 8, 9, 9, 10, 10,
    ]  # fmt: skip
    deliveries = Deliveries()
    run_deliveries(deliveries, plain_or_drafted((32, 0.030), (40, 0.060)), 20, batch_size=32)
    assert deliveries.vetoes(32) and deliveries.vetoes(23)
    assert not deliveries.vetoes(22)
    drafted = run_deliveries(deliveries, plain_or_drafted((16, 0.020), (28, 0.025)), 20, 16)
    assert drafted == [False] * PLAIN_FIRST + [True] * (20 - PLAIN_FIRST)


@pytest.mark.parametrize("loss", [1.05, 1.5, 4.0])
def test_exploration_costs_at_most_its_share_where_drafting_never_pays(loss):
    """Where drafted rounds deliver ``loss`` times a plain step's seconds per
    token, each trial's first round paying 10 plain steps to start the
    draft model besides, auto's rounds take at most EXPLORATION_SHARE more
    than plain steps alone, once its first judgement has been paid, and it
    keeps trying."""
    deliveries = Deliveries()

    def deliver(drafts: bool, i: int) -> tuple[int, float]:
        if not drafts:
            return 8, 0.010
        start = 0.100 if not drafted[-1] else 0.0
        return 14, 14 * 0.010 / 8 * loss + start

    drafted = [False]
    first = PLAIN_FIRST + JUDGED_ROUNDS
    run_deliveries(deliveries, deliver, first)
    seconds = tokens = 0.0

    def counted(drafts: bool, i: int) -> tuple[int, float]:
        nonlocal seconds, tokens
        round_tokens, round_seconds = deliver(drafts, i)
        seconds, tokens = seconds + round_seconds, tokens + round_tokens
        drafted.append(drafts)
        return round_tokens, round_seconds

    run_deliveries(deliveries, counted, 20_000)
    trials = sum(a and not b for a, b in zip(drafted[1:], drafted))
    assert trials >= 3
    assert seconds / (tokens * 0.010 / 8) - 1 <= EXPLORATION_SHARE


def test_drafting_that_starts_paying_is_taken_up_again():
    """A vetoed bucket tries drafting again: once it pays (a new prompt that
    the draft agrees with, say), the next trial finds it, and it is kept."""
    deliveries = Deliveries()
    run_deliveries(
        deliveries, plain_or_drafted((8, 0.010), (14, 0.020)), PLAIN_FIRST + JUDGED_ROUNDS
    )
    assert deliveries.vetoes(8)
    # Drafted rounds now deliver 1.6x the tokens per second.
    drafted = run_deliveries(deliveries, plain_or_drafted((8, 0.010), (20, 0.0156)), 400)
    # The wait the losing rounds earned (see the test above), in plain
    # steps; then the trial's rounds, the last JUDGED_ROUNDS drafted, win.
    taken_up = drafted.index(True)
    assert taken_up == 100
    assert all(drafted[taken_up:])
    assert not deliveries.vetoes(8)


class LazilySlow:
    """A model whose every decoder pass adds ``products`` products of 256 x
    256 matrices that MLX computes only when the pass's results are read,
    as it computes on a GPU: the decoder waits for them where it reads a
    round's tokens, not when the pass returns."""

    def __init__(self, model, products: int):
        self.model, self.products = model, products
        self.weight = mx.random.normal((256, 256), key=mx.random.key(0)) / 16

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode(self, inputs: mx.array, cache) -> mx.array:
        logits = self.model.decode(inputs, cache)
        x = self.weight
        for _ in range(self.products):
            x = mx.tanh(x @ self.weight)  # bounded: times zero, it adds zero
        return logits + 0.0 * mx.sum(x)


def batch_of_two(decoder: SpeculativeDecoder, max_tokens: int = MAX_TOKENS) -> list[tuple]:
    """Decode PROMPTS[:2] in a batch of two, checking that their tokens are
    those of regular decoding; for each round, its rows, whether it drafted
    and whether the draft model was started after it."""
    generator = decoder.batch_generator(max_batch_size=2)
    uids = [generator.insert(prompt, max_tokens=max_tokens) for prompt in PROMPTS[:2]]
    rounds, last = [], {}
    while len(generator):
        events = generator.next()
        drafts = any(
            result.n_draft > (last[uid].n_draft if uid in last else 0) for uid, result in events
        )
        last.update(events)
        started = generator.drafter is not None and not generator.drafter.start_pending
        rounds.append((len(generator.rows), drafts, started))
    regular = [decoder.generate(prompt, max_tokens=max_tokens).tokens for prompt in PROMPTS[:2]]
    assert [last[uid].tokens for uid in uids] == regular
    return rounds


def test_auto_abandons_a_draft_model_whose_rounds_deliver_less(decoding_pair):
    """The cost model (a draft step at 0.1 plain steps) would draft every
    round, but each draft-model pass costs products that are computed only
    when the round's tokens are read: drafted rounds deliver far fewer
    tokens per second than plain steps. After PLAIN_FIRST plain steps auto
    drafts JUDGED_ROUNDS rounds, then steps plainly with its draft model
    dropped; the decoder's next batch starts from that verdict."""
    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, LazilySlow(draft_model, 8), tokenizer, num_draft="auto")
    cheap_drafts(decoder, judged=True)
    rounds = [(drafts, started) for rows, drafts, started in batch_of_two(decoder) if rows == 2]
    # The drafted rounds, and the cost model's own plain probe (its PROBE_EVERY-th round).
    judged = PLAIN_FIRST + JUDGED_ROUNDS + 1
    assert rounds[:PLAIN_FIRST] == [(False, False)] * PLAIN_FIRST
    assert [drafts for drafts, _ in rounds[:judged]].count(True) == JUDGED_ROUNDS
    # Then plain steps, the draft model dropped.
    assert rounds[judged:] == [(False, False)] * (len(rounds) - judged)
    assert len(rounds) > judged + 4
    assert not any(drafts for rows, drafts, _ in batch_of_two(decoder) if rows == 2)


def test_auto_keeps_a_draft_model_whose_rounds_deliver_more(decoding_pair):
    """Here the main model's passes cost the products computed when read,
    and the draft model is the main model's weights without them: drafting
    delivers several times the tokens per second, and auto keeps at it
    after its first plain steps, in this batch and the next."""
    model, _, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(LazilySlow(model, 8), model, tokenizer, num_draft="auto")
    cheap_drafts(decoder, judged=True)
    rounds = []
    while len(rounds) < PLAIN_FIRST + 3 * JUDGED_ROUNDS:  # batch after batch
        rounds += [drafts for rows, drafts, _ in batch_of_two(decoder, 3 * MAX_TOKENS) if rows == 2]
    # Every round after them drafts but the cost model's own plain probes
    # (one in PROBE_EVERY rounds at most).
    assert rounds[:PLAIN_FIRST] == [False] * PLAIN_FIRST
    assert rounds[PLAIN_FIRST:].count(False) <= len(rounds) / PROBE_EVERY
    assert not next(iter(decoder.auto.deliveries.values())).vetoes(2)
