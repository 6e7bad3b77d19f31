"""Batched decoding is exact for every row: the same tokens as the prompt
decoded alone at temperature 0, the main model's distribution when sampling,
and the same logits as a row decoded alone, whatever the other rows do.
Each check is shown to catch a wrong per-row trim and per-row positions
taken from another row."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest
from fixtures import auto_costs, cheap_drafts
from test_sampling_distribution import (
    MAX_TOKENS,
    NUM_DRAFT,
    POWER_RUNS,
    PROMPT,
    RUNS,
    TEMP,
    chi_square_p_value,
    exact_distribution,
)

from cache import DecoderCache, KVCache, compacted_rows
from decoder import SpeculativeDecoder
from sampling import Sampling
from scheduler import SORT_WINDOW, iter_rounds, longest_first
from speculative import Options

# Prompts of very different lengths (3 to about 160 tokens).
PROMPTS = [
    "hi",
    "translate English to German: the house is small and the garden is green.",
    "summarize: " + "the children walked to the old market by the river in the morning. " * 12,
    "question: where is the big red book? context: the book lies on the kitchen table.",
    "the dog",
    "translate English to French: we are going to the sea tomorrow.",
    "summarize: " + "heavy rain fell on the green garden for three days and nights. " * 5,
    "restore: the old man walks to the market by the river.",
    "a",
    "translate English to German: the old bridge was closed, so we took the ferry.",
]
MAX_NEW = 30


def with_eos(model, eos):
    """The same weights, reading ``eos`` as the end of sequence."""
    changed = type(model)(dataclasses.replace(model.args, eos_token_id=eos))
    changed.update(model.parameters())
    return changed


@pytest.fixture(scope="module")
def early_ending_pair(decoding_pair):
    """The decoding pair with a frequent output token read as the end of
    sequence, so rows end at different points, many before MAX_NEW."""
    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, None, tokenizer)
    outputs = [decoder.generate(prompt, max_tokens=MAX_NEW).tokens for prompt in PROMPTS]
    counts = np.bincount([t for tokens in outputs for t in tokens[2:]])
    eos = int(counts.argmax())
    return with_eos(model, eos), with_eos(draft_model, eos), tokenizer


DRAFTING = {
    "regular": {},
    "draft model": {"num_draft": 3},
    "draft model auto": {"num_draft": "auto"},
    "prompt lookup": {"num_draft": 4, "prompt_lookup": 2, "draft_model": None},
    "hybrid auto": {"num_draft": "auto", "prompt_lookup": 3},
}


def decoder_for(pair, drafting: str) -> SpeculativeDecoder:
    model, draft_model, tokenizer = pair
    options = dict(DRAFTING[drafting])
    draft_model = options.pop("draft_model", draft_model)
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, **options)
    # g about 3 where the draft agrees: rounds of every length, lookup's too.
    cheap_drafts(decoder, draft_cost=0.4)
    return decoder


def check_rows_equal_alone(pair, drafting: str, batch_size: int) -> None:
    decoder = decoder_for(pair, drafting)
    alone = [decoder.generate(prompt, max_tokens=MAX_NEW) for prompt in PROMPTS]
    decode = decoder.generate_batch if drafting == "regular" else decoder.speculative_decode_batch
    batched = decode(PROMPTS, batch_size=batch_size, max_tokens=MAX_NEW)
    for prompt, one, row in zip(PROMPTS, alone, batched, strict=True):
        assert row.tokens == one.tokens, prompt
        assert row.text == one.text
    lengths = [len(r.tokens) for r in alone]
    assert min(lengths) < MAX_NEW / 2 and max(lengths) == MAX_NEW  # rows end early, others not
    if drafting != "regular":
        assert sum(r.n_accepted for r in batched) > 0
        assert sum(r.n_rejected for r in batched) > 0
    if "lookup" in drafting or "hybrid" in drafting:
        assert sum(r.n_lookup_rounds for r in batched) > 0


@pytest.mark.parametrize("batch_size", [1, 3, 16])
@pytest.mark.parametrize("drafting", list(DRAFTING))
def test_every_row_equals_its_prompt_decoded_alone(drafting, batch_size, early_ending_pair):
    """Rows of very different prompt lengths, ending early or not, and (at
    batch size 3) rows refilled from the queue as others finish."""
    check_rows_equal_alone(early_ending_pair, drafting, batch_size)


def test_rows_decoded_before_auto_first_drafts_equal_their_prompts_alone(early_ending_pair):
    """auto steps plainly while drafting does not pay, then drafts once its
    costs say it pays (here: made cheap after DRAFTING_FROM rounds): its
    draft model encodes the rows' prompts then (``ModelDrafter``'s lazy
    mode), after rows joined and left, and each row's draft cache catches
    up on its whole output."""
    drafting_from = 24
    decoder = decoder_for(early_ending_pair, "draft model auto")
    cheap_drafts(decoder, draft_cost=0.9)  # pays above 0.9 acceptance: the prior, 0.75, is far
    alone = [decoder.generate(prompt, max_tokens=MAX_NEW) for prompt in PROMPTS]
    generator = decoder.batch_generator(max_batch_size=3)
    uids = [generator.insert(prompt, Options(MAX_NEW)) for prompt in PROMPTS]
    results, first_drafted, joined_before = {}, None, set()
    for events in iter_rounds(generator):
        results.update(events)
        if first_drafted is None and any(result.n_draft for _, result in events):
            first_drafted = generator.rounds
        if first_drafted is None:
            joined_before.update(uid for uid, _ in events)
        if generator.rounds == drafting_from:
            for costs in generator.draft_length.round_costs.values():
                costs["model"] = auto_costs(0.1)["model"]
    assert [results[uid].tokens for uid in uids] == [result.tokens for result in alone]
    assert first_drafted == drafting_from + 1
    assert len(joined_before) > 3  # rows joined the batch of 3 before it drafted


def wrong_trim(original):
    """``KVCache.trim`` that trims every row by row 0's count."""

    def trim(self, counts):
        if isinstance(counts, list):
            counts = [counts[0]] * len(counts)
        return original(self, counts)

    return trim


