"""Speculative decoding keeps the main model's output: greedy identity,
acceptance rules, delta, max_tokens, EOS and draft compatibility."""

import dataclasses
import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures import load_hf, train_tokenizer

from decoder import SpeculativeDecoder
from drafting import IncompatibleDraftError, check_draft_compatible, trim_to
from loading import check_draft_directories, load_tokenizer
from sampling import RowSampling, Sampling, verify

PROMPTS = [
    "translate English to German: the house is small and the garden is green.",
    "summarize: the children walked to the old market by the river in the morning.",
    "question: where is the big red book? context: the book lies on the kitchen table.",
    "translate English to French: we are going to the sea tomorrow.",
]


@pytest.mark.parametrize("num_draft", [1, 2, 3, 5, 8])
def test_greedy_speculative_output_equals_greedy_main_model(num_draft, decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=num_draft)
    proposed = accepted = rejected = steps = generated = 0
    for prompt in PROMPTS:
        regular = decoder.generate(prompt, max_tokens=40)
        speculative = decoder.speculative_decode(prompt, max_tokens=40)
        assert speculative.tokens == regular.tokens
        assert speculative.text == regular.text
        assert regular.n_steps == len(regular.tokens) + (len(regular.tokens) < 40)
        proposed += speculative.n_draft
        accepted += speculative.n_accepted
        rejected += speculative.n_rejected
        steps += speculative.n_steps
        generated += len(speculative.tokens)
    # The draft agrees often but not always, so both paths (all accepted,
    # rejection then cache trim) were exercised.
    assert 0.3 < accepted / proposed < 0.97
    assert rejected > 0
    if num_draft > 1:
        assert steps < generated


def test_regular_greedy_decoding_equals_transformers_generate(decoding_pair, main_checkpoint):
    model, _, tokenizer = decoding_pair
    hf_model = load_hf(main_checkpoint)
    decoder = SpeculativeDecoder(model, None, tokenizer)
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = hf_model.generate(ids, max_new_tokens=30, do_sample=False, num_beams=1)
        expected = expected[0, 1:].tolist()  # without the start token
        if model.args.eos_token_id in expected:
            expected = expected[: expected.index(model.args.eos_token_id)]
        tokens = decoder.generate(prompt, max_tokens=30).tokens
        assert tokens == expected
        assert len(set(tokens)) > 3  # a varied output, not a one-token loop


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_delta_one_accepts_every_draft_token(temp, decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=4, delta=1.0)
    for prompt in PROMPTS:
        result = decoder.speculative_decode(prompt, max_tokens=30, temp=temp, seed=3)
        assert result.n_draft > 0
        assert result.n_accepted == result.n_draft
        assert result.n_rejected == 0


def random_round(seed, num_draft=6, vocab_size=50):
    """Main-model and draft logits that disagree in places, and Gumbel
    noise, as one speculative round would have them (a batch of one)."""
    rng = np.random.default_rng(seed)
    main_logits = mx.array(rng.normal(size=(1, num_draft + 1, vocab_size)) * 2)
    draft_logits = main_logits[:, :num_draft] + mx.array(
        rng.normal(size=(1, num_draft, vocab_size))
    )
    noise = mx.array(rng.gumbel(size=(1, num_draft + 1, vocab_size)).astype(np.float32))
    return main_logits, draft_logits, noise


@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_acceptance_never_decreases_as_delta_grows(temp):
    sampling = RowSampling([Sampling(temp=temp)])
    deltas = [0.0, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 0.95, 1.0]
    increased = False
    for seed in range(30):
        main_logits, draft_logits, noise = random_round(seed)
        noise = noise if temp else None
        draft_noise = None if noise is None else noise[:, :-1]
        draft_tokens = mx.argmax(sampling.scores(draft_logits, draft_noise), axis=-1)
        counts = [
            verify(draft_tokens, main_logits, sampling, delta, noise=noise)[0].item()
            for delta in deltas
        ]
        assert counts == sorted(counts)
        assert counts[-1] == draft_tokens.shape[1]
        increased |= counts[0] < counts[-1]
    assert increased


