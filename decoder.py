"""Regular and speculative decoding (Leviathan et al., arXiv 2211.17192) for T5 in MLX.

One speculative round:

1. the draft model proposes ``g`` tokens x_1..x_g, one at a time, from its
   distributions q_1..q_g;
2. the main model scores the last accepted token and x_1..x_g in one pass,
   giving its distributions p_1..p_{g+1};
3. each x_i is accepted in turn until the first rejection; the round then
   adds one token of the main model's own: a replacement for the rejected
   token, or one more token after x_g when all were accepted.

So every round costs one main-model pass and adds between 1 and g+1 tokens.
The host waits once per round, for the accepted count and the next token.

Drafts come from a drafter: ``ModelDrafter`` (a small model),
``PromptLookupDrafter`` (tokens that followed an earlier occurrence of the
output's last n-gram, no model at all) or ``HybridDrafter`` (lookup where it
matches, the model elsewhere). A lookup draft is a point mass: its proposal
distribution q is one-hot, so ``verify`` needs no rule of its own.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# First: the fast BLAS on Linux must load before mlx (see model.py).
import blas  # noqa: F401  # isort: skip
import mlx.core as mx

from cli import SEEDS, is_seed
from model import T5, DecoderCache, ModelArgs, load_config


class IncompatibleDraftError(ValueError):
    """The draft model cannot propose tokens for the main model."""


@dataclass(frozen=True)
class Sampling:
    """How a token is chosen from logits. ``temp == 0`` means greedy (argmax);
    otherwise softmax(logits / temp), restricted to the ``top_k`` likeliest
    tokens (0: all) and to the smallest set whose probability reaches ``top_p``."""

    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self):
        if self.temp < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temp == 0

    def probabilities(self, logits: mx.array) -> mx.array:
        """The sampling distribution over the last axis of ``logits``."""
        logits = logits.astype(mx.float32) / self.temp
        if 0 < self.top_k < logits.shape[-1]:
            kth_largest = mx.topk(logits, self.top_k, axis=-1).min(axis=-1, keepdims=True)
            logits = mx.where(logits < kth_largest, -mx.inf, logits)
        probs = mx.softmax(logits, axis=-1)
        if self.top_p < 1:
            descending = -mx.sort(-probs, axis=-1)
            mass_before = mx.cumsum(descending, axis=-1) - descending
            # The smallest kept probability: tokens before it hold < top_p.
            num_kept = (mass_before < self.top_p).sum(axis=-1, keepdims=True)
            smallest_kept = mx.take_along_axis(descending, num_kept - 1, axis=-1)
            probs = mx.where(probs < smallest_kept, 0.0, probs)
            probs = probs / probs.sum(axis=-1, keepdims=True)
        return probs

    def sample(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """One token per row of ``logits``, and the distribution it was drawn
        from (None when greedy)."""
        if self.greedy:
            return mx.argmax(logits, axis=-1), None
        probs = self.probabilities(logits)
        return mx.random.categorical(mx.log(probs)), probs


def verify(
    draft_tokens: mx.array,
    draft_probs: mx.array | None,
    main_logits: mx.array,
    sampling: Sampling,
    delta: float,
) -> tuple[mx.array, mx.array]:
    """Decide how many of the ``g`` draft tokens the main model accepts, and
    the token that follows them.

    ``main_logits`` has ``g + 1`` rows: row i scores the position of draft
    token i, the last row the position after all of them. Returns
    ``(num_accepted, next_token)`` as scalar arrays.

    Sampling (temp > 0): x_i is accepted when ``u * (1 - delta) * q(x) <= p(x)``
    with u uniform in (0, 1]; for delta = 0 that is probability min(1, p/q),
    the paper's rule, and a rejected token is replaced by a sample from
    normalize(max(0, p - q)). Greedy (temp = 0): x_i is accepted when it is
    the main model's argmax or, for delta > 0, when ``p(x) >= (1 - delta) *
    max p`` with p the main model's softmax; a rejected token is replaced by
    the argmax. In both, delta = 1 accepts every draft token.
    """
    num_draft = draft_tokens.shape[0]
    if num_draft == 0:  # nothing to verify: an ordinary decoding step
        return mx.array(0), sampling.sample(main_logits[0])[0]
    if sampling.greedy:
        main_tokens = mx.argmax(main_logits, axis=-1)
        accepted = draft_tokens == main_tokens[:num_draft]
        if delta > 0:
            probs = mx.softmax(main_logits[:num_draft].astype(mx.float32), axis=-1)
            chosen = mx.take_along_axis(probs, draft_tokens[:, None], axis=-1)[:, 0]
            accepted = accepted | (chosen >= (1 - delta) * probs.max(axis=-1))
        candidates = main_tokens
    else:
        probs = sampling.probabilities(main_logits)
        p = mx.take_along_axis(probs[:num_draft], draft_tokens[:, None], axis=-1)[:, 0]
        q = mx.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]
        u = 1 - mx.random.uniform(shape=(num_draft,))
        accepted = u * (1 - delta) * q <= p
        # Row i < g: the replacement should x_i be rejected; row g: the extra token.
        residual = mx.maximum(probs[:num_draft] - draft_probs, 0)
        candidates = mx.random.categorical(
            mx.log(mx.concatenate([residual, probs[num_draft:]], axis=0))
        )
    num_accepted = mx.cumprod(accepted.astype(mx.int32)).sum()
    return num_accepted, candidates[num_accepted]


# The most draft tokens "auto" proposes per round.
MAX_AUTO_DRAFT = 16
# When "auto" finds drafting not worth it, it still drafts one token every
# this many rounds, so its estimate can notice the draft agreeing again.
PROBE_EVERY = 8
# Before a generation's first tested draft token at a given position, "auto"
# assumes this acceptance rate there, weighted as this many tested tokens.
PRIOR_ACCEPTANCE = 0.75
PRIOR_WEIGHT = 4


def expected_tokens_per_round(alpha: float, num_draft: int) -> float:
    """Leviathan et al., eq. 1: the expected tokens a round of ``num_draft``
    draft tokens yields when each is accepted with probability ``alpha``,
    ``(1 - alpha^(g+1)) / (1 - alpha)``."""
    if alpha >= 1:
        return num_draft + 1
    return (1 - alpha ** (num_draft + 1)) / (1 - alpha)


def best_num_draft(acceptance: list[float], draft_cost: float, verify_costs: list[float]) -> int:
    """The g in 0 .. len(verify_costs) - 1 with the most expected tokens per
    unit of time. ``acceptance[i]`` is the probability that draft token i + 1
    is accepted once the tokens before it were, so a round of g yields
    ``1 + a_1 + a_1 a_2 + ... + a_1 ... a_g`` tokens (eq. 1 when every a_i is
    the same alpha); it costs ``g * draft_cost + verify_costs[g]``: g draft
    steps and a main pass over g + 1 tokens, both relative to a main pass
    over one token (``verify_costs[0] == 1``). g = 0 is a plain main-model
    step, one token per pass: the choice when drafting does not pay."""
    reach = np.cumprod(acceptance[: len(verify_costs) - 1])  # a_1 ... a_i
    # Index g: the tokens a round of g draft tokens yields.
    tokens = 1 + np.concatenate([[0.0], np.cumsum(reach)])
    return max(
        range(len(verify_costs)),
        key=lambda g: tokens[g] / (g * draft_cost + verify_costs[g]),
    )


def pass_times(
    model: T5, encoder_output: mx.array, max_length: int, repeats: int = 3
) -> list[float]:
    """Median seconds of one decoder pass of ``model`` over 1 .. ``max_length``
    tokens, after one cached token, timed in rounds so drift hits every length."""
    cache = model.make_cache(encoder_output)
    start = mx.array([[model.args.decoder_start_token_id]])
    mx.eval(model.decode(start, cache))
    times = [[] for _ in range(max_length)]
    for _ in range(repeats):
        for length in range(1, max_length + 1):
            tic = time.perf_counter()
            mx.eval(model.decode(mx.repeat(start, length, axis=1), cache))
            times[length - 1].append(time.perf_counter() - tic)
            cache.trim(length)
    return [statistics.median(t) for t in times]


@dataclass
class Draft:
    """Tokens proposed for one round, and their proposal distributions."""

    tokens: mx.array  # (g,)
    probs: mx.array | None  # (g, vocabulary); None when greedy
    source: str  # "model" or "lookup": whose acceptance estimate the round updates


class ModelDrafter:
    """Drafts with a small model, one token at a time, for one generation."""

    source = "model"

    def __init__(self, model: T5, prompt_ids: mx.array):
        self.model = model
        self.cache = model.make_cache(model.encode(prompt_ids))
        mx.eval(self.cache.cross_keys_values)

    def propose(
        self, sequence: list[int], sampling: Sampling, budget: Callable[[str], int]
    ) -> Draft | None:
        """``budget("model")`` tokens, without waiting for them (the last one
        is not fed back); None for a budget of 0."""
        num_draft = budget(self.source)
        if num_draft == 0:
            return None
        inputs = mx.array([_catch_up(self.cache, sequence)])
        tokens, probs = [], []
        for _ in range(num_draft):
            logits = self.model.decode(inputs, self.cache)[0, -1]
            token, token_probs = sampling.sample(logits)
            # Start computing this token while Python builds the next step's
            # graph; nothing waits for it until the round's single eval.
            mx.async_eval(token)
            tokens.append(token)
            probs.append(token_probs)
            inputs = token.reshape(1, 1)
        draft_probs = None if sampling.greedy else mx.stack(probs)
        return Draft(mx.stack(tokens), draft_probs, self.source)


def draft_token_time(drafter: ModelDrafter, num_draft: int = 8, repeats: int = 3) -> float:
    """Median seconds per token of ``drafter`` proposing ``num_draft`` tokens
    after the start token as in a round, where each step's graph is built
    while the previous one computes (cheaper than one step timed alone)."""
    start = [drafter.model.args.decoder_start_token_id]
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(drafter.propose(start, Sampling(), lambda source: num_draft).tokens)
        times.append((time.perf_counter() - tic) / num_draft)
    return statistics.median(times)


def find_continuation(tokens: list[int], max_ngram: int, min_ngram: int = 1) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the longest
    n-gram (``max_ngram`` down to ``min_ngram``) that ends ``tokens``; empty
    when none occurs earlier."""
    array = np.array(tokens)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        # Windows of tokens[:-1] end before the last token, so the n-gram
        # never matches itself and something always follows a match.
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)
        matches = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if matches.size:
            return tokens[matches[-1] + n :]
    return []


