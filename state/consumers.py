"""Named consumers: durable positions in a shard, with a since hold and a fencing token.

A consumer (issue 36) is what Kafka calls a consumer group, kept in the
shard's state in Consensus: the offset a stream committed (``position``,
opaque JSON the connector writes), the times it consumed (``upper``), the
micro-batches it planned past that position (``planned``, so a query that
resumes without its checkpoint replays exactly the same ranges), and a hold
on ``since`` like a critical reader's, so retention and compaction never
pass what it has not consumed.

Who may move it: whoever acquired it last. Every acquire (and every reset)
takes the next ``epoch``; a plan or an advance names the epoch it acquired,
and is refused with :class:`~pyspark_persist.state.errors.ConsumerFenced`
once another holder took a newer one. So of two live queries with one
consumer name, only the newer moves it.

Every command here is pure (state in, ``Apply(diff, value)`` or
``Refuse(value)`` out, see :mod:`pyspark_persist.state.commands`); a refusal
that is the caller's problem carries the error to raise as its value
(:func:`raise_refusal`), so the same function tells a test, the client and
the CLI what happened. Each command recognises its own landed effect, so a
retry after an unknown outcome (``Indeterminate``) lands once: an acquire by
the same holder, a plan already present, an advance to the position already
recorded, a release of a consumer nobody holds, a reset to the values held,
are all refusals that answer with the current consumer.

A consumer idle (no acquire, no advance) longer than its ``expiry_ms`` is
marked expired by maintenance (:func:`expire_consumers`): its hold stops
counting, so a forgotten consumer cannot hold data forever. Acquiring it
again revives it, from its position if that is still readable.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import TypeVar

from .changes import Behind, behind
from .commands import Apply, Outcome, Refuse, meet_since
from .diff import DiffBuilder
from .errors import (
    ConsumerFenced,
    ConsumerInUse,
    InvalidFrontier,
    InvalidUsage,
    PersistError,
    UnknownConsumer,
)
from .state import ConsumerState, ShardState, Time

__all__ = [
    "ConsumerResult",
    "ConsumerState",
    "acquire_consumer",
    "advance_consumer",
    "consumer_lag",
    "drop_consumer",
    "expire_consumers",
    "is_held",
    "plan_consumer_batch",
    "raise_refusal",
    "release_consumer",
    "reset_consumer",
    "validate_consumer_name",
]

ConsumerResult = ConsumerState | PersistError
"""What a consumer command answers: the consumer as it now is, or the error refusing it."""

Planned = tuple[tuple[str, str], ...]
"""A consumer's planned micro-batches: ``(start, end)`` offsets, a chain from its position."""

T = TypeVar("T")

_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")


def validate_consumer_name(name: object) -> str:
    """A consumer name is a key of the shard's state: 1 to 128 letters, digits, '-', '_', '.'."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidUsage(
            f"invalid consumer name {name!r}: use 1 to 128 letters, digits, '-', '_' or '.' "
            "(e.g. 'to-pg'); nothing was written"
        )
    return name


def raise_refusal(result: T | PersistError) -> T:
    """``result``, unless it is the error a command refused with: then raise that."""
    if isinstance(result, PersistError):
        raise result
    return result


def _unknown(state: ShardState, name: str) -> UnknownConsumer:
    return UnknownConsumer(state.shard_id, name, tuple(sorted(state.consumers)))


def _fenced(state: ShardState, name: str, current: ConsumerState, holder: str) -> ConsumerFenced:
    return ConsumerFenced(state.shard_id, name, current.holder, holder)


def _held(state: ShardState, name: str, current: ConsumerState, what: str) -> ConsumerInUse:
    return ConsumerInUse(
        f"consumer {name!r} of shard {state.shard_id!r} is held by {current.holder}, so it "
        f"was not {what}: stop that query first, or force it (--force; the query is then "
        "fenced and fails at its next micro-batch); nothing changed"
    )


def is_held(state: ShardState, consumer: ConsumerState, now_ms: int | None = None) -> bool:
    """Whether a live query holds ``consumer``: it has a holder, and the leased reader that
    holder named (if any) is still registered, its lease not run out at ``now_ms``."""
    if not consumer.holder:
        return False
    if not consumer.reader:
        return True
    lease = state.leased_readers.get(consumer.reader)
    return lease is not None and (now_ms is None or lease.expires_at_ms >= now_ms)


def _put(state: ShardState, name: str, consumer: ConsumerState) -> Apply[ConsumerResult]:
    """The diff that stores ``consumer`` and moves the shard's since to the meet of the holds."""
    consumers = dict(state.consumers)
    consumers[name] = consumer
    b = DiffBuilder(state).put_consumer(name, consumer)
    b.set(since=meet_since(state, consumers=consumers))
    return Apply(b.build(), consumer)


