"""The Python API: ``SpeculativeDecoder`` decodes prompts with a main model
and its drafts, one prompt or a batch, streamed or whole.

Every call runs rounds of ``speculative.speculative_round`` (the algorithm:
read that file first) over the rows of a ``scheduler.BatchGenerator``,
which lets prompts join and leave the batch. ``loading.load`` builds a
decoder from converted models.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from auto import Auto
from beam import BeamOptions, BeamSearchResult, beam_search
from cache import DecoderCache
from detokenizer import byte_piece_ids
from distributed import shared_draft_length
from drafting import Drafter, DraftLength, FixedDraftLength, check_draft_compatible, make_drafter
from model import T5
from scheduler import SORT_WINDOW, BatchGenerator, longest_first
from speculative import GenerationResult, Options
from speculative_beam import TreeStep


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
        # What "auto" measures of this pair, kept from batch to batch.
        self.auto = Auto(model, draft_model, prompt_lookup)
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
            rule = self.auto.for_batch(prompts[0], batch_sizes)
        else:
            rule = FixedDraftLength(self.num_draft)
        # In a group, rank 0's choices (auto's weigh each rank's timings, and
        # a rank may be started with other flags): every rank runs the same rounds.
        return shared_draft_length(rule, self.group)

    def batch_generator(
        self, *, speculative: bool = True, max_batch_size: int = 8, **kwargs
    ) -> BatchGenerator:
        """A ``BatchGenerator`` decoding with this decoder: prompts join it
        while it runs (``insert``), one round per ``next``."""
        return BatchGenerator(
            self, speculative=speculative, max_batch_size=max_batch_size, **kwargs
        )

    def stream_rounds(
        self,
        prompts: Sequence[str | Sequence[int]],
        options: Options,
        *,
        speculative: bool = True,
        batch_size: int = 8,
        prompt_progress: Callable[[int, int], None] | None = None,
    ) -> Iterator[list[tuple[int, GenerationResult]]]:
        """The events of every round that decodes ``prompts`` as ``options``
        say: after each, ``(index, result)`` for every prompt in the batch.
        ``stream_batch``'s loop, a round at a time, for a caller that works
        between rounds (``data_parallel.py``)."""
        ids = []
        for i, prompt in enumerate(prompts):
            try:
                ids.append(self.prompt_ids(prompt))
            except (TypeError, ValueError) as error:
                if len(prompts) == 1:  # one prompt needs no name
                    raise
                raise type(error)(f"prompt {i}: {error}") from None
        generator = self.batch_generator(
            speculative=speculative, max_batch_size=batch_size, prompt_progress=prompt_progress
        )
        index = {}
        for i in longest_first(ids, SORT_WINDOW * batch_size):
            index[generator.insert(ids[i], options)] = i

        def rounds() -> Iterator[list[tuple[int, GenerationResult]]]:
            while len(generator):
                yield [(index[uid], result) for uid, result in generator.next()]

        return rounds()  # checked and queued already: bad prompts fail the call itself

    def stream_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        *,
        speculative: bool = True,
        batch_size: int = 8,
        prompt_progress: Callable[[int, int], None] | None = None,
        **options,
    ) -> Iterator[tuple[int, GenerationResult]]:
        """Decode ``prompts`` as ``options`` say (``Options``' fields, or
        ``options=`` an ``Options``), ``batch_size`` at a time, and yield
        ``(index, result)`` for every prompt in the batch after every
        main-model pass (a new result object each time; ``result.finished``
        on a prompt's last), taking them longest first within each run of
        ``SORT_WINDOW * batch_size``. Regular decoding (``speculative=False``,
        or nothing to draft with) is the same loop with no draft tokens. With
        ``seed`` (else one is drawn per prompt: ``result.seed``), a prompt
        gets the text regular decoding gives it alone with that seed,
        whatever the batch, drafter or draft length (with ``delta`` 0).
        ``prompt_progress(done, total)`` is called with 0, then after each
        encoder layer (main and draft models) whenever prompts join."""
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        rounds = self.stream_rounds(
            prompts,
            as_options(options),
            speculative=speculative,
            batch_size=batch_size,
            prompt_progress=prompt_progress,
        )
        return (event for events in rounds for event in events)

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
        rounds = self.stream_rounds(
            [prompt],
            as_options(options),
            speculative=speculative,
            batch_size=1,
            prompt_progress=prompt_progress,
        )
        return (result for events in rounds for _, result in events)

    def generate(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """Regular decoding with the main model alone, as ``options`` say
        (``Options``' fields: max_tokens, temp, top_p, top_k, seed), or
        with ``num_beams`` > 1 beam search (``beam_search_batch``'s options):
        then a ``beam.BeamSearchResult``."""
        if options.get("num_beams", 1) != 1:
            return self.generate_batch([prompt], batch_size=1, **options)[0]
        options = without_beams(options)
        return deque(self.stream(prompt, speculative=False, **options), maxlen=1)[0]

    def beam_search_batch(
        self, prompts: Sequence[str | Sequence[int]], *, batch_size: int = 8, **options
    ) -> Iterator[tuple[int, BeamSearchResult]]:
        """Beam search over ``prompts``, ``batch_size`` prompts decoded
        together (``num_beams`` rows each; a prompt whose search ends leaves
        the batch and a waiting one takes its place), as ``options`` say:
        ``beam.BeamOptions``' fields, and ``Options``' max_tokens (temp must
        be 0: this beam search does not sample; transformers' would). Yields
        ``(index, result)`` as each prompt's search ends, taking the prompts
        longest first within each run of ``SORT_WINDOW * batch_size``."""
        options, beams = split_options(options)
        if options.temp > 0:
            raise ValueError("beam search does not sample: temp must be 0 with num_beams > 1")
        if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("prompts must be a non-empty list of prompts")
        ids = [self.prompt_ids(prompt) for prompt in prompts]
        order = longest_first(ids, SORT_WINDOW * batch_size)
        step = None
        if beams.draft_levels:
            if self.draft_model is None:
                raise ValueError("draft_levels (speculative beam search) needs a draft model")
            step = TreeStep(self.model, self.draft_model, beams, options.max_tokens)
        searches = beam_search(
            self.model, [ids[i] for i in order], batch_size, options.max_tokens, beams, step
        )
        for j, search in searches:
            hypotheses = search.finished[: beams.num_return_sequences]
            texts = [
                self.tokenizer.decode(hypothesis.tokens, skip_special_tokens=True)
                for hypothesis in hypotheses
            ]
            yield (
                order[j],
                BeamSearchResult(
                    hypotheses[0].tokens,
                    texts[0],
                    n_steps=search.steps,
                    levels=search.levels,
                    prompt_tokens=len(ids[order[j]]),
                    prompt_time=search.prompt_time,
                    elapsed=time.perf_counter() - search.started,
                    finished=True,
                    sequences=hypotheses,
                    texts=texts,
                ),
            )

    def speculative_decode(self, prompt: str | Sequence[int], **options) -> GenerationResult:
        """Speculative decoding; same arguments as ``generate``."""
        return deque(self.stream(prompt, speculative=True, **options), maxlen=1)[0]

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], batch_size: int = 8, **options
    ) -> list[GenerationResult]:
        """Regular decoding of every prompt, ``batch_size`` at a time, as
        ``options`` say, or with ``num_beams`` > 1 beam search
        (``beam_search_batch``); results in input order."""
        if options.get("num_beams", 1) != 1:
            return _finished(self.beam_search_batch(prompts, batch_size=batch_size, **options))
        options = without_beams(options)
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


def as_options(options: dict) -> Options:
    """The ``Options`` of a call's keyword arguments: ``Options``' fields, or
    ``options=`` one ``Options``."""
    if "options" in options:
        if len(options) > 1 or not isinstance(options["options"], Options):
            raise TypeError("give options= an Options, or Options' fields, not both")
        return options["options"]
    return Options(**options)


def split_options(options: dict) -> tuple[Options, BeamOptions]:
    """The ``Options`` and the ``BeamOptions`` of a call's keyword arguments."""
    names = {field.name for field in dataclasses.fields(BeamOptions)}
    beams = BeamOptions(**{name: value for name, value in options.items() if name in names})
    return as_options({k: v for k, v in options.items() if k not in names}), beams


def without_beams(options: dict) -> dict:
    """A call's keyword arguments less ``num_beams`` 1; ``ValueError`` for
    another beam option (with one beam, decoding is regular)."""
    options = {name: value for name, value in options.items() if name != "num_beams"}
    names = {field.name for field in dataclasses.fields(BeamOptions)} & options.keys()
    if names:
        raise ValueError(f"{min(names)} goes with beam search: give num_beams > 1")
    return options


def _finished(results: Iterator[tuple[int, GenerationResult]]) -> list[GenerationResult]:
    """The finished results of ``stream_batch``, in input order."""
    finished = {index: result for index, result in results if result.finished}
    return [finished[index] for index in sorted(finished)]