class PromptLookupDrafter:
    """Drafts the tokens that followed the output's last n-gram where it
    occurred before, in the prompt or in the output (prompt-lookup decoding).
    The proposal is deterministic: a point mass."""

    source = "lookup"

    def __init__(self, prompt_ids: mx.array, vocab_size: int, max_ngram: int, min_ngram: int = 1):
        self.prompt = prompt_ids[0].tolist()
        self.vocab_size = vocab_size
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(
        self, sequence: list[int], sampling: Sampling, budget: Callable[[str], int]
    ) -> Draft | None:
        """Up to ``budget("lookup")`` tokens; None when no n-gram matches or
        the budget is 0."""
        output = sequence[1:]  # without the start token
        if not output:
            return None
        found = find_continuation(self.prompt + output, self.max_ngram, self.min_ngram)
        found = found[: budget(self.source)] if found else []
        if not found:
            return None
        tokens = mx.array(found)
        probs = None
        if not sampling.greedy:
            probs = (mx.arange(self.vocab_size) == tokens[:, None]).astype(mx.float32)
        return Draft(tokens, probs, self.source)


class HybridDrafter:
    """Prompt lookup where it finds a match, the draft model elsewhere."""

    def __init__(self, lookup: PromptLookupDrafter, model: ModelDrafter):
        self.lookup, self.model = lookup, model

    def propose(
        self, sequence: list[int], sampling: Sampling, budget: Callable[[str], int]
    ) -> Draft | None:
        return self.lookup.propose(sequence, sampling, budget) or self.model.propose(
            sequence, sampling, budget
        )


