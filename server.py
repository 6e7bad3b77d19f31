"""Serve a T5 model over HTTP with OpenAI's completions API: concurrent
requests share one batch, decoded speculatively and exactly.

python server.py --model-name t5-large --draft-model-name t5-small --num-draft auto
curl http://127.0.0.1:8080/v1/completions -H 'Content-Type: application/json' \\
     -d '{"prompt": "translate English to German: Thank you.", "max_tokens": 20}'

Three rooms: the protocol (``protocol.py``: requests parsed, bodies built),
the decoding engine (``engine.py``: one thread owns MLX and the batch), and
here the HTTP side (Starlette on uvicorn: the routes' handlers, ``App``)
and the process (arguments, loading, the listening socket, shutdown).
docs/serving.md has the API, the limits and what seeds promise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import functools
import hmac
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from cli import (
    FULL_FLOAT32_NOTE,
    NON_NEGATIVE,
    POSITIVE,
    ArgumentParser,
    add_drafting_options,
    checked,
    full_float32,
    quiet_transformers,
)
from protocol import (
    NOT_A_CHAT_MODEL,
    RequestError,
    check_model,
    completion_body,
    event,
    held_back,
    http_error,
    model_entry,
    parse_completion,
    parse_json,
)

if TYPE_CHECKING:
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.requests import Request
    from starlette.responses import Response

    from engine import Engine, Job

API_KEY_VARIABLE = "T5_SERVER_API_KEY"
# Seconds past --shutdown-timeout for requests told the server is shutting
# down to send their error; uvicorn cancels whatever is left after that.
SHUTDOWN_GRACE = 5.0


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


class App:
    """The HTTP side of a server: one handler per route, over the state they
    share (the engine, what is served, the limits). The handlers parse
    with ``protocol``, hand jobs to the ``engine`` and answer from what it
    sends back; they never touch MLX."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        draft_name: str | None,
        max_tokens_limit: int,
        max_body_bytes: int,
    ):
        self.engine, self.model_name, self.draft_name = engine, model_name, draft_name
        self.max_tokens_limit, self.max_body_bytes = max_tokens_limit, max_body_bytes
        self.started = int(time.time())

    def starlette(self, api_key: str | None) -> Starlette:
        """The Starlette application: the routes, JSON errors, the key check."""
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{name:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            exception_handlers={HTTPException: self.http_error, Exception: self.server_error},
        )
        if api_key:
            app.add_middleware(KeyCheck, api_key=api_key, error=error_response)
        return app

    async def read_json(self, request: Request) -> object:
        """The request's JSON body, at most ``max_body_bytes`` of it."""
        too_large = RequestError(413, f"the body is larger than {self.max_body_bytes} bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise too_large
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_large
        return parse_json(body)

    async def completions(self, request: Request) -> Response:
        from starlette.responses import StreamingResponse

        try:
            body = await self.read_json(request)
            settings = parse_completion(body, self.max_tokens_limit, self.model_name)
        except RequestError as error:
            self.engine.refused()
            return error_response(error)
        try:
            job = self.engine.submit(settings, asyncio.get_running_loop())
        except RequestError as error:
            return error_response(error)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if settings.stream:
            message = await job.messages.get()
            if message[0] == "error":
                self.engine.answered(job)
                return error_response(message[1])
            events = self.stream_events(job, request_id, created)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            return await self.complete(request, job, request_id, created)
        finally:
            self.engine.answered(job)

    async def complete(self, request: Request, job: Job, request_id: str, created: int):
        """Wait for the job's end; a client that leaves first cancels it."""
        from starlette.responses import JSONResponse, Response

        leaving = asyncio.ensure_future(client_left(request))
        try:
            while True:
                message = asyncio.ensure_future(job.messages.get())
                await asyncio.wait((message, leaving), return_when=asyncio.FIRST_COMPLETED)
                if not message.done():
                    message.cancel()
                    self.engine.cancel(job)
                    return Response(status_code=499)  # nobody reads it
                if message.result()[0] == "error":
                    return error_response(message.result()[1])
                if message.result()[0] == "done":
                    body = completion_body(job.choices, request_id, self.model_name, created)
                    return JSONResponse(body)
        finally:
            leaving.cancel()

    async def stream_events(self, job: Job, request_id: str, created: int) -> AsyncIterator[str]:
        """Server-sent events: a chunk after every round that added text,
        then [DONE]. Text that could still become a stop string is held back."""
        sent = [0] * len(job.choices)  # characters sent, per choice
        ended = [False] * len(job.choices)  # its finish_reason sent
        answer = functools.partial(
            completion_body, job.choices, request_id, self.model_name, created
        )
        try:
            while True:
                message = await job.messages.get()
                if message[0] == "error":
                    yield event(message[1].body())
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
                    yield event(answer(texts))
                if message[0] == "done":
                    if job.settings.stream_usage:  # OpenAI's last chunk: no choices, the usage
                        yield event({**answer([None] * len(texts)), "usage": answer()["usage"]})
                    break
            yield event("[DONE]")
        finally:
            self.engine.answered(job)
            if not job.done:  # the client left (or the stream failed): free the rows
                self.engine.cancel(job)

    async def models(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        entry = model_entry(self.model_name, self.draft_name, self.started)
        return JSONResponse({"object": "list", "data": [entry]})

    async def model(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        try:
            check_model({"model": request.path_params["name"]}, self.model_name)
        except RequestError as error:
            return error_response(error)
        return JSONResponse(model_entry(self.model_name, self.draft_name, self.started))

    async def health(self, request: Request) -> Response:
        from starlette.responses import JSONResponse

        return JSONResponse(self.engine.health())

    async def chat(self, request: Request) -> Response:
        return error_response(NOT_A_CHAT_MODEL)

    async def http_error(self, request: Request, error: HTTPException) -> Response:
        status, method, path = error.status_code, request.method, request.url.path
        return error_response(http_error(status, method, path, str(error.detail)))

    async def server_error(self, request: Request, error: Exception) -> Response:
        return error_response(RequestError(500, f"internal error: {type(error).__name__}"))


def error_response(error: RequestError) -> Response:
    """``error`` as a JSON response; a 429 says when to retry."""
    from starlette.responses import JSONResponse

    headers = {"Retry-After": "1"} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def client_left(request) -> None:
    """Return once the client of ``request`` (its body read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
            self.loop: asyncio.AbstractEventLoop | None = None  # set as it starts
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
            self.loop = asyncio.get_running_loop()
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


class GroupEnd:
    """How rank 0 of a serving group ends when the group fails under it,
    called once with the line to end with, from the decoding thread or the
    peers' watch: every open request is answered (a 503; a stream, an error
    event and [DONE]), then the server stops and the process exits 1."""

    def __init__(self):
        self.line: str | None = None
        self.lock = threading.Lock()
        self.engine: Engine | None = None
        self.server = None  # set before the engine starts

    def __call__(self, line: str) -> None:
        with self.lock:
            if self.line is not None:
                return
            self.line = line
        if self.server.loop is None:  # not yet serving: nothing to answer
            self.server.should_exit = True
        else:
            self.server.loop.call_soon_threadsafe(self.end)

    def end(self) -> None:
        self.engine.abort(f"the server's process group failed: {self.line}")
        self.server.should_exit = True


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


def load_decoder(args: argparse.Namespace, group) -> tuple:
    """The decoder ``args`` name, this rank's share of its main model in a
    ``group`` (None: alone), and the longest prompt it accepts."""
    from loading import load_checked, model_paths, prompt_token_limit

    no_draft = args.regular_decode or args.draft_model_name == "none"
    paths = model_paths(args.model_name, None if no_draft else args.draft_model_name)
    shards = 1 if group is None else group.size()
    limit = args.max_prompt_tokens or prompt_token_limit(
        paths, args.max_tokens_limit, args.max_batch_size, shards
    )
    decoder = load_checked(
        args.model_name,
        paths,
        prompt_tokens=limit,
        max_tokens=args.max_tokens_limit,
        batch_size=args.max_batch_size,
        num_draft=args.num_draft,
        delta=args.delta,
        prompt_lookup=0 if args.regular_decode else args.prompt_lookup,
        group=group,
    )
    return decoder, limit


def follow_group(args: argparse.Namespace, group, connections: list) -> int:
    """Every rank of a serving group but 0: load this rank's share of the
    main model, then decode what rank 0 decides until it stops. A peer that
    closes one of the group's ``connections`` first ends this rank."""
    from distributed import GROUP_BROKEN, PEER_CLOSED, PeerWatch, RankZeroDecisions, end_now
    from engine import follow

    watch = PeerWatch(connections, lambda: end_now(group, f"{GROUP_BROKEN} ({PEER_CLOSED})"))
    decoder, _ = load_decoder(args, group)
    follow(
        decoder,
        RankZeroDecisions(group, watch),
        speculative=not args.regular_decode,
        max_batch_size=args.max_batch_size,
    )
    return 0


def serve(args: argparse.Namespace, group=None, connections: list | None = None) -> int:
    """Serve alone, or as rank 0 of a ``group`` that splits the main model:
    the one that listens and decides what every rank decodes; a peer that
    closes one of the group's ``connections``, or a failed sum, ends it."""
    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    # cpu first: on Linux it loads an optimized BLAS, which MLX uses only if loaded before it.
    import cpu  # noqa: F401  # isort: skip
    import uvicorn

    from distributed import PEER_CLOSED, PeerWatch, RankZeroDecisions, group_failure
    from engine import Engine

    Server = http_server_class()
    listener = listening_socket(args.host, args.port)
    decoder, limit = load_decoder(args, group)
    ended = GroupEnd()
    watch = None
    if group is not None:
        watch = PeerWatch(connections, functools.partial(ended, group_failure(PEER_CLOSED, group)))
    engine = Engine(
        decoder,
        speculative=not args.regular_decode,
        max_batch_size=args.max_batch_size,
        max_waiting=args.max_waiting,
        max_prompt_tokens=limit,
        decisions=None if group is None else RankZeroDecisions(group, watch),
        on_group_failure=ended,
    )
    draft_name = None if decoder.draft_model is None else args.draft_model_name
    app = App(engine, args.model_name, draft_name, args.max_tokens_limit, args.max_body_bytes)
    app = app.starlette(api_key)
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
    ended.engine, ended.server = engine, server
    engine.start()
    try:
        server.run(sockets=[listener])
    finally:
        if ended.line is None:  # else its thread may be stuck in MLX: the process ends without it
            engine.stop()
    if ended.line is not None:
        print(f"error: {ended.line}", file=sys.stderr, flush=True)
        return 1
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    quiet_transformers()
    full_float32()
    args = build_parser().parse_args(argv)
    from distributed import (
        failures_end_group,
        group_connections,
        init_group,
        silence_other_ranks,
    )

    group = init_group()  # None alone
    silence_other_ranks(group)
    connections = [] if group is None else group_connections()  # before any other
    if group is not None and group.rank() != 0:
        with failures_end_group(group):
            return follow_group(args, group, connections)
    try:
        return serve(args, group, connections)
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
