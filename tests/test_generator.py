"""The batch generator: prompts join a running batch and leave it (finished
or cancelled) without changing any other row; each row samples with its own
settings and its own noise, so a seeded prompt gets the text regular decoding
gives it alone; events are snapshots; bad prompts are named by their index."""

import time
from collections import Counter

import mlx.core as mx
import pytest
from fixtures import auto_costs, cheap_drafts
from test_batch import PROMPTS
from test_sampling_distribution import (
    MAX_TOKENS,
    NUM_DRAFT,
    PROMPT,
    RUNS,
    TEMP,
    chi_square_p_value,
    exact_distribution,
)

from decoder import SpeculativeDecoder
from model import encoder_passes
from sampling import RowSampling, Sampling
from scheduler import HOLD_FREE_ROWS
from speculative import Options

MAX_NEW = 12
SAMPLED = Sampling(temp=0.8)


def drain(generator) -> dict[int, object]:
    """Run ``generator`` to the end; the last result of every uid."""
    last = {}
    while len(generator):
        for uid, result in generator.next():
            last[uid] = result
    return last


def as_lists(result) -> tuple:
    """What a result holds, copied."""
    return list(result.tokens), list(result.from_draft), list(result.draft_lengths), result.text


def test_events_are_snapshots(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    events, as_yielded = [], []
    for index, result in decoder.stream_batch(PROMPTS[:3], batch_size=2, max_tokens=4):
        events.append((index, result))
        as_yielded.append(as_lists(result))
    assert [as_lists(result) for _, result in events] == as_yielded
    assert sum(result.finished for _, result in events) == 3
    for index in range(3):
        lengths = [len(r.tokens) for i, r in events if i == index]
        assert len(lengths) > 1 and lengths == sorted(lengths)
        assert lengths[0] < lengths[-1]


@pytest.mark.parametrize(
    ("prompts", "error", "message"),
    [
        (["a", ""], ValueError, "prompt 1: the prompt is empty"),
        (["a", "b", None], TypeError, "prompt 2: a prompt must be a string or a sequence"),
        ([[5, 6], [5, 10**6]], ValueError, "prompt 1: token id 1000000 is outside the vocabulary"),
        ([[5, 6], [5, 1.5]], TypeError, "prompt 1: a prompt must be"),
    ],
)
def test_a_bad_prompt_is_named_by_its_index(prompts, error, message, decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair)
    with pytest.raises(error, match=message):
        decoder.generate_batch(prompts)


@pytest.mark.parametrize(
    "options",
    [
        {"num_draft": 3},
        {"num_draft": 3, "draft_model": None, "prompt_lookup": 2},
        {"speculative": False},
    ],
    ids=["draft model", "prompt lookup", "regular"],
)
def test_a_seeded_prompt_gets_its_regular_text_at_any_batch_size_and_place(options, decoding_pair):
    """The text regular decoding gives the prompt alone with that seed."""
    model, draft_model, tokenizer = decoding_pair
    options = dict(options)
    speculative = options.pop("speculative", True)
    decoder = SpeculativeDecoder(
        model, options.pop("draft_model", draft_model), tokenizer, **options
    )
    sampling = {"max_tokens": MAX_NEW, "temp": SAMPLED.temp, "seed": 5}
    prompts = PROMPTS[:6]
    alone = [decoder.generate(p, **sampling).tokens for p in prompts]
    for batch_size, order in ((4, prompts), (6, prompts[::-1]), (1, prompts[1:] + prompts[:1])):
        results = decoder.stream_batch(
            order, speculative=speculative, batch_size=batch_size, **sampling
        )
        texts = {order[i]: r.tokens for i, r in results if r.finished}
        assert [texts[p] for p in prompts] == alone, f"batch size {batch_size}"
    other_seed = [
        decoder.speculative_decode(p, **{**sampling, "seed": 6}).tokens for p in prompts[:3]
    ]
    assert other_seed != alone[:3]  # the seed matters: the check is not vacuous


def test_greedy_rows_among_sampled_rows_are_greedy(decoding_pair):
    """Greedy and sampled rows share every pass; each keeps its own rule."""
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=3)
    generator = decoder.batch_generator(max_batch_size=8)
    greedy, sampled = {}, {}
    for i, prompt in enumerate(PROMPTS[:8]):
        if i % 2:
            greedy[generator.insert(prompt, Options(MAX_NEW))] = prompt
        else:
            # Seeded: unseeded, whether a row drew a rejection varied run to run.
            uid = generator.insert(prompt, Options(MAX_NEW, temp=1.5, seed=i))
            sampled[uid] = prompt
    results = drain(generator)
    for uid, prompt in greedy.items():
        assert results[uid].tokens == decoder.generate(prompt, max_tokens=MAX_NEW).tokens
    # The sampled rows did sample: none drew its greedy text.
    for uid, prompt in sampled.items():
        assert results[uid].tokens != decoder.generate(prompt, max_tokens=MAX_NEW).tokens


