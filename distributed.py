"""The process group: several processes on MLX's distributed layer
(``mx.distributed``), started by ``mlx.launch``, on one machine or several.

A group either splits the main model across its processes (tensor
parallel, the default: ``model.T5.shard``, which ``loading.load_model``
calls) or spreads a file of prompts over them (``data_parallel.py``). Here
is what every group needs: starting it (``init_group``), ending it when one
process fails (``failures_end_group``), one writer (``silence_other_ranks``),
and rank 0's values where the ranks would otherwise differ: every decision
that depends on timing (the CPU's product forms, auto's draft lengths) or
on the world (a server's requests: ``RankZeroDecisions``) is rank 0's,
shared with a sum in which every other rank adds 0 (``rank_zero_value``).
docs/distributed.md tells how to run a group.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import mlx.core as mx

    from drafting import Drafter, DraftLength, RowState, Tested

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
# How MLX's ring backend says so, and PeerWatch.
PEER_LOST = "connection to a peer was lost"
PEER_CLOSED = f"{PEER_LOST}: the peer closed it"


# What a rank says when SIGTERM stopped it.
TERMINATED = (
    "stopped by SIGTERM (sent by a user, or by mlx.launch once another process of the "
    "group has ended)"
)
# Seconds a rank that SIGTERM stopped has to write its lines and end before
# a watching thread ends it: its main thread can be stuck in a sum whose
# peer has gone, where no Python code runs (docs/distributed.md#failures).
TERMINATE_GRACE = 5.0


class Terminated(KeyboardInterrupt):
    """SIGTERM reached a rank: ``mlx.launch`` sends it to every rank once
    one has ended with an error (or a user did). A ``KeyboardInterrupt``,
    so that what Ctrl-C stops (a summary of what finished) SIGTERM stops
    alike."""


def raise_terminated(signum: int, frame) -> None:
    raise Terminated(TERMINATED)


def end_on_sigterm(group: mx.distributed.Group) -> None:
    """SIGTERM raises ``Terminated`` in the main thread, which ends the
    process once it has written its lines (``failures_end_group``). A
    main thread stuck in MLX runs no Python code, so a thread woken by the
    same signal ends the process ``TERMINATE_GRACE`` seconds later, with
    the same line, if it is still running."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    signal.set_wakeup_fd(write_end)  # the signal's number, written even while Python waits
    signal.signal(signal.SIGTERM, raise_terminated)

    def watch() -> None:
        while os.read(read_end, 1) != bytes([signal.SIGTERM]):
            pass  # another signal (Ctrl-C): the main thread handles it
        time.sleep(TERMINATE_GRACE)
        end_now(group, TERMINATED)

    threading.Thread(target=watch, name="sigterm", daemon=True).start()


def group_failure(reason: str, group: mx.distributed.Group) -> str:
    """What rank 0 says when a sum failed with ``reason``: the rank it lost,
    where a peer went (the ring backend's words, or ``PeerWatch``)."""
    if PEER_LOST not in reason:
        return reason
    size = group.size()
    lost = "rank 1 of 2" if size == 2 else f"one of ranks 1 to {size - 1}"
    return f"{lost} ended or failed (see its error); rank 0 stops too ({reason})"


def end_now(group: mx.distributed.Group, reason: str) -> None:
    """End this process at once, from any thread, with its one line (if
    anyone still reads it: a closed standard error must not keep it alive)."""
    with contextlib.suppress(OSError):
        print(f"error: {rank_named(group)}{reason}", file=_error_file, flush=True)
    os._exit(1)


def rank_named(group: mx.distributed.Group) -> str:
    """How this rank's lines start: "rank R of N: ", nothing for rank 0."""
    return f"rank {group.rank()} of {group.size()}: " if group.rank() else ""


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
    end_on_sigterm(group)
    try:
        yield
    except (Exception, KeyboardInterrupt) as error:  # noqa: BLE001 - any failure ends the group
        reason = " ".join(str(error).split()) or type(error).__name__
        if PEER_LOST in reason:
            reason = f"{GROUP_BROKEN} ({reason})"
        with contextlib.suppress(OSError):  # a reader of standard output that left
            sys.stdout.flush()
        end_now(group, reason)


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
    rank plans and observes its own rounds; rank 0's plan, shared in one
    sum per round, is every rank's."""

    def __init__(self, draft_length: DraftLength, group: mx.distributed.Group):
        self.draft_length, self.group = draft_length, group
        self.calibration_seconds = draft_length.calibration_seconds

    def plan(self, rows: list[RowState], limits: list[int], drafter: Drafter) -> dict[str, int]:
        import mlx.core as mx

        plan = self.draft_length.plan(rows, limits, drafter)  # every rank's has the same sources
        mine = [length if self.group.rank() == 0 else 0 for length in plan.values()]
        shared = mx.distributed.all_sum(mx.array(mine, mx.int32), group=self.group, stream=mx.cpu)
        return dict(zip(plan, shared.tolist()))

    def observe(self, rows: list[RowState], outcome: Tested) -> None:
        self.draft_length.observe(rows, outcome)


