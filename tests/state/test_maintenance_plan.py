"""Maintenance planned as data: what ``--dry-run`` shows is what the real pass then does.

``compaction_plan`` is pure (a state in, merges out); ``plan_gc`` only reads;
``requests_after_commit`` is pure (a state in, the requests a commit queues out).
Each test plans, checks nothing changed, runs the real pass, and compares.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from types import MappingProxyType

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.maintenance import plan_gc
from pyspark_persist.state.maintenance_policy import (
    BACKGROUND_COMPACTION_ROUNDS,
    CompactRequest,
    GcRequest,
    compaction_due,
    compaction_plan,
    compaction_request,
    requests_after_commit,
)
from pyspark_persist.state.state import Batch, LeasedReaderState, PartRef, ShardState

SCHEMA = pa.schema([("id", pa.int64())])


def make_client(fan_in: int, clock: list[int] | None = None) -> PersistClient:
    """A mem client; with ``clock``, its clock reads ``clock[0]`` (milliseconds)."""
    tag = uuid.uuid4().hex
    config = PersistConfig(
        maintenance=False,
        compaction_fan_in=fan_in,
        inline_write_max_bytes=1,
        staged_part_grace_s=1,
        retry_timeout_s=0.25,  # less than half the grace, as PersistConfig requires
    )
    return PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=config,
        clock_ms=None if clock is None else (lambda: clock[0]),
    )


@pytest.mark.parametrize(
    ("fan_in", "sizes", "merges"),
    [
        (2, [1], []),  # one batch: nothing to merge
        (2, [1, 1], [2]),
        (4, [1, 1, 1], []),  # fewer than fan_in batches
        (2, [1, 1, 1, 1, 1], [5]),  # a run of one tier merges whole
        (2, [2, 1, 1], [2, 2]),  # the merge joins the tier before it
        (2, [4, 2, 1, 1], [2, 2, 2]),  # a cascade
        (3, [50, 9, 9, 1, 1, 1, 9], [3]),  # the merge lands between other tiers: done
    ],
)
def test_compaction_plan_names_the_merges_compaction_then_makes(
    fan_in: int, sizes: list[int], merges: list[int]
) -> None:
    client = make_client(fan_in)
    shard = client.open_shard("s", SCHEMA)
    writer = shard.writer()
    start = 0
    for n in sizes:  # distinct ids: consolidation cancels nothing, so the plan is exact
        writer.append(pa.table({"id": list(range(start, start + n))}))
        start += n
    state = shard.state()
    plan = compaction_plan(state, client.config)
    assert shard.state() is state  # planning changed nothing
    reports = shard.compact()
    assert [(r.batches_in, r.rows_in) for r in reports] == [
        (len(merge), sum(b.rows for b in merge)) for merge in plan
    ]
    assert all(r.applied for r in reports)
    assert [len(merge) for merge in plan] == merges
    assert compaction_plan(shard.state(), client.config) == []
    client.close()


def test_plan_gc_names_what_gc_then_deletes_and_writes_nothing() -> None:
    clock = [time.time_ns() // 1_000_000]
    client = make_client(2, clock)
    shard = client.open_shard("s", SCHEMA)
    writer = shard.writer()
    for i in range(8):
        writer.append(pa.table({"id": [i]}))
    shard.compact()
    staged = writer.builder()
    staged.add(pa.table({"id": [99]}))
    orphan = staged.finish().parts[0].key  # staged, never committed
    clock[0] += 2000  # past staged_part_grace_s: an orphan the sweep deletes
    rows_before = client.consensus.scan("s", 0)
    keys_before = {m.key for m in client.blob.list_keys()}
    plan = plan_gc(shard.machine)
    assert client.consensus.scan("s", 0) == rows_before
    assert {m.key for m in client.blob.list_keys()} == keys_before
    assert len(plan.parts) > 0 and orphan in plan.orphans
    assert plan.consensus_rows > 0 and plan.readers_expired == ()
    report = shard.gc()
    assert report.parts_deleted == len(plan.parts)
    assert report.orphans_deleted == len(plan.orphans)
    gone = keys_before - {m.key for m in client.blob.list_keys()}
    assert gone == set(plan.parts) | set(plan.orphans)
    assert report.consensus_rows_deleted >= plan.consensus_rows
    assert sorted(shard.reader().snapshot_table()["id"].to_pylist()) == list(range(8))
    client.close()


def test_plan_gc_counts_readers_whose_lease_ran_out() -> None:
    clock = [time.time_ns() // 1_000_000]
    client = make_client(2, clock)
    shard = client.open_shard("s", SCHEMA)
    shard.writer().append(pa.table({"id": [1]}))
    shard.reader("sleepy")
    clock[0] += int(client.config.reader_lease_s * 1000) + 1
    plan = plan_gc(shard.machine)
    assert plan.readers_expired == ("sleepy",)
    assert "sleepy" in shard.machine.fetch_latest().leased_readers  # planned, not done
    assert shard.gc().readers_expired == ("sleepy",)
    other = PersistClient(client.blob, client.consensus, cache=StateCache())
    assert "sleepy" not in other.open_shard("s").state().leased_readers
    client.close()


# --- what a commit asks for: pure, over hand-built states ---------------------------------


def _state(
    batch_rows: list[int], seqno: int, last_gc_seqno: int, reader_seqno: int | None
) -> ShardState:
    """A state with one batch of ``rows`` updates per entry (tiers follow rows), at ``seqno``,
    last collected at ``last_gc_seqno``, with one leased reader holding ``reader_seqno``."""
    batches = [
        Batch(i, i + 1, 0, (PartRef(f"p{i}", None, 10, rows, i, i),))
        for i, rows in enumerate(batch_rows)
    ]
    readers = {} if reader_seqno is None else {"r": LeasedReaderState(0, reader_seqno, 0, 1000)}
    return ShardState(
        shard_id="s",
        seqno=seqno,
        schema=b"",
        since=0,
        upper=len(batch_rows),
        last_gc_seqno=last_gc_seqno,
        batches=MappingProxyType({b.key: b for b in batches}),
        leased_readers=MappingProxyType(readers),
    )


def test_only_a_commit_that_can_make_a_merge_due_asks_for_compaction() -> None:
    """A commit that left the batches alone (a reader's heartbeat or since downgrade) asks
    for no compaction, unless it moved the since of a shard with retention (which can
    expire a run of batches); one that changed the batches does."""
    config = PersistConfig(compaction_fan_in=2, gc_interval=32)
    before = _state([1, 1], 1, 0, None)
    held = replace(before, seqno=2, since=1)  # the same batches mapping, as apply keeps it
    assert requests_after_commit(held, config, before) == ()
    appended = replace(held, seqno=3, batches=MappingProxyType(dict(held.batches)))
    assert requests_after_commit(appended, config, held) == (
        CompactRequest(BACKGROUND_COMPACTION_ROUNDS),
    )
    retained = replace(before, retention_ms=1000)
    assert requests_after_commit(replace(retained, seqno=2, since=1), config, retained) == (
        CompactRequest(BACKGROUND_COMPACTION_ROUNDS),
    )


@pytest.mark.parametrize(
    ("batch_rows", "seqno", "last_gc", "reader", "maintenance", "want"),
    [
        ([1], 1, 0, None, True, []),
        ([1, 1], 1, 0, None, True, ["compact"]),  # fan_in (2) batches of one tier
        ([100, 1], 1, 0, None, True, []),  # two tiers: nothing to merge yet
        ([1], 40, 0, None, True, ["gc"]),  # 40 SeqNos since the last GC >= gc_interval (32)
        ([1], 40, 10, None, True, []),  # only 30 since
        ([1], 40, 0, 20, True, []),  # a reader holds SeqNo 20: only 20 collectable
        ([1], 40, 0, 32, True, ["gc"]),
        ([1, 1], 40, 0, None, True, ["compact", "gc"]),
        ([1, 1], 40, 0, None, False, []),  # maintenance off: never
    ],
)
def test_a_commit_asks_for_maintenance_as_data(
    batch_rows: list[int],
    seqno: int,
    last_gc: int,
    reader: int | None,
    maintenance: bool,
    want: list[str],
) -> None:
    """requests_after_commit returns the requests a commit's new state calls for (no I/O)."""
    config = PersistConfig(compaction_fan_in=2, gc_interval=32, maintenance=maintenance)
    got = requests_after_commit(_state(batch_rows, seqno, last_gc, reader), config)
    names = {CompactRequest: "compact", GcRequest: "gc"}
    assert [names[type(r)] for r in got] == want
    assert all(
        r == CompactRequest(BACKGROUND_COMPACTION_ROUNDS)
        if isinstance(r, CompactRequest)
        else r == GcRequest(sweep_orphans=False, force=False)
        for r in got
    )


@settings(max_examples=400, deadline=None)
@given(
    batch_rows=st.lists(st.integers(0, 5000), max_size=70),
    fan_in=st.integers(2, 9),
    retention=st.booleans(),
    since=st.integers(0, 70),
)
def test_compaction_due_answers_what_compaction_request_would(
    batch_rows: list[int], fan_in: int, retention: bool, since: int
) -> None:
    """The cheap check every commit runs agrees with the full request on any trace: runs of
    one tier anywhere, traces past fan_in * MAX_TIERS, and retention's expired runs."""
    config = PersistConfig(compaction_fan_in=fan_in)
    state = replace(
        _state(batch_rows, 1, 0, None),
        retention_ms=1000 if retention else 0,
        since=min(since, max(len(batch_rows) - 1, 0)),
    )
    assert compaction_due(state, config) == (compaction_request(state, config) is not None)
