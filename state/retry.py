"""One retry policy for every store: jittered backoff until a deadline, and a warning when it waits.

Why one module
--------------
A store that blips (PostgreSQL restarting, S3 returning 503s, a connection
reset by a load balancer) must not fail a query that would have succeeded a
few seconds later. Every Blob and Consensus backend, and the compare-and-set
loop of :class:`~pyspark_persist.state.machine.Machine`, retries through
:func:`call` with the same rules:

- only *transient* failures are retried: the caller says which (connection
  refused or reset, server shutting down, serialization failure, a 5xx). A
  permanent one (bad password, no such bucket, permission denied) fails at
  once, and an unknown outcome (a compare-and-set whose reply was lost) is
  never retried here: it is :class:`~pyspark_persist.state.errors.Indeterminate`
  and only idempotent callers retry it;
- between attempts it sleeps a "full jitter" exponential backoff
  (uniform in ``[0, min(max_backoff_s, first_backoff_s * 2**n)]``), so many
  clients that lost the store together do not come back in lockstep;
- it gives up at a deadline: ``RetryPolicy.deadline_s`` after the first
  attempt, or earlier inside a :func:`deadline_in` block (the machine wraps
  each command in one, so ``PersistConfig.retry_timeout_s`` bounds the
  whole command, nested store retries included). The error raised then
  names the store, the operation and how long it waited.

Nothing waits silently. Every operation run through :func:`call` is
registered with a watchdog thread; once one has been running (stalled in
one request, or retrying) for ``warn_after_s`` it logs a warning naming the
store, the operation and the time waited, and when that operation finishes
it logs that the store recovered (or that it gave up). :func:`call` costs
about 2 µs when the first attempt succeeds (a lock and a dict entry): the
watchdog sleeps until the earliest operation could be late, and not at all
while nothing is in flight.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from .errors import StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how fast to retry transient store failures."""

    deadline_s: float = 60.0
    """Give up this long after the first attempt (the default of ``retry_timeout_s``)."""
    first_backoff_s: float = 0.01
    """Upper bound of the first jittered sleep; it doubles with every attempt."""
    max_backoff_s: float = 1.0
    """Upper bound of any one sleep, so a store that comes back is used within a second."""
    warn_after_s: float = 5.0
    """Log a warning once an operation has been waiting this long."""


DEFAULT_POLICY = RetryPolicy()
"""What every store uses (looked up at each call, so a test may swap it)."""


class Backoff:
    """Full-jitter exponential backoff: each :meth:`delay` is uniform in ``[0, cap]``, the
    cap doubling from ``first_backoff_s`` up to ``max_backoff_s``."""

    def __init__(self, policy: RetryPolicy | None = None) -> None:
        self._policy = policy or DEFAULT_POLICY
        self._attempt = 0

    def delay(self) -> float:
        """The next sleep, in seconds."""
        cap = min(
            self._policy.max_backoff_s,
            self._policy.first_backoff_s * (2 ** min(self._attempt, 30)),
        )
        self._attempt += 1
        return random.uniform(0, cap)

    def sleep(self, deadline: float | None = None) -> None:
        """Sleep the next delay, but never past ``deadline`` (a ``time.monotonic()`` value)."""
        pause = self.delay()
        if deadline is not None:
            pause = min(pause, max(0.0, deadline - time.monotonic()))
        time.sleep(pause)


# --- deadlines ------------------------------------------------------------------------------

_scope = threading.local()


@contextlib.contextmanager
def deadline_in(seconds: float) -> Iterator[float]:
    """Bound every store retry on this thread inside the block to ``seconds`` from now.

    Nested blocks can only shorten the deadline. Yields the deadline as a
    ``time.monotonic()`` value.
    """
    outer: float | None = getattr(_scope, "deadline", None)
    deadline = time.monotonic() + seconds
    if outer is not None:
        deadline = min(deadline, outer)
    _scope.deadline = deadline
    try:
        yield deadline
    finally:
        _scope.deadline = outer


# --- the watchdog ---------------------------------------------------------------------------


class _Op:
    """One operation in flight, as the watchdog sees it."""

    __slots__ = ("store", "what", "started", "warn_at", "attempts", "last_error", "warned")

    def __init__(self, store: str, what: str, warn_after_s: float) -> None:
        self.store = store
        self.what = what
        self.started = time.monotonic()
        self.warn_at = self.started + warn_after_s
        self.attempts = 1
        self.last_error: str | None = None
        self.warned = False


class Watch:
    """A handle on an operation in flight: report failed attempts to it (see :func:`watch`)."""

    __slots__ = ("_op",)

    def __init__(self, op: _Op) -> None:
        self._op = op

    @property
    def waited_s(self) -> float:
        """Seconds since the operation started."""
        return time.monotonic() - self._op.started

    @property
    def attempts(self) -> int:
        """Attempts made so far."""
        return self._op.attempts

    def failed(self, error: BaseException) -> None:
        """Record a failed attempt (another one follows)."""
        self._op.attempts += 1
        self._op.last_error = _one_line(error)


