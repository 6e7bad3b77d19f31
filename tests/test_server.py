"""server.py over real HTTP: the official openai client, concurrent
requests sharing a batch (each greedy choice equal to its prompt decoded
alone, no text in another request's response), seeds, cancellation, bad
input answered with OpenAI-shaped 4xx errors, the API key, and a graceful
shutdown. The server runs on 127.0.0.1 on a port the system picks, started
and stopped by the tests; every request has a time limit."""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from test_batch import PROMPTS

from decoder import SpeculativeDecoder

ROOT = Path(__file__).resolve().parents[1]
API_KEY = "test-key-123"
TIMEOUT = 120  # seconds, for any one request
NUM_DRAFT = 3
MAX_NEW = 12


def server_command(converted_pair, *options: str) -> list[str]:
    """The command line of server.py for the test pair, on a free port."""
    main_dir, draft_dir = converted_pair
    command = [sys.executable, str(ROOT / "server.py"), "--model-name", str(main_dir)]
    command += ["--draft-model-name", str(draft_dir), "--num-draft", str(NUM_DRAFT)]
    return command + ["--port", "0", *options]


def start_server(
    converted_pair,
    *options: str,
    key: str | None = API_KEY,
    quiet: bool = True,
    command: list[str] | None = None,
    cwd: Path = ROOT,
) -> tuple:
    """Start server.py (``command``, by default the test pair's
    ``server_command``) in ``cwd`` on a free port (the system's pick);
    (process, base URL), as ``listening_url`` reads it."""
    command = command or server_command(converted_pair, *options)
    command = command + (["--quiet"] if quiet else [])
    env = dict(os.environ)
    env.pop("T5_SERVER_API_KEY", None)
    if key:
        command += ["--api-key", key]
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return process, listening_url(process)


def listening_url(process) -> str:
    """The base URL of a starting server ``process`` (its output piped, as
    text), once it prints it; then ``process.stderr_lines`` and
    ``process.stdout_lines`` collect the rest of its output."""
    lines = process.stderr_lines = []
    process.stdout_lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # ready when it prints its address
        line = process.stderr.readline()
        lines.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", line)
        if found:
            # Keep reading its output, so that the server never blocks on it.
            process.readers = [
                threading.Thread(target=out.extend, args=(stream,), daemon=True)
                for out, stream in ((lines, process.stderr), (process.stdout_lines, process.stdout))
            ]
            for reader in process.readers:
                reader.start()
            return found.group(1)
        if not line and process.poll() is not None:
            break
    stop_server(process)
    pytest.fail("the server did not start: " + "".join(lines))


def output_after_exit(process) -> tuple[str, str]:
    """(standard output, standard error) of a server that has exited."""
    for reader in process.readers:
        reader.join(timeout=10)
    return "".join(process.stdout_lines), "".join(process.stderr_lines)


def stop_server(process) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


@pytest.fixture(scope="module")
def server(converted_pair):
    process, url = start_server(converted_pair, "--max-prompt-tokens", "1000")
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def reference(decoding_pair):
    """The library's decoder with the server's settings."""
    return SpeculativeDecoder(*decoding_pair, num_draft=NUM_DRAFT)


def post(
    url: str, body, path="/v1/completions", key=API_KEY, timeout: float = TIMEOUT
) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(url + path, content=content, headers=headers, timeout=timeout)


def open_stream(url: str, body: dict, key: str | None = API_KEY):
    """A streamed completion's response, as a context manager."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.stream(
        "POST",
        url + "/v1/completions",
        json={**body, "stream": True},
        headers=headers,
        timeout=TIMEOUT,
    )


def stream_events(url: str, body: dict) -> list[str]:
    """The data lines of a streamed completion."""
    with open_stream(url, body) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def stream_texts(url: str, body: dict) -> list[str]:
    """A streamed completion's texts per choice, put together from its events."""
    texts, finished = {}, {}
    with open_stream(url, body) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for event in events[:-1]:
        for choice in json.loads(event[6:])["choices"]:
            assert not finished.get(choice["index"]), "text after a choice's finish_reason"
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
            finished[choice["index"]] = choice["finish_reason"] is not None
    assert all(finished.values())
    return [texts[i] for i in sorted(texts)]


