"""CPU seconds spent by this process and every process it started (Spark's JVM, its Python workers).

On a shared machine a scan's wall time swings with the load while the CPU it
burns moves far less, so the Spark benchmarks print both: a change that cuts
work shows in CPU seconds even when other jobs drown it in the wall times.
Linux only (it reads ``/proc``); elsewhere the figure is ``None``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, str, int, int] | None:
    """(parent pid, command name, CPU ticks of the process, CPU ticks of its reaped
    children), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return ppid, comm, utime + stime, cutime + cstime


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds spent between two :class:`CpuSample`, by who spent them."""

    jvm: float
    """Spark's JVM (a ``java`` process)."""
    workers: float
    """Every process the JVM started, those that exited meanwhile included: Spark's Python
    workers, where a Python source reads and a Python sink writes (persist's own code on
    executors runs there, beside pyspark's)."""
    driver: float
    """This process and anything else it started."""

    @property
    def total(self) -> float:
        """All of it."""
        return self.jvm + self.workers + self.driver


_KINDS = ("jvm", "workers", "driver")


@dataclass(frozen=True)
class CpuSample:
    """The CPU ticks, so far, of every live process of this tree, and whose each is."""

    procs: dict[int, tuple[str, int, int, str]]
    """pid -> (its kind, its own ticks, the ticks of its reaped children, their kind)."""

    def __sub__(self, before: CpuSample) -> CpuSplit:
        """What each kind spent since ``before``.

        A process alive at both counts its own growth, and one started since all of its
        own; what children reaped meanwhile spent is in their parent's reaped ticks, less
        what those that were alive at ``before`` had spent by then. Never below zero (a
        process its parent left to init takes its last ticks with it).
        """
        ticks = dict.fromkeys(_KINDS, 0)
        for pid, (kind, own, reaped, below) in self.procs.items():
            then = before.procs.get(pid)
            ticks[kind] += own - (then[1] if then else 0)
            ticks[below] += reaped - (then[2] if then else 0)
        for pid, (kind, own, reaped, _) in before.procs.items():
            if pid not in self.procs:  # exited: its whole CPU went to its parent's reaped
                ticks[kind] -= own + reaped
        return CpuSplit(*(round(max(ticks[k], 0) / _TICKS, 2) for k in _KINDS))


def tree_cpu_sample() -> CpuSample | None:
    """The CPU of this process tree's live processes, each by kind; None off Linux."""
    if not os.path.isdir("/proc/self"):
        return None
    stats: dict[int, tuple[int, str, int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in stats.items():
        children.setdefault(ppid, []).append(pid)
    procs: dict[int, tuple[str, int, int, str]] = {}
    todo = [(os.getpid(), "driver")]
    while todo:
        pid, kind = todo.pop()
        if pid not in stats:
            continue
        _, comm, own, reaped = stats[pid]
        if kind == "driver" and comm == "java":
            kind = "jvm"
        below = "workers" if kind in ("jvm", "workers") else "driver"
        procs[pid] = (kind, own, reaped, below)
        todo.extend((child, below) for child in children.get(pid, ()))
    return CpuSample(procs)
