"""Maintenance planned as data: what ``--dry-run`` shows is what the real pass then does.

``compaction_plan`` is pure (a state in, merges out); ``plan_gc`` only reads.
Each test plans, checks nothing changed, runs the real pass, and compares.
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.maintenance import compaction_plan, plan_gc

SCHEMA = pa.schema([("id", pa.int64())])


def make_client(fan_in: int, clock: list[int] | None = None) -> PersistClient:
    """A mem client; with ``clock``, its clock reads ``clock[0]`` (milliseconds)."""
    tag = uuid.uuid4().hex
    config = PersistConfig(
        maintenance=False,
        compaction_fan_in=fan_in,
        inline_write_max_bytes=1,
        staged_part_grace_s=1,
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
