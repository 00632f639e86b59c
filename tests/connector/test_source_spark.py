"""The persist source through Spark: streams, restarts, limits, bad input, batch reads.

Data goes into shards with the Python API at the embedded default location
(which Spark's workers share through ``PERSIST_HOME``); queries run with
``trigger(availableNow=True)`` into a ``foreachBatch`` collector (it runs in
this process) or a memory sink. ``tests/test_source_unit.py`` holds the
fast, Spark-free checks of the same rules.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from source_helpers import SCHEMA, Row, error_of, merge_all, rows, run_available_now
from spark_fixtures import auto_registered

from pyspark_persist.state import PersistClient, Shard, commands

pytestmark = pytest.mark.spark


def new_shard() -> Shard:
    """A fresh shard at the default location (what Spark's workers open)."""
    return PersistClient.open().open_shard(f"src-{uuid.uuid4().hex[:12]}", SCHEMA)


def write(shard: Shard, table: pa.Table) -> int:
    """Commit ``table`` as one batch at the next time; returns that time."""
    upper = shard.upper
    shard.writer().compare_and_append(table, upper, upper + 1)
    return upper


def consolidated(updates: list[Any]) -> Counter[Row]:
    """Sum diffs per row (Spark Rows or dicts), drop zeros."""
    c: Counter[Row] = Counter()
    for u in updates:
        c[(u["id"], u["s"])] += u["_diff"]
    return Counter({k: v for k, v in c.items() if v})


def contents(shard: Shard) -> Counter[Row]:
    """The shard now, through the Python API."""
    with shard.reader() as r:
        return consolidated(r.snapshot_table().to_pylist())


# --- streaming ---------------------------------------------------------------------------


def test_stream_while_another_thread_writes_sees_the_consolidated_contents(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A query running while inserts and retractions land emits diffs that sum to the shard."""
    shard = new_shard()
    write(shard, rows(range(0, 200)))
    table = f"live_{shard.name.replace('-', '_')}"
    q = (
        spark.readStream.format("persist")
        .load(shard.name)
        .writeStream.format("memory")
        .queryName(table)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .start()
    )
    done = threading.Event()

    def writer() -> None:
        w = shard.writer()
        for k in range(1, 13):
            w.append(rows(range(k * 200, k * 200 + 50)))
            w.append(rows(range((k - 1) * 200, (k - 1) * 200 + 10), diff=-1))
            time.sleep(0.1)
        done.set()

    deadline = time.monotonic() + 120
    while not q.recentProgress or q.recentProgress[-1]["numInputRows"] == 0:
        assert time.monotonic() < deadline, "the snapshot micro-batch never ran"
        time.sleep(0.1)
    t = threading.Thread(target=writer)  # writes land while the query keeps running
    t.start()
    try:
        t.join(120)
        assert done.is_set()
        q.processAllAvailable()
        out = spark.sql(f"select id, s, _time, _diff from {table}").collect()
    finally:
        q.stop()
    assert consolidated(out) == contents(shard)
    assert sum(1 for r in out if r["_diff"] == -1) == 12 * 10  # retractions came through
    assert len({r["_time"] for r in out}) >= 2  # the snapshot's time, then changes


def test_gc_during_a_micro_batch_then_restarts_without_gap_or_duplicate(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Compaction+GC while batch 0's tasks are pending; then restarts (one after compaction)."""
    shard = new_shard()
    for k in range(8):
        write(shard, rows(range(k * 200, k * 200 + 200)))
    expected = contents(shard)
    old_parts = {p.key for b in shard.state().trace for p in b.parts}
    cp = tmp_path / "cp"

    def meddle(batch_id: int) -> None:
        write(shard, rows(range(9000, 9100)))
        merge_all(shard)
        shard.gc()

    first = run_available_now(spark, shard, cp, {"splitSizeBytes": "1"}, on_batch=meddle)
    assert consolidated([r for b in first for r in b]) == expected  # every part was read
    # PySpark ends the stopped query's Python reader without calling stop(): its holds
    # linger until reader_lease_s runs out. Expire it as that would, then GC may delete.
    lingering = tuple(shard.state().leased_readers)
    assert len(lingering) <= 1
    shard.machine.run(lambda s: commands.expire_leased_readers(s, reader_ids=lingering))
    shard.gc()
    assert all(shard.client.blob.get(k) is None for k in old_parts)

    # Restart from the checkpoint: the write made during batch 0 (after AvailableNow's end).
    write(shard, rows(range(0, 50), diff=-1))
    second = run_available_now(spark, shard, cp)
    got = Counter(r["_diff"] for b in second for r in b)
    assert got == Counter({1: 100, -1: 50})

    # Restart after the whole shard was merged into one batch.
    write(shard, rows(range(7000, 7100)))
    merge_all(shard)
    assert len(shard.state().trace) == 1
    third = run_available_now(spark, shard, cp)
    assert consolidated([r for b in third for r in b]) == consolidated(
        rows(range(7000, 7100)).to_pylist()
    )
    everything = [r for b in first + second + third for r in b]
    assert consolidated(everything) == contents(shard)

    # The same checkpoint for another shard is refused, naming both shards.
    other = new_shard()
    write(other, rows(range(10)))
    msg = error_of(lambda: run_available_now(spark, other, cp))
    assert f"holds offsets of shard '{shard.name}'" in msg and "new checkpointLocation" in msg


def test_read_limit_caps_micro_batches_and_available_now_ends_at_its_upper(
    spark: SparkSession, tmp_path: Path
) -> None:
    """startingAsOf=0 + maxRowsPerTrigger: snapshot at 0, then <= cap rows per batch, then stop."""
    shard = new_shard()
    for k in range(5):
        write(shard, rows(range(k * 100, k * 100 + 100)))
    late: list[int] = []
    holds: list[tuple[int, int]] = []

    def write_late(batch_id: int) -> None:
        if not late:
            late.append(write(shard, rows(range(8000, 8100))))
        (hold,) = shard.state().leased_readers.values()  # the query's driver-side reader
        holds.append((hold.since, hold.seqno))

    batches = run_available_now(
        spark,
        shard,
        tmp_path / "cp",
        {"startingAsOf": "0", "maxRowsPerTrigger": "150"},
        on_batch=write_late,
    )
    assert [len(b) for b in batches] == [100, 100, 100, 100, 100]
    assert [sorted({r["_time"] for r in b}) for b in batches] == [[t] for t in range(5)]
    assert sorted(r["id"] for b in batches for r in b) == list(range(500))
    assert late == [5]  # written during the run, left for the next one
    # Spark commits batch N while planning N+1: the reader's since and SeqNo hold follow.
    assert holds == sorted(holds) and holds[-1][0] >= 2 and holds[-1][1] > holds[0][1]


def test_starting_position_latest_gives_only_new_changes(
    spark: SparkSession, tmp_path: Path
) -> None:
    """startingPosition=latest skips the existing contents; a restart then sees new changes."""
    shard = new_shard()
    write(shard, rows(range(100)))
    cp = tmp_path / "cp"
    first = run_available_now(spark, shard, cp, {"startingPosition": "latest"})
    assert all(b == [] for b in first)  # Spark may run one empty first batch
    write(shard, rows(range(100, 120)))
    write(shard, rows(range(0, 5), diff=-1))
    got = [
        r for b in run_available_now(spark, shard, cp, {"startingPosition": "latest"}) for r in b
    ]
    assert consolidated(got) == consolidated(
        rows(range(100, 120)).to_pylist() + rows(range(5), -1).to_pylist()
    )


def test_bad_input_fails_before_any_task_with_a_clear_message(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Unknown shard, unknown/contradictory options, compacted startingAsOf: messages say why."""
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    assert f"shard '{missing}' does not exist" in error_of(
        lambda: spark.readStream.format("persist").load(missing)
    )
    assert f"shard '{missing}' does not exist" in error_of(
        lambda: spark.read.format("persist").load(missing).collect()
    )
    shard = new_shard()
    for k in range(3):
        write(shard, rows(range(k * 100, k * 100 + 100)))
    stream = spark.readStream.format("persist")
    assert "nosuchoption not valid" in error_of(
        lambda: stream.option("noSuchOption", "1").load(shard.name)
    )
    assert "maxBytesPerTrigger, maxRowsPerTrigger contradict" in error_of(
        lambda: (
            spark.readStream.format("persist")
            .option("maxRowsPerTrigger", "1")
            .option("maxBytesPerTrigger", "1m")
            .load(shard.name)
        )
    )
    assert "startingPosition and startingAsOf contradict" in error_of(
        lambda: (
            spark.readStream.format("persist")
            .option("startingPosition", "latest")
            .option("startingAsOf", "1")
            .load(shard.name)
        )
    )
    # asOf is a batch option: refused when the streaming query starts.
    assert "asOf not valid for stream read" in error_of(
        lambda: run_available_now(spark, shard, tmp_path / "a", {"asOf": "1"})
    )
    with shard.reader() as r:
        r.downgrade_since(2)
    merge_all(shard)
    msg = error_of(lambda: run_available_now(spark, shard, tmp_path / "b", {"startingAsOf": "1"}))
    assert "startingAsOf 1 is before the since 2" in msg and "failOnDataLoss" in msg
    skipped = run_available_now(
        spark, shard, tmp_path / "c", {"startingAsOf": "1", "failOnDataLoss": "false"}
    )
    assert consolidated([r for b in skipped for r in b]) == contents(shard)
    assert {r["_time"] for b in skipped for r in b} == {2}
    # Batch asOf outside [since, upper).
    for bad in ("1", "3"):
        msg = error_of(
            lambda bad=bad: (
                spark.read.format("persist").option("asOf", bad).load(shard.name).collect()
            )
        )
        assert f"asOf {bad} is " in msg and "[since, upper) = [2, 3)" in msg


# --- batch reads -------------------------------------------------------------------------


def test_batch_read_is_the_consolidated_collection_at_as_of(spark: SparkSession) -> None:
    """spark.read: latest by default, any asOf in range; retracted rows never appear."""
    shard = new_shard()
    write(shard, rows(range(0, 100)))
    write(shard, rows(range(0, 30), diff=-1))
    write(shard, rows(range(100, 130)))
    write(shard, rows(range(100, 110)))  # a second copy: _diff 2 after consolidation
    latest = spark.read.format("persist").load(shard.name).collect()
    assert {r["_time"] for r in latest} == {3}
    assert all(r["_diff"] > 0 for r in latest)
    assert len(latest) == len({(r["id"], r["s"]) for r in latest})  # consolidated
    assert consolidated(latest) == contents(shard)
    assert Counter(r["_diff"] for r in latest) == Counter({1: 90, 2: 10})
    at1 = spark.read.format("persist").option("asOf", "1").load(shard.name).collect()
    assert consolidated(at1) == consolidated(rows(range(30, 100)).to_pylist())
    assert {r["_time"] for r in at1} == {1}
    assert spark.read.format("persist").option("ASOF", "0").load(shard.name).count() == 100


def test_batch_read_splits_by_split_size_and_min_partitions(spark: SparkSession) -> None:
    """The snapshot's parts spread over InputPartitions: one by default, more when asked."""
    shard = new_shard()
    for k in range(5):
        write(shard, rows(range(k * 200, k * 200 + 200)))
    read = spark.read.format("persist")
    assert read.load(shard.name).rdd.getNumPartitions() == 1
    split = spark.read.format("persist").option("splitSizeBytes", "1").load(shard.name)
    assert split.rdd.getNumPartitions() == 5
    assert split.count() == 1000
    assert (
        spark.read.format("persist")
        .option("minPartitions", "3")
        .load(shard.name)
        .rdd.getNumPartitions()
        == 3
    )


def test_a_default_split_of_a_sink_written_shard_gives_equal_tasks(spark: SparkSession) -> None:
    """A shard the Spark sink wrote (each writing task's full parts and a small remainder)
    reads in a power of two of tasks holding about equal rows, each row once.

    The shard is scaled down with the split size: 16 MiB of rows from 2 tasks in parts of
    3 MiB and splits of 3 MiB have the shape of 256 MiB in the default 64 MiB parts and
    splits. Whole parts spread greedily made 6 tasks of 3, 3, 3, 3, 2 and 2 MiB here (and
    5 of 122, 122 ... MiB at 256 MiB): on 2 cores one core waited for the other.
    """
    from pyspark.sql import functions as F

    name = f"sink-split-{uuid.uuid4().hex[:12]}"
    rows_total = 16 * 65536
    df = spark.range(0, rows_total, numPartitions=2).select("id", (F.col("id") * 0.5).alias("x"))
    df.write.format("persist").option("partSizeBytes", "3m").mode("append").save(name)
    read = spark.read.format("persist").option("splitSizeBytes", "3m").load(name)
    per_task = read.groupBy(F.spark_partition_id().alias("task")).count().collect()
    counts = sorted(r["count"] for r in per_task)
    assert len(counts) == read.rdd.getNumPartitions() == 4, counts
    assert sum(counts) == rows_total and counts[-1] - counts[0] <= 65536, counts
    assert read.select("id").distinct().count() == rows_total


def test_filter_pushdown_skips_parts_by_statistics(spark: SparkSession) -> None:
    """filterPushdown=true reads only parts whose min/max can match; results stay exact."""
    shard = new_shard()
    for k in range(3):
        write(shard, rows(range(k * 1000, k * 1000 + 300)))
    keys = [b.parts[0].key for b in shard.state().trace]
    assert all(keys) and len(keys) == 3
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        pushed = spark.read.format("persist").option("filterPushdown", "true").load(shard.name)
        plain = spark.read.format("persist").load(shard.name)
        cond = "id >= 2000 and id < 2100"
        assert sorted(r.id for r in pushed.where(cond).collect()) == list(range(2000, 2100))
        assert pushed.where("id > 5000").count() == 0
        # (No part can match id > 5000: Spark still runs one task, which must return nothing.)
        # Remove the parts the filter rules out behind persist's back: a pushed read never
        # fetches them (a plain read of the same shard now fails on the missing part).
        shard.client.blob.delete(keys[0])
        shard.client.blob.delete(keys[1])
        got = pushed.where(cond).collect()
        assert sorted(r.id for r in got) == list(range(2000, 2100))
        assert all(r["_diff"] == 1 and r["s"] == f"v{r['id']:031d}" for r in got)
        assert "missing from blob" in error_of(lambda: plain.where(cond).collect())
    finally:
        spark.conf.unset("spark.sql.python.filterPushdown.enabled")


# --- auto-registration -------------------------------------------------------------------

CHILD = textwrap.dedent(
    """
    import json, sys
    from pyspark.sql import SparkSession
    spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
             .getOrCreate())
    q = (spark.readStream.format("persist").load(sys.argv[1]).writeStream.format("memory")
         .queryName("auto").option("checkpointLocation", sys.argv[2])
         .trigger(availableNow=True).start())
    q.awaitTermination(120)
    print(json.dumps(sorted(r.id for r in spark.sql("select id from auto").collect())))
    spark.stop()
    """
)


@pytest.mark.skipif(
    not auto_registered(),
    reason="pyspark_persist is not a regular top-level module here (editable install): "
    "Spark's pyspark_* scan cannot find it; runs on a normal `pip install .` as in CI",
)
def test_format_persist_is_found_without_register(
    tmp_path: Path, spark_submit_java_options: str
) -> None:
    """A fresh Spark process finds format("persist") by its module scan, no register() call.

    Its JVM starts with the test run's quick-start options (``jvm_fixtures``: how it loads
    classes, nothing the module scan sees).
    """
    shard = new_shard()
    write(shard, rows(range(25)))
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    submit_args = f"--driver-java-options {shlex.quote(spark_submit_java_options)} pyspark-shell"
    proc = subprocess.run(
        [sys.executable, str(script), shard.name, str(tmp_path / "cp")],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, PYSPARK_SUBMIT_ARGS=submit_args),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == list(range(25))
