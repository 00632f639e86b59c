"""Child job of the Spark Connect test: batch and streaming through ``remote("local[2]")``.

Usage: ``python connect_job.py WORKDIR OUT`` with ``PERSIST_HOME`` set. The
job's session is a Spark Connect client: ``remote("local[2]")`` starts a local
Connect server (a JVM with Spark's Connect plugin) and talks to it over gRPC,
so ``format("persist")`` runs in that server's Python workers. It writes a
shard in batch and reads it back, then tails it with a streaming query into
a second shard and reads that, then splits it into two shards with a
``foreachBatch`` transaction per micro-batch (``pyspark_persist.txn``, whose
function Connect runs in a server-side Python worker), replays its
micro-batch 0 from the client, streams both shards in one source (option
``shards``), and writes what it saw to OUT (JSON) for the test to check.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from both_shards import stream_both
from pyspark.sql import DataFrame, SparkSession

import pyspark_persist

ROWS = 500


def main() -> None:
    workdir, out = sys.argv[1:3]
    spark = (
        SparkSession.builder.remote("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    )
    report: dict[str, Any] = {"session": f"{type(spark).__module__}.{type(spark).__name__}"}

    (
        spark.range(ROWS, numPartitions=2)
        .selectExpr("id", "id * 2 AS twice")
        .write.format("persist")
        .mode("append")
        .save("connect-in")
    )
    back = spark.read.format("persist").load("connect-in").select("id", "twice", "_diff")
    report["batch"] = sorted(tuple(r) for r in back.collect())

    query = (
        spark.readStream.format("persist")
        .load("connect-in")
        .select("id", "twice")
        .writeStream.format("persist")
        .option("checkpointLocation", os.path.join(workdir, "checkpoint"))
        .trigger(availableNow=True)
        .start("connect-out")
    )
    if not query.awaitTermination(300):
        raise SystemExit("the streaming query did not finish its availableNow run in 300 s")
    report["query"] = f"{type(query).__module__}.{type(query).__name__}"
    got = spark.read.format("persist").load("connect-out").select("id", "_diff")
    report["stream"] = sorted(tuple(r) for r in got.collect())
    report["txn"] = split_in_transactions(spark, workdir)
    with open(out, "w") as f:
        json.dump(report, f)
    spark.stop()


def _even_odd(t: Any, df: DataFrame) -> None:
    t.append(df.filter("id % 2 = 0"), "connect-even")
    t.append(df.filter("id % 2 = 1"), "connect-odd")


def split_in_transactions(spark: SparkSession, workdir: str) -> dict[str, Any]:
    """``connect-out`` into two shards, one transaction per micro-batch; then a replay."""

    def load(df: DataFrame, batch_id: int) -> None:
        with pyspark_persist.txn(df.sparkSession, writerId="split", txnVersion=batch_id) as t:
            _even_odd(t, df)

    query = (
        spark.readStream.format("persist")
        .load("connect-out")
        .select("id")
        .writeStream.foreachBatch(load)
        .option("checkpointLocation", os.path.join(workdir, "txn-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(300):
        raise SystemExit("the foreachBatch query did not finish its availableNow run in 300 s")
    with pyspark_persist.txn(spark, writerId="split", txnVersion=0) as replay:
        _even_odd(replay, spark.range(5))
    history = {
        name: [
            [c["txn_id"], c["upper"]]
            for c in (
                r.asDict()
                for r in spark.read.format("persist").option("history", "true").load(name).collect()
            )
            if c["txn_id"]
        ]
        for name in ("connect-even", "connect-odd")
    }
    ids = {
        name: sorted(r.id for r in spark.read.format("persist").load(name).select("id").collect())
        for name in ("connect-even", "connect-odd")
    }
    return {
        "history": history,
        "ids": ids,
        "streamed": stream_both(spark, ("connect-even", "connect-odd"), {}, workdir),
        "replay_applied": not replay.already_committed,
    }


if __name__ == "__main__":
    main()
