"""Several processes on MLX's distributed layer (``mx.distributed``): the
main model split across them (tensor parallel, the default in a group), or a
file of prompts spread over them (data parallel, ``main.py --data-parallel``).

A group is what ``mlx.launch`` starts: N processes (ranks), on one machine
or several, each running the same command. In tensor parallel, every
attention's heads and every feed-forward block's hidden units are split
across the ranks with MLX's sharded layers (``mlx.nn.layers.distributed``):
each rank holds 1/N of them and computes its share of every product, and
one sum across the ranks (``all_sum``) per block (the attention's output
projection, the feed-forward's) gives every rank the whole result. The
embedding, the norms, the output projection and the draft model are whole
on every rank, which computes them alike.

So the ranks must take every decision alike: those that depend on timing
(auto's draft length, the CPU's product forms) are rank 0's, shared with a
sum in which every other rank adds 0 (``rank_zero_value``). Only rank 0
writes (``silence_other_ranks``), and a rank that fails ends the group
(``failures_end_group``). docs/distributed.md tells how to run it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

    from decoder import GenerationResult, SpeculativeDecoder
    from drafting import DraftLength
    from model import T5, ModelArgs

# Environment variables that mark a process started in a group: mlx.launch
# sets MLX_RANK (ring and JACCL backends), mpirun OMPI_COMM_WORLD_SIZE,
# mlx.launch's NCCL backend MLX_WORLD_SIZE. Without them no group is
# formed, and nothing imports mlx before the arguments are checked.
GROUP_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "MLX_WORLD_SIZE")
# Seconds the ranks wait for each other to connect: the ring backend waits
# forever for a rank that never starts (one that failed before connecting).
CONNECT_SECONDS = 60.0


def launched_in_group() -> bool:
    """Whether this process was started as one rank of a group."""
    return any(name in os.environ for name in GROUP_VARIABLES)


def init_group() -> mx.distributed.Group | None:
    """The group this process is a rank of, connected; None when it was
    started alone (or in a group of one). A rank that cannot connect to the
    others within ``CONNECT_SECONDS`` ends with a one-line error."""
    if not launched_in_group():
        return None
    import cpu  # noqa: F401  # isort: skip  (on Linux, the BLAS MLX must load first)
    import mlx.core as mx

    def give_up() -> None:
        print(
            f"error: the group's processes did not all connect within {CONNECT_SECONDS:.0f} s "
            "(one failed to start, or a host or port is unreachable)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    watchdog = threading.Timer(CONNECT_SECONDS, give_up)
    watchdog.daemon = True
    watchdog.start()
    try:
        group = mx.distributed.init()
    finally:
        watchdog.cancel()
    return group if group.size() > 1 else None


def rank_zero_value(value: int, group: mx.distributed.Group) -> int:
    """Rank 0's ``value`` (an integer), on every rank: the sum of rank 0's
    and every other rank's 0."""
    import mlx.core as mx

    mine = mx.array(value if group.rank() == 0 else 0, dtype=mx.int32)
    return mx.distributed.all_sum(mine, group=group, stream=mx.cpu).item()


def rank_zero_seed(seed: int, group: mx.distributed.Group) -> int:
    """Rank 0's ``seed`` (below 2**62, as ``sampling.draw_seed`` draws), on
    every rank: a seed drawn on each rank would give each other noise."""
    high, low = seed >> 31, seed & (2**31 - 1)
    return rank_zero_value(high, group) << 31 | rank_zero_value(low, group)


# What failures_end_group writes a rank's errors to: the standard error
# it started with (silence_other_ranks silences the rest).
_error_file = sys.stderr


