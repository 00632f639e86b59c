"""Pure state transitions: ``(state, arguments) -> Apply(diff, result) | Refuse(result)``.

Nothing here does I/O or reads a clock; :mod:`pyspark_persist.state.machine`
runs a command against the newest state it knows, compare-and-sets the diff,
and on a lost race runs it again against the fresher state. Because a
command is re-evaluated from scratch on every attempt, it must decide
*everything* from the state it is given: that is what makes a retry after an
unknown outcome safe (the idempotency token in state answers "did my write
land?").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import Generic, TypeVar

from .diff import DiffBuilder
from .schema import decode_schema, encode_schema, evolve_schema
from .state import (
    EMPTY_STATE,
    Batch,
    ConsumerState,
    CriticalReaderState,
    LeasedReaderState,
    PartRef,
    ShardState,
    StateDiff,
    Time,
    TxnMark,
    WriterState,
)

R = TypeVar("R")


@dataclass(frozen=True)
class Apply(Generic[R]):
    """The command changes state: compare-and-set ``diff``, then return ``result``."""

    diff: StateDiff
    result: R


@dataclass(frozen=True)
class Refuse(Generic[R]):
    """The command does not change state; return ``result`` without touching Consensus."""

    result: R


Outcome = Apply[R] | Refuse[R]


@dataclass(frozen=True)
class Committed:
    """The append landed: the shard's upper is now ``upper``, at state SeqNo ``seqno``."""

    upper: Time
    seqno: int


@dataclass(frozen=True)
class UpperMismatch:
    """The append did not land because the shard's upper is ``current``, not the expected one."""

    current: Time


@dataclass(frozen=True)
class AlreadyCommitted:
    """A commit with this writer's ``token`` (or a later one) already landed; nothing was applied.

    This is the answer to a retry after an unknown outcome, and to a Spark
    micro-batch replayed after a crash.
    """

    token: int
    upper: Time


AppendResult = Committed | UpperMismatch | AlreadyCommitted


def create_shard(
    shard_id: str,
    schema: bytes,
    now_ms: int,
    *,
    incarnation: str,
    retention_ms: int = 0,
    after_seqno: int = 0,
    keys: tuple[str, ...] = (),
) -> StateDiff:
    """The diff that creates a shard: from nothing (SeqNo 0) to SeqNo 1, or on top of the
    tombstone a drop left at ``after_seqno``, so the new shard's SeqNos go on from there.

    ``incarnation`` is the id minted for this creation (see ``ShardState.incarnation``);
    GC starts from ``after_seqno``, as nothing of this shard lies below it. ``keys``: the key
    columns of a keyed shard (checked by the caller, :func:`~.keyed.validate_keys`).
    """
    b = DiffBuilder(dc_replace(EMPTY_STATE, seqno=after_seqno))
    b.set(shard_id=shard_id, schema=schema, created_ms=now_ms, incarnation=incarnation)
    b.set(keys=keys or None)
    return b.set(retention_ms=retention_ms or None, last_gc_seqno=after_seqno or None).build()


