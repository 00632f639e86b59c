"""Child job of the Spark Connect test: batch and streaming through ``remote("local[2]")``.

Usage: ``python connect_job.py WORKDIR OUT`` with ``PERSIST_HOME`` set. The
job's session is a Spark Connect client: ``remote("local[2]")`` starts a local
Connect server (a JVM with Spark's Connect plugin) and talks to it over gRPC,
so ``format("persist")`` runs in that server's Python workers. It writes a
shard in batch and reads it back, then tails it with a streaming query into
a second shard and reads that, and writes what it saw to OUT (JSON) for the
test to check.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from pyspark.sql import SparkSession

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
    with open(out, "w") as f:
        json.dump(report, f)
    spark.stop()


if __name__ == "__main__":
    main()