def test_greedy_delta_accepts_only_tokens_the_main_model_rates_highly():
    # The main model's probabilities at the draft token's position: 0.5 for
    # token 0, 0.4 for token 1 (the draft's choice), 0.1 for token 2.
    main_logits = mx.log(mx.array([[[0.5, 0.4, 0.1], [0.2, 0.3, 0.5]]]))
    draft_tokens = mx.array([[1]])
    greedy = Sampling(temp=0.0)

    def run(delta):
        num_accepted, next_token = verify(draft_tokens, main_logits, greedy, delta)
        return num_accepted.item(), next_token.item()

    # Token 1 has 0.8 of the top probability: accepted once 1 - delta <= 0.8.
    assert run(0.0) == (0, 0)
    assert run(0.1) == (0, 0)  # rejected, replaced by the main model's argmax
    assert run(0.25) == (1, 2)  # accepted, then the main model's next argmax
    assert run(1.0) == (1, 2)


def test_sampling_rule_accepts_exactly_the_main_models_gumbel_choice():
    """On one position, with p the main model's distribution and G the
    noise: a draft token is accepted exactly when it is argmax(log p + G),
    which is otherwise the next token; a draft of q's argmax(log q + G) is
    accepted at least (1 - TV) / (1 + TV) of the time, TV the total
    variation between p and q (Daliri, Musco and Suresh, arXiv 2408.07978)."""
    p = np.array([0.6, 0.3, 0.1])
    q = np.array([0.2, 0.5, 0.3])
    main_logits = mx.log(mx.array(np.stack([p, p])[None]))
    sampling = Sampling(temp=1.0)
    rng = np.random.default_rng(0)
    trials, draft_accepted = 4000, 0
    for _ in range(trials):
        g = rng.gumbel(size=3)
        noise = mx.array(np.stack([g, rng.gumbel(size=3)])[None].astype(np.float32))
        choice = int(np.argmax(np.log(p) + g))
        for token in range(3):
            num_accepted, next_token = verify(
                mx.array([[token]]), main_logits, sampling, 0.0, None, noise
            )
            assert num_accepted.item() == (token == choice)
            if token != choice:
                assert next_token.item() == choice
        draft_token = int(np.argmax(np.log(q) + g))
        draft_accepted += draft_token == choice
    total_variation = 0.5 * np.abs(p - q).sum()
    assert draft_accepted / trials >= (1 - total_variation) / (1 + total_variation) - 0.02


@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16])
@pytest.mark.parametrize("temp", [0.0, 1.0])
def test_never_more_than_max_tokens(max_tokens, temp, decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=5)
    full = decoder.generate(PROMPTS[0], max_tokens=40)
    assert len(full.tokens) == 40  # no EOS in the first 40 tokens of this prompt
    lengths = []
    for seed in range(5, 10 if temp else 6):  # sampled runs may end early, at EOS
        regular = decoder.generate(PROMPTS[0], max_tokens=max_tokens, temp=temp, seed=seed)
        speculative = decoder.speculative_decode(
            PROMPTS[0], max_tokens=max_tokens, temp=temp, seed=seed
        )
        lengths += [len(regular.tokens), len(speculative.tokens)]
    assert max(lengths) == max_tokens
    if temp == 0:
        assert min(lengths) == max_tokens
        assert speculative.tokens == full.tokens[:max_tokens]


def with_eos(model, eos):
    """The same weights, reading ``eos`` as the end of sequence."""
    changed = type(model)(dataclasses.replace(model.args, eos_token_id=eos))
    changed.update(model.parameters())
    return changed


