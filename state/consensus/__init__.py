"""Consensus: a linearizable log of versioned values per key (the shard's state).

Each shard's state lives under one key as a sequence of rows, one per SeqNo,
each holding an encoded state diff. The only way to add a row is
:meth:`Consensus.compare_and_set`, which succeeds only if the caller's idea of
the current head is right; that single primitive is what makes every state
transition of a shard linearizable, across threads, processes and machines.

Contract:

- ``head(key)``: the row with the largest SeqNo, or ``None`` for a new key.
- ``compare_and_set(key, expected, new)``: appends ``new`` iff the current head
  SeqNo is ``expected`` (``None``: the key has no rows) and ``new.seqno`` is
  greater than ``expected``. Returns :class:`CaSCommitted` or
  :class:`CaSMismatch` (a lost race is a value, not an exception). ``new.seqno``
  must be exactly ``expected + 1`` (1 for a new key), so two racers always
  contend for the same primary key and at most one can win. Raises
  :class:`~pyspark_persist.state.errors.Indeterminate` if it cannot tell.
- ``compare_and_set_many([(key, expected, new), ...])``: the same check for
  several distinct keys, and every row appended or none, in one atomic step
  of the store (one database transaction): :class:`CaSCommitted` or
  :class:`CaSManyMismatch` naming the keys whose head was not the expected
  one. What makes a transaction across shards one state change
  (:mod:`pyspark_persist.state.txn_commit`): every shard's state lives in
  this one store. Raises ``Indeterminate`` if it cannot tell; then either
  every row landed or none did.
- ``scan(key, from_seqno, limit)``: rows with SeqNo >= ``from_seqno`` in order.
- ``truncate(key, seqno)``: deletes rows with SeqNo < ``seqno``; refuses (raises
  InvalidUsage) to delete the head. Returns the number deleted.
- ``list_keys()``: every key with at least one row.

A key's rows are never all deleted: dropping a shard leaves a tombstone row
(:mod:`pyspark_persist.state.drop`), so a key's SeqNos never start again at 1.

Backends, by URI scheme, through :func:`open_consensus` (the table is in
:mod:`pyspark_persist.state.registry`): ``sqlite:///path``
(the embedded default), ``postgresql://...`` (psycopg 3 through SQLAlchemy,
one statement per compare-and-set, after the pool's pre-ping) and ``mem://name``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..errors import InvalidUsage
from ..registry import open_store
from ..tracing import CONSENSUS_TRACED, trace_store_class

SeqNo = int
"""A shard state's version: starts at 1 and increases by one with every change."""


@dataclass(frozen=True)
class VersionedData:
    """One Consensus row: the encoded state diff that produced version ``seqno``."""

    seqno: SeqNo
    data: bytes


@dataclass(frozen=True)
class CaSCommitted:
    """compare_and_set appended the new row."""


@dataclass(frozen=True)
class CaSMismatch:
    """compare_and_set lost a race: ``current`` is the head it found (``None``: no rows)."""

    current: SeqNo | None


CaSResult = CaSCommitted | CaSMismatch


@dataclass(frozen=True)
class CaSManyMismatch:
    """compare_and_set_many appended nothing: ``moved`` maps each key whose head was not the
    expected one to the head found (``None``: no rows). Empty only when the heads had moved
    back by the time they were read (a rival's rows truncated meanwhile): re-read them all."""

    moved: Mapping[str, SeqNo | None]


CaSManyResult = CaSCommitted | CaSManyMismatch
CaSOp = tuple[str, "SeqNo | None", VersionedData]
"""One key of a compare_and_set_many: the key, the head SeqNo expected, the row to append."""


class Consensus(ABC):
    """A linearizable, versioned log per key. See the module doc for the contract."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Every backend's compare_and_set/truncate opens a span (state.tracing).
        trace_store_class(cls, "Consensus", CONSENSUS_TRACED)

    @property
    @abstractmethod
    def uri(self) -> str:
        """The URI this Consensus was opened from (password removed), to reopen it elsewhere."""

    @abstractmethod
    def head(self, key: str) -> VersionedData | None:
        """Return the newest row for ``key`` or ``None`` if it has none."""

    @abstractmethod
    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """Append ``new`` iff the head SeqNo is ``expected``; one atomic step.

        Raises InvalidUsage when ``new.seqno != (expected or 0) + 1``.
        """

    def compare_and_set_many(self, ops: Sequence[CaSOp]) -> CaSManyResult:
        """Append every ``(key, expected, new)`` row iff every key's head SeqNo is its
        ``expected``: all in one atomic step, or none.

        InvalidUsage for a repeated key, no keys, or a row that is not its key's next SeqNo.
        A backend that cannot change several keys atomically refuses (this default), rather
        than commit them one by one.
        """
        raise InvalidUsage(
            f"consensus {self.uri} ({type(self).__name__}) cannot compare-and-set several keys "
            "at once, which a transaction across shards needs: use sqlite://, postgresql:// or "
            "mem:// for Consensus"
        )

    @abstractmethod
    def scan(self, key: str, from_seqno: SeqNo, limit: int | None = None) -> list[VersionedData]:
        """Return rows with SeqNo >= ``from_seqno`` in ascending order, at most ``limit``."""

    @abstractmethod
    def truncate(self, key: str, seqno: SeqNo) -> int:
        """Delete rows with SeqNo < ``seqno`` (never the head); return how many were deleted."""

    @abstractmethod
    def list_keys(self) -> list[str]:
        """Return every key that has at least one row."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections; the Consensus must not be used afterwards."""


def open_consensus(uri: str) -> Consensus:
    """Open the Consensus named by ``uri`` (schemes: :data:`~..registry.BACKENDS`)."""
    opened: Consensus = open_store("consensus", uri)
    return opened
