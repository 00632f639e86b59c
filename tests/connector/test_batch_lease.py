"""A Spark batch read holds its parts for as long as its job runs (issue 13 item 3(c)).

Spark's planner and its tasks are called directly, as Spark calls them, on an
in-memory location whose client has a hand-moved clock: the job "runs" for
minutes without sleeping, and compaction and GC run between its tasks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest
from pyspark.sql.datasource import InputPartition

import pyspark_persist.batch_reader as batch_reader
import pyspark_persist.source as source
from pyspark_persist.batch_reader import PersistBatchReader, make_batch_reader
from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import read_schema
from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.drop import drop_shard
from pyspark_persist.state.errors import LeaseExpired, ShardDropped

SCHEMA = pa.schema([("id", pa.int64())])
ROWS_PER_BATCH = 1_000
"""Rows of each committed batch: past inline_write_max_bytes, so every part lives in Blob."""


class Job:
    """A shard of four batches and the options of a batch read of it, on a clock we move."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **options: str) -> None:
        tag = uuid.uuid4().hex
        self.now_ms = 1_000_000
        self.client = PersistClient(
            open_blob(f"mem://{tag}"),
            open_consensus(f"mem://{tag}"),
            config=PersistConfig(maintenance=False, compaction_fan_in=2),
            clock_ms=lambda: self.now_ms,
        )
        # The planner's client and the tasks' lease client are this one (same process).
        key = (f"mem://{tag}", f"mem://{tag}")
        monkeypatch.setitem(source._clients, (*key, None), self.client)
        monkeypatch.setitem(batch_reader._lease_clients, key, self.client)
        monkeypatch.setattr(batch_reader, "clock_ms", lambda: self.now_ms)
        self.shard = self.client.open_shard("events", SCHEMA)
        self.writer = self.shard.writer("loader")
        for i in range(4):
            ids = range(i * ROWS_PER_BATCH, (i + 1) * ROWS_PER_BATCH)
            self.writer.compare_and_append(pa.table({"id": list(ids)}), i, i + 1, token=i + 1)
        self.opts = PersistOptions.parse(
            {"blob": f"mem://{tag}", "consensus": f"mem://{tag}", "path": "events", **options},
            "read",
        )

    def reader(self) -> PersistBatchReader:
        """What Spark's ``reader(schema)`` returns (pickled to the tasks in real life)."""
        return make_batch_reader(self.opts, read_schema(SCHEMA))

    def replace_and_collect(self) -> None:
        """Overwrite the shard, then compact and GC: the planned parts are garbage unless held."""
        upper = self.writer.fetch_upper()
        staged = self.writer.builder()
        staged.add(pa.table({"id": [-1]}))
        self.writer.compare_and_append_batches(
            [staged.finish()], upper, upper + 1, token=100, ts_rewrite=upper, replace=True
        )
        self.shard.compact()
        self.shard.gc()

    def close(self) -> None:
        """Close the client."""
        self.client.close()


@pytest.fixture
def job(monkeypatch: pytest.MonkeyPatch) -> Iterator[Job]:
    """A Job with the default lease."""
    j = Job(monkeypatch, minPartitions="2")
    yield j
    j.close()


def _ids(reader: PersistBatchReader, partition: InputPartition) -> list[int]:
    """What one task returns to Spark: the ids of every row it read."""
    return [i for rb in reader.read(partition) for i in rb.column("id").to_pylist()]


def test_batch_read_longer_than_the_lease_keeps_its_parts(job: Job) -> None:
    """A job that runs 80 s (past the 60 s lease) with GC in between reads every row: its
    tasks heartbeat the lease. On the old code the lease ran out 60 s after planning and the
    second task failed on parts GC had deleted."""
    reader = job.reader()
    partitions = reader.partitions()
    assert len(partitions) == 2
    job.now_ms += 40_000
    first = _ids(reader, partitions[0])
    job.now_ms += 40_000  # 80 s after planning: the planned lease alone would have expired
    job.replace_and_collect()
    second = _ids(reader, partitions[1])
    assert sorted(first + second) == list(range(4 * ROWS_PER_BATCH))


def test_lease_seconds_option_and_expiry_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """``leaseSeconds`` sets how long a read's parts are held with no task running; a task that
    starts after that fails with LeaseExpired naming the option, not with a missing part."""
    long = Job(monkeypatch, leaseSeconds="300")
    reader = long.reader()
    (partition,) = reader.partitions()
    long.now_ms += 200_000  # tasks queued for 200 s before the first ran
    long.replace_and_collect()
    assert sorted(_ids(reader, partition)) == list(range(4 * ROWS_PER_BATCH))
    long.close()

    short = Job(monkeypatch, leaseSeconds="10")
    reader = short.reader()
    (partition,) = reader.partitions()
    short.now_ms += 11_000
    short.replace_and_collect()
    with pytest.raises(LeaseExpired, match="leaseSeconds"):
        _ids(reader, partition)
    short.close()


def test_tasks_that_start_soon_after_planning_touch_no_consensus(job: Job) -> None:
    """Tasks that start within a third of the lease read without a heartbeat (the planner's
    registration holds): the shard's state does not move. Later tasks do heartbeat."""
    reader = job.reader()
    partitions = reader.partitions()
    seqno = job.shard.machine.fetch_latest().seqno
    job.now_ms += 19_000  # under a third of the default 60 s lease
    rows = [i for p in partitions for i in _ids(reader, p)]
    assert sorted(rows) == list(range(4 * ROWS_PER_BATCH))
    assert job.shard.machine.fetch_latest().seqno == seqno
    job.now_ms += 2_000  # 21 s after planning: the next task extends the lease
    assert _ids(reader, partitions[0])
    assert job.shard.machine.fetch_latest().seqno == seqno + 1


def test_a_task_of_a_read_whose_shard_was_dropped_fails_with_shard_dropped(job: Job) -> None:
    """The shard is dropped and created again under its name between planning and a task's
    heartbeat: the task fails with ShardDropped naming the shard, and heartbeats nothing in
    the new shard. Before the fix it heartbeated the new shard, where its reader was never
    registered, and failed with LeaseExpired telling the user to lengthen leaseSeconds."""
    reader = job.reader()
    partitions = reader.partitions()
    drop_shard(job.client.consensus, job.client.blob, "events", now_ms=job.now_ms, force=True)
    again = job.client.open_shard("events", SCHEMA)
    again.writer().append(pa.table({"id": [-5]}))
    seqno = again.state().seqno
    job.now_ms += 21_000  # past a third of the lease: the task heartbeats before reading
    with pytest.raises(ShardDropped, match="'events' was dropped"):
        _ids(reader, partitions[0])
    assert again.state().seqno == seqno and dict(again.state().leased_readers) == {}
