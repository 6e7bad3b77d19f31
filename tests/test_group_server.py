"""server.py in a group of 2 ranks on this machine (the ring backend,
started as ``mlx.launch`` starts them): rank 0 answers HTTP on a free port
of 127.0.0.1, the main model split across both; every request's text is a
single-process server's; a client that leaves, a bad request, a killed rank
and SIGTERM. Every group and server is bounded in time and always stopped."""

from __future__ import annotations

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_batch import PROMPTS
from test_distributed import FAILURE_SECONDS, finish, start_group, stop
from test_server import (
    MAX_NEW,
    TIMEOUT,
    health_when,
    leave_mid_stream,
    listening_url,
    open_stream,
    output_after_exit,
    post,
    server_command,
    sigterm_while_decoding,
    start_server,
    stop_server,
    stream_texts,
)

# The servers' options: auto's draft lengths, unless a rank is given its own.
OPTIONS = ("--max-prompt-tokens", "1000", "--quiet")
AUTO = ("--num-draft", "auto")


def start_group_server(converted_pair, tmp_path, *rank_options: tuple) -> tuple[list, str]:
    """server.py as 2 ranks, each with its ``rank_options`` (default: auto);
    (processes, rank 0's base URL) once it listens."""
    # start_group adds the interpreter.
    commands = [
        server_command(converted_pair, *OPTIONS, *options)[1:]
        for options in rank_options or (AUTO, AUTO)
    ]
    processes = start_group(commands, tmp_path)
    try:
        return processes, listening_url(processes[0])
    except BaseException:
        stop(processes)
        raise


def request_texts(url: str, request: tuple[dict, bool]) -> list[str]:
    body, streaming = request
    if streaming:
        return stream_texts(url, body)
    response = post(url, body, key=None)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in response.json()["choices"]]


def mixed_requests() -> list[tuple[dict, bool]]:
    """16 requests: greedy and seeded at two temperatures, streamed and
    whole, 4 to 16 tokens, one with a list of prompts."""
    requests = []
    for i in range(16):
        body = {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 4 + i % 4 * 4}
        if i % 3:
            body.update(temperature=0.6 + 0.3 * (i % 2), seed=100 + i)
        if i == 5:
            body["prompt"] = [PROMPTS[1], PROMPTS[4]]
        requests.append((body, i % 2 == 0))
    return requests


@pytest.fixture(scope="module")
def group_server(converted_pair, tmp_path_factory):
    """2 ranks whose own draft lengths differ, as ranks whose timings differ
    would plan others: every rank must take rank 0's."""
    tmp_path = tmp_path_factory.mktemp("group")
    ranks = (("--num-draft", "2"), ("--num-draft", "4"))
    processes, url = start_group_server(converted_pair, tmp_path, *ranks)
    yield url
    stop(processes)


def test_a_group_serves_a_single_processs_texts(group_server, converted_pair):
    """16 concurrent mixed requests get, from the group, the texts a single
    process serves them; /health names the group and each rank."""
    process, single = start_server(converted_pair, *OPTIONS, *AUTO, key=None)
    try:
        requests = mixed_requests()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            grouped = list(pool.map(lambda r: request_texts(group_server, r), requests))
        alone = [request_texts(single, request) for request in requests]
    finally:
        stop_server(process)
    assert grouped == alone
    assert len({text for texts in alone for text in texts}) > 8  # they differ: a real check
    # Unseeded, the group draws one seed for all its ranks: the seed it names repeats the text.
    unseeded = {"prompt": PROMPTS[3], "max_tokens": MAX_NEW, "temperature": 1.0}
    drawn = post(group_server, unseeded, key=None).json()["choices"][0]
    seeded = post(group_server, {**unseeded, "seed": drawn["seed"]}, key=None).json()
    assert seeded["choices"][0]["text"] == drawn["text"]
    health = httpx.get(group_server + "/health", timeout=TIMEOUT).json()
    assert health["completed"] == len(requests) + 2 and health["active"] == 0
    assert health["group"]["size"] == 2
    assert [rank["state"] for rank in health["group"]["ranks"]] == ["serving", "following"]
    assert all(rank["memory"] > 0 for rank in health["group"]["ranks"])


