"""The persist Spark source without Spark: offsets, leases, splitting, limits, bad input.

Spark drives a streaming reader through ``initialOffset``/``latestOffset``/
``partitions``/``commit`` on the driver and ``read`` on executors; these tests
make the same calls in the same order on a :class:`PersistStreamReader` over
an in-memory location, so every rule of the source is checked in
milliseconds. ``tests/test_source_spark.py`` checks the same paths end to end.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxFiles,
    ReadMaxRows,
)
from source_helpers import PUBSUB, SCHEMA, Row, merge_all, reader_with_lost_pushes, rows

from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import read_schema
from pyspark_persist.state import PersistClient, Shard
from pyspark_persist.state.drop import drop_shard
from pyspark_persist.state.errors import InvalidUsage, ShardDropped
from pyspark_persist.stream_reader import (
    DataLoss,
    LeaseHolder,
    Offset,
    PersistInputPartition,
    PersistStreamReader,
    read_partition,
)


class Env:
    """A fresh in-memory location with one shard, and the options naming it."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex
        self.base = {"blob": f"mem://{tag}", "consensus": f"mem://{tag}", "shard": f"s{tag[:12]}"}
        self.client = PersistClient.open(self.base["blob"], self.base["consensus"])
        self.shard: Shard = self.client.open_shard(self.base["shard"], SCHEMA)
        self.writer = self.shard.writer()

    def write(self, table: pa.Table) -> int:
        """Commit ``table`` as one batch one time unit past the current upper; its time."""
        upper = self.shard.upper
        self.writer.compare_and_append(table, upper, upper + 1)
        return upper

    def opts(self, **extra: str) -> PersistOptions:
        """Streaming-read options for this shard (extra keys as a user would spell them)."""
        return PersistOptions.parse({**self.base, **extra}, "stream_read")

    def reader(self, **extra: str) -> PersistStreamReader:
        """A streaming reader as ``format("persist")`` builds it."""
        return PersistStreamReader(self.opts(**extra), read_schema(SCHEMA))


def read_all(reader: PersistStreamReader, parts: Any) -> list[dict[str, Any]]:
    """What executors would emit for ``parts`` (via a pickle round trip, as Spark ships them)."""
    import pickle

    remote: PersistStreamReader = pickle.loads(pickle.dumps(reader))
    assert remote._holder is None  # only options travel to executors
    out: list[dict[str, Any]] = []
    for p in parts:
        for batch in remote.read(pickle.loads(pickle.dumps(p))):
            out.extend(batch.to_pylist())
    return out


def consolidated(updates: list[dict[str, Any]]) -> Counter[Row]:
    """Sum diffs per row; drop zeros."""
    c: Counter[Row] = Counter()
    for u in updates:
        c[(u["id"], u["s"])] += u["_diff"]
    return Counter({k: v for k, v in c.items() if v})


def snapshot(env: Env) -> Counter[Row]:
    """The shard's current contents, through the plain Python API."""
    with env.shard.reader() as r:
        return consolidated(r.snapshot_table().to_pylist())


def micro_batch(
    reader: PersistStreamReader, start: dict[str, Any], limit: ReadLimit | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]], int]:
    """One micro-batch as Spark runs it: (end offset, rows emitted, InputPartitions)."""
    end = reader.latestOffset(start, limit or reader.getDefaultReadLimit())
    if end == start:
        return end, [], 0
    parts = reader.partitions(start, end)
    out = read_all(reader, parts)
    reader.commit(end)
    return end, out, len(parts)


def drain(
    reader: PersistStreamReader, start: dict[str, Any], limit: ReadLimit | None = None
) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """Micro-batches until nothing new: the last offset and each batch's rows."""
    batches = []
    for _ in range(100):
        end, out, _ = micro_batch(reader, start, limit)
        if end == start:
            return end, batches
        batches.append(out)
        start = end
    raise AssertionError("the source never stopped producing micro-batches")


