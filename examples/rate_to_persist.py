"""Main job: Spark's rate source into a persist shard, exactly once, then read back and checked.

Once the first micro-batch has committed, it writes for --seconds (default
20), stops, reads the shard back with a batch read and checks that every
generated value landed exactly once.

    spark-submit examples/rate_to_persist.py [--seconds 20] [--shard rates] [--rows-per-second 100]

Data and checkpoints go under $PERSIST_HOME (default ~/.pyspark-persist).
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid

from common import follow, session, stop, wait_for_rows

from pyspark_persist.state import default_home


def main() -> int:
    """Run the writer and the tail; exit 0 when every value is in the shard exactly once."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--shard", default=f"rates-{uuid.uuid4().hex[:6]}")
    ap.add_argument("--rows-per-second", type=int, default=100)
    args = ap.parse_args()
    spark = session("persist: rate to persist")
    checkpoints = os.path.join(default_home(), "checkpoints", args.shard)

    writer = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", args.rows_per_second)
        .load()
        .writeStream.format("persist")
        .option("checkpointLocation", os.path.join(checkpoints, "sink"))
        .trigger(processingTime="1 second")
        .start(args.shard)
    )
    wait_for_rows(writer, "sink")
    print(
        f"writing shard {args.shard!r} under {default_home()} for {args.seconds:.0f} s",
        file=sys.stderr,
    )
    follow(writer, args.seconds, "sink")
    stop(writer)

    got = spark.read.format("persist").load(args.shard)
    rows = got.count()
    distinct = got.select("value").distinct().count()
    low, high = got.selectExpr("min(value)", "max(value)").first()
    ok = rows == distinct and (rows == 0 or high - low + 1 == rows)
    print(
        f"shard {args.shard!r}: {rows} rows, {distinct} distinct values "
        f"[{low}, {high}]; exactly once: {ok}"
    )
    spark.stop()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
