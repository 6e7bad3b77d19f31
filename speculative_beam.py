"""Speculative beam search: a draft model proposes, for every prompt's
beams, a tree of candidate continuations; the main model scores the whole
tree in one pass; and beam search advances as many levels as its own
choices stay inside the tree. Its output is plain beam search's by
construction: every choice is made from the main model's log-probabilities,
exactly as ``beam.BeamStep`` makes it, and the draft only decides how many
levels one pass covers.

The tree (``DraftTree.propose``) is the draft's own beam search from the
main model's beams: at each of ``levels`` levels, the ``width`` best (parent,
token) continuations by summed log-probabilities, the first level's parents
being the beams (scored as beam search scores them). The main model's pass
holds a row per beam: its last token, then the tree nodes that descend from
it, each attending to the beam's cached positions and to its own ancestors
(``cache.Tree``). The logits of the beam's last token give the first step,
as in plain beam search. After a step, if every new beam is a node of the
tree, that node's logits give the next step; at the first level where one
is not, the pass ends with that level's beams chosen (at least one level
per pass, as the bonus token gives regular speculation). The caches then
keep each new beam's path: the positions of its ancestors' nodes, which the
pass computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx
import numpy as np

from beam import BeamCache, BeamOptions, BeamStep, PromptBeams, advance, best_continuations
from cache import Tree
from model import T5


@dataclass
class Level:
    """One level of a prompt's tree: for each of its nodes (best first), the
    index of its parent (a beam at the first level, else a node of the
    level before) and its token."""

    parents: np.ndarray  # int [width]
    tokens: np.ndarray  # int [width]


class DraftTree(BeamCache):
    """The draft model's side of speculative beam search: its decoder cache
    of every beam's tokens but the last (the rows ordered as the main
    model's), and the tree it proposes from them."""

    def __init__(self, draft: T5, num_beams: int, levels: int, width: int):
        super().__init__(draft, num_beams)
        self.levels, self.width = levels, width

    def propose(self, searches: Sequence[PromptBeams]) -> list[list[Level]]:
        """Each search's tree, level by level. First the draft catches up
        with the beams' tokens it has not seen (the path a pass accepted
        and the last token), one pass for all rows."""
        sequences = [sequence for search in searches for sequence in search.sequences]
        unseen = [sequence[n:] for sequence, n in zip(sequences, self.cache.lengths, strict=True)]
        longest = max(map(len, unseen))
        inputs = mx.array([tokens + [0] * (longest - len(tokens)) for tokens in unseen])
        logits = self.model.decode(inputs, self.cache)
        self.cache.trim([longest - len(tokens) for tokens in unseen])
        logits = logits[mx.arange(len(unseen)), mx.array([len(tokens) - 1 for tokens in unseen])]
        scores = mx.array(np.concatenate([search.scores for search in searches]))
        branches = self.cache.fork()
        trees: list[list[Level]] = [[] for _ in searches]
        rows_per_prompt = self.num_beams
        for level in range(self.levels):
            logits = logits.astype(mx.float32)
            totals = logits - mx.logsumexp(logits, axis=-1, keepdims=True) + scores[:, None]
            values, flat = best_continuations(totals.reshape(len(searches), -1), self.width)
            parents, tokens = np.divmod(flat, logits.shape[-1])
            for tree, node_parents, node_tokens in zip(trees, parents, tokens, strict=True):
                tree.append(Level(node_parents, node_tokens))
            if level + 1 == self.levels:
                return trees
            rows = np.arange(len(searches))[:, None] * rows_per_prompt + parents
            branches.take_beams(rows.ravel().tolist(), beams=self.width)
            rows_per_prompt = self.width
            logits = self.model.decode(mx.array(tokens.reshape(-1, 1)), branches)[:, -1]
            # A node that ends its hypothesis has no children.
            ends = tokens.reshape(-1) == self.model.args.eos_token_id
            scores = mx.array(np.where(ends, -np.inf, values.reshape(-1)))
        return trees


