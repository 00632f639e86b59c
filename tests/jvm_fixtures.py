"""A class-data sharing (CDS) archive of Spark's classes, so the tests' JVMs start faster.

Every ``spark-submit`` starts a JVM that loads and verifies thousands of
Spark classes from their jars: half of a short job's CPU time. The
``spark_submit_java_options`` fixture runs one small job once per test run
with ``-XX:ArchiveClassesAtExit``, which dumps the classes it loaded into an
archive; the tests' other jobs (the kill tests' restarts, the examples) map
that archive with ``-XX:SharedArchiveFile`` instead of loading those classes
again. The archive only changes how classes are loaded: a JVM that cannot use
it (another JDK, another class path) warns and runs as without it. The
warm-up job is the first of the jobs started early, in the background, while
the JVM-free tests run (``tests/early.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import early
import pyspark
import pytest

QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
"""A quick-starting JVM: the tests' jobs are short, JIT and GC threads only compete for CPU."""

WARM_UP_JOB = """
import sys
from pyspark.sql import SparkSession

spark = SparkSession.builder.appName("cds-warm-up").getOrCreate()
spark.sparkContext.setLogLevel("ERROR")
spark.range(100).selectExpr("id % 3 AS k").groupBy("k").count().collect()
spark.read.json(sys.argv[1]).collect()
query = (
    spark.readStream.schema("id long").json(sys.argv[2])
    .writeStream.format("noop").trigger(availableNow=True).start()
)
query.awaitTermination()
spark.stop()
"""
"""Loads the classes the tests' jobs share: SQL planning, aggregation, JSON, a file stream."""


WARM_UP_TIMEOUT_S = 120.0
"""The warm-up takes 10-20 s; one starved longer than this (it runs niced, in the background,
and a loaded machine gives it nothing: seen at 300 s with two CPU hogs beside the tests) is
given up, and the jobs start without an archive rather than not at all."""


def spark_submit() -> str:
    """``$SPARK_HOME/bin/spark-submit``, else the one shipped inside the pyspark package."""
    home = os.environ.get("SPARK_HOME") or os.path.dirname(pyspark.__file__)
    return os.path.join(home, "bin", "spark-submit")


def _java_options(factory: pytest.TempPathFactory, env: dict[str, str]) -> str:
    """Run the warm-up job with ``-XX:ArchiveClassesAtExit``; the options that use its archive.

    Without an archive (the warm-up job failed or ran out of time) the options are the quick
    JVM's alone.
    """
    base = factory.mktemp("cds")
    archive, job, data = base / "spark.jsa", base / "warm_up.py", base / "data"
    job.write_text(WARM_UP_JOB)
    data.mkdir()
    (data / "rows.json").write_text('{"id": 1}\n')
    env = dict(env, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    try:
        dump = subprocess.run(
            [
                spark_submit(),
                "--master",
                "local[2]",
                "--driver-java-options",
                f"{QUICK_JVM} -XX:ArchiveClassesAtExit={archive}",
                "--conf",
                "spark.ui.enabled=false",
                str(job),
                str(data / "rows.json"),
                str(data),
            ],
            env=env,
            cwd=base,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=WARM_UP_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return QUICK_JVM
    if dump.returncode != 0 or not Path(archive).is_file():
        return QUICK_JVM
    return f"{QUICK_JVM} -XX:SharedArchiveFile={archive}"


early.register("spark_submit_java_options", _java_options)


@pytest.fixture(scope="session")
def spark_submit_java_options(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``--driver-java-options`` for the tests' ``spark-submit`` jobs: quick JIT, shared classes.

    The warm-up job starts early, in the background (``early``), while the JVM-free tests run.
    """
    return str(early.result("spark_submit_java_options", tmp_path_factory))
