"""CPU seconds spent by this process and every process it started (Spark's JVM, its Python workers).

On a shared machine a scan's wall time swings with the load while the CPU it
burns moves far less, so the Spark benchmarks print both: a change that cuts
work shows in CPU seconds even when other jobs drown it in the wall times.
Split by who spent it (the JVM, its Python workers, the rest), it also shows
what a Python source's or sink's own code cost beside a do-nothing peer's.
Linux only (it reads ``/proc``); elsewhere the figure is ``None``.

Spark's worker daemon ignores SIGCHLD, so a worker that exits leaves its CPU
to nobody (no parent's reaped-children ticks): :class:`CpuMeter` therefore
samples every process of the tree while the measured piece runs and counts
each by what it was last seen to have spent.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from types import TracebackType

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, command name, CPU ticks of the process itself), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    comm = raw[raw.index("(") + 1 : raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), comm, int(fields[11]) + int(fields[12])


@dataclass(frozen=True)
class CpuSplit:
    """CPU seconds spent while a :class:`CpuMeter` ran, by who spent them."""

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


def tree_cpu_sample() -> dict[int, tuple[str, int]] | None:
    """pid -> (kind, CPU ticks so far) of this process tree's live processes; None off Linux."""
    if not os.path.isdir("/proc/self"):
        return None
    stats: dict[int, tuple[int, str, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in stats.items():
        children.setdefault(ppid, []).append(pid)
    procs: dict[int, tuple[str, int]] = {}
    todo = [(os.getpid(), "driver")]
    while todo:
        pid, kind = todo.pop()
        if pid not in stats:
            continue
        _, comm, ticks = stats[pid]
        if kind == "driver" and comm == "java":
            kind = "jvm"
        procs[pid] = (kind, ticks)
        below = "workers" if kind in ("jvm", "workers") else "driver"
        todo.extend((child, below) for child in children.get(pid, ()))
    return procs


class CpuMeter:
    """``with CpuMeter() as m: ...``; then ``m.split`` (None off Linux) is what the tree spent.

    Samples the tree at entry, every ``interval_s`` on a thread, and at exit; each process
    counts what it spent between its first and its last sighting (from zero if it started
    meanwhile). A process that lives less than ``interval_s`` may go unseen, and one that
    exits loses what it spent after its last sighting: Spark's workers live across tasks,
    and idle out before they exit. One sample reads ``/proc`` once (a few ms).
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        self._interval_s = interval_s
        self._first: dict[int, tuple[str, int]] = {}
        self._last: dict[int, tuple[str, int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.split: CpuSplit | None = None

    def _sample(self) -> bool:
        procs = tree_cpu_sample()
        if procs is None:
            return False
        self._last.update(procs)
        return True

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._sample()

    def __enter__(self) -> CpuMeter:
        first = tree_cpu_sample()
        if first is not None:
            self._first = first
            self._last = dict(first)
            self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._sample()
        ticks = dict.fromkeys(_KINDS, 0)
        for pid, (kind, spent) in self._last.items():
            then = self._first.get(pid)
            ticks[kind] += spent - (then[1] if then is not None else 0)
        self.split = CpuSplit(*(round(ticks[k] / _TICKS, 2) for k in _KINDS))


def own_cpu(
    workers: float | None, peer_workers: float | None, total: float | None
) -> tuple[float, float] | None:
    """A Python source's or sink's own cost: its workers' CPU beyond a do-nothing peer's (both
    pay pyspark's transfer to or from the JVM), in seconds and as a share of its ``total``
    CPU; None when a figure is missing (off Linux)."""
    if workers is None or peer_workers is None or total is None:
        return None
    own = max(workers - peer_workers, 0.0)
    return round(own, 2), round(own / max(total, 1e-9), 3)
