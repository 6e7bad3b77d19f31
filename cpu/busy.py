"""How busy other processes keep the machine's CPUs, from Linux's ``/proc/stat``.

Product forms timed while they are busy are not kept (``cpu.forms``), and
OpenBLAS computes on the cores they leave free (``cpu.prepare``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path


def machine_cpu_seconds() -> float | None:
    """CPU seconds the machine's processors have spent busy since it booted
    (Linux's ``/proc/stat``, time taken by the hypervisor included); None
    where that cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# Other processes that use more than this share of a CPU while the forms are
# timed make the timings unfit to keep: a busy process takes well over it, a
# quiet machine well under, and forms timed beside a busy process can come
# out otherwise than on the quiet machine (docs/benchmark-log.md, 2026-11-26).
BUSY_SHARE = 0.25
# /proc/stat counts in ticks (100 a second), on every CPU: what other
# processes used can read up to about this much too high on a quiet machine.
TICKS_SLACK_SECONDS = 0.02


class OtherProcesses:
    """How much CPU time processes other than this one take from the
    moment it is made: the machine's busy time minus this process's own
    (every thread's, OpenBLAS's included)."""

    def __init__(self):
        self.machine = machine_cpu_seconds()
        self.own = time.process_time()
        self.start = time.perf_counter()

    def cores(self) -> float | None:
        """How many CPUs they kept busy on average since; None where the
        machine's CPU time cannot be read."""
        machine = machine_cpu_seconds()
        if machine is None or self.machine is None:
            return None
        elsewhere = (machine - self.machine) - (time.process_time() - self.own)
        return max(0.0, elsewhere - TICKS_SLACK_SECONDS) / (time.perf_counter() - self.start)

    def were_busy(self) -> bool:
        """Whether they used more than ``BUSY_SHARE`` of a CPU on average
        since; False where the machine's CPU time cannot be read."""
        return (self.cores() or 0.0) > BUSY_SHARE


def free_cores(others: OtherProcesses) -> int:
    """The CPUs this process may use (``os.sched_getaffinity``) less those
    ``others`` kept busy on average, rounded to the nearest, and at least 1."""
    cores = len(os.sched_getaffinity(0))
    busy = others.cores()
    return cores if busy is None else max(1, cores - round(busy))
