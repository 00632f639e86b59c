"""The persist sink through Spark (the shared local[2] session): streams, modes and errors.

Shard contents are checked with the Python API, independently of the
connector's read path (except where reading back by the source is the point).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pyspark.errors import PySparkException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming import StreamingQuery

from pyspark_persist.state import PersistClient
from pyspark_persist.writer import read_sink_metrics

pytestmark = pytest.mark.spark

METRIC_KEYS = {"rows", "size_bytes", "parts", "queued_s", "upload_s", "commit_s"}


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _snapshot(shard: str) -> list[dict[str, Any]]:
    """The shard's consolidated rows via the Python API (a client of this process)."""
    reader = PersistClient.open().open_shard(shard, create=False).reader()
    return reader.snapshot_table().to_pylist()


def _run_until(queries: list[StreamingQuery], batches: int, timeout_s: float = 150) -> None:
    """Let each query finish ``batches`` micro-batches, then stop them all."""
    deadline = time.monotonic() + timeout_s
    try:
        while any(
            q.lastProgress is None or q.lastProgress["batchId"] < batches - 1 for q in queries
        ):
            for q in queries:
                if q.exception() is not None:
                    raise AssertionError(f"query failed: {q.exception()}")
            assert time.monotonic() < deadline, [q.lastProgress for q in queries]
            time.sleep(0.2)
    finally:
        for q in queries:
            q.stop()


def _rate(spark: SparkSession, rows_per_s: int = 200) -> DataFrame:
    return spark.readStream.format("rate").option("rowsPerSecond", rows_per_s).load()


class SnapshotWatcher:
    """Snapshots a shard in a loop from another thread and records every distinct view."""

    def __init__(self, shard: str) -> None:
        self._shard = shard
        self._stop = threading.Event()
        self.views: list[list[dict[str, Any]]] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        try:
            reader = PersistClient.open().open_shard(self._shard, create=False).reader()
            while not self._stop.is_set():
                view = reader.snapshot_table().drop(["_time"]).to_pylist()
                if not self.views or view != self.views[-1]:
                    self.views.append(view)
                time.sleep(0.01)
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def __enter__(self) -> SnapshotWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        if self.error is not None:
            raise self.error


def test_rate_stream_exactly_once_and_metrics(spark: SparkSession, tmp_path: Path) -> None:
    """Rate source -> persist: every value exactly once, gap-free, read back by the source.

    Protects: one exactly-once commit per micro-batch and the per-batch
    metrics file (one line per micro-batch with rows/bytes/parts/timings).
    """
    shard, ckpt = _name("rate"), str(tmp_path / "sink")
    q = (
        _rate(spark)
        .writeStream.format("persist")
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="300 milliseconds")
        .start(shard)
    )
    _run_until([q], batches=3)

    rows = _snapshot(shard)
    values = sorted(r["value"] for r in rows)
    assert values == list(range(len(values))) and values
    assert {r["_diff"] for r in rows} == {1}

    metrics = read_sink_metrics(ckpt)
    assert [m["batch_id"] for m in metrics] == list(range(len(metrics)))
    assert {m["outcome"] for m in metrics} == {"committed"}
    assert all(METRIC_KEYS <= m.keys() for m in metrics)
    assert sum(m["rows"] for m in metrics) == len(values)

    table = f"sink_tail_{shard.replace('-', '_')}"
    tail = (
        spark.readStream.format("persist")
        .load(shard)
        .writeStream.format("memory")
        .queryName(table)
        .option("checkpointLocation", str(tmp_path / "src"))
        .trigger(availableNow=True)
        .start()
    )
    assert tail.awaitTermination(120)
    got = spark.sql(f"select value, _diff from {table}").collect()
    assert sorted(r.value for r in got) == values
    assert {r._diff for r in got} == {1}


