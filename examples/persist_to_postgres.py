"""Exactly once from persist into PostgreSQL: rate -> persist -> consumer -> a PostgreSQL table.

Two queries in one job. The first writes Spark's rate source into a shard: each value v
inserts the row (id v, payload "row-v"), and each v divisible by 3 (from 3 on) also
retracts the row v - 3, so the shard holds retractions. The second reads the shard as
the named consumer (``.option("consumer", ...)``) and delivers every micro-batch with
``foreachBatch(exactly_once(sinks.postgres(...)))``: the updates and the micro-batch's
token in one transaction, a replayed micro-batch skipped. After --seconds it stops the
writer, lets the delivery catch up, and checks that the table equals the shard's
snapshot.

    spark-submit examples/persist_to_postgres.py [--seconds 20] [--url URL] [--shard orders]
        [--table orders] [--consumer to-pg] [--rows-per-second 50] [--checkpoints DIR]

Run it again with the same --shard, --table and --checkpoints (say after killing it) and
it goes on where both queries were: nothing is written twice, nothing lost. Delete the
delivery's checkpoint (DIR/deliver) and the consumer resumes from its committed position,
replaying the same micro-batch ranges, so their tokens skip what was applied.
``--consumer ''`` reads without a consumer (a lost checkpoint then restarts from the
snapshot). Data goes under $PERSIST_HOME (default ~/.pyspark-persist).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from collections import Counter

import psycopg
from common import session, stop, wait_for_rows
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

from pyspark_persist import exactly_once, sinks
from pyspark_persist.state import default_home

UPDATES = """inline(filter(array(
    named_struct('id', value, 'payload', concat('row-', value), '_diff', 1L),
    IF(value % 3 = 0 AND value >= 3,
       named_struct('id', value - 3, 'payload', concat('row-', value - 3), '_diff', -1L),
       NULL)
), u -> u IS NOT NULL))"""
"""Each rate value's updates: its row inserted; every third value retracts the row 3 below."""


def start_writer(spark: SparkSession, args: argparse.Namespace) -> StreamingQuery:
    """rate -> shard, exactly once (the persist sink's own tokens)."""
    return (
        spark.readStream.format("rate")
        .option("rowsPerSecond", args.rows_per_second)
        .load()
        .selectExpr(UPDATES)
        .writeStream.format("persist")
        .option("checkpointLocation", os.path.join(args.checkpoints, "write"))
        .trigger(processingTime="500 milliseconds")
        .start(args.shard)
    )


def start_delivery(
    spark: SparkSession, args: argparse.Namespace, available_now: bool = False
) -> StreamingQuery:
    """shard -> consumer -> PostgreSQL, each micro-batch applied once by its token."""
    sink = sinks.postgres(args.url, args.table)

    def deliver(df: DataFrame, token: str) -> None:
        applied = sink(df, token)
        what = "applied" if applied else "skipped (applied before: a replay)"
        print(f"[deliver] {what}: token {token}", file=sys.stderr, flush=True)

    reader = spark.readStream.format("persist")
    if args.consumer:
        reader = reader.option("consumer", args.consumer)
    writer = (
        reader.load(args.shard)
        .writeStream.foreachBatch(exactly_once(deliver))
        .option("checkpointLocation", os.path.join(args.checkpoints, "deliver"))
    )
    if available_now:
        return writer.trigger(availableNow=True).start()
    return writer.trigger(processingTime="250 milliseconds").start()


def table_rows(url: str, table: str) -> Counter[tuple[int, str]]:
    """The table's rows, as a multiset."""
    with psycopg.connect(url) as conn:
        return Counter(conn.execute(f'SELECT id, payload FROM "{table}"').fetchall())


def snapshot_rows(spark: SparkSession, shard: str) -> Counter[tuple[int, str]]:
    """The shard's collection now, as a multiset."""
    got: Counter[tuple[int, str]] = Counter()
    for row in spark.read.format("persist").load(shard).collect():
        got[(row["id"], row["payload"])] += row["_diff"]
    return got


def main() -> int:
    """Run both queries for --seconds, drain the delivery, compare; exit 0 when equal."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--url", default="postgresql://127.0.0.1:5432/test")
    ap.add_argument("--shard", default=f"orders-{uuid.uuid4().hex[:6]}")
    ap.add_argument("--table", default=None, help="default: the shard's name, '-' as '_'")
    ap.add_argument("--consumer", default="to-pg", help="'' to read without a consumer")
    ap.add_argument("--rows-per-second", type=int, default=50)
    ap.add_argument("--checkpoints", default=None, help="default: $PERSIST_HOME/checkpoints")
    args = ap.parse_args()
    args.table = args.table or args.shard.replace("-", "_")
    args.checkpoints = args.checkpoints or os.path.join(
        default_home(), "checkpoints", f"{args.shard}-to-postgres"
    )
    spark = session("persist: persist to PostgreSQL")

    writer = start_writer(spark, args)
    wait_for_rows(writer, "write")
    delivery = start_delivery(spark, args)
    print(
        f"writing shard {args.shard!r}, delivering it to table {args.table!r} at {args.url} "
        f"for {args.seconds:.0f} s",
        file=sys.stderr,
        flush=True,
    )
    deadline = time.monotonic() + args.seconds
    while time.monotonic() < deadline and writer.isActive and delivery.isActive:
        time.sleep(0.25)
    for query in (writer, delivery):
        if query.exception() is not None:
            raise SystemExit(f"query {query.name or query.id} failed: {query.exception()}")
    stop(writer)
    stop(delivery)
    # Everything the writer committed, delivered: the same query (checkpoint) to the end.
    drain = start_delivery(spark, args, available_now=True)
    drain.awaitTermination()

    shard, table = snapshot_rows(spark, args.shard), table_rows(args.url, args.table)
    equal = shard == table and all(n == 1 for n in table.values())
    for (id_, payload), n in sorted(table.items())[:5]:
        print(f"  {id_:>8} {payload:<16} x{n}")
    print(
        f"table {args.table!r}: {sum(table.values())} rows; shard {args.shard!r} snapshot: "
        f"{sum(shard.values())} rows; equal: {equal}"
    )
    spark.stop()
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