def test_prompts_join_and_leave_a_running_batch(decoding_pair):
    """Prompts inserted between rounds and a cancelled row change nothing
    in the other rows; the cancelled row yields nothing more and its place
    is freed."""
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    generator = decoder.batch_generator(max_batch_size=3)
    prompts = {generator.insert(p, Options(MAX_NEW)): p for p in PROMPTS[:2]}
    last = {}
    for uid, result in generator.next():
        last[uid] = result
    cancelled = generator.insert(PROMPTS[2], Options(MAX_NEW))
    prompts |= {generator.insert(p, Options(MAX_NEW)): p for p in PROMPTS[3:6]}
    generator.next()  # the cancelled prompt joined the batch
    assert any(row is not None and row.uid == cancelled for row in generator.rows)
    before = len(generator)
    generator.cancel(cancelled)
    assert len(generator) == before - 1
    events = generator.next()
    assert cancelled not in {uid for uid, _ in events}
    assert all(row is None or row.uid != cancelled for row in generator.rows)
    last |= dict(events) | drain(generator)
    assert cancelled not in last
    for uid, prompt in prompts.items():
        assert last[uid].tokens == decoder.generate(prompt, max_tokens=MAX_NEW).tokens, prompt
    assert not generator.rows and generator.main_cache is None  # an idle generator holds nothing


def test_a_freed_place_is_taken_in_place_then_dropped(decoding_pair):
    """A finished row's place stays in the caches for HOLD_FREE_ROWS rounds:
    a prompt inserted meanwhile takes it (the batch keeps its rows where
    they are); with nothing waiting it is dropped after them. Every row
    still gets its greedy text."""
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    # Regular decoding (a token per round) of the two prompts that run longest.
    generator = decoder.batch_generator(speculative=False, max_batch_size=3)
    lasting = sorted(PROMPTS[1:], key=lambda p: len(decoder.generate(p, max_tokens=MAX_NEW).tokens))
    assert len(decoder.generate(lasting[-2], max_tokens=MAX_NEW).tokens) > 3 + HOLD_FREE_ROWS
    prompts = {generator.insert(PROMPTS[0], Options(1)): (PROMPTS[0], 1)}
    prompts |= {generator.insert(p, Options(MAX_NEW)): (p, MAX_NEW) for p in lasting[-2:]}
    last = dict(generator.next())  # the one-token prompt finished
    last |= dict(generator.next())  # a round with nothing waiting
    (place,) = [i for i, row in enumerate(generator.rows) if row is None]
    assert len(generator.rows) == 3
    joined = generator.insert(PROMPTS[0], Options(MAX_NEW))
    last |= dict(generator.next())
    assert generator.rows[place].uid == joined and len(generator.rows) == 3
    generator.cancel(joined)
    del last[joined]
    for _ in range(HOLD_FREE_ROWS):
        last |= dict(generator.next())
        assert generator.rows[place] is None and len(generator.rows) == 3
    last |= dict(generator.next())
    assert len(generator.rows) == 2 and len(generator.main_cache.lengths) == 2
    last |= drain(generator)
    for uid, (prompt, max_tokens) in prompts.items():
        assert last[uid].tokens == decoder.generate(prompt, max_tokens=max_tokens).tokens