DRAFT_SOURCES = ("model", "lookup")


def acceptance_counts() -> dict[str, np.ndarray]:
    """For each draft source, zero [accepted, tested] counts per draft position."""
    return {source: np.zeros((2, MAX_AUTO_DRAFT)) for source in DRAFT_SOURCES}


class DraftLength:
    """Draft tokens per round: a fixed number, or for ``"auto"`` the g that
    ``best_num_draft`` picks from measured costs and the acceptance so far,
    kept apart for each draft source and each position in the draft:
    acceptance is not independent from token to token (a draft that got past
    its first tokens tends to go on agreeing), so one rate for all positions
    misjudges long drafts.

    ``earlier`` holds, per source, the [accepted, tested] counts per position
    of the decoder's earlier generations, and is updated too. This
    generation starts from their rate (itself starting from the prior),
    weighted as PRIOR_WEIGHT tokens, so its own rounds soon outweigh it."""

    def __init__(
        self,
        num_draft: int | str,
        draft_costs: dict[str, float],
        verify_costs: list[float],
        earlier: dict[str, np.ndarray] | None = None,
    ):
        self.num_draft = num_draft
        self.draft_costs, self.verify_costs = draft_costs, verify_costs
        self.earlier = acceptance_counts() if earlier is None else earlier
        self.counts = {}  # per source: [accepted, tested] per position, prior included
        for source, (accepted, tested) in self.earlier.items():
            rate = (accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / (tested + PRIOR_WEIGHT)
            self.counts[source] = np.stack([rate * PRIOR_WEIGHT, np.full_like(rate, PRIOR_WEIGHT)])
        self.undrafted = dict.fromkeys(DRAFT_SOURCES, 0)  # rounds "auto" chose not to draft

    def choose(self, source: str) -> int:
        """Draft tokens for the next round from ``source``; 0: a plain step."""
        if self.num_draft != "auto":
            return self.num_draft
        accepted, tested = self.counts[source]
        num_draft = best_num_draft(accepted / tested, self.draft_costs[source], self.verify_costs)
        if num_draft == 0:
            self.undrafted[source] += 1
            if self.undrafted[source] % PROBE_EVERY == 0:
                return 1
        return num_draft

    def update(self, source: str, num_accepted: int, num_tested: int) -> None:
        """A round tested the first ``num_tested`` draft tokens and accepted
        the first ``num_accepted`` of them."""
        for counts in (self.counts[source], self.earlier[source]):
            counts[0, :num_accepted] += 1
            counts[1, :num_tested] += 1


@dataclass
class GenerationResult:
    """The tokens and text generated so far, and what it cost."""

    tokens: list[int]
    text: str = ""
    n_draft: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens accepted
    n_rejected: int = 0  # draft tokens tested and rejected (at most one per round)
    n_steps: int = 0  # main-model decoder passes
    from_draft: list[bool] = dataclasses.field(
        default_factory=list
    )  # per token: an accepted draft token
    draft_lengths: list[int] = dataclasses.field(
        default_factory=list
    )  # per round: draft tokens proposed
    n_lookup_rounds: int = 0  # rounds drafted by prompt lookup
    prompt_tokens: int = 0  # tokens of the prompt, end-of-sequence included
    prompt_time: float = 0.0  # seconds encoding the prompt (both models, cross-attention too)
    elapsed: float = 0.0  # seconds in all, prompt processing included

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens per proposed draft token."""
        return self.n_accepted / self.n_draft if self.n_draft else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prompt_time if self.prompt_time else 0.0

    @property
    def generation_time(self) -> float:
        """Seconds spent generating, after the prompt was processed."""
        return self.elapsed - self.prompt_time

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of generation (prompt processing excluded)."""
        return len(self.tokens) / self.generation_time if self.generation_time > 0 else 0.0


def load_tokenizer(path: str | Path):
    """The Hugging Face tokenizer saved beside a converted model."""
    from transformers import AutoTokenizer

    # Without its files, transformers would quietly build a default T5
    # tokenizer from config.json and every word would become <unk>.
    if not any((Path(path) / name).is_file() for name in ("tokenizer.json", "spiece.model")):
        raise FileNotFoundError(f"{path} has no tokenizer; convert the model again with convert.py")
    return AutoTokenizer.from_pretrained(str(path))


def check_draft_compatible(
    main_args: ModelArgs,
    draft_args: ModelArgs,
    main_name: str = "main model",
    draft_name: str = "draft model",
    main_vocab: dict[str, int] | None = None,
    draft_vocab: dict[str, int] | None = None,
) -> None:
    """Raise ``IncompatibleDraftError`` unless the draft model speaks the main
    model's vocabulary: same output size, same special tokens and, when
    given, the same tokenizer vocabulary."""
    for field in (
        "vocab_size",
        "decoder_start_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        main_value, draft_value = getattr(main_args, field), getattr(draft_args, field)
        if main_value != draft_value:
            raise IncompatibleDraftError(
                f"draft model {draft_name} does not match main model {main_name}: "
                f"{field} is {draft_value} in the draft and {main_value} in the main model"
            )
    if main_vocab is not None and draft_vocab is not None and main_vocab != draft_vocab:
        differing = len({index for _, index in main_vocab.items() ^ draft_vocab.items()})
        raise IncompatibleDraftError(
            f"draft model {draft_name} does not match main model {main_name}: "
            f"their tokenizers differ in {differing} vocabulary entries"
        )


def check_draft_directories(main_path: str | Path, draft_path: str | Path) -> None:
    """``check_draft_compatible`` for two converted model directories,
    reading only their configs and tokenizers, before any weights are loaded."""
    args = [load_config(path) for path in (main_path, draft_path)]
    vocabs = [load_tokenizer(path).get_vocab() for path in (main_path, draft_path)]
    check_draft_compatible(*args, str(main_path), str(draft_path), *vocabs)


def _catch_up(cache: DecoderCache, sequence: list[int]) -> list[int]:
    """Trim ``cache`` to the accepted ``sequence`` (keeping every position
    whose token was accepted) and return the tokens it has yet to process.
    The last token of the sequence is never cached: it is the next input."""
    cache.trim(max(0, cache.offset - (len(sequence) - 1)))
    return sequence[cache.offset :]


class SpeculativeDecoder:
    """Decodes with ``model``. Drafts come from ``draft_model``, from prompt
    lookup of n-grams up to ``prompt_lookup`` tokens long (0: off), or from
    both (lookup first). ``num_draft`` is the number of draft tokens per
    round, or ``"auto"``; ``delta`` in [0, 1] relaxes acceptance."""

    def __init__(
        self,
        model: T5,
        draft_model: T5 | None,
        tokenizer,
        num_draft: int | str = 5,
        delta: float = 0.0,
        prompt_lookup: int = 0,
    ):
        if num_draft != "auto" and not (isinstance(num_draft, int) and num_draft >= 1):
            raise ValueError(f"num_draft must be >= 1 or 'auto', got {num_draft!r}")
        if not 0 <= delta <= 1:
            raise ValueError(f"delta must be in [0, 1], got {delta}")
        if prompt_lookup < 0:
            raise ValueError(f"prompt_lookup must be >= 0, got {prompt_lookup}")
        if draft_model is not None:
            check_draft_compatible(model.args, draft_model.args)
        self.model = model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.num_draft = num_draft
        self.delta = delta
        self.prompt_lookup = prompt_lookup
        self._costs = {}  # measured once: see measure_costs
        self._acceptance = {}  # per way of drafting: see DraftLength

    @property
    def drafting(self) -> str:
        """The drafting mode: "draft model", "prompt lookup", "hybrid" or "none"."""
        if self.prompt_lookup and self.draft_model is not None:
            return "hybrid"
        if self.prompt_lookup:
            return "prompt lookup"
        return "none" if self.draft_model is None else "draft model"

    def _prompt_ids(self, prompt: str | list[int]) -> mx.array:
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError("the prompt is empty")
        return mx.array([ids])

    def _drafter(self, prompt_ids: mx.array):
        """A drafter for one generation of ``prompt_ids``."""
        vocab_size = self.model.args.vocab_size
        if self.drafting == "prompt lookup":
            return PromptLookupDrafter(prompt_ids, vocab_size, self.prompt_lookup)
        model_drafter = ModelDrafter(self.draft_model, prompt_ids)
        if self.drafting == "draft model":
            return model_drafter
        # Single-token matches are weak; the draft model does better there.
        lookup = PromptLookupDrafter(
            prompt_ids, vocab_size, self.prompt_lookup, min(2, self.prompt_lookup)
        )
        return HybridDrafter(lookup, model_drafter)

    def measure_costs(self, prompt_ids: mx.array) -> tuple[dict[str, float], list[float]]:
        """What "auto" weighs, timed on ``prompt_ids`` once per decoder (and
        draft model): a draft token's time, drafted as in a round, over a
        main step's, for each draft source, and the time of a main pass over
        1 .. MAX_AUTO_DRAFT + 1 tokens over that of a pass over one. The first generation with
        num_draft="auto" pays for it, in its prompt time."""
        if "verify" not in self._costs:
            main = pass_times(self.model, self.model.encode(prompt_ids), MAX_AUTO_DRAFT + 1)
            self._costs["verify"] = [t / main[0] for t in main]
            self._costs["main step"] = main[0]
        # Looking up draft tokens costs next to nothing.
        draft_costs = {"lookup": 0.0}
        if self.draft_model is not None:
            if id(self.draft_model) not in self._costs:
                draft_step = draft_token_time(ModelDrafter(self.draft_model, prompt_ids))
                self._costs[id(self.draft_model)] = draft_step / self._costs["main step"]
            draft_costs["model"] = self._costs[id(self.draft_model)]
        return draft_costs, self._costs["verify"]

    def stream(
        self,
        prompt: str | list[int],
        *,
        speculative: bool = True,
        max_tokens: int = 100,
        temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> Iterator[GenerationResult]:
        """Decode ``prompt`` and yield the running result after every
        main-model pass. Regular decoding (``speculative=False``, or nothing
        to draft with) is the same loop with no draft tokens."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if seed is not None and not is_seed(seed):
            raise ValueError(f"seed must be {SEEDS}, got {seed!r}")
        sampling = Sampling(temp, top_p, top_k)
        speculative = speculative and self.drafting != "none"
        if seed is not None:
            mx.random.seed(seed)
        start = time.perf_counter()
        prompt_ids = self._prompt_ids(prompt)
        eos = self.model.args.eos_token_id
        main_cache = self.model.make_cache(self.model.encode(prompt_ids))
        # Prompt processing ends here, so generation speed can be told apart from it.
        mx.eval(main_cache.cross_keys_values)
        drafter = self._drafter(prompt_ids) if speculative else None
        if drafter is not None:
            costs = self.measure_costs(prompt_ids) if self.num_draft == "auto" else ({}, [])
            # Acceptance depends on the pair, how lookup matches, sampling and delta.
            key = self.drafting, self.prompt_lookup, id(self.draft_model), sampling, self.delta
            earlier = self._acceptance.setdefault(key, acceptance_counts())
            draft_length = DraftLength(self.num_draft, *costs, earlier)
        sequence = [self.model.args.decoder_start_token_id]
        result = GenerationResult(
            tokens=[],
            prompt_tokens=prompt_ids.shape[1],
            prompt_time=time.perf_counter() - start,
        )
        while len(result.tokens) < max_tokens:
            # Never propose more tokens than may still be generated.
            limit = max_tokens - len(result.tokens) - 1
            draft = None
            if drafter is not None and limit > 0:
                draft = drafter.propose(
                    sequence,
                    sampling,
                    lambda source, limit=limit: min(draft_length.choose(source), limit),
                )
            if draft is None:
                draft = Draft(mx.array([], mx.int32), None, "none")
            num_draft = draft.tokens.shape[0]
            pending = _catch_up(main_cache, sequence)
            inputs = mx.concatenate([mx.array(pending), draft.tokens])
            logits = self.model.decode(inputs[None], main_cache)[0]
            num_accepted, next_token = verify(
                draft.tokens, draft.probs, logits, sampling, self.delta
            )
            mx.eval(num_accepted, next_token, draft.tokens)

            num_accepted = num_accepted.item()
            new_tokens = draft.tokens[:num_accepted].tolist() + [next_token.item()]
            rejected = num_accepted < num_draft
            finished = eos in new_tokens
            if finished:
                end = new_tokens.index(eos)
                if end < num_accepted:  # the draft's own EOS: later draft tokens went untested
                    num_accepted, rejected = end + 1, False
                new_tokens = new_tokens[:end]
            if num_draft > 0:
                draft_length.update(draft.source, num_accepted, num_accepted + int(rejected))
                result.draft_lengths.append(num_draft)
                result.n_lookup_rounds += draft.source == "lookup"
            result.n_steps += 1
            result.n_draft += num_draft
            result.n_accepted += num_accepted
            result.n_rejected += int(rejected)
            sequence += new_tokens
            result.tokens += new_tokens
            result.from_draft += [i < num_accepted for i in range(len(new_tokens))]
            result.text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
            result.elapsed = time.perf_counter() - start
            yield result
            if finished:
                break

    def generate(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Regular decoding with the main model alone. Takes the keyword
        arguments of ``stream``: max_tokens, temp, top_p, top_k, seed."""
        return _last(self.stream(prompt, speculative=False, **kwargs))

    def speculative_decode(self, prompt: str | list[int], **kwargs) -> GenerationResult:
        """Speculative decoding; same arguments as ``generate``."""
        return _last(self.stream(prompt, speculative=True, **kwargs))


def _last(results: Iterator[GenerationResult]) -> GenerationResult:
    result = None
    for result in results:
        pass
    return result
