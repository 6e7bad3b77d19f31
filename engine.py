"""The server's decoding engine: one thread owns MLX, the models and the
batch (``scheduler.BatchGenerator``). Requests reach it as jobs on a
queue, join the running batch at its next round, and get their texts as
soon as a round accepts tokens; the HTTP side (``server.py``) never
touches MLX. docs/serving.md has the limits and what seeds promise.

What joins and leaves the batch is decided as ``Insert``s and ``Cancel``s
and carried out at the start of the next round. In a process group (the
main model split across it) rank 0's engine decides, and every other rank
carries out the same decisions in the same rounds (``follow``): one
exchange per round (``distributed.RankZeroDecisions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from decoder import SpeculativeDecoder
from distributed import IDLE_TICK_SECONDS, RankZeroDecisions, group_failure
from protocol import Choice, RequestError, Settings, prompt_name
from sampling import draw_seed
from scheduler import BatchGenerator
from speculative import Options


@dataclass
class Insert:
    """A decision: a prompt (token ids) joins the batch, decoded as ``options``
    say (a seed always set: rank 0's draw, in a group)."""

    prompt_ids: list[int]
    options: Options


@dataclass
class Cancel:
    """A decision: the row ``uid`` leaves the batch."""

    uid: int


@dataclass
class Decided:
    """The decisions taken since the last round began, and on rank 0 whose
    each insert is: (job, choice index), one per ``Insert``, in order."""

    decisions: list[Insert | Cancel] = dataclasses.field(default_factory=list)
    owners: list[tuple[Job, int]] = dataclasses.field(default_factory=list)

    def take_back(self, job: Job) -> int:
        """Take back the inserts of ``job``'s prompts; how many there were."""
        decisions, owners, each_owner = [], [], iter(self.owners)
        for decision in self.decisions:
            if isinstance(decision, Insert):
                owner = next(each_owner)
                if owner[0] is job:
                    continue
                owners.append(owner)
            decisions.append(decision)
        taken = len(self.owners) - len(owners)
        self.decisions, self.owners = decisions, owners
        return taken


def carry_out(generator: BatchGenerator, decisions: list[Insert | Cancel]) -> list[int]:
    """Carry out ``decisions`` in order; the uids of the inserted prompts."""
    uids = []
    for decision in decisions:
        if isinstance(decision, Insert):
            uids.append(generator.insert(decision.prompt_ids, decision.options))
        else:
            generator.cancel(decision.uid)
    return uids


def new_generator(
    decoder: SpeculativeDecoder, *, speculative: bool, max_batch_size: int
) -> BatchGenerator:
    """A server's batch: it encodes joining prompts in slices between
    rounds, as the rounds' timings allow (in a group, rank 0's)."""
    return decoder.batch_generator(
        speculative=speculative,
        max_batch_size=max_batch_size,
        cost_batch_sizes=cost_batch_sizes(max_batch_size),
        interleave_encoding=True,
    )


def follow(
    decoder: SpeculativeDecoder,
    decisions: RankZeroDecisions,
    *,
    speculative: bool,
    max_batch_size: int,
) -> None:
    """Every rank of a serving group but 0: carry out rank 0's decisions
    and run the rounds it runs, encoding as much as it says, until it says
    stop."""
    generator = new_generator(decoder, speculative=speculative, max_batch_size=max_batch_size)
    while True:
        shared, stop, slices = decisions.share()
        if stop:
            return
        carry_out(generator, shared)
        if len(generator):
            generator.next(slices)
        else:
            decisions.idle()


class Job:
    """A request inside the server: its settings, its choices, and the
    asyncio queue its handler reads what the decoding thread sends."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop):
        self.settings = settings
        self.loop = loop
        self.messages: asyncio.Queue = asyncio.Queue()
        self.choices = [Choice() for _ in settings.prompts]
        self.uids: dict[int, int] = {}  # row uid -> choice index
        self.done = False
        self.outcome: str | None = None  # the counter it ended in (Engine.OUTCOMES)

    def send(self, message: tuple) -> None:
        """Hand ``message`` to the handler, from the decoding thread."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to read it
            self.loop.call_soon_threadsafe(self.messages.put_nowait, message)

    @property
    def finished(self) -> bool:
        return all(choice.finish_reason for choice in self.choices)

    def state(self) -> list[tuple[str, str | None]]:
        """Each choice's text and finish reason now: what a round sends a
        stream, which the handler may read rounds later."""
        return [(choice.text, choice.finish_reason) for choice in self.choices]


def cost_batch_sizes(max_batch_size: int) -> list[int]:
    """The numbers of rows at which "auto" measures its costs for a server,
    whose batch grows and shrinks with its load: each power of two below
    ``max_batch_size``, and that."""
    return [1 << k for k in range(max_batch_size.bit_length()) if 1 << k < max_batch_size] + [
        max_batch_size
    ]


class Engine:
    """The decoding thread: it alone calls MLX. Handlers ``submit`` and
    ``cancel`` jobs; the thread admits their prompts into the batch between
    rounds and sends each job ("accepted",), ("progress", choices) after every
    round that changed it (streaming jobs only), then ("done", choices) or ("error",
    RequestError). ``abort`` ends every open job with an error at once.

    Every completion request counts in ``requests`` and, once it ends, in
    exactly one of ``OUTCOMES``; until then it is ``running``."""

    # completed: answered in full; cancelled: its client left; refused: a
    # 4xx, or a 503 before it decoded; errors: decoding failed, or the
    # server shut down while it ran.
    OUTCOMES = ("completed", "cancelled", "refused", "errors")

    def __init__(
        self,
        decoder: SpeculativeDecoder,
        *,
        speculative: bool,
        max_batch_size: int,
        max_waiting: int,
        max_prompt_tokens: int,
        decisions: RankZeroDecisions | None = None,
        on_group_failure: Callable[[str], None] | None = None,
    ):
        self.decoder = decoder
        self.speculative = speculative
        self.max_batch_size = max_batch_size
        self.max_waiting = max_waiting
        self.max_prompt_tokens = max_prompt_tokens
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        # Prompts submitted and not yet finished, cancelled or refused, decoding
        # or not: at most max_batch_size + max_waiting.
        self.held = 0
        self.open_jobs: set[Job] = set()  # submitted, not yet answered (event loop's side)
        self.closing = False  # abort was called: no new job is taken
        self.counters = dict.fromkeys(("requests", *self.OUTCOMES, "active"), 0)
        # In a group: the exchange with the other ranks, and what to call
        # (from the decoding thread) when the group fails, once.
        self.decisions, self.on_group_failure = decisions, on_group_failure
        self.thread = threading.Thread(target=self._run, name="decoding", daemon=True)

    @property
    def max_prompts(self) -> int:
        """The most prompts the server holds at once, decoding or waiting."""
        return self.max_batch_size + self.max_waiting

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.commands.put(("stop", None))
        self.thread.join()

    def submit(self, settings: Settings, loop: asyncio.AbstractEventLoop) -> Job:
        """Queue a job for a request of ``settings``, whose handler runs on
        ``loop``. ``RequestError``: 400 when it has more prompts than the
        server ever holds, 429 when it would fit once others finish, 503
        when the server is shutting down."""
        job = Job(settings, loop)
        count = len(settings.prompts)
        with self.lock:
            self.counters["requests"] += 1
        try:
            if self.closing:
                raise RequestError(503, "the server is shutting down")
            if count > self.max_prompts:
                message = (
                    f"the request has {count} prompts; this server holds at most "
                    f"{self.max_prompts} at once (--max-batch-size {self.max_batch_size} + "
                    f"--max-waiting {self.max_waiting})"
                )
                raise RequestError(400, message, "prompt")
            with self.lock:
                if self.held + count > self.max_prompts:
                    raise RequestError(
                        429, "too many requests are waiting; retry later", kind="rate_limit_error"
                    )
                self.held += count
        except RequestError:
            self._end(job, "refused")
            raise
        self.open_jobs.add(job)
        self.commands.put(("submit", job))
        return job

    def refused(self) -> None:
        """Count a request refused before it became a job (its body was bad)."""
        with self.lock:
            self.counters["requests"] += 1
            self.counters["refused"] += 1

    def answered(self, job: Job) -> None:
        """``job``'s handler is done with it (event loop's side)."""
        self.open_jobs.discard(job)

    def cancel(self, job: Job) -> None:
        """Stop decoding ``job`` (its client left): its rows free at the next round."""
        self.commands.put(("cancel", job))

    def abort(self, reason: str) -> None:
        """End every open job now with a 503 saying ``reason``, and take no
        new one (event loop's side: the handlers answer at once, whatever
        the decoding thread is doing); their rows are freed."""
        self.closing = True
        for job in self.open_jobs:
            job.messages.put_nowait(("error", RequestError(503, reason)))
            self._end(job, "errors")
            self.cancel(job)
        self.open_jobs.clear()

    def health(self) -> dict:
        with self.lock:
            # Waiting for a row: every prompt held but the active ones, from
            # its request's arrival (before the decoding thread has seen it)
            # through its encoding.
            waiting = max(0, self.held - self.counters["active"])
            ended = sum(self.counters[outcome] for outcome in self.OUTCOMES)
            running = self.counters["requests"] - ended
            health = {"status": "ok", **self.counters, "running": running, "waiting": waiting}
        if self.decisions is not None:
            ranks = [
                {"rank": rank, "state": "serving" if rank == 0 else "following", "memory": used}
                for rank, used in enumerate(self.decisions.rank_bytes)
            ]
            health["group"] = {"size": len(ranks), "ranks": ranks}
        return health

    def _end(self, job: Job, outcome: str) -> None:
        """Count ``job`` in ``outcome``, unless it ended already."""
        with self.lock:
            if job.outcome is None:
                job.outcome = outcome
                self.counters[outcome] += 1

    def _release(self, prompts: int) -> None:
        """``prompts`` no longer held: finished, cancelled, refused or failed."""
        with self.lock:
            self.held -= prompts

    def _run(self) -> None:
        # MLX's random state is per thread and starts the same in every new one.
        mx.random.seed(int.from_bytes(os.urandom(8), "little"))
        generator = new_generator(
            self.decoder, speculative=self.speculative, max_batch_size=self.max_batch_size
        )
        jobs: dict[int, Job] = {}  # row uid -> job
        decided = Decided()
        while True:
            stop = self._take_commands(decided, jobs, idle=not len(generator))
            try:
                if stop:
                    if self.decisions is not None:
                        self.decisions.share(stop=True)
                    return
                for uid, (job, index) in zip(
                    carry_out(generator, decided.decisions), decided.owners
                ):
                    job.uids[uid] = index
                    jobs[uid] = job
                    if index == 0:
                        job.send(("accepted",))
                slices = None  # alone: judged slice by slice
                if self.decisions is not None:  # decided here for every rank: their timings differ
                    slices = generator.encoding_budget()
                    self.decisions.share(decided.decisions, slices=slices)
                decided = Decided()
                events = generator.next(slices) if len(generator) else []
            except Exception as error:  # noqa: BLE001 - the server must go on serving
                reason = " ".join(f"{type(error).__name__}: {error}".split())
                if self.decisions is not None:  # a group cannot: its ranks no longer agree
                    self.on_group_failure(group_failure(reason, self.decoder.group))
                    return
                failed = {id(job): job for job in jobs.values()}.values()
                for job in failed:
                    job.send(("error", RequestError(500, f"decoding failed: {reason}")))
                    self._end(job, "errors")
                self._release(len(jobs))
                jobs.clear()
                generator = new_generator(
                    self.decoder, speculative=self.speculative, max_batch_size=self.max_batch_size
                )
                self._count(generator)
                continue
            changed = {}
            for uid, result in events:
                job = jobs.get(uid)
                if job is None:
                    continue
                choice = job.choices[job.uids[uid]]
                if choice.update(result, job.settings):  # a stop string: the row is done
                    decided.decisions.append(Cancel(uid))
                if result.finished or choice.finish_reason:
                    del jobs[uid]
                    self._release(1)
                changed[id(job)] = job
            for job in changed.values():
                if job.finished:
                    job.done = True
                    job.send(("done", job.state()))
                    self._end(job, "completed")
                elif job.settings.stream:
                    job.send(("progress", job.state()))
            self._count(generator)

    def _take_commands(self, decided: Decided, jobs: dict, idle: bool) -> bool:
        """Turn the commands that came into decisions; whether to stop.
        Idle, wait for one (in a group, at most ``IDLE_TICK_SECONDS``, the
        pace at which the other ranks look for decisions)."""
        timeout = IDLE_TICK_SECONDS if self.decisions is not None else None
        try:
            command, job = self.commands.get(block=idle, timeout=timeout if idle else None)
        except queue.Empty:
            return False
        while True:
            if command == "stop":
                return True
            if command == "submit":
                self._admit(job, decided)
            elif command == "cancel":
                self._cancel(job, jobs, decided)
            try:
                command, job = self.commands.get_nowait()
            except queue.Empty:
                return False

    def _count(self, generator: BatchGenerator) -> None:
        with self.lock:
            self.counters["active"] = sum(row is not None for row in generator.rows)

    def _admit(self, job: Job, decided: Decided) -> None:
        """Decide to insert ``job``'s prompts, or tell it why not."""
        settings = job.settings
        try:
            ids = [self.decoder.prompt_ids(prompt) for prompt in settings.prompts]
        except (TypeError, ValueError) as error:
            self._refuse(job, RequestError(400, str(error), "prompt"))
            return
        for index, prompt_ids in enumerate(ids):
            if len(prompt_ids) > self.max_prompt_tokens:
                message = (
                    f"{prompt_name(settings.is_list, index)} has {len(prompt_ids)} tokens, more "
                    f"than the {self.max_prompt_tokens} this server accepts"
                )
                self._refuse(job, RequestError(400, message, "prompt"))
                return
        for index, prompt_ids in enumerate(ids):
            options = settings.options
            if options.seed is None:  # drawn here: in a group, rank 0's draw is every rank's
                options = dataclasses.replace(options, seed=draw_seed())
            decided.decisions.append(Insert(prompt_ids, options))
            decided.owners.append((job, index))

    def _refuse(self, job: Job, error: RequestError) -> None:
        self._release(len(job.settings.prompts))
        job.send(("error", error))
        self._end(job, "refused")

    def _cancel(self, job: Job, jobs: dict, decided: Decided) -> None:
        """Decide that ``job``'s rows leave; its prompts not yet inserted never join."""
        rows = [uid for uid, owner in jobs.items() if owner is job]
        for uid in rows:
            decided.decisions.append(Cancel(uid))
            del jobs[uid]
        dropped = decided.take_back(job)
        self._release(len(rows) + dropped)
        if rows or dropped:
            self._end(job, "cancelled")
