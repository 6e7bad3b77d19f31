"""Beam search equals transformers' ``generate(num_beams=N)``: the same
hypotheses and scores, alone and batched, with the encoder's keys and
values held once per prompt; main.py's flags, --task and its errors."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
import torch
from fixtures import EOS_ID, load_hf
from safetensors.torch import load_file, save_file

import beam
import convert
import main as main_module
from beam import BeamOptions, start_cache
from decoder import SpeculativeDecoder
from loading import load_model, load_tokenizer

PROMPTS = [
    "translate English to German: the house is small and the garden is green.",
    "summarize: the children walked to the old market by the river in the morning.",
    "question: where is the big red book? context: the book lies on the kitchen table.",
    "translate English to French: we are going to the sea tomorrow.",
    "the sea is green.",
]
# transformers' generate arguments: each setting of the search, one test each.
SETTINGS = {
    "defaults": {"num_beams": 4, "max_new_tokens": 20, "num_return_sequences": 2},
    "early_true_penalty_2_ngram_3": {
        "num_beams": 4,
        "length_penalty": 2.0,
        "early_stopping": True,
        "no_repeat_ngram_size": 3,
        "max_new_tokens": 20,
        "num_return_sequences": 4,
    },
    "never_ngram_2": {
        "num_beams": 3,
        "early_stopping": "never",
        "no_repeat_ngram_size": 2,
        "max_new_tokens": 15,
        "num_return_sequences": 3,
    },
    "negative_penalty_min_length": {
        "num_beams": 5,
        "length_penalty": -1.0,
        "min_length": 6,
        "max_new_tokens": 12,
        "num_return_sequences": 2,
    },
    "two_beams_penalty_half_ngram_1": {
        "num_beams": 2,
        "length_penalty": 0.5,
        "no_repeat_ngram_size": 1,
        "max_new_tokens": 10,
    },
}
# The settings in which max_new_tokens cuts some of the hypotheses compared.
CUT = {"defaults", "never_ngram_2", "negative_penalty_min_length"}
# How far the end-of-sequence token's output row moves along the decoder's
# mean output: the random model then ends some hypotheses after 0 to 19
# tokens and runs others to max_new_tokens (unmoved, none ends).
EOS_PULL = 0.55
TASKS = {
    "summarization": {
        "early_stopping": True,
        "length_penalty": 2.0,
        "max_length": 16,
        "min_length": 5,
        "no_repeat_ngram_size": 3,
        "num_beams": 4,
        "prefix": "summarize: ",
    },
    "translation_en_to_de": {
        "early_stopping": True,
        "max_length": 13,
        "num_beams": 3,
        "prefix": "translate English to German: ",
    },
}


@pytest.fixture(scope="module")
def hf_ending(tmp_path_factory, main_checkpoint):
    """The decoding tests' main checkpoint, its end-of-sequence row moved so
    that hypotheses end at many lengths, with T5's kind of task_specific_params."""
    directory = tmp_path_factory.mktemp("hf-ending")
    shutil.copytree(main_checkpoint, directory, dirs_exist_ok=True)
    model = load_hf(directory)
    tokenizer = load_tokenizer(directory)
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        start = torch.zeros((len(PROMPTS), 10), dtype=torch.long)
        hidden = model(**inputs, decoder_input_ids=start, output_hidden_states=True)
        direction = hidden.decoder_hidden_states[-1].reshape(-1, model.config.d_model).mean(0)
    tensors = load_file(directory / "model.safetensors")
    lm_head = tensors["lm_head.weight"]
    pull = EOS_PULL * lm_head.norm(dim=1).mean() * direction / direction.norm()
    tensors["lm_head.weight"][EOS_ID] += pull
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    config["task_specific_params"] = TASKS
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def ending(tmp_path_factory, hf_ending):
    """``hf_ending`` converted, and its decoder."""
    out = tmp_path_factory.mktemp("mlx") / "ending"
    convert.convert(str(hf_ending), out, "float32")
    return out, SpeculativeDecoder(load_model(out), None, load_tokenizer(out))


def transformers_beams(hf_model, tokenizer, prompt: str, settings: dict):
    """transformers' sequences (start token dropped) and scores for ``prompt``."""
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        output = hf_model.generate(
            ids, do_sample=False, output_scores=True, return_dict_in_generate=True, **settings
        )
    return [row[1:] for row in output.sequences.tolist()], output.sequences_scores.tolist()


def our_settings(settings: dict) -> dict:
    """``generate``'s keyword arguments for transformers' ``settings``."""
    ours = {k: v for k, v in settings.items() if k not in ("max_new_tokens", "min_length")}
    return {
        **ours,
        "max_tokens": settings["max_new_tokens"],
        "min_tokens": max(0, settings.get("min_length", 0) - 1),
    }


