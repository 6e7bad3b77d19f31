"""OpenAI's completions protocol as this server speaks it (and mlx-lm's
server and LM Studio do): a request body parsed into ``Settings`` (the
decoding ``speculative.Options`` among them), stop strings applied to the
growing texts, and the bodies of answers, stream chunks and errors. Pure
functions and plain data: no threads, no HTTP, no decoding; ``engine.py``
decodes, ``server.py`` serves. docs/serving.md has the API.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from speculative import GenerationResult, Options

# The most stop strings a request may give, as OpenAI allows.
MAX_STOP_STRINGS = 4


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
    """What a completion request asks for, checked: its prompts, how each
    is decoded, and what the answer holds."""

    prompts: list[str]
    options: Options
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    stream_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    is_list: bool = False  # the prompt came as a list (errors name a prompt by index)


def parse_json(body: bytes) -> object:
    """The JSON value of a request ``body``; ``RequestError`` (400) if it is
    not JSON (NaN and Infinity included, which Python would accept)."""
    try:
        return json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(400, f"the body is not valid JSON: {error}") from None


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
    "num_beams": (1, "beam search runs in main.py and the Python API (--num-beams), not here"),
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
    # Imported here: importing this module starts no MLX, so that server.py
    # asks for full-precision float32 before MLX starts (cli.full_float32).
    from sampling import SEEDS, is_seed
    from speculative import Options

    limit = max_tokens_limit
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not is_seed(seed)):
        raise RequestError(400, f"seed must be {SEEDS}, got {json.dumps(seed)}", "seed")
    options = Options(
        max_tokens=_number(
            body,
            "max_tokens",
            min(Options.max_tokens, limit),
            int,
            lambda n: 1 <= n <= limit,
            f"an integer in [1, {limit}]",
        ),
        temp=_number(body, "temperature", 0.0, float, lambda t: t >= 0, "a number >= 0"),
        top_p=_number(body, "top_p", 1.0, float, lambda p: 0 < p <= 1, "a number in (0, 1]"),
        top_k=_number(body, "top_k", 0, int, lambda k: k >= 0, "an integer >= 0"),
        seed=seed,
    )
    return Settings(
        prompts=prompts,
        options=options,
        stop=stop,
        stream=stream,
        stream_usage=stream_options.get("include_usage", False),
        is_list=isinstance(prompt, list),
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
    result: GenerationResult | None = None  # the row's latest

    def update(self, result: GenerationResult, settings: Settings) -> bool:
        """Take the row's new ``result``, cut at the first of the request's
        stop strings; whether the row should stop (a stop string appeared)."""
        self.result, text = result, result.text
        stops = [text.find(s) for s in settings.stop if s in text]
        if stops:
            self.text, self.finish_reason = text[: min(stops)], "stop"
            return True
        self.text = text
        if result.finished:
            ended = len(result.tokens) < settings.options.max_tokens
            self.finish_reason = "stop" if ended else "length"
        return False


def completion_body(
    choices: list[Choice], request_id: str, model: str, created: int, stream_texts=None
) -> dict:
    """OpenAI's completion object for a request's ``choices``; with
    ``stream_texts`` (per choice: the text to send now and its finish
    reason, or None), a streaming chunk."""
    entries = []
    for index, choice in enumerate(choices):
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
        entries.append(entry)
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": entries,
    }
    if stream_texts is None:
        prompt_tokens = sum(c.result.prompt_tokens for c in choices if c.result)
        completion_tokens = sum(len(c.result.tokens) for c in choices if c.result)
        body["usage"] = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
    return body


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


NOT_A_CHAT_MODEL = RequestError(
    400,
    "T5 is not a chat model (it has no chat template): send the text as prompt to /v1/completions",
)


def http_error(status: int, method: str, path: str, detail: str) -> RequestError:
    """The error for a request HTTP itself refuses: no such path, a method not allowed."""
    messages = {404: f"no such path: {path}", 405: f"{method} is not allowed on {path}"}
    return RequestError(status, messages.get(status, detail))


def model_entry(model: str, draft_model: str | None, created: int) -> dict:
    """OpenAI's model object for the served ``model``; ``draft_model`` names
    the model that proposes its tokens (null: none), which is not served."""
    return {
        "id": model,
        "object": "model",
        "created": created,
        "owned_by": "local",
        "draft_model": draft_model,
    }


def event(body: dict | str) -> str:
    """One server-sent event: ``body`` as JSON, or as it is ("[DONE]")."""
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"
