"""Offsets of a stream of several shards (option ``shards``), as pure functions.

A stream of several shards keeps one :class:`~pyspark_persist.offsets.Offset` per shard,
each moved by the rules of :mod:`pyspark_persist.offsets`, and moves them together so that
no micro-batch splits a transaction:

- A transaction commits all its shards at one time ``T`` in one compare-and-set of several
  keys (:mod:`pyspark_persist.state.txn`), so at any instant either every participant's upper
  is past ``T`` or none is. A micro-batch that ends each shard at its upper *as of one
  instant* holds each transaction wholly or not at all, and so does every later one. The
  source finds such an instant by reading the shards' states twice (:func:`settled`): an
  upper that did not change between two reads of a shard was that upper at every moment
  between them, so when none changed, the second read's uppers are those of one instant
  between the two reads. Each shard keeps its own upper, so a shard nobody writes never holds
  back the others (a single frontier time for all shards would wait for it).
- A read limit cuts every shard at one time (:func:`next_joint`): the earliest time where any
  shard's cap ends a run of its batches. A transaction's updates are at one time in every
  participant, so they are all below the cut or all at or past it. The cap applies to each
  shard's share of the micro-batch, not to their sum.
- The snapshot is one micro-batch of every shard's snapshot at once (a limit applies from the
  first change on): a cut of the snapshots by time would split a transaction that compaction
  moved to a later time in one shard and not in another. A shard empty at the query's start
  has no snapshot: it starts at time 0 in ``listen``.

Offsets are JSON ``{"shards": {name: offset}}``, each offset as a single shard's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pyspark_persist.offsets import LISTEN, SNAPSHOT, Offset, next_offset
from pyspark_persist.state import NO_LIMITS, ReadLimits, ShardState, Time
from pyspark_persist.state.errors import InvalidUsage

JointOffset = dict[str, Offset]
"""Each shard's offset, keyed by shard name."""


def joint_to_dict(joint: Mapping[str, Offset]) -> dict[str, Any]:
    """The JSON Spark checkpoints."""
    return {"shards": {name: offset.to_dict() for name, offset in joint.items()}}


def joint_from_dict(d: Mapping[str, Any], shards: tuple[str, ...]) -> JointOffset:
    """Read a stream's offset back, refusing one checkpointed for another set of shards."""
    offsets = d.get("shards")
    if not isinstance(offsets, dict):
        named = d.get("shard")
        raise InvalidUsage(
            f"persist source: the checkpoint holds offsets of shard {named!r} alone, but this "
            f"query reads shards {list(shards)}: use a new checkpointLocation for a different "
            "set of shards"
        )
    if sorted(offsets) != sorted(shards):
        raise InvalidUsage(
            f"persist source: the checkpoint holds offsets of shards {sorted(offsets)}, but this "
            f"query reads shards {sorted(shards)}: use a new checkpointLocation for a different "
            "set of shards"
        )
    return {name: Offset.from_dict(offsets[name], name) for name in shards}


def settled(before: Mapping[str, ShardState], after: Mapping[str, ShardState]) -> bool:
    """True when no shard's upper moved between two reads of all of them: ``after``'s uppers
    are then every shard's upper at one instant (see the module doc)."""
    return all(before[name].upper == state.upper for name, state in after.items())


def next_joint(
    states: Mapping[str, ShardState],
    start: Mapping[str, Offset],
    limits: ReadLimits = NO_LIMITS,
    available_now: Mapping[str, Time] | None = None,
) -> JointOffset:
    """Spark's ``latestOffset`` for several shards: each shard's end, from ``states`` read at
    one instant; ``start`` itself when nothing is new.

    ``available_now``: each shard's Trigger.AvailableNow upper (read at one instant too).
    """
    now = available_now or {}
    uppers = {name: _target(state, now.get(name)) for name, state in states.items()}
    if any(o.phase == SNAPSHOT for o in start.values()):
        return _snapshots(states, start, uppers)
    ends = {name: next_offset(states[name], o, limits, now.get(name)) for name, o in start.items()}
    cut = min((e.upper for name, e in ends.items() if e.upper < uppers[name]), default=None)
    if cut is None:
        return ends
    return {name: _capped(states[name], start[name], e, cut) for name, e in ends.items()}


def _capped(state: ShardState, start: Offset, end: Offset, cut: Time) -> Offset:
    """``end`` moved back to the time ``cut`` (``start`` when the shard is already there)."""
    if end.upper <= cut:
        return end
    return start if start.upper >= cut else _listen_at(state, cut)


def _snapshots(
    states: Mapping[str, ShardState], start: Mapping[str, Offset], uppers: Mapping[str, Time]
) -> JointOffset:
    """Every shard's whole snapshot at once, or nothing while one's snapshot time is not
    complete (an asked-for time past its upper)."""
    ends: JointOffset = {}
    for name, o in start.items():
        state = states[name]
        if o.phase != SNAPSHOT:
            ends[name] = o
        elif o.as_of is None and uppers[name] == 0:
            ends[name] = _listen_at(state, 0)  # empty: no snapshot, every change from time 0
        else:
            end = next_offset(state, o, NO_LIMITS, uppers[name])
            if end == o:
                return dict(start)
            ends[name] = end
    return ends


def reads_nothing(start: Offset, end: Offset) -> bool:
    """True when one shard's share of a micro-batch is empty: no change in its range, or the
    snapshot of a shard that was empty (``listen`` at 0)."""
    if start == end:
        return True
    if start.phase == SNAPSHOT:
        return end.phase == LISTEN and end.upper == 0
    return end.upper <= start.upper


def _target(state: ShardState, available_now: Time | None) -> Time:
    return state.upper if available_now is None else min(state.upper, available_now)


def _listen_at(state: ShardState, upper: Time) -> Offset:
    return Offset(state.shard_id, state.seqno, upper, LISTEN, None, state.incarnation)