def compare_and_append(
    state: ShardState,
    *,
    parts: tuple[PartRef, ...],
    expected_upper: Time,
    new_upper: Time,
    writer_id: str,
    token: int,
    now_ms: int,
    replace: bool = False,
    schema: bytes | None = None,
    tombstones: tuple[PartRef, ...] = (),
    txn: TxnMark | None = None,
) -> Outcome[AppendResult]:
    """Append one batch ``[expected_upper, new_upper)`` made of ``parts``, exactly once.

    The token is checked before the upper: a writer whose earlier attempt
    landed learns so even after other writers moved the upper on. With
    ``replace`` the batch also retracts everything the shard holds, by
    negated references to its parts at the first time of the new rows (so a
    read sees the old rows before it and only new ones from it on, never
    both), or at ``new_upper - 1`` when there are none: one atomic step from
    the old contents to exactly ``parts``. See :func:`_retraction`.

    ``schema`` (a merge-schema write: the schema its parts were staged with)
    adds the columns the shard lacks to the shard's schema in the same diff as
    the data, so no state ever holds the new schema without the write or the
    write without it. It is merged with the schema in *this* state, so a
    concurrent writer's additions stay; SchemaMismatch when the two conflict.
    ``tombstones``: an upsert's deleted keys and sequences (``Batch.tombstones``).
    ``txn``: the transaction this batch is one shard's share of, recorded with
    the writer's token (see :mod:`.txn`).
    """
    writer = state.writers.get(writer_id)
    if writer is not None and token <= writer.last_token:
        return Refuse(AlreadyCommitted(token=writer.last_token, upper=state.upper))
    if state.upper != expected_upper:
        return Refuse(UpperMismatch(current=state.upper))
    retractions = 0
    if replace:
        first = min((p.effective_min_time for p in parts), default=new_upper - 1)
        retract = _retraction(state.trace, first)
        retractions = len(retract)
        parts = retract + parts
    b = DiffBuilder(state)
    if schema is not None and schema != state.schema:
        evolved = encode_schema(
            evolve_schema(
                decode_schema(state.schema),
                decode_schema(schema),
                state.shard_id,
                "merge-schema commit (racing another writer's schema change)",
            )
        )
        if evolved != state.schema:
            b.set(schema=evolved)
    last = state.trace[-1] if state.trace else None
    extend = last is not None and not last.parts and not last.tombstones
    if not parts and not tombstones and extend and last is not None and last.since == state.since:
        # Empty appends only advance the upper: extend the previous empty batch so
        # an idle stream does not grow the trace by one batch per micro-batch.
        b.delete_batch(last.key)
        batch = Batch(lower=last.lower, upper=new_upper, since=last.since, parts=())
    else:
        batch = Batch(expected_upper, new_upper, state.since, parts, retractions, tombstones)
    b.put_batch(batch)
    b.set(upper=new_upper)
    b.put_writer(writer_id, WriterState(last_token=token, last_heartbeat_ms=now_ms, txn=txn))
    diff = b.build()
    return Apply(diff, Committed(upper=new_upper, seqno=diff.to_seqno))


def _retraction(trace: tuple[Batch, ...], t: Time) -> tuple[PartRef, ...]:
    """Negated references, at time ``t``, that cancel everything ``trace`` holds.

    Everything up to the newest replace's batch adds up to that batch's own
    new parts (its retractions cancel the rest), so only those and the
    batches after it are negated: a replace adds the parts of the last
    replace and of the appends since, never every earlier reference again
    (which doubled the references with each replace). A batch compaction
    merged no longer marks a replace, and is retracted whole.
    """
    start = 0
    for i in range(len(trace) - 1, -1, -1):
        if trace[i].retractions:
            start = i
            break
    negated: list[PartRef] = []
    for i, batch in enumerate(trace[start:]):
        skip = batch.retractions if i == 0 and batch.retractions else 0
        negated.extend(dc_replace(p, ts_rewrite=t, negate=not p.negate) for p in batch.parts[skip:])
    return tuple(negated)


def add_rollup(state: ShardState, *, seqno: int, key: str) -> Outcome[bool]:
    """Record that Blob holds the full state of ``seqno`` under ``key``."""
    if seqno in state.rollups:
        return Refuse(False)
    diff = DiffBuilder(state).put_rollup(seqno, key).build()
    return Apply(diff, True)