def test_the_openai_client_gets_the_main_models_text(server, reference, converted_pair):
    from openai import OpenAI

    client = OpenAI(base_url=server + "/v1", api_key=API_KEY, timeout=TIMEOUT, max_retries=0)
    model = str(converted_pair[0])
    alone = reference.generate(PROMPTS[1], max_tokens=MAX_NEW)
    expected = alone.text
    completion = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0
    )
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == len(alone.tokens)
    assert completion.usage.prompt_tokens == alone.prompt_tokens
    assert completion.choices[0].finish_reason in ("stop", "length")
    streamed = client.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0, stream=True
    )
    chunks = list(streamed)
    assert "".join(chunk.choices[0].text for chunk in chunks if chunk.choices) == expected
    with_usage = client.completions.create(
        model=model,
        prompt=PROMPTS[1],
        max_tokens=MAX_NEW,
        stream=True,
        stream_options={"include_usage": True},
    )
    assert [c.usage.completion_tokens for c in with_usage if c.usage] == [len(alone.tokens)]
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].draft_model == str(converted_pair[1])
    assert client.models.retrieve(model).id == model


def test_the_readme_client_gets_text_from_the_readme_server(converted_pair, tmp_path):
    """The README's server command and its openai client example, as
    written: the models it names (the test pair, in mlx_models/) and a free
    port instead of 8080."""
    serve = (ROOT / "README.md").read_text().split("## Serve", 1)[1]
    command = shlex.split(re.search(r"```bash\n(.*?)\n", serve)[1])
    client = re.search(r"```python\n(.*?)```", serve, re.DOTALL)[1]
    assert command[:2] == [".venv/bin/python", "server.py"]
    (tmp_path / "mlx_models").mkdir()
    for option, directory in zip(("--model-name", "--draft-model-name"), converted_pair):
        name = command[command.index(option) + 1]
        (tmp_path / "mlx_models" / name).symlink_to(directory, target_is_directory=True)
    command = [sys.executable, str(ROOT / "server.py"), *command[2:], "--port", "0"]
    process, url = start_server(converted_pair, key=None, command=command, cwd=tmp_path)
    try:
        assert "http://127.0.0.1:8080/v1" in client
        result = subprocess.run(
            [sys.executable, "-c", client.replace("http://127.0.0.1:8080/v1", url + "/v1")],
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip()
    finally:
        stop_server(process)


def test_concurrent_requests_each_get_their_own_text(server, reference):
    """40 requests at once: prompts of 1 to about 160 tokens, streaming and
    not, greedy and sampled, some with a list of prompts."""
    requests = []
    for i in range(40):
        prompts = [PROMPTS[i % len(PROMPTS)]]
        if i % 5 == 0:
            prompts.append(PROMPTS[(i + 3) % len(PROMPTS)])
        body = {"prompt": prompts if len(prompts) > 1 else prompts[0], "max_tokens": MAX_NEW}
        body["temperature"] = 0.0 if i % 3 else 1.0
        requests.append((body, prompts, i % 2 == 0))

    def send(request):
        body, _, streaming = request
        if streaming:
            return stream_texts(server, body)
        response = post(server, body)
        assert response.status_code == 200, response.text
        return [choice["text"] for choice in response.json()["choices"]]

    with ThreadPoolExecutor(max_workers=40) as pool:
        answers = list(pool.map(send, requests))
    alone = {p: reference.generate(p, max_tokens=MAX_NEW).text for p in PROMPTS}
    for (body, prompts, _), texts in zip(requests, answers, strict=True):
        assert len(texts) == len(prompts)
        if body["temperature"] == 0:
            assert texts == [alone[p] for p in prompts]
    health = httpx.get(server + "/health", timeout=TIMEOUT).json()
    assert health["active"] == 0 and health["waiting"] == 0


def test_a_seeded_request_gets_its_regular_text_alone_and_among_others(
    server, reference, converted_pair
):
    """The text of regular decoding with that seed, as the library and
    main.py --seed give it (main.py drafting 5 tokens a round, the server 3),
    alone and among 7 other requests; the response names the seed, and an
    unseeded request's named seed repeats its text."""
    body = {"prompt": PROMPTS[3], "max_tokens": MAX_NEW, "temperature": 0.9, "seed": 42}
    response = post(server, body).json()
    alone = response["choices"][0]["text"]
    assert response["choices"][0]["seed"] == 42
    others = [{**body, "prompt": p, "seed": None} for p in PROMPTS[4:11]]
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(post, server, b) for b in others]
        among = pool.submit(post, server, body).result().json()["choices"][0]["text"]
        for future in futures:
            assert future.result().status_code == 200
    expected = reference.generate(PROMPTS[3], max_tokens=MAX_NEW, temp=0.9, seed=42).text
    main_dir, draft_dir = converted_pair
    main_py = subprocess.run(
        [sys.executable, str(ROOT / "main.py"), "--model-name", str(main_dir)]
        + ["--draft-model-name", str(draft_dir), "--prompt", PROMPTS[3], "-m", str(MAX_NEW)]
        + ["--temp", "0.9", "--seed", "42"],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=True,
    )
    assert alone == among == expected == main_py.stdout[:-1]
    other_seed = post(server, {**body, "seed": 43}).json()["choices"][0]["text"]
    assert other_seed != alone  # the seed matters: the check is not vacuous
    drawn = post(server, {**body, "seed": None}).json()["choices"][0]
    assert (
        post(server, {**body, "seed": drawn["seed"]}).json()["choices"][0]["text"] == drawn["text"]
    )


