"""Drafting modes: prompt lookup, hybrid and ``num_draft="auto"`` keep the main
model's greedy output; the auto rule's formula; ``from_draft``."""

import mlx.core as mx
import pytest
from fixtures import auto_costs, cheap_drafts, linear_round_costs

from auto import (
    CALIBRATION_PROMPT_TOKENS,
    MAX_AUTO_DRAFT,
    Auto,
    AutoDraftLength,
    best_num_draft,
    draft_start_cost,
    expected_tokens_per_round,
    pass_times,
    piecewise_linear,
)
from cache import compacted_rows
from decoder import SpeculativeDecoder
from drafting import FixedDraftLength, ModelDrafter, RowState, find_continuation
from sampling import RowSampling, Sampling
from scheduler import row_state
from speculative import Options

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
    assert best_num_draft(0.75, cheap) == 5
    # A round of 4 draft tokens 10% cheaper than the line: g = 4 gives 3.051 / 1.3.
    assert best_num_draft(0.75, cheap[:4] + [1.3] + cheap[5:]) == 4
    # g = 1 yields 1.4 tokens for 1.3 passes; g = 2 1.56 for 1.6.
    assert best_num_draft(0.4, linear_round_costs(0.3)) == 1
    # Drafting does not pay (1.2 tokens for 1.5 passes at g = 1): a plain step.
    assert best_num_draft(0.2, linear_round_costs(0.5)) == 0
    assert best_num_draft(0.99, linear_round_costs(0.0)) == 16


def test_auto_weighs_starting_the_draft_model():
    # A draft model whose prompts take 50 ms to encode, for 16 rows with 160
    # tokens left, a plain step over them taking 28 ms: 50 / 160 / (28 / 16).
    assert draft_start_cost(0.050, 160, 0.028, 16) == pytest.approx(0.1786, abs=1e-4)
    # At acceptance 0.8 with draft steps of 0.5 plain steps, g = 2 yields 2.44
    # tokens for 2.0 steps (1.22x); each token carrying 0.1 steps of the start,
    # 2.44 for 2.244 (1.09x); carrying 0.25, 2.44 for 2.61 (0.93x), g = 1
    # 1.8 for 1.95 (0.92x): a plain step.
    costs = linear_round_costs(0.5)
    assert best_num_draft(0.8, costs) == 2
    assert best_num_draft(0.8, costs, start_cost=0.1) == 2
    assert best_num_draft(0.8, costs, start_cost=0.25) == 0
    # In auto, a start cost weighs on model drafts only.
    length = accepting(AutoDraftLength({1: auto_costs(0.5)}), 0.8)
    assert length.choose("model", start_cost=0.25) == 0
    assert length.choose("model") == 2
    assert length.choose("lookup", start_cost=0.25) > 0


