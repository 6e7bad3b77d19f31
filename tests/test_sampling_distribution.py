"""At temperature > 0, speculative sampling draws from the main model's own
distribution: each token is argmax(log p + G), an exact sample of p by the
Gumbel-max trick, whatever was drafted.

The exact distribution of the first two generated tokens follows from the
main model's logits: P(y1, y2) = p(y1) p(y2 | y1). Thousands of seeded
speculative runs (rows of one batch) give an empirical distribution; a chi-square test on the
likeliest outcomes plus a "rest" bucket compares the two. The same test is
shown to reject deliberately wrong acceptance rules, so it has the power to
catch them.
"""

from collections import Counter
from itertools import pairwise

import mlx.core as mx
import pytest
from fixtures import cheap_drafts
from scipy.stats import chisquare

import speculative
from decoder import SpeculativeDecoder
from sampling import Sampling
from speculative import Options

PROMPT = "translate English to German: the old man walks to the market."
RUNS = 2000
# The power checks (a wrong rule must fail the check) draw a quarter as many:
# a wrong distribution's chi-square statistic grows in proportion to the
# runs, so what the check rejects from POWER_RUNS it rejects from RUNS.
POWER_RUNS = RUNS // 4
TEMP = 0.1
NUM_DRAFT = 2
# 3 tokens are generated so that the first round drafts 2 of them: the
# second draft token is judged given the first.
MAX_TOKENS = NUM_DRAFT + 1
FULL_AND_TRUNCATED = pytest.mark.parametrize(
    "sampling",
    [Sampling(temp=TEMP), Sampling(temp=TEMP, top_p=0.9, top_k=8)],
    ids=["full", "top-p-top-k"],
)


def exact_distribution(model, prompt_ids, sampling: Sampling) -> dict[tuple, float]:
    """Probability of each possible output prefix of (at most) two tokens;
    a prefix ends early where the end-of-sequence token was drawn."""
    eos, start = model.args.eos_token_id, model.args.decoder_start_token_id
    vocab_size = model.args.vocab_size
    first = sampling.probabilities(model(prompt_ids, mx.array([[start]]))[0, -1])
    # Every first token at once: a batch of [start, y1] decoder inputs.
    decoder_inputs = mx.stack([mx.full((vocab_size,), start), mx.arange(vocab_size)], axis=1)
    prompts = mx.repeat(prompt_ids, vocab_size, axis=0)
    second = sampling.probabilities(model(prompts, decoder_inputs)[:, -1])
    joint = (first[:, None] * second).tolist()
    first = first.tolist()
    distribution = Counter({(): first[eos]})
    for y1 in range(vocab_size):
        if y1 == eos or first[y1] == 0:
            continue
        for y2 in range(vocab_size):
            if joint[y1][y2] > 0:
                distribution[(y1,) if y2 == eos else (y1, y2)] += joint[y1][y2]
    return distribution


# Rows decoded together: a seeded row's text is the one its seed gives the
# prompt alone (tests/test_seeded_text.py), and a batch draws the samples
# about 6 times as fast as one run per seed (counts checked equal, 500 seeds).
SAMPLE_BATCH = 256


def sample_outputs(
    decoder: SpeculativeDecoder, sampling: Sampling, prompt=PROMPT, runs=RUNS, speculative=True
) -> Counter:
    """The first two tokens of ``runs`` runs of ``prompt``, seeded 0 .. runs - 1."""
    generator = decoder.batch_generator(speculative=speculative, max_batch_size=SAMPLE_BATCH)
    options = [
        Options(MAX_TOKENS, sampling.temp, sampling.top_p, sampling.top_k, seed)
        for seed in range(runs)
    ]
    uids = [generator.insert(prompt, row_options) for row_options in options]
    last = {}
    while len(generator):
        for uid, result in generator.next():
            last[uid] = result
    return Counter(tuple(last[uid].tokens[:2]) for uid in uids)


