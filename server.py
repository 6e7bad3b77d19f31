"""Serve a T5 model over HTTP with OpenAI's completions API: concurrent
requests share one batch, decoded speculatively and exactly.

python server.py --model-name t5-large --draft-model-name t5-small --num-draft auto
curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
     -d '{"prompt": "translate English to German: Thank you.", "max_tokens": 20}'

One thread owns MLX, the models and the batch (``scheduler.BatchGenerator``):
requests reach it as commands on a queue, join the running batch at its
next round, and get their tokens as soon as a round accepts them. The HTTP
side (Starlette on uvicorn) never touches MLX. docs/serving.md has the API,
the limits and what seeds promise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import hmac
import json
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from cli import (
    FULL_FLOAT32_NOTE,
    NON_NEGATIVE,
    POSITIVE,
    ArgumentParser,
    add_drafting_options,
    checked,
    full_float32,
)
from distributed import launched_in_group
from loading import quiet_transformers

API_KEY_VARIABLE = "T5_SERVER_API_KEY"
# The most stop strings a request may give, as OpenAI allows.
MAX_STOP_STRINGS = 4
# Seconds past --shutdown-timeout for requests told the server is shutting
# down to send their error; uvicorn cancels whatever is left after that.
SHUTDOWN_GRACE = 5.0
# Why a server started in a group of processes (mlx.launch) stops at once.
GROUP_REFUSAL = (
    "server.py does not run in a group of processes (mlx.launch) yet: it serves from one "
    "process; main.py splits the main model across several (see docs/distributed.md)"
)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        description="Serve a T5 model with OpenAI's /v1/completions API, speculatively.",
        epilog=FULL_FLOAT32_NOTE,
    )
    add = parser.add_argument
    add("--model-name", default="t5-11b", help="main model: converted name or directory")
    add(
        "--draft-model-name",
        default="t5-small",
        help="draft model: converted name or directory; none: no draft model",
    )
    add_drafting_options(parser, num_draft_default="auto")
    add("--regular-decode", action="store_true", help="decode with the main model alone")
    add("--max-batch-size", type=POSITIVE, default=8, help="rows decoded together")
    add(
        "--max-waiting",
        type=NON_NEGATIVE,
        default=64,
        help="prompts that may wait for a row; more get 429 Too Many Requests",
    )
    add("--max-tokens-limit", type=POSITIVE, default=512, help="the largest max_tokens accepted")
    add(
        "--max-prompt-tokens",
        type=POSITIVE,
        help="the longest prompt accepted, in tokens (default: the longest that fits in "
        "memory with a full batch and at most doubles a decoding step's work for the "
        "rows beside it)",
    )
    add("--max-body-bytes", type=POSITIVE, default=1_000_000, help="largest request body")
    add("--host", default="127.0.0.1", help="address to listen on")
    add(
        "--port",
        type=checked(int, lambda p: 0 <= p < 65536, "a port"),
        default=8080,
        help="port to listen on; 0: a free one",
    )
    add(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_VARIABLE} if set)",
    )
    add(
        "--shutdown-timeout",
        type=checked(float, lambda s: s >= 0, ">= 0"),
        default=30.0,
        help="seconds running requests may take to finish after SIGINT/SIGTERM",
    )
    add("--quiet", action="store_true", help="no access log")
    return parser


class RequestError(Exception):
    """A request the server refuses: an HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class Settings:
    """What a completion request asks for, checked."""

    prompts: list[str]
    max_tokens: int = 100
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    stream_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    is_list: bool = False  # the prompt came as a list (errors name a prompt by index)


def _number(body: dict, name: str, default, kind: type, valid, requirement: str):
    """``body[name]`` (``default`` when absent or null), a ``kind`` number
    satisfying ``valid``; ``RequestError`` otherwise."""
    value = body.get(name)
    if value is None:
        return default
    is_number = isinstance(value, int if kind is int else (int, float))
    if isinstance(value, bool) or not is_number or not math.isfinite(value) or not valid(value):
        raise RequestError(400, f"{name} must be {requirement}, got {json.dumps(value)}", name)
    return kind(value)