def test_two_queries_write_one_shard_concurrently(spark: SparkSession, tmp_path: Path) -> None:
    """Two streaming queries on one shard: every batch of both commits, uppers rise, no loss.

    Protects: the commit's retry on UpperMismatch with the same staged parts
    and the per-query writer identity (different checkpoints never collide).
    """
    shard = _name("twoq")
    queries, ckpts = [], {}
    for tag in ("a", "b"):
        ckpts[tag] = str(tmp_path / tag)
        queries.append(
            _rate(spark, 100)
            .withColumn("tag", F.lit(tag))
            .writeStream.format("persist")
            .option("checkpointLocation", ckpts[tag])
            .trigger(processingTime="200 milliseconds")
            .start(shard)
        )
    _run_until(queries, batches=3)

    rows = _snapshot(shard)
    uppers: list[int] = []
    for tag, ckpt in ckpts.items():
        metrics = read_sink_metrics(ckpt)
        assert [m["batch_id"] for m in metrics] == list(range(len(metrics)))
        assert {m["outcome"] for m in metrics} == {"committed"}
        mine = [m["upper"] for m in metrics]
        assert mine == sorted(set(mine)), f"uppers of query {tag} must strictly increase"
        uppers += mine
        values = sorted(r["value"] for r in rows if r["tag"] == tag)
        assert values == list(range(len(values)))
        assert len(values) == sum(m["rows"] for m in metrics)
    assert len(set(uppers)) == len(uppers), "two commits shared an upper"
    assert len(PersistClient.open().open_shard(shard, create=False).state().writers) == 2


def test_complete_mode_replaces_atomically(spark: SparkSession, tmp_path: Path) -> None:
    """Complete mode: the shard holds exactly the latest result; a reader never sees a mix.

    Every result of ``count() by value % 5`` over a gap-free prefix has each
    key once with counts differing by at most 1; a half-replaced shard would
    show a key twice, or nothing after something was there.
    """
    shard, ckpt = _name("complete"), str(tmp_path / "sink")
    counts = _rate(spark, 100).groupBy((F.col("value") % 5).alias("k")).count()
    q = (
        counts.writeStream.format("persist")
        .outputMode("complete")
        .option("checkpointLocation", ckpt)
        .trigger(processingTime="300 milliseconds")
        .start(shard)
    )
    deadline = time.monotonic() + 120
    while q.lastProgress is None and time.monotonic() < deadline:
        time.sleep(0.1)  # the shard is created by the first commit
    with SnapshotWatcher(shard) as watcher:
        _run_until([q], batches=4)

    def consistent(view: list[dict[str, Any]]) -> bool:
        keys = [r["k"] for r in view]
        cnt = [r["count"] for r in view]
        return (
            len(keys) == len(set(keys))
            and {r["_diff"] for r in view} <= {1}
            and (not cnt or max(cnt) - min(cnt) <= 1)
        )

    views = watcher.views
    while views and not views[0]:
        views = views[1:]  # the first micro-batch of the rate source may be empty
    assert len(views) >= 2, "the reader should have seen several results"
    bad = [v for v in views if not consistent(v) or not v]
    assert not bad, bad[:2]
    final = _snapshot(shard)
    assert sorted(r["k"] for r in final) == [0, 1, 2, 3, 4]
    assert consistent(final)
    metrics = read_sink_metrics(ckpt)
    assert [m["batch_id"] for m in metrics] == list(range(len(metrics)))
    assert metrics[-1]["rows"] == 5, "complete mode writes the whole result each batch"


def test_batch_append_retract_then_overwrite(spark: SparkSession) -> None:
    """Batch writes: ``_diff`` retracts; ``mode("overwrite")`` leaves exactly the new rows.

    A concurrent reader sees the old contents or the new, never a mix.
    """
    shard = _name("batch")
    spark.range(100).select("id", F.concat(F.lit("v"), F.col("id")).alias("s")).write.format(
        "persist"
    ).mode("append").save(shard)
    spark.range(10).select(
        "id", F.concat(F.lit("v"), F.col("id")).alias("s"), F.lit(-1).cast("long").alias("_diff")
    ).write.format("persist").mode("append").save(shard)
    old = [(i, f"v{i}") for i in range(10, 100)]
    assert sorted((r["id"], r["s"]) for r in _snapshot(shard)) == old

    new = [(i, f"new{i}") for i in range(1000, 1050)]
    with SnapshotWatcher(shard) as watcher:
        time.sleep(0.2)
        spark.createDataFrame(new, "id long, s string").repartition(2).write.format("persist").mode(
            "overwrite"
        ).save(shard)
        time.sleep(0.2)
    final = _snapshot(shard)
    assert sorted((r["id"], r["s"]) for r in final) == new
    assert {r["_diff"] for r in final} == {1}
    views = [sorted((r["id"], r["s"]) for r in v) for v in watcher.views]
    assert all(v in (old, new) for v in views), [len(v) for v in views]
    assert views[0] == old and views[-1] == new


def _boom(_: Any) -> str:
    raise RuntimeError("TASK RAN")