def test_starting_the_lazy_draft_model_is_weighed_until_it_starts(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    cheap_drafts(decoder)
    decoder.auto.plain_step_seconds[2] = 0.010  # as if calibrated at 2 rows
    generator = decoder.batch_generator(max_batch_size=2)
    for prompt in PROMPTS[:2]:
        generator.insert(prompt, Options(MAX_TOKENS))
    generator._admit()  # the prompts join, as a round starts
    assert generator.drafter.start_pending  # lazy: not started
    live, limits = list(generator.rows), [MAX_TOKENS - 1] * 2
    rule = generator.draft_length
    start, choose, weighed = rule.start, rule.choose, []

    def recording(source: str, batch_size: int = 1, start_cost: float = 0.0) -> int:
        weighed.append(start_cost)
        return choose(source, batch_size, start_cost)

    rule.choose = recording

    def start_cost() -> float:
        """The start cost the rule weighs in the next round's choice."""
        weighed.clear()
        rule.plan([row_state(row) for row in live], limits, generator.drafter)
        return weighed[0]

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
    length = AutoDraftLength({1: auto_costs(0.1)})
    assert length.choose("model") == 5  # the prior, alpha 0.75
    for _ in range(20):
        length.update("model", 0, 1)  # every tested token rejected
        length.update("lookup", 6, 6)  # every one accepted
    assert length.choose("model") == 1
    assert length.choose("lookup") == 16
    assert FixedDraftLength(3).plan([], [3], None) == {"model": 3, "lookup": 3}


def test_auto_weighs_the_costs_of_the_rounds_rows():
    """Each round's choice weighs the costs calibrated at the fewest rows at
    least as many as the round's (or the most)."""
    length = AutoDraftLength({1: auto_costs(0.1), 8: auto_costs(0.9)})
    assert length.choose("model", batch_size=1) == 5
    # At 8 rows a draft step costs 0.9 plain steps: at 0.75, 1.75 tokens for 1.9.
    assert [length.choose("model", batch_size=n) for n in (2, 8, 16)] == [0, 0, 0]
    assert length.choose("lookup", batch_size=8) == 16
    # The round's plan weighs its own rows (places, free ones included).
    assert length.plan([RowState(True)], [5], None)["model"] == 5
    assert length.plan([RowState(True), RowState(False)], [5, 0], None)["model"] == 0


def test_a_batchs_acceptance_counts_every_rows_tested_draft_tokens(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft="auto")
    cheap_drafts(decoder)
    generator = decoder.batch_generator(max_batch_size=2)
    uids = [generator.insert(prompt, Options(MAX_TOKENS)) for prompt in PROMPTS]
    results = {}
    while len(generator):
        results.update(generator.next())
    accepted = sum(results[uid].n_accepted for uid in uids)
    tested = accepted + sum(results[uid].n_rejected for uid in uids)
    assert tested > accepted > 0
    assert generator.draft_length.counts["model"] == pytest.approx([3 + accepted, 4 + tested])


def test_auto_stops_drafting_a_draft_that_does_not_pay():
    # A round of one draft token costs 1.55 plain steps: it pays above 0.55 acceptance.
    length = AutoDraftLength({1: auto_costs(0.55)})
    assert length.choose("model") == 1  # the prior, 0.75
    length.update("model", 0, 1)  # 3 of 5
    assert length.choose("model") == 1
    length.update("model", 0, 1)  # 3 of 6
    assert length.choose("model") == 0
    # Another batch starts from the prior.
    assert AutoDraftLength({1: auto_costs(0.55)}).choose("model") == 1


def accepting(length: AutoDraftLength, rate: float, tests: int = 100) -> AutoDraftLength:
    """``length`` after ``tests`` one-token rounds accepting at ``rate``."""
    for i in range(tests):
        length.update("model", int(i < rate * tests), 1)
    return length


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
    drafts = [drafter.propose(sequences, greedy, {"model": 3}, [3, 3]) for drafter in drafters]
    assert lazy.cache is not None and lazy.encoding_time > 0.0 == eager.encoding_time
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()
    # Differently ordered prompts would draft otherwise.
    wrong = ModelDrafter(draft_model, [prompts[1], prompts[0]])
    assert wrong.propose(sequences, greedy, {"model": 3}, [3, 3]).tokens.tolist() != (
        drafts[0].tokens.tolist()
    )
    # Started, it drafts as the eager drafter does for rows that join later.
    for drafter in drafters:
        drafter.admit([2], [prompts[1]])
        drafter.keep_rows([2, 0])  # a new row 0; row 0 now row 1
    first_draft_token = drafts[0].tokens.tolist()[0][0]
    # Row 1 accepted its first draft token, then made a plain step.
    sequences = [[start, 4], [start, 5, 7, first_draft_token, 9]]
    drafts = [drafter.propose(sequences, greedy, {"model": 2}, [2, 2]) for drafter in drafters]
    assert drafts[0].tokens.tolist() == drafts[1].tokens.tolist()


def test_auto_counts_every_tested_draft_token():
    length = AutoDraftLength({1: auto_costs(0.1)})
    for _ in range(50):
        length.update("model", 1, 2)  # the first token accepted, the second rejected
    # (3 + 50) / (4 + 100): g = 2 yields 1.77 tokens for 1.2 steps, g = 1 1.51 for 1.1.
    assert length.rate("model") == pytest.approx(53 / 104)
    assert length.choose("model") == 2
    assert length.rate("lookup") == 0.75  # the prior


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
        drafting: decoder.auto.measure_costs(prompt_ids) for drafting, decoder in decoders.items()
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
    and where each row of the cache ended before it; and the number of
    tokens of every prompt it encodes."""

    def __init__(self, model):
        self.model, self.passes, self.encoded = model, [], []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def decode(self, inputs: mx.array, cache):
        self.passes.append((inputs.shape[1], cache.self_attn[0].ends))
        return self.model.decode(inputs, cache)

    def encode(self, prompt_ids: mx.array) -> mx.array:
        self.encoded.append(prompt_ids.shape[1])
        return self.model.encode(prompt_ids)


def test_calibration_costs_the_same_for_any_prompt(decoding_pair):
    """auto's calibration times passes on the first CALIBRATION_PROMPT_TOKENS
    of a prompt, however long."""
    model, _, tokenizer = decoding_pair
    recording = RecordingPasses(model)
    auto = Auto(recording, None, prompt_lookup=2)
    long_prompt = tokenizer(PROMPTS[0]).input_ids * 20
    auto.measure_costs(long_prompt)
    assert recording.encoded == [CALIBRATION_PROMPT_TOKENS] < [len(long_prompt)]


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