def assert_same_hypotheses(result, expected_rows, expected_scores) -> None:
    """Our hypotheses, best first, are transformers' rows: the tokens, then the
    end-of-sequence token where one ended, then padding; the scores within
    float32 round-off."""
    assert len(result.sequences) == len(expected_rows)
    for hypothesis, row, score in zip(result.sequences, expected_rows, expected_scores):
        tokens = hypothesis.tokens + [EOS_ID] * hypothesis.ended
        assert row[: len(tokens)] == tokens
        padding = row[len(tokens) :]
        assert len(set(padding)) <= 1 and set(padding) <= {0, EOS_ID}
        # Padding is the end-of-sequence token in transformers: one that ended
        # shows it first, one max_new_tokens cut is as long as the longest.
        assert hypothesis.ended or not padding
        assert hypothesis.score == pytest.approx(score, rel=1e-5, abs=1e-4)


@pytest.fixture
def gaps(monkeypatch):
    """The gaps between consecutive candidates, down to the first left out, of
    every step: a gap near 0 is a near-tie that round-off could flip."""
    seen = []
    choose = beam.best_continuations

    def recording(totals, k):
        values, indices = choose(totals, k + 1)
        seen.extend(np.abs(np.diff(values, axis=-1)).ravel().tolist())
        return values[:, :k], indices[:, :k]

    monkeypatch.setattr(beam, "best_continuations", recording)
    return seen


NEAR_TIE = 1e-4


@pytest.mark.parametrize("name", SETTINGS)
def test_beam_search_equals_transformers(name, ending, hf_ending, gaps):
    _, decoder = ending
    settings = SETTINGS[name]
    hf_model = load_hf(hf_ending)
    ended = cut = 0
    for prompt in PROMPTS:
        rows, scores = transformers_beams(hf_model, decoder.tokenizer, prompt, settings)
        result = decoder.generate(prompt, **our_settings(settings))
        assert_same_hypotheses(result, rows, scores)
        assert result.tokens == result.sequences[0].tokens
        assert result.text == decoder.tokenizer.decode(result.tokens, skip_special_tokens=True)
        ended += sum(hypothesis.ended for hypothesis in result.sequences)
        cut += sum(not hypothesis.ended for hypothesis in result.sequences)
    near_ties = sum(gap < NEAR_TIE for gap in gaps)
    print(f"\nnear-ties: {near_ties} of {len(gaps)} candidate gaps below {NEAR_TIE}")
    print(f"hypotheses: {ended} ended, {cut} cut by max_new_tokens")
    # Hypotheses that ended were compared, and in the settings of CUT, hypotheses cut.
    assert ended and (cut or name not in CUT), (ended, cut)


@pytest.mark.parametrize("longest_first", [True, False])
def test_batched_beams_equal_each_prompt_alone(longest_first, ending):
    """Prompts of different lengths, whose searches end at different steps,
    batched 2 at a time, the others joining as searches end (longest first,
    as the API takes them, or shortest first, each joining prompt wider than
    the batch): each prompt's hypotheses are its own alone."""
    _, decoder = ending
    settings = our_settings(SETTINGS["early_true_penalty_2_ngram_3"])
    options = BeamOptions(**{k: v for k, v in settings.items() if k != "max_tokens"})
    ids = sorted(map(decoder.prompt_ids, PROMPTS), key=len, reverse=longest_first)
    searches = dict(beam.beam_search(decoder.model, ids, 2, settings["max_tokens"], options))
    steps = set()
    for i, prompt in enumerate(ids):
        alone = decoder.generate(prompt, **settings)
        batched = searches[i].finished[: options.num_return_sequences]
        assert [h.tokens for h in batched] == [h.tokens for h in alone.sequences]
        assert [h.score for h in batched] == pytest.approx(
            [h.score for h in alone.sequences], abs=1e-5
        )
        assert searches[i].steps == alone.n_steps
        steps.add(alone.n_steps)
    assert len(steps) > 1  # prompts left the batch while others went on


def cross_bytes(cache) -> int:
    return sum(array.nbytes for pair in cache.cross_buffers for array in pair)


