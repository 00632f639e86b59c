"""Tail a persist shard to the console: its snapshot first, then every change, with _time/_diff.

    spark-submit examples/tail_shard.py --shard rates [--seconds 30] [--available-now]

With --available-now it prints what the shard holds now and exits.
"""

from __future__ import annotations

import argparse
import sys
import tempfile

from common import follow, session, stop


def main() -> int:
    """Tail the shard for --seconds (or once with --available-now)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", required=True)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--available-now", action="store_true")
    args = ap.parse_args()
    spark = session("persist: tail a shard")
    stream = spark.readStream.format("persist").load(args.shard)
    writer = (
        stream.writeStream.format("console")
        .option("truncate", "false")
        .option("numRows", 20)
        .option("checkpointLocation", tempfile.mkdtemp(prefix="tail-"))
    )
    if args.available_now:
        query = writer.trigger(availableNow=True).start()
        query.awaitTermination()
    else:
        query = writer.trigger(processingTime="1 second").start()
        follow(query, args.seconds, "tail")
        stop(query)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
