"""Named consumers (issue 36): every transition of ``state/consumers.py`` as a pure function
(state in, diff or refusal out), their since hold in every since computation, the encoding of
states with and without consumers, and the client's retries after a lost reply landing once.
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, Shard
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.commands import (
    Apply,
    Outcome,
    Refuse,
    expire_leased_readers,
    heartbeat_leased_reader,
)
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.consumers import (
    ConsumerState,
    acquire_consumer,
    advance_consumer,
    consumer_lag,
    drop_consumer,
    expire_consumers,
    is_held,
    plan_consumer_batch,
    release_consumer,
    reset_consumer,
    validate_consumer_name,
)
from pyspark_persist.state.diff import decode, encode, full_diff
from pyspark_persist.state.errors import (
    ConsumerFenced,
    ConsumerInUse,
    InvalidFrontier,
    InvalidUsage,
    UnknownConsumer,
)
from pyspark_persist.state.retention import retention_since
from pyspark_persist.state.state import EMPTY_STATE, Batch, LeasedReaderState, PartRef, ShardState
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus

A, B = "query a pid 1 on h since t0", "query b pid 2 on h since t1"


def shard(since: int = 10, upper: int = 100, **kw: Any) -> ShardState:
    """A shard at SeqNo 5 holding one batch of 7 rows in [0, upper)."""
    part = PartRef(key="p", inline=None, size_bytes=70, rows=7, min_time=0, max_time=upper - 1)
    batch = Batch(0, upper, 0, (part,))
    return ShardState(
        shard_id="s",
        seqno=5,
        schema=b"",
        since=since,
        upper=upper,
        batches=MappingProxyType({batch.key: batch}),
        **kw,
    )


def applied(outcome: Outcome[Any], state: ShardState) -> tuple[ShardState, Any]:
    """The state after an Apply (round-tripped through the Consensus encoding) and its result."""
    assert isinstance(outcome, Apply), outcome
    assert decode(encode(outcome.diff), where="test") == outcome.diff
    return state.apply(outcome.diff), outcome.result


def refused(outcome: Outcome[Any]) -> Any:
    """The value of a refusal."""
    assert isinstance(outcome, Refuse), outcome
    return outcome.result


def held(state: ShardState, name: str = "c", holder: str = A) -> ShardState:
    """``state`` with consumer ``name`` acquired by ``holder``."""
    return applied(acquire_consumer(state, name=name, holder=holder, now_ms=1000), state)[0]


def test_acquire_creates_at_the_shards_since_and_a_second_holder_fences_the_first() -> None:
    s0 = shard()
    s1, c = applied(acquire_consumer(s0, name="c", holder=A, now_ms=1000, expiry_ms=5), s0)
    assert c == ConsumerState(
        since=10,
        upper=0,
        position="",
        planned=(),
        holder=A,
        epoch=1,
        created_ms=1000,
        committed_ms=0,
        expiry_ms=5,
        acquired_ms=1000,
    )
    assert s1.consumers == {"c": c} and s1.since == 10
    # The same holder again (a retry after a lost reply): nothing changes.
    assert refused(acquire_consumer(s1, name="c", holder=A, now_ms=2000, expiry_ms=5)) == c
    s2, c2 = applied(acquire_consumer(s1, name="c", holder=B, now_ms=2000, expiry_ms=5), s1)
    assert (c2.epoch, c2.holder, c2.acquired_ms) == (2, B, 2000)
    err = refused(plan_consumer_batch(s2, name="c", epoch=1, holder=A, start="", end="e"))
    assert isinstance(err, ConsumerFenced)
    assert A in str(err) and B in str(err)
    assert pickle.loads(pickle.dumps(err)).args == err.args  # Spark ships errors pickled


def test_bad_names_are_refused_before_anything_is_written() -> None:
    for bad in ("", "a/b", "x" * 129, "to pg", "é", "c\n"):
        with pytest.raises(InvalidUsage, match="letters, digits"):
            acquire_consumer(shard(), name=bad, holder=A, now_ms=0)
    assert validate_consumer_name("to-pg_1.v2") == "to-pg_1.v2"


def test_planned_batches_form_a_chain_from_the_position() -> None:
    s = held(shard())
    s, c = applied(plan_consumer_batch(s, name="c", epoch=1, holder=A, start="o0", end="o1"), s)
    s, c = applied(plan_consumer_batch(s, name="c", epoch=1, holder=A, start="o1", end="o2"), s)
    assert c.planned == (("o0", "o1"), ("o1", "o2"))
    # Planned again with the same start (a replay, a retry): kept as it was.
    assert refused(plan_consumer_batch(s, name="c", epoch=1, holder=A, start="o1", end="x")) == c
    # A batch following o1 replaces what followed it; one following nothing restarts the chain.
    s2, c2 = applied(plan_consumer_batch(s, name="c", epoch=1, holder=A, start="o2", end="o3"), s)
    assert c2.planned == (("o0", "o1"), ("o1", "o2"), ("o2", "o3"))
    _, c3 = applied(plan_consumer_batch(s, name="c", epoch=1, holder=A, start="z", end="z1"), s)
    assert c3.planned == (("z", "z1"),)


def test_advance_moves_position_hold_and_the_shards_since_and_is_idempotent() -> None:
    s = held(shard())
    for start, end in (("o0", "o1"), ("o1", "o2")):
        s = applied(plan_consumer_batch(s, name="c", epoch=1, holder=A, start=start, end=end), s)[0]
    adv = dict(name="c", epoch=1, holder=A, position="o1", upper=40, since=39, now_ms=3000)
    s1, c = applied(advance_consumer(s, **adv), s)  # type: ignore[arg-type]
    assert (c.position, c.upper, c.since, c.committed_ms) == ("o1", 40, 39, 3000)
    assert c.planned == (("o1", "o2"),)
    assert s1.since == 39  # the consumer is the only hold
    assert refused(advance_consumer(s1, **adv)) == c  # type: ignore[arg-type]
    # A hold never moves back; fenced once another holder took it.
    s2, c2 = applied(advance_consumer(s1, **{**adv, "position": "o2", "since": 5}), s1)  # type: ignore[arg-type]
    assert (c2.since, c2.planned, s2.since) == (39, (), 39)
    s3 = held(s2, holder=B)
    assert isinstance(refused(advance_consumer(s3, **adv)), ConsumerFenced)  # type: ignore[arg-type]


def test_an_advance_records_the_next_planned_batch_in_the_same_step() -> None:
    """Spark commits micro-batch N after it planned N + 1: one diff records both."""
    s = held(shard())
    s = applied(plan_consumer_batch(s, name="c", epoch=1, holder=A, start="o0", end="o1"), s)[0]
    adv = dict(name="c", epoch=1, holder=A, position="o1", upper=40, since=39, now_ms=1)
    s1, c = applied(advance_consumer(s, **adv, plan=("o1", "o2")), s)  # type: ignore[arg-type]
    assert (c.position, c.planned) == ("o1", (("o1", "o2"),))
    assert refused(advance_consumer(s1, **adv, plan=("o1", "o2"))) == c  # type: ignore[arg-type]


def test_every_since_computation_counts_unexpired_consumers() -> None:
    """A leased reader moving on cannot move since past a consumer's hold, nor can retention;
    once the consumer expires its hold stops counting."""
    reader = LeasedReaderState(since=10, seqno=5, last_heartbeat_ms=0, lease_duration_ms=10**9)
    base = shard(leased_readers=MappingProxyType({"r": reader}), retention_ms=1)
    s = held(base)
    s, _ = applied(heartbeat_leased_reader(s, reader_id="r", now_ms=1, seqno=5, new_since=90), s)
    assert s.since == 10
    assert retention_since(s, now_ms=10**6) == 10
    s, _ = applied(acquire_consumer(s, name="c", holder=A, now_ms=1000, expiry_ms=500), s)
    assert refused(expire_consumers(s, now_ms=1500)) == ()
    s, gone = applied(expire_consumers(s, now_ms=1501), s)
    assert gone == ("c",) and s.consumers["c"].expired and s.since == 90
    assert retention_since(s, now_ms=10**6) == 90  # the reader's hold alone now
    # Acquired again: revived, holding at least the shard's since (what it missed is gone).
    s, c = applied(acquire_consumer(s, name="c", holder=A, now_ms=2000, expiry_ms=500), s)
    assert not c.expired and c.since == 90


def test_release_reset_and_drop() -> None:
    s = held(shard())
    assert refused(release_consumer(s, name="c", epoch=7)) == s.consumers["c"]  # fenced: no-op
    reset = dict(name="c", position="p", upper=50, since=49)
    assert isinstance(refused(reset_consumer(s, **reset)), ConsumerInUse)  # type: ignore[arg-type]
    assert isinstance(refused(drop_consumer(s, name="c")), ConsumerInUse)
    s1, c = applied(reset_consumer(s, **reset, force=True), s)  # type: ignore[arg-type]
    assert (c.position, c.upper, c.since, c.holder, c.epoch) == ("p", 50, 49, "", 2)
    assert refused(reset_consumer(s1, **reset)) == c  # type: ignore[arg-type]
    gone = refused(reset_consumer(s1, **{**reset, "since": 9}))  # type: ignore[arg-type]
    assert isinstance(gone, InvalidFrontier) and "since is 49" in str(gone)
    s2, _ = applied(release_consumer(held(s1, holder=B), name="c", epoch=3), held(s1, holder=B))
    assert s2.consumers["c"].holder == ""
    s3, _ = applied(drop_consumer(s2, name="c"), s2)
    assert s3.consumers == {}
    unknown = refused(drop_consumer(s3, name="c"))
    assert isinstance(unknown, UnknownConsumer) and "'c'" in str(unknown)
    with pytest.raises(UnknownConsumer):
        consumer_lag(s3, "c")


def test_a_holder_whose_reader_lease_is_gone_no_longer_holds_it() -> None:
    """PySpark never calls a stopped source's stop(): the query's leased reader bounds its hold,
    so reset and drop need no force once that lease ran out or the reader was expired."""
    lease = LeasedReaderState(since=10, seqno=5, last_heartbeat_ms=0, lease_duration_ms=1000)
    s = shard(leased_readers=MappingProxyType({"r": lease}))
    s, c = applied(acquire_consumer(s, name="c", holder=A, now_ms=0, reader_id="r"), s)
    assert is_held(s, c, now_ms=1000) and not is_held(s, c, now_ms=1001)
    assert isinstance(refused(drop_consumer(s, name="c", now_ms=1000)), ConsumerInUse)
    reset = dict(name="c", position="p", upper=50, since=49, now_ms=1001)
    _, after = applied(reset_consumer(s, **reset), s)  # type: ignore[arg-type]
    assert (after.holder, after.reader, after.epoch) == ("", "", 2)
    gone = applied(expire_leased_readers(s, reader_ids=("r",)), s)[0]
    assert not is_held(gone, c)
    assert applied(drop_consumer(gone, name="c"), gone)[0].consumers == {}


def test_lag_counts_what_lies_past_the_consumers_upper() -> None:
    s = held(shard())
    lag = consumer_lag(s, "c")
    assert (lag.rows, lag.bytes, lag.parts, lag.times) == (7, 70, 1, 100)


def test_rollups_carry_consumers_and_leave_the_map_out_without_them() -> None:
    s = held(shard())
    rollup = decode(encode(full_diff(s)), where="rollup")
    assert EMPTY_STATE.apply(replace(rollup, from_seqno=0)).consumers == s.consumers
    assert b"consumers" not in encode(full_diff(shard()))  # older releases read it
    assert EMPTY_STATE.apply(decode(encode(full_diff(shard())), where="r")).consumers == {}


# --- the client: a retry after a lost reply lands once --------------------------------------

LOSE_ONE_CAS_REPLY = Faults(
    seed=5, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set"})
)


def lossy_shard() -> tuple[UnreliableConsensus, Shard, PersistClient]:
    """A shard whose Consensus loses the reply of the next compare-and-set once enabled."""
    tag = uuid.uuid4().hex
    consensus = UnreliableConsensus(
        open_consensus(f"mem://{tag}"), LOSE_ONE_CAS_REPLY, enabled=False
    )
    client = PersistClient(open_blob(f"mem://{tag}"), consensus, cache=StateCache())
    return consensus, client.open_shard("s", pa.schema([("v", pa.int64())])), client


CALLS: dict[str, Callable[[Shard], object]] = {
    "acquire": lambda sh: sh.acquire_consumer("c", B),
    "plan": lambda sh: sh.plan_consumer_batch("c", 1, "o0", "o1"),
    "advance": lambda sh: sh.advance_consumer("c", 1, position="o0", upper=3, since=2),
    "release": lambda sh: sh.release_consumer("c", 1),
    "reset": lambda sh: sh.reset_consumer("c", position="r", upper=1, since=0, force=True),
    "drop": lambda sh: sh.drop_consumer("c", force=True),
}


@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_lost_reply_is_retried_and_lands_once(call: str) -> None:
    consensus, sh, client = lossy_shard()
    with client:
        sh.writer("w").append(pa.table({"v": [1, 2, 3]}))
        sh.acquire_consumer("c", A)
        before = sh.state().seqno
        consensus.enabled = True
        CALLS[call](sh)
        assert consensus.injected["fail_after"] == 1
        after = sh.state()
        assert after.seqno == before + 1  # exactly one diff landed
        c = after.consumers.get("c")
        expected = {
            "acquire": lambda: c is not None and (c.epoch, c.holder) == (2, B),
            "plan": lambda: c is not None and c.planned == (("o0", "o1"),),
            "advance": lambda: c is not None and (c.position, c.since) == ("o0", 2),
            "release": lambda: c is not None and c.holder == "",
            "reset": lambda: c is not None and (c.position, c.epoch) == ("r", 2),
            "drop": lambda: c is None,
        }[call]
        assert expected(), c


def test_the_client_raises_what_a_command_refused_with() -> None:
    _, sh, client = lossy_shard()
    with client:
        first = sh.acquire_consumer("c", A, expiry_ms=60_000)
        assert sh.acquire_consumer("c", B).epoch == first.epoch + 1
        with pytest.raises(ConsumerFenced, match="held by query b"):
            sh.advance_consumer("c", first.epoch, position="o", upper=1, since=0, holder=A)
        with pytest.raises(ConsumerInUse):
            sh.drop_consumer("c")
        with pytest.raises(UnknownConsumer, match="its consumers: 'c'"):
            sh.reset_consumer("nope", position="", upper=0, since=0)
        assert sh.consumers()["c"].holder == B
