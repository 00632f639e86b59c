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
    """CPU seconds of this process tree, by who spent them."""

    jvm: float
    """Spark's JVM (a ``java`` process)."""
    workers: float
    """Every process the JVM started, those that exited since included: Spark's Python workers,
    where a Python source reads and a Python sink writes (persist's own code on executors runs
    there, beside pyspark's)."""
    driver: float
    """This process and anything else it started."""

    @property
    def total(self) -> float:
        """All of it."""
        return self.jvm + self.workers + self.driver

    def __sub__(self, before: CpuSplit) -> CpuSplit:
        return CpuSplit(
            round(self.jvm - before.jvm, 2),
            round(self.workers - before.workers, 2),
            round(self.driver - before.driver, 2),
        )


def tree_cpu_split() -> CpuSplit | None:
    """CPU seconds used so far by this process tree (live processes and reaped children), by
    JVM, its Python workers and the rest; None off Linux."""
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
    ticks = {"jvm": 0, "workers": 0, "driver": 0}
    todo = [(os.getpid(), "driver")]
    while todo:
        pid, kind = todo.pop()
        if pid not in stats:
            continue
        _, comm, own, reaped = stats[pid]
        if kind == "driver" and comm == "java":
            kind = "jvm"
        below = "workers" if kind in ("jvm", "workers") else "driver"
        ticks[kind] += own
        # A child that exited (a streaming query's Python runner, a worker the JVM stopped)
        # left its CPU to its parent: it is still the kind of the children.
        ticks[below] += reaped
        todo.extend((child, below) for child in children.get(pid, ()))
    return CpuSplit(*(ticks[k] / _TICKS for k in ("jvm", "workers", "driver")))


def tree_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process tree (live processes and reaped children)."""
    split = tree_cpu_split()
    return None if split is None else split.total