def meet_since(
    state: ShardState,
    leased: Mapping[str, LeasedReaderState] | None = None,
    critical: Mapping[str, CriticalReaderState] | None = None,
    consumers: Mapping[str, ConsumerState] | None = None,
) -> Time:
    """The shard's since after a reader change: the meet of every hold, never going back.

    Every hold counts: leased readers, critical readers and the named consumers that have
    not expired (an expired consumer stops holding data, see :mod:`.consumers`).
    """
    lr = state.leased_readers if leased is None else leased
    cr = state.critical_readers if critical is None else critical
    holds = [r.since for r in lr.values()] + [r.since for r in cr.values()]
    holds += consumer_holds(state.consumers if consumers is None else consumers)
    return max(state.since, min(holds)) if holds else state.since


def consumer_holds(consumers: Mapping[str, ConsumerState]) -> list[Time]:
    """The since holds of the consumers that still hold data (every one not expired)."""
    return [c.since for c in consumers.values() if not c.expired]


def register_leased_reader(
    state: ShardState, *, reader_id: str, now_ms: int, lease_ms: int
) -> Outcome[LeasedReaderState]:
    """Add a leased reader holding since at the shard's since and SeqNo at the current one."""
    existing = state.leased_readers.get(reader_id)
    if existing is not None:
        return Refuse(existing)
    reader = LeasedReaderState(
        since=state.since, seqno=state.seqno, last_heartbeat_ms=now_ms, lease_duration_ms=lease_ms
    )
    return Apply(DiffBuilder(state).put_leased_reader(reader_id, reader).build(), reader)


def heartbeat_leased_reader(
    state: ShardState,
    *,
    reader_id: str,
    now_ms: int,
    seqno: int | None,
    new_since: Time | None = None,
) -> Outcome[LeasedReaderState | None]:
    """Extend a reader's lease, advance its SeqNo hold and optionally its since.

    ``seqno`` is the oldest SeqNo the reader still leases (``None``: none, so
    the hold moves to the current SeqNo). Refuses with ``None`` when the
    reader has expired: its holds are gone and it must not read on.
    """
    reader = state.leased_readers.get(reader_id)
    if reader is None:
        return Refuse(None)
    hold = state.seqno if seqno is None else seqno
    updated = LeasedReaderState(
        since=reader.since if new_since is None else max(reader.since, new_since),
        seqno=max(reader.seqno, min(hold, state.seqno)),
        last_heartbeat_ms=max(reader.last_heartbeat_ms, now_ms),
        lease_duration_ms=reader.lease_duration_ms,
    )
    b = DiffBuilder(state).put_leased_reader(reader_id, updated)
    leased = dict(state.leased_readers)
    leased[reader_id] = updated
    b.set(since=meet_since(state, leased=leased))
    return Apply(b.build(), updated)


def expire_leased_readers(
    state: ShardState, *, reader_ids: tuple[str, ...] = (), now_ms: int | None = None
) -> Outcome[tuple[str, ...]]:
    """Remove the named readers and, given ``now_ms``, every reader whose lease ran out."""
    gone = {r for r in reader_ids if r in state.leased_readers}
    if now_ms is not None:
        gone |= {r for r, s in state.leased_readers.items() if s.expires_at_ms < now_ms}
    if not gone:
        return Refuse(())
    b = DiffBuilder(state)
    for r in gone:
        b.delete_leased_reader(r)
    leased = {r: s for r, s in state.leased_readers.items() if r not in gone}
    b.set(since=meet_since(state, leased=leased))
    return Apply(b.build(), tuple(sorted(gone)))


@dataclass(frozen=True)
class CriticalSince:
    """The outcome of a critical since change: ``ok`` or the holder's current state."""

    ok: bool
    current: CriticalReaderState


def register_critical_reader(
    state: ShardState, *, reader_id: str, opaque: int
) -> Outcome[CriticalReaderState]:
    """Add (or return) a since hold that never expires."""
    existing = state.critical_readers.get(reader_id)
    if existing is not None:
        return Refuse(existing)
    reader = CriticalReaderState(since=state.since, opaque=opaque)
    return Apply(DiffBuilder(state).put_critical_reader(reader_id, reader).build(), reader)