def first_row_columns(original):
    """``DecoderCache.reserve`` that gives every row row 0's columns."""

    def reserve(self, length, tree=None):
        columns, keys, hidden = original(self, length, tree)
        return mx.broadcast_to(columns[:1], columns.shape), keys, hidden

    return reserve


def starts_not_hidden(original):
    """``DecoderCache.reserve`` whose mask hides only later columns, not
    those before a row's start (where an earlier row's keys may lie)."""

    def reserve(self, length, tree=None):
        columns, keys, hidden = original(self, length, tree)
        return columns, keys, mx.arange(hidden.shape[-1]) > columns[..., None]

    return reserve


BUGS = {
    "trim by row 0's count": (KVCache, "trim", wrong_trim(KVCache.trim)),
    "columns of row 0": (DecoderCache, "reserve", first_row_columns(DecoderCache.reserve)),
    "starts not hidden": (DecoderCache, "reserve", starts_not_hidden(DecoderCache.reserve)),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_the_greedy_check_catches_wrong_per_row_bookkeeping(bug, early_ending_pair, monkeypatch):
    monkeypatch.setattr(*BUGS[bug])
    with pytest.raises(AssertionError):
        check_rows_equal_alone(early_ending_pair, "draft model", 3)


def test_results_come_in_input_order_with_their_own_counts(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=3)
    results = decoder.speculative_decode_batch(PROMPTS, batch_size=4, max_tokens=12)
    for prompt, result in zip(PROMPTS, results, strict=True):
        alone = decoder.speculative_decode(prompt, max_tokens=12)
        assert result.tokens == alone.tokens
        assert result.finished
        assert result.prompt_tokens == len(decoder.tokenizer(prompt).input_ids)
        assert len(result.from_draft) == len(result.tokens)
        assert sum(result.from_draft) == result.n_accepted
        assert result.n_draft == sum(result.draft_lengths)


def test_stream_batch_yields_every_row_after_every_pass(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=2)
    seen = {}
    for index, result in decoder.stream_batch(PROMPTS[:5], batch_size=2, max_tokens=6):
        assert not seen.get(index, (0, False))[1], "a row yielded after it finished"
        seen[index] = (len(result.tokens), result.finished)
    assert sorted(seen) == list(range(5))
    assert all(finished for _, finished in seen.values())


def test_a_list_of_prompts_is_taken_longest_first_within_each_window(decoding_pair):
    lengths = [3, 5, 5, 2, 9, 1]
    assert longest_first([[7] * n for n in lengths], 4) == [1, 2, 0, 3, 4, 5]
    decoder = SpeculativeDecoder(*decoding_pair)
    prompts = PROMPTS[: SORT_WINDOW + 1]
    first_index, _ = next(decoder.stream_batch(prompts, batch_size=1, max_tokens=2))
    window = [len(decoder.prompt_ids(prompt)) for prompt in prompts[:SORT_WINDOW]]
    assert first_index == window.index(max(window))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompts": []}, "prompts"),
        ({"prompts": "one string"}, "prompts"),
        ({"batch_size": 0}, "batch_size"),
        ({"seed": -3}, "seed"),
    ],
)
def test_bad_batch_arguments_are_refused(kwargs, message, decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair)
    arguments = {"prompts": PROMPTS[:2], **kwargs}
    with pytest.raises(ValueError, match=message):
        decoder.generate_batch(**arguments)


