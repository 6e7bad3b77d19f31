"""The round itself (``speculative.speculative_round``), called directly with
hand-made drafts on the tiny main model: every draft token accepted and the
bonus token, a rejection mid-draft, an end of sequence inside a draft and
at the bonus position, rows with their own limits and draft lengths, a
cache trimmed back to what was accepted, and ``delta``; and ``Options``."""

import mlx.core as mx
import pytest

from decoder import SpeculativeDecoder
from drafting import Draft
from sampling import RowSampling, Sampling
from speculative import Options, speculative_round

PROMPTS = [
    "translate English to German: the house is small.",
    "summarize: the cat sat on the mat and looked at the dog.",
]
# Tokens of each prompt's greedy text the tests draft from.
REFERENCE_TOKENS = 8
# An id no test text holds: a round whose end-of-sequence it is never ends.
NO_EOS = -1


class GivenDraft:
    """A drafter that proposes the tokens it was given, whatever it is asked."""

    encoding_time = 0.0

    def __init__(self, rows: list[list[int]], lengths: list[int] | None = None):
        width = max(map(len, rows))
        tokens = mx.array([row + [0] * (width - len(row)) for row in rows])
        lengths = lengths or [len(row) for row in rows]
        self.draft = Draft(tokens, lengths, ["model"] * len(rows))

    def propose(self, sequences, sampling, num_draft, limits, noise=None) -> Draft:
        return self.draft


@pytest.fixture(scope="module")
def pair(decoding_pair):
    """(main model, tokenizer, each prompt's token ids, each prompt's greedy tokens)."""
    model, _, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, None, tokenizer)
    ids = [tokenizer(prompt).input_ids for prompt in PROMPTS]
    greedy = [decoder.generate(prompt, max_tokens=REFERENCE_TOKENS).tokens for prompt in PROMPTS]
    assert all(len(tokens) == REFERENCE_TOKENS for tokens in greedy), "a text ended early"
    return model, tokenizer, ids, greedy


def run_round(model, prompt_ids, drafter, sequences, limits, delta=0.0, eos=NO_EOS, cache=None):
    """One greedy round over rows of ``prompt_ids`` holding ``sequences``
    (their cache built here unless given); (outcome, cache)."""
    if cache is None:
        cache = model.prompt_cache(prompt_ids)
        # The cache holds every position but the last token: the pass's first input.
        pending = [sequence[:-1] for sequence in sequences]
        if any(pending):
            width = max(map(len, pending))
            model.decode(mx.array([p + [0] * (width - len(p)) for p in pending]), cache)
            cache.trim([width - len(p) for p in pending])
    sampling = RowSampling([Sampling()] * len(sequences))
    num_draft = {"model": max(drafter.draft.lengths)} if drafter else {}
    outcome = speculative_round(
        model, cache, drafter, num_draft, sequences, limits, sampling, delta, None, eos
    )
    return outcome, cache


def start(model) -> list[int]:
    return [model.args.decoder_start_token_id]


def test_every_draft_token_accepted_and_the_bonus_token(pair):
    model, _, ids, greedy = pair
    drafter = GivenDraft([greedy[0][:3]])
    outcome, _ = run_round(model, ids[:1], drafter, [start(model)], [REFERENCE_TOKENS])
    assert outcome.accepted == [3] and outcome.rejected == [False]
    assert outcome.new_tokens == [greedy[0][:4]]  # the three drafts and the main model's fourth
    assert outcome.ended == [False]


def test_a_rejection_mid_draft_gives_the_main_models_token_in_its_place(pair):
    model, _, ids, greedy = pair
    wrong = (greedy[0][1] + 1) % model.args.vocab_size
    drafter = GivenDraft([[greedy[0][0], wrong, greedy[0][2]]])
    outcome, cache = run_round(model, ids[:1], drafter, [start(model)], [REFERENCE_TOKENS])
    assert outcome.accepted == [1] and outcome.rejected == [True]
    assert outcome.new_tokens == [greedy[0][:2]]
    # The next round trims the cache back to the accepted tokens, and goes on as greedy decoding.
    sequence = start(model) + outcome.new_tokens[0]
    assert cache.lengths == [4]  # the start token and the three drafts, not yet trimmed
    outcome, cache = run_round(
        model, ids[:1], GivenDraft([greedy[0][2:4]]), [sequence], [5], cache=cache
    )
    assert outcome.accepted == [2] and outcome.new_tokens == [greedy[0][2:5]]
    assert cache.lengths == [len(sequence) - 1 + 3]