def silence_other_ranks(group: mx.distributed.Group | None) -> None:
    """On every rank but 0, send standard output and standard error
    (Python's and MLX's own) to the null device: rank 0 writes the texts,
    the notes and the summary; the others only their errors."""
    global _error_file
    if group is None or group.rank() == 0:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    _error_file = os.fdopen(os.dup(sys.stderr.fileno()), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    for stream in (sys.stdout, sys.stderr):
        os.dup2(null, stream.fileno())
    os.close(null)


# What a rank says when another one ended while it waited on their sum.
GROUP_BROKEN = "another process of the group ended or failed (see its error); this one stops too"


class Terminated(KeyboardInterrupt):
    """SIGTERM reached a rank: ``mlx.launch`` sends it to every rank once
    one has ended with an error (or a user did). A ``KeyboardInterrupt``,
    so that what Ctrl-C stops (a summary of what finished) SIGTERM stops
    alike."""


def raise_terminated(signum: int, frame) -> None:
    raise Terminated(
        "stopped by SIGTERM (sent by a user, or by mlx.launch once another process of the "
        "group has ended)"
    )


@contextlib.contextmanager
def failures_end_group(group: mx.distributed.Group | None) -> Iterator[None]:
    """In a group, end this process at once when what runs inside fails or
    SIGTERM stops it (``Terminated``): one line on the standard error it
    started with (``error: ...``, the rank named where it is not 0), exit
    status 1. The other ranks then find the connection to it closed at
    their next sum, and end alike (``GROUP_BROKEN``), instead of waiting
    forever for it. Outside a group, nothing."""
    if group is None:
        yield
        return
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - any failure ends the group
        reason = " ".join(str(error).split()) or type(error).__name__
        if "connection to a peer was lost" in reason:  # the ring backend's words
            reason = f"{GROUP_BROKEN} ({reason})"
        rank = f"rank {group.rank()} of {group.size()}: " if group.rank() else ""
        with contextlib.suppress(OSError):  # a reader of standard output that left
            sys.stdout.flush()
        print(f"error: {rank}{reason}", file=_error_file, flush=True)
        os._exit(1)


# --- Tensor parallel: the main model split across the ranks ------------------


def shard_model(model: T5, group: mx.distributed.Group) -> None:
    """Split ``model``'s attention heads and feed-forward hidden units
    across ``group``, in place, keeping this rank's share: the query, key
    and value projections and the feed-forward input projections by output
    rows (``AllToShardedLinear``; a self-attention's stacked ``qkv_proj``
    as three segments), the attention and feed-forward output projections
    by input columns, summed across the ranks (``ShardedToAllLinear``), and
    the position bias tables by head. Each layer is computed once split, so
    that a model loaded lazily (``mx.load``) is read one layer at a time and
    never held whole. ``ValueError`` when the heads, the feed-forward width
    or a quantized layer's groups do not divide among the ranks."""
    import mlx.core as mx
    from mlx.nn.layers.distributed import shard_inplace, shard_linear

    from model import Attention, CrossAttention, DecoderLayer, FeedForward, SelfAttention

    check_divisible(model.args, group.size())

    def split(module, name: str, sharding: str, segments: int = 1) -> None:
        setattr(
            module,
            name,
            shard_linear(getattr(module, name), sharding, segments=segments, group=group),
        )

    for stack in (model.encoder, model.decoder):
        shard_inplace(stack.position_bias, lambda path, weight: -1, group=group)
        mx.eval(stack.position_bias.parameters())
        for layer in stack.layers:
            for module in layer.modules():
                if isinstance(module, SelfAttention):
                    split(module, "qkv_proj", "all-to-sharded", segments=3)
                elif isinstance(module, CrossAttention):
                    for name in ("query_proj", "key_proj", "value_proj"):
                        split(module, name, "all-to-sharded")
                elif isinstance(module, FeedForward):
                    for name in ("wi_0", "wi_1") if module.gated else ("wi",):
                        split(module, name, "all-to-sharded")
                    split(module, "wo", "sharded-to-all")
                if isinstance(module, Attention):
                    split(module, "out_proj", "sharded-to-all")
                    module.num_heads //= group.size()
            if isinstance(layer, DecoderLayer):
                # A sum across ranks has no shapeless form (mx.compile).
                layer.compile_rows(shapeless=False)
            mx.eval(layer.parameters())


def check_divisible(args: ModelArgs, ranks: int, name: str = "the main model") -> None:
    """``ValueError`` unless a model of ``args`` splits evenly across
    ``ranks``: its heads, its feed-forward width and, quantized, the groups
    of its layers split by input columns (each rank's columns whole groups)."""
    cannot = f"cannot split {name} across {ranks} processes"
    if args.num_heads % ranks:
        raise ValueError(f"{cannot}: its {args.num_heads} attention heads do not divide by {ranks}")
    if args.d_ff % ranks:
        raise ValueError(f"{cannot}: its feed-forward width {args.d_ff} does not divide by {ranks}")
    quantization = args.quantization
    if quantization is None:
        return
    group_size = quantization["group_size"]
    for width in (args.num_heads * args.d_kv, args.d_ff):
        if (width // ranks) % group_size:
            raise ValueError(
                f"{cannot}: the {width // ranks} input "
                f"columns each would hold of a {width}-wide quantized layer are not whole "
                f"groups of {group_size}"
            )


def rank_zero_forms(group: mx.distributed.Group) -> Callable[..., str]:
    """A ``cpu.forms.chosen_form`` whose choice is rank 0's: rank 0 times
    the forms (or reads them from its cache), the others take its choice,
    so every rank lays out the weights it holds whole alike and computes
    them alike."""
    from cpu.forms import chosen_form

    def choose(shape: tuple[int, int], dtype, forms: Sequence[str], busy: bool = False) -> str:
        index = forms.index(chosen_form(shape, dtype, forms, busy)) if group.rank() == 0 else 0
        return forms[rank_zero_value(index, group)]

    return choose


class RankZeroDraftLength:
    """A ``drafting.DraftLength`` whose plans are rank 0's: how many tokens
    each source drafts weighs timings, which differ between ranks. Every
    rank plans and observes its own rounds; only rank 0's answers are used."""

    def __init__(self, draft_length: DraftLength, group: mx.distributed.Group):
        self.draft_length, self.group = draft_length, group
        self.calibration_seconds = draft_length.calibration_seconds

    def plan(self, rows: list, limits: list[int], drafter) -> Callable[[str], int]:
        budget = self.draft_length.plan(rows, limits, drafter)
        # The drafters ask every rank for the same sources in the same order.
        return lambda source: rank_zero_value(budget(source), self.group)

    def observe(self, rows: list, outcome) -> None:
        self.draft_length.observe(rows, outcome)


def shared_draft_length(
    draft_length: DraftLength, group: mx.distributed.Group | None
) -> DraftLength | RankZeroDraftLength:
    """``draft_length``, its plans rank 0's in a ``group`` (None: as it is)."""
    return draft_length if group is None else RankZeroDraftLength(draft_length, group)


# --- Data parallel: the prompts of a file spread over the ranks -------------


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
    group: mx.distributed.Group,
    *,
    speculative: bool = True,
    batch_size: int = 8,
    max_tokens: int = 100,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    prompt_progress: Callable[[int, int], None] | None = None,
) -> Iterator[tuple[int, GenerationResult]]:
    """``decoder.stream_batch`` over ranks that each hold both models whole:
    each rank decodes a share of ``prompts`` (``balanced_shares``, a
    prompt's cost its tokens plus ``max_tokens``), and after every round the
    ranks sum what finished in it, so that rank 0 yields ``(index,
    result)`` for every prompt of every rank as it finishes (the others
    yield nothing). The ranks run their rounds in step, so a rank that
    fails ends the others within a round."""
    import mlx.core as mx

    from sampling import Sampling
    from scheduler import SORT_WINDOW, iter_rounds, longest_first

    ids = []
    for i, prompt in enumerate(prompts):
        try:
            ids.append(decoder.prompt_ids(prompt))
        except (TypeError, ValueError) as error:
            raise type(error)(f"prompt {i}: {error}") from None
    share = balanced_shares([len(i) + max_tokens for i in ids], group.size())[group.rank()]
    generator = decoder.batch_generator(
        speculative=speculative, max_batch_size=batch_size, prompt_progress=prompt_progress
    )
    generator.check_options(max_tokens, seed)
    index = {}
    sampling = Sampling(temp, top_p, top_k)
    for i in longest_first([ids[j] for j in share], SORT_WINDOW * batch_size):
        uid = generator.insert(ids[share[i]], max_tokens=max_tokens, sampling=sampling, seed=seed)
        index[uid] = share[i]
    rounds = iter_rounds(generator)
    # A round finishes at most max_tokens tokens, and at most one round more.
    room = max_tokens + 1
    rank, ranks = group.rank(), group.size()
    running = True
    while True:
        events = next(rounds, None) if running else None
        running = events is not None
        finished = [(index[uid], result) for uid, result in events or [] if result.finished]
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
    from decoder import GenerationResult

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
