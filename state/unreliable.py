"""Fault-injecting wrappers around any Blob or Consensus: :class:`UnreliableBlob`,
:class:`UnreliableConsensus`, configured by :class:`Faults`.

Why they are first-class (shipped in the package, not hidden in a test)
------------------------------------------------------------------------
Persist's promise is "a committed update is never lost or applied twice", and
that promise is only interesting when the stores misbehave. Real stores fail
in exactly two ways that matter, and the error taxonomy of
:mod:`pyspark_persist.state.errors` names them:

- the call surely did not happen (:class:`~pyspark_persist.state.errors.StoreUnavailable`,
  a :class:`~pyspark_persist.state.errors.Determinate` error), and
- the call may have happened but its reply was lost
  (:class:`~pyspark_persist.state.errors.Indeterminate`): the dangerous one,
  which the idempotency token of a compare-and-append exists for.

These wrappers produce both on demand, reproducibly from a seed, around any
backend (``mem``, ``file``, ``s3``, ``sqlite``, ``postgresql``). Three users
need them, so they live next to the stores they wrap:

- the test suite (unknown-outcome commits, randomized fault runs);
- the reliability checker, which drives real workloads through faults and
  then verifies, with faults switched off (:attr:`enabled`), that every
  acknowledged write is present exactly once;
- benchmarks, which use ``slow``/``slow_s`` to model store latency and
  measure how retries and backoff behave under a lossy store.

Semantics of :class:`Faults`, per call (one random draw decides the fault):

- ``fail_before``: raise :class:`StoreUnavailable` without calling the store;
- ``fail_after``: for a *mutating* call (Blob ``set``/``delete``, Consensus
  ``compare_and_set``/``truncate``) call the store, so the change takes
  effect, then raise :class:`Indeterminate` (a lost reply). A read has no
  effect to lose, so for reads it behaves like ``fail_before``;
- ``timeout``: like ``fail_after`` but first sleeps ``slow_s`` and says "timed
  out". For reads it sleeps and then raises :class:`StoreUnavailable` (what
  every real backend raises for a failed read: a read is always safe to retry);
- ``slow`` (an independent draw): sleep ``slow_s`` before the call.

``max_faults`` caps the number of failures injected (``slow`` is not a
failure), and ``ops`` restricts injection to the named operations, so a test
can say "lose the reply of exactly one compare_and_set". If the wrapped store
itself raises, its exception propagates unchanged: it is the real outcome.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from .blob import Blob, BlobMeta, BlobValue
from .consensus import CaSManyResult, CaSOp, CaSResult, Consensus, SeqNo, VersionedData
from .errors import Indeterminate, InvalidUsage, StoreUnavailable

T = TypeVar("T")

FAULT_KINDS: tuple[str, ...] = ("fail_before", "fail_after", "timeout", "slow")
"""The keys of :attr:`FaultInjector.injected`."""

BLOB_OPS: frozenset[str] = frozenset({"get", "set", "delete", "list_keys", "stat_many"})
CONSENSUS_OPS: frozenset[str] = frozenset(
    {"head", "compare_and_set", "compare_and_set_many", "scan", "truncate", "list_keys"}
)
MUTATING_OPS: frozenset[str] = frozenset(
    {"set", "delete", "compare_and_set", "compare_and_set_many", "truncate"}
)
"""Operations whose effect can land even though the caller sees an error."""


@dataclass(frozen=True)
class Faults:
    """How often each fault is injected; probabilities per call. See the module doc."""

    seed: int
    fail_before: float = 0.0
    fail_after: float = 0.0
    timeout: float = 0.0
    slow: float = 0.0
    slow_s: float = 0.01
    max_faults: int | None = None
    """Stop injecting failures after this many (``None``: no limit)."""
    ops: frozenset[str] | None = None
    """Inject only into these operation names (``None``: every operation)."""

    def __post_init__(self) -> None:
        for name in ("fail_before", "fail_after", "timeout", "slow"):
            p = getattr(self, name)
            if not 0.0 <= p <= 1.0:
                raise InvalidUsage(f"fault probability {name}={p!r} must be in [0, 1]")
        if self.fail_before + self.fail_after + self.timeout > 1.0:
            raise InvalidUsage(
                "fault probabilities fail_before + fail_after + timeout must not exceed 1"
            )
        if self.slow_s < 0:
            raise InvalidUsage(f"slow_s={self.slow_s!r} must be >= 0")
        if self.max_faults is not None and self.max_faults < 0:
            raise InvalidUsage(f"max_faults={self.max_faults!r} must be >= 0 or None")
        if self.ops is not None:
            object.__setattr__(self, "ops", frozenset(self.ops))


class FaultInjector:
    """The seeded decision maker and fault counters shared by one wrapper. Thread-safe."""

    def __init__(self, faults: Faults, *, enabled: bool = True) -> None:
        self.faults = faults
        self.enabled = enabled
        """Switch every fault (including ``slow``) off or on; read on every call."""
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self._failures = 0
        self.injected: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        """How many faults of each kind were injected so far."""

    def _decide(self, op: str) -> tuple[str | None, bool]:
        """Draw (under the lock, so a seed gives one sequence) the fault and the slowness."""
        f = self.faults
        if not self.enabled or (f.ops is not None and op not in f.ops):
            return None, False
        with self._lock:
            r = self._rng.random()
            slow = self._rng.random() < f.slow
            kind: str | None = None
            if f.max_faults is None or self._failures < f.max_faults:
                if r < f.fail_before:
                    kind = "fail_before"
                elif r < f.fail_before + f.fail_after:
                    kind = "fail_after"
                elif r < f.fail_before + f.fail_after + f.timeout:
                    kind = "timeout"
            if kind is not None:
                self._failures += 1
                self.injected[kind] += 1
            if slow:
                self.injected["slow"] += 1
        return kind, slow

    def call(self, store: str, op: str, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (the real call ``op`` on ``what``) with whatever fault the draw picks."""
        kind, slow = self._decide(op)
        if slow:
            time.sleep(self.faults.slow_s)
        if kind is None:
            return fn()
        mutating = op in MUTATING_OPS
        where = f"{store} {op} of {what}"
        if kind == "fail_before" or (kind == "fail_after" and not mutating):
            raise StoreUnavailable(f"injected fault: {where} failed before reaching the store")
        if kind == "timeout":
            time.sleep(self.faults.slow_s)
            if not mutating:
                raise StoreUnavailable(f"injected fault: {where} timed out")
            fn()
            raise Indeterminate(
                f"injected fault: {where} timed out; it may or may not have taken effect"
            )
        fn()
        raise Indeterminate(
            f"injected fault: the reply to {where} was lost; it may or may not have taken effect"
        )


