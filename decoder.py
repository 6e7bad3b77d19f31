"""Speculative decoding (Leviathan et al., arXiv 2211.17192) for T5 in MLX:
the round, its results, and the API.

``speculative_round`` is the algorithm: a drafter proposes up to g tokens,
the main model scores them all in one pass, ``sampling.verify`` accepts a
prefix of them and adds one token of the main model's own. Every token is
the Gumbel-max choice argmax(log p + G) of its distribution p, with noise G
drawn from the row's seed and the token's position alone: the draft model
proposes argmax(log q + G) with the same noise, and a draft token is
accepted exactly when it is the main model's choice: a round adds the
tokens plain decoding would, whatever was drafted, at the cost of one
main-model pass (the host waits once per round). A batch's rows run the same rounds, each with its own draft tokens
and its own number accepted (the caches keep a length per row);
``scheduler.BatchGenerator`` lets prompts join and leave the batch. Where
drafts come from: ``drafting.py``; how many: ``drafting.FixedDraftLength``
or ``auto.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

# First: the fast BLAS on Linux must load before mlx (see model.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from auto import Auto
from cache import DecoderCache
from detokenizer import byte_piece_ids
from distributed import shared_draft_length
from drafting import (
    Draft,
    Drafter,
    DraftLength,
    FixedDraftLength,
    check_draft_compatible,
    make_drafter,
    trim_to,
)
from model import T5
from sampling import Noise, RowSampling, Sampling, verify

if TYPE_CHECKING:
    from scheduler import BatchGenerator


def speculative_round(
    model: T5,
    cache: DecoderCache,
    drafter: Drafter | None,
    budget: Callable[[str], int] | None,
    sequences: list[list[int]],
    limits: list[int],
    sampling: RowSampling,
    delta: float,
    noise: Noise | None,
    eos: int,
) -> RoundOutcome:
    """One round over every row of a batch: draft up to g tokens, score them
    in one pass of the main model, accept, and trim what was rejected.

    Row i holds ``sequences[i]`` (the start token and the tokens so far) and
    may add ``limits[i] + 1`` more; ``cache``, the main model's, holds every
    position of it but the last token, the pass's first input. ``drafter``
    proposes ``budget(source)`` tokens per row (None: a plain decoding
    step) with the rows' ``noise`` at their next positions (None: every row
    greedy); ``verify`` decides, by ``sampling`` and ``delta``.
    """
    # Draft: x_1 .. x_g per row (fewer where a row may add fewer).
    draft = None
    if drafter is not None and max(limits) > 0:
        draft = drafter.propose(sequences, sampling, budget, limits, noise)
    draft = draft or Draft.empty(len(sequences))
    # Trim: the cache drops the positions the last round rejected (and a
    # freed row's), back to each row's accepted tokens.
    trim_to(cache, sequences)
    # Score: p_1 .. p_{g+1} from one pass over each row's last token and its draft.
    last = mx.array([[sequence[-1]] for sequence in sequences])
    logits = model.decode(mx.concatenate([last, draft.tokens], axis=1), cache)
    # Accept x_1 .. x_n, up to the first rejection, then one token of the
    # main model's own: the recovered token in place of x_{n+1}, or the
    # bonus token after x_g when all were accepted.
    positions = None if noise is None else noise.first(draft.tokens.shape[1] + 1)
    lengths = mx.array(draft.lengths)
    num_accepted, next_tokens = verify(draft.tokens, logits, sampling, delta, lengths, positions)
    mx.eval(num_accepted, next_tokens, draft.tokens)  # the host waits once per round
    outcome = RoundOutcome(draft)
    rounds = zip(num_accepted.tolist(), next_tokens.tolist(), draft.tokens.tolist(), draft.lengths)
    for accepted, next_token, draft_tokens, num_draft in rounds:
        tokens = draft_tokens[:accepted] + [next_token]
        rejected = accepted < num_draft
        ended = eos in tokens
        if ended:  # the text ends before its end-of-sequence token
            end = tokens.index(eos)
            if end < accepted:  # the draft's own: the draft tokens after it went untested
                accepted, rejected = end + 1, False
            tokens = tokens[:end]
        outcome.add(accepted, rejected, tokens, ended)
    return outcome


@dataclass
class RoundOutcome:
    """What one round gave each row of its batch."""

    draft: Draft  # the tokens proposed
    accepted: list[int] = dataclasses.field(default_factory=list)  # draft tokens accepted
    rejected: list[bool] = dataclasses.field(default_factory=list)  # a draft token rejected
    # The accepted draft tokens and the main model's own, up to any end of sequence.
    new_tokens: list[list[int]] = dataclasses.field(default_factory=list)
    ended: list[bool] = dataclasses.field(default_factory=list)  # the end of sequence came

    def add(self, accepted: int, rejected: bool, tokens: list[int], ended: bool) -> None:
        """The next row's outcome."""
        self.accepted.append(accepted)
        self.rejected.append(rejected)
        self.new_tokens.append(tokens)
        self.ended.append(ended)


