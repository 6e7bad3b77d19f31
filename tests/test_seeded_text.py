"""A seed fixes the text, whatever drafts it: at temperature > 0 and delta 0,
seeded speculative decoding gives regular decoding's tokens with the same
seed and settings, for the draft model, prompt lookup and hybrid drafting,
g = 1 to 8 and auto, a draft length that changes from round to round, alone
and in batches whose rows sit at different positions. main.py and the
server are held to the same text in test_cli.py and test_server.py.

Every check asserts that drafts were both accepted and rejected (and lookup
drafted where it is on), and that another seed gives another text, so that
none passes for want of drafting or of sampling."""

import numpy as np
import pytest
from fixtures import cheap_drafts
from test_batch import PROMPTS

from auto import AutoDraftLength
from decoder import SpeculativeDecoder
from sampling import Sampling

MAX_NEW = 16
SEED = 7
# Low temperatures: these tiny models' logits are small, and at 0.8 prompt
# lookup's tokens were hardly ever the main model's choice.
SETTINGS = {
    "temperature 0.3": Sampling(0.3),
    "top-p and top-k": Sampling(0.5, top_p=0.9, top_k=20),
}
DRAFTERS = {
    "draft model": {},
    "prompt lookup": {"draft_model": None, "prompt_lookup": 2},
    "hybrid": {"prompt_lookup": 3},
}
NUM_DRAFTS = [*range(1, 9), "auto"]


def options(sampling: Sampling, seed: int = SEED, max_tokens: int = MAX_NEW) -> dict:
    return {
        "max_tokens": max_tokens,
        "temp": sampling.temp,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "seed": seed,
    }


def speculative_decoder(pair, drafter: str, num_draft) -> SpeculativeDecoder:
    model, draft_model, tokenizer = pair
    settings = dict(DRAFTERS[drafter])
    draft_model = settings.pop("draft_model", draft_model)
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft, **settings)
    cheap_drafts(decoder)  # so that auto drafts
    return decoder


def regular_tokens(pair, prompts, sampling: Sampling, seed=SEED, max_tokens=MAX_NEW) -> list:
    decoder = SpeculativeDecoder(pair[0], None, pair[2])
    return [decoder.generate(p, **options(sampling, seed, max_tokens)).tokens for p in prompts]


def assert_drafting_was_tested(results, drafter: str) -> None:
    assert sum(r.n_accepted for r in results) > 0
    assert sum(r.n_rejected for r in results) > 0
    if drafter != "draft model":
        assert sum(r.n_lookup_rounds for r in results) > 0


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_a_seeded_text_is_regular_decodings_at_every_draft_length(drafter, setting, decoding_pair):
    sampling, prompts = SETTINGS[setting], PROMPTS[:6]
    regular = regular_tokens(decoding_pair, prompts, sampling)
    every = []
    for num_draft in NUM_DRAFTS:
        decoder = speculative_decoder(decoding_pair, drafter, num_draft)
        results = [decoder.speculative_decode(p, **options(sampling)) for p in prompts]
        assert [r.tokens for r in results] == regular, f"g = {num_draft}"
        assert all(r.seed == SEED for r in results)
        assert sum(r.n_draft for r in results) > 0
        every += results
    assert_drafting_was_tested(every, drafter)
    assert regular_tokens(decoding_pair, prompts, sampling, SEED + 1) != regular


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_a_seeded_text_is_regular_decodings_in_a_batch_whose_draft_length_changes(
    drafter, decoding_pair, monkeypatch
):
    """Rows of prompts of 1 to about 160 tokens, 4 at a time, joining as
    others finish, so that a round's rows are at different positions; every
    round drafts a length drawn at random from 0 to 8, as auto's choices
    change with its timings."""
    sampling = SETTINGS["temperature 0.3"]
    lengths = np.random.default_rng(0)
    monkeypatch.setattr(AutoDraftLength, "choose", lambda self, *a, **k: int(lengths.integers(9)))
    decoder = speculative_decoder(decoding_pair, drafter, "auto")
    settings = options(sampling, max_tokens=2 * MAX_NEW)  # long enough for lookup to match
    results = decoder.speculative_decode_batch(PROMPTS, batch_size=4, **settings)
    regular = regular_tokens(decoding_pair, PROMPTS, sampling, max_tokens=2 * MAX_NEW)
    assert [r.tokens for r in results] == regular
    assert_drafting_was_tested(results, drafter)
    assert len({length for r in results for length in r.draft_lengths}) > 4


def test_a_draft_model_equal_to_the_main_model_has_every_token_accepted(decoding_pair):
    """The draft proposes with the main model's noise at the same positions:
    the same model then proposes exactly the main model's tokens. (A draft
    drawing other noise, or the noise of other positions, would have many
    rejected.)"""
    model, _, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, model, tokenizer, num_draft=4)
    sampling = SETTINGS["top-p and top-k"]
    results = [decoder.speculative_decode(p, **options(sampling)) for p in PROMPTS[:4]]
    assert sum(r.n_draft for r in results) > 0
    assert all(r.n_accepted == r.n_draft - r.n_rejected for r in results)
    assert sum(r.n_rejected for r in results) == 0
