"""The server's decoding engine: one thread owns MLX, the models and the
batch (``scheduler.BatchGenerator``). Requests reach it as jobs on a
queue, join the running batch at its next round, and get their texts as
soon as a round accepts tokens; the HTTP side (``server.py``) never
touches MLX. docs/serving.md has the limits and what seeds promise.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import threading

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from decoder import SpeculativeDecoder
from protocol import Choice, RequestError, Settings, prompt_name
from scheduler import BatchGenerator


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
            return {"status": "ok", **self.counters, "running": running, "waiting": waiting}

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
        generator = self._new_generator()
        jobs: dict[int, Job] = {}  # row uid -> job
        while True:
            # Wait for work when idle; otherwise take what came during the round.
            block = len(generator) == 0
            try:
                command, job = self.commands.get(block=block)
            except queue.Empty:
                command = None
            while command is not None:
                if command == "stop":
                    return
                if command == "submit":
                    self._admit(generator, job, jobs)
                elif command == "cancel":
                    self._cancel(generator, job, jobs)
                try:
                    command, job = self.commands.get_nowait()
                except queue.Empty:
                    command = None
            if not len(generator):
                self._count(generator)
                continue
            try:
                events = generator.next()
            except Exception as error:  # noqa: BLE001 - the server must go on serving
                reason = " ".join(f"{type(error).__name__}: {error}".split())
                failed = {id(job): job for job in jobs.values()}.values()
                for job in failed:
                    job.send(("error", RequestError(500, f"decoding failed: {reason}")))
                    self._end(job, "errors")
                self._release(len(jobs))
                jobs.clear()
                generator = self._new_generator()
                self._count(generator)
                continue
            changed = {}
            for uid, result in events:
                job = jobs.get(uid)
                if job is None:
                    continue
                choice = job.choices[job.uids[uid]]
                if choice.update(result, job.settings):  # a stop string: the row is done
                    generator.cancel(uid)
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

    def _new_generator(self) -> BatchGenerator:
        return self.decoder.batch_generator(
            speculative=self.speculative,
            max_batch_size=self.max_batch_size,
            cost_batch_sizes=cost_batch_sizes(self.max_batch_size),
            interleave_encoding=True,
        )

    def _count(self, generator: BatchGenerator) -> None:
        with self.lock:
            self.counters["active"] = sum(row is not None for row in generator.rows)

    def _admit(self, generator: BatchGenerator, job: Job, jobs: dict) -> None:
        """Insert ``job``'s prompts, or tell it why not."""
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
            uid = generator.insert(prompt_ids, settings.options)
            job.uids[uid] = index
            jobs[uid] = job
        job.send(("accepted",))

    def _refuse(self, job: Job, error: RequestError) -> None:
        self._release(len(job.settings.prompts))
        job.send(("error", error))
        self._end(job, "refused")

    def _cancel(self, generator: BatchGenerator, job: Job, jobs: dict) -> None:
        rows = [uid for uid, owner in jobs.items() if owner is job]
        for uid in rows:
            generator.cancel(uid)
            del jobs[uid]
        self._release(len(rows))
        if rows:
            self._end(job, "cancelled")