def batch_logits_and_alone(model, prompts: list[list[int]], rounds: list[list[list[int]]]):
    """Decode ``rounds`` (per round, per row: tokens fed, then how many to
    trim, as the last entry) in one padded batch and each row alone; return
    the last round's logits of both, [B, T, vocab]."""
    batch = model.prompt_cache(prompts)
    alone = [model.make_cache(model.encode(mx.array([p]))) for p in prompts]
    for round_ in rounds:
        tokens = mx.array([row[:-1] for row in round_])
        batch_logits = model.decode(tokens, batch)
        alone_logits = [model.decode(tokens[i : i + 1], cache) for i, cache in enumerate(alone)]
        trims = [row[-1] for row in round_]
        batch.trim(trims)
        for cache, trim in zip(alone, trims):
            cache.trim(trim)
    return np.array(batch_logits), np.array(mx.concatenate(alone_logits))


@pytest.mark.parametrize("lengths", [(2, 39, 8), (9, 16, 12)])
def test_padded_batch_logits_equal_each_row_alone(lengths, decoding_pair):
    """After rounds that leave the rows at different lengths, a padded batch
    scores each row as that row alone, to float32 rounding: prompts of 3, 40
    and 9 tokens (encoded apart, their cross-attention padded) and of 10, 17
    and 13 tokens (encoded together, padded)."""
    model = decoding_pair[0]
    rng = np.random.default_rng(0)
    vocab = model.args.vocab_size
    prompts = [rng.integers(2, vocab, n).tolist() + [1] for n in lengths]
    rounds = []
    for trims in ([0, 3, 1], [2, 0, 3], [3, 1, 0], [0, 0, 0]):
        rounds.append([[0] + rng.integers(2, vocab, 3).tolist() + [trim] for trim in trims])
    batch, alone = batch_logits_and_alone(model, prompts, rounds)
    scale = np.abs(alone).max()
    assert np.abs(batch - alone).max() <= 1e-5 * max(scale, 1.0)
    assert len(set(alone.argmax(-1).ravel().tolist())) > 3  # not a degenerate fixture


def test_admitted_and_kept_rows_score_as_alone(decoding_pair):
    """Row 1 restarted with a longer prompt and a fourth row added in the
    same admission, then the batch cut to three rows in another order: each
    row still scores as if decoded alone."""
    model = decoding_pair[0]
    rng = np.random.default_rng(1)
    vocab = model.args.vocab_size
    prompts = [rng.integers(2, vocab, n).tolist() + [1] for n in (5, 12, 7)]
    batch = model.prompt_cache(prompts)
    model.decode(mx.array([[0, 5, 6], [0, 7, 8], [0, 9, 10]]), batch)
    batch.trim([1, 0, 2])
    longer, added = (rng.integers(2, vocab, n).tolist() + [1] for n in (30, 20))
    batch.admit([1, 3], model.prompt_cache([longer, added]))
    batch.keep_rows([2, 1, 3])
    # Row 0 is the third prompt with [0] cached; rows 1 and 2 the new prompts, empty.
    logits = model.decode(mx.array([[9, 11], [0, 12], [0, 13]]), batch)
    expected = [
        model(mx.array([prompts[2]]), mx.array([[0, 9, 11]]))[:, 1:],
        model(mx.array([longer]), mx.array([[0, 12]])),
        model(mx.array([added]), mx.array([[0, 13]])),
    ]
    for row, reference in enumerate(expected):
        reference = np.array(reference)
        difference = np.abs(np.array(logits[row : row + 1]) - reference).max()
        assert difference <= 1e-5 * max(np.abs(reference).max(), 1.0)


