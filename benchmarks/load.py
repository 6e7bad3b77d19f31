"""Load-test server.py: C concurrent clients sending streamed completions
from a prompt file, with speculation (auto) and without, and the library's
``speculative_decode_batch`` on the same prompts for comparison.

    python benchmarks/load.py --model-name benchmark_models/main \\
        --draft-model-name benchmark_models/draft --prompts benchmark_models/prompts-32.txt \\
        --concurrency 1,8 --requests 32 --max-tokens 48

For each mode and concurrency it starts the server (127.0.0.1, a free port),
sends ``--requests`` requests (or, with ``--duration``, requests for that
many seconds), ``--concurrency`` at a time, and reports generated tokens/s
over the wall time, p50/p95 latency, p50/p95 time to first token (the first
event with text), errors and the server's resident memory (sampled every few
seconds: after the first tenth of the run, its largest, at the end); then
stops it.

``--soak N`` instead sends N requests at the first concurrency to the
speculative server, mixed: greedy ones (streamed and not, some with a list
of two prompts), seeded sampled ones, clients that leave after their first
chunk, and bad requests that must get their 4xx. Every greedy choice must
equal the library's greedy text for its prompt, every response id must be
new, every request must get one answer; it reports what was lost,
duplicated or mismatched, and the memory.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from cli import ArgumentParser, full_float32

ROOT = Path(__file__).resolve().parents[1]


def start_server(args, regular: bool) -> tuple[subprocess.Popen, str]:
    """server.py with the pair, speculative (auto) or regular; (rank 0's
    process, URL). With ``--ranks N`` > 1, N processes on this machine,
    started as ``mlx.launch`` starts a ring (the others: ``process.ranks``)."""
    command = [sys.executable, str(ROOT / "server.py"), "--model-name", args.model_name]
    command += ["--draft-model-name", args.draft_model_name, "--num-draft", "auto"]
    command += ["--port", "0", "--quiet", "--max-batch-size", str(args.max_batch_size)]
    command += ["--regular-decode"] if regular else []
    ranks = [{}]
    if args.ranks > 1:
        hostfile = Path(tempfile.mkdtemp()) / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(args.ranks)]))
        ranks = [
            {"MLX_HOSTFILE": str(hostfile), "MLX_RANK": str(rank)} for rank in range(args.ranks)
        ]
    processes = [
        subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})
        for env in ranks
    ]
    process = processes[0]
    process.ranks = processes[1:]
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        found = re.search(r"on (http://\S+)", line)
        if found:
            # Keep reading standard error, so that the server never blocks on it.
            threading.Thread(target=process.stderr.read, daemon=True).start()
            return process, found.group(1)
        if not line and process.poll() is not None:
            break
    for started in processes:
        started.kill()
    raise RuntimeError("the server did not start")


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to rank 0, which stops every rank; wait for them all."""
    process.send_signal(signal.SIGTERM)
    for stopped in (process, *process.ranks):
        stopped.wait(timeout=120)