def test_first_micro_batch_of_a_big_snapshot_is_split_over_partitions() -> None:
    """splitSizeBytes/minPartitions spread the snapshot's parts over InputPartitions; all read."""
    env = Env()
    for k in range(6):
        env.write(rows(range(k * 300, (k + 1) * 300)))
    expected = snapshot(env)
    for extra, n in (({}, 1), ({"splitSizeBytes": "1"}, 6), ({"minPartitions": "3"}, 3)):
        holder = LeaseHolder(env.opts(**extra))
        start = holder.initial_offset()
        end = holder.latest_offset(start, ReadAllAvailable())
        plan = holder.plan(start, end)
        assert len(plan) == n, extra
        assert all(isinstance(p, PersistInputPartition) and p.parts for p in plan)
        schema = read_schema(SCHEMA)
        got = [r for p in plan for b in read_partition(p, schema) for r in b.to_pylist()]
        assert consolidated(got) == expected
        assert {r["_time"] for r in got} == {end.upper - 1}
        holder.close()


# --- the stream: consolidated changes, leases, GC ----------------------------------------


def test_snapshot_then_changes_with_retractions_sum_to_the_shard() -> None:
    """Inserts, retractions, re-inserts between micro-batches: emitted diffs sum to the shard."""
    env = Env()
    env.write(rows(range(0, 400)))
    reader = env.reader()
    start, batches = drain(reader, reader.initialOffset())
    assert len(batches) == 1
    env.write(rows(range(0, 100), diff=-1))  # retract
    env.write(rows(range(400, 500)))
    start, more = drain(reader, start)
    env.write(rows(range(50, 60)))  # re-insert some retracted rows
    env.write(rows(range(450, 460), diff=-1))
    start, last = drain(reader, start)
    emitted = [r for b in batches + more + last for r in b]
    assert consolidated(emitted) == snapshot(env)
    assert any(r["_diff"] == -1 for r in emitted)
    reader.stop()


def test_gc_and_compaction_during_a_slow_micro_batch_cannot_delete_its_parts() -> None:
    """Parts handed to tasks stay leased until commit; then the reader's SeqNo hold moves on."""
    env = Env()
    # One batch fewer than compaction_fan_in, so background compaction cannot merge them
    # before planning; the test merges explicitly below.
    for k in range(7):
        env.write(rows(range(k * 300, (k + 1) * 300)))
    expected = snapshot(env)
    reader = env.reader(splitSizeBytes="1")
    start = reader.initialOffset()
    end = reader.latestOffset(start, ReadAllAvailable())
    parts = reader.partitions(start, end)
    planned = {
        lp.part.key
        for p in parts
        for lp in p.leased_parts()
        if lp.part.key is not None  # type: ignore[attr-defined]
    }
    assert len(planned) == 7
    leased_at = Offset.from_dict(end, env.base["shard"]).seqno
    # The slow micro-batch: meanwhile writes go on, everything is merged, the driver's
    # reader heartbeats (as the background thread does) and GC runs as hard as it can.
    env.write(rows(range(5000, 5300)))
    merge_all(env.shard)
    reader.holder._reader.heartbeat()
    env.shard.gc()
    after = env.shard.state()
    assert all(p.key not in planned for b in after.trace for p in b.parts)  # merged away
    assert after.seqno_since <= leased_at
    assert all(env.client.blob.get(k) is not None for k in planned)
    # Every task still reads every part.
    assert consolidated(read_all(reader, parts)) == expected
    reader.commit(end)
    reader.holder.holds.flush()  # the holds reach state in the background
    committed = env.shard.state()
    assert committed.seqno_since > leased_at
    reader_id = reader.holder._reader.reader_id
    assert committed.leased_readers[reader_id].seqno > leased_at
    emitted_upper = Offset.from_dict(end, env.base["shard"]).upper
    assert committed.leased_readers[reader_id].since == emitted_upper - 1
    env.shard.gc()
    assert all(env.client.blob.get(k) is None for k in planned)  # now they may go
    # ...and the stream goes on from the compacted shard without gap or duplicate.
    _, more = drain(reader, end)
    tail = consolidated([r for b in more for r in b])
    assert tail == consolidated(rows(range(5000, 5300)).to_pylist())
    reader.stop()
    assert reader_id not in env.shard.state().leased_readers