def test_cross_attention_is_held_once_per_prompt(ending):
    """A batch's beam cache holds each prompt's cross-attention keys and
    values once (the bytes of one row per prompt, not N), and decoding its
    beams gives what copies of them per beam give; when a prompt's search
    ends, its keys and values leave."""
    _, decoder = ending
    model, num_beams = decoder.model, 4
    ids = [decoder.prompt_ids(prompt) for prompt in PROMPTS[:3]]
    cache = start_cache(model, ids, num_beams)
    plain = model.prompt_cache(ids)
    assert cross_bytes(cache) == cross_bytes(plain)
    assert all(keys.shape[0] == len(ids) for keys, _ in cache.cross_buffers)

    rows = len(ids) * num_beams
    copied = beam.DecoderCache(
        [tuple(mx.repeat(a, num_beams, axis=0) for a in pair) for pair in plain.cross_buffers],
        [length for length in plain.prompt_lengths for _ in range(num_beams)],
    )
    assert cross_bytes(copied) == num_beams * cross_bytes(cache)
    tokens = mx.array([[0, 5, 9]] * rows) + mx.arange(rows)[:, None] % 7
    shared = model.decode(tokens, cache)
    np.testing.assert_allclose(shared, model.decode(tokens, copied), atol=1e-5, rtol=1e-5)

    # Prompt 1's search ends; the beams of 0 and 2 take their parents' positions.
    parents = [1, 0, 0, 3, 8, 8, 9, 11]
    before = [np.array(layer.keys[:rows, :, :3]) for layer in cache.self_attn]
    cache.take_beams(parents)
    for layer, keys in zip(cache.self_attn, before, strict=True):
        np.testing.assert_array_equal(np.array(layer.keys[: len(parents), :, :3]), keys[parents])
    assert cache.lengths == [3] * len(parents)
    assert all(keys.shape[0] == 2 for keys, _ in cache.cross_buffers)
    assert cache.prompt_lengths == [len(ids[0]), len(ids[2])]


def test_bad_beam_options_are_refused(ending):
    _, decoder = ending
    for options, message in [
        ({"num_beams": 0}, "num_beams must be"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences must be"),
        ({"num_beams": 2, "early_stopping": "sometimes"}, "early_stopping must be"),
        ({"num_beams": 2, "no_repeat_ngram_size": -1}, "no_repeat_ngram_size must be"),
        ({"num_beams": 2, "temp": 0.5}, "does not sample"),
        ({"num_beams": 1, "length_penalty": 2.0}, "length_penalty goes with beam search"),
        ({"no_repeat_ngram_size": 3}, "no_repeat_ngram_size goes with beam search"),
    ]:
        with pytest.raises(ValueError, match=message):
            decoder.generate(PROMPTS[0], **options)


def run_main(argv: list[str], capsys) -> tuple[int, str, str]:
    """main.py's exit status, standard output and standard error, in this process."""
    try:
        status = main_module.main(argv)
    except SystemExit as exit:  # the parser's errors
        status = exit.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def transformers_text(hf_model, tokenizer, prompt: str, **settings) -> tuple[str, float]:
    """transformers' best text for ``prompt`` and its score."""
    rows, scores = transformers_beams(hf_model, tokenizer, prompt, settings)
    return tokenizer.decode(rows[0], skip_special_tokens=True), scores[0]


def test_task_applies_its_prefix_beams_and_lengths(ending, hf_ending, capsys):
    """--task translation_en_to_de is transformers' pipeline: the prefix,
    3 beams, early stopping, max_length 13 (12 new tokens)."""
    directory, decoder = ending
    hf_model = load_hf(hf_ending)
    status, out, err = run_main(
        [
            *("--model-name", str(directory), "--draft-model-name", "none"),
            *("--task", "translation_en_to_de", "--prompt", "the sea"),
        ],
        capsys,
    )
    assert status == 0, err
    expected, _ = transformers_text(
        hf_model,
        decoder.tokenizer,
        "translate English to German: the sea",
        num_beams=3,
        early_stopping=True,
        max_length=13,
    )
    assert out == expected + "\n"
    assert "note:" not in err


def test_a_flag_given_wins_over_the_task(ending, hf_ending, capsys):
    directory, decoder = ending
    hf_model = load_hf(hf_ending)
    prompt = "the children walked to the old market by the river."
    argv = ["--model-name", str(directory), "--task", "summarization", "--prompt", prompt]
    status, out, err = run_main([*argv, "--num-beams", "2", "-m", "9"], capsys)
    assert status == 0, err
    expected, _ = transformers_text(
        hf_model,
        decoder.tokenizer,
        "summarize: " + prompt,
        num_beams=2,
        length_penalty=2.0,
        early_stopping=True,
        no_repeat_ngram_size=3,
        min_length=5,
        max_new_tokens=9,
    )
    assert out == expected + "\n"


def test_output_holds_each_prompts_sequences_and_scores(ending, hf_ending, tmp_path, capsys):
    directory, decoder = ending
    hf_model = load_hf(hf_ending)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:3]) + "\n")
    output = tmp_path / "out.jsonl"
    argv = ["--model-name", str(directory), "--prompts", str(prompts), "--output", str(output)]
    beams = ["--num-beams", "3", "--num-return-sequences", "2", "-m", "12", "--batch-size", "2"]
    status, _, err = run_main([*argv, *beams, "--draft-model-name", "none"], capsys)
    assert status == 0, err
    records = sorted(map(json.loads, output.read_text().splitlines()), key=lambda r: r["index"])
    assert [record["index"] for record in records] == [0, 1, 2]
    for prompt, record in zip(PROMPTS, records):
        rows, scores = transformers_beams(
            hf_model,
            decoder.tokenizer,
            prompt,
            {"num_beams": 3, "num_return_sequences": 2, "max_new_tokens": 12},
        )
        assert len(record["sequences"]) == 2
        for sequence, row, score in zip(record["sequences"], rows, scores):
            assert row[: len(sequence["tokens"])] == sequence["tokens"]
            assert sequence["score"] == pytest.approx(score, rel=1e-5, abs=1e-4)
            assert sequence["text"] == decoder.tokenizer.decode(
                sequence["tokens"], skip_special_tokens=True
            )
        assert record["text"] == record["sequences"][0]["text"]
        assert record["score"] == record["sequences"][0]["score"]
    # Without --output, standard output has each prompt's best text, a line each, in order.
    status, out, err = run_main([*argv[:-2], *beams, "--draft-model-name", "none"], capsys)
    assert status == 0, err
    assert out.splitlines() == [record["text"] for record in records]


