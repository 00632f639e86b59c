"""Slow, independent work started early, in one background lane, while the JVM-free tests run.

Some session fixtures spend a minute or more waiting on child processes:
the class-data sharing archive's warm-up job (``jvm_fixtures``), ``python -m
build`` and the fresh install's pip steps (``tests/ops``). The run starts with the JVM-free tests
(state, pubsub), which keep about one core busy. So once collection is done,
``tests/conftest.py`` starts the jobs behind the fixtures that the collected
tests will ask for, in one background thread, one job at a time, in the
order the tests will ask for them (each after the jobs it needs); each
fixture then waits for its job's result instead of running the job itself.
A job runs the same commands as before, given the environment as it was at
collection (before any test's monkeypatching); an exception it raised is
raised by its fixture. A job that was not started in the lane (e.g. under
``--collect-only``) runs, once, when first asked for.

The lane's thread lowers its own scheduling priority (``nice``), which the
child processes it starts inherit on Linux: the tests in the foreground keep
the CPU they had, the jobs use what is left. While a fixture waits for a
job, the foreground is idle and the lane is what the run waits for: the
lane's thread and the processes it started get the test run's priority back
(where the user may raise it, e.g. root), so that nothing else on the machine
starves them; once the job is done they go back to the background's.

Under pytest-xdist (``lanes``), the last worker runs the lane (it starts
with JVM-free tests), and each job runs once for the whole run: under an
exclusive lock on a file beside the workers' base temporary directories,
whichever worker gets to it first runs it and leaves its result there
(pickled) for the others; a job that failed leaves nothing, so the next
worker to ask runs it again and sees the error itself. A worker waiting for
a job of another worker's lane just blocks on that lock (it is idle then, so
the lane has its core). The scheduler hands a unit of tests that need a job
to a worker once the job is ``done``, so that rarely happens.

Only jobs that no deadline can trip belong here. A Spark job whose Python
workers start in the background can miss Spark's fixed deadline for them to
connect back ("Python worker failed to connect back") while the foreground
keeps the CPU, and a kill test's parent, polling from this thread, can
react late enough to kill past the phase it aims at: both were seen when
the examples and the kill tests' runs were tried here.
"""

from __future__ import annotations

import fcntl
import os
import pickle
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import pytest

Job = Callable[[pytest.TempPathFactory, dict[str, str]], Any]
"""A job: made directories come from the factory; child processes get the given environment."""

_registered: dict[str, Job] = {}
_needs: dict[str, tuple[str, ...]] = {}
_started: dict[str, Future[Any]] = {}
_lock = threading.Lock()
_lane: list[threading.Thread] = []
NICE = 10
RENICE_EVERY_S = 2.0
"""While a fixture waits: how often processes started since get their priority back."""


def _shared_dir(basetemp: Path) -> Path:
    """Where the jobs' results are shared, beside the xdist workers' base temporary dirs."""
    return basetemp / "early-jobs"


def done(basetemp: Path, name: str) -> bool:
    """Whether the job ``name`` has run and left its result for xdist's workers."""
    return (_shared_dir(basetemp) / f"{name}.pickle").exists()


def jobs_of(fixtures: Iterable[str]) -> set[str]:
    """The registered jobs behind ``fixtures``."""
    return {f for f in fixtures if f in _registered}


def _run(name: str, factory: pytest.TempPathFactory, env: dict[str, str]) -> Any:
    """Run the job ``name``, once per run across xdist's workers (see the module's doc)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _registered[name](factory, env)
    shared = _shared_dir(factory.getbasetemp().parent)
    shared.mkdir(exist_ok=True)
    done = shared / f"{name}.pickle"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if done.exists():
            return pickle.loads(done.read_bytes())
        value = _registered[name](factory, env)
        partial = done.with_suffix(".partial")
        partial.write_bytes(pickle.dumps(value))
        partial.replace(done)
        return value


def register(fixture: str, job: Job, needs: tuple[str, ...] = ()) -> None:
    """Declare the job behind ``fixture``, which uses the results of the jobs ``needs``."""
    _registered[fixture] = job
    _needs[fixture] = needs


def start(config: pytest.Config, fixtures: list[str]) -> None:
    """Start, in one background thread, the registered jobs of ``fixtures``.

    ``fixtures`` in the order the tests will ask for them: the jobs run in that order, each
    after the jobs it needs.
    """
    order: list[str] = []

    def add(name: str) -> None:
        if name in _registered and name not in order:
            for need in _needs[name]:
                add(need)
            order.append(name)

    for f in fixtures:
        add(f)
    with _lock:
        names = [n for n in order if n not in _started]
        futures: dict[str, Future[Any]] = {n: Future() for n in names}
        _started.update(futures)
    if not names:
        return
    factory: pytest.TempPathFactory = config._tmp_path_factory  # type: ignore[attr-defined]
    factory.getbasetemp()  # made here, in the main thread, not raced from the lane's
    env = dict(os.environ)

    def lane() -> None:
        try:
            os.nice(NICE)
        except OSError:
            pass
        for n in names:
            fut = futures[n]
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(_run(n, factory, env))
            except BaseException as e:  # handed to the fixture that waits
                fut.set_exception(e)

    thread = threading.Thread(target=lane, name="early-jobs", daemon=True)
    thread.start()
    _lane.append(thread)


def _descendants() -> list[int]:
    """The processes below this one (Linux ``/proc``; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [os.getpid()]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _restore_priority() -> set[int]:
    """The lane's thread and the niced processes below this one back to this process's priority.

    The threads changed: on Linux the priority is each thread's, and every thread of a
    process below this one that is niced below this process was set so by the lane.
    """
    own = os.getpriority(os.PRIO_PROCESS, 0)
    targets = [t.native_id for t in _lane if t.native_id is not None]
    for pid in _descendants():
        targets.extend(int(task.name) for task in Path(f"/proc/{pid}/task").glob("[0-9]*"))
    changed = set()
    for tid in targets:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) > own:
                os.setpriority(os.PRIO_PROCESS, tid, own)
                changed.add(tid)
        except OSError:  # gone, or not allowed to raise priority: it runs on as it was
            pass
    return changed


def _lower_priority(tids: set[int]) -> None:
    """Threads given their priority back by ``_restore_priority`` back to the background's."""
    value = os.getpriority(os.PRIO_PROCESS, 0) + NICE
    for tid in tids:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, value)
        except OSError:  # gone
            pass


def cancel() -> None:
    """At the end of the run: jobs not started yet never start (a running one runs out)."""
    for fut in _started.values():
        fut.cancel()


def result(fixture: str, factory: pytest.TempPathFactory) -> Any:
    """The job's result: from the lane if it was started there, else run it now (once)."""
    with _lock:
        fut = _started.get(fixture)
        here = fut is None
        if fut is None:
            fut = _started[fixture] = Future()
            fut.set_running_or_notify_cancel()
    if here:
        try:
            fut.set_result(_run(fixture, factory, dict(os.environ)))
        except BaseException as e:  # raised below, as to every later caller
            fut.set_exception(e)
    restored: set[int] = set()
    try:
        while True:
            try:
                return fut.result(timeout=0 if fut.done() else RENICE_EVERY_S)
            except FutureTimeout:
                restored |= _restore_priority()
    finally:
        _lower_priority(restored)
