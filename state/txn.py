"""Transactions across shards: the pure rules (states in, one diff per shard or a refusal out).

A transaction appends one batch to each shard it names, all at one time
``T`` and in one state change: every shard's state lives in the one
Consensus store, which compare-and-sets several keys atomically
(:meth:`~pyspark_persist.state.consensus.Consensus.compare_and_set_many`),
so the diffs computed here land together or not at all
(:mod:`.txn_commit` is the shell that stages, commits and retries). Each
shard's batch is ``[its upper, T + 1)`` with every update at ``T``, where
``T`` is at least every participant's upper: a read of any of them as of
``T`` or later sees the transaction, one as of an earlier time sees none of
it, and no SeqNo is shared between shards: times are the shared clock.

Each shard's diff is exactly :func:`~.commands.compare_and_append`'s (the
same batch, writer entry and schema rules as a plain write), with the
transaction (its id and ``T``) recorded in the writer's entry, where
``persist shards history`` finds it. Idempotency is a plain write's too: a
writer id and a token, recorded in every participant by the same step, so
a retry after an unknown outcome (or a resend after a crash) finds the
token everywhere and applies nothing. A token found in some participants
and not others was spent outside this transaction (tokens only go up): that
is refused, as nothing can tell which data it stood for.

A keyed shard's share is an upsert planned against the updates up to its
upper (:func:`~.upsert.plan_attempt`): valid only while that upper stands,
so when it moved the shell plans that share again (:class:`Replan`); the
other shares' parts stay staged and valid at any ``T``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import replace as dc_replace

from . import commands
from .errors import InvalidUsage
from .state import PartRef, ShardState, StateDiff, Time, TxnMark


@dataclass(frozen=True)
class Share:
    """One shard's part of a transaction, staged: the parts its batch will hold.

    Parts without times get the commit time; a keyed share's carry the time it
    was planned at (at most the commit time, to which they are rewritten), and
    ``planned_upper`` is the upper it was planned against (``None``: no plan
    depends on the shard's contents).
    """

    shard_id: str
    parts: tuple[PartRef, ...] = ()
    tombstones: tuple[PartRef, ...] = ()
    planned_upper: Time | None = None


@dataclass(frozen=True)
class TxnPlan:
    """The transaction's diff for each participant, all ending at commit time ``time``."""

    time: Time
    diffs: Mapping[str, StateDiff]


@dataclass(frozen=True)
class TxnAlreadyCommitted:
    """Every participant already holds the writer's ``token`` (or a later one): nothing to do.

    ``time``: the transaction's commit time, when every participant's last
    commit of the writer is this token's and carries one (``None`` otherwise:
    the writer committed a later token since).
    """

    token: int
    time: Time | None


@dataclass(frozen=True)
class Replan:
    """The keyed shares of ``shards`` were planned against an upper that moved: plan them
    again against the new states before committing."""

    shards: tuple[str, ...]


TxnOutcome = TxnPlan | TxnAlreadyCommitted | Replan


def commit_time(states: Mapping[str, ShardState], now_ms: int) -> Time:
    """The transaction's time: the wall clock, or the newest participant's upper if later
    (so every participant's batch ``[upper, T + 1)`` is non-empty)."""
    return max(now_ms, *(s.upper for s in states.values()))


def plan_txn(
    states: Mapping[str, ShardState],
    shares: Mapping[str, Share],
    *,
    writer_id: str,
    token: int,
    txn_id: str,
    time: Time,
    now_ms: int,
) -> TxnOutcome:
    """Each participant's diff for the transaction at ``time``, or why there is none.

    ``states``: every participant's state, as the commit will expect it
    (the compare-and-set fails whole if any moved). The token is checked
    before anything else, so a retry whose earlier attempt landed learns so
    even after the shards moved on.
    """
    done = [s for s in shares if _has_token(states[s], writer_id, token)]
    if len(done) == len(shares):
        return TxnAlreadyCommitted(token, _recorded_time(states, shares, writer_id, token))
    if done:
        rest = sorted(set(shares) - set(done))
        raise InvalidUsage(
            f"writer {writer_id!r} already committed token {token} (or a later one) to shard(s) "
            f"{sorted(done)} but not to {rest}: a transaction lands in all its shards or none, "
            "so that token was spent outside this transaction. A resent transaction must name "
            "the same shards; for new data use a higher token or another writer id"
        )
    moved = tuple(
        sorted(
            s
            for s, share in shares.items()
            if share.planned_upper is not None and share.planned_upper != states[s].upper
        )
    )
    if moved:
        return Replan(moved)
    late = [s for s in shares if states[s].upper > time]
    if late:
        raise InvalidUsage(f"transaction time {time} is below the upper of shard(s) {late}")
    mark = TxnMark(txn_id, time)
    diffs: dict[str, StateDiff] = {}
    for shard_id, share in shares.items():
        state = states[shard_id]
        outcome = commands.compare_and_append(
            state,
            parts=tuple(_at(p, time) for p in share.parts),
            expected_upper=state.upper,
            new_upper=time + 1,
            writer_id=writer_id,
            token=token,
            now_ms=now_ms,
            tombstones=tuple(_at(p, time) for p in share.tombstones),
            txn=mark,
        )
        # The token and the upper were checked above, so compare_and_append cannot refuse.
        assert isinstance(outcome, commands.Apply), outcome
        diffs[shard_id] = outcome.diff
    return TxnPlan(time, diffs)


def _has_token(state: ShardState, writer_id: str, token: int) -> bool:
    writer = state.writers.get(writer_id)
    return writer is not None and token <= writer.last_token


def _recorded_time(
    states: Mapping[str, ShardState], shares: Mapping[str, Share], writer_id: str, token: int
) -> Time | None:
    """The commit time every participant recorded with ``token``, if they all did."""
    times = set()
    for s in shares:
        w = states[s].writers[writer_id]
        if w.last_token != token or w.txn is None:
            return None
        times.add(w.txn.time)
    return times.pop() if len(times) == 1 else None


def _at(part: PartRef, time: Time) -> PartRef:
    """``part`` read at ``time``: every update's time becomes ``time`` (each is at most it)."""
    current = part.ts_rewrite
    return dc_replace(part, ts_rewrite=time if current is None else max(current, time))