def test_cross_attention_narrows_when_the_longest_prompt_leaves(decoding_pair):
    """The cross-attention is as wide as the batch's longest prompt: after
    the 40-token prompt leaves (``keep_rows``) or is replaced (``admit``),
    the buffers narrow to the longest left, and every row still scores as
    if decoded alone."""
    model = decoding_pair[0]
    rng = np.random.default_rng(3)
    vocab = model.args.vocab_size
    prompts = [rng.integers(2, vocab, n).tolist() + [1] for n in (5, 40, 7)]

    def check(batch, rows, decoded, width):
        assert all(keys.shape[2] == width for keys, _ in batch.cross_buffers)
        assert batch.memory_mask.shape[-1] == width
        logits = model.decode(mx.array([tokens[-1:] for tokens in decoded]), batch)
        for row, (prompt, tokens) in enumerate(zip(rows, decoded)):
            reference = np.array(model(mx.array([prompt]), mx.array([tokens]))[:, -1:])
            difference = np.abs(np.array(logits[row : row + 1]) - reference).max()
            assert difference <= 1e-5 * max(np.abs(reference).max(), 1.0)

    batch = model.prompt_cache(prompts)
    model.decode(mx.array([[0, 5], [0, 6], [0, 7]]), batch)
    batch.keep_rows([0, 2])  # the 40-token prompt leaves
    check(batch, [prompts[0], prompts[2]], [[0, 5, 8], [0, 7, 9]], 8)
    replacement = rng.integers(2, vocab, 3).tolist() + [1]
    batch.admit([1], model.prompt_cache([replacement]))  # the 8-token prompt is replaced
    check(batch, [prompts[0], replacement], [[0, 5, 8, 10], [0]], 6)


def test_a_row_admitted_past_the_storage_is_kept_as_zeros():
    """A row admitted past the rows a cache's storage holds, then kept in
    another place before any write, holds zeros there: positions past its
    length are masked, but a NaN from memory past the buffer's end would
    still poison the row's scores (seen in 2 of 5 runs of
    test_admitted_and_kept_rows_score_as_alone under OPENBLAS_CORETYPE=Haswell)."""
    cache = KVCache(3)
    for _ in range(20):  # fill freed memory with NaN
        mx.eval(mx.full((4, 2, 64, 8), float("nan")))
    cache.update_and_fetch(mx.ones((3, 2, 2, 8)), mx.ones((3, 2, 2, 8)))
    cache.admit([3])
    cache.keep_rows([2, 1, 3])
    assert cache.lengths == [2, 2, 0]
    assert np.array_equal(np.array(cache.keys[2]), np.zeros((2, 64, 8)))
    assert np.array_equal(np.array(cache.values[2]), np.zeros((2, 64, 8)))
    assert np.array_equal(np.array(cache.keys[0, :, :2]), np.ones((2, 2, 8)))