def compare_and_downgrade_since(
    state: ShardState,
    *,
    reader_id: str,
    expected_opaque: int,
    new_opaque: int,
    new_since: Time,
) -> Outcome[CriticalSince]:
    """Move a critical hold iff the caller holds the newest fencing token (``opaque``).

    A reader not registered yet is registered, holding ``expected_opaque`` at the shard's
    since. A move that changes neither the hold nor the token is ``ok`` without a diff.
    """
    reader = state.critical_readers.get(reader_id)
    if reader is None:
        reader = CriticalReaderState(since=state.since, opaque=expected_opaque)
    if reader.opaque != expected_opaque:
        return Refuse(CriticalSince(ok=False, current=reader))
    updated = CriticalReaderState(since=max(reader.since, new_since), opaque=new_opaque)
    if updated == state.critical_readers.get(reader_id):
        return Refuse(CriticalSince(ok=True, current=updated))
    critical = dict(state.critical_readers)
    critical[reader_id] = updated
    b = DiffBuilder(state).put_critical_reader(reader_id, updated)
    b.set(since=meet_since(state, critical=critical))
    return Apply(b.build(), CriticalSince(ok=True, current=updated))


def apply_merge(state: ShardState, *, replaced: tuple[Batch, ...], merged: Batch) -> Outcome[bool]:
    """Swap a run of batches for their compacted merge, iff they are all still in state as read.

    Refuses (False) when a write or another compaction changed any of them:
    the compactor then deletes its output and gives up or retries. A retry
    after an unknown outcome finds its own merge in state and reports True,
    so the compactor never deletes parts that state references.
    """
    if state.batches.get(merged.key) == merged:
        return Refuse(True)
    if any(state.batches.get(b.key) != b for b in replaced):
        return Refuse(False)
    b = DiffBuilder(state)
    for old in replaced:
        b.delete_batch(old.key)
    b.put_batch(merged)
    return Apply(b.build(), True)


def expire_writers(state: ShardState, *, now_ms: int, idle_ms: int) -> Outcome[tuple[str, ...]]:
    """Forget writers whose last commit is more than ``idle_ms`` before ``now_ms``.

    A writer entry goes whole (its token with it); the next commit of that
    writer id registers it afresh.
    """
    gone = tuple(
        sorted(w for w, s in state.writers.items() if s.last_heartbeat_ms + idle_ms < now_ms)
    )
    if not gone:
        return Refuse(())
    b = DiffBuilder(state)
    for w in gone:
        b.delete_writer(w)
    return Apply(b.build(), gone)


def fence(state: ShardState) -> Outcome[int]:
    """Take the next SeqNo with a diff that changes nothing; the result is that SeqNo.

    Every compare-and-set attempt carries the SeqNo it expects to follow, so
    once this lands, no attempt computed against this state or an older one
    (one whose reply was lost, still in flight in a slow store or another
    process) can land any more. Cleanup that must not race such an attempt
    fences first (see :func:`~pyspark_persist.state.write.abandon_staged`).
    Applying it twice (a retry after a lost reply) only takes one more SeqNo.
    """
    return Apply(DiffBuilder(state).build(), state.seqno + 1)


def claim_gc(state: ShardState, *, seqno_since: int) -> Outcome[bool]:
    """Record that GC up to ``seqno_since`` is under way, so other processes skip it."""
    if seqno_since <= state.last_gc_seqno:
        return Refuse(False)
    return Apply(DiffBuilder(state).set(last_gc_seqno=seqno_since).build(), True)


def remove_rollups(state: ShardState, *, seqnos: tuple[int, ...]) -> Outcome[tuple[int, ...]]:
    """Forget rollups below the oldest live SeqNo (GC deletes their Blob objects after)."""
    present = tuple(s for s in seqnos if s in state.rollups)
    if not present:
        return Refuse(())
    b = DiffBuilder(state)
    for s in present:
        b.delete_rollup(s)
    return Apply(b.build(), present)