def shared_draft_length(
    draft_length: DraftLength, group: mx.distributed.Group | None
) -> DraftLength | RankZeroDraftLength:
    """``draft_length``, its plans rank 0's in a ``group`` (None: as it is)."""
    return draft_length if group is None else RankZeroDraftLength(draft_length, group)


# Seconds an idle serving group waits between exchanges (RankZeroDecisions):
# a rank waiting in a sum spins its core (MLX's ring backend polls), so the
# ranks meet at this pace, sleeping between, instead of waiting in a sum;
# a request to an idle group waits at most this long to start.
IDLE_TICK_SECONDS = 0.05


class RankZeroDecisions:
    """Rank 0's decisions, on every rank, once per round: a server's rank 0
    alone hears the requests, so it decides what joins and leaves the batch
    and how much the round encodes, and every rank carries out its
    decisions, in the same order. One sum of a header (the decisions' size,
    a stop, the encoding slices, and each rank's own state in its place),
    and a second of the decisions (pickled) when there are any."""

    HEADER = 3  # the decisions' bytes, stop, encoding slices; then one place per rank

    def __init__(self, group: mx.distributed.Group, watch: PeerWatch | None = None):
        self.group, self.watch = group, watch  # watch: ended once rank 0 says stop
        self.rank_bytes = [0] * group.size()  # each rank's MLX memory in use, at the last exchange
        self.exchanged = time.monotonic()

    def share(
        self, decisions: list | None = None, stop: bool = False, slices: int = 0
    ) -> tuple[list, bool, int]:
        """Rank 0's ``decisions``, ``stop`` and encoding ``slices`` (other
        ranks pass none of them)."""
        import mlx.core as mx

        rank, size = self.group.rank(), self.group.size()
        payload = pickle.dumps(decisions) if rank == 0 and decisions else b""
        header = [0] * (self.HEADER + size)
        if rank == 0:
            header[: self.HEADER] = [len(payload), int(stop), slices]
            if stop and self.watch is not None:  # the other ranks end now, on purpose
                self.watch.expect_end()
        header[self.HEADER + rank] = mx.get_active_memory() >> 10  # KiB: an int32 holds 2 TiB
        header = self.sum(mx.array(header, mx.int32)).tolist()
        self.rank_bytes = [kib << 10 for kib in header[self.HEADER :]]
        self.exchanged = time.monotonic()
        length, stop, slices = header[0], bool(header[1]), header[2]
        if stop and self.watch is not None:
            self.watch.expect_end()
        if not length:
            return [], stop, slices
        mine = mx.array(list(payload) if rank == 0 else [0] * length, mx.uint8)
        return pickle.loads(bytes(self.sum(mine).tolist())), stop, slices

    def sum(self, values: mx.array) -> mx.array:
        import mlx.core as mx

        return mx.distributed.all_sum(values, group=self.group, stream=mx.cpu)

    def idle(self) -> None:
        """Wait as rank 0 waits for a request when nothing decodes (every
        rank but 0)."""
        time.sleep(IDLE_TICK_SECONDS)


# Seconds between looks at the group's connections (PeerWatch).
PEER_WATCH_SECONDS = 0.2


def group_connections() -> list[socket.socket]:
    """The TCP connections this process holds: called right after
    ``init_group``, before anything else opens one, the group's own (MLX's
    ring backend connects each rank to its neighbours over TCP)."""
    connections = []
    for name in os.listdir("/dev/fd"):
        with contextlib.suppress(OSError, ValueError):
            if stat.S_ISSOCK(os.fstat(int(name)).st_mode):
                connection = socket.socket(fileno=os.dup(int(name)))
                if connection.type == socket.SOCK_STREAM and connection.getpeername():
                    connections.append(connection)
                else:
                    connection.detach()
    return connections


class PeerWatch:
    """Calls ``on_lost()`` once, from a thread of its own, when a peer of
    the group has closed a connection to this process: it ended (killed,
    or failed). MLX may not return from a collective whose peer has gone
    (its ring backend then waits forever), so a rank must not rely on the
    collective's error alone. ``expect_end()`` stops the watch: after a
    shared stop, the peers end on purpose. A peer that hangs, or a host
    that is unreachable without closing its connections, is not seen."""

    def __init__(self, connections: list[socket.socket], on_lost: Callable[[], None]):
        self.connections, self.on_lost = connections, on_lost
        self.ending = threading.Event()
        threading.Thread(target=self.watch, name="peers", daemon=True).start()

    def expect_end(self) -> None:
        self.ending.set()

    def watch(self) -> None:
        while not self.ending.wait(PEER_WATCH_SECONDS):
            if any(map(closed_by_peer, self.connections)) and not self.ending.is_set():
                self.on_lost()
                return


def closed_by_peer(connection: socket.socket) -> bool:
    """Whether the other end of ``connection`` has closed it (a look at
    what waits to be read, which leaves it there for MLX)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
