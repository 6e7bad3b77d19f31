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

A batch of prompts runs the same rounds, all rows in each pass: every row
proposes its own draft tokens, is verified by the same rule and keeps its
own number of them (the caches keep a length per row). Rows that finish
leave the batch and waiting prompts take their places. A single prompt is
a batch of one. Drafters and the draft-length rule live in ``drafting.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

# First: the fast BLAS on Linux must load before mlx (see model.py).
import blas  # noqa: F401  # isort: skip
import mlx.core as mx

from cli import SEEDS, is_seed
from drafting import (
    MAX_AUTO_DRAFT,
    Draft,
    DraftLength,
    HybridDrafter,
    ModelDrafter,
    PromptLookupDrafter,
    acceptance_counts,
    draft_token_time,
    pass_times,
    trim_to,
)
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
        if not 0 <= self.temp < float("inf"):  # nan fails this too
            raise ValueError(f"temperature must be a number >= 0, got {self.temp}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top-k must be an integer >= 0, got {self.top_k!r}")

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
    draft_lengths: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Decide, for every row of a batch, how many of its draft tokens the
    main model accepts, and the token that follows them.

    ``draft_tokens`` is [B, g]; row i proposed its first ``draft_lengths[i]``
    (default: all g). ``main_logits`` is [B, g + 1, vocabulary]: position j
    scores the position of draft token j, position g the one after all of
    them. Returns ``(num_accepted, next_token)``, each [B].

    Sampling (temp > 0): x_i is accepted when ``u * (1 - delta) * q(x) <= p(x)``
    with u uniform in (0, 1]; for delta = 0 that is probability min(1, p/q),
    the paper's rule, and a rejected token is replaced by a sample from
    normalize(max(0, p - q)). Greedy (temp = 0): x_i is accepted when it is
    the main model's argmax or, for delta > 0, when ``p(x) >= (1 - delta) *
    max p`` with p the main model's softmax; a rejected token is replaced by
    the argmax. In both, delta = 1 accepts every draft token. A row that
    accepted all its draft tokens adds one sampled from p (its q is zero
    past its length, so the residual there is p itself).
    """
    batch_size, num_draft = draft_tokens.shape
    if num_draft == 0:  # nothing to verify: an ordinary decoding step
        return mx.zeros(batch_size, mx.int32), sampling.sample(main_logits[:, 0])[0]
    if sampling.greedy:
        main_tokens = mx.argmax(main_logits, axis=-1)
        accepted = draft_tokens == main_tokens[:, :num_draft]
        if delta > 0:
            probs = mx.softmax(main_logits[:, :num_draft].astype(mx.float32), axis=-1)
            chosen = mx.take_along_axis(probs, draft_tokens[..., None], axis=-1)[..., 0]
            accepted = accepted | (chosen >= (1 - delta) * probs.max(axis=-1))
        candidates = main_tokens
    else:
        probs = sampling.probabilities(main_logits)
        p = mx.take_along_axis(probs[:, :num_draft], draft_tokens[..., None], axis=-1)[..., 0]
        q = mx.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
        u = 1 - mx.random.uniform(shape=(batch_size, num_draft))
        accepted = u * (1 - delta) * q <= p
        # Position i < g: the replacement should x_i be rejected; position g: the extra token.
        residual = mx.maximum(probs[:, :num_draft] - draft_probs, 0)
        candidates = mx.random.categorical(
            mx.log(mx.concatenate([residual, probs[:, num_draft:]], axis=1))
        )
    if draft_lengths is not None:
        accepted = accepted & (mx.arange(num_draft) < draft_lengths[:, None])
    num_accepted = mx.cumprod(accepted.astype(mx.int32), axis=1).sum(axis=1)
    next_token = mx.take_along_axis(candidates, num_accepted[:, None], axis=1)[:, 0]
    return num_accepted, next_token


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
    # Seconds encoding the prompt (both models, cross-attention too); the
    # prompts that start a batch share their batch's time evenly.
    prompt_time: float = 0.0
    # Seconds "auto" spent measuring costs before this generation's batch began.
    calibration_time: float = 0.0
    elapsed: float = 0.0  # seconds in all, from the start of the prompt's processing
    finished: bool = False  # the last result of this generation

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
        return self.elapsed - self.prompt_time - self.calibration_time

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


@dataclass
class Row:
    """One prompt being decoded in a batch."""

    index: int  # the prompt's place in the input
    sequence: list[int]  # the start token and every token generated
    result: GenerationResult
    start: float  # time.perf_counter() when its prompt processing began


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
        if not (isinstance(prompt_lookup, int) and prompt_lookup >= 0):
            raise ValueError(f"prompt_lookup must be an integer >= 0, got {prompt_lookup!r}")
        if draft_model is not None:
            check_draft_compatible(model.args, draft_model.args)
        self.model = model
        self.draft_model = draft_model
        self.tokenizer = tokenizer
        self.num_draft = num_draft
        self.delta = delta
        self.prompt_lookup = prompt_lookup
        self._costs = {}  # measured once per batch size: see measure_costs
        self._acceptance = {}  # per way of drafting: see DraftLength

    @property
    def drafting(self) -> str:
        """The drafting mode: "draft model", "prompt lookup", "hybrid" or "none"."""
        if self.prompt_lookup and self.draft_model is not None:
            return "hybrid"
        if self.prompt_lookup:
            return "prompt lookup"
        return "none" if self.draft_model is None else "draft model"

    def _prompt_ids(self, prompt: str | Sequence[int]) -> mx.array:
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        if not ids or (isinstance(prompt, str) and not prompt.strip()):
            raise ValueError("the prompt is empty")
        return mx.array([ids])

    def _prompt_cache(self, prompt_ids: mx.array) -> DecoderCache:
        cache = self.model.make_cache(self.model.encode(prompt_ids))
        # Prompt processing ends here, so generation speed can be told apart from it.
        mx.eval(cache.cross_keys_values)
        return cache

    def _drafter(self, prompts: list[mx.array]):
        """A drafter for a batch of ``prompts``."""
        vocab_size = self.model.args.vocab_size
        if self.drafting == "prompt lookup":
            return PromptLookupDrafter(prompts, vocab_size, self.prompt_lookup)
        model_drafter = ModelDrafter(self.draft_model, prompts)
        if self.drafting == "draft model":
            return model_drafter
        # Single-token matches are weak; the draft model does better there.
        lookup = PromptLookupDrafter(
            prompts, vocab_size, self.prompt_lookup, min(2, self.prompt_lookup)
        )
        return HybridDrafter(lookup, model_drafter)

    def measure_costs(
        self, prompt_ids: mx.array, batch_size: int = 1
    ) -> tuple[dict[str, float], list[float]]:
        """What "auto" weighs at ``batch_size`` rows, timed on ``prompt_ids``
        once per decoder (and draft model) and batch size: a draft token's
        time, drafted as in a round, over a main step's, for each draft
        source, and the time of a main pass over 1 .. MAX_AUTO_DRAFT + 1
        tokens per row over that of a pass over one."""
        if ("verify", batch_size) not in self._costs:
            encoder_output = self.model.encode(prompt_ids)
            main = pass_times(self.model, encoder_output, MAX_AUTO_DRAFT + 1, batch_size)
            self._costs["verify", batch_size] = [t / main[0] for t in main]
            self._costs["main step", batch_size] = main[0]
        # Looking up draft tokens costs next to nothing.
        draft_costs = {"lookup": 0.0}
        if self.draft_model is not None:
            key = id(self.draft_model), batch_size
            if key not in self._costs:
                draft_step = draft_token_time(self.draft_model, prompt_ids, batch_size)
                self._costs[key] = draft_step / self._costs["main step", batch_size]
            draft_costs["model"] = self._costs[key]
        return draft_costs, self._costs["verify", batch_size]

    def stream_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        speculative: bool = True,
        batch_size: int = 8,
        max_tokens: int = 100,
        temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Decode ``prompts``, ``batch_size`` at a time, and yield ``(index,
        result)`` for every prompt in the batch after every main-model pass;
        ``result.finished`` marks a prompt's last. A prompt that finishes
        (end of sequence or ``max_tokens``) leaves the batch and the next
        waiting prompt takes its place. Regular decoding
        (``speculative=False``, or nothing to draft with) is the same loop
        with no draft tokens."""
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        if not (isinstance(batch_size, int) and batch_size >= 1):
            raise ValueError(f"batch_size must be >= 1, got {batch_size!r}")
        if not (isinstance(max_tokens, int) and max_tokens >= 1):
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
        if seed is not None and not is_seed(seed):
            raise ValueError(f"seed must be {SEEDS}, got {seed!r}")
        sampling = Sampling(temp, top_p, top_k)
        speculative = speculative and self.drafting != "none"
        queue = deque(enumerate(map(self._prompt_ids, prompts)))
        if seed is not None:
            mx.random.seed(seed)
        eos = self.model.args.eos_token_id

        start = time.perf_counter()
        first = [queue.popleft() for _ in range(min(batch_size, len(queue)))]
        main_cache = DecoderCache.join([self._prompt_cache(ids) for _, ids in first])
        drafter = self._drafter([ids for _, ids in first]) if speculative else None
        prompt_time = (time.perf_counter() - start) / len(first)
        calibration_time = 0.0
        if drafter is not None:
            costs = ({}, [])
            if self.num_draft == "auto":
                tic = time.perf_counter()
                costs = self.measure_costs(first[0][1], len(first))
                calibration_time = time.perf_counter() - tic
            # Acceptance depends on the pair, how lookup matches, sampling and delta.
            key = self.drafting, self.prompt_lookup, id(self.draft_model), sampling, self.delta
            earlier = self._acceptance.setdefault(key, acceptance_counts())
            draft_length = DraftLength(self.num_draft, *costs, earlier)
        rows = [self._row(index, ids, start, prompt_time, calibration_time) for index, ids in first]
        while rows:
            sequences = [row.sequence for row in rows]
            # Never propose more tokens than a row may still generate.
            limits = [max_tokens - len(row.result.tokens) - 1 for row in rows]
            draft = None
            if drafter is not None and max(limits) > 0:
                draft = drafter.propose(sequences, sampling, draft_length.choose, limits)
            draft = draft or Draft.empty(len(rows))
            # The main cache holds every accepted position of a row but its
            # last token, which is the next input.
            trim_to(main_cache, sequences)
            inputs = mx.concatenate([mx.array([[s[-1]] for s in sequences]), draft.tokens], axis=1)
            logits = self.model.decode(inputs, main_cache)
            num_accepted, next_tokens = verify(
                draft.tokens, draft.probs, logits, sampling, self.delta, mx.array(draft.lengths)
            )
            mx.eval(num_accepted, next_tokens, draft.tokens)

            done = []
            for i, (row, accepted, next_token, draft_tokens) in enumerate(
                zip(rows, num_accepted.tolist(), next_tokens.tolist(), draft.tokens.tolist())
            ):
                num_draft = draft.lengths[i]
                new_tokens = draft_tokens[:accepted] + [next_token]
                rejected = accepted < num_draft
                finished = eos in new_tokens
                if finished:
                    end = new_tokens.index(eos)
                    if end < accepted:  # the draft's own EOS: later draft tokens went untested
                        accepted, rejected = end + 1, False
                    new_tokens = new_tokens[:end]
                result = row.result
                if num_draft > 0:
                    draft_length.update(draft.sources[i], accepted, accepted + int(rejected))
                    result.draft_lengths.append(num_draft)
                    result.n_lookup_rounds += draft.sources[i] == "lookup"
                result.n_steps += 1
                result.n_draft += num_draft
                result.n_accepted += accepted
                result.n_rejected += int(rejected)
                row.sequence += new_tokens
                result.tokens += new_tokens
                result.from_draft += [j < accepted for j in range(len(new_tokens))]
                result.text = self.tokenizer.decode(result.tokens, skip_special_tokens=True)
                result.finished = finished or len(result.tokens) >= max_tokens
                result.elapsed = time.perf_counter() - row.start
                yield row.index, result
                if result.finished:
                    done.append(i)

            # Waiting prompts take the places of finished ones; then the rest leave.
            while done and queue:
                row, (index, ids) = done.pop(0), queue.popleft()
                tic = time.perf_counter()
                main_cache.restart_row(row, self._prompt_cache(ids))
                if drafter is not None:
                    drafter.restart_row(row, ids)
                rows[row] = self._row(index, ids, tic, time.perf_counter() - tic)
            if done:
                kept = [i for i in range(len(rows)) if i not in done]
                rows = [rows[i] for i in kept]
                if rows:
                    main_cache.keep_rows(kept)
                    if drafter is not None:
                        drafter.keep_rows(kept)

    def _row(
        self,
        index: int,
        prompt_ids: mx.array,
        start: float,
        prompt_time: float,
        calibration_time: float = 0.0,
    ) -> Row:
        """A row about to decode the prompt at ``index``, its prompt processed."""
        result = GenerationResult(
            [],
            prompt_tokens=prompt_ids.shape[1],
            prompt_time=prompt_time,
            calibration_time=calibration_time,
        )
        return Row(index, [self.model.args.decoder_start_token_id], result, start)

    def stream(
        self, prompt: str | Sequence[int], *, speculative: bool = True, **kwargs
    ) -> Iterator[GenerationResult]:
        """Decode ``prompt`` and yield the running result after every
        main-model pass: ``stream_batch`` with a batch of one. Takes its
        keyword arguments: max_tokens, temp, top_p, top_k, seed."""
        for _, result in self.stream_batch(
            [prompt], speculative=speculative, batch_size=1, **kwargs
        ):
            yield result

    def generate(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Regular decoding with the main model alone. Takes the keyword
        arguments of ``stream``: max_tokens, temp, top_p, top_k, seed."""
        return _last(self.stream(prompt, speculative=False, **kwargs))

    def speculative_decode(self, prompt: str | Sequence[int], **kwargs) -> GenerationResult:
        """Speculative decoding; same arguments as ``generate``."""
        return _last(self.stream(prompt, speculative=True, **kwargs))

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **kwargs
    ) -> list[GenerationResult]:
        """Regular decoding of every prompt, ``batch_size`` at a time;
        results in input order. Takes the keyword arguments of ``stream``."""
        return _finished(
            self.stream_batch(prompts, speculative=False, batch_size=batch_size, **kwargs)
        )

    def speculative_decode_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **kwargs
    ) -> list[GenerationResult]:
        """Speculative decoding of every prompt; same arguments as ``generate_batch``."""
        return _finished(
            self.stream_batch(prompts, speculative=True, batch_size=batch_size, **kwargs)
        )


def _last(results: Iterator[GenerationResult]) -> GenerationResult:
    result = None
    for result in results:
        pass
    return result


def _finished(results: Iterator[tuple[int, GenerationResult]]) -> list[GenerationResult]:
    """The finished results of ``stream_batch``, in input order."""
    finished = {index: result for index, result in results if result.finished}
    return [finished[index] for index in sorted(finished)]
