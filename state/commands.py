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

from dataclasses import dataclass
from typing import Generic, TypeVar

from pyspark_persist.state.diff import DiffBuilder, StateDiff
from pyspark_persist.state.state import (
    EMPTY_STATE,
    Batch,
    PartRef,
    ShardState,
    Time,
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


def create_shard(shard_id: str, schema: bytes, now_ms: int) -> StateDiff:
    """The diff that brings a new shard from nothing to SeqNo 1."""
    return (
        DiffBuilder(EMPTY_STATE)
        .set("shard_id", shard_id)
        .set("schema", schema)
        .set("created_ms", now_ms)
        .build()
    )


def compare_and_append(
    state: ShardState,
    *,
    parts: tuple[PartRef, ...],
    expected_upper: Time,
    new_upper: Time,
    writer_id: str,
    token: int,
    now_ms: int,
) -> Outcome[AppendResult]:
    """Append one batch ``[expected_upper, new_upper)`` made of ``parts``, exactly once.

    The token is checked before the upper: a writer whose earlier attempt
    landed learns so even after other writers moved the upper on.
    """
    writer = state.writers.get(writer_id)
    if writer is not None and token <= writer.last_token:
        return Refuse(AlreadyCommitted(token=writer.last_token, upper=state.upper))
    if state.upper != expected_upper:
        return Refuse(UpperMismatch(current=state.upper))
    b = DiffBuilder(state)
    last = state.trace[-1] if state.trace else None
    if not parts and last is not None and not last.parts and last.since == state.since:
        # Empty appends only advance the upper: extend the previous empty batch so
        # an idle stream does not grow the trace by one batch per micro-batch.
        b.delete("batches", last.key)
        batch = Batch(lower=last.lower, upper=new_upper, since=last.since, parts=())
    else:
        batch = Batch(lower=expected_upper, upper=new_upper, since=state.since, parts=parts)
    b.put("batches", batch.key, batch)
    b.set("upper", new_upper)
    b.put("writers", writer_id, WriterState(last_token=token, last_heartbeat_ms=now_ms))
    diff = b.build()
    return Apply(diff, Committed(upper=new_upper, seqno=diff.to_seqno))


def add_rollup(state: ShardState, *, seqno: int, key: str) -> Outcome[bool]:
    """Record that Blob holds the full state of ``seqno`` under ``key``."""
    if seqno in state.rollups:
        return Refuse(False)
    diff = DiffBuilder(state).put("rollups", seqno, key).build()
    return Apply(diff, True)