def free_ports(count: int) -> list[int]:
    """Ports of 127.0.0.1 that the system has just given out and taken back."""
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    """A streamed completion: latency, time to first token, tokens, error."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first, tokens = None, 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first is None and any(c["text"] for c in chunk["choices"]):
                    first = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as error:
        return {"error": type(error).__name__}
    return {"latency": time.perf_counter() - start, "ttft": first, "tokens": tokens, "error": None}


async def load(
    url: str,
    prompts: list[str],
    concurrency: int,
    requests: int,
    max_tokens: int,
    duration: float | None = None,
):
    """``requests`` requests (or as many as ``duration`` seconds take),
    ``concurrency`` at a time; (results, wall seconds)."""
    results = []
    counter = itertools.count()  # requests taken, by every worker
    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker():
            while True:
                i = next(counter)
                if duration is None and i >= requests:
                    return
                if duration is not None and time.perf_counter() - start >= duration:
                    return
                results.append(
                    await one_request(client, url, prompts[i % len(prompts)], max_tokens)
                )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


class MemorySampler:
    """The resident memory of process ``pid`` (Linux: /proc), every ``every`` seconds."""

    def __init__(self, pid: int, every: float = 5.0):
        self.path, self.every = Path(f"/proc/{pid}/status"), every
        self.samples: list[float] = []  # bytes
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self.sample()
            if self.stopped.wait(self.every):
                return

    def sample(self) -> None:
        try:
            found = re.search(r"VmRSS:\s+(\d+) kB", self.path.read_text())
        except OSError:  # the process has ended, or no /proc here
            return
        if found:
            self.samples.append(int(found.group(1)) * 1024)

    def summary(self) -> dict:
        """Resident GB after the first tenth of the run (warm-up), the
        largest, and the last; stops sampling."""
        self.stopped.set()
        self.thread.join()
        self.sample()
        if not self.samples:
            return {}
        after_warm_up = self.samples[len(self.samples) // 10 :]
        return {
            "rss_gb_warm": after_warm_up[0] / 1e9,
            "rss_gb_max": max(after_warm_up) / 1e9,
            "rss_gb_last": self.samples[-1] / 1e9,
            "rss_samples": len(self.samples),
        }


# (method, path, body, the status it must get): bad requests of the soak.
BAD_REQUESTS = [
    ("POST", "/v1/completions", b"{not json", 400),
    ("POST", "/v1/completions", b'{"prompt": 5}', 400),
    ("POST", "/v1/completions", b'{"prompt": "a", "max_tokens": -1}', 400),
    ("POST", "/v1/completions", b'{"prompt": " "}', 400),
    ("POST", "/v1/completions", b'{"prompt": []}', 400),
    ("POST", "/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400),
    ("POST", "/v1/nowhere", b"{}", 404),
    ("GET", "/v1/completions", b"", 405),
]


async def soak_request(client: httpx.AsyncClient, url: str, i: int, prompts, max_tokens) -> dict:
    """Request ``i`` of the soak; what came back: its kind, status, response
    id, and per choice index its text and how many finish reasons."""
    kind = ("stream",) * 4 + ("list", "whole", "sampled", "leave", "bad", "bad")
    kind = kind[i % 10]
    if kind == "bad":
        method, path, body, status = BAD_REQUESTS[i // 10 % len(BAD_REQUESTS)]
        response = await client.request(method, url + path, content=body)
        return {"kind": kind, "status": response.status_code, "expected_status": status}
    chosen = [prompts[i % len(prompts)]] + (
        [prompts[(i + 1) % len(prompts)]] if kind == "list" else []
    )
    body = {"prompt": chosen if kind == "list" else chosen[0], "max_tokens": max_tokens}
    if kind == "sampled":
        body |= {"temperature": 0.8, "seed": i}
    out = {"kind": kind, "prompts": chosen, "texts": {}, "finishes": Counter(), "ids": set()}
    if kind in ("list", "whole"):
        response = await client.post(url + "/v1/completions", json=body)
        out["status"] = response.status_code
        if response.status_code == 200:
            reply = response.json()
            out["ids"].add(reply["id"])
            for choice in reply["choices"]:
                out["texts"][choice["index"]] = choice["text"]
                out["finishes"][choice["index"]] += choice["finish_reason"] is not None
        return out
    async with client.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}
    ) as response:
        out["status"] = response.status_code
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                out["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                out["ids"].add(chunk.get("id"))
                for choice in chunk.get("choices", []):
                    index = choice["index"]
                    out["texts"][index] = out["texts"].get(index, "") + choice["text"]
                    out["finishes"][index] += choice["finish_reason"] is not None
                if kind == "leave":
                    break  # the client leaves after its first chunk
    return out


async def settled_health(client: httpx.AsyncClient, url: str, timeout: float) -> dict:
    """The server's /health once no row is active or waiting, or as it is
    after ``timeout`` seconds. The server learns that a client left when it
    next writes to it, and frees the row in the round after: a moment after
    the client is gone, not at once."""
    deadline = time.perf_counter() + timeout
    while True:
        health = (await client.get(url + "/health")).json()
        if health["active"] == health["waiting"] == 0 or time.perf_counter() > deadline:
            return health
        await asyncio.sleep(0.05)


async def soak(
    url: str,
    prompts: list[str],
    expected: dict[str, str],
    count: int,
    concurrency: int,
    max_tokens: int,
    request_timeout: float,
) -> dict:
    """``count`` requests of the soak, ``concurrency`` at a time; the tally.
    A request unanswered after ``request_timeout`` seconds counts as lost."""
    tally = Counter()
    seen_ids: set[str] = set()
    counter = itertools.count()
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker():
            while (i := next(counter)) < count:
                try:
                    out = await asyncio.wait_for(
                        soak_request(client, url, i, prompts, max_tokens), request_timeout
                    )
                except (httpx.HTTPError, TimeoutError) as error:
                    tally[f"lost ({type(error).__name__})"] += 1
                    continue
                tally[out["kind"]] += 1
                if out["kind"] == "bad":
                    tally["bad with the wrong status"] += out["status"] != out["expected_status"]
                    continue
                if out["status"] != 200:
                    tally[f"lost (HTTP {out['status']})"] += 1
                    continue
                tally["duplicated"] += len(out["ids"] & seen_ids) + (len(out["ids"]) != 1)
                seen_ids.update(out["ids"])
                if out["kind"] == "leave":
                    continue
                choices = range(len(out["prompts"]))
                if out["kind"] == "stream" or out["kind"] == "sampled":
                    tally["lost"] += not out.get("done")
                tally["lost"] += any(out["finishes"][c] == 0 for c in choices)
                tally["duplicated"] += any(out["finishes"][c] > 1 for c in choices)
                if out["kind"] != "sampled":
                    tally["mismatched"] += any(
                        out["texts"].get(c) != expected[p] for c, p in zip(choices, out["prompts"])
                    )

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        health = await settled_health(client, url, request_timeout)
    for name in ("lost", "duplicated", "mismatched", "bad with the wrong status"):
        tally.setdefault(name, 0)
    return {**tally, "health": health}


def percentile(values: list[float], q: float) -> float:
    return (
        statistics.quantiles(values, n=100, method="inclusive")[q - 1]
        if len(values) > 1
        else values[0]
    )


def summarize(mode: str, concurrency: int, results: list[dict], seconds: float) -> dict:
    good = [r for r in results if r.get("error") is None]
    latencies = [r["latency"] for r in good]
    ttfts = [r["ttft"] for r in good if r["ttft"] is not None]
    return {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(good),
        "tokens_per_s": sum(r["tokens"] for r in good) / seconds,
        "p50_latency": percentile(latencies, 50),
        "p95_latency": percentile(latencies, 95),
        "p50_ttft": percentile(ttfts, 50),
        "p95_ttft": percentile(ttfts, 95),
    }


def library_decoder(args):
    """The pair's decoder in this process, "auto" as the server runs it."""
    full_float32()  # as the server does, before MLX starts
    import cpu  # noqa: F401  # isort: skip

    from decoder import SpeculativeDecoder
    from loading import load_model, load_tokenizer

    return SpeculativeDecoder(
        load_model(args.model_name),
        load_model(args.draft_model_name),
        load_tokenizer(args.model_name),
        "auto",
    )