def test_commit_returns_at_once_and_the_holds_follow_in_the_background() -> None:
    """Spark waits for commit() before the next micro-batch: it must not wait on Consensus.

    The leases go in memory at once; the since and SeqNo hold reach state from
    the HoldUpdater thread, here held back until the test lets it go.
    """
    env = Env()
    env.write(rows(range(100)))
    reader = env.reader()
    start = reader.initialOffset()
    end, _, _ = micro_batch(reader, start)
    reader.holder.holds.flush()
    handle = reader.holder._reader
    gate = threading.Event()
    real = handle.downgrade_since

    def slow_downgrade(since: int) -> None:
        gate.wait(10)
        real(since)

    handle.downgrade_since = slow_downgrade  # type: ignore[method-assign]
    env.write(rows(range(100, 200)))
    end2, out, _ = micro_batch(reader, end)  # its commit() returns while the update waits
    assert len(out) == 100
    assert handle.leased_seqnos() == []  # the leases are back already
    emitted = Offset.from_dict(end2, env.base["shard"]).upper
    assert env.shard.state().leased_readers[handle.reader_id].since < emitted - 1
    gate.set()
    reader.holder.holds.flush()
    assert env.shard.state().leased_readers[handle.reader_id].since == emitted - 1
    reader.stop()


def test_a_failed_background_hold_update_fails_the_next_call() -> None:
    """A reader that expired (say, the driver stalled past its lease) fails the query loudly."""
    from pyspark_persist.state import commands
    from pyspark_persist.state.errors import LeaseExpired

    env = Env()
    env.write(rows(range(10)))
    reader = env.reader()
    end, _, _ = micro_batch(reader, reader.initialOffset())
    rid = reader.holder._reader.reader_id
    env.shard.machine.run(lambda s: commands.expire_leased_readers(s, reader_ids=(rid,)))
    reader.commit(end)  # the update fails in the background...
    with pytest.raises(LeaseExpired, match=rid):
        reader.holder.holds.flush()
    with pytest.raises(LeaseExpired, match=rid):  # ...and every later call says so
        reader.latestOffset(end, reader.getDefaultReadLimit())


def test_restart_from_checkpointed_offset_after_compaction() -> None:
    """A new reader resuming at a committed offset of a compacted shard: no gap, no duplicate."""
    env = Env()
    for k in range(3):
        env.write(rows(range(k * 100, (k + 1) * 100)))
    first = env.reader()
    checkpoint, batches = drain(first, first.initialOffset())
    first.stop()  # the query stops; its reader expires
    for k in range(3, 6):
        env.write(rows(range(k * 100, (k + 1) * 100)))
    env.write(rows(range(0, 50), diff=-1))
    merge_all(env.shard)
    assert len(env.shard.state().trace) == 1
    second = env.reader()
    _, more = drain(second, checkpoint)
    emitted = [r for b in batches + more for r in b]
    assert Counter(r["_diff"] for b in more for r in b) == Counter({1: 300, -1: 50})
    assert consolidated(emitted) == snapshot(env)
    second.stop()


