"""Running on a cluster: S3 + PostgreSQL, executors in JVMs of their own, the package shipped.

The application (``jobs/cluster_job.py``) runs under ``spark-submit --master
local-cluster[2,1,1024]``: a standalone master and two workers, each worker
launching its executor as a separate JVM, as on a real cluster. It is set up
the way the docs' "Running on a cluster" page (``docs/cluster.md``) says:

- Blob on an S3-compatible endpoint (moto's server on loopback), Consensus on
  PostgreSQL;
- the package on the executors from ``--py-files pyspark_persist.zip`` (the
  built wheel under a name Spark puts on the workers' Python path);
- the executors' S3 credentials from ``spark.executorEnv.*``; the driver's
  from its own environment (the standard AWS variables).

local-cluster's workers live inside the driver's JVM, so its executors would
also inherit the driver's environment; the executors are therefore given
other credentials than the driver, and the test checks that they use those.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import boto3
import pyspark
import pytest
from blob_fixtures import MOTO_BUCKET
from distribution import Built
from jvm_fixtures import QUICK_JVM

from pyspark_persist.state import PersistClient

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.postgres]

JOB = Path(__file__).parent / "jobs" / "cluster_job.py"
DRIVER_KEY, EXECUTOR_KEY = "driver-key", "executor-key"
ROWS = 600  # the job's rows per write; it writes three times
TIMEOUT_S = 400.0


def test_roundtrip_and_restarted_stream_on_a_local_cluster(
    built: Built,
    moto_server: str,
    postgres_url: str,
    tmp_path: Path,
    spark_submit_java_options: str,
) -> None:
    """Two executor JVMs write and read S3 + PostgreSQL; a restarted stream lands exactly once;
    a transaction over two shards commits once and a stream of both reads it whole."""
    run_id = uuid.uuid4().hex[:8]
    blob = f"s3://{MOTO_BUCKET}/cluster-{run_id}?endpoint_url={moto_server}&region=us-east-1"
    archive = tmp_path / "pyspark_persist.zip"
    shutil.copyfile(built.wheel, archive)
    spark_home = Path(pyspark.__file__).parent
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "SPARK_HOME" and not k.startswith(("AWS_", "PYSPARK_"))
    }
    env.update(
        AWS_ACCESS_KEY_ID=DRIVER_KEY,
        AWS_SECRET_ACCESS_KEY="driver-secret",
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
    )
    out, log = tmp_path / "report.json", tmp_path / "job.log"
    cmd = [
        str(spark_home / "bin" / "spark-submit"),
        "--master",
        "local-cluster[2,1,1024]",
        "--py-files",
        str(archive),
        "--conf",
        f"spark.executorEnv.AWS_ACCESS_KEY_ID={EXECUTOR_KEY}",
        "--conf",
        "spark.executorEnv.AWS_SECRET_ACCESS_KEY=executor-secret",
        "--driver-java-options",
        spark_submit_java_options,
        "--conf",
        f"spark.executor.extraJavaOptions={QUICK_JVM}",
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.sql.shuffle.partitions=2",
        str(JOB),
        blob,
        postgres_url,
        run_id,
        str(tmp_path),
        str(out),
    ]
    try:
        with open(log, "w") as f:
            proc = subprocess.run(
                cmd, env=env, cwd=tmp_path, stdout=f, stderr=subprocess.STDOUT, timeout=TIMEOUT_S
            )
    finally:
        # local-cluster's workers keep each application's files under $SPARK_HOME/work.
        app_id = tmp_path / "app-id"
        if app_id.exists():
            shutil.rmtree(spark_home / "work" / app_id.read_text().strip(), ignore_errors=True)
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-60:])
    assert proc.returncode == 0, tail
    report = json.loads(out.read_text())

    executors = report["executors"]
    jvms = {e["jvm_pid"] for e in executors}
    assert len(jvms) == 2 and report["driver"]["jvm_pid"] not in jvms, report
    for e in executors:
        assert e["jvm_main"] == "org.apache.spark.executor.CoarseGrainedExecutorBackend", e
        assert (e["access_key"], e["credentials_from"]) == (EXECUTOR_KEY, "env"), e
        assert e["jvm_access_key"] == EXECUTOR_KEY, e
        assert e["package"].endswith("pyspark_persist.zip/pyspark_persist/__init__.py"), e
    assert report["driver"]["access_key"] == DRIVER_KEY, report["driver"]

    assert report["roundtrip"] == [[i, f"row-{i}", 1] for i in range(ROWS)]
    assert report["first_run_batches"] >= 1
    assert report["sink"] == [[i, 1] for i in range(3 * ROWS)], "each row exactly once"

    # One transaction over two shards from the cluster: one commit in each, at one time; both
    # shards streamed in one source, every row tagged with its shard.
    txn = report["txn"]
    evens, odds = f"even-{run_id}", f"odd-{run_id}"
    assert len(txn["history"][evens]) == 1 and txn["history"][evens] == txn["history"][odds]
    assert txn["history"][evens][0][1] == txn["time"] + 1  # the commit's upper: time + 1
    assert txn["streamed"] == {evens: list(range(0, ROWS, 2)), odds: list(range(1, ROWS, 2))}

    # The data is where the options said: parts in the bucket, state in PostgreSQL.
    client = PersistClient.open(blob, postgres_url)
    out_rows = client.open_shard(f"out-{run_id}", create=False).reader().snapshot_table()
    assert sorted(out_rows.column("id").to_pylist()) == list(range(3 * ROWS))
    s3 = boto3.client("s3", endpoint_url=moto_server, region_name="us-east-1")
    listed = s3.list_objects_v2(Bucket=MOTO_BUCKET, Prefix=f"cluster-{run_id}/")
    assert listed.get("KeyCount", 0) > 0
