"""Every job in ``examples/`` runs as documented, on the embedded default, and says it worked.

Each example is run exactly as the docs' Examples page (``docs/examples.md``)
shows (``spark-submit examples/NAME.py ...``; the Spark-free quickstart with
``python``) on small sizes, with ``$PERSIST_HOME`` pointing at a fresh directory, and its
printed verdict is checked. The Spark jobs run one after another (each
starts a JVM), in the order that page tells them: the rate job writes the
shard that the tail and the batch export then read. Their driver JVMs get the
test run's quick-start options (``jvm_fixtures``): how the JVM loads classes,
nothing an example sees.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SHARD = "rates"


def _spark_submit() -> list[str]:
    """``$SPARK_HOME/bin/spark-submit``, the one on PATH, or pyspark's own copy."""
    home = os.environ.get("SPARK_HOME")
    candidates = [os.path.join(home, "bin", "spark-submit")] if home else []
    on_path = shutil.which("spark-submit")
    if on_path:
        candidates.append(on_path)
    try:
        import pyspark

        candidates.append(os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-submit"))
    except ImportError:
        pass
    for c in candidates:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return [
                c,
                "--master",
                "local[2]",
                "--conf",
                "spark.ui.enabled=false",
                "--conf",
                "spark.sql.shuffle.partitions=2",
            ]
    pytest.skip("spark-submit not found (install pyspark or set SPARK_HOME)")


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh embedded default shared by the jobs of this module."""
    yield tmp_path_factory.mktemp("examples-home")


def run(home: Path, argv: list[str], timeout: float = 150) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "PERSIST_HOME": str(home),
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
    }
    proc = subprocess.run(
        argv, cwd=EXAMPLES.parent, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, (
        f"{' '.join(argv)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
        f"\n--- stderr\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def submit(spark_submit_java_options: str) -> list[str]:
    """``spark-submit`` and its options, with the test run's quick driver JVM (shared classes)."""
    return [*_spark_submit(), "--driver-java-options", spark_submit_java_options]


def spark_job(
    submit: list[str], home: Path, script: str, *args: str
) -> subprocess.CompletedProcess[str]:
    return run(home, [*submit, str(EXAMPLES / script), *args])


def test_stream_quickstart(home: Path) -> None:
    proc = run(
        home,
        [
            sys.executable,
            str(EXAMPLES / "stream_quickstart.py"),
            "--batches",
            "20",
            "--shard",
            "quickstart",
        ],
        timeout=60,
    )
    assert "consolidated match: True" in proc.stdout


@pytest.fixture(scope="module")
def rates(submit: list[str], home: Path) -> int:
    """Run rate_to_persist for 3 seconds into shard ``rates``; the rows it wrote."""
    proc = spark_job(
        submit,
        home,
        "rate_to_persist.py",
        "--seconds",
        "3",
        "--shard",
        SHARD,
        "--rows-per-second",
        "20",
    )
    m = re.search(
        rf"shard '{SHARD}': (\d+) rows, (\d+) distinct values .*exactly once: (\w+)", proc.stdout
    )
    assert m is not None, proc.stdout
    assert m.group(3) == "True" and int(m.group(1)) == int(m.group(2)) > 0
    # The progress lines the Examples page shows (spark-submit sends the driver's stderr to stdout).
    assert "[sink] micro-batch" in proc.stdout + proc.stderr
    return int(m.group(1))


def test_rate_to_persist_exactly_once(rates: int) -> None:
    assert rates > 0


def test_tail_shard_available_now(submit: list[str], home: Path, rates: int) -> None:
    proc = spark_job(submit, home, "tail_shard.py", "--shard", SHARD, "--available-now")
    assert "Batch: 0" in proc.stdout
    header = next(line for line in proc.stdout.splitlines() if "_diff" in line)
    assert re.search(r"\|\s*timestamp\s*\|\s*value\s*\|\s*_time\s*\|\s*_diff\s*\|", header)


def test_batch_asof_to_parquet(submit: list[str], home: Path, rates: int, tmp_path: Path) -> None:
    out = tmp_path / "rates-parquet"
    proc = spark_job(submit, home, "batch_asof_to_parquet.py", "--shard", SHARD, "--out", str(out))
    m = re.search(
        rf"wrote (\d+) rows of shard '{SHARD}' as of (\d+) to {re.escape(str(out))}", proc.stdout
    )
    assert m is not None, proc.stdout
    assert int(m.group(1)) == rates
    assert list(out.glob("*.parquet"))


def test_streaming_aggregation(submit: list[str], home: Path) -> None:
    # 4 s: two more of the aggregate's 2-second micro-batches, each retracting the last counts.
    proc = spark_job(
        submit,
        home,
        "streaming_aggregation.py",
        "--seconds",
        "4",
        "--buckets",
        "3",
        "--shard",
        "counts",
    )
    assert "[tail] micro-batch" in proc.stdout
    assert re.search(r"tailed view \{.*\} equals the shard: True", proc.stdout), proc.stdout


def test_cdc_upsert(submit: list[str], home: Path) -> None:
    # 600 events over 60 keys in 4 files: two runs of the CDC query, a tail with change types.
    proc = spark_job(
        submit,
        home,
        "cdc_upsert.py",
        "--events",
        "600",
        "--keys",
        "60",
        "--files",
        "4",
        "--shard",
        "customers",
    )
    out = proc.stdout + proc.stderr
    assert "[cdc] run done" in out and "[tail] micro-batch" in out
    assert re.search(r"change types seen by the tail: \{.*'update_preimage'", proc.stdout)
    m = re.search(
        r"shard 'customers': (\d+) live keys; equals the feed applied with pandas: (\w+); "
        r"tailed view equals it: (\w+); each change exactly once: (\w+)",
        proc.stdout,
    )
    assert m is not None, proc.stdout
    assert int(m.group(1)) > 0 and m.groups()[1:] == ("True", "True", "True")