# --- read limits and AvailableNow --------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "cost"),
    [
        ("maxRowsPerTrigger", "250", lambda p: p.part.rows),
        ("maxFilesPerTrigger", "2", lambda p: 1),
        ("maxBytesPerTrigger", "", lambda p: p.part.size_bytes),
    ],
)
def test_read_limit_caps_each_micro_batch(option: str, value: str, cost: Any) -> None:
    """Each limit caps a micro-batch at whole batches; a batch over the cap still goes alone."""
    env = Env()
    env.write(rows(range(0, 10)))
    # Listen batches only: capped snapshots are checked in test_stream_semantics_unit.py.
    reader = env.reader(startingPosition="latest", **({option: value} if value else {}))
    start = reader.initialOffset()
    for k in range(1, 7):
        env.write(rows(range(k * 100, k * 100 + 100)))
    env.write(rows(range(5000, 5600)))  # bigger than every cap: must still make progress
    if not value:
        value = str(int(env.shard.state().trace[1].size_bytes * 2.5))
        reader = env.reader(startingPosition="latest", **{option: value})
    cap = int(value)
    limit = reader.getDefaultReadLimit()
    assert isinstance(limit, ReadMaxRows | ReadMaxFiles | ReadMaxBytes)
    seen: list[int] = []
    while True:
        end = reader.latestOffset(start, limit)
        if end == start:
            break
        parts = reader.partitions(start, end)
        leased = [lp for p in parts for lp in p.leased_parts()]  # type: ignore[attr-defined]
        spent = sum(cost(lp) for lp in leased)
        assert spent <= cap or len(leased) == 1, (spent, cap)
        seen.append(len(leased))
        reader.commit(end)
        start = end
    assert Offset.from_dict(start, env.base["shard"]).upper == env.shard.upper
    assert sum(seen) == 7 and len(seen) >= 4
    reader.stop()


def test_available_now_ends_at_the_upper_seen_when_prepared() -> None:
    """Trigger.AvailableNow: later writes are left for the next run, with or without a limit."""
    env = Env()
    for k in range(4):
        env.write(rows(range(k * 100, k * 100 + 100)))
    for late, extra in ((9000, {}), (9100, {"maxRowsPerTrigger": "100"})):
        reader = env.reader(**extra)
        reader.prepareForTriggerAvailableNow()
        prepared = env.shard.upper
        expected = snapshot(env)
        start = reader.initialOffset()
        env.write(rows(range(late, late + 100)))
        end, batches = drain(reader, start)
        assert Offset.from_dict(end, env.base["shard"]).upper == prepared
        assert consolidated([r for b in batches for r in b]) == expected
        reader.stop()


def test_available_now_with_limit_survives_compaction_across_its_upper() -> None:
    """A merged batch straddling the AvailableNow upper must not stall a limited query.

    Regression: the cap (now ``planning.limited_upper``) stopped before such a batch and
    returned the start's upper, so each micro-batch was empty and AvailableNow never terminated.
    """
    env = Env()
    for k in range(3):
        env.write(rows(range(k * 100, k * 100 + 100)))
    reader = env.reader(maxRowsPerTrigger="100")
    reader.prepareForTriggerAvailableNow()
    prepared = env.shard.upper
    start, _ = drain(reader, reader.initialOffset())
    assert Offset.from_dict(start, env.base["shard"]).upper == prepared
    # A fresh AvailableNow run resumes here; meanwhile more writes, then everything merges.
    env.write(rows(range(300, 400)))
    env.write(rows(range(400, 500)))
    reader2 = env.reader(maxRowsPerTrigger="100")
    reader2.prepareForTriggerAvailableNow()
    env.write(rows(range(500, 600)))
    merge_all(env.shard)
    end, batches = drain(reader2, start)
    assert Offset.from_dict(end, env.base["shard"]).upper == prepared + 2
    assert sorted(r["id"] for b in batches for r in b) == list(range(300, 500))
    reader.stop()
    reader2.stop()


# --- starting positions ------------------------------------------------------------------


def test_starting_position_latest_gives_only_new_changes() -> None:
    """startingPosition=latest: nothing already in the shard, every change after the start."""
    env = Env()
    env.write(rows(range(0, 100)))
    reader = env.reader(startingPosition="LATEST")
    start = reader.initialOffset()
    assert reader.latestOffset(start, ReadAllAvailable()) == start
    env.write(rows(range(100, 150)))
    env.write(rows(range(0, 10), diff=-1))
    _, batches = drain(reader, start)
    got = consolidated([r for b in batches for r in b])
    want = consolidated(rows(range(100, 150)).to_pylist() + rows(range(0, 10), -1).to_pylist())
    assert got == want
    reader.stop()