def chi_square_p_value(counts: Counter, distribution: dict[tuple, float]) -> float:
    """Chi-square goodness of fit on the outcomes expected at least 5 times,
    with every other outcome pooled into one bucket, itself pooled with the
    least likely outcome when expected fewer than 5 times. (With top-p/top-k
    the likely outcomes can hold all the mass: the rest is then float32
    round-off, exactly 0 with some BLAS kernels, and a bucket of its own made
    the statistic 0/0.)"""
    runs = sum(counts.values())
    likely = [o for o, p in distribution.items() if p * runs >= 5]
    observed = [counts[o] for o in likely]
    expected = [distribution[o] * runs for o in likely]
    rest_observed, rest_expected = runs - sum(observed), runs - sum(expected)
    assert len(likely) >= 3, "too few likely outcomes for a meaningful test"
    assert rest_expected >= 5 or rest_observed == 0
    if rest_expected >= 5:
        observed.append(rest_observed)
        expected.append(rest_expected)
    else:
        expected[expected.index(min(expected))] += rest_expected
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def setting(decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=NUM_DRAFT)
    prompt_ids = mx.array([tokenizer(PROMPT).input_ids])
    return decoder, prompt_ids


def distributions_differ(setting, sampling):
    """Total variation between the draft's and the main model's first-token
    distributions: the test is only meaningful if the draft is wrong often."""
    decoder, prompt_ids = setting
    start = mx.array([[decoder.model.args.decoder_start_token_id]])
    p = sampling.probabilities(decoder.model(prompt_ids, start)[0, -1])
    q = sampling.probabilities(decoder.draft_model(prompt_ids, start)[0, -1])
    return 0.5 * mx.abs(p - q).sum().item()


@FULL_AND_TRUNCATED
def test_speculative_samples_follow_the_main_model(setting, sampling):
    decoder, prompt_ids = setting
    assert distributions_differ(setting, sampling) > 0.1
    distribution = exact_distribution(decoder.model, prompt_ids, sampling)
    counts = sample_outputs(decoder, sampling)
    assert chi_square_p_value(counts, distribution) > 1e-3


@FULL_AND_TRUNCATED
def test_regular_samples_follow_the_main_model(setting, sampling):
    decoder, prompt_ids = setting
    distribution = exact_distribution(decoder.model, prompt_ids, sampling)
    counts = sample_outputs(decoder, sampling, speculative=False)
    assert chi_square_p_value(counts, distribution) > 1e-3


def miswritten_verify(rule: str):
    """``speculative.verify`` (the round's ``sampling.verify``) with one deliberate mistake, for the power checks."""
    correct = speculative.verify

    def verify(draft_tokens, main_logits, sampling, delta, draft_lengths=None, noise=None):
        if draft_tokens.shape[1] == 0:  # no draft tokens: nothing to get wrong
            return correct(draft_tokens, main_logits, sampling, delta, draft_lengths, noise)
        if rule == "wrong prefix":
            # Off by one: x_i judged by the main model's distribution after x_i.
            main_logits = mx.concatenate([main_logits[:, 1:], main_logits[:, -1:]], axis=1)
        elif rule == "no noise":
            # The main model's noise-free argmax: the draft is judged against greedy decoding.
            noise = None
        elif rule == "noise before the temperature":
            # argmax(logits + G): noise added before dividing by the temperature.
            noise = noise / TEMP
        elif rule == "always accept":
            delta = 1.0
        return correct(draft_tokens, main_logits, sampling, delta, draft_lengths, noise)

    return verify


@pytest.mark.parametrize("rule", ["no noise", "noise before the temperature", "wrong prefix"])
def test_the_check_catches_a_wrong_rule(setting, rule, monkeypatch):
    decoder, prompt_ids = setting
    sampling = Sampling(temp=TEMP)
    monkeypatch.setattr(speculative, "verify", miswritten_verify(rule))
    counts = sample_outputs(decoder, sampling, runs=POWER_RUNS)
    distribution = exact_distribution(decoder.model, prompt_ids, sampling)
    assert chi_square_p_value(counts, distribution) < 1e-4


