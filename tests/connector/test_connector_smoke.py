"""The connector end to end in one shared SparkSession: write a stream, read it back."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark


def test_rate_stream_into_persist_read_back_exactly_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Rows from Spark's rate source land once each, read back by batch and streaming reads."""
    shard = f"rate-{uuid.uuid4().hex[:8]}"
    rate = spark.readStream.format("rate").option("rowsPerSecond", 500).load()
    q = (
        rate.writeStream.format("persist")
        .option("checkpointLocation", str(tmp_path / "sink"))
        .trigger(processingTime="200 milliseconds")
        .start(shard)
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (q.lastProgress is None or q.lastProgress["batchId"] < 3):
        time.sleep(0.2)
    q.stop()
    written = spark.read.format("persist").load(shard)
    n = written.count()
    assert n > 0
    assert written.select("value").distinct().count() == n

    tail = (
        spark.readStream.format("persist")
        .load(shard)
        .writeStream.format("memory")
        .queryName(f"tail_{shard.replace('-', '_')}")
        .option("checkpointLocation", str(tmp_path / "src"))
        .trigger(availableNow=True)
        .start()
    )
    tail.awaitTermination(120)
    rows = spark.sql(f"select value, _diff from tail_{shard.replace('-', '_')}").collect()
    assert sorted(r.value for r in rows) == sorted(r.value for r in written.collect())
    assert all(r._diff == 1 for r in rows)
