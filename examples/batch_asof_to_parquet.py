"""Batch job: read a persist shard as of a time and write it out as Parquet.

    spark-submit examples/batch_asof_to_parquet.py --shard rates --out /tmp/rates-parquet \
        [--as-of <ms time>]

Without --as-of it reads the latest complete time. Each row is written with
its multiplicity (`_diff`) expanded, so the Parquet output is the plain table.
"""

from __future__ import annotations

import argparse
import sys

from common import session
from pyspark.sql import functions as F


def main() -> int:
    """Read the shard as of a time, expand multiplicities, write Parquet, print a summary."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shard", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--as-of", type=int, default=None)
    args = ap.parse_args()
    spark = session("persist: batch as-of to parquet")
    reader = spark.read.format("persist")
    if args.as_of is not None:
        reader = reader.option("asOf", args.as_of)
    df = reader.load(args.shard)
    as_of = df.select(F.max("_time")).first()[0]
    rows = df.withColumn("_copy", F.explode(F.sequence(F.lit(1), F.col("_diff")))).drop(
        "_copy", "_diff", "_time"
    )
    rows.write.mode("overwrite").parquet(args.out)
    n = spark.read.parquet(args.out).count()
    print(f"wrote {n} rows of shard {args.shard!r} as of {as_of} to {args.out}")
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
