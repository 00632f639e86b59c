"""The streaming source's offsets: where each micro-batch starts and ends, as pure functions.

Offsets are JSON ``{"shard", "seqno", "upper", "phase", "as_of", "incarnation"}``: every
update with a time below ``upper`` has been emitted (``phase: "listen"``), or
nothing has and the next micro-batch reads the snapshot (``phase:
"snapshot"``, at ``as_of`` if the user asked for a time). A read limit cuts
the snapshot too: a ``snapshot`` offset with ``upper > 0`` says the updates at
times below ``upper`` have been emitted, read as at ``as_of``, the snapshot's
time (fixed by the first cut), and the next cut goes on from there; the last
one ends at ``as_of + 1`` in ``listen``. A stream asked to
start at a time or SeqNo without the snapshot (``startingTime``,
``startingSeqNo``) starts in ``listen`` at that time. ``seqno`` is the
state the offset was observed at, ``incarnation`` the id of the shard's
creation (absent for a shard created before incarnations existed): a query
whose checkpoint names a shard since dropped fails with ShardDropped rather
than read the shard created again under its name. They are built only from
values in state, so the same state always gives the same offset.

Every rule of where a stream goes is a function here of one :class:`ShardState`, the
previous offset and the limits, with no Spark, no store, no clock:

- :func:`initial_offset`: where a query with no checkpoint starts (``startingPosition``,
  ``startingAsOf``, ``startingTime``/``startingSeqNo`` resolved to a time by the caller);
- :func:`next_offset`: Spark's ``latestOffset``, the end of the next micro-batch under
  the read limit (whole batches, see :func:`~pyspark_persist.state.planning.limited_upper`)
  and the ``Trigger.AvailableNow`` upper;
- :func:`micro_batch`: what ``partitions(start, end)`` reads, a whole snapshot, a cut of
  one or a listen range, in times;
- :func:`since_after` and :func:`behind_end`: the since a committed end lets the reader
  hold, and what is left to read after an end;
- :func:`offset_json`, :func:`consumed_upper` and :func:`replayed_end`: what a named
  consumer (``consumer`` option) records of an offset, and the micro-batch it replays.

The source's :class:`~pyspark_persist.stream_reader.LeaseHolder` is the shell around them:
it reads the state, leases it, plans the parts with
:func:`~pyspark_persist.state.planning.plan_read` and keeps the metrics.

Data loss is a value. When the times a stream must read next were compacted together with
older ones (its position is before the shard's since), it cannot go on exactly once: the
functions that can meet that take ``fail_on_data_loss`` (Spark's ``failOnDataLoss``) and
return the :class:`Gap` itself as a refusal when it is true, or go on from the gap's
``resume`` and list it in the result's ``skipped`` when it is false. The source raises
DataLoss for the one and logs the other.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pyspark_persist.state import (
    NO_LIMITS,
    Behind,
    ReadLimits,
    ShardState,
    Time,
    behind,
    check_readable,
    describe,
    limited_upper,
)
from pyspark_persist.state.errors import InvalidFrontier, InvalidUsage, ShardDropped

SNAPSHOT = "snapshot"
"""The phase before the snapshot is wholly emitted (``upper``: how far its cuts got)."""
LISTEN = "listen"
"""The phase after it: every update at a time below ``upper`` was emitted."""


@dataclass(frozen=True)
class Offset:
    """A position in a shard's changelog; see the module doc."""

    shard: str
    seqno: int
    upper: int
    phase: str
    as_of: int | None = None
    incarnation: str = ""
    """The shard's incarnation id (``ShardState.incarnation``); ``""``: unknown (an offset
    checkpointed before incarnations existed, or of a shard created before them)."""

    def to_dict(self) -> dict[str, Any]:
        """The JSON Spark checkpoints."""
        d: dict[str, Any] = {
            "shard": self.shard,
            "seqno": self.seqno,
            "upper": self.upper,
            "phase": self.phase,
            "as_of": -1 if self.as_of is None else self.as_of,
        }
        if self.incarnation:
            d["incarnation"] = self.incarnation
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], shard: str) -> Offset:
        """Read an offset back, refusing one checkpointed for another shard."""
        if d.get("shard") != shard:
            raise InvalidUsage(
                f"persist source: the checkpoint holds offsets of shard {d.get('shard')!r}, "
                f"but this query reads shard {shard!r}: use a new checkpointLocation for a "
                "different shard"
            )
        try:
            as_of = int(d.get("as_of", -1))
            phase = str(d["phase"])
            if phase not in (SNAPSHOT, LISTEN):
                raise ValueError(f"phase {phase!r}")
            return cls(
                shard,
                int(d["seqno"]),
                int(d["upper"]),
                phase,
                None if as_of < 0 else as_of,
                str(d.get("incarnation", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidUsage(f"persist source: malformed offset {d!r} ({e})") from e


@dataclass(frozen=True)
class Gap:
    """Times compaction merged with older ones before the query read them.

    ``what`` says which (the source's error or warning quotes it); ``resume`` is
    the first position from which reading is exact again. A refusal when
    failOnDataLoss is true; with it false the read skips ahead to ``resume``.
    """

    what: str
    resume: Time


@dataclass(frozen=True)
class Starting:
    """Where a query with no checkpoint starts, as its starting options say, in times.

    At most one is set (the options refuse two); none: the snapshot now, then
    its changes. ``startingSeqNo`` S arrives as ``changes_from``, the upper
    SeqNo S - 1 left: finding it reads the shard's history, which is the caller's.
    """

    latest: bool = False
    """startingPosition=latest: no snapshot, only the changes after the upper now."""
    changes_from: Time | None = None
    """startingTime / startingSeqNo: no snapshot, every change at a time from this on."""
    as_of: Time | None = None
    """startingAsOf: the snapshot at this time, then every change after it."""
    what: str = ""
    """The option as the user wrote it, for errors (``startingTimestamp``, ``startingSeqNo 4
    (from the upper SeqNo 3 left)``)."""


@dataclass(frozen=True)
class Start:
    """A query's first offset, and the gaps skipped to reach it (failOnDataLoss=false)."""

    offset: Offset
    skipped: tuple[Gap, ...] = ()


@dataclass(frozen=True)
class MicroBatch:
    """What one micro-batch reads: the updates at times ``[lower, upper)``, each at its own
    time (a listen range) or read as at ``as_of`` (a cut of the snapshot at ``as_of``).

    ``whole_snapshot``: the snapshot at ``as_of`` in one micro-batch (``lower`` 0, ``upper``
    ``as_of + 1``), planned as a snapshot, where a replace's retraction and the parts it
    retracts cancel. The micro-batch's leases are returned once Spark commits an end at or
    past ``upper``. ``skipped``: the gaps passed over to get here (failOnDataLoss=false).
    """

    lower: Time
    upper: Time
    as_of: Time | None = None
    whole_snapshot: bool = False
    skipped: tuple[Gap, ...] = ()


def upper_offset(state: ShardState) -> Offset:
    """The offset at ``state``'s upper: everything in it emitted (startingPosition=latest, and
    the newest offset Spark's progress shows)."""
    return Offset(state.shard_id, state.seqno, state.upper, LISTEN, None, state.incarnation)


def initial_offset(
    state: ShardState,
    starting: Starting,
    fail_on_data_loss: bool = True,
    *,
    changes_ahead: bool = False,
) -> Start | Gap:
    """Where a new query starts: before the snapshot (at ``starting.as_of`` when set), at the
    upper for ``latest``, or in ``listen`` at ``starting.changes_from``.

    A time at or past the upper is InvalidFrontier; one whose snapshot (or changes) were
    compacted away is a :class:`Gap` that resumes at the since. ``changes_ahead``: a
    ``changes_from`` past the upper starts there all the same, and the stream waits for the
    shard to reach it (a stream of several shards, where one shard's writes may lag the time
    the others reached).
    """
    if starting.latest:
        return Start(upper_offset(state))
    if starting.changes_from is not None:
        if changes_ahead and starting.changes_from > state.upper:
            return Start(
                Offset(
                    state.shard_id,
                    state.seqno,
                    starting.changes_from,
                    LISTEN,
                    None,
                    state.incarnation,
                )
            )
        return _changes_from(state, starting.changes_from, starting.what, fail_on_data_loss)
    as_of = starting.as_of
    skipped: list[Gap] = []
    if as_of is not None:
        try:
            check_readable(as_of, state.since, state.upper, starting.what, state.shard_id)
        except InvalidFrontier as e:
            if as_of >= state.upper:
                raise InvalidFrontier(f"persist source: {e}") from None
            gap = Gap(str(e), state.since)
            if not _go_on(gap, fail_on_data_loss, skipped):
                return gap
            as_of = gap.resume
    return Start(Offset(state.shard_id, 0, 0, SNAPSHOT, as_of, state.incarnation), tuple(skipped))


def _changes_from(
    state: ShardState, lower: Time, what: str, fail_on_data_loss: bool
) -> Start | Gap:
    """No snapshot: every change at a time from ``lower`` on.

    Exactly the changes after the collection at ``lower - 1``, which must be readable:
    below since, compaction has merged them with older ones (data loss).
    """
    if lower > state.upper:
        raise InvalidFrontier(
            f"persist source: {what}: time {describe(lower)} is past the upper "
            f"{describe(state.upper)} of shard {state.shard_id!r}: the changes from a time "
            f"in [since, upper] = [{state.since}, {state.upper}] can be streamed; for only "
            "new changes use startingPosition=latest"
        )
    skipped: list[Gap] = []
    if 0 < lower and lower - 1 < state.since:
        gap = Gap(
            f"{what}: time {describe(lower)} needs the collection as of {lower - 1}, "
            f"before the since {state.since} (the changes in [since, upper] = "
            f"[{state.since}, {state.upper}] are kept apart; older ones were compacted "
            "together)",
            state.since + 1,
        )
        if not _go_on(gap, fail_on_data_loss, skipped):
            return gap
        lower = gap.resume
    offset = Offset(state.shard_id, state.seqno, lower, LISTEN, None, state.incarnation)
    return Start(offset, tuple(skipped))


def caught_up(state: ShardState, start: Offset) -> bool:
    """True when a ``listen`` start has emitted everything ``state`` holds: with no
    AvailableNow upper, :func:`next_offset` returns it unchanged (the source may wait for a
    commit first)."""
    return start.phase == LISTEN and state.upper <= start.upper


def next_offset(
    state: ShardState,
    start: Offset,
    limits: ReadLimits = NO_LIMITS,
    available_now_upper: Time | None = None,
) -> Offset:
    """Spark's ``latestOffset``: the end of the micro-batch after ``start``, or ``start`` itself
    when nothing is new.

    Everything up to the upper (no further than ``available_now_upper``), cut where a cap of
    ``limits`` ends a run of whole batches. From a ``snapshot`` start the snapshot is the
    updates at times ``[0, as_of]``, each read as at ``as_of``, so a cap cuts that range and
    the cut's offset stays ``snapshot`` at the same ``as_of``; the cut that reaches ``as_of``
    ends the snapshot at ``as_of + 1`` in ``listen``. A snapshot with no time asked for is at
    the newest complete time, fixed by its first cut's offset.
    """
    target = state.upper
    if available_now_upper is not None:
        target = min(target, available_now_upper)
    if start.phase == SNAPSHOT:
        as_of = start.as_of
        if as_of is None:
            if target == 0:
                return start
            as_of = target - 1
        elif as_of >= target:
            return start  # the time asked for is not complete yet
        cut = _cut(state, start.upper, as_of + 1, limits)
        if cut > as_of:
            return Offset(state.shard_id, state.seqno, as_of + 1, LISTEN, None, state.incarnation)
        return Offset(state.shard_id, state.seqno, cut, SNAPSHOT, as_of, state.incarnation)
    if target <= start.upper:
        return start
    end = _cut(state, start.upper, target, limits)
    return Offset(state.shard_id, state.seqno, end, LISTEN, None, state.incarnation)


def _cut(state: ShardState, lower: Time, target: Time, limits: ReadLimits) -> Time:
    """Where the micro-batch from ``lower`` ends: ``target``, or before it under a cap."""
    return limited_upper(state, lower, target, limits) if limits.caps else target


def reads_nothing(start: Offset, end: Offset) -> bool:
    """True when ``(start, end]`` is an empty listen range: no state need be read for it."""
    return start.phase == LISTEN and end.upper <= start.upper


def micro_batch(
    state: ShardState, start: Offset, end: Offset, fail_on_data_loss: bool = True
) -> MicroBatch | Gap:
    """What ``partitions(start, end)`` reads of ``state`` (for a range :func:`reads_nothing`
    is false of).

    From a ``snapshot`` start: the whole snapshot when the first micro-batch takes it all,
    else the cut ``[start.upper, end.upper)`` read as at the snapshot's time (``end.as_of``,
    or ``end.upper - 1`` for the last cut). The cuts of one snapshot tile ``[0, as_of]``, so
    together they are the snapshot (unconsolidated across cuts: an insert and its retraction
    may land in two micro-batches; their diffs still sum to the collection). From a ``listen``
    start: every change in ``[start.upper, end.upper)``.

    A replayed micro-batch reads the same times whatever compaction did meanwhile, unless it
    merged across its start (since past ``start.upper - 1``; from 0 nothing was merged away)
    or past the snapshot's time: a :class:`Gap`.
    """
    skipped: list[Gap] = []
    if start.phase == SNAPSHOT:
        as_of = end.as_of if end.phase == SNAPSHOT and end.as_of is not None else end.upper - 1
        if as_of < state.since:
            gap = Gap(
                f"the snapshot at {as_of} is before the shard's since {state.since}", state.since
            )
            if not _go_on(gap, fail_on_data_loss, skipped):
                return gap
            as_of = gap.resume
        if start.upper == 0 and end.phase == LISTEN:
            return MicroBatch(0, as_of + 1, as_of, whole_snapshot=True, skipped=tuple(skipped))
        lower, upper = start.upper, min(end.upper, as_of + 1)
        if lower > 0 and lower - 1 < state.since:
            gap = Gap(
                f"the snapshot's times [{lower}, {state.since}] were compacted with earlier "
                "ones before this query read them",
                state.since + 1,
            )
            if not _go_on(gap, fail_on_data_loss, skipped):
                return gap
            lower = gap.resume
        return MicroBatch(lower, max(lower, upper), as_of, skipped=tuple(skipped))
    lower = start.upper
    if lower > 0 and lower - 1 < state.since:
        gap = Gap(
            f"times [{lower}, {state.since}] were compacted before this query read them",
            state.since + 1,
        )
        if not _go_on(gap, fail_on_data_loss, skipped):
            return gap
        lower = gap.resume
    return MicroBatch(lower, end.upper, None, skipped=tuple(skipped))


def _go_on(gap: Gap, fail_on_data_loss: bool, skipped: list[Gap]) -> bool:
    """Whether a read may skip ``gap`` (then it is noted in ``skipped``): failOnDataLoss=false."""
    if fail_on_data_loss:
        return False
    skipped.append(gap)
    return True


def since_after(end: Offset) -> Time | None:
    """The since a reader may hold once Spark committed every micro-batch up to ``end``: the
    last time emitted; None while nothing of the changelog was emitted up to a time (a
    snapshot offset, or the start of an empty shard)."""
    return end.upper - 1 if end.phase == LISTEN and end.upper > 0 else None


def offset_json(offset: Offset) -> str:
    """The canonical JSON of an offset: what a named consumer records as its position and its
    planned micro-batches, so one offset is always one string."""
    return json.dumps(offset.to_dict(), sort_keys=True, separators=(",", ":"))


def consumed_upper(end: Offset) -> Time:
    """The consumer's ``upper`` once Spark committed every micro-batch up to ``end``: every
    change at a time below it was emitted (0 while the snapshot is under way)."""
    return end.upper if end.phase == LISTEN else 0


def replayed_end(planned: tuple[tuple[str, str], ...], start: Offset, shard: str) -> Offset | None:
    """The end a consumer planned for the micro-batch from ``start`` (None: none planned).

    A query resuming without its checkpoint from the consumer's position asks for the same
    starts as the run that planned them, and gets the same ends: the same micro-batches.
    """
    key = offset_json(start)
    for s, e in planned:
        if s == key:
            return Offset.from_dict(json.loads(e), shard)
    return None


def behind_end(state: ShardState, end: Offset | None) -> Behind:
    """What a query that has read up to ``end`` (nothing yet: None) still has to read."""
    return behind(state, 0 if end is None else end.upper)


def check_incarnation(incarnation: str | None, *offsets: Offset) -> None:
    """ShardDropped when an offset (from the checkpoint) names another incarnation of the shard
    than ``incarnation``, the one the query opened: the one it read was dropped since. An offset
    naming none (checkpointed before incarnations existed) is of every incarnation."""
    for offset in offsets:
        if offset.incarnation and offset.incarnation != incarnation:
            raise ShardDropped(
                f"persist source: this query's checkpoint holds offsets of shard "
                f"{offset.shard!r} as it was before it was dropped (persist shards drop); "
                "the shard of that name now was created again since, and this query never "
                "read it. Restart the query with a new checkpointLocation to read it"
            )