def test_the_check_catches_the_draft_distribution(setting):
    """delta = 1 keeps every draft token: the draft's distribution, not the main model's."""
    decoder, prompt_ids = setting
    sampling = Sampling(temp=TEMP)
    loose = SpeculativeDecoder(
        decoder.model, decoder.draft_model, decoder.tokenizer, NUM_DRAFT, 1.0
    )
    counts = sample_outputs(loose, sampling, runs=POWER_RUNS)
    distribution = exact_distribution(decoder.model, prompt_ids, sampling)
    assert chi_square_p_value(counts, distribution) < 1e-4


def test_auto_num_draft_samples_follow_the_main_model(setting):
    decoder, prompt_ids = setting
    sampling = Sampling(temp=TEMP)
    auto = SpeculativeDecoder(decoder.model, decoder.draft_model, decoder.tokenizer, "auto")
    cheap_drafts(auto)
    counts = sample_outputs(auto, sampling)
    first = auto.speculative_decode(PROMPT, max_tokens=MAX_TOKENS, temp=TEMP, seed=0)
    assert first.draft_lengths[0] > 1  # auto drafted, more than one token
    distribution = exact_distribution(decoder.model, prompt_ids, sampling)
    assert chi_square_p_value(counts, distribution) > 1e-3


def lookup_right_mass(distribution, prompt: list[int]) -> float:
    """The probability that the second token is the one after the first in ``prompt``."""
    following = dict(pairwise(prompt))
    return sum(p for o, p in distribution.items() if len(o) == 2 and following[o[0]] == o[1])


@pytest.fixture(scope="module")
def lookup_setting(decoding_pair):
    """A decoder with prompt lookup of single tokens and no draft model, and
    a prompt (token ids) holding every token but the end of sequence once,
    so that lookup always drafts the second token: the token after the
    first one in the prompt. The prompt's order is changed, a few times at
    most, until the main model picks that token with probability 0.05 to 0.6,
    so that both acceptance and rejection happen."""
    model, _, tokenizer = decoding_pair
    sampling = Sampling(temp=TEMP)
    eos = model.args.eos_token_id
    order = [t for t in range(model.args.vocab_size) if t != eos]
    for _ in range(8):
        prompt = order + [eos]
        distribution = exact_distribution(model, mx.array([prompt]), sampling)
        if 0.05 < lookup_right_mass(distribution, prompt) < 0.6:
            break
        # Put after each of the three likeliest first tokens its likeliest successor.
        pairs = [o for o in distribution if len(o) == 2 and o[0] != o[1]]
        successor, first_mass = {}, Counter()
        for first, second in sorted(pairs, key=distribution.get):
            successor[first] = second
            first_mass[first] += distribution[first, second]
        for first, _ in first_mass.most_common(3):
            order.remove(successor[first])
            order.insert(order.index(first) + 1, successor[first])
    else:
        pytest.fail("no prompt order found where lookup is right sometimes")
    decoder = SpeculativeDecoder(model, None, tokenizer, num_draft=NUM_DRAFT, prompt_lookup=1)
    return decoder, prompt


@FULL_AND_TRUNCATED
def test_prompt_lookup_samples_follow_the_main_model(lookup_setting, sampling):
    decoder, prompt = lookup_setting
    counts = sample_outputs(decoder, sampling, prompt)
    distribution = exact_distribution(decoder.model, mx.array([prompt]), sampling)
    assert chi_square_p_value(counts, distribution) > 1e-3


@pytest.mark.parametrize("rule", ["always accept", "no noise", "noise before the temperature"])
def test_the_check_catches_a_wrong_rule_for_lookup_drafts(lookup_setting, rule, monkeypatch):
    decoder, prompt = lookup_setting
    sampling = Sampling(temp=TEMP)
    monkeypatch.setattr(speculative, "verify", miswritten_verify(rule))
    counts = sample_outputs(decoder, sampling, prompt, runs=POWER_RUNS)
    distribution = exact_distribution(decoder.model, mx.array([prompt]), sampling)
    assert chi_square_p_value(counts, distribution) < 1e-4