@dataclass(frozen=True)
class Options:
    """How a prompt is decoded: at most ``max_tokens`` new tokens, sampled
    at ``temp`` (0: greedy) from the ``top_k`` likeliest tokens (0: all)
    holding ``top_p`` of the probability, with the noise of ``seed``
    (None: one drawn from MLX's random state, named by ``result.seed``)."""

    max_tokens: int = 100
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    @property
    def sampling(self) -> Sampling:
        return Sampling(self.temp, self.top_p, self.top_k)


@dataclass
class GenerationResult:
    """The tokens and text generated so far, and what it cost. In the events
    of a generation, the lists of an unfinished result are views
    (``scheduler.Prefix``) of the growing lists of its last, finished one."""

    tokens: Sequence[int]
    # Their text, ``tokenizer.decode(tokens, skip_special_tokens=True)``,
    # less, before the last result, the end that later tokens may still
    # change (a character whose bytes have not all come).
    text: str = ""
    n_draft: int = 0  # draft tokens proposed
    n_accepted: int = 0  # draft tokens accepted
    n_rejected: int = 0  # draft tokens tested and rejected (at most one per round)
    n_steps: int = 0  # main-model decoder passes
    # Per token: whether it is an accepted draft token.
    from_draft: Sequence[bool] = dataclasses.field(default_factory=list)
    # Per round: the draft tokens proposed.
    draft_lengths: Sequence[int] = dataclasses.field(default_factory=list)
    n_lookup_rounds: int = 0  # rounds drafted by prompt lookup
    prompt_tokens: int = 0  # tokens of the prompt, end-of-sequence included
    # Seconds encoding the prompt (both models, cross-attention too); the
    # prompts that start a batch share their batch's time evenly.
    prompt_time: float = 0.0
    # Seconds "auto" spent measuring costs before this generation's batch began.
    calibration_time: float = 0.0
    elapsed: float = 0.0  # seconds in all, from the start of the prompt's processing
    finished: bool = False  # the last result of this generation
    seed: int = 0  # the seed of its noise: given, or drawn (it repeats the generation)

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