def test_starting_as_of_gives_the_snapshot_at_that_time_then_changes() -> None:
    """startingAsOf=T: the collection at T (as of T), then every change after T."""
    env = Env()
    t0 = env.write(rows(range(0, 100)))
    t1 = env.write(rows(range(0, 20), diff=-1))
    t2 = env.write(rows(range(100, 130)))
    assert (t0, t1, t2) == (0, 1, 2)
    reader = env.reader(startingAsOf=str(t1))
    start = reader.initialOffset()
    end, first, _ = micro_batch(reader, start)
    assert consolidated(first) == consolidated(rows(range(20, 100)).to_pylist())
    assert {r["_time"] for r in first} == {t1}
    _, batches = drain(reader, end)
    later = [r for b in batches for r in b]
    assert consolidated(later) == consolidated(rows(range(100, 130)).to_pylist())
    assert {r["_time"] for r in later} == {t2}
    reader.stop()


def _compact_past(env: Env, since: int) -> None:
    """Advance the shard's since to ``since`` (a reader's hold moves, then goes) and compact."""
    with env.shard.reader() as r:
        r.downgrade_since(since)
    assert env.shard.since == since
    merge_all(env.shard)


def test_starting_as_of_compacted_away_fails_or_skips_ahead() -> None:
    """startingAsOf before since: error naming failOnDataLoss, or (false) the snapshot at since."""
    env = Env()
    for k in range(4):
        env.write(rows(range(k * 100, k * 100 + 100)))
    _compact_past(env, 2)
    with pytest.raises(DataLoss, match=r"startingAsOf 1 .*since 2.*failOnDataLoss=false"):
        env.reader(startingAsOf="1").initialOffset()
    reader = env.reader(startingAsOf="1", failOnDataLoss="false")
    start = reader.initialOffset()
    assert Offset.from_dict(start, env.base["shard"]).as_of == 2
    end, first, _ = micro_batch(reader, start)
    assert consolidated(first) == consolidated(rows(range(0, 300)).to_pylist())
    _, batches = drain(reader, end)
    assert consolidated([r for b in batches for r in b]) == consolidated(
        rows(range(300, 400)).to_pylist()
    )
    reader.stop()


def test_checkpointed_offset_compacted_away_fails_or_skips_ahead() -> None:
    """Resuming from an offset whose times were compacted: error, or (false) skip to since."""
    env = Env()
    env.write(rows(range(0, 100)))
    first = env.reader()
    checkpoint, _ = drain(first, first.initialOffset())
    first.stop()
    for k in range(1, 5):
        env.write(rows(range(k * 100, k * 100 + 100)))
    _compact_past(env, 3)  # times 1..3 are merged into 3: the changes at 1 and 2 are gone
    strict = env.reader()
    end = strict.latestOffset(checkpoint, ReadAllAvailable())
    with pytest.raises(DataLoss, match=r"compacted before this query read them.*failOnDataLoss"):
        strict.partitions(checkpoint, end)
    strict.stop()
    lenient = env.reader(failOnDataLoss="false")
    _, batches = drain(lenient, checkpoint)
    assert consolidated([r for b in batches for r in b]) == consolidated(
        rows(range(400, 500)).to_pylist()
    )
    lenient.stop()


# --- bad input ---------------------------------------------------------------------------


