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
from pyspark_persist.sinks import PostgresSink, stage_name
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


def table_rows(url: str, table: str) -> Counter[tuple[int, str]]:
    with psycopg.connect(url, autocommit=True) as conn:
        got = Counter(conn.execute(f"SELECT id, s FROM {table}").fetchall())
    return got


def leftover_stages(url: str, table: str) -> list[str]:
    """The staging tables of ``table``'s applied tokens still in the database."""
    with psycopg.connect(url, autocommit=True) as conn:
        tokens = [
            t
            for (t,) in conn.execute(
                "SELECT token FROM persist_tokens WHERE target = %s", (table,)
            ).fetchall()
        ]
        names = [stage_name(table, t) for t in tokens]
        return [
            n for n in names if conn.execute("SELECT to_regclass(%s)", (n,)).fetchone() != (None,)
        ]


def drop(url: str, *tables: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        for t in tables:
            conn.execute(f"DROP TABLE IF EXISTS {t}")


@pytest.mark.postgres
@pytest.mark.parametrize("keys", [None, ["id"]])
def test_a_stream_staged_on_the_executors_lands_as_the_driver_way(
    spark: SparkSession, tmp_path: Path, postgres_url: str, keys: list[str] | None
) -> None:
    """stage=True (each partition COPYs into a staging table, the driver applies it with the
    token) gives the table the driver way gives, multiset or keyed, drops its staging
    tables, and a rerun over the same ranges applies nothing again."""
    shard = new_shard()
    write(shard, rows(range(0, 30)))
    write(shard, rows(range(0, 10), diff=-1))
    write(shard, rows(range(30, 40)))
    if keys is None:
        write(shard, rows([31, 31], diff=1))
    driver, staged = (f"eo_{w}_{uuid.uuid4().hex[:8]}" for w in ("driver", "staged"))
    try:
        run(stream(spark, shard, 12), sinks.postgres(postgres_url, driver, keys), tmp_path / "a")
        sink = sinks.postgres(postgres_url, staged, keys, stage=True)
        run(stream(spark, shard, 12).repartition(3), sink, tmp_path / "b")
        run(stream(spark, shard, 12), sink, tmp_path / "c")
        got = table_rows(postgres_url, staged)
        assert got == table_rows(postgres_url, driver)
        assert sum(got.values()) == (32 if keys is None else 30)
        assert leftover_stages(postgres_url, staged) == []
    finally:
        drop(postgres_url, driver, staged)


@pytest.mark.postgres
def test_a_crash_between_staging_and_commit_is_replayed_once(
    spark: SparkSession, tmp_path: Path, postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver dies after the executors staged a micro-batch, before its transaction:
    nothing of it is applied; the query restarted on its checkpoint replays it (same token,
    same staging table, dropped and staged again) and every row lands once."""
    shard = new_shard()
    write(shard, rows(range(0, 20)))
    write(shard, rows(range(0, 5), diff=-1))
    table = f"eo_crash_{uuid.uuid4().hex[:8]}"
    sink = sinks.postgres(postgres_url, table, stage=True)
    commit = PostgresSink._commit_staged  # noqa: SLF001 - the step the crash cuts off
    calls: list[int] = []

    def crash_on_second(self: PostgresSink, *args: Any) -> bool:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("driver crashed between staging and commit")
        return commit(self, *args)

    monkeypatch.setattr(PostgresSink, "_commit_staged", crash_on_second)
    try:
        message = error_of(lambda: run(stream(spark, shard, 8), sink, tmp_path / "cp"))
        assert "between staging and commit" in message, message
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            tokens = conn.execute(
                "SELECT count(*) FROM persist_tokens WHERE target = %s", (table,)
            ).fetchone()
        assert tokens == (1,)  # the first micro-batch only
        monkeypatch.setattr(PostgresSink, "_commit_staged", commit)
        run(stream(spark, shard, 8), sink, tmp_path / "cp")
        expected = Counter({(u["id"], u["s"]): 1 for u in rows(range(5, 20)).to_pylist()})
        assert table_rows(postgres_url, table) == expected
        assert leftover_stages(postgres_url, table) == []
    finally:
        drop(postgres_url, table)