def test_a_rows_samples_follow_the_main_model_among_other_settings(decoding_pair):
    """Rows of PROMPT at TEMP share batches with greedy rows and rows at
    other temperatures, top-p and top-k: their first two tokens follow the
    main model's distribution at TEMP."""
    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=NUM_DRAFT)
    others = [Sampling(), Sampling(1.5), Sampling(0.7, top_p=0.8), Sampling(1.0, top_k=3)]
    generator = decoder.batch_generator(max_batch_size=64)
    mx.random.seed(0)
    mine = []
    for i in range(RUNS):
        mine.append(generator.insert(PROMPT, Options(MAX_TOKENS, temp=TEMP)))
        if i % 2:
            setting = others[i // 2 % len(others)]
            generator.insert(
                PROMPTS[i % 5], Options(MAX_TOKENS, setting.temp, setting.top_p, setting.top_k)
            )
    results = drain(generator)
    counts = Counter(tuple(results[uid].tokens[:2]) for uid in mine)
    prompt_ids = mx.array([tokenizer(PROMPT).input_ids])
    distribution = exact_distribution(model, prompt_ids, Sampling(temp=TEMP))
    assert chi_square_p_value(counts, distribution) > 1e-3


def test_row_sampling_applies_each_rows_setting():
    """Each row of a mixed batch gets the distribution its own setting gives alone."""
    logits = mx.random.normal((4, 3, 50), key=mx.random.key(0)) * 3
    settings = [Sampling(), Sampling(0.5, top_k=5), Sampling(2.0, top_p=0.6), Sampling(1.0)]
    mixed = RowSampling(settings).probabilities(logits)
    for row, setting in enumerate(settings):
        alone = setting.probabilities(logits[row : row + 1])
        assert mx.allclose(mixed[row : row + 1], alone, atol=1e-6).item(), setting


class SlowPrompts:
    """A model whose prompt encoding takes ``delay`` seconds more."""

    def __init__(self, model, delay: float):
        self.model, self.delay = model, delay

    def __getattr__(self, name):
        return getattr(self.model, name)

    def prompt_cache(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.model.prompt_cache(*args, **kwargs)


def test_auto_counts_its_draft_models_encoding_as_prompt_time(decoding_pair):
    """auto's draft model encodes the batch's prompts in the round that
    first drafts: the rows' prompt time, shared evenly."""
    model, draft_model, tokenizer = decoding_pair
    delay = 0.5
    decoder = SpeculativeDecoder(model, SlowPrompts(draft_model, delay), tokenizer, "auto")
    decoder.auto.measure_costs = lambda *args, **kwargs: auto_costs(0.1)  # drafting pays
    generator = decoder.batch_generator(max_batch_size=2)
    for prompt in PROMPTS[:2]:
        generator.insert(prompt, Options(MAX_NEW))
    events = generator.next()
    assert all(result.n_draft > 0 for _, result in events)  # the first round drafted
    assert all(result.prompt_time > delay / 2 for _, result in events)


@pytest.mark.parametrize("mode", ["draft model", "draft model auto", "prompt lookup", "regular"])
@pytest.mark.parametrize(
    ("prompts", "passes"),
    [([PROMPTS[3], PROMPTS[9]], 1), ([PROMPTS[0], PROMPTS[2]], 2)],
    ids=["one pass", "two passes"],
)
def test_prompt_progress_counts_every_encoder_layer(mode, prompts, passes, decoding_pair):
    """``prompt_progress`` gets (0, total), then (k, total) after each encoder
    layer of every model that encodes the prompts, in every padded pass;
    with "auto" the draft model encodes them when it first drafts, if ever."""
    main_model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(
        main_model,
        draft_model if mode.startswith("draft model") else None,
        tokenizer,
        num_draft="auto" if mode.endswith("auto") else 2,
        prompt_lookup=2 if mode == "prompt lookup" else 0,
    )
    if mode.endswith("auto"):
        cheap_drafts(decoder)  # so that it drafts, from the first round
    # The prompts are of lengths that take this many passes (see ENCODE_TOGETHER_RATIO).
    assert len(encoder_passes([decoder.prompt_ids(prompt) for prompt in prompts])) == passes
    layers = main_model.args.num_layers
    if mode == "draft model":
        layers += draft_model.args.num_layers
    calls = []
    events = decoder.stream_batch(
        prompts,
        speculative=mode != "regular",
        max_tokens=3,
        prompt_progress=lambda done, total: calls.append((done, total)),
    )
    next(events)  # the batch's prompts are encoded before its first round
    total = passes * layers
    assert calls == [(done, total) for done in range(total + 1)]
    # A single prompt: a batch of one, one pass.
    calls.clear()
    *_, result = decoder.stream(
        PROMPTS[3],
        speculative=mode != "regular",
        prompt_progress=lambda *c: calls.append(c),
        max_tokens=2,
    )
    assert calls == [(done, layers) for done in range(layers + 1)]
    assert (result.n_draft > 0) == mode.startswith("draft model")


def test_a_short_prompt_decodes_while_a_long_one_encodes(decoding_pair, monkeypatch):
    """Interleaving, a long prompt's encoding is sliced between rounds: a
    short prompt sent after it began joins and finishes while it still
    encodes (counted in events and slices, not timed), and both get the
    text they get alone, with the draft model encoding each too."""
    import model as model_module
    import scheduler

    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=2)
    long_prompt = [5 + i % 40 for i in range(300)] + [1]
    projection, feed_forward = model.args._layer_work
    monkeypatch.setattr(model_module, "ENCODER_SLICE_WORK", 16 * (4 * projection + feed_forward))
    monkeypatch.setattr(scheduler, "IDLE_ENCODING_SECONDS", 0.0)
    generator = decoder.batch_generator(max_batch_size=4, interleave_encoding=True)
    long_uid = generator.insert(long_prompt, Options(MAX_NEW))
    assert generator.next() == [] and len(generator.encodings) == 1  # one slice of it
    short_uid = generator.insert(PROMPTS[0], Options(MAX_NEW))
    last, short_rounds = {}, 0
    while short_uid not in last or not last[short_uid].finished:
        events = dict(generator.next())
        assert long_uid not in events
        assert long_uid in (row.uid for encoding in generator.encodings for row in encoding.rows)
        short_rounds += short_uid in events
        last |= events
    assert short_rounds > 1
    last |= drain(generator)
    assert last[short_uid].tokens == decoder.generate(PROMPTS[0], max_tokens=MAX_NEW).tokens
    assert last[long_uid].tokens == decoder.generate(long_prompt, max_tokens=MAX_NEW).tokens


def test_a_pass_encodes_two_rounds_time_per_prompt_at_once(decoding_pair):
    """Interleaving while rows decode, a pass that has encoded for less than
    JOINING_ROUNDS rounds' time per prompt goes first, credit or not (a
    server's usual requests join at once, even beside short rounds); the
    others wait for the credit, in order."""
    from scheduler import JOINING_ROUNDS, Encoding, Row

    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    generator = decoder.batch_generator(max_batch_size=4, interleave_encoding=True)
    generator.rows = [object()]  # a row decoding
    generator.round_seconds = 0.050
    assert JOINING_ROUNDS == 2

    def encoding(prompts: int, seconds: float) -> Encoding:
        rows = [Row(uid, [5, 1], 4, Sampling(), None) for uid in range(prompts)]
        return Encoding(rows, None, seconds=seconds)

    throttled, other = encoding(1, 0.200), encoding(1, 0.100)
    fresh = encoding(1, 0.090)  # under two rounds' time
    several = encoding(3, 0.250)  # under six
    generator.encodings = [throttled, other, several, fresh]
    generator.encoding_credit = 0.0
    assert generator._next_encoding(True, 0.0) is several
    generator.encodings = [throttled, other, fresh]
    assert generator._next_encoding(True, 0.0) is fresh
    generator.encodings = [throttled, other]
    assert generator._next_encoding(True, 0.0) is None
    generator.encoding_credit = 0.001
    assert generator._next_encoding(True, 0.0) is throttled


def test_a_groups_encoding_budget_is_judged_before_the_round(decoding_pair):
    """What a group's rank 0 decides a round encodes (``encoding_budget``),
    before it: nothing with nothing to encode; one slice for a pass not yet
    timed; with rows decoding, the first pass's free seconds left or the
    credit, over its seconds per slice, at least one; idle,
    IDLE_ENCODING_SECONDS' worth. The generator then computes that many."""
    from scheduler import IDLE_ENCODING_SECONDS, Encoding, Row

    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    generator = decoder.batch_generator(max_batch_size=4, interleave_encoding=True)
    assert generator.encoding_budget() == 0
    generator.insert(PROMPTS[1], Options(MAX_NEW))
    assert generator.encoding_budget() == 1
    generator.waiting.clear()
    row = Row(0, [5, 1], 4, Sampling(), None)
    generator.encodings = [Encoding([row], None)]  # not yet timed
    assert generator.encoding_budget() == 1
    generator.encodings = [Encoding([row], None, seconds=0.0201, done=2)]  # 10 ms a slice
    assert generator.encoding_budget() == int(IDLE_ENCODING_SECONDS / 0.01005)
    generator.rows, generator.round_seconds = [object()], 0.050  # a row decoding
    assert generator.encoding_budget() == 7  # 2 rounds' 100 ms, less 20 ms spent
    generator.encoding_credit = 0.2
    assert generator.encoding_budget() == 19
    generator.encodings = [Encoding([row], None, seconds=0.5, done=10)]
    generator.encoding_credit = 0.0
    assert generator.encoding_budget() == 1  # past its free seconds, no credit: one


def test_a_prompt_cancelled_while_encoding_leaves_nothing(decoding_pair):
    """A prompt cancelled while its pass encodes leaves the generator, its
    pass too when no prompt of it is left."""
    import scheduler

    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    generator = decoder.batch_generator(max_batch_size=4, interleave_encoding=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scheduler, "IDLE_ENCODING_SECONDS", 0.0)
        uid = generator.insert([5 + i % 40 for i in range(300)] + [1])
        generator.next()
    assert len(generator) == 1 and generator.encodings
    generator.cancel(uid)
    assert len(generator) == 0 and not generator.encodings and generator.next() == []
