"""Spark Connect: the ``[connect]`` extra is enough, and ``format("persist")`` works through it.

In the fresh install of ``test_install.py`` (the wheel with ``[spark]``),
``pip install "<wheel>[connect]"`` must install cleanly; then
``jobs/connect_job.py`` runs there, outside the source tree, with a session
from ``SparkSession.builder.remote("local[2]")``: a Connect client talking
gRPC to a local Connect server. It writes and reads in batch and streams
from one shard into another. A separate process, since this test run's own
session is a classic one.
"""

from __future__ import annotations

import fcntl
import json
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from distribution import Built, FreshInstall, alarming

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = Path(__file__).parent / "jobs" / "connect_job.py"
CONNECT_PORT = 15002
"""Where a ``remote("local...")`` server listens and its client connects; not configurable."""
ROWS = 500  # the job's rows


@contextmanager
def connect_port() -> Iterator[None]:
    """Hold the machine-wide turn for port 15002, so two test runs on one machine never collide."""
    lock = Path(tempfile.gettempdir()) / f"pyspark-persist-connect-{CONNECT_PORT}.lock"
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        with socket.socket() as probe:
            busy = probe.connect_ex(("127.0.0.1", CONNECT_PORT)) == 0
        if busy:
            pytest.fail(
                f"port {CONNECT_PORT} is taken by another process: Spark Connect's local mode "
                "needs it; stop that process"
            )
        yield


def test_batch_and_streaming_through_spark_connect(
    fresh_install: FreshInstall, built: Built, tmp_path: Path
) -> None:
    """``.[connect]`` installs cleanly; batch and streaming reads and writes work over Connect."""
    pip = fresh_install.venv / "bin" / "pip"
    install = fresh_install.run(pip, "install", f"{built.wheel}[connect]")
    assert install.returncode == 0 and alarming(install.stdout) == [], install.stdout[-4000:]
    check = fresh_install.run(pip, "check")
    assert check.returncode == 0, check.stdout

    out = tmp_path / "report.json"
    with connect_port():
        job = fresh_install.run(fresh_install.venv / "bin" / "python", JOB, tmp_path, out)
    assert job.returncode == 0, job.stdout[-6000:]
    report = json.loads(out.read_text())
    assert report["session"] == "pyspark.sql.connect.session.SparkSession"
    assert report["query"] == "pyspark.sql.connect.streaming.query.StreamingQuery"
    assert report["batch"] == [[i, 2 * i, 1] for i in range(ROWS)]
    assert report["stream"] == [[i, 1] for i in range(ROWS)]
    # foreachBatch transactions: both shards got every micro-batch's commit at the same time;
    # the client's replay of micro-batch 0 applied nothing.
    txn = report["txn"]
    assert txn["history"]["connect-even"] == txn["history"]["connect-odd"] != []
    assert txn["ids"] == {
        "connect-even": list(range(0, ROWS, 2)),
        "connect-odd": list(range(1, ROWS, 2)),
    }
    assert txn["replay_applied"] is False
    # Both shards streamed in one source (option shards) over Connect: every row, tagged.
    assert txn["streamed"] == txn["ids"]