def acquire_consumer(
    state: ShardState,
    *,
    name: str,
    holder: str,
    now_ms: int,
    expiry_ms: int = 0,
    reader_id: str = "",
) -> Outcome[ConsumerResult]:
    """Hold consumer ``name`` for ``holder``, creating it at the shard's since when absent.

    An existing consumer gets the next epoch and the new holder: whoever held
    it is fenced from now on. The same holder acquiring again (a retry after
    a lost reply) gets the consumer as it is. An expired consumer is revived,
    its hold at least the shard's since (what it had not consumed may be gone).
    ``reader_id``: the holder's leased reader, whose lease bounds the hold (see
    :func:`is_held`).
    """
    validate_consumer_name(name)
    if expiry_ms < 0:
        raise InvalidUsage(f"consumer expiry must not be negative (got {expiry_ms} ms)")
    current = state.consumers.get(name)
    if current is None:
        created = ConsumerState(
            since=state.since,
            upper=0,
            position="",
            planned=(),
            holder=holder,
            epoch=1,
            created_ms=now_ms,
            committed_ms=0,
            expiry_ms=expiry_ms,
            acquired_ms=now_ms,
            reader=reader_id,
        )
        return Apply(DiffBuilder(state).put_consumer(name, created).build(), created)
    same = (current.holder, current.reader, current.expiry_ms) == (holder, reader_id, expiry_ms)
    if same and not current.expired:
        return Refuse(current)
    acquired = replace(
        current,
        since=max(current.since, state.since),
        holder=holder,
        epoch=current.epoch + 1,
        expiry_ms=expiry_ms,
        expired=False,
        acquired_ms=max(current.acquired_ms, now_ms),
        reader=reader_id,
    )
    return _put(state, name, acquired)


def plan_consumer_batch(
    state: ShardState, *, name: str, epoch: int, holder: str, start: str, end: str
) -> Outcome[ConsumerResult]:
    """Record that the micro-batch ``[start, end)`` (offsets JSON) was planned past the position.

    The planned list stays a chain from the position: a batch whose start is
    the end of a planned one is appended after it (what follows it is
    dropped: it was planned by a run that went another way), one whose start
    no planned batch ends at starts the chain afresh. A batch already planned
    with this start is left as it is (answered with the consumer, whose entry
    names its end). Refused with ConsumerFenced when ``epoch`` is not the
    consumer's (``holder`` is the caller, for the message).
    """
    current = state.consumers.get(name)
    if current is None:
        return Refuse(_unknown(state, name))
    if current.epoch != epoch:
        return Refuse(_fenced(state, name, current, holder))
    chain = _chain(current.planned, (start, end))
    if chain == current.planned:
        return Refuse(current)
    updated = replace(current, planned=chain)
    return Apply(DiffBuilder(state).put_consumer(name, updated).build(), updated)


def _chain(planned: Planned, batch: tuple[str, str]) -> Planned:
    """``planned`` with ``batch`` planned (see :func:`plan_consumer_batch`): unchanged when a
    batch with its start is there; after the one it follows, or alone."""
    start = batch[0]
    if any(s == start for s, _ in planned):
        return planned
    ends = [e for _, e in planned]
    return (*planned[: ends.index(start) + 1], batch) if start in ends else (batch,)


def advance_consumer(
    state: ShardState,
    *,
    name: str,
    epoch: int,
    holder: str,
    position: str,
    upper: Time,
    since: Time,
    now_ms: int,
    plan: tuple[str, str] | None = None,
) -> Outcome[ConsumerResult]:
    """Record that everything up to ``position`` (times below ``upper``) was consumed.

    Only a committed micro-batch moves a consumer (the connector calls this from
    Spark's ``commit``). Its hold moves up to ``since`` (never back), the
    planned batches before the one that starts at ``position`` are dropped
    (all of them when none does), and the shard's since moves to the meet of
    every hold. ``plan``: the next micro-batch's ``(start, end)``, planned in
    the same step as by :func:`plan_consumer_batch` (Spark commits a micro-batch
    after it planned the next, so one compare-and-set records both). Refused
    with ConsumerFenced when ``epoch`` is not the consumer's; an advance
    already recorded (a retry) is answered as it is.
    """
    current = state.consumers.get(name)
    if current is None:
        return Refuse(_unknown(state, name))
    if current.epoch != epoch:
        return Refuse(_fenced(state, name, current, holder))
    starts = [s for s, _ in current.planned]
    planned = current.planned[starts.index(position) :] if position in starts else ()
    if plan is not None:
        planned = _chain(planned, plan)
    new_since = max(current.since, since)
    held = (current.position, current.upper, current.since, current.planned)
    if held == (position, upper, new_since, planned):
        return Refuse(current)
    advanced = replace(
        current,
        since=new_since,
        upper=upper,
        position=position,
        planned=planned,
        committed_ms=max(current.committed_ms, now_ms),
    )
    return _put(state, name, advanced)


