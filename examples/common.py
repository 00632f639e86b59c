"""What every example job shares: a SparkSession with format("persist"), and progress lines."""

from __future__ import annotations

import pkgutil
import sys
import time

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery


def session(app: str) -> SparkSession:
    """The job's SparkSession (spark-submit's master, or local[2] when run with plain python)."""
    builder = SparkSession.builder.appName(app).config("spark.sql.shuffle.partitions", "2")
    if "spark.master" not in SparkSession.builder._options:  # noqa: SLF001 - plain python run
        builder = builder.master("local[2]")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not any(m.name == "pyspark_persist" for m in pkgutil.iter_modules()):
        # An editable install is invisible to Spark's scan of pyspark_* modules.
        from pyspark_persist import DefaultSource

        spark.dataSource.register(DefaultSource)
    return spark


def wait_for_rows(query: StreamingQuery, label: str, timeout_s: float = 300) -> None:
    """Block until a micro-batch with rows has committed (Spark's start-up can take a while)."""
    deadline = time.monotonic() + timeout_s
    print(f"[{label}] starting (the first micro-batch includes Spark's start-up)", file=sys.stderr)
    while time.monotonic() < deadline:
        if not query.isActive:
            raise SystemExit(f"[{label}] query stopped: {query.exception()}")
        if any(p["numInputRows"] > 0 for p in query.recentProgress):
            return
        time.sleep(0.25)
    raise SystemExit(f"[{label}] no micro-batch committed within {timeout_s:.0f} s")


def stop(query: StreamingQuery) -> None:
    """Stop a query quietly: from here on the job logs only fatal errors.

    Stopping cancels the running micro-batch, whose staged parts are aborted
    (and its input replayed on restart): expected, so not worth an ERROR log.
    Its tasks log that abort when they notice the cancellation, which can be
    well after ``stop()`` returns, so the quiet is never lifted. The examples
    only read and print after stopping, and a failure there still raises.
    """
    spark = SparkSession.getActiveSession()
    if spark is not None:
        spark.sparkContext.setLogLevel("FATAL")
    query.stop()


def follow(query: StreamingQuery, seconds: float, label: str) -> None:
    """Print one line per finished micro-batch until ``seconds`` pass or the query ends."""
    deadline = time.monotonic() + seconds
    seen = -1
    while query.isActive and time.monotonic() < deadline:
        p = query.lastProgress
        if p is not None and p["batchId"] != seen:
            seen = p["batchId"]
            print(
                f"[{label}] micro-batch {seen}: {p['numInputRows']} rows "
                f"({p.get('processedRowsPerSecond', 0.0):.0f} rows/s)",
                file=sys.stderr,
            )
        time.sleep(0.25)