class _Unreliable:
    """The fault controls both wrappers expose, delegating to one :class:`FaultInjector`."""

    _injector: FaultInjector

    @property
    def faults(self) -> Faults:
        """The fault configuration."""
        return self._injector.faults

    @property
    def injected(self) -> dict[str, int]:
        """Faults injected so far by kind: fail_before, fail_after, timeout, slow."""
        return self._injector.injected

    @property
    def enabled(self) -> bool:
        """Whether faults are injected; switch off for a final verification read."""
        return self._injector.enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._injector.enabled = value


class UnreliableBlob(_Unreliable, Blob):
    """A Blob that injects :class:`Faults` around another Blob. See the module doc."""

    def __init__(self, inner: Blob, faults: Faults, *, enabled: bool = True) -> None:
        self.inner = inner
        self._injector = FaultInjector(faults, enabled=enabled)

    @property
    def uri(self) -> str:
        """The wrapped Blob's URI (reopening it elsewhere gives the reliable store)."""
        return self.inner.uri

    def get(self, key: str) -> bytes | None:
        """The inner ``get``, possibly failing first."""
        return self._injector.call("blob", "get", key, lambda: self.inner.get(key))

    def get_view(self, key: str) -> memoryview | None:
        """The inner ``get_view``, possibly failing first (a fault of the ``get`` operation)."""
        return self._injector.call("blob", "get", key, lambda: self.inner.get_view(key))

    def set(self, key: str, value: BlobValue) -> None:
        """The inner ``set``, possibly failing first or losing its reply."""
        self._injector.call("blob", "set", key, lambda: self.inner.set(key, value))

    def delete(self, key: str) -> int | None:
        """The inner ``delete``, possibly failing first or losing its reply."""
        return self._injector.call("blob", "delete", key, lambda: self.inner.delete(key))

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """The inner ``stat_many``, possibly failing first."""
        checked = list(keys)
        return self._injector.call(
            "blob", "stat_many", f"{len(checked)} keys", lambda: self.inner.stat_many(checked)
        )

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """The inner ``list_keys`` (the fault, if any, is raised at the call, not mid-iteration)."""
        return self._injector.call(
            "blob", "list_keys", repr(prefix), lambda: iter(list(self.inner.list_keys(prefix)))
        )

    def delete_abandoned(self, prefix: str, older_than_ms: int) -> int:
        """The inner ``delete_abandoned`` (never faulted: it only ever removes garbage)."""
        return self.inner.delete_abandoned(prefix, older_than_ms)

    def close(self) -> None:
        """Close the inner Blob (never faulted)."""
        self.inner.close()


class UnreliableConsensus(_Unreliable, Consensus):
    """A Consensus that injects :class:`Faults` around another Consensus. See the module doc."""

    def __init__(self, inner: Consensus, faults: Faults, *, enabled: bool = True) -> None:
        self.inner = inner
        self._injector = FaultInjector(faults, enabled=enabled)

    @property
    def uri(self) -> str:
        """The wrapped Consensus's URI (clients key their state cache by it)."""
        return self.inner.uri

    def head(self, key: str) -> VersionedData | None:
        """The inner ``head``, possibly failing first."""
        return self._injector.call("consensus", "head", key, lambda: self.inner.head(key))

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """The inner ``compare_and_set``, possibly failing first or losing its reply."""
        return self._injector.call(
            "consensus",
            "compare_and_set",
            f"{key!r} at SeqNo {new.seqno}",
            lambda: self.inner.compare_and_set(key, expected, new),
        )

    def compare_and_set_many(self, ops: Sequence[CaSOp]) -> CaSManyResult:
        """The inner ``compare_and_set_many``, possibly failing first or losing its reply."""
        keys = ", ".join(repr(key) for key, _, _ in ops)
        return self._injector.call(
            "consensus",
            "compare_and_set_many",
            keys,
            lambda: self.inner.compare_and_set_many(ops),
        )

    def scan(self, key: str, from_seqno: SeqNo, limit: int | None = None) -> list[VersionedData]:
        """The inner ``scan``, possibly failing first."""
        return self._injector.call(
            "consensus", "scan", key, lambda: self.inner.scan(key, from_seqno, limit)
        )

    def truncate(self, key: str, seqno: SeqNo) -> int:
        """The inner ``truncate``, possibly failing first or losing its reply."""
        return self._injector.call(
            "consensus", "truncate", key, lambda: self.inner.truncate(key, seqno)
        )

    def list_keys(self) -> list[str]:
        """The inner ``list_keys``, possibly failing first."""
        return self._injector.call("consensus", "list_keys", "keys", self.inner.list_keys)

    def close(self) -> None:
        """Close the inner Consensus (never faulted)."""
        self.inner.close()
