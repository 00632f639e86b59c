"""``pyspark_persist.txn`` in the run's SparkSession: a foreachBatch stream writing two shards
in one transaction per micro-batch, a replayed micro-batch, and the failures that must leave
every shard as it was (an exception in the block, a DataFrame the shard refuses)."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import pytest
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import pyspark_persist
from pyspark_persist.state import PersistClient
from pyspark_persist.state.errors import SchemaMismatch

pytestmark = pytest.mark.spark


def _batches(client: PersistClient, shard: str, as_of: int) -> Counter[int]:
    """Rows per micro-batch in ``shard`` as of ``as_of``."""
    table = client.open_shard(shard).reader().snapshot_table(as_of)
    out: Counter[int] = Counter()
    for b, d in zip(
        table.column("batch").to_pylist(), table.column("_diff").to_pylist(), strict=True
    ):
        out[b] += d
    return out


def _orders_and_items(spark: SparkSession, rows_per_second: int) -> DataFrame:
    """A rate stream of ids, every third an order and the rest its items (column ``kind``)."""
    return (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rows_per_second)
        .load()
        .select(
            F.col("value").alias("id"),
            F.when(F.col("value") % 3 == 0, "order").otherwise("item").alias("kind"),
        )
    )


def test_each_micro_batch_lands_in_both_shards_whole_and_once(
    spark: SparkSession, tmp_path: Path
) -> None:
    location = {"blob": f"file://{tmp_path}/blob", "consensus": f"sqlite:///{tmp_path}/c.db"}
    orders, items = (f"{n}-{uuid.uuid4().hex[:8]}" for n in ("orders", "items"))
    writer = f"etl-{uuid.uuid4().hex[:8]}"

    def load(df: DataFrame, batch_id: int) -> None:
        df = df.withColumn("batch", F.lit(batch_id))
        with pyspark_persist.txn(
            df.sparkSession, writerId=writer, txnVersion=batch_id, **location
        ) as t:
            t.append(df.filter("kind = 'order'").drop("kind"), orders)
            t.append(df.filter("kind = 'item'").drop("kind"), items)

    feed = _orders_and_items(spark, rows_per_second=100)
    q = (
        feed.writeStream.foreachBatch(load)
        .option("checkpointLocation", str(tmp_path / "ck"))
        .start()
    )
    deadline = time.monotonic() + 120
    try:
        while q.lastProgress is None or q.lastProgress["batchId"] < 3:
            assert q.exception() is None and time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        q.stop()

    client = PersistClient.open(location["blob"], location["consensus"])
    order_commits = {c.upper - 1: c for c in client.open_shard(orders).history() if c.txn_id}
    item_commits = {c.upper - 1: c for c in client.open_shard(items).history() if c.txn_id}
    # One commit per micro-batch in each shard, at the same times, naming the same transaction.
    assert order_commits.keys() == item_commits.keys() and len(order_commits) >= 4
    assert all(order_commits[t].txn_id == item_commits[t].txn_id for t in order_commits)
    final = max(order_commits)
    total = _batches(client, orders, final) + _batches(client, items, final)
    assert sum(total.values()) > 0
    for t in sorted(order_commits):
        for at in (t - 1, t):  # just before each commit, and at it
            seen = _batches(client, orders, at) + _batches(client, items, at)
            assert all(seen[b] in (0, total[b]) for b in total), (at, seen, total)
            # Whole micro-batches, the oldest first.
            whole = sorted(b for b in total if seen[b])
            assert whole == sorted(total)[: len(whole)], (at, whole)
    # Each row once: no micro-batch applied twice.
    ids = [
        i
        for s in (orders, items)
        for i in client.open_shard(s).reader().snapshot_table(final).column("id").to_pylist()
    ]
    assert len(ids) == len(set(ids)) == sum(total.values())

    # Foreachbatch replays a micro-batch after a crash with its id: nothing is applied again.
    seqnos = {s: client.open_shard(s).state().seqno for s in (orders, items)}
    replay = spark.createDataFrame([(10**9, "order"), (10**9 + 1, "item")], "id long, kind string")
    with pyspark_persist.txn(spark, writerId=writer, txnVersion=1, **location) as t:
        t.append(replay.filter("kind = 'order'").drop("kind").withColumn("batch", F.lit(1)), orders)
        t.append(replay.filter("kind = 'item'").drop("kind").withColumn("batch", F.lit(1)), items)
    assert t.already_committed
    assert {s: client.open_shard(s).state().seqno for s in (orders, items)} == seqnos
    client.close()


def test_a_stream_of_both_shards_gets_each_transaction_in_one_micro_batch(
    spark: SparkSession, tmp_path: Path
) -> None:
    """One query writes a transaction per micro-batch into two shards; another streams both
    shards in one source (option ``shards``) beside it: each transaction's rows, in both
    shards, arrive in one of the reader's micro-batches, once, tagged with their shard."""
    location = {"blob": f"file://{tmp_path}/blob", "consensus": f"sqlite:///{tmp_path}/c.db"}
    orders, items = (f"{n}-{uuid.uuid4().hex[:8]}" for n in ("orders", "items"))

    def load(df: DataFrame, batch_id: int) -> None:
        df = df.withColumn("batch", F.lit(batch_id))
        with pyspark_persist.txn(
            df.sparkSession, writerId="w", txnVersion=batch_id, **location
        ) as t:
            t.append(df.filter("kind = 'order'").select("id", "batch"), orders)
            t.append(df.filter("kind = 'item'").select("id", "batch", "kind"), items)

    feed = _orders_and_items(spark, rows_per_second=200)
    writer = (
        feed.writeStream.foreachBatch(load)
        .option("checkpointLocation", str(tmp_path / "wck"))
        .trigger(processingTime="300 milliseconds")
        .start()
    )
    client = PersistClient.open(location["blob"], location["consensus"])
    seen: list[tuple[int, str, int, int]] = []  # (reader batch, shard, writer batch, rows)

    def collect(df: DataFrame, batch_id: int) -> None:
        counts = df.groupBy("_shard", "batch").count().collect()
        seen.extend((batch_id, r["_shard"], r["batch"], r["count"]) for r in counts)

    deadline = time.monotonic() + 120
    reader = None
    try:
        while len(client.list_shards()) < 2:  # both shards exist after the first transaction
            assert writer.exception() is None and time.monotonic() < deadline
            time.sleep(0.2)
        both = spark.readStream.format("persist").option("shards", f"{orders},{items}")
        stream = both.options(**location).load()
        assert stream.columns == ["id", "batch", "kind", "_shard", "_time", "_diff"]
        reader = (
            stream.writeStream.foreachBatch(collect)
            .option("checkpointLocation", str(tmp_path / "rck"))
            .start()
        )
        while reader.lastProgress is None:  # the reader's first micro-batch is done
            assert writer.exception() is None and reader.exception() is None
            assert time.monotonic() < deadline
            time.sleep(0.2)
        # Then two more of the writer's transactions, which the reader reads as they land.
        after = writer.lastProgress["batchId"] + 2 if writer.lastProgress else 2
        while writer.lastProgress is None or writer.lastProgress["batchId"] < after:
            assert writer.exception() is None and reader.exception() is None
            assert time.monotonic() < deadline
            time.sleep(0.2)
        writer.stop()
        reader.processAllAvailable()
    finally:
        writer.stop()
        if reader is not None:
            reader.stop()

    final = client.open_shard(orders).state().upper - 1
    total = _batches(client, orders, final) + _batches(client, items, final)
    arrived: dict[int, set[int]] = {}
    rows: Counter[int] = Counter()
    for reader_batch, shard, batch, count in seen:
        assert shard in (orders, items)
        arrived.setdefault(batch, set()).add(reader_batch)
        rows[batch] += count
    assert rows == total  # every row once
    split = {b: sorted(r) for b, r in arrived.items() if len(r) > 1}
    assert not split, f"transactions split across micro-batches: {split}"
    assert len({r for r, *_ in seen}) > 1  # the reader ran beside the writer
    client.close()