def library_batch(args, prompts: list[str], requests: int) -> float:
    """Generated tokens/s of ``speculative_decode_batch`` at --max-batch-size
    on the same requests, in this process (after one warm-up call)."""
    decoder = library_decoder(args)
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    options = {"batch_size": args.max_batch_size, "max_tokens": args.max_tokens}
    decoder.speculative_decode_batch(batch[: args.max_batch_size], **options)
    start = time.perf_counter()
    results = decoder.speculative_decode_batch(batch, **options)
    return sum(len(r.tokens) for r in results) / (time.perf_counter() - start)


def run_soak(args, prompts: list[str]) -> int:
    """The soak against the speculative server; 1 when anything went wrong."""
    decoder = library_decoder(args)
    greedy = decoder.generate_batch(
        prompts, batch_size=args.max_batch_size, max_tokens=args.max_tokens
    )
    expected = {prompt: result.text for prompt, result in zip(prompts, greedy)}
    del decoder
    concurrency = int(args.concurrency.split(",")[0])
    process, url = start_server(args, regular=False)
    memory = MemorySampler(process.pid)
    try:
        start = time.perf_counter()
        report = asyncio.run(
            soak(
                url,
                prompts,
                expected,
                args.soak,
                concurrency,
                args.max_tokens,
                args.request_timeout,
            )
        )
        report |= {"seconds": time.perf_counter() - start, "concurrency": concurrency}
        report |= memory.summary()
    finally:
        stop_server(process)
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    failed = report["lost"] + report["duplicated"] + report["mismatched"]
    failed += (
        report["bad with the wrong status"]
        + report["health"]["active"]
        + report["health"]["waiting"]
    )
    return 1 if failed or any(name.startswith("lost (") for name in report) else 0


