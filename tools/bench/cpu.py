"""CPU seconds spent by this process and every process it started (Spark's JVM, its Python workers).

On a shared machine a scan's wall time swings with the load while the CPU it
burns moves far less, so the Spark benchmarks print both: a change that cuts
work shows in CPU seconds even when other jobs drown it in the wall times.
Linux only (it reads ``/proc``); elsewhere the figure is ``None``.
"""

from __future__ import annotations

import os

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, CPU ticks of the process and of its reaped children), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = raw[raw.rindex(")") + 2 :].split()
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(v) for v in fields[11:15])
    return ppid, utime + stime + cutime + cstime


def tree_cpu_seconds() -> float | None:
    """CPU seconds used so far by this process tree (live processes and reaped children)."""
    if not os.path.isdir("/proc/self"):
        return None
    stats: dict[int, tuple[int, int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                stats[int(name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [os.getpid()]
    while todo:
        pid = todo.pop()
        if pid in stats:
            total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total / _TICKS