@pytest.mark.parametrize("num_draft", [1, 3, 8])
def test_stops_at_eos_also_inside_a_draft(num_draft, decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    full = SpeculativeDecoder(model, None, tokenizer).generate(PROMPTS[1], max_tokens=40).tokens
    # Declare a token of the greedy output the end of sequence: decoding
    # must stop right before its first occurrence.
    eos = full[9]
    stop = full.index(eos)
    assert stop >= 2
    decoder = SpeculativeDecoder(
        with_eos(model, eos), with_eos(draft_model, eos), tokenizer, num_draft=num_draft
    )
    regular = decoder.generate(PROMPTS[1], max_tokens=40)
    speculative = decoder.speculative_decode(PROMPTS[1], max_tokens=40)
    assert regular.tokens == full[:stop]
    assert speculative.tokens == full[:stop]
    assert eos not in speculative.tokens


def test_draft_tokens_after_an_accepted_eos_are_not_counted(decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    # delta = 1 accepts every draft token, so the first round is the draft's
    # own output; declaring its third token the end of sequence puts an
    # accepted EOS inside the first 8-token draft.
    decoder = SpeculativeDecoder(model, draft_model, tokenizer, num_draft=8, delta=1.0)
    unstopped = decoder.speculative_decode(PROMPTS[1], max_tokens=40).tokens
    eos = unstopped[2]
    stop = unstopped.index(eos)
    decoder = SpeculativeDecoder(
        with_eos(model, eos), with_eos(draft_model, eos), tokenizer, num_draft=8, delta=1.0
    )
    result = decoder.speculative_decode(PROMPTS[1], max_tokens=40)
    assert result.tokens == unstopped[:stop]
    assert result.n_steps == 1
    assert result.n_draft == 8
    # The tokens up to and including EOS were accepted; the rest were never tested.
    assert result.n_accepted == stop + 1
    assert result.n_rejected == 0


def test_same_seed_same_sample(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=3)
    first = decoder.speculative_decode(PROMPTS[2], max_tokens=30, temp=1.0, seed=11)
    second = decoder.speculative_decode(PROMPTS[2], max_tokens=30, temp=1.0, seed=11)
    other = decoder.speculative_decode(PROMPTS[2], max_tokens=30, temp=1.0, seed=12)
    assert first.tokens == second.tokens
    assert first.tokens != other.tokens


def test_stream_yields_growing_results(decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair, num_draft=3)
    lengths, texts = [], []
    for result in decoder.stream(PROMPTS[0], max_tokens=20):
        lengths.append(len(result.tokens))
        texts.append(result.text)
    assert lengths == sorted(lengths) and lengths[-1] == 20
    assert len(lengths) > 1
    assert texts[-1] == decoder.generate(PROMPTS[0], max_tokens=20).text


def test_prompt_may_be_token_ids(decoding_pair):
    model, draft_model, tokenizer = decoding_pair
    decoder = SpeculativeDecoder(model, draft_model, tokenizer)
    ids = tokenizer(PROMPTS[3]).input_ids
    assert decoder.speculative_decode(ids, max_tokens=10).tokens == (
        decoder.speculative_decode(PROMPTS[3], max_tokens=10).tokens
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temp": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top-p"),
        ({"top_p": 1.5}, "top-p"),
        ({"top_k": -2}, "top-k"),
        ({"top_k": 2.5}, "top-k"),
        ({"temp": float("nan")}, "temperature"),
        ({"max_tokens": 2.0}, "max_tokens"),
        # mx.random.seed takes an unsigned 64-bit integer; MLX's own error is a TypeError.
        ({"seed": -3, "temp": 1.0}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_generation_arguments_are_refused(kwargs, message, decoding_pair):
    decoder = SpeculativeDecoder(*decoding_pair)
    with pytest.raises(ValueError, match=message):
        decoder.speculative_decode(PROMPTS[0], **kwargs)


def test_bad_decoder_arguments_are_refused(decoding_pair):
    with pytest.raises(ValueError, match="num_draft"):
        SpeculativeDecoder(*decoding_pair, num_draft=0)
    with pytest.raises(ValueError, match="delta"):
        SpeculativeDecoder(*decoding_pair, delta=1.5)
    with pytest.raises(ValueError, match="empty"):
        SpeculativeDecoder(*decoding_pair).generate("   ")


def test_trim_to_keeps_the_accepted_prefix_of_each_row_and_returns_the_rest(decoding_pair):
    model = decoding_pair[0]
    cache = model.prompt_cache([[5, 6, 7, 1], [8, 1]])
    model.decode(mx.array([[0, 11, 12, 13, 14], [0, 31, 32, 33, 34]]), cache)
    # Row 0 accepted start, 11, 12, then a replacement 20: positions for 13
    # and 14 go, 20 is the next input. Row 1 accepted everything and one more.
    pending = trim_to(cache, [[0, 11, 12, 20], [0, 31, 32, 33, 34, 35]])
    assert pending == [[20], [35]]
    assert cache.lengths == [3, 5]
    # A draft that never processed its last accepted token gets it back too.
    assert trim_to(cache, [[0, 11, 12, 20, 21, 22], [0, 31, 40]]) == [[20, 21, 22], [40]]
    assert cache.lengths == [3, 2]


def test_draft_with_another_vocabulary_size_is_refused(decoding_pair):
    model = decoding_pair[0]
    args = dataclasses.replace(model.args, vocab_size=model.args.vocab_size + 8)
    with pytest.raises(IncompatibleDraftError, match="main.*vocab_size|vocab_size.*main"):
        check_draft_compatible(model.args, args, "big-model", "small-model")
    with pytest.raises(IncompatibleDraftError) as error:
        check_draft_compatible(model.args, args, "big-model", "small-model")
    assert "big-model" in str(error.value) and "small-model" in str(error.value)
    wrong_draft = type(model)(args)
    with pytest.raises(IncompatibleDraftError):
        SpeculativeDecoder(model, wrong_draft, decoding_pair[2])


def test_draft_with_another_tokenizer_is_refused(converted_pair, tmp_path):
    main_dir, draft_dir = converted_pair
    check_draft_directories(main_dir, draft_dir)  # the real pair is compatible
    other = tmp_path / "other-draft"
    shutil.copytree(draft_dir, other)
    for file in other.iterdir():
        if file.name not in ("config.json", "weights.safetensors"):
            file.unlink()
    train_tokenizer(other, vocab_size=150)
    with pytest.raises(IncompatibleDraftError) as error:
        check_draft_directories(main_dir, other)
    assert str(main_dir) in str(error.value) and str(other) in str(error.value)
    assert "tokenizer" in str(error.value)


@pytest.mark.parametrize("tokenizer_class", ["T5Tokenizer", "PreTrainedTokenizerFast"])
def test_the_tokenizer_is_the_one_auto_tokenizer_loads(
    tokenizer_class, converted, tmp_path, monkeypatch
):
    """T5's tokenizer class is loaded without AutoTokenizer (whose import
    cost a second of every start), to the tokenizer AutoTokenizer gives: same
    class, vocabulary, special tokens, ids and text. Another class named in
    tokenizer_config.json goes through AutoTokenizer."""
    import transformers

    directory = tmp_path / "model"
    shutil.copytree(converted("relu_tied"), directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({**config, "tokenizer_class": tokenizer_class})
    )
    auto = transformers.AutoTokenizer.from_pretrained(str(directory))
    if tokenizer_class == "T5Tokenizer":
        monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", None)
    ours = load_tokenizer(directory)
    assert type(ours) is type(auto)
    assert ours.get_vocab() == auto.get_vocab()
    assert ours.all_special_ids == auto.all_special_ids and ours.eos_token_id == auto.eos_token_id
    texts = ["translate English to German: the old bridge", "a, b; c - d!  e\nf </s>"]
    assert ours(texts).input_ids == auto(texts).input_ids
    ids = auto(texts).input_ids
    assert ours.batch_decode(ids, skip_special_tokens=True) == auto.batch_decode(
        ids, skip_special_tokens=True
    )


def test_tokenizer_difference_counts_each_entry_once(decoding_pair):
    """A piece renamed at one id is one differing entry, not two; two
    1000-entry vocabularies differ in at most 1000."""
    args = decoding_pair[0].args
    vocab = {f"piece{index}": index for index in range(1000)}
    renamed = {**{piece: index for piece, index in vocab.items() if index != 7}, "other": 7}
    shifted = {piece: (index + 1) % 1000 for piece, index in vocab.items()}
    for draft_vocab, differing in ((renamed, 1), (shifted, 1000)):
        with pytest.raises(IncompatibleDraftError, match=f"differ in {differing} vocabulary"):
            check_draft_compatible(args, args, main_vocab=vocab, draft_vocab=draft_vocab)