def test_offset_checkpointed_for_another_shard_is_refused() -> None:
    """A checkpoint of shard A reused for shard B: a clear error naming both and the fix."""
    env = Env()
    env.write(rows(range(10)))
    other = Offset("other-shard", 3, 5, "listen").to_dict()
    reader = env.reader()
    with pytest.raises(InvalidUsage, match=r"'other-shard'.*new checkpointLocation"):
        reader.latestOffset(other, ReadAllAvailable())
    with pytest.raises(InvalidUsage, match="malformed offset"):
        reader.latestOffset({"shard": env.base["shard"], "phase": "later"}, ReadAllAvailable())
    reader.stop()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"noSuchOption": "1"}, r"option\(s\) nosuchoption not valid for stream read"),
        ({"asOf": "3"}, r"option\(s\) asOf not valid for stream read"),
        (
            {"maxRowsPerTrigger": "5", "MAXFILESPERTRIGGER": "2"},
            r"read limits maxFilesPerTrigger, maxRowsPerTrigger contradict",
        ),
        (
            {"startingPosition": "earliest", "startingAsOf": "3"},
            "startingPosition and startingAsOf contradict",
        ),
        ({"startingPosition": "beginning"}, "startingPosition='beginning'"),
        ({"maxBytesPerTrigger": "lots"}, "maxBytesPerTrigger='lots' must be a size"),
        ({"maxRowsPerTrigger": "0"}, "maxRowsPerTrigger='0' must be at least 1"),
        ({"failOnDataLoss": "maybe"}, "failOnDataLoss='maybe' must be true or false"),
        ({"shard": "a", "path": "b"}, "contradicts the load"),
        ({"shard": "../x"}, "invalid shard name"),
    ],
)
def test_bad_stream_options_name_the_option(options: dict[str, str], message: str) -> None:
    """Unknown, misplaced, malformed, contradictory options fail at parse, naming the option."""
    base = {"shard": "s1", "blob": "mem://o", "consensus": "mem://o"}
    with pytest.raises(InvalidUsage, match=message):
        PersistOptions.parse({**base, **options}, "stream_read")


def test_options_are_case_insensitive() -> None:
    """Spark lower-cases option keys; every spelling parses to the same options."""
    a = PersistOptions.parse(
        {"shard": "x", "MaxRowsPerTrigger": "7", "SPLITSIZEBYTES": "2m"}, "stream_read"
    )
    assert (a.max_rows, a.split_size_bytes) == (7, 2 << 20)


def test_the_schema_lookup_never_connects_to_pubsub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark asks a source for its schema once, in a planner worker: the answer is the shard's
    columns read from Consensus, with no PubSub connection (or server) started for it."""
    import pyspark_persist.pubsub
    from pyspark_persist.source import PersistDataSource

    def refuse(*args: Any) -> Any:
        raise AssertionError("the schema lookup connected to PubSub")

    monkeypatch.setattr(pyspark_persist.pubsub, "connect", refuse)
    env = Env()
    source = PersistDataSource({**env.base, "pubsub": "auto"})
    assert source.schema() == read_schema(SCHEMA)


def test_latest_offset_waits_for_a_pubsub_commit_when_nothing_is_new(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing new, latestOffset waits a moment for PubSub to bring a commit, so one that
    lands just after the trigger is in this micro-batch rather than the next; the wait shows
    as ``waited_ms`` in metricsFile. With nothing coming it returns the start after it."""
    import json
    import time

    import pyspark_persist.stream_reader as stream_reader

    wait_s = 2.0  # the real wait is 10 ms: long enough here to tell on a busy machine
    monkeypatch.setattr(stream_reader, "COMMIT_WAIT_S", wait_s)
    base = {
        "blob": f"file://{tmp_path}/blob",
        "consensus": f"sqlite:///{tmp_path}/consensus.db",
        "shard": "waited",
    }
    client = PersistClient.open(base["blob"], base["consensus"])
    writer = client.open_shard("waited", SCHEMA).writer()
    writer.append(rows(range(3)))
    metrics = tmp_path / "metrics.jsonl"
    opts = PersistOptions.parse(
        {**base, "pubsub": "auto", "startingPosition": "latest", "metricsFile": str(metrics)},
        "stream_read",
    )
    holder = LeaseHolder(opts)
    deadline = time.monotonic() + 30
    while not holder.machine.shared.push_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert holder.machine.shared.push_healthy, "the PubSub subscription never came up"
    start = holder.initial_offset()

    began = time.monotonic()
    assert holder.latest_offset(start, ReadAllAvailable()) == start  # nothing came
    assert time.monotonic() - began >= wait_s

    later = threading.Timer(0.2, lambda: writer.append(rows(range(3, 5))))
    later.start()
    end = holder.latest_offset(start, ReadAllAvailable())
    later.join()
    assert end.upper > start.upper, "the commit during the wait was not picked up"
    read = read_all(PersistStreamReader(opts, read_schema(SCHEMA)), holder.plan(start, end))
    assert sorted(r["id"] for r in read) == [3, 4]
    (line,) = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert 0 < line["waited_ms"] < wait_s * 1000
    holder.close()
    client.close()


