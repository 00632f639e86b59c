"""Keyed shards through Spark (the shared session): batch and streaming upserts, deletes by
column, overwrite. The exactly-once and ordering details are the JVM-free tests'
(test_sink_upsert_unit.py); these check that Spark's paths reach them."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from pyspark_persist.state import PersistClient

pytestmark = pytest.mark.spark


def _live(shard: str) -> list[tuple[object, ...]]:
    rows = PersistClient.open().open_shard(shard).reader().snapshot_table().to_pylist()
    assert all(r["_diff"] == 1 for r in rows)
    return sorted(tuple(v for k, v in r.items() if k not in ("_time", "_diff")) for r in rows)


def test_batch_writes_upsert_delete_and_overwrite(spark: SparkSession) -> None:
    shard = f"keyed-{uuid.uuid4().hex[:8]}"
    first = spark.createDataFrame(
        [("eu", 1, "a"), ("us", 1, "b"), ("eu", 2, "c")], "region string, id long, name string"
    )
    first.write.format("persist").option("upsertKeys", "region,id").mode("append").save(shard)
    assert PersistClient.open().open_shard(shard).keys == ("region", "id")
    changes = spark.createDataFrame(
        [("eu", 1, "a2", False), ("us", 1, "", True), ("us", 7, "d", False)],
        "region string, id long, name string, is_deleted boolean",
    )
    changes.write.format("persist").option("deleteColumn", "is_deleted").mode("append").save(shard)
    assert _live(shard) == [("eu", 1, "a2"), ("eu", 2, "c"), ("us", 7, "d")]
    first.write.format("persist").mode("overwrite").save(shard)
    assert _live(shard) == [("eu", 1, "a"), ("eu", 2, "c"), ("us", 1, "b")]
    with pytest.raises(Exception, match="KeysMismatch|other keys|names keys"):  # noqa: PT011
        first.write.format("persist").option("upsertKeys", "id").mode("append").save(shard)


def test_a_stream_upserts_each_micro_batch(spark: SparkSession, tmp_path: Path) -> None:
    shard = f"stream-keyed-{uuid.uuid4().hex[:8]}"
    feed = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 200)
        .load()
        .select((F.col("value") % 20).alias("k"), F.col("value").alias("lsn"))
    )
    q = (
        feed.writeStream.format("persist")
        .option("upsertKeys", "k")
        .option("sequenceColumn", "lsn")
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start(shard)
    )
    deadline = time.monotonic() + 120
    try:
        while q.lastProgress is None or q.lastProgress["batchId"] < 3:
            assert q.exception() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        q.stop()
    rows = _live(shard)
    assert [k for k, _ in rows] == list(range(20))  # one row per key
    assert all(lsn % 20 == k for k, lsn in rows)
    history = PersistClient.open().open_shard(shard).history()
    assert sum(c.rows_mixed for c in history) > 0  # later batches retract and insert