# OpenAI's completion parameters this server does not implement: the value
# each may have (as if absent) and what a request gets told otherwise.
UNSUPPORTED = {
    "n": (1, "send a list of prompts for several completions"),
    "best_of": (1, "send a list of prompts for several completions"),
    "echo": (False, ""),
    "logprobs": (None, ""),
    "suffix": ("", "T5 completes a prompt; it does not fill text in before a suffix"),
    "logit_bias": ({}, ""),
    "presence_penalty": (0, ""),
    "frequency_penalty": (0, ""),
}
# Every parameter a request may name: those parse_completion reads, the
# unsupported ones, and ``user`` (an end user's id, which changes no output).
PARAMETERS = frozenset(
    {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
    | {"stream", "stream_options", "user"}
    | UNSUPPORTED.keys()
)


def check_model(body: dict, served: str) -> None:
    """``RequestError`` unless ``body``'s ``model`` (optional) is ``served``:
    OpenAI's 404 ``model_not_found`` for any other name."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise RequestError(400, f"model must be a string, got {json.dumps(model)}", "model")
    if model != served:
        message = f"the model {model!r} does not exist: this server serves {served!r}"
        raise RequestError(404, message, "model", code="model_not_found")


def parse_completion(body: object, max_tokens_limit: int, served_model: str) -> Settings:
    """The ``Settings`` of a /v1/completions body for the model named
    ``served_model``; ``RequestError`` (400, 404 for another model) for
    anything malformed, out of range, unknown or unsupported."""
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    for name in body:
        if name not in PARAMETERS:
            raise RequestError(400, f"unknown parameter: {name}", name)
    for name, (plain, hint) in UNSUPPORTED.items():
        if body.get(name, plain) not in (plain, None):
            raise RequestError(
                400, f"{name} is not supported" + (f"; {hint}" if hint else ""), name
            )
    check_model(body, served_model)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError(400, "user must be a string", "user")
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise RequestError(400, "prompt must be a string or a list of strings", "prompt")
    if not prompts:
        raise RequestError(400, "prompt is an empty list", "prompt")
    for i, text in enumerate(prompts):
        if not text.strip():
            raise RequestError(
                400, f"{prompt_name(isinstance(prompt, list), i)} is empty", "prompt"
            )
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise RequestError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        raise RequestError(400, f"stop takes at most {MAX_STOP_STRINGS} strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "stream must be true or false", "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise RequestError(400, 'stream_options goes with "stream": true', "stream_options")
    stream_options = stream_options or {}
    if (
        not isinstance(stream_options, dict)
        or not stream_options.keys() <= {"include_usage"}
        or not isinstance(stream_options.get("include_usage", False), bool)
    ):
        raise RequestError(
            400, 'stream_options must be {"include_usage": true or false}', "stream_options"
        )
    from sampling import SEEDS, is_seed

    limit = max_tokens_limit
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not is_seed(seed)):
        raise RequestError(400, f"seed must be {SEEDS}, got {json.dumps(seed)}", "seed")
    return Settings(
        prompts=prompts,
        is_list=isinstance(prompt, list),
        max_tokens=_number(
            body,
            "max_tokens",
            min(Settings.max_tokens, limit),
            int,
            lambda n: 1 <= n <= limit,
            f"an integer in [1, {limit}]",
        ),
        temperature=_number(body, "temperature", 0.0, float, lambda t: t >= 0, "a number >= 0"),
        top_p=_number(body, "top_p", 1.0, float, lambda p: 0 < p <= 1, "a number in (0, 1]"),
        top_k=_number(body, "top_k", 0, int, lambda k: k >= 0, "an integer >= 0"),
        seed=seed,
        stop=stop,
        stream=stream,
        stream_usage=stream_options.get("include_usage", False),
    )


def prompt_name(is_list: bool, index: int) -> str:
    """How an error names prompt ``index`` of a request whose prompt is a
    list (``is_list``) or one string."""
    return f"prompt {index}" if is_list else "the prompt"


@dataclass
class Choice:
    """One prompt of a request: its row's latest result, with stop strings applied."""

    text: str = ""
    finish_reason: str | None = None
    result: object = None  # the row's latest decoder.GenerationResult


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

    def update(self, index: int, result) -> bool:
        """Take a row's new result into choice ``index``; whether the row
        should stop (a stop string appeared)."""
        choice = self.choices[index]
        choice.result, text = result, result.text
        stops = [text.find(s) for s in self.settings.stop if s in text]
        if stops:
            choice.text, choice.finish_reason = text[: min(stops)], "stop"
            return True
        choice.text = text
        if result.finished:
            ended = len(result.tokens) < self.settings.max_tokens
            choice.finish_reason = "stop" if ended else "length"
        return False

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
        decoder,
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

    def submit(self, job: Job) -> None:
        """Queue ``job``. ``RequestError``: 400 when it has more prompts than
        the server ever holds, 429 when it would fit once others finish,
        503 when the server is shutting down."""
        count = len(job.settings.prompts)
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
        import mlx.core as mx

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
                if job.update(job.uids[uid], result):  # a stop string: the row is done
                    generator.cancel(uid)
                if result.finished or job.choices[job.uids[uid]].finish_reason:
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

    def _new_generator(self):
        return self.decoder.batch_generator(
            speculative=self.speculative,
            max_batch_size=self.max_batch_size,
            cost_batch_sizes=cost_batch_sizes(self.max_batch_size),
            interleave_encoding=True,
        )

    def _count(self, generator) -> None:
        with self.lock:
            self.counters["active"] = sum(row is not None for row in generator.rows)

    def _admit(self, generator, job: Job, jobs: dict) -> None:
        """Insert ``job``'s prompts, or tell it why not."""
        from sampling import Sampling

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
        sampling = Sampling(settings.temperature, settings.top_p, settings.top_k)
        for index, prompt_ids in enumerate(ids):
            uid = generator.insert(
                prompt_ids, max_tokens=settings.max_tokens, sampling=sampling, seed=settings.seed
            )
            job.uids[uid] = index
            jobs[uid] = job
        job.send(("accepted",))

    def _refuse(self, job: Job, error: RequestError) -> None:
        self._release(len(job.settings.prompts))
        job.send(("error", error))
        self._end(job, "refused")

    def _cancel(self, generator, job: Job, jobs: dict) -> None:
        rows = [uid for uid, owner in jobs.items() if owner is job]
        for uid in rows:
            generator.cancel(uid)
            del jobs[uid]
        self._release(len(rows))
        if rows:
            self._end(job, "cancelled")


def completion_body(job: Job, request_id: str, model: str, created: int, stream_texts=None) -> dict:
    """OpenAI's completion object for ``job``; with ``stream_texts`` (per
    choice: the text to send now and its finish reason, or None), a
    streaming chunk."""
    choices = []
    for index, choice in enumerate(job.choices):
        if stream_texts is not None and stream_texts[index] is None:
            continue
        result = choice.result
        text, finish_reason = (
            (choice.text, choice.finish_reason) if stream_texts is None else stream_texts[index]
        )
        entry = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if stream_texts is None and result is not None:
            # The speculative figures, named as LM Studio reports them: a
            # round's draft tokens after its rejected one (or the draft's end
            # of sequence) are never tested, so they are ignored.
            entry["stats"] = {
                "total_draft_tokens_count": result.n_draft,
                "accepted_draft_tokens_count": result.n_accepted,
                "rejected_draft_tokens_count": result.n_rejected,
                "ignored_draft_tokens_count": result.n_draft
                - result.n_accepted
                - result.n_rejected,
            }
            # The seed it sampled with, given or drawn: sent again, it repeats the text.
            entry["seed"] = result.seed
        choices.append(entry)
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if stream_texts is None:
        prompt_tokens = sum(c.result.prompt_tokens for c in job.choices if c.result)
        completion_tokens = sum(len(c.result.tokens) for c in job.choices if c.result)
        body["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return body


def build_app(
    engine: Engine,
    args: argparse.Namespace,
    model_name: str,
    draft_name: str | None,
    api_key: str | None,
):
    """The Starlette application serving ``model_name`` (drafted by
    ``draft_name``): the routes, JSON errors, the key check."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    started = int(time.time())

    def error_response(error: RequestError) -> JSONResponse:
        headers = {"Retry-After": "1"} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def read_json(request: Request) -> object:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > args.max_body_bytes:
            raise RequestError(413, f"the body is larger than {args.max_body_bytes} bytes")
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > args.max_body_bytes:
                raise RequestError(413, f"the body is larger than {args.max_body_bytes} bytes")
        try:
            return json.loads(body, parse_constant=_refuse_constant)
        except (ValueError, UnicodeDecodeError) as error:
            raise RequestError(400, f"the body is not valid JSON: {error}") from None

    async def completions(request: Request):
        try:
            settings = parse_completion(await read_json(request), args.max_tokens_limit, model_name)
        except RequestError as error:
            engine.refused()
            return error_response(error)
        job = Job(settings, asyncio.get_running_loop())
        try:
            engine.submit(job)
        except RequestError as error:
            return error_response(error)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if settings.stream:
            message = await job.messages.get()
            if message[0] == "error":
                engine.answered(job)
                return error_response(message[1])
            events = stream_events(job, request_id, created)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return await complete(request, job, request_id, created)
        finally:
            engine.answered(job)

    async def complete(request: Request, job: Job, request_id: str, created: int):
        """Wait for the job's end; a client that leaves first cancels it."""
        leaving = asyncio.ensure_future(client_left(request))
        try:
            while True:
                message = asyncio.ensure_future(job.messages.get())
                await asyncio.wait((message, leaving), return_when=asyncio.FIRST_COMPLETED)
                if not message.done():
                    message.cancel()
                    engine.cancel(job)
                    return Response(status_code=499)  # nobody reads it
                if message.result()[0] == "error":
                    return error_response(message.result()[1])
                if message.result()[0] == "done":
                    return JSONResponse(completion_body(job, request_id, model_name, created))
        finally:
            leaving.cancel()

    async def stream_events(job: Job, request_id: str, created: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk after every round that added text,
        then [DONE]. Text that could still become a stop string is held back."""
        sent = [0] * len(job.choices)  # characters sent, per choice
        ended = [False] * len(job.choices)  # its finish_reason sent
        try:
            while True:
                message = await job.messages.get()
                if message[0] == "error":
                    yield f"data: {json.dumps(message[1].body())}\n\n"
                    break
                texts = []
                # The choices as the round that sent this left them, however
                # late it is read: a chunk per round.
                for index, (text, finish_reason) in enumerate(message[1]):
                    finishing = finish_reason is not None and not ended[index]
                    end = len(text)
                    if not finishing:
                        end -= held_back(text, job.settings.stop)
                    new = text[sent[index] : max(sent[index], end)]
                    sent[index] += len(new)
                    ended[index] = ended[index] or finishing
                    texts.append((new, finish_reason) if new or finishing else None)
                if any(t is not None for t in texts):
                    chunk = completion_body(job, request_id, model_name, created, texts)
                    yield f"data: {json.dumps(chunk)}\n\n"
                if message[0] == "done":
                    if job.settings.stream_usage:  # OpenAI's last chunk: no choices, the usage
                        usage = completion_body(job, request_id, model_name, created)["usage"]
                        chunk = completion_body(
                            job, request_id, model_name, created, [None] * len(texts)
                        )
                        yield f"data: {json.dumps({**chunk, 'usage': usage})}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            engine.answered(job)
            if not job.done:  # the client left (or the stream failed): free the rows
                engine.cancel(job)

    def model_entry() -> dict:
        """OpenAI's model object for the served model; ``draft_model`` names
        the model that proposes its tokens (null: none), which is not served."""
        return {
            "id": model_name,
            "object": "model",
            "created": started,
            "owned_by": "local",
            "draft_model": draft_name,
        }

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [model_entry()]})

    async def model(request: Request):
        name = request.path_params["name"]
        try:
            check_model({"model": name}, model_name)
        except RequestError as error:
            return error_response(error)
        return JSONResponse(model_entry())

    async def health(request: Request):
        return JSONResponse(engine.health())

    async def chat(request: Request):
        return error_response(
            RequestError(
                400,
                "T5 is not a chat model (it has no chat template): send the text as prompt "
                "to /v1/completions",
            )
        )

    async def http_error(request: Request, error: HTTPException):
        messages = {
            404: f"no such path: {request.url.path}",
            405: f"{request.method} is not allowed on {request.url.path}",
        }
        return error_response(
            RequestError(error.status_code, messages.get(error.status_code, str(error.detail)))
        )

    async def server_error(request: Request, error: Exception):
        return error_response(RequestError(500, f"internal error: {type(error).__name__}"))

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{name:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    if api_key:
        app.add_middleware(KeyCheck, api_key=api_key, error=error_response)
    return app


async def client_left(request) -> None:
    """Return once the client of ``request`` (its body read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of ``text`` a stream holds back: the
    longest end of it that begins one of ``stops`` (and may yet become it)."""
    longest = max(map(len, stops), default=1) - 1
    for length in range(min(longest, len(text)), 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


def _refuse_constant(name: str):
    """JSON's NaN and Infinity, which Python would otherwise accept."""
    raise ValueError(f"{name} is not a number JSON allows")


class KeyCheck:
    """ASGI middleware: every path but /health needs ``Authorization: Bearer KEY``."""

    def __init__(self, app, api_key: str, error):
        self.app, self.key, self.error = app, api_key.encode(), error

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            headers = dict(scope["headers"])
            scheme, _, given = headers.get(b"authorization", b"").partition(b" ")
            # The scheme is case-insensitive (RFC 9110); the key, compared in constant time, not.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given, self.key):
                response = self.error(
                    RequestError(401, "a valid API key is required", kind="authentication_error")
                )
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def http_server_class():
    """uvicorn's server, saying where it listens once it does, ending with
    status 0 after a graceful shutdown on SIGINT or SIGTERM (uvicorn's own
    raises the signal again once it has shut down), and calling
    ``on_overtime()`` if requests are still open ``shutdown_timeout``
    seconds into it."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(
            self,
            config: uvicorn.Config,
            ready_message: str,
            shutdown_timeout: float,
            on_overtime: Callable[[], None],
        ):
            super().__init__(config)
            self.ready_message = ready_message
            self.shutdown_timeout, self.on_overtime = shutdown_timeout, on_overtime

        async def shutdown(self, sockets=None) -> None:
            # uvicorn's own timeout cancels what is still running: plain-text
            # 500s, streams cut short, tracebacks. The requests get an answer
            # of their own first, with time to send it.
            overtime = asyncio.get_running_loop().call_later(
                self.shutdown_timeout, self.on_overtime
            )
            try:
                await super().shutdown(sockets)
            finally:
                overtime.cancel()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(
                    self.ready_message.format(f"http://{host}:{port}"), file=sys.stderr, flush=True
                )

        @contextlib.contextmanager
        def capture_signals(self):
            stops = (signal.SIGINT, signal.SIGTERM)
            previous = {stop: signal.signal(stop, self.handle_exit) for stop in stops}
            try:
                yield
            finally:
                for stop, handler in previous.items():
                    signal.signal(stop, handler)

    return Server


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port`` (not yet listening), so that a
    busy port or a wrong address is found before any model loads."""
    listener = None
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as error:
        if listener is not None:
            listener.close()
        raise OSError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    return listener


def prompt_token_limit(paths: list[Path], max_tokens: int, batch_size: int) -> int:
    """The longest prompt, in tokens, for which a full batch at ``max_tokens``
    fits in memory by main.py's estimate, and which costs the rows beside it
    at most half their speed (``cost_token_limit``)."""
    from loading import available_memory, runtime_bytes
    from model import load_config, weights_file

    weights = sum(weights_file(path).stat().st_size for path in paths)
    budget = available_memory() - weights

    def fits(tokens: int) -> bool:
        return batch_size * sum(runtime_bytes(p, tokens, max_tokens) for p in paths) <= budget

    low, high = 1, 1 << 20
    if not fits(low):
        raise MemoryError(
            f"{' and '.join(map(str, paths))} leave no memory for a batch of {batch_size}"
        )
    while low < high:  # the largest length that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return min(low, cost_token_limit(load_config(paths[0])))


def cost_token_limit(args) -> int:
    """The longest prompt whose cross-attention costs a decoded token no
    more multiply-adds than the rest of the main model's step
    (``ModelArgs.decode_work``). Its encoding is sliced between the rounds
    (``BatchGenerator``), but once it joins, every row's cross-attention
    widens to its length until it leaves: the rows beside it then decode
    at no less than about half their speed. Never below ``COST_LIMIT_FLOOR``."""
    per_prompt_token = args.num_decoder_layers * 2 * args.num_heads * args.d_kv
    return max(COST_LIMIT_FLOOR, args.decode_work // per_prompt_token)


# A small model's step is mostly fixed costs that multiply-adds do not
# count: cost_token_limit accepts prompts up to this length whatever the model.
COST_LIMIT_FLOOR = 2048


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    # cpu first: on Linux it loads an optimized BLAS, which MLX uses only if loaded before it.
    import cpu  # noqa: F401  # isort: skip
    import uvicorn

    from loading import check_memory, load_decoder, model_paths

    Server = http_server_class()
    listener = listening_socket(args.host, args.port)

    no_draft = args.regular_decode or args.draft_model_name == "none"
    paths = model_paths(args.model_name, None if no_draft else args.draft_model_name)
    limit = args.max_prompt_tokens or prompt_token_limit(
        paths, args.max_tokens_limit, args.max_batch_size
    )
    check_memory(args.model_name, paths, limit, args.max_tokens_limit, args.max_batch_size)
    for path, role in zip(paths, ("", "draft ")):
        print(f"Loading {role}{path}", file=sys.stderr)
    decoder = load_decoder(
        paths,
        num_draft=args.num_draft,
        delta=args.delta,
        prompt_lookup=0 if args.regular_decode else args.prompt_lookup,
    )
    engine = Engine(
        decoder,
        speculative=not args.regular_decode,
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
        max_prompt_tokens=limit,
    )
    engine.start()
    draft_name = args.draft_model_name if len(paths) > 1 else None
    app = build_app(engine, args, args.model_name, draft_name, api_key)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(
            f"warning: listening on {args.host} without an API key: anyone who can reach it "
            f"can use it (--api-key or ${API_KEY_VARIABLE})",
            file=sys.stderr,
        )
    log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # standard output stays empty
    config = uvicorn.Config(
        app,
        log_config=log_config,
        log_level="warning" if args.quiet else "info",  # info: the access log
        access_log=not args.quiet,
        timeout_graceful_shutdown=args.shutdown_timeout + SHUTDOWN_GRACE,
    )
    server = Server(
        config,
        f"Serving {args.model_name} on {{}} (prompts up to {limit} tokens)",
        args.shutdown_timeout,
        functools.partial(engine.abort, "the server is shutting down"),
    )
    try:
        server.run(sockets=[listener])
    finally:
        engine.stop()
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    quiet_transformers()
    full_float32()
    parser = build_parser()
    args = parser.parse_args(argv)
    if launched_in_group():
        print(f"error: {GROUP_REFUSAL}", file=sys.stderr)
        return 1
    try:
        return serve(args)
    except (ValueError, OSError, MemoryError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    status = main()
    # Skip interpreter teardown: MLX's native state of the decoding thread
    # sometimes aborts the process as it is destroyed (SIGABRT after a
    # clean shutdown), which would turn a graceful exit into a crash.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
