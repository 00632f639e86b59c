"""A changing aggregate in a persist shard, tailed by a second query that keeps it consolidated.

Query 1: rate source -> count per bucket (value % --buckets) in complete mode
-> persist shard. Each micro-batch replaces the shard's contents atomically,
so the shard's changelog is retractions of the old counts and insertions of
the new ones.
Query 2: tails that shard (snapshot, then changes) and folds `_diff` into the
consolidated result, printed after every micro-batch; at the end it must
equal the shard read as a batch.

    spark-submit examples/streaming_aggregation.py [--seconds 30] [--buckets 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import uuid
from collections import Counter

from common import follow, session, stop, wait_for_rows
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

from pyspark_persist.state import default_home


def main() -> int:
    """Run both queries; exit 0 when the tailed view equals the shard's contents."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--buckets", type=int, default=5)
    ap.add_argument("--shard", default=f"counts-{uuid.uuid4().hex[:6]}")
    args = ap.parse_args()
    spark = session("persist: streaming aggregation")
    checkpoints = os.path.join(default_home(), "checkpoints", args.shard)

    counts = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 50)
        .load()
        .groupBy((F.col("value") % args.buckets).alias("bucket"))
        .count()
    )
    writer = (
        counts.writeStream.format("persist")
        .outputMode("complete")
        .option("checkpointLocation", os.path.join(checkpoints, "aggregate"))
        .trigger(processingTime="2 seconds")
        .start(args.shard)
    )
    wait_for_rows(writer, "aggregate")  # the shard exists once a micro-batch committed

    view: Counter[tuple[int, int]] = Counter()
    lock = threading.Lock()

    def fold(batch: DataFrame, batch_id: int) -> None:
        changes = batch.select("bucket", "count", "_diff").collect()
        with lock:
            for r in changes:
                view[(r["bucket"], r["count"])] += r["_diff"]
            live = sorted(k for k, n in view.items() if n > 0)
        print(
            f"[tail] micro-batch {batch_id}: {len(changes)} changes "
            f"({sum(r['_diff'] < 0 for r in changes)} retractions); "
            f"counts now {dict(live)}"
        )

    tail = (
        spark.readStream.format("persist")
        .load(args.shard)
        .writeStream.foreachBatch(fold)
        .option("checkpointLocation", os.path.join(checkpoints, "tail"))
        .trigger(processingTime="1 second")
        .start()
    )
    follow(writer, args.seconds, "aggregate")
    stop(writer)
    tail.processAllAvailable()
    stop(tail)

    final = {
        (r["bucket"], r["count"]): r["_diff"]
        for r in spark.read.format("persist").load(args.shard).collect()
    }
    with lock:
        consolidated = {k: n for k, n in view.items() if n != 0}
    ok = consolidated == final
    print(f"tailed view {dict(sorted(consolidated))} equals the shard: {ok}")
    spark.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