def main() -> int:
    parser = ArgumentParser(description="Load-test server.py with concurrent clients.")
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--draft-model-name", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="one prompt per line")
    parser.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument(
        "--duration", type=float, help="seconds per run, instead of --requests requests"
    )
    parser.add_argument(
        "--modes", default="speculative,regular", help="comma-separated: speculative, regular"
    )
    parser.add_argument(
        "--soak",
        type=int,
        metavar="N",
        help="instead, N mixed requests to the speculative server (greedy streamed and whole, "
        "lists of prompts, seeded sampled, clients that leave, bad requests), every answer "
        "checked",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=120, help="soak: seconds before a request is lost"
    )
    parser.add_argument(
        "--ranks",
        type=int,
        default=1,
        help="serve from this many processes on this machine, the main model split across "
        "them (a group, as mlx.launch starts one; memory: rank 0's)",
    )
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    if args.soak:
        return run_soak(args, prompts)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for mode in args.modes.split(","):
        name = {"speculative": "speculative auto", "regular": "regular"}[mode]
        process, url = start_server(args, regular=mode == "regular")
        try:
            asyncio.run(load(url, prompts, 1, min(4, args.requests), args.max_tokens))  # warm-up
            for concurrency in levels:
                memory = MemorySampler(process.pid)
                results, seconds = asyncio.run(
                    load(url, prompts, concurrency, args.requests, args.max_tokens, args.duration)
                )
                rows.append(summarize(name, concurrency, results, seconds) | memory.summary())
                print(json.dumps(rows[-1]), flush=True)
        finally:
            stop_server(process)
    # The library at the same batch size, on the same requests (not for timed runs).
    library = None if args.duration else library_batch(args, prompts, args.requests)
    print(
        "| mode | C | requests | errors | tokens/s | p50 / p95 latency (s) "
        "| p50 / p95 first token (s) | resident GB: warm / max / last |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        memory = " / ".join(f"{r[k]:.2f}" for k in ("rss_gb_warm", "rss_gb_max", "rss_gb_last"))
        print(
            f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
            f"{r['tokens_per_s']:.1f} | {r['p50_latency']:.2f} / {r['p95_latency']:.2f} | "
            f"{r['p50_ttft']:.2f} / {r['p95_ttft']:.2f} | {memory} |"
        )
    if library is not None:
        print(
            f"| speculative_decode_batch, B = {args.max_batch_size} | | {args.requests} | | "
            f"{library:.1f} | | | |"
        )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "library_tokens_per_s": library}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