def test_with_a_draft_model_beams_run_plain_and_say_so_once(ending, converted_pair, capsys):
    directory, decoder = ending
    argv = ["--model-name", str(directory), "--prompt", PROMPTS[3], "--num-beams", "3", "-m", "9"]
    status, out, err = run_main([*argv, "--draft-model-name", str(converted_pair[1])], capsys)
    assert status == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "beam search" in notes[0], err
    assert not any(line.startswith("Loading") and "draft" in line for line in err.splitlines())
    expected = decoder.generate(PROMPTS[3], num_beams=3, max_tokens=9).text
    assert out == expected + "\n"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-beams", "0"], "--num-beams: 0 is not >= 1"),
        (["--num-beams", "2", "--num-return-sequences", "3"], "--num-return-sequences 3"),
        (["--task", "translation_en_to_fr"], "--task translation_en_to_fr: the model has no"),
        (["--num-beams", "2", "--temp", "0.5"], "does not sample"),
        (["--length-penalty", "2"], "--length-penalty goes with beam search"),
        (["--early-stopping", "maybe"], "'maybe' is not true, false or never"),
        (["--num-beams", "2", "--show-draft"], "--show-draft colours draft tokens"),
        (["--draft-levels", "2"], "--draft-levels goes with beam search"),
        (["--num-beams", "2", "--draft-levels", "2"], "--draft-levels drafts with a draft model"),
    ],
)
def test_bad_beam_flags_get_one_line(flags, message, ending, capsys):
    directory, _ = ending
    argv = ["--model-name", str(directory), "--draft-model-name", "none", "--regular-decode"]
    status, out, err = run_main([*argv, "--prompt", "the sea", *flags], capsys)
    assert status != 0 and not out
    lines = [line for line in err.splitlines() if not line.startswith("Loading")]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], err


@pytest.mark.parametrize(
    "field, value", [("num_beams", 4), ("best_of", 4), ("n", 4), ("num_return_sequences", 2)]
)
def test_the_server_refuses_beam_search_naming_the_field(field, value):
    from protocol import RequestError, parse_completion

    with pytest.raises(RequestError) as refused:
        parse_completion({"prompt": "the sea", field: value}, 100, "t5")
    assert refused.value.status == 400 and refused.value.param == field
    assert field in refused.value.message
    parse_completion({"prompt": "the sea", "num_beams": 1}, 100, "t5")  # as if absent


def test_beams_with_data_parallel_get_one_line(ending, tmp_path, capsys):
    directory, _ = ending
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the sea\n")
    argv = ["--model-name", str(directory), "--prompts", str(prompts), "--num-beams", "2"]
    status, out, err = run_main([*argv, "--data-parallel", "--regular-decode"], capsys)
    lines = [line for line in err.splitlines() if line.startswith(("error:", "Traceback"))]
    assert status == 1 and not out and len(lines) == 1, err
    assert lines[0].startswith("error: beam search runs in one process: not with --data-parallel")
