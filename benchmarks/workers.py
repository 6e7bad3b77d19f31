"""The line protocol between the benchmarks and the peers they time in processes of their own.

A worker (``transformers_worker.py``, ``ctranslate2_worker.py``) loads its model, warms it
up and prints one JSON line (``ready``, with what the driver should know: the threads it
computes on, ...); then it answers every JSON line of standard input with one JSON line.
The driver side is ``Worker``. Nothing here imports mlx, ``blas`` or torch: a worker must
never share the OpenBLAS that ``blas.py`` loads for MLX (see ``transformers_worker.py``).

Batch requests (``serve_batches``) are ``{"prompts": [...], "batch_size": B,
"max_tokens": N}``, with ``"num_beams"`` for beam search (else 1, greedy); the answer is ``{"seconds": wall clock of the whole call, tokenizing
included, "tokens": [generated ids per prompt, in input order]}``, each without the start
token and cut at end-of-sequence, the way the decoder counts its tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Self


def cut_at_eos(tokens: Sequence[int], eos: int) -> list[int]:
    """``tokens`` up to, not including, the first end-of-sequence token."""
    tokens = list(tokens)
    return tokens[: tokens.index(eos)] if eos in tokens else tokens


def send(message: dict) -> None:
    """One JSON line on standard output, flushed: the driver waits for it."""
    print(json.dumps(message), flush=True)


def serve_batches(
    generate: Callable[[list[str], int, int, int], list[list[int]]], eos: int, ready: dict
) -> None:
    """Announce ``ready``, then answer each batch request on standard input:
    ``generate(prompts, batch_size, max_tokens, num_beams)`` returns the
    generated ids per prompt (the best hypothesis's with beams; they are cut
    at ``eos`` here), timed as a whole."""
    send({"ready": True, **ready})
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        outputs = generate(
            request["prompts"],
            request["batch_size"],
            request["max_tokens"],
            request.get("num_beams", 1),
        )
        seconds = time.perf_counter() - start
        send({"seconds": seconds, "tokens": [cut_at_eos(tokens, eos) for tokens in outputs]})


class Worker:
    """A worker process running ``script`` (a file beside this one), driven one
    request at a time. ``ready`` holds its first line; use it as a context
    manager, so that it is always ended."""

    def __init__(self, script: str, *arguments):
        path = Path(__file__).with_name(script)
        self.process = subprocess.Popen(
            [sys.executable, str(path), *map(str, arguments)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.name = script
        try:
            self.ready = self._answer()
        except BaseException:
            self.close()
            raise

    def _answer(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} ended early (its error is above)")
        return json.loads(line)

    def ask(self, request) -> dict:
        """Send ``request`` (anything JSON can encode) and wait for the answer."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        """Close its input, which ends it, and wait for it."""
        if self.process.stdin and not self.process.stdin.closed:
            try:
                self.process.stdin.close()
            except BrokenPipeError:
                pass
        self.process.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