def test_latest_offset_sees_a_commit_whose_push_was_dropped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With pubsub set and pushes looking healthy, latestOffset may answer from its cache for
    at most pubsubPollMs: a commit whose push never arrives is in the next micro-batch planned
    after that, not hidden until something else refreshes the cache.

    Regression: the cache was trusted for as long as pushes looked healthy, so such a commit
    stayed invisible until the reader's heartbeat (10 s) happened to refresh it."""
    env = Env()
    env.write(rows(range(3)))
    clock = reader_with_lost_pushes(monkeypatch, env.base["blob"], env.base["consensus"])
    reader = env.reader(pubsub=PUBSUB, startingPosition="latest")
    start = reader.initialOffset()
    assert reader.holder.machine.shared.push_healthy

    env.write(rows(range(3, 5)))  # another process's commit; its push is lost
    assert reader.latestOffset(start, ReadAllAvailable()) == start  # cached, within 1 s
    clock[0] += 1000  # pubsubPollMs (default 1 s) later: Consensus is read again
    end = reader.latestOffset(start, ReadAllAvailable())
    assert Offset.from_dict(end, env.base["shard"]).upper == env.shard.upper
    assert sorted(r["id"] for r in read_all(reader, reader.partitions(start, end))) == [3, 4]
    reader.stop()