def test_rows_compacted_in_place_score_as_alone(decoding_pair):
    """Rows 1 and 3 of five leave in the order ``compacted_rows`` gives
    (row 4 moves into place 1, in the same buffers), then a new prompt takes
    a fourth row, one the buffers still hold with row 3's stale keys: every
    row scores as if decoded alone, also after decoding on."""
    model = decoding_pair[0]
    rng = np.random.default_rng(2)
    vocab = model.args.vocab_size
    prompts = [rng.integers(2, vocab, n).tolist() + [1] for n in (6, 11, 4, 9, 14)]
    decoded = [[0] + rng.integers(2, vocab, 3).tolist() for _ in prompts]
    batch = model.prompt_cache(prompts)
    model.decode(mx.array(decoded), batch)
    batch.trim([1, 0, 2, 0, 1])
    decoded = [tokens[: len(tokens) - trim] for tokens, trim in zip(decoded, [1, 0, 2, 0, 1])]
    order = compacted_rows([True, False, True, False, True])
    assert order == [0, 4, 2]
    batch.keep_rows(order)
    assert batch.self_attn[0].keys.shape[0] == 5  # the buffers were kept, not gathered
    prompts, decoded = [prompts[i] for i in order], [decoded[i] for i in order]
    new_prompt = rng.integers(2, vocab, 7).tolist() + [1]
    batch.admit([3], model.prompt_cache([new_prompt]))
    prompts.append(new_prompt)
    decoded.append([])
    for _ in range(2):
        new_tokens = [
            [0] if not tokens else rng.integers(2, vocab, 2).tolist() for tokens in decoded
        ]
        width = max(map(len, new_tokens))
        padded = [tokens + [0] * (width - len(tokens)) for tokens in new_tokens]
        logits = model.decode(mx.array(padded), batch)
        batch.trim([width - len(tokens) for tokens in new_tokens])
        for row, (prompt, tokens) in enumerate(zip(prompts, decoded)):
            tokens += new_tokens[row]
            count = len(new_tokens[row])
            reference = np.array(model(mx.array([prompt]), mx.array([tokens]))[0, -count:])
            difference = np.abs(np.array(logits[row, :count]) - reference).max()
            assert difference <= 1e-5 * max(np.abs(reference).max(), 1.0), row


# The rows' seeds start here: not those of test_sampling_distribution's runs (0 up).
ROW_SEEDS = 10_000


def sample_rows(decoder, prompt=PROMPT, copies=RUNS) -> list[tuple]:
    """The first two tokens of ``copies`` rows of ``prompt``, decoded in
    batches of 64 among half as many rows of shorter and longer prompts."""
    others = ["a", PROMPTS[2], "the dog", PROMPTS[6]]
    prompts = []
    for i in range(copies):
        prompts += [prompt] if i % 2 else [prompt, others[i // 2 % len(others)]]
    # A seed of its own per row: one seed would give every copy of the prompt the same text.
    generator = decoder.batch_generator(max_batch_size=64)
    uids = [
        generator.insert(p, Options(MAX_TOKENS, temp=TEMP, seed=ROW_SEEDS + i))
        for i, p in enumerate(prompts)
    ]
    results = {uid: result for events in iter_rounds(generator) for uid, result in events}
    return [tuple(results[uid].tokens[:2]) for p, uid in zip(prompts, uids) if p == prompt]


@pytest.fixture(scope="module")
def sampling_setting(decoding_pair):
    model, _, tokenizer = decoding_pair
    prompt_ids = mx.array([tokenizer(PROMPT).input_ids])
    distribution = exact_distribution(model, prompt_ids, Sampling(temp=TEMP))
    return decoding_pair, distribution


@pytest.mark.parametrize("drafting", ["draft model", "prompt lookup"])
def test_a_rows_samples_follow_the_main_model(drafting, sampling_setting):
    from collections import Counter

    (model, draft_model, tokenizer), distribution = sampling_setting
    if drafting == "draft model":
        decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=NUM_DRAFT)
    else:
        decoder = SpeculativeDecoder(model, None, tokenizer, num_draft=NUM_DRAFT, prompt_lookup=1)
    counts = Counter(sample_rows(decoder))
    assert chi_square_p_value(counts, distribution) > 1e-3


@pytest.mark.parametrize("bug", list(BUGS))
def test_the_sampling_check_catches_wrong_per_row_bookkeeping(bug, sampling_setting, monkeypatch):
    from collections import Counter

    (model, draft_model, tokenizer), distribution = sampling_setting
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=NUM_DRAFT)
    monkeypatch.setattr(*BUGS[bug])
    counts = Counter(sample_rows(decoder, copies=POWER_RUNS))
    assert chi_square_p_value(counts, distribution) < 1e-4
