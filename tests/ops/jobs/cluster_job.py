"""Child job of the cluster test: a roundtrip and a restarted stream on a real cluster.

Usage: ``spark-submit --master local-cluster[2,1,1024] --py-files pyspark_persist.zip
--conf spark.executorEnv.AWS_ACCESS_KEY_ID=... cluster_job.py BLOB CONSENSUS RUN WORKDIR OUT``
(shards ``in-RUN`` and ``out-RUN``).

``local-cluster`` runs a standalone master and two workers, and each worker
launches its executor as a JVM of its own, as on a real cluster. The job:

1. asks every executor where it runs (its JVM's pid and main class), which
   S3 credentials boto3 resolves there, and where ``pyspark_persist`` was
   imported from (the ``--py-files`` archive, ahead of any installed copy);
2. writes a DataFrame to a shard on S3 + PostgreSQL from both executors and
   reads it back (the roundtrip);
3. tails that shard into a second one with a streaming query, stops it
   mid-stream, writes more, and restarts it from its checkpoint;
4. splits a DataFrame into two shards in one ``pyspark_persist.txn`` (staged
   on both executors, committed on the driver) and streams both shards in one
   source (option ``shards``).

It writes what it saw to OUT (JSON) for the test to check; it checks nothing itself.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

from both_shards import stream_both
from pyspark.sql import SparkSession

ROWS = 600
"""Rows per batch write; three writes in all."""


def _parent(pid: int) -> int:
    """The parent of ``pid``, from /proc (field 4 of stat; the name before it may hold spaces)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _jvm_of(pid: int) -> tuple[int, str]:
    """The nearest ancestor of ``pid`` that is a JVM, and its main class."""
    while pid > 1:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode() for a in f.read().split(b"\0") if a]
        if argv and os.path.basename(argv[0]) == "java":
            main = next((a for a in argv if a.startswith("org.apache.spark.")), "?")
            return pid, main
        pid = _parent(pid)
    raise RuntimeError("no JVM among this process's ancestors")


def _where(_: Iterator[Any]) -> Iterator[dict[str, Any]]:
    """This process's JVM, the S3 credentials boto3 finds here, and the package's origin."""
    import boto3

    import pyspark_persist

    jvm, main = _jvm_of(os.getpid())
    with open(f"/proc/{jvm}/environ", "rb") as f:
        jvm_env = dict(kv.decode().split("=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    creds = boto3.session.Session().get_credentials()
    yield {
        "jvm_pid": jvm,
        "jvm_main": main,
        "jvm_access_key": jvm_env.get("AWS_ACCESS_KEY_ID"),
        "access_key": creds.access_key if creds else None,
        "credentials_from": creds.method if creds else None,
        "package": pyspark_persist.__file__,
    }


def _wait_for_executors(spark: SparkSession, count: int, timeout_s: float = 120) -> None:
    """Block until ``count`` executors have registered, so the first job's tasks reach all."""
    tracker = spark.sparkContext._jsc.sc().statusTracker()  # noqa: SLF001
    deadline = time.monotonic() + timeout_s
    while len(tracker.getExecutorInfos()) < count + 1:  # the driver counts as one
        if time.monotonic() > deadline:
            raise SystemExit(f"fewer than {count} executors registered in {timeout_s:.0f} s")
        time.sleep(0.2)


def _write(spark: SparkSession, opts: dict[str, str], shard: str, start: int) -> None:
    """Append ids ``start .. start + ROWS - 1`` in four tasks, so both executors stage parts."""
    (
        spark.range(start, start + ROWS, numPartitions=4)
        .selectExpr("id", "concat('row-', id) AS name")
        .write.format("persist")
        .options(**opts)
        .mode("append")
        .save(shard)
    )


def main() -> None:
    blob, consensus, run, workdir, out = sys.argv[1:6]
    spark = SparkSession.builder.appName("persist cluster test").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    with open(os.path.join(workdir, "app-id"), "w") as f:
        f.write(spark.sparkContext.applicationId)  # the workers' files go under work/<app-id>
    _wait_for_executors(spark, 2)
    opts = {"blob": blob, "consensus": consensus}
    source, sink = f"in-{run}", f"out-{run}"
    report: dict[str, Any] = {"driver": next(_where(iter(())))}
    report["executors"] = (
        spark.sparkContext.parallelize(range(4), 4).mapPartitions(_where).collect()
    )

    _write(spark, opts, source, 0)
    back = spark.read.format("persist").options(**opts).load(source)
    report["roundtrip"] = sorted(tuple(r) for r in back.select("id", "name", "_diff").collect())

    checkpoint = os.path.join(workdir, "checkpoint")

    def start(available_now: bool) -> Any:
        w = (
            spark.readStream.format("persist")
            .options(**opts)
            .load(source)
            .select("id", "name")
            .writeStream.format("persist")
            .options(**opts)
            .option("checkpointLocation", checkpoint)
        )
        w = (
            w.trigger(availableNow=True)
            if available_now
            else w.trigger(processingTime="200 milliseconds")
        )
        return w.start(sink)

    first = start(available_now=False)
    deadline = time.monotonic() + 120
    while not any(p["numInputRows"] > 0 for p in first.recentProgress):
        if time.monotonic() > deadline or not first.isActive:
            raise SystemExit(f"first run committed nothing: {first.exception()}")
        time.sleep(0.1)
    _write(spark, opts, source, ROWS)  # lands while the query runs, or just after it stops
    first.stop()
    _write(spark, opts, source, 2 * ROWS)
    second = start(available_now=True)
    if not second.awaitTermination(300):
        raise SystemExit("the restarted query did not finish its availableNow run in 300 s")
    report["first_run_batches"] = len(first.recentProgress)
    report["sink"] = sorted(
        tuple(r)
        for r in spark.read.format("persist")
        .options(**opts)
        .load(sink)
        .select("id", "_diff")
        .collect()
    )
    report["txn"] = _split_in_one_transaction(spark, opts, run, workdir)
    with open(out, "w") as f:
        json.dump(report, f)
    spark.stop()


def _split_in_one_transaction(
    spark: SparkSession, opts: dict[str, str], run: str, workdir: str
) -> dict[str, Any]:
    """Even and odd ids into two shards in one ``pyspark_persist.txn`` (four staging tasks
    over both executors, one commit on the driver), then both shards in one stream."""
    import pyspark_persist

    evens, odds = f"even-{run}", f"odd-{run}"
    df = spark.range(0, ROWS, numPartitions=4).selectExpr("id", "concat('row-', id) AS name")
    with pyspark_persist.txn(spark, writerId="cluster", txnVersion=0, **opts) as t:
        t.append(df.filter("id % 2 = 0"), evens)
        t.append(df.filter("id % 2 = 1"), odds)
    history = {
        name: [
            [r["txn_id"], r["upper"]]
            for r in spark.read.format("persist")
            .options(**opts)
            .option("history", "true")
            .load(name)
            .collect()
            if r["txn_id"]
        ]
        for name in (evens, odds)
    }
    return {
        "history": history,
        "time": t.commit_time,
        "streamed": stream_both(spark, (evens, odds), opts, workdir),
    }


if __name__ == "__main__":
    main()
