"""changeTypes through Spark (the shared session): a keyed shard's upsert read back as
update_preimage/update_postimage and a delete as delete, by readChanges and by a stream. The
pairing itself is tested without Spark (test_change_types.py)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession

pytestmark = pytest.mark.spark

ROWS = "id long, name string, is_deleted boolean"


def _write(spark: SparkSession, shard: str, rows: list[tuple[int, str, bool]]) -> None:
    (
        spark.createDataFrame(rows, ROWS)
        .write.format("persist")
        .option("upsertKeys", "id")
        .option("deleteColumn", "is_deleted")
        .mode("append")
        .save(shard)
    )


def _labelled(df: DataFrame) -> list[tuple[int, str, int, str]]:
    """(id, name, _diff, _change_type), sorted, with the commits' times checked apart."""
    return sorted((r.id, r.name, r._diff, r._change_type) for r in df.collect())


def test_read_changes_labels_an_upsert_as_pre_and_post_images_and_a_delete(
    spark: SparkSession,
) -> None:
    shard = f"ct-batch-{uuid.uuid4().hex[:8]}"
    _write(spark, shard, [(1, "ann", False), (2, "bob", False)])
    _write(spark, shard, [(1, "ann2", False), (2, "", True), (3, "cy", False)])
    changes = (
        spark.read.format("persist")
        .option("readChanges", "true")
        .option("changeTypes", "true")
        .option("minPartitions", "4")  # however split, a commit's updates meet in one task
        .load(shard)
    )
    assert changes.schema["_change_type"].dataType.simpleString() == "string"
    rows = changes.collect()
    assert sorted((r.id, r.name, r._diff, r._change_type) for r in rows) == [
        (1, "ann", -1, "update_preimage"),
        (1, "ann", 1, "insert"),
        (1, "ann2", 1, "update_postimage"),
        (2, "bob", -1, "delete"),
        (2, "bob", 1, "insert"),
        (3, "cy", 1, "insert"),
    ]
    first = min(r._time for r in rows)
    assert {r._change_type for r in rows if r._time == first} == {"insert"}
    snapshot = spark.read.format("persist").option("changeTypes", "true").load(shard)
    assert _labelled(snapshot) == [(1, "ann2", 1, "insert"), (3, "cy", 1, "insert")]


def test_a_stream_labels_the_snapshot_as_inserts_then_upserts_and_deletes(
    spark: SparkSession, tmp_path: Path
) -> None:
    shard = f"ct-stream-{uuid.uuid4().hex[:8]}"
    _write(spark, shard, [(1, "ann", False), (2, "bob", False)])
    name = f"ct_{uuid.uuid4().hex[:8]}"
    q = (
        spark.readStream.format("persist")
        .option("changeTypes", "true")
        .load(shard)
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    try:
        q.processAllAvailable()
        _write(spark, shard, [(1, "ann2", False), (2, "", True)])
        q.processAllAvailable()
        rows = _labelled(spark.table(name))
    finally:
        q.stop()
    assert rows == [
        (1, "ann", -1, "update_preimage"),
        (1, "ann", 1, "insert"),
        (1, "ann2", 1, "update_postimage"),
        (2, "bob", -1, "delete"),
        (2, "bob", 1, "insert"),
    ]


def test_a_user_schema_without_change_type_is_refused_naming_the_fix(spark: SparkSession) -> None:
    shard = f"ct-schema-{uuid.uuid4().hex[:8]}"
    _write(spark, shard, [(1, "ann", False)])
    read = spark.read.format("persist").option("changeTypes", "true")
    with pytest.raises(Exception, match="changeTypes adds a _change_type column"):  # noqa: PT011
        read.schema("id long, name string, _time long, _diff long").load(shard).collect()