class _Watchdog:
    """Logs operations that run past their warn time. One thread, asleep until one is due."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._ops: dict[int, _Op] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake_at: float | None = None
        """When the thread wakes next (None: asleep until notified)."""

    def add(self, op: _Op) -> int:
        with self._cond:
            key = next(self._ids)
            self._ops[key] = op
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="persist-store-watchdog", daemon=True
                )
                self._thread.start()
            elif self._wake_at is None or op.warn_at < self._wake_at:
                self._cond.notify()
            return key

    def remove(self, key: int) -> None:
        with self._cond:
            self._ops.pop(key, None)

    def snapshot(self) -> list[tuple[str, str, int]]:
        with self._cond:
            return [(op.store, op.what, op.attempts) for op in self._ops.values()]

    def _run(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                due: list[_Op] = []
                next_at: float | None = None
                for op in self._ops.values():
                    if op.warned:
                        continue
                    if op.warn_at <= now:
                        op.warned = True
                        due.append(op)
                    elif next_at is None or op.warn_at < next_at:
                        next_at = op.warn_at
                self._wake_at = next_at
                if due:
                    self._cond.release()
                    try:
                        for op in due:
                            _warn(op)
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(None if next_at is None else next_at - now)

    def reset_after_fork(self) -> None:
        """A forked child has no watchdog thread: start a fresh one on first use."""
        self._cond = threading.Condition(threading.Lock())
        self._ops = {}
        self._thread = None
        self._wake_at = None


_WATCHDOG = _Watchdog()
os.register_at_fork(after_in_child=_WATCHDOG.reset_after_fork)


def _warn(op: _Op) -> None:
    waited = time.monotonic() - op.started
    if op.last_error is None:
        log.warning(
            "persist: %s: %s has been waiting %.1f s for a reply", op.store, op.what, waited
        )
    else:
        log.warning(
            "persist: %s: %s has been failing for %.1f s (%d attempts, last: %s); retrying",
            op.store,
            op.what,
            waited,
            op.attempts,
            op.last_error,
        )


def in_flight() -> list[tuple[str, str, int]]:
    """Store operations running now, as ``(store, operation, attempts so far)``."""
    return _WATCHDOG.snapshot()


def _done(key: int, op: _Op, ok: bool) -> None:
    """Unregister ``op``; if it was warned about, say how it ended."""
    _WATCHDOG.remove(key)
    if not op.warned:
        return
    waited = time.monotonic() - op.started
    if ok:
        log.warning(
            "persist: %s recovered: %s succeeded after %.1f s (%d attempts)",
            op.store,
            op.what,
            waited,
            op.attempts,
        )
    else:
        log.warning(
            "persist: %s: %s failed after %.1f s (%d attempts)",
            op.store,
            op.what,
            waited,
            op.attempts,
        )


# --- retrying -------------------------------------------------------------------------------


def call(
    op: Callable[[], T],
    *,
    store: str,
    what: str,
    transient: Callable[[Exception], bool],
    gave_up: Callable[[Exception, Watch], Exception] | None = None,
    policy: RetryPolicy | None = None,
) -> T:
    """Run ``op``, retrying failures ``transient`` accepts with jittered backoff until the deadline.

    Any other exception propagates at once, unchanged. Past the deadline
    the last transient failure is raised, or ``gave_up(error, watch)``
    (``watch.waited_s``, ``watch.attempts``) when given, chained to it.
    """
    policy = policy or DEFAULT_POLICY
    op_ = _Op(store, what, policy.warn_after_s)
    key = _WATCHDOG.add(op_)
    ok = False
    try:
        try:
            result = op()  # the common case: no backoff, deadline or watch objects made
        except Exception as e:
            if not transient(e):
                raise
            result = _retry(op, e, op_, transient, gave_up, policy)
        ok = True
        return result
    finally:
        _done(key, op_, ok)


def _retry(
    op: Callable[[], T],
    first: Exception,
    op_: _Op,
    transient: Callable[[Exception], bool],
    gave_up: Callable[[Exception, Watch], Exception] | None,
    policy: RetryPolicy,
) -> T:
    """The retry loop of :func:`call`, once the first attempt failed transiently."""
    scoped: float | None = getattr(_scope, "deadline", None)
    deadline = scoped if scoped is not None else op_.started + policy.deadline_s
    backoff = Backoff(policy)
    w = Watch(op_)
    error = first
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if gave_up is None:
                raise error
            raise gave_up(error, w) from error
        w.failed(error)
        log.debug("persist: %s: %s failed (%s); retrying", op_.store, op_.what, _one_line(error))
        time.sleep(min(backoff.delay(), remaining))
        try:
            return op()
        except Exception as e:
            if not transient(e):
                raise
            error = e


def is_transient(error: Exception) -> bool:
    """For callers above the stores: a store failure that retrying may fix.

    :class:`~pyspark_persist.state.errors.StoreUnavailable` unless its store
    called it permanent (authentication, permissions, a missing bucket).
    """
    return isinstance(error, StoreUnavailable) and error.transient


def waited(w: Watch) -> str:
    """``"for 12.3 s (7 attempts)"``: how long an operation retried, for error messages."""
    return f"for {w.waited_s:.1f} s ({w.attempts} attempt{'s' if w.attempts != 1 else ''})"


def _one_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