def leave_mid_stream(url: str, key: str | None = API_KEY) -> tuple[dict, dict]:
    """Open a long stream and leave after its first event; the server's
    /health before, and once it counts the request cancelled with no row
    active (or after a minute)."""
    before = httpx.get(url + "/health", timeout=TIMEOUT).json()
    body = {"prompt": PROMPTS[2], "max_tokens": 64, "stop": "zzzz-never"}
    with open_stream(url, body, key) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # leave after the first event
    after = health_when(url, lambda h: h["cancelled"] > before["cancelled"] and h["active"] == 0)
    return before, after


def test_a_client_that_leaves_frees_its_row(server, reference):
    before, health = leave_mid_stream(server)
    assert health["cancelled"] == before["cancelled"] + 1
    assert health["active"] == 0
    # The server goes on, with the right text.
    expected = reference.generate(PROMPTS[0], max_tokens=MAX_NEW).text
    assert (
        post(server, {"prompt": PROMPTS[0], "max_tokens": MAX_NEW}).json()["choices"][0]["text"]
        == expected
    )


def test_stop_strings_end_a_choice(server, reference):
    full = reference.generate(PROMPTS[1], max_tokens=MAX_NEW).text
    stop = full.split()[2]
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_NEW, "stop": [stop]}
    choice = post(server, body).json()["choices"][0]
    assert choice["text"] == full[: full.index(stop)]
    assert choice["finish_reason"] == "stop"
    assert stream_texts(server, body) == [full[: full.index(stop)]]