def test_pubsub_poll_ms_bounds_how_long_a_cached_answer_stands(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pubsubPollMs sets the bound: 0 reads Consensus for every latestOffset, 250 after
    250 ms of the client's clock."""
    env = Env()
    env.write(rows(range(3)))
    clock = reader_with_lost_pushes(monkeypatch, env.base["blob"], env.base["consensus"])
    always = env.reader(pubsub=PUBSUB, startingPosition="latest", pubsubPollMs="0")
    start = always.initialOffset()
    env.write(rows(range(3, 5)))
    assert (
        Offset.from_dict(always.latestOffset(start, ReadAllAvailable()), env.base["shard"]).upper
        == env.shard.upper
    )
    always.stop()

    quarter = env.reader(pubsub=PUBSUB, startingPosition="latest", pubsubPollMs="250")
    start = quarter.initialOffset()
    env.write(rows(range(5, 7)))
    clock[0] += 249
    assert quarter.latestOffset(start, ReadAllAvailable()) == start
    clock[0] += 1
    end = quarter.latestOffset(start, ReadAllAvailable())
    assert Offset.from_dict(end, env.base["shard"]).upper == env.shard.upper
    quarter.stop()


def test_available_now_end_reads_consensus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Trigger.AvailableNow ends at the upper Consensus holds when it is prepared, even while
    pushes look healthy and the cache was just read: a commit whose push was lost is in the
    run.

    Regression: the end came from the cache, so such a commit was left for the next run."""
    env = Env()
    env.write(rows(range(3)))
    reader_with_lost_pushes(monkeypatch, env.base["blob"], env.base["consensus"])
    reader = env.reader(pubsub=PUBSUB)
    start = reader.initialOffset()
    env.write(rows(range(3, 5)))  # another process's commit; its push is lost
    reader.prepareForTriggerAvailableNow()
    end, batches = drain(reader, start)
    assert Offset.from_dict(end, env.base["shard"]).upper == env.shard.upper
    assert consolidated([r for b in batches for r in b]) == snapshot(env)
    reader.stop()


def test_unknown_shard_is_a_clear_error() -> None:
    """Reading a shard that does not exist names the shard (and is never created by the read)."""
    env = Env()
    opts = PersistOptions.parse(
        {**env.base, "shard": "nope-" + uuid.uuid4().hex[:6]}, "stream_read"
    )
    with pytest.raises(Exception, match=r"shard 'nope-\w+' does not exist"):
        LeaseHolder(opts)
    assert opts.shard not in env.client.list_shards()


def _run_python(script: str) -> None:
    """Run ``script`` in a fresh interpreter; it prints ``ok`` when its checks pass."""
    import subprocess
    import sys
    import textwrap

    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_daemon_worker_freezes_its_heap_and_still_collects_each_task_s_garbage() -> None:
    """Spark's daemon runs gc.collect() after every task of a reused Python worker; persist's
    tasks and planner calls freeze what the worker holds, so that collection no longer walks
    every imported object, and cyclic garbage made later is still freed. Objects that outlive
    tasks are frozen again once more than REFREEZE_OBJECTS of them pile up."""
    _run_python(
        """
        import gc, importlib.machinery, sys, weakref
        # What a worker forked by ``python -m pyspark.daemon`` sees as its main module.
        sys.modules["__main__"].__spec__ = importlib.machinery.ModuleSpec("pyspark.daemon", None)
        from pyspark_persist.source import REFREEZE_OBJECTS, freeze_worker_heap
        assert gc.get_freeze_count() == 0
        freeze_worker_heap()
        frozen = gc.get_freeze_count()
        assert frozen > 10_000, frozen  # pyspark's, pyarrow's and persist's objects
        class Node:
            pass
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle made by a task, after the freeze
        alive = weakref.ref(a)
        del a, b
        freeze_worker_heap()  # the next task of the same worker: nothing more to freeze
        assert gc.get_freeze_count() == frozen
        gc.collect()
        assert alive() is None, "a task's cyclic garbage must still be collected"
        kept = [[i] for i in range(REFREEZE_OBJECTS)]  # objects that outlive their task
        freeze_worker_heap()
        assert gc.get_freeze_count() >= frozen + REFREEZE_OBJECTS
        assert len(gc.get_objects()) < REFREEZE_OBJECTS
        print("ok")
        """
    )


def test_a_process_spark_s_daemon_did_not_fork_is_never_frozen() -> None:
    """The user's driver (or any process that is not a daemon-forked worker) keeps its heap
    under the cyclic GC: nothing there collects after every task, and a freeze would keep
    cycles for good."""
    _run_python(
        """
        import gc
        from pyspark_persist.source import freeze_worker_heap
        freeze_worker_heap()
        assert gc.get_freeze_count() == 0
        print("ok")
        """
    )


def test_a_query_whose_offsets_name_a_dropped_shard_fails_with_shard_dropped() -> None:
    """The shard a streaming query reads is dropped and created again under its name: the
    running query, and the query restarted from its checkpoint, fail with ShardDropped and
    emit nothing of the new shard; a query with a new checkpoint reads the new shard. Before
    the fix both went on reading the new shard as if it continued the dropped one."""
    env = Env()
    env.write(rows(range(10)))
    running = env.reader()
    end, out, _ = micro_batch(running, running.initialOffset())
    assert len(out) == 10 and end["incarnation"] == env.shard.state().incarnation
    name = env.base["shard"]
    drop_shard(
        env.client.consensus, env.client.blob, name, now_ms=time.time_ns() // 10**6, force=True
    )
    again = env.client.open_shard(name, SCHEMA)
    for k in range(2):
        again.writer().compare_and_append(rows(range(100 * (k + 1), 100 * (k + 1) + 10)), k, k + 1)

    with pytest.raises(ShardDropped, match=repr(name)):
        running.latestOffset(end, ReadAllAvailable())
    running.stop()
    restarted = env.reader()
    with pytest.raises(ShardDropped, match="new checkpointLocation"):
        restarted.latestOffset(end, ReadAllAvailable())
    with pytest.raises(ShardDropped, match="new checkpointLocation"):
        restarted.partitions(end, {**end, "upper": 2})
    restarted.stop()
    fresh = env.reader()
    _, batches = drain(fresh, fresh.initialOffset())
    assert sorted(r["id"] for b in batches for r in b) == [*range(100, 110), *range(200, 210)]
    fresh.stop()