class SpeculativeDecoder:
    """Decodes with ``model``. Drafts come from ``draft_model``, from prompt
    lookup of n-grams up to ``prompt_lookup`` tokens long (0: off), or from
    both (lookup first). ``num_draft`` is the number of draft tokens per
    round, or ``"auto"``; ``delta`` in [0, 1] relaxes acceptance. ``group``:
    the processes ``model`` is split across (``distributed.py``)."""

    def __init__(
        self,
        model: T5,
        draft_model: T5 | None,
        tokenizer,
        num_draft: int | str = 5,
        delta: float = 0.0,
        prompt_lookup: int = 0,
        group: mx.distributed.Group | None = None,
    ):
        if num_draft != "auto" and not (isinstance(num_draft, int) and num_draft >= 1):
            raise ValueError(f"num_draft must be >= 1 or 'auto', got {num_draft!r}")
        if not 0 <= delta <= 1:
            raise ValueError(f"delta must be in [0, 1], got {delta}")
        if not (isinstance(prompt_lookup, int) and prompt_lookup >= 0):
            raise ValueError(f"prompt_lookup must be an integer >= 0, got {prompt_lookup!r}")
        if draft_model is not None:
            check_draft_compatible(model.args, draft_model.args)
        self.model, self.draft_model, self.tokenizer = model, draft_model, tokenizer
        self.num_draft, self.delta, self.prompt_lookup = num_draft, delta, prompt_lookup
        self.auto = Auto()  # what "auto" measured, kept from batch to batch
        self.group = group  # the processes the main model is split across, or None

    @functools.cached_property
    def byte_ids(self) -> frozenset[int]:
        """The tokenizer's byte pieces, which the rows' detokenizers wait on;
        read once, since reading a large vocabulary takes a while."""
        return byte_piece_ids(self.tokenizer)

    @property
    def drafting(self) -> str:
        """The drafting mode: "draft model", "prompt lookup", "hybrid" or "none"."""
        if self.prompt_lookup and self.draft_model is not None:
            return "hybrid"
        if self.prompt_lookup:
            return "prompt lookup"
        return "none" if self.draft_model is None else "draft model"

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The token ids of ``prompt``: text, or token ids as they are.
        ``TypeError`` for anything else, ``ValueError`` for an empty prompt
        or an id outside the vocabulary."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            return self.tokenizer(prompt).input_ids
        if not isinstance(prompt, Sequence) or not all(
            isinstance(token, int) and not isinstance(token, bool) for token in prompt
        ):
            raise TypeError(
                "a prompt must be a string or a sequence of token ids (int), "
                f"got {type(prompt).__name__}"
            )
        if not prompt:
            raise ValueError("the prompt is empty")
        vocab_size = self.model.args.vocab_size
        outside = [token for token in prompt if not 0 <= token < vocab_size]
        if outside:
            raise ValueError(
                f"token id {outside[0]} is outside the vocabulary (0 .. {vocab_size - 1})"
            )
        return list(prompt)

    @property
    def lazy_drafting(self) -> bool:
        """Whether the draft model encodes a batch's prompts only when it
        first drafts (see ``ModelDrafter``): with "auto", which may not."""
        return self.num_draft == "auto" and self.draft_model is not None

    def drafter(self, prompts: list[list[int]], cache: DecoderCache | None = None) -> Drafter:
        """A drafter for a batch of ``prompts`` (token ids); ``cache``: the
        draft model's cache of them, where encoded already."""
        return make_drafter(
            self.draft_model, self.prompt_lookup, prompts, self.lazy_drafting, cache
        )

    def draft_length(self, prompts: list[list[int]], batch_sizes: list[int]) -> DraftLength:
        """The draft-length rule of a batch whose first rows are ``prompts``,
        its costs measured at each of ``batch_sizes`` rows."""
        if self.num_draft == "auto":
            drafting = self.model, self.draft_model, self.prompt_lookup
            rule = self.auto.for_batch(*drafting, prompts[0], batch_sizes)
            # In a group, rank 0's choices: every rank must run the same rounds.
            return shared_draft_length(rule, self.group)
        return FixedDraftLength(self.num_draft)

    def batch_generator(
        self, *, speculative: bool = True, max_batch_size: int = 8, **kwargs
    ) -> BatchGenerator:
        """A ``BatchGenerator`` decoding with this decoder: prompts join it
        while it runs (``insert``), one round per ``next``."""
        # Imported here: the scheduler runs this module's rounds.
        from scheduler import BatchGenerator

        return BatchGenerator(
            self, speculative=speculative, max_batch_size=max_batch_size, **kwargs
        )

    def stream_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        speculative: bool = True,
        batch_size: int = 8,
        prompt_progress: Callable[[int, int], None] | None = None,
        **options,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Decode ``prompts`` as ``options`` say (``Options``' fields),
        ``batch_size`` at a time, and yield ``(index, result)`` for every
        prompt in the batch after every main-model pass (a new result object
        each time; ``result.finished`` on a prompt's last), taking them
        longest first within each run of ``SORT_WINDOW * batch_size``.
        Regular decoding (``speculative=False``, or nothing to draft with)
        is the same loop with no draft tokens. With ``seed`` (else one is
        drawn per prompt: ``result.seed``), a prompt gets the text regular
        decoding gives it alone with that seed, whatever the batch, drafter
        or draft length (with ``delta`` 0). ``prompt_progress(done, total)``
        is called with 0, then after each encoder layer (main and draft
        models) whenever prompts join."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        return self._stream(prompts, Options(**options), speculative, batch_size, prompt_progress)

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        speculative: bool = True,
        prompt_progress: Callable[[int, int], None] | None = None,
        **options,
    ) -> Iterator[GenerationResult]:
        """Decode ``prompt`` as ``options`` say and yield the running result
        after every main-model pass (a new object each time): a batch of one.
        ``prompt_progress`` as for ``stream_batch``."""
        events = self._stream([prompt], Options(**options), speculative, 1, prompt_progress)
        return (result for _, result in events)

    def _stream(
        self,
        prompts: Sequence[str | Sequence[int]],
        options: Options,
        speculative: bool,
        batch_size: int,
        prompt_progress: Callable[[int, int], None] | None,
    ) -> Iterator[tuple[int, GenerationResult]]:
        from scheduler import SORT_WINDOW, iter_rounds, longest_first  # see batch_generator

        generator = self.batch_generator(
            speculative=speculative, max_batch_size=batch_size, prompt_progress=prompt_progress
        )
        generator.check_options(options.max_tokens, options.seed)
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.prompt_ids(prompt))
            except (TypeError, ValueError) as error:
                if len(prompts) == 1:  # one prompt needs no name
                    raise
                raise type(error)(f"prompt {i}: {error}") from None
        index = {}
        for i in longest_first(ids, SORT_WINDOW * batch_size):
            uid = generator.insert(
                ids[i], max_tokens=options.max_tokens, sampling=options.sampling, seed=options.seed
            )
            index[uid] = i
        return ((index[uid], result) for events in iter_rounds(generator) for uid, result in events)

    def generate(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """Regular decoding with the main model alone, as ``options`` say
        (``Options``' fields: max_tokens, temp, top_p, top_k, seed)."""
        return deque(self.stream(prompt, speculative=False, **options), maxlen=1)[0]

    def speculative_decode(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """Speculative decoding; same arguments as ``generate``."""
        return deque(self.stream(prompt, speculative=True, **options), maxlen=1)[0]

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **options
    ) -> list[GenerationResult]:
        """Regular decoding of every prompt, ``batch_size`` at a time, as
        ``options`` say; results in input order."""
        return _finished(
            self.stream_batch(prompts, speculative=False, batch_size=batch_size, **options)
        )

    def speculative_decode_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **options
    ) -> list[GenerationResult]:
        """Speculative decoding of every prompt; same arguments as ``generate_batch``."""
        return _finished(
            self.stream_batch(prompts, speculative=True, batch_size=batch_size, **options)
        )


def _finished(results: Iterator[tuple[int, GenerationResult]]) -> list[GenerationResult]:
    """The finished results of ``stream_batch``, in input order."""
    finished = {index: result for index, result in results if result.finished}
    return [finished[index] for index in sorted(finished)]