def release_consumer(state: ShardState, *, name: str, epoch: int) -> Outcome[ConsumerResult]:
    """Let go of the consumer (a query stopping cleanly): holder ``""``, position and hold kept.

    Nothing changes when another holder took it meanwhile (a newer epoch) or
    nobody holds it: a fenced query stopping must not release its successor.
    """
    current = state.consumers.get(name)
    if current is None:
        return Refuse(_unknown(state, name))
    if current.epoch != epoch or not current.holder:
        return Refuse(current)
    released = replace(current, holder="", reader="")
    return Apply(DiffBuilder(state).put_consumer(name, released).build(), released)


def reset_consumer(
    state: ShardState,
    *,
    name: str,
    position: str,
    upper: Time,
    since: Time,
    force: bool = False,
    now_ms: int = 0,
) -> Outcome[ConsumerResult]:
    """Move the consumer to ``position`` (times below ``upper`` consumed, holding ``since``).

    Refused with ConsumerInUse while a live query holds it (:func:`is_held` at
    ``now_ms``), unless ``force`` (the holder is then fenced: the epoch moves
    and nobody holds it); with
    InvalidFrontier when ``since`` is before the shard's since (that data is
    compacted away). The planned batches are forgotten; it may move back as
    far as the shard's since. ``now_ms`` restarts its expiry clock.
    """
    current = state.consumers.get(name)
    if current is None:
        return Refuse(_unknown(state, name))
    if not force and is_held(state, current, now_ms or None):
        return Refuse(_held(state, name, current, "reset"))
    if since < state.since:
        return Refuse(
            InvalidFrontier(
                f"cannot reset consumer {name!r} of shard {state.shard_id!r} to hold time "
                f"{since}: the shard's since is {state.since} (earlier times were compacted "
                f"away); reset it to a time at or after {state.since}; nothing changed"
            )
        )
    held = (current.position, current.upper, current.since, current.planned, current.holder)
    if (*held, current.expired) == (position, upper, since, (), "", False):
        return Refuse(current)
    reset = replace(
        current,
        position=position,
        upper=upper,
        since=since,
        planned=(),
        holder="",
        reader="",
        epoch=current.epoch + 1,
        expired=False,
        acquired_ms=max(current.acquired_ms, now_ms),
    )
    return _put(state, name, reset)


def drop_consumer(
    state: ShardState, *, name: str, force: bool = False, now_ms: int | None = None
) -> Outcome[ConsumerResult]:
    """Remove the consumer and its hold; refused with ConsumerInUse while a live query holds
    it (:func:`is_held` at ``now_ms``), unless ``force``.

    Answers with the consumer as it was. (A retry after a lost reply finds it
    gone: UnknownConsumer; the client tells that from a name never there.)
    """
    current = state.consumers.get(name)
    if current is None:
        return Refuse(_unknown(state, name))
    if not force and is_held(state, current, now_ms):
        return Refuse(_held(state, name, current, "dropped"))
    consumers = {k: v for k, v in state.consumers.items() if k != name}
    b = DiffBuilder(state).delete_consumer(name)
    b.set(since=meet_since(state, consumers=consumers))
    return Apply(b.build(), current)


def expire_consumers(state: ShardState, *, now_ms: int) -> Outcome[tuple[str, ...]]:
    """Mark expired every consumer idle longer than its ``expiry_ms``; their holds stop counting.

    Returns the names expired now (refused with ``()`` when there are none).
    A consumer with ``expiry_ms`` 0 never expires.
    """
    idle = sorted(
        n
        for n, c in state.consumers.items()
        if c.expiry_ms > 0 and not c.expired and now_ms - c.active_ms > c.expiry_ms
    )
    if not idle:
        return Refuse(())
    consumers = dict(state.consumers)
    b = DiffBuilder(state)
    for n in idle:
        consumers[n] = replace(consumers[n], expired=True)
        b.put_consumer(n, consumers[n])
    b.set(since=meet_since(state, consumers=consumers))
    return Apply(b.build(), tuple(idle))


def consumer_lag(state: ShardState, name: str) -> Behind:
    """How far consumer ``name`` is behind the shard's upper (UnknownConsumer when absent)."""
    current = state.consumers.get(name)
    if current is None:
        raise _unknown(state, name)
    return behind(state, current.upper)
