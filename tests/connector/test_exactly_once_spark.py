"""``exactly_once`` and ``sinks.postgres`` through Spark: tokens read from real micro-batches.

Queries run with ``trigger(availableNow=True)`` and ``maxRowsPerTrigger`` (several
micro-batches, snapshot cuts and listen ranges) into ``foreachBatch(exactly_once(fn))``.
The kill -9 test of the whole pipeline is ``tests/examples/test_persist_to_postgres.py``.
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession
from source_helpers import SCHEMA, error_of, rows

from pyspark_persist import exactly_once, sinks
from pyspark_persist.state import PersistClient, Shard

pytestmark = pytest.mark.spark


def new_shard() -> Shard:
    return PersistClient.open().open_shard(f"eo-{uuid.uuid4().hex[:12]}", SCHEMA)


def write(shard: Shard, table: pa.Table) -> None:
    upper = shard.upper
    shard.writer().compare_and_append(table, upper, upper + 1)


def run(source: DataFrame, fn: Any, checkpoint: Path) -> None:
    """Run ``source`` into ``foreachBatch(exactly_once(fn))`` until it has read everything."""
    q = (
        source.writeStream.foreachBatch(exactly_once(fn))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180), "query did not finish"
    finally:
        q.stop()


def stream(spark: SparkSession, shard: Shard, rows_per_batch: int) -> DataFrame:
    return (
        spark.readStream.format("persist")
        .option("maxRowsPerTrigger", str(rows_per_batch))
        .load(shard.name)
    )


def test_each_micro_batch_gets_the_token_of_its_range_and_a_rerun_the_same_ones(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Tokens are distinct per micro-batch, chain end to start, and a new query reading the
    same ranges (a fresh checkpoint, nothing written meanwhile) gets the same tokens."""
    shard = new_shard()
    for i in range(4):
        write(shard, rows(range(i * 10, i * 10 + 10)))
    seen: list[tuple[str, int]] = []
    run(stream(spark, shard, 15), lambda df, t: seen.append((t, df.count())), tmp_path / "a")
    tokens = [t for t, _ in seen]
    assert len(tokens) >= 3 and len(set(tokens)) == len(tokens), tokens
    assert sum(n for _, n in seen) == 40
    decoded = [json.loads(t) for t in tokens]
    assert {d["shard"] for d in decoded} == {shard.name}
    assert all(a["end"] == b["start"] for a, b in zip(decoded, decoded[1:], strict=False))
    again: list[str] = []
    run(stream(spark, shard, 15), lambda df, t: again.append(t), tmp_path / "b")
    assert again == tokens


def test_the_sink_applies_a_stream_with_retractions_once(
    spark: SparkSession, tmp_path: Path, postgres_url: str
) -> None:
    """Inserts and retractions over several micro-batches: the table is the shard's snapshot;
    a second query over the same ranges (a lost checkpoint) applies nothing again."""
    shard = new_shard()
    write(shard, rows(range(0, 30)))
    write(shard, rows(range(0, 10), diff=-1))
    write(shard, rows(range(30, 40)))
    write(shard, rows([31, 31], diff=1))
    table = f"eo_{uuid.uuid4().hex[:10]}"
    sink = sinks.postgres(postgres_url, table)
    run(stream(spark, shard, 12), sink, tmp_path / "a")
    run(stream(spark, shard, 12), sink, tmp_path / "b")
    with shard.reader() as r:
        snapshot = r.snapshot_table().to_pylist()
    expected: Counter[tuple[int, str]] = Counter()
    for u in snapshot:
        expected[(u["id"], u["s"])] += u["_diff"]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        got = Counter(conn.execute(f"SELECT id, s FROM {table}").fetchall())
        conn.execute(f"DROP TABLE {table}")
    assert got == expected and sum(got.values()) == 32


def test_a_query_not_reading_persist_is_refused_naming_its_source(
    spark: SparkSession, tmp_path: Path
) -> None:
    called: list[str] = []
    source = spark.readStream.format("rate").option("rowsPerSecond", "5").load()
    q = (
        source.writeStream.foreachBatch(exactly_once(lambda df, t: called.append(t)))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        message = error_of(lambda: q.awaitTermination(120))
    finally:
        q.stop()
    assert "not a persist source" in message and "RateStream" in message, message
    assert called == []


def test_two_persist_sources_in_one_micro_batch_are_refused(
    spark: SparkSession, tmp_path: Path
) -> None:
    a, b = new_shard(), new_shard()
    write(a, rows(range(3)))
    write(b, rows(range(3)))
    source = (
        spark.readStream.format("persist")
        .load(a.name)
        .unionByName(spark.readStream.format("persist").load(b.name))
    )
    message = error_of(lambda: run(source, lambda df, t: None, tmp_path / "cp"))
    assert "2 streaming sources" in message and "one persist source" in message, message