def test_failures_leave_every_shard_as_it_was(spark: SparkSession, tmp_path: Path) -> None:
    location = {"blob": f"file://{tmp_path}/blob", "consensus": f"sqlite:///{tmp_path}/c.db"}
    plain, keyed = (f"{n}-{uuid.uuid4().hex[:8]}" for n in ("plain", "keyed"))
    df = spark.createDataFrame([(1, "a"), (2, "b")], "id long, name string")
    with pyspark_persist.txn(spark, writerId="etl", txnVersion=0, **location) as t:
        t.append(df, plain)
        t.append(df, keyed, upsertKeys="id")  # created keyed: an append is its upsert
    first = t.commit_time
    client = PersistClient.open(location["blob"], location["consensus"])
    assert client.open_shard(keyed).keys == ("id",)
    assert client.open_shard(plain).upper == client.open_shard(keyed).upper == first + 1

    def blob_files() -> set[Path]:
        return {p for p in (tmp_path / "blob").rglob("*") if p.is_file() and "rollup" not in p.name}

    seqnos = {s: client.open_shard(s).state().seqno for s in (plain, keyed)}
    files = blob_files()
    # An exception in the block, after both shards staged: nothing lands, nothing stays staged.
    changed = spark.createDataFrame([(2, "b2"), (3, "c")], "id long, name string")
    with (
        pytest.raises(RuntimeError, match="boom"),
        pyspark_persist.txn(spark, writerId="etl", txnVersion=1, **location) as t,
    ):
        t.append(changed.repartition(2), plain)
        t.upsert(changed, keyed)
        raise RuntimeError("boom")
    # A DataFrame the shard refuses (name is a string there): refused before any task stages.
    wrong = spark.createDataFrame([(4, 4)], "id long, name long")
    with (
        pytest.raises(SchemaMismatch),
        pyspark_persist.txn(spark, writerId="etl", txnVersion=1, **location) as t,
    ):
        t.upsert(changed, keyed)
        t.append(wrong, plain)
    assert {s: client.open_shard(s).state().seqno for s in (plain, keyed)} == seqnos
    assert blob_files() == files
    # The version was never spent: the same transaction now commits.
    with pyspark_persist.txn(spark, writerId="etl", txnVersion=1, **location) as t:
        t.append(changed, plain)
        t.upsert(changed, keyed)
    rows = client.open_shard(keyed).reader().snapshot_table(t.commit_time).to_pylist()
    assert sorted((r["id"], r["name"]) for r in rows) == [(1, "a"), (2, "b2"), (3, "c")]
    assert client.open_shard(plain).reader().snapshot_table().num_rows == 4
    client.close()