def test_an_end_of_sequence_inside_a_draft_ends_the_text_before_it(pair):
    """The draft's own end of sequence, accepted, ends the row: the draft
    tokens after it go untested (not counted as rejected)."""
    model, _, ids, greedy = pair
    drafter = GivenDraft([greedy[0][:4]])
    # The first draft token after the first that is none of those before it.
    end = next(i for i in range(1, 4) if greedy[0][i] not in greedy[0][:i])
    eos = greedy[0][end]
    outcome, _ = run_round(model, ids[:1], drafter, [start(model)], [REFERENCE_TOKENS], eos=eos)
    assert outcome.new_tokens == [greedy[0][:end]] and outcome.ended == [True]
    assert outcome.accepted == [end + 1] and outcome.rejected == [False]


def test_an_end_of_sequence_as_the_bonus_token_ends_the_text(pair):
    model, _, ids, greedy = pair
    eos = greedy[0][2]
    assert eos not in greedy[0][:2]
    drafter = GivenDraft([greedy[0][:2]])
    outcome, _ = run_round(model, ids[:1], drafter, [start(model)], [REFERENCE_TOKENS], eos=eos)
    assert outcome.new_tokens == [greedy[0][:2]] and outcome.ended == [True]
    assert outcome.accepted == [2] and outcome.rejected == [False]


def test_rows_with_their_own_limits_and_draft_lengths(pair):
    """Two rows in one pass: row 0 drafts 3 tokens, row 1 only 1 (its
    limit), and row 1 is further along; each gets its own greedy tokens."""
    model, _, ids, greedy = pair
    sequences = [start(model), start(model) + greedy[1][:3]]
    drafter = GivenDraft([greedy[0][:3], greedy[1][3:4] + [7, 7]], lengths=[3, 1])
    outcome, cache = run_round(model, ids, drafter, sequences, [REFERENCE_TOKENS, 1])
    assert outcome.accepted == [3, 1] and outcome.rejected == [False, False]
    assert outcome.new_tokens == [greedy[0][:4], greedy[1][3:5]]
    # Past its length a row's draft tokens are not tested: row 1's [7, 7] rejected nothing.
    assert cache.lengths == [4, 4 + 3]


def test_a_plain_step_without_a_drafter(pair):
    model, _, ids, greedy = pair
    outcome, _ = run_round(model, ids, None, [start(model)] * 2, [REFERENCE_TOKENS] * 2)
    assert outcome.accepted == [0, 0] and outcome.rejected == [False, False]
    assert outcome.new_tokens == [greedy[0][:1], greedy[1][:1]]


def test_delta_one_accepts_every_draft_token(pair):
    """delta = 1 accepts whatever is drafted (no longer exact); delta = 0
    accepts only the main model's own tokens."""
    model, _, ids, greedy = pair
    junk = [(token + 1) % model.args.vocab_size for token in greedy[0][:3]]
    for delta, accepted in ((1.0, 3), (0.0, 0)):
        drafter = GivenDraft([junk])
        outcome, _ = run_round(model, ids[:1], drafter, [start(model)], [10], delta=delta)
        assert outcome.accepted == [accepted]
        assert outcome.new_tokens[0][:accepted] == junk[:accepted]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temp": -1}, "temperature"),
        ({"top_p": 0}, "top-p"),
        ({"top_k": -1}, "top-k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": True}, "seed"),
    ],
)
def test_options_refuse_values_out_of_range(fields, message):
    with pytest.raises(ValueError, match=message):
        Options(**fields)
    Options(seed=2**64 - 1)