def _error_text(fn: Callable[[], object]) -> str:
    with pytest.raises(Exception) as info:  # noqa: PT011 - Spark wraps the Python error
        fn()
    return str(info.value)


def test_bad_input_fails_before_any_task(spark: SparkSession) -> None:
    """``_time`` input, a non-long ``_diff`` and a changed schema fail on the driver, with the fix.

    Every DataFrame here has a column computed by a UDF that raises if a task
    ever runs, so the errors are shown to come before any task.
    """
    shard = _name("bad")
    spark.range(3).select("id", F.lit("x").alias("s")).write.format("persist").mode("append").save(
        shard
    )
    client = PersistClient.open()
    parts_before = {m.key for m in client.blob.list_keys(f"{shard}/part/")}
    boom = F.udf(_boom, "string")

    text = _error_text(
        lambda: (
            spark.range(3)
            .select("id", boom("id").alias("s"), F.lit(5).cast("long").alias("_time"))
            .write.format("persist")
            .mode("append")
            .save(shard)
        )
    )
    assert "_time" in text and "drop or rename _time" in text and "TASK RAN" not in text

    text = _error_text(
        lambda: (
            spark.range(3)
            .select("id", boom("id").alias("s"), F.lit(1).alias("_diff"))
            .write.format("persist")
            .mode("append")
            .save(shard)
        )
    )
    assert "_diff must be a long" in text and "TASK RAN" not in text

    text = _error_text(
        lambda: (
            spark.range(3)
            .select("id", boom("id").alias("t"))
            .write.format("persist")
            .mode("append")
            .save(shard)
        )
    )
    assert "'t'" in text and "'s'" in text and "TASK RAN" not in text

    ckpt = f"/tmp/{_name('ckpt')}"
    q = (
        spark.readStream.format("rate")
        .load()
        .select(F.col("value").alias("id"), boom("value").alias("other"))
        .writeStream.format("persist")
        .option("checkpointLocation", ckpt)
        .start(shard)
    )
    text = _error_text(lambda: q.awaitTermination(120))
    assert "'other'" in text and "TASK RAN" not in text
    assert {m.key for m in client.blob.list_keys(f"{shard}/part/")} == parts_before
    assert len(_snapshot(shard)) == 3


def test_options_spark_injects_are_accepted_and_typos_suggested(
    spark: SparkSession, tmp_path: Path
) -> None:
    """.queryName(q), checkpointLocation and .start(path) on a persist -> persist stream: Spark
    passes them all as options, and the path is the shard. A typo still fails, with a hint."""
    source, sink = _name("inj-src"), _name("inj-sink")
    spark.range(5).write.format("persist").mode("append").save(source)
    q = (
        spark.readStream.format("persist")
        .load(source)
        .drop("_time", "_diff")
        .writeStream.format("persist")
        .queryName(f"q_{sink.replace('-', '_')}")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .trigger(availableNow=True)
        .start(sink)
    )
    assert q.awaitTermination(120)
    assert q.exception() is None
    assert sorted(r["id"] for r in _snapshot(sink)) == list(range(5))
    text = _error_text(
        lambda: spark.read.format("persist").option("splitSizeByte", "1m").load(source).count()
    )
    assert "did you mean splitSizeBytes?" in text


def test_batch_writer_id_and_txn_version_through_spark(spark: SparkSession) -> None:
    """The issue's acceptance case, on the embedded default: writerId + txnVersion 1 twice
    writes once, version 2 writes again, two unversioned writes with the same writerId both
    land, and a bad txnVersion fails before any task runs."""
    shard = _name("txn")

    def write(start: int, **options: str) -> None:
        df = spark.range(start, start + 3).select("id", F.lit("v").alias("s"))
        df.write.format("persist").options(**options).mode("append").save(shard)

    write(0, writerId="app", txnVersion="1")
    write(0, writerId="app", txnVersion="1")
    assert sorted(r["id"] for r in _snapshot(shard)) == [0, 1, 2]
    write(10, writerId="app", txnVersion="2")
    write(20, writerId="app")
    write(30, writerId="app")
    expected = [0, 1, 2, 10, 11, 12, 20, 21, 22, 30, 31, 32]
    assert sorted(r["id"] for r in _snapshot(shard)) == expected

    boom = F.udf(_boom, "string")
    text = _error_text(
        lambda: (
            spark.range(3)
            .select("id", boom("id").alias("s"))
            .write.format("persist")
            .option("writerId", "app")
            .option("txnVersion", "-4")
            .mode("append")
            .save(shard)
        )
    )
    assert "txnVersion='-4' must be at least 0" in text and "TASK RAN" not in text
    assert len(_snapshot(shard)) == 12