@dataclass
class BeamPath:
    """Where a beam lies in the main model's pass: its row (the beam it
    descends from at the pass's start); ``path``, the indices in that row
    of its tokens the pass computed, which its caches keep (that beam's last
    token, at 0, first); and ``node``, the index of its own last token, or
    None where the tree does not hold it."""

    row: int
    path: list[int]
    node: int | None


class TreeStep(BeamStep):
    """A pass of speculative beam search (see the module's docstring):
    the draft's tree for every prompt's beams, scored by the main model in
    one pass, and as many steps of beam search as the tree covers."""

    def __init__(self, model: T5, draft: T5, options: BeamOptions, max_tokens: int):
        super().__init__(model, options, max_tokens)
        width = options.draft_width or 2 * options.num_beams
        self.draft = DraftTree(draft, options.num_beams, options.draft_levels, width)

    def add_prompts(self, prompts: Sequence[Sequence[int]]) -> None:
        super().add_prompts(prompts)
        self.draft.add_prompts(prompts)

    def __call__(self, searches: Sequence[PromptBeams]) -> None:
        """Steps of the ``searches`` (the batch's prompts, in order) while
        the tree holds their beams."""
        num_beams = self.options.num_beams
        trees = self.draft.propose(searches)
        for search in searches:
            search.steps += 1
        inputs, parents, children = self.rows(searches, trees)
        logits = self.model.decode(mx.array(inputs), self.cache, Tree.from_parents(parents))
        beams = {
            i: [BeamPath(i * num_beams + beam, [], 0) for beam in range(num_beams)]
            for i in range(len(searches))
        }
        running = list(range(len(searches)))
        eos = self.model.args.eos_token_id
        while running:
            places = [place for i in running for place in beams[i]]
            rows = mx.array([place.row for place in places])
            nodes = mx.array([place.node for place in places])
            chosen = advance(
                [searches[i] for i in running],
                logits[rows, nodes],
                self.options,
                self.max_tokens,
                eos,
            )
            covered = []
            for i, chosen_parents in zip(running, chosen, strict=True):
                if chosen_parents is None:
                    del beams[i]
                    continue
                new_beams = []
                for parent, sequence in zip(chosen_parents, searches[i].sequences, strict=True):
                    place = beams[i][parent]
                    node = children.get((place.row, place.node, sequence[-1]))
                    new_beams.append(BeamPath(place.row, place.path + [place.node], node))
                beams[i] = new_beams
                if all(place.node is not None for place in new_beams):
                    covered.append(i)
            running = covered
        kept = [place for i in sorted(beams) for place in beams[i]]
        rows = [place.row for place in kept]
        self.keep(rows)
        self.draft.keep(rows)
        if kept:
            self.cache.keep_new([place.path for place in kept], inputs.shape[1])

    def rows(
        self, searches: Sequence[PromptBeams], trees: list[list[Level]]
    ) -> tuple[np.ndarray, np.ndarray, dict[tuple[int, int, int], int]]:
        """The main model's pass: a row per beam, its last token then the
        tree's nodes that descend from it, level by level (padded at the
        end); each token's parent's index in its row (-1: none); and where
        each node lies, keyed by (row, its parent's index, its token)."""
        num_beams = self.options.num_beams
        row_tokens = [[sequence[-1]] for search in searches for sequence in search.sequences]
        row_parents = [[-1] for _ in row_tokens]
        children = {}
        for i, tree in enumerate(trees):
            # Each node of the level before: its row and its index there.
            places = [(i * num_beams + beam, 0) for beam in range(num_beams)]
            for level in tree:
                next_places = []
                for parent, token in zip(level.parents.tolist(), level.tokens.tolist()):
                    row, parent_index = places[parent]
                    index = len(row_tokens[row])
                    row_tokens[row].append(token)
                    row_parents[row].append(parent_index)
                    children[(row, parent_index, token)] = index
                    next_places.append((row, index))
                places = next_places
        length = max(map(len, row_tokens))
        inputs = np.array([tokens + [0] * (length - len(tokens)) for tokens in row_tokens])
        parents = np.array([indices + [-1] * (length - len(indices)) for indices in row_parents])
        return inputs, parents, children