GOOD = {"prompt": "the dog", "max_tokens": 4}
BAD_REQUESTS = [
    ("not json", "{", 400, None),
    ("NaN", '{"prompt": "a", "temperature": NaN}', 400, None),
    ("not an object", "[1, 2]", 400, None),
    ("no prompt", {"max_tokens": 4}, 400, "prompt"),
    ("prompt a number", {"prompt": 5}, 400, "prompt"),
    ("empty prompt", {"prompt": "  "}, 400, "prompt"),
    ("empty list", {"prompt": []}, 400, "prompt"),
    ("list with a number", {"prompt": ["a", 3]}, 400, "prompt"),
    ("negative max_tokens", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    ("fractional max_tokens", {**GOOD, "max_tokens": 1.5}, 400, "max_tokens"),
    ("max_tokens as text", {**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    ("max_tokens over the cap", {**GOOD, "max_tokens": 10**6}, 400, "max_tokens"),
    ("negative temperature", {**GOOD, "temperature": -1}, 400, "temperature"),
    ("top_p 0", {**GOOD, "top_p": 0}, 400, "top_p"),
    ("negative top_k", {**GOOD, "top_k": -2}, 400, "top_k"),
    ("negative seed", {**GOOD, "seed": -1}, 400, "seed"),
    ("stop a number", {**GOOD, "stop": 5}, 400, "stop"),
    ("n = 2", {**GOOD, "n": 2}, 400, "n"),
    ("stream as text", {**GOOD, "stream": "yes"}, 400, "stream"),
    ("prompt too long", {"prompt": "the dog " * 1000}, 400, "prompt"),
    ("prompt too long in a list", {"prompt": ["a", "the dog " * 1000]}, 400, "prompt"),
    ("more prompts than the server holds", {**GOOD, "prompt": ["a"] * 73}, 400, "prompt"),
    ("logit_bias", {**GOOD, "logit_bias": {"5": 10}}, 400, "logit_bias"),
    ("presence_penalty", {**GOOD, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("frequency_penalty", {**GOOD, "frequency_penalty": -1}, 400, "frequency_penalty"),
    ("suffix", {**GOOD, "suffix": " the end"}, 400, "suffix"),
    ("echo", {**GOOD, "echo": True}, 400, "echo"),
    ("unknown parameter", {**GOOD, "repetition_penalty": 1.2}, 400, "repetition_penalty"),
    ("model a number", {**GOOD, "model": 3}, 400, "model"),
    ("user a number", {**GOOD, "user": 3}, 400, "user"),
    ("stream_options without stream", {**GOOD, "stream_options": {}}, 400, "stream_options"),
    (
        "stream_options with stream false",
        {**GOOD, "stream": False, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
    ),
    (
        "stream_options with a key not honoured",
        {**GOOD, "stream": True, "stream_options": {"continuous_usage_stats": True}},
        400,
        "stream_options",
    ),
]


@pytest.mark.parametrize(
    ("case", "body", "status", "param"), BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_gets_a_json_error_and_the_server_goes_on(case, body, status, param, server):
    response = post(server, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if param and param != "prompt":
        assert param in error["message"]  # named, not just flagged
    assert post(server, GOOD).status_code == 200


def test_the_errors_say_which_prompt_and_what_limit(server):
    too_long = post(server, {"prompt": ["a", "the dog " * 1000]}).json()["error"]["message"]
    assert too_long.startswith("prompt 1 has ") and "1000" in too_long
    too_many = post(server, {**GOOD, "prompt": ["a"] * 73}).json()["error"]["message"]
    assert "at most 72" in too_many  # --max-batch-size 8 + --max-waiting 64


def test_parameters_at_their_neutral_values_are_taken(server, reference, converted_pair):
    neutral = {"logit_bias": {}, "presence_penalty": 0, "frequency_penalty": 0.0}
    neutral |= {"suffix": None, "n": 1, "echo": False, "user": "someone"}
    body = {"prompt": PROMPTS[1], "max_tokens": MAX_NEW, "model": str(converted_pair[0])}
    response = post(server, {**body, **neutral})
    assert response.status_code == 200, response.text
    expected = reference.generate(PROMPTS[1], max_tokens=MAX_NEW).text
    assert response.json()["choices"][0]["text"] == expected


def test_a_model_not_served_is_not_found(server, converted_pair):
    for name in ("gpt-4", str(converted_pair[1])):  # the draft only proposes tokens: not served
        response = post(server, {**GOOD, "model": name})
        assert response.status_code == 404, response.text
        assert response.json()["error"]["code"] == "model_not_found"
        found = httpx.get(
            f"{server}/v1/models/{name}",
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=TIMEOUT,
        )
        assert found.status_code == 404
        assert found.json()["error"]["code"] == "model_not_found"


def test_wrong_paths_methods_size_and_keys(server):
    cases = [
        (
            httpx.get(
                server + "/v1/nothing",
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=TIMEOUT,
            ),
            404,
        ),
        (
            httpx.get(
                server + "/v1/completions",
                headers={"Authorization": f"Bearer {API_KEY}"},
                timeout=TIMEOUT,
            ),
            405,
        ),
        (post(server, GOOD, path="/v1/chat/completions"), 400),
        (post(server, {"prompt": "a" * 2_000_000}), 413),
        (post(server, GOOD, key=None), 401),
        (post(server, GOOD, key="wrong"), 401),
        (post(server, GOOD, key=f"{API_KEY} extra"), 401),
    ]
    for response, status in cases:
        assert response.status_code == status, response.text
        assert response.json()["error"]["message"]
    assert "/v1/completions" in cases[2][0].json()["error"]["message"]
    assert httpx.get(server + "/health", timeout=TIMEOUT).status_code == 200  # no key needed
    assert post(server, GOOD).status_code == 200
    lowercase = {"Authorization": f"bearer {API_KEY}"}  # the scheme is case-insensitive
    assert httpx.post(server + "/v1/completions", json=GOOD, headers=lowercase).status_code == 200


def sigterm_while_decoding(url: str, process, expected: str) -> None:
    """SIGTERM to ``process`` while the server at ``url`` decodes a request
    (the second prompt, 40 tokens), which must still get ``expected``."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        running = pool.submit(post, url, {"prompt": PROMPTS[2], "max_tokens": 40}, key=None)
        assert health_when(url, lambda health: health["running"] > 0)["running"] > 0
        process.send_signal(signal.SIGTERM)
        assert running.result().json()["choices"][0]["text"] == expected


def test_sigterm_lets_a_running_request_finish(converted_pair, reference):
    process, url = start_server(converted_pair, key=None)
    try:
        sigterm_while_decoding(url, process, reference.generate(PROMPTS[2], max_tokens=40).text)
        assert process.wait(timeout=60) == 0
    finally:
        stop_server(process)


def test_the_load_generator_reports_every_mode(converted_pair, tmp_path):
    """benchmarks/load.py end to end on the tiny pair: both modes, no errors."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:4]))
    out = tmp_path / "load.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "load.py")]
    command += [
        "--model-name",
        str(converted_pair[0]),
        "--draft-model-name",
        str(converted_pair[1]),
    ]
    command += ["--prompts", str(prompts), "--concurrency", "1,3", "--requests", "6"]
    command += ["--max-tokens", "8", "--out", str(out)]
    subprocess.run(command, check=True, timeout=300, capture_output=True, cwd=ROOT)
    report = json.loads(out.read_text())
    assert [(r["mode"], r["concurrency"]) for r in report["rows"]] == [
        ("speculative auto", 1),
        ("speculative auto", 3),
        ("regular", 1),
        ("regular", 3),
    ]
    assert all(r["errors"] == 0 and r["tokens_per_s"] > 0 for r in report["rows"])
    assert report["library_tokens_per_s"] > 0


def test_the_soak_finds_nothing_lost_duplicated_or_mismatched(converted_pair, tmp_path):
    """benchmarks/load.py --soak on the tiny pair: every kind of request,
    bad ones and clients that leave included, and a clean tally."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:5]))
    out = tmp_path / "soak.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "load.py")]
    command += ["--model-name", str(converted_pair[0])]
    command += ["--draft-model-name", str(converted_pair[1]), "--prompts", str(prompts)]
    command += ["--soak", "40", "--concurrency", "6", "--max-tokens", "8", "--out", str(out)]
    command += ["--request-timeout", "20"]
    run = subprocess.run(
        command, check=False, timeout=300, capture_output=True, text=True, cwd=ROOT
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(out.read_text())
    for kind in ("stream", "list", "whole", "sampled", "leave", "bad"):
        assert report[kind] > 0, kind
    assert (
        sum(report[kind] for kind in ("stream", "list", "whole", "sampled", "leave", "bad")) == 40
    )
    for failure in ("lost", "duplicated", "mismatched", "bad with the wrong status"):
        assert report[failure] == 0, failure
    assert report["health"]["active"] == report["health"]["waiting"] == 0


def health_when(url: str, condition, seconds: float = 60) -> dict:
    """/health once ``condition(health)`` holds, or as it is after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        health = httpx.get(url + "/health", timeout=TIMEOUT).json()
        if condition(health) or time.monotonic() > deadline:
            return health
        time.sleep(0.02)  # polling, not waiting for something to happen by then


# A request that decodes far longer than a client waits: 8 rows of 512 tokens.
LONG = {"prompt": [PROMPTS[2]] * 8, "max_tokens": 512}


@pytest.mark.parametrize("streaming", [False, True], ids=["whole", "streamed"])
def test_a_client_that_times_out_frees_its_rows(server, streaming):
    """A client that gives up after 0.5 s, as one with a timeout does:
    its request is cancelled (not completed), every row freed."""
    before = httpx.get(server + "/health", timeout=TIMEOUT).json()
    started = time.monotonic()
    if streaming:  # a total deadline: events keep coming, so no read times out
        with open_stream(server, LONG) as response:
            for _ in response.iter_lines():
                if time.monotonic() - started > 0.5:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            post(server, LONG, timeout=0.5)
    health = health_when(server, lambda h: h["cancelled"] > before["cancelled"])
    assert health["cancelled"] == before["cancelled"] + 1
    assert health["completed"] == before["completed"]
    assert health_when(server, lambda h: h["active"] == h["waiting"] == 0)["active"] == 0
    assert post(server, GOOD).status_code == 200


def test_every_request_ends_in_exactly_one_counter(server):
    """A mixed run: each request counts in ``requests`` and, once it ended,
    in one of completed, cancelled, refused and errors; ``running`` is the rest."""
    outcomes = ("completed", "cancelled", "refused", "errors")
    before = httpx.get(server + "/health", timeout=TIMEOUT).json()
    assert post(server, GOOD).status_code == 200
    assert stream_texts(server, GOOD)
    for bad in ("{", {"prompt": "the dog " * 1000}, {**GOOD, "model": "gpt-4"}):
        assert post(server, bad).status_code in (400, 404)
    assert post(server, {**GOOD, "prompt": ["a"] * 73}).status_code == 400  # refused at submit
    with open_stream(server, LONG) as response:  # a client that leaves
        next(line for line in response.iter_lines() if line.startswith("data: "))
    health = health_when(
        server, lambda h: h["running"] == 0 and h["cancelled"] > before["cancelled"]
    )
    change = {name: health[name] - before[name] for name in ("requests", *outcomes)}
    assert change == {"requests": 7, "completed": 2, "cancelled": 1, "refused": 4, "errors": 0}
    assert health["requests"] == health["running"] + sum(health[name] for name in outcomes)


def test_the_draft_stats_add_up(server):
    body = {"prompt": PROMPTS[:6], "max_tokens": MAX_NEW}
    stats = [choice["stats"] for choice in post(server, body).json()["choices"]]
    for counts in stats:
        parts = ("accepted", "rejected", "ignored")
        total = sum(counts[f"{part}_draft_tokens_count"] for part in parts)
        assert total == counts["total_draft_tokens_count"], counts
    assert any(counts["ignored_draft_tokens_count"] for counts in stats)  # not vacuous


def test_a_stop_string_that_never_comes_holds_nothing_back(server):
    """As many chunks with a long stop string that never appears as without."""
    body = {"prompt": PROMPTS[2], "max_tokens": 40}
    plain = stream_events(server, body)
    with_stop = stream_events(server, {**body, "stop": "\N{SNOWMAN}" * 200})
    assert len(with_stop) == len(plain) > 5
    assert stream_texts(server, {**body, "stop": "\N{SNOWMAN}" * 200}) == stream_texts(server, body)


def test_statuses_say_whether_waiting_helps(converted_pair):
    """--max-batch-size 2 --max-waiting 2: 10 requests at once, 4 taken and 6
    told to retry (429); more prompts than 4 in one request is a 400."""
    process, url = start_server(
        converted_pair, "--max-batch-size", "2", "--max-waiting", "2", key=None
    )
    try:
        too_many = post(url, {**GOOD, "prompt": ["a"] * 5}, key=None)
        assert too_many.status_code == 400 and "at most 4" in too_many.json()["error"]["message"]
        statuses = []
        all_answered = threading.Barrier(10, timeout=60)

        def send() -> None:
            with open_stream(url, {"prompt": PROMPTS[2], "max_tokens": 512}, key=None) as response:
                statuses.append(response.status_code)
                all_answered.wait()  # the taken ones still decode meanwhile

        with ThreadPoolExecutor(max_workers=10) as pool:
            for future in [pool.submit(send) for _ in range(10)]:
                future.result()
        assert sorted(statuses) == [200] * 4 + [429] * 6
        assert health_when(url, lambda h: h["active"] == h["waiting"] == 0)["active"] == 0
        assert post(url, GOOD, key=None).status_code == 200  # the wait helped
    finally:
        stop_server(process)


def test_shutdown_past_its_timeout_answers_every_request(converted_pair):
    """SIGTERM with --shutdown-timeout 0 during a stream and a whole request
    waiting behind it: an error event and [DONE] for one, a JSON 503 for the
    other, exit status
    0, no traceback; the access log went to standard error, not output."""
    process, url = start_server(converted_pair, "--shutdown-timeout", "0", key=None, quiet=False)
    try:
        streaming = threading.Event()

        def stream() -> list[str]:
            with open_stream(url, LONG, key=None) as response:
                events = []
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        streaming.set()
                return events

        with ThreadPoolExecutor(max_workers=2) as pool:
            streamed = pool.submit(stream)
            assert streaming.wait(timeout=60)
            whole = pool.submit(post, url, LONG, key=None)  # waits for the stream's rows
            assert health_when(url, lambda h: h["requests"] == 2)["requests"] == 2
            process.send_signal(signal.SIGTERM)
            response, events = whole.result(), streamed.result()
        assert response.status_code == 503, response.text[:300]
        assert "shutting down" in response.json()["error"]["message"]
        assert events[-1] == "data: [DONE]"
        assert "shutting down" in json.loads(events[-2][6:])["error"]["message"]
        assert process.wait(timeout=60) == 0
        stdout, stderr = output_after_exit(process)
        assert stdout == ""
        assert '"POST /v1/completions HTTP/1.1" 503' in stderr
        assert "Traceback" not in stderr and "Exception" not in stderr, stderr
    finally:
        stop_server(process)


def test_a_busy_port_is_an_error_before_loading(converted_pair):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        command = server_command(converted_pair, "--quiet")
        command[command.index("--port") + 1] = port
        run = subprocess.run(
            command, check=False, capture_output=True, text=True, timeout=120, cwd=ROOT
        )
    assert run.returncode == 1
    assert run.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}: "), run.stderr
    assert "Loading" not in run.stderr and len(run.stderr.splitlines()) == 1


def test_the_help_shows_the_defaults_and_describes_the_soak():
    server_help = subprocess.run(
        [sys.executable, str(ROOT / "server.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert re.search(
        r"--port PORT\s+port to listen on; 0: a free one \(default: 8080\)", server_help
    )
    load_help = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "load.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "see above" not in load_help and "--soak N" in load_help


def test_an_unknown_host_is_an_error_naming_it():
    from server import listening_socket

    with pytest.raises(OSError, match=r"^cannot listen on no-such-host\.invalid:8080: "):
        listening_socket("no-such-host.invalid", 8080)


def test_the_default_prompt_limit_bounds_what_a_prompt_costs_others():
    """By default a prompt may widen every row's cross-attention only up to
    the decoding step's other work (so the rows beside it keep about half
    their speed): the benchmark pair's main model's shape, 2,862 tokens; a
    small model's, never below COST_LIMIT_FLOOR."""
    from loading import COST_LIMIT_FLOOR, cost_token_limit
    from model import ModelArgs

    args = ModelArgs(3000, 256, 64, 8192, 8, 8, 16)
    limit = cost_token_limit(args)
    cross_attention = args.num_decoder_layers * 2 * args.num_heads * args.d_kv
    assert limit * cross_attention <= args.decode_work < (limit + 1) * cross_attention
    assert limit == 2862
    assert cost_token_limit(ModelArgs(200, 32, 8, 64, 2, 2, 4)) == COST_LIMIT_FLOOR


def test_auto_measures_a_servers_costs_at_each_power_of_two_and_its_largest_batch():
    from engine import cost_batch_sizes

    assert cost_batch_sizes(1) == [1]
    assert cost_batch_sizes(8) == [1, 2, 4, 8]
    assert cost_batch_sizes(12) == [1, 2, 4, 8, 12]