def test_a_client_that_leaves_and_a_bad_request_leave_the_group_serving(
    group_server, decoding_pair
):
    from decoder import SpeculativeDecoder

    before, health = leave_mid_stream(group_server, key=None)
    assert health["cancelled"] == before["cancelled"] + 1 and health["active"] == 0
    malformed = post(group_server, '{"prompt": "hi", ', key=None)
    assert malformed.status_code == 400 and malformed.json()["error"]["message"]
    unknown = post(group_server, {"prompt": "hi", "colour": "red"}, key=None)
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "colour"
    too_long = post(group_server, {"prompt": PROMPTS[2] * 8}, key=None)
    assert too_long.status_code == 400 and "1000" in too_long.json()["error"]["message"]
    expected = SpeculativeDecoder(*decoding_pair).generate(PROMPTS[0], max_tokens=MAX_NEW).text
    good = post(group_server, {"prompt": PROMPTS[0], "max_tokens": MAX_NEW}, key=None)
    assert good.json()["choices"][0]["text"] == expected


def events_until_done(response) -> list[str]:
    return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_a_killed_rank_ends_the_group_answering_every_request(converted_pair, tmp_path):
    """Rank 1 killed mid-stream: the stream gets an error event and [DONE],
    a waiting request a 503, and rank 0 ends within seconds, non-zero, with
    one line naming rank 1."""
    processes, url = start_group_server(converted_pair, tmp_path)
    try:
        long = {"prompt": [PROMPTS[2]] * 4, "max_tokens": 512, "stop": "zzzz-never"}
        with ThreadPoolExecutor(max_workers=1) as pool:
            with open_stream(url, long, key=None) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                waiting = pool.submit(post, url, long, key=None)
                assert health_when(url, lambda health: health["running"] == 2)["running"] == 2
                processes[1].send_signal(signal.SIGKILL)
                killed = time.monotonic()
                rest = [line for line in lines if line.startswith("data: ")]
            answer = waiting.result()
        status = processes[0].wait(timeout=FAILURE_SECONDS)
        assert time.monotonic() - killed < FAILURE_SECONDS
    finally:
        stop(processes)
    assert "error" not in json.loads(first[6:])
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == 503 or "group" in error["message"]
    assert answer.status_code == 503 and "group failed" in answer.json()["error"]["message"]
    assert status == 1
    _, stderr = output_after_exit(processes[0])
    assert stderr.strip().splitlines()[-1].startswith("error: rank 1 of 2 ended or failed")


def test_sigterm_to_rank_zero_ends_the_group_cleanly(converted_pair, decoding_pair, tmp_path):
    """SIGTERM to rank 0: the running request finishes, then both ranks end
    with status 0; rank 1 has written nothing at all."""
    from decoder import SpeculativeDecoder

    processes, url = start_group_server(converted_pair, tmp_path)
    try:
        expected = SpeculativeDecoder(*decoding_pair).generate(PROMPTS[2], max_tokens=40).text
        sigterm_while_decoding(url, processes[0], expected)
        assert processes[0].wait(timeout=60) == 0
        follower = finish(processes[1:], FAILURE_SECONDS)[0]
    finally:
        stop(processes)
    assert follower.returncode == 0
    assert follower.stdout == follower.stderr == ""
    assert output_after_exit(processes[0])[0] == ""


def test_the_server_counts_a_ranks_share_of_memory(converted_pair, monkeypatch):
    """In a group of 2, the server's memory check and its prompt limit count
    half the main model: with memory for a batch of 8 at 20 prompt tokens
    alone, the split model's limit is longer."""
    import loading
    import server

    paths = list(converted_pair)
    weights, rows = loading.held_bytes(paths, 20, 16)
    monkeypatch.setattr(loading, "available_memory", lambda: int(sum(weights) + 8 * sum(rows)))
    monkeypatch.setattr(loading, "cost_token_limit", lambda args: 1 << 20)
    alone = loading.prompt_token_limit(paths, 16, 8)
    assert alone == 20
    loaded = {}
    monkeypatch.setattr(loading, "load_checked", lambda *args, **kwargs: loaded.update(kwargs))

    class Pair:  # what load_decoder reads of a group
        def size(self):
            return 2

    args = server.build_parser().parse_args(
        [
            "--model-name",
            str(paths[0]),
            "--draft-model-name",
            str(paths[1]),
            "--max-tokens-limit",
            "16",
        ]
    )
    _, limit = server.load_decoder(args, Pair())
    assert limit > alone and loaded["prompt_tokens"] == limit and isinstance(loaded["group"], Pair)
