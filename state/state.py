"""The shard's state as plain frozen values, with no I/O.

A :class:`ShardState` is what one Consensus SeqNo says the shard is: its
schema, its frontiers, its trace of batches, and the registered writers and
readers. It never changes in place; every change is a :class:`StateDiff`
(see :mod:`pyspark_persist.state.diff`) computed by a pure command and
applied with :meth:`ShardState.apply`, and the same diff is what Consensus
stores and PubSub pushes, so a process that applies the diffs it receives
ends up with exactly the state the writer computed.

Invariants (checked by :meth:`ShardState.check_invariants` in tests):

- ``seqno`` increases by one with every diff;
- ``upper`` only advances; ``since`` only advances (it is the meet of the
  readers' since holds, and may pass ``upper``: then no read is possible
  until writes catch up; a shard with a retention period also moves it up
  to ``now - retention``, never past a reader's hold or ``upper - 1``);
- the batches tile ``[0, upper)``: sorted by ``lower``, each one's ``lower``
  is the previous one's ``upper``, none is empty (``lower < upper``).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from .errors import CorruptData

Time = int
"""An update's time: an unsigned 64-bit integer (milliseconds since the epoch for Spark writes)."""

EMPTY_MAP: Mapping[Any, Any] = MappingProxyType({})


@dataclass(frozen=True)
class PartRef:
    """One immutable run of updates: a Parquet object in Blob, or tiny Arrow IPC bytes inline.

    ``min_time``/``max_time`` are the stored times; when ``ts_rewrite`` is set,
    every time is read as ``max(time, ts_rewrite)``. That is how a part staged
    before its commit time was known (the Spark sink) gets its final time
    without rewriting data: the commit records the time, the bytes never change.
    ``negate`` reads every diff with its sign flipped: an atomic replace
    retracts the shard's old contents by referencing their parts negated,
    without rereading or copying a byte.
    """

    key: str | None
    inline: bytes | None
    size_bytes: int
    rows: int
    min_time: Time
    max_time: Time
    ts_rewrite: Time | None = None
    negate: bool = False
    dmin: int | None = None
    dmax: int | None = None
    stats: Mapping[str, tuple[Any, Any]] | None = None
    """Per-column (min, max) of numeric and short string columns, for skipping parts."""
    crc: int | None = None
    """CRC-32 of the stored bytes: a fetch that does not match is corrupt, never read."""
    fmt: str = "parquet"
    """How a Blob part is encoded: ``"parquet"``; ``"arrow"`` (an Arrow IPC stream: cheaper to
    write and read); or ``"arrow-rows"`` (an Arrow IPC stream of the row columns only, every
    update an insert at ``min_time``: what the Spark sink stages). Compaction rewrites Arrow
    parts as Parquet."""

    @property
    def effective_dmin(self) -> int | None:
        """The smallest diff a reader sees (``None``: unknown)."""
        return (-self.dmax if self.dmax is not None else None) if self.negate else self.dmin

    @property
    def identity(self) -> str | bytes:
        """What names the stored data: the Blob key, or the inline bytes themselves."""
        return self.key if self.key is not None else (self.inline or b"")

    @property
    def effective_min_time(self) -> Time:
        """The smallest time a reader sees in this part."""
        return self.min_time if self.ts_rewrite is None else max(self.min_time, self.ts_rewrite)

    @property
    def effective_max_time(self) -> Time:
        """The largest time a reader sees in this part."""
        return self.max_time if self.ts_rewrite is None else max(self.max_time, self.ts_rewrite)

    def to_json(self) -> dict[str, Any]:
        """Encode for state diffs, rollups and the wire (inline bytes as base64)."""
        from base64 import b64encode

        out: dict[str, Any] = {
            "size": self.size_bytes,
            "rows": self.rows,
            "tmin": self.min_time,
            "tmax": self.max_time,
        }
        if self.key is not None:
            out["key"] = self.key
        if self.inline is not None:
            out["inline"] = b64encode(self.inline).decode("ascii")
        if self.ts_rewrite is not None:
            out["tsr"] = self.ts_rewrite
        if self.negate:
            out["neg"] = True
        if self.dmin is not None:
            out["dmin"] = self.dmin
        if self.dmax is not None:
            out["dmax"] = self.dmax
        if self.stats:
            out["stats"] = {k: list(v) for k, v in self.stats.items()}
        if self.crc is not None:
            out["crc"] = self.crc
        if self.fmt != "parquet":
            out["fmt"] = self.fmt
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> PartRef:
        """Decode what :meth:`to_json` produced."""
        from base64 import b64decode

        try:
            inline = d.get("inline")
            return cls(
                key=d.get("key"),
                inline=None if inline is None else b64decode(inline),
                size_bytes=int(d["size"]),
                rows=int(d["rows"]),
                min_time=int(d["tmin"]),
                max_time=int(d["tmax"]),
                ts_rewrite=None if d.get("tsr") is None else int(d["tsr"]),
                negate=bool(d.get("neg", False)),
                dmin=None if d.get("dmin") is None else int(d["dmin"]),
                dmax=None if d.get("dmax") is None else int(d["dmax"]),
                stats={k: (v[0], v[1]) for k, v in d["stats"].items()} if "stats" in d else None,
                crc=None if d.get("crc") is None else int(d["crc"]),
                fmt=str(d.get("fmt", "parquet")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptData(f"malformed part reference {dict(d)!r}: {e}") from e


@dataclass(frozen=True)
class Batch:
    """The updates of the time interval ``[lower, upper)``, as zero or more parts.

    ``since`` says times below it were advanced to it by compaction, so the
    batch answers reads only at or past ``since``. A replace's batch starts
    with ``retractions`` negated parts that cancel everything before it, so
    everything up to it adds up to its other parts: the next replace
    retracts only those and the batches after it (see
    :func:`~pyspark_persist.state.commands.compare_and_append`).
    """

    lower: Time
    upper: Time
    since: Time
    parts: tuple[PartRef, ...]
    retractions: int = 0
    tombstones: tuple[PartRef, ...] = ()
    """Of a keyed shard with a sequence column: parts of ``(key columns, sequence)`` of the keys
    deleted in this batch, which no reader reads (see :mod:`pyspark_persist.state.upsert`): an
    upsert older than a key's delete must not bring it back. Compaction carries them along."""

    @property
    def all_parts(self) -> tuple[PartRef, ...]:
        """Every part the batch references in Blob or inline: its data and its tombstones."""
        return self.parts + self.tombstones if self.tombstones else self.parts

    @property
    def key(self) -> str:
        """The batch's name in state: batches tile the time line, so its interval is unique."""
        return f"{self.lower}-{self.upper}"

    @cached_property
    def rows(self) -> int:
        """Updates in the batch (before consolidation)."""
        return sum(p.rows for p in self.parts)

    @cached_property
    def size_bytes(self) -> int:
        """Encoded bytes of the batch's parts."""
        return sum(p.size_bytes for p in self.parts)

    @cached_property
    def inline_bytes(self) -> int:
        """Bytes of the batch held inline in state rather than in Blob."""
        return sum(p.size_bytes for p in self.all_parts if p.inline is not None)

    def to_json(self) -> dict[str, Any]:
        """Encode for state diffs and rollups."""
        return {
            "lower": self.lower,
            "upper": self.upper,
            "since": self.since,
            "parts": [p.to_json() for p in self.parts],
            **({"retract": self.retractions} if self.retractions else {}),
            **({"tomb": [p.to_json() for p in self.tombstones]} if self.tombstones else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Batch:
        """Decode what :meth:`to_json` produced."""
        try:
            return cls(
                lower=int(d["lower"]),
                upper=int(d["upper"]),
                since=int(d["since"]),
                parts=tuple(PartRef.from_json(p) for p in d["parts"]),
                retractions=int(d.get("retract", 0)),
                tombstones=tuple(PartRef.from_json(p) for p in d.get("tomb", ())),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptData(f"malformed batch {dict(d)!r}: {e}") from e


@dataclass(frozen=True)
class TxnMark:
    """The transaction a writer's last commit belonged to: its id and its commit time, the
    same in every shard it wrote (see :mod:`pyspark_persist.state.txn`)."""

    txn_id: str
    time: Time


@dataclass(frozen=True)
class WriterState:
    """What state remembers about a writer: the last idempotency token it committed."""

    last_token: int
    last_heartbeat_ms: int
    txn: TxnMark | None = None
    """Set when that commit was part of a transaction across shards (``None``: a plain write)."""

    def to_json(self) -> dict[str, Any]:
        """Encode for state diffs and rollups (``txn`` only when set, so plain writes' diffs
        stay as they were)."""
        d: dict[str, Any] = {"token": self.last_token, "hb": self.last_heartbeat_ms}
        if self.txn is not None:
            d["txn"] = {"id": self.txn.txn_id, "t": self.txn.time}
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> WriterState:
        """Decode what :meth:`to_json` produced."""
        txn = d.get("txn")
        return cls(
            last_token=int(d["token"]),
            last_heartbeat_ms=int(d["hb"]),
            txn=None if txn is None else TxnMark(str(txn["id"]), int(txn["t"])),
        )


@dataclass(frozen=True)
class LeasedReaderState:
    """A reader whose since hold and SeqNo hold last only while it heartbeats.

    ``seqno`` is the oldest SeqNo whose parts the reader may still fetch (it
    leases every SeqNo it hands parts out from, to itself or to other
    processes); GC keeps everything any state at or after it references.
    It only advances: a reader leases SeqNos at or after its recorded one.
    """

    since: Time
    seqno: int
    last_heartbeat_ms: int
    lease_duration_ms: int

    @property
    def expires_at_ms(self) -> int:
        """Wall-clock millisecond after which anyone may expire this reader."""
        return self.last_heartbeat_ms + self.lease_duration_ms

    def to_json(self) -> dict[str, Any]:
        """Encode for state diffs and rollups."""
        return {
            "since": self.since,
            "seqno": self.seqno,
            "hb": self.last_heartbeat_ms,
            "lease": self.lease_duration_ms,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeasedReaderState:
        """Decode what :meth:`to_json` produced."""
        return cls(
            since=int(d["since"]),
            seqno=int(d["seqno"]),
            last_heartbeat_ms=int(d["hb"]),
            lease_duration_ms=int(d["lease"]),
        )


@dataclass(frozen=True)
class CriticalReaderState:
    """A since hold that never expires; only the holder of the newest ``opaque`` may move it."""

    since: Time
    opaque: int

    def to_json(self) -> dict[str, Any]:
        """Encode for state diffs and rollups."""
        return {"since": self.since, "opaque": self.opaque}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> CriticalReaderState:
        """Decode what :meth:`to_json` produced."""
        return cls(since=int(d["since"]), opaque=int(d["opaque"]))


@dataclass(frozen=True)
class ConsumerState:
    """A named, durable consumer of the shard (see :mod:`pyspark_persist.state.consumers`).

    Like a critical reader it holds ``since`` until it moves it; unlike one it
    also records what it consumed (``position``, ``upper``), the micro-batches
    planned past it (so a query resuming without its checkpoint replays the
    same ranges), who holds it (``holder``) and the fencing token ``epoch``.
    """

    since: Time
    upper: Time
    position: str
    planned: tuple[tuple[str, str], ...]
    holder: str
    epoch: int
    created_ms: int
    committed_ms: int
    expiry_ms: int = 0
    expired: bool = False
    acquired_ms: int = 0
    """Wall ms of the last acquire (or reset): with ``committed_ms``, what expiry measures from."""
    reader: str = ""
    """The leased reader of the query holding it (``""``: none named): the holder counts as
    live only while that reader's lease does, so a query that died or stopped without
    releasing (PySpark never calls a stopped source's ``stop``) stops holding it."""

    @property
    def active_ms(self) -> int:
        """Wall ms of the consumer's last sign of life (creation, acquire, reset or advance)."""
        return max(self.created_ms, self.committed_ms, self.acquired_ms)

    def to_json(self) -> dict[str, Any]:
        """Encode for state diffs and rollups (defaults left out)."""
        out: dict[str, Any] = {
            "since": self.since,
            "upper": self.upper,
            "pos": self.position,
            "planned": [list(p) for p in self.planned],
            "holder": self.holder,
            "epoch": self.epoch,
            "created": self.created_ms,
            "committed": self.committed_ms,
        }
        if self.expiry_ms:
            out["expiry"] = self.expiry_ms
        if self.expired:
            out["expired"] = True
        if self.acquired_ms:
            out["acquired"] = self.acquired_ms
        if self.reader:
            out["reader"] = self.reader
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ConsumerState:
        """Decode what :meth:`to_json` produced."""
        try:
            return cls(
                since=int(d["since"]),
                upper=int(d["upper"]),
                position=str(d["pos"]),
                planned=tuple((str(s), str(e)) for s, e in d["planned"]),
                holder=str(d["holder"]),
                epoch=int(d["epoch"]),
                created_ms=int(d["created"]),
                committed_ms=int(d["committed"]),
                expiry_ms=int(d.get("expiry", 0)),
                expired=bool(d.get("expired", False)),
                acquired_ms=int(d.get("acquired", 0)),
                reader=str(d.get("reader", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptData(f"malformed consumer {dict(d)!r}: {e}") from e


MAP_CODECS: dict[str, Any] = {
    "batches": Batch,
    "writers": WriterState,
    "leased_readers": LeasedReaderState,
    "critical_readers": CriticalReaderState,
    "consumers": ConsumerState,
}
"""The map-valued fields of ShardState and the type of their values (rollups map int->str)."""

SCALARS: tuple[str, ...] = (
    "shard_id",
    "schema",
    "since",
    "upper",
    "created_ms",
    "last_gc_seqno",
    "retention_ms",
    "incarnation",
    "keys",
)
"""The scalar fields of ShardState that a diff may set (seqno is the diff's own)."""


@dataclass(frozen=True)
class ShardState:
    """The shard at one SeqNo. Immutable; see the module doc for its invariants."""

    shard_id: str
    seqno: int
    schema: bytes
    since: Time
    upper: Time
    created_ms: int = 0
    last_gc_seqno: int = 0
    retention_ms: int = 0
    """How far behind the clock maintenance keeps since (0: no retention, readers alone move it);
    see :mod:`pyspark_persist.state.retention`."""
    incarnation: str = ""
    """The id minted when this shard was created: a shard dropped and created again under its
    name is another incarnation, and a handle bound to one never touches the other (``""``: a
    shard created before incarnations existed)."""
    keys: tuple[str, ...] = ()
    """The key columns of a keyed shard, set at creation and never changed: every write is an
    upsert, and at every time the shard holds at most one row per key (see
    :mod:`pyspark_persist.state.keyed`). ``()``: an unkeyed shard (every shard written before
    keys existed is one)."""
    batches: Mapping[str, Batch] = field(default_factory=lambda: EMPTY_MAP)
    writers: Mapping[str, WriterState] = field(default_factory=lambda: EMPTY_MAP)
    leased_readers: Mapping[str, LeasedReaderState] = field(default_factory=lambda: EMPTY_MAP)
    critical_readers: Mapping[str, CriticalReaderState] = field(default_factory=lambda: EMPTY_MAP)
    consumers: Mapping[str, ConsumerState] = field(default_factory=lambda: EMPTY_MAP)
    """Named consumers (issue 36): absent from states written before them, so empty there."""
    rollups: Mapping[int, str] = field(default_factory=lambda: EMPTY_MAP)

    @cached_property
    def trace(self) -> tuple[Batch, ...]:
        """The batches sorted by ``lower``: they tile ``[0, upper)``."""
        return tuple(sorted(self.batches.values(), key=_lower))

    @cached_property
    def inline_bytes(self) -> int:
        """Bytes of update data held inline in state (bounded by the writer's knob)."""
        return sum(b.inline_bytes for b in self.batches.values())

    @cached_property
    def seqno_since(self) -> int:
        """The oldest SeqNo any reader may still fetch parts of: GC keeps what it references."""
        return min((r.seqno for r in self.leased_readers.values()), default=self.seqno)

    def apply(self, diff: StateDiff) -> ShardState:
        """Return the state after ``diff``; refuses a diff that does not follow this SeqNo."""
        if diff.from_seqno != self.seqno:
            raise CorruptData(
                f"state diff for shard {self.shard_id!r} goes from SeqNo {diff.from_seqno} "
                f"but the state is at SeqNo {self.seqno}"
            )
        changes: dict[str, Any] = dict(diff.scalars)
        for name, (puts, dels) in diff.maps.items():
            current = getattr(self, name)
            updated = {k: v for k, v in current.items() if k not in dels}
            updated.update(puts)
            changes[name] = MappingProxyType(updated)
        new = replace(self, seqno=diff.to_seqno, **changes)
        if "batches" in diff.maps:
            self._carry_batch_totals(new, *diff.maps["batches"])
        return new

    def _carry_batch_totals(
        self, new: ShardState, puts: Mapping[str, Batch], dels: frozenset[str]
    ) -> None:
        """Give ``new`` this state's ``trace`` and ``inline_bytes``, updated by the batches
        put and deleted, where this state has them: a commit touches a batch or two, and
        re-sorting and re-summing every batch on each one-row write costs more than it does.
        (Equal to what the cached properties compute: they are filled in ahead of time.)
        """
        removed = [self.batches[k] for k in {*dels, *puts} if k in self.batches]
        cached = self.__dict__
        if "inline_bytes" in cached:
            new.__dict__["inline_bytes"] = (
                cached["inline_bytes"]
                - sum(b.inline_bytes for b in removed)
                + sum(b.inline_bytes for b in puts.values())
            )
        if "trace" in cached:
            gone = {id(b) for b in removed}
            trace = [b for b in cached["trace"] if id(b) not in gone]
            for b in puts.values():
                bisect.insort(trace, b, key=_lower)
            new.__dict__["trace"] = tuple(trace)

    def check_invariants(self) -> None:
        """Raise CorruptData when the state breaks an invariant from the module doc."""
        expected_lower = 0
        for batch in self.trace:
            if batch.lower != expected_lower or batch.upper <= batch.lower:
                raise CorruptData(
                    f"shard {self.shard_id!r}: batch [{batch.lower}, {batch.upper}) does not "
                    f"follow the previous upper {expected_lower}"
                )
            expected_lower = batch.upper
        if expected_lower != self.upper:
            raise CorruptData(
                f"shard {self.shard_id!r}: batches end at {expected_lower}, upper is {self.upper}"
            )


@dataclass(frozen=True)
class StateDiff:
    """The change from SeqNo ``from_seqno`` to ``to_seqno``: scalars set, and per map-valued
    field the entries put and the keys deleted. Built by
    :class:`~pyspark_persist.state.diff.DiffBuilder`, encoded by :mod:`~pyspark_persist.state.diff`.
    """

    shard_id: str
    from_seqno: int
    to_seqno: int
    scalars: Mapping[str, Any] = field(default_factory=dict)
    maps: Mapping[str, tuple[Mapping[Any, Any], frozenset[Any]]] = field(default_factory=dict)

    @property
    def put_batches(self) -> tuple[Batch, ...]:
        """The batches this diff adds (a write's, a merge's, an extended empty batch)."""
        return tuple(self.maps.get("batches", ({}, frozenset()))[0].values())

    @property
    def deleted_batches(self) -> frozenset[str]:
        """The keys of the batches this diff removes (replaced by a merge, or extended)."""
        return frozenset(self.maps.get("batches", ({}, frozenset()))[1])


def _lower(batch: Batch) -> Time:
    return batch.lower


EMPTY_STATE = ShardState(shard_id="", seqno=0, schema=b"", since=0, upper=0)
"""The state before SeqNo 1: the creation diff (and every rollup) applies to it."""
