"""Schema evolution in Spark (issue 17 item 6): ``mergeSchema`` on batch and stream writes,
refusals before anything is written, and a running stream that stops on a schema change and
resumes exactly once after a restart. On the embedded default location."""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from source_helpers import SCHEMA, error_of, rows

from pyspark_persist.state import PersistClient, Shard

pytestmark = pytest.mark.spark


def new_name() -> str:
    return f"evo-{uuid.uuid4().hex[:12]}"


def part_keys(shard: Shard) -> set[str]:
    return {m.key for m in shard.client.blob.list_keys(shard.name + "/part/")}


def contents(shard: Shard) -> Counter[tuple[Any, ...]]:
    """The shard's rows (all columns but _time) with their multiplicities, read by Python."""
    shard.state()  # the newest state, so the read has the newest columns
    table = shard.reader().snapshot_table()
    names = [n for n in table.column_names if n not in ("_time", "_diff")]
    out: Counter[tuple[Any, ...]] = Counter()
    for r in table.to_pylist():
        out[tuple(r[n] for n in names)] += r["_diff"]
    return out


def test_batch_merge_schema_append_overwrite_and_refusals(spark: SparkSession) -> None:
    """New columns need mergeSchema; type changes are refused with or without it; a missing
    column is written null; old rows read null; nothing is written by a refused write."""
    name = new_name()
    first = spark.createDataFrame([(1, "a"), (2, "b")], "id long, s string")
    first.write.format("persist").mode("append").save(name)
    shard = PersistClient.open().open_shard(name)
    seqno, keys = shard.state().seqno, part_keys(shard)
    wider = spark.createDataFrame([(3, "c", 0.5)], "id long, s string, score double")

    msg = error_of(lambda: wider.write.format("persist").mode("append").save(name))
    assert "'score' (double)" in msg and '.option("mergeSchema", "true")' in msg
    retyped = spark.createDataFrame([("4", "d")], "id string, s string")
    msg = error_of(
        lambda: (
            retyped.write.format("persist").mode("append").option("mergeSchema", "true").save(name)
        )
    )
    assert "column 'id' is string in the write but int64 in the shard" in msg
    assert shard.state().seqno == seqno and part_keys(shard) == keys

    wider.write.format("persist").mode("append").option("mergeSchema", "true").save(name)
    spark.createDataFrame([(5,)], "id long").write.format("persist").mode("append").save(name)
    df = spark.read.format("persist").load(name)
    assert df.columns == ["id", "s", "score", "_time", "_diff"]
    got = sorted((r["id"], r["s"], r["score"]) for r in df.collect())
    assert got == [(1, "a", None), (2, "b", None), (3, "c", 0.5), (5, None, None)]

    tagged = spark.createDataFrame(
        [(9, "z", 1.0, "t")], "id long, s string, score double, tag string"
    )
    tagged.write.format("persist").mode("overwrite").option("mergeSchema", "true").save(name)
    df = spark.read.format("persist").load(name)
    assert df.columns == ["id", "s", "score", "tag", "_time", "_diff"]
    assert [(r["id"], r["tag"], r["_diff"]) for r in df.collect()] == [(9, "t", 1)]


def test_stream_stops_on_schema_change_and_resumes_exactly_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    """A running persist -> persist stream meets a mergeSchema commit: it fails telling the user
    to restart; restarted from its checkpoint it delivers the rest once, with the new column,
    which its own mergeSchema sink adds to the target."""
    client = PersistClient.open()
    source = client.open_shard(new_name(), SCHEMA)
    source.writer().append(rows(range(0, 10)))
    target = new_name()

    def start() -> Any:
        return (
            spark.readStream.format("persist")
            .load(source.name)
            .drop("_time")
            .writeStream.format("persist")
            .option("mergeSchema", "true")
            .option("checkpointLocation", str(tmp_path / "cp"))
            .start(target)
        )

    q = start()
    try:
        q.processAllAvailable()
        with_score = rows(range(10, 15)).append_column("score", pa.array([1.5] * 5))
        source.writer().append(with_score, merge_schema=True)
        msg = error_of(q.processAllAvailable)
    finally:
        q.stop()
    assert "SchemaChanged" in msg and "gained column(s) 'score' (double)" in msg
    assert "Restart the query with the same checkpointLocation" in msg
    sink = client.open_shard(target)
    assert contents(sink) == Counter({(i, f"v{i:031d}"): 1 for i in range(10)})

    q = start()
    try:
        q.processAllAvailable()
    finally:
        q.stop()
    expected = Counter({(i, f"v{i:031d}", None): 1 for i in range(10)})
    expected.update({(i, f"v{i:031d}", 1.5): 1 for i in range(10, 15)})
    assert contents(sink) == expected
    assert sink.schema.names == ["id", "s", "score"]
