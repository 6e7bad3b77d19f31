"""Load-test server.py: C concurrent clients sending streamed completions
from a prompt file, with speculation (auto) and without, and the library's
``speculative_decode_batch`` on the same prompts for comparison.

    python benchmarks/load.py --model-name benchmark_models/main \\
        --draft-model-name benchmark_models/draft --prompts benchmark_models/prompts-32.txt \\
        --concurrency 1,8 --requests 32 --max-tokens 48

For each mode and concurrency it starts the server (127.0.0.1, a free port),
sends ``--requests`` requests, ``--concurrency`` at a time, and reports
generated tokens/s over the wall time, p50/p95 latency, p50/p95 time to
first token (the first event with text) and errors; then stops it.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from cli import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]


def start_server(args, regular: bool) -> tuple[subprocess.Popen, str]:
    """server.py with the pair, speculative (auto) or regular; (process, URL)."""
    command = [sys.executable, str(ROOT / "server.py"), "--model-name", args.model_name]
    command += ["--draft-model-name", args.draft_model_name, "--num-draft", "auto"]
    command += ["--port", "0", "--quiet", "--max-batch-size", str(args.max_batch_size)]
    command += ["--regular-decode"] if regular else []
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = process.stderr.readline()
        found = re.search(r"on (http://\S+)", line)
        if found:
            return process, found.group(1)
        if not line and process.poll() is not None:
            break
    process.kill()
    raise RuntimeError("the server did not start")


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


async def load(url: str, prompts: list[str], concurrency: int, requests: int, max_tokens: int):
    """``requests`` requests, ``concurrency`` at a time; (results, wall seconds)."""
    queue = [prompts[i % len(prompts)] for i in range(requests)]
    results = []
    async with httpx.AsyncClient(timeout=600) as client:

        async def worker():
            while queue:
                results.append(await one_request(client, url, queue.pop(), max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results, time.perf_counter() - start


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


def library_batch(args, prompts: list[str], requests: int) -> float:
    """Generated tokens/s of ``speculative_decode_batch`` at --max-batch-size
    on the same requests, in this process (after one warm-up call)."""
    import blas  # noqa: F401  # isort: skip

    from decoder import SpeculativeDecoder, load_tokenizer
    from model import load_model

    decoder = SpeculativeDecoder(
        load_model(args.model_name),
        load_model(args.draft_model_name),
        load_tokenizer(args.model_name),
        "auto",
    )
    batch = [prompts[i % len(prompts)] for i in range(requests)]
    options = {"batch_size": args.max_batch_size, "max_tokens": args.max_tokens}
    decoder.speculative_decode_batch(batch[: args.max_batch_size], **options)
    start = time.perf_counter()
    results = decoder.speculative_decode_batch(batch, **options)
    return sum(len(r.tokens) for r in results) / (time.perf_counter() - start)


def main() -> int:
    parser = ArgumentParser(description="Load-test server.py with concurrent clients.")
    parser.add_argument("--model-name", required=True)
    parser.add_argument("--draft-model-name", required=True)
    parser.add_argument("--prompts", type=Path, required=True, help="one prompt per line")
    parser.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated")
    parser.add_argument("--requests", type=int, default=32, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    prompts = [line for line in args.prompts.read_text().splitlines() if line.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    rows = []
    for mode in ("speculative auto", "regular"):
        process, url = start_server(args, regular=mode == "regular")
        try:
            asyncio.run(load(url, prompts, 1, min(4, args.requests), args.max_tokens))  # warm-up
            for concurrency in levels:
                results, seconds = asyncio.run(
                    load(url, prompts, concurrency, args.requests, args.max_tokens)
                )
                rows.append(summarize(mode, concurrency, results, seconds))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=120)
    library = library_batch(args, prompts, args.requests)
    print(
        json.dumps(
            {"mode": "library batch", "batch_size": args.max_batch_size, "tokens_per_s": library}
        )
    )
    print(
        "| mode | C | requests | errors | tokens/s | p50 / p95 latency (s) | p50 / p95 first token (s) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['errors']} | "
            f"{r['tokens_per_s']:.1f} | {r['p50_latency']:.2f} / {r['p95_latency']:.2f} | "
            f"{r['p50_ttft']:.2f} / {r['p95_ttft']:.2f} |"
        )
    print(
        f"| speculative_decode_batch, B = {args.max_batch_size} | | {args.requests} | | {library:.1f} | | |"
    )
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "library_tokens_per_s": library}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
