"""Speculative beam search gives plain beam search's hypotheses and scores,
whatever the draft proposes: a tree's tokens attend as each one's path
would (positions and masks), the caches keep the accepted paths, and the
search covers several levels per pass where the draft agrees."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_beam import (  # noqa: F401
    PROMPTS,
    SETTINGS,
    ending,
    hf_ending,
    our_settings,
    run_main,
)

import beam
from beam import BeamOptions, start_cache
from cache import Tree
from decoder import SpeculativeDecoder
from loading import load_model
from speculative_beam import TreeStep

# A tree over 2 rows with different cached lengths: (parent index, token)
# of each new token after the row's root (index 0, parent -1).
TREES = [
    [(-1, 4), (0, 9), (0, 11), (1, 7), (2, 7), (3, 30), (1, 12)],
    [(-1, 5), (0, 6), (1, 8), (0, 13)],
]


def path_to(tree: list[tuple[int, int]], index: int) -> list[int]:
    """The tokens from the root to node ``index`` of ``tree``."""
    tokens = []
    while index >= 0:
        parent, token = tree[index]
        tokens.append(token)
        index = parent
    return tokens[::-1]


def test_a_tree_attends_as_each_of_its_paths(ending):  # noqa: F811
    """Each node's logits in a tree pass equal those of its root-to-node path
    decoded as a chain; then the cache keeps one path per row, and the next
    token's logits equal the chain's."""
    _, decoder = ending
    model = decoder.model
    ids = [decoder.prompt_ids(prompt) for prompt in PROMPTS[:2]]
    prefixes = [[0, 21, 35, 40], [0, 17]]  # rows of different cached lengths

    def cache_with_prefixes():
        cache = start_cache(model, ids, 1)
        # Row 1 padded, then trimmed: the rows end at different columns.
        model.decode(mx.array([prefixes[0], prefixes[1] + [1, 1]]), cache)
        cache.trim([0, 2])
        return cache

    def chain_logits(row: int, tokens: list[int]) -> np.ndarray:
        single = start_cache(model, [ids[row]], 1)
        return np.array(model.decode(mx.array([prefixes[row] + tokens]), single)[0, -1])

    cache = cache_with_prefixes()
    assert cache.lengths == [len(p) for p in prefixes]
    width = max(map(len, TREES))
    parents = np.full((2, width), -1)
    tokens = np.zeros((2, width), np.int64)
    for row, tree in enumerate(TREES):
        parents[row, : len(tree)], tokens[row, : len(tree)] = zip(*tree)
    logits = model.decode(mx.array(tokens), cache, Tree.from_parents(parents))
    for row, tree in enumerate(TREES):
        for index in range(len(tree)):
            np.testing.assert_allclose(
                np.array(logits[row, index]),
                chain_logits(row, path_to(tree, index)),
                atol=1e-4,
                rtol=1e-4,
            )
    kept = [[0, 1, 3, 5], [0, 3]]
    cache.keep_new(kept, width)
    assert cache.lengths == [len(p) + len(k) for p, k in zip(prefixes, kept, strict=True)]
    following = np.array(model.decode(mx.array([[3], [8]]), cache)[:, -1])
    for row, tree in enumerate(TREES):
        np.testing.assert_allclose(
            following[row],
            chain_logits(row, path_to(tree, kept[row][-1]) + [[3], [8]][row]),
            atol=1e-4,
            rtol=1e-4,
        )


@pytest.fixture(scope="module")
def drafts(ending, converted_pair):  # noqa: F811
    """Draft models of the beam tests' main model: itself (its trees hold
    most of the main model's choices), and the decoding tests' draft
    (another end-of-sequence row, its output projection perturbed)."""
    directory, _ = ending
    return {"itself": load_model(directory), "perturbed": load_model(converted_pair[1])}


def search_all(decoder, settings: dict, batch_size: int, **tree) -> dict[int, beam.PromptBeams]:
    """Every prompt's search, ``batch_size`` at a time, with ``tree``'s
    draft_levels and draft_width (none: plain beam search)."""
    options = BeamOptions(**{k: v for k, v in settings.items() if k != "max_tokens"}, **tree)
    ids = [decoder.prompt_ids(prompt) for prompt in PROMPTS]
    max_tokens = settings["max_tokens"]
    step = TreeStep(decoder.model, decoder.draft_model, options, max_tokens) if tree else None
    return dict(beam.beam_search(decoder.model, ids, batch_size, max_tokens, options, step))


@pytest.mark.parametrize("name", ["defaults", "early_true_penalty_2_ngram_3", "never_ngram_2"])
@pytest.mark.parametrize("draft", ["itself", "perturbed"])
def test_speculative_beam_search_equals_plain_beam_search(name, draft, ending, drafts):  # noqa: F811
    """The hypotheses and scores of every prompt, batched 2 at a time, equal
    plain beam search's at 1 and 3 levels and 2 widths; with the main model
    as its own draft, passes cover several levels."""
    _, plain_decoder = ending
    decoder = SpeculativeDecoder(plain_decoder.model, drafts[draft], plain_decoder.tokenizer)
    settings = our_settings(SETTINGS[name])
    plain = search_all(decoder, settings, batch_size=2)
    for levels, width in [(1, 0), (3, 0), (3, settings["num_beams"])]:
        tree = search_all(decoder, settings, 2, draft_levels=levels, draft_width=width)
        for i, search in plain.items():
            assert [h.tokens for h in tree[i].finished] == [h.tokens for h in search.finished]
            assert [h.score for h in tree[i].finished] == pytest.approx(
                [h.score for h in search.finished], abs=1e-5
            )
            assert tree[i].levels == search.levels == search.steps
        levels_per_pass = sum(s.levels for s in tree.values()) / sum(s.steps for s in tree.values())
        print(f"\n{draft}, {levels} levels of {width or 'default'}: {levels_per_pass:.2f}")
        if draft == "itself" and levels == 3 and not width:
            assert levels_per_pass > 2.5
        assert levels_per_pass <= levels + 1


def test_the_api_takes_draft_levels_and_needs_a_draft_model(ending, drafts):  # noqa: F811
    _, plain_decoder = ending
    decoder = SpeculativeDecoder(plain_decoder.model, drafts["perturbed"], plain_decoder.tokenizer)
    settings = {"num_beams": 3, "max_tokens": 12}
    expected = plain_decoder.generate(PROMPTS[0], **settings)
    result = decoder.generate(PROMPTS[0], draft_levels=2, **settings)
    assert result.tokens == expected.tokens
    assert result.n_steps < expected.n_steps or result.n_steps == expected.n_steps
    with pytest.raises(ValueError, match="needs a draft model"):
        plain_decoder.generate(PROMPTS[0], draft_levels=2, **settings)


def test_main_runs_speculative_beam_search_with_draft_levels(
    ending,  # noqa: F811
    converted_pair,
    tmp_path,
    capsys,
):
    """main.py --draft-levels G with a draft model: plain beam search's texts
    for a file of prompts, batched, with no note; with --prompt-lookup, one
    line."""
    directory, decoder = ending
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    argv = ["--model-name", str(directory), "--draft-model-name", str(converted_pair[1])]
    argv += ["--prompts", str(prompts), "--num-beams", "3", "-m", "12", "--batch-size", "2"]
    status, out, err = run_main([*argv, "--draft-levels", "2"], capsys)
    assert status == 0, err
    assert not any(line.startswith("note:") for line in err.splitlines()), err
    expected = decoder.generate_batch(PROMPTS, num_beams=3, max_tokens=12)
    assert out.splitlines() == [result.text for result in expected]

    status, out, err = run_main([*argv, "--draft-levels", "2", "--prompt-lookup", "2"], capsys)
    assert status != 0 and not out
    errors = [line for line in err.splitlines() if not line.startswith("Loading")]
    refusal = (
        "error: --prompt-lookup: speculative beam search (--draft-levels) drafts with the "
        "draft model alone"
    )
    assert errors == [refusal], err
