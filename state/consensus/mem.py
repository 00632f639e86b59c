"""In-memory Consensus: the reference semantics, for tests and benchmarks.

``mem://NAME`` names a process-global store, so two ``open_consensus`` calls
with the same NAME (a writer and a reader in one test, say) see the same rows;
``mem://`` gives a fresh private store on every call. Nothing survives the
process, and other processes cannot see it: use ``sqlite://`` for that.

:func:`check_cas_args` lives here because this module is the reference
implementation of the contract; the SQL backend reuses it so both reject bad
calls identically.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from ..errors import InvalidUri, InvalidUsage
from . import (
    CaSCommitted,
    CaSManyMismatch,
    CaSManyResult,
    CaSMismatch,
    CaSOp,
    CaSResult,
    Consensus,
    SeqNo,
    VersionedData,
)


def check_cas_args(expected: SeqNo | None, new: VersionedData) -> None:
    """Reject a compare_and_set whose ``new.seqno`` is not ``(expected or 0) + 1``.

    Requiring exactly the next SeqNo is what makes racers contend for the same
    primary key, so at most one of them can win; ``expected=0`` is refused
    because "no rows" is spelled ``None`` and accepting both would hide bugs.
    """
    if expected is not None and expected < 1:
        raise InvalidUsage(
            f"compare_and_set expected={expected}: SeqNos start at 1; pass None for a new key"
        )
    want = (expected or 0) + 1
    if new.seqno != want:
        raise InvalidUsage(
            f"compare_and_set expected={expected} needs new.seqno={want}, got {new.seqno}"
        )


def check_cas_many_args(ops: Sequence[CaSOp]) -> list[CaSOp]:
    """``ops`` checked as :func:`check_cas_args` each, sorted by key (every backend takes its
    keys in one order, so two transactions on the same keys queue rather than deadlock).

    A repeated key is refused: two rows for one key in one step cannot both be its next SeqNo.
    """
    if not ops:
        raise InvalidUsage("compare_and_set_many needs at least one key")
    keys = [key for key, _, _ in ops]
    if len(set(keys)) != len(keys):
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        raise InvalidUsage(f"compare_and_set_many names key(s) {repeated} more than once")
    for _, expected, new in ops:
        check_cas_args(expected, new)
    return sorted(ops, key=lambda op: op[0])


def check_scan_limit(limit: int | None) -> None:
    """Reject a negative scan limit, which every backend would interpret differently."""
    if limit is not None and limit < 0:
        raise InvalidUsage(f"scan limit must be >= 0 or None, got {limit}")


class _MemStore:
    """The rows of every key, guarded by one lock (every operation is O(small))."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Per key, rows in ascending SeqNo order; never empty once created,
        # because truncate refuses to delete the head.
        self.rows: dict[str, list[VersionedData]] = {}


_REGISTRY_LOCK = threading.Lock()
_REGISTRY: dict[str, _MemStore] = {}


class MemConsensus(Consensus):
    """A Consensus held in this process's memory. See the module doc."""

    def __init__(self, store: _MemStore, uri: str) -> None:
        self._store = store
        self._uri = uri

    @classmethod
    def from_uri(cls, uri: str) -> MemConsensus:
        """Open ``mem://NAME`` (shared by NAME in this process) or ``mem://`` (private)."""
        scheme, sep, name = uri.partition("://")
        if not sep or scheme != "mem":
            raise InvalidUri(f"not a mem consensus URI: {uri!r}; use mem://name or mem://")
        if not name:
            return cls(_MemStore(), "mem://")
        with _REGISTRY_LOCK:
            store = _REGISTRY.setdefault(name, _MemStore())
        return cls(store, uri)

    @property
    def uri(self) -> str:
        """``mem://NAME``; a private ``mem://`` store cannot be reopened, only recreated."""
        return self._uri

    def head(self, key: str) -> VersionedData | None:
        """Return the newest row of ``key``, or ``None``."""
        with self._store.lock:
            rows = self._store.rows.get(key)
            return rows[-1] if rows else None

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """Append ``new`` iff the head SeqNo is ``expected``, under the store's lock."""
        check_cas_args(expected, new)
        with self._store.lock:
            rows = self._store.rows.setdefault(key, [])
            current = rows[-1].seqno if rows else None
            if current != expected:
                if not rows:
                    del self._store.rows[key]
                return CaSMismatch(current)
            rows.append(VersionedData(new.seqno, bytes(new.data)))
            return CaSCommitted()

    def compare_and_set_many(self, ops: Sequence[CaSOp]) -> CaSManyResult:
        """Append every row iff every head is as expected, under the store's lock."""
        ops = check_cas_many_args(ops)
        with self._store.lock:
            rows = self._store.rows
            heads = {key: (rows[key][-1].seqno if rows.get(key) else None) for key, _, _ in ops}
            moved = {key: heads[key] for key, expected, _ in ops if heads[key] != expected}
            if moved:
                return CaSManyMismatch(moved)
            for key, _, new in ops:
                rows.setdefault(key, []).append(VersionedData(new.seqno, bytes(new.data)))
            return CaSCommitted()

    def scan(self, key: str, from_seqno: SeqNo, limit: int | None = None) -> list[VersionedData]:
        """Return rows of ``key`` with SeqNo >= ``from_seqno``, ascending, at most ``limit``."""
        check_scan_limit(limit)
        with self._store.lock:
            rows = self._store.rows.get(key, [])
            start = bisect.bisect_left(rows, from_seqno, key=lambda row: row.seqno)
            end = len(rows) if limit is None else min(len(rows), start + limit)
            return rows[start:end]

    def truncate(self, key: str, seqno: SeqNo) -> int:
        """Delete rows of ``key`` below ``seqno``; InvalidUsage if that would delete the head."""
        with self._store.lock:
            rows = self._store.rows.get(key)
            if not rows or seqno > rows[-1].seqno:
                head = rows[-1].seqno if rows else None
                raise InvalidUsage(
                    f"truncate({key!r}, {seqno}) would delete the head (head SeqNo: {head})"
                )
            cut = bisect.bisect_left(rows, seqno, key=lambda row: row.seqno)
            del rows[:cut]
            return cut

    def list_keys(self) -> list[str]:
        """Return every key with at least one row, sorted."""
        with self._store.lock:
            return sorted(self._store.rows)