def test_recreated_checkpoint_first_batches_land(spark: SparkSession, tmp_path: Path) -> None:
    """A checkpoint deleted and recreated under the same path is a new query whose first
    batches are written (issue 13 item 5), through Spark."""
    import shutil

    first, second, sink = _name("ck-a"), _name("ck-b"), _name("ck-sink")
    spark.range(3).write.format("persist").mode("append").save(first)
    spark.range(100, 103).write.format("persist").mode("append").save(second)
    ckpt = str(tmp_path / "ck")

    def run(source: str) -> None:
        q = (
            spark.readStream.format("persist")
            .load(source)
            .drop("_time", "_diff")
            .writeStream.format("persist")
            .option("checkpointLocation", ckpt)
            .trigger(availableNow=True)
            .start(sink)
        )
        assert q.awaitTermination(120)
        assert q.exception() is None

    run(first)
    shutil.rmtree(ckpt)
    run(second)
    assert sorted(r["id"] for r in _snapshot(sink)) == [0, 1, 2, 100, 101, 102]


@pytest.mark.parametrize("mode", [None, "error", "errorifexists", "ignore"])
def test_unsupported_batch_modes_rejected_by_spark(spark: SparkSession, mode: str | None) -> None:
    """Batch writes other than append/overwrite get Spark's UNSUPPORTED_DATA_SOURCE_SAVE_MODE.

    Spark rejects them for every Python data source before our code runs;
    note the DataFrameWriter default (no ``mode``) is ``errorifexists``.
    """
    shard = _name("mode")
    writer = spark.range(2).write.format("persist")
    if mode is not None:
        writer = writer.mode(mode)
    with pytest.raises(PySparkException) as info:
        writer.save(shard)
    assert "UNSUPPORTED_DATA_SOURCE_SAVE_MODE" in str(info.value)
    assert shard not in PersistClient.open().list_shards()


def test_update_output_mode_rejected_by_spark(spark: SparkSession, tmp_path: Path) -> None:
    """Streaming ``outputMode("update")`` is refused by Spark itself, when the query runs.

    Unlike batch modes this is not UNSUPPORTED_DATA_SOURCE_SAVE_MODE: ``start()``
    succeeds and the query then fails with STREAM_FAILED "requirement failed:
    persist does not support Update mode." (Spark's check of the Python sink's
    capabilities, before our writer is built), writing nothing.
    """
    shard = _name("update")
    counts = _rate(spark).groupBy((F.col("value") % 2).alias("k")).count()

    def start() -> None:
        q = (
            counts.writeStream.format("persist")
            .outputMode("update")
            .option("checkpointLocation", str(tmp_path / "ck"))
            .start(shard)
        )
        try:
            q.awaitTermination(120)
        finally:
            q.stop()

    text = _error_text(start)
    assert "STREAM_FAILED" in text and "persist does not support Update mode" in text
    assert shard not in PersistClient.open().list_shards()


def test_sink_metrics_show_the_arrow_batch_size_spark_hands_the_tasks(
    spark: SparkSession, tmp_path: Path
) -> None:
    """``batch_rows`` in the sink's metrics is the largest Arrow batch a task received: what
    ``spark.sql.execution.arrow.maxRecordsPerBatch`` caps, so a user sees whether persist's
    tasks copied Spark's batches together (docs/spark.md, "Bulk writes")."""
    source = str(tmp_path / "source")
    spark.range(0, 5000, numPartitions=1).write.parquet(source)
    shard, ckpt = _name("batch-rows"), str(tmp_path / "sink")
    conf = "spark.sql.execution.arrow.maxRecordsPerBatch"
    spark.conf.set(conf, "1200")
    try:
        q = (
            spark.readStream.schema("id long")
            .parquet(source)
            .writeStream.format("persist")
            .option("checkpointLocation", ckpt)
            .trigger(availableNow=True)
            .start(shard)
        )
        q.awaitTermination(120)
    finally:
        spark.conf.unset(conf)
    (metrics,) = read_sink_metrics(ckpt)
    assert (metrics["rows"], metrics["batch_rows"]) == (5000, 1200)
    assert sorted(r["id"] for r in _snapshot(shard)) == list(range(5000))
