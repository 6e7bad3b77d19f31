"""Data parallel: the prompts of a file spread over a group of processes
(``main.py --prompts FILE --data-parallel``, started by ``mlx.launch``),
each holding both models whole and decoding its share round by round with
the Python API; after every round the processes sum what finished, so
that rank 0 writes every prompt's result. docs/distributed.md tells how to
run it; ``distributed.py`` starts and ends the group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

# First: the fast BLAS on Linux must load before mlx (see cpu/__init__.py).
import cpu  # noqa: F401  # isort: skip
import mlx.core as mx

from decoder import SpeculativeDecoder
from speculative import GenerationResult, Options


def balanced_shares(costs: Sequence[float], ranks: int) -> list[list[int]]:
    """The indices of the prompts each of ``ranks`` decodes, given each
    prompt's ``costs``: the costliest first, each to the rank with the least
    so far (ties to the lowest rank); each share in input order."""
    shares = [[] for _ in range(ranks)]
    loads = [0.0] * ranks
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        rank = loads.index(min(loads))
        shares[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(share) for share in shares]


# What data_parallel_stream sums of each finished result, as numbers: its
# index, its token and round counts, these, its times, then its tokens and
# its draft lengths, each padded to max_tokens + 1.
RESULT_COUNTS = (
    "n_draft",
    "n_accepted",
    "n_rejected",
    "n_steps",
    "n_lookup_rounds",
    "prompt_tokens",
)
RESULT_TIMES = ("prompt_time", "calibration_time", "elapsed")
# A seed (below 2**64) travels as 16-bit pieces, which float32 holds exactly.
SEED_PIECES = 4
RESULT_HEADER = 3 + len(RESULT_COUNTS) + len(RESULT_TIMES) + SEED_PIECES


def data_parallel_stream(
    decoder: SpeculativeDecoder,
    prompts: Sequence[str],
    options: Options,
    group: mx.distributed.Group,
    *,
    speculative: bool = True,
    batch_size: int = 8,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[int, GenerationResult]]:
    """``decoder.stream_batch`` over ranks that each hold both models whole:
    each rank decodes a share of ``prompts`` (``balanced_shares``, a
    prompt's cost its tokens plus ``max_tokens``) round by round
    (``decoder.stream_rounds``), and after every round the ranks sum what
    finished in it, so that rank 0 yields ``(index, result)`` for every
    prompt of every rank as it finishes (the others yield nothing). The
    ranks run their rounds in step, so a rank that fails ends the others
    within a round."""
    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(decoder.prompt_ids(prompt))
        except (TypeError, ValueError) as error:
            raise type(error)(f"prompt {i}: {error}") from None
    rank, ranks = group.rank(), group.size()
    share = balanced_shares([len(i) + options.max_tokens for i in ids], ranks)[rank]
    rounds = iter(())
    if share:
        rounds = decoder.stream_rounds(
            [ids[i] for i in share],
            options,
            speculative=speculative,
            batch_size=batch_size,
            prompt_progress=prompt_progress,
        )
    # A round finishes at most max_tokens tokens, and at most one round more.
    room = options.max_tokens + 1
    running = True
    while True:
        events = next(rounds, None) if running else None
        running = events is not None
        finished = [(share[i], result) for i, result in events or [] if result.finished]
        counts = mx.zeros((2, ranks), mx.int32)
        counts[:, rank] = mx.array([len(finished), running])
        counts = mx.distributed.all_sum(counts, group=group, stream=mx.cpu).tolist()
        if sum(counts[0]):
            rows = mx.zeros((sum(counts[0]), RESULT_HEADER + 2 * room), mx.float32)
            if finished:
                start = sum(counts[0][:rank])
                rows[start : start + len(finished)] = mx.array(
                    [packed(i, result, room) for i, result in finished]
                )
            rows = mx.distributed.all_sum(rows, group=group, stream=mx.cpu).tolist()
            if rank == 0:
                for row in rows:
                    yield unpacked(row, room, decoder.tokenizer)
        if not any(counts[1]):
            return


def packed(index: int, result: GenerationResult, room: int) -> list[float]:
    """A finished result as numbers (see RESULT_COUNTS), its tokens and
    draft lengths each padded to ``room``."""
    header = [index, len(result.tokens), len(result.draft_lengths)]
    header += [getattr(result, name) for name in RESULT_COUNTS + RESULT_TIMES]
    header += [result.seed >> (16 * piece) & 0xFFFF for piece in range(SEED_PIECES)]
    padded = [
        list(values) + [0] * (room - len(values))
        for values in (result.tokens, result.draft_lengths)
    ]
    return header + padded[0] + padded[1]


def unpacked(row: list[float], room: int, tokenizer) -> tuple[int, GenerationResult]:
    """``(index, result)`` from a row of ``packed``; its text decoded by ``tokenizer``."""
    index, num_tokens, num_rounds = map(int, row[:3])
    counts = dict(zip(RESULT_COUNTS, map(int, row[3 : 3 + len(RESULT_COUNTS)])))
    times_end = 3 + len(RESULT_COUNTS) + len(RESULT_TIMES)
    times = dict(zip(RESULT_TIMES, row[3 + len(RESULT_COUNTS) : times_end]))
    pieces = row[times_end:RESULT_HEADER]
    seed = sum(int(piece) << (16 * index) for index, piece in enumerate(pieces))
    tokens = [int(token) for token in row[RESULT_HEADER : RESULT_HEADER + num_tokens]]
    lengths = row[RESULT_HEADER + room : RESULT_HEADER + room + num_rounds]
    result = GenerationResult(
        tokens,
        text=tokenizer.decode(tokens, skip_special_tokens=True),
        draft_lengths=[int(length) for length in lengths],
        finished=True,
        seed=seed,
        **counts,
        **times,
    )
    return index, result
