"""``examples/persist_to_postgres.py`` killed with SIGKILL again and again delivers exactly once.

The example job (rate -> persist -> consumer -> ``sinks.postgres``) runs as users run it
(``spark-submit``), with a fixed shard, table and checkpoints. The pipeline fixture kills
it (its whole process group, SIGKILL: the driver JVM, the Python driver and its workers)
:data:`KILLS` times once the delivery runs: half at random moments (during the rate
source's writes, a delivery's ``COPY`` or its commit, or between micro-batches), half the
moment a new token shows in PostgreSQL, which mostly falls between PostgreSQL's commit and
Spark's commit log (a replay, skipped by its token). Each restart
uses the same checkpoints; the last run is left to finish, drains the delivery and
compares the table with the shard's snapshot. The tests then check the table
themselves: every value the rate source produced landed exactly once and every
retraction was applied. A second test deletes the delivery's checkpoint and runs again:
the named consumer resumes from its committed position and replays the same ranges,
whose tokens are recorded, so nothing lands twice.

:data:`KILLS` = 10 (the issue's minimum): each restart pays Spark's start-up (~10-15 s
with the CDS archive), so the module takes 4.5 to 9 minutes (measured: 268 s on a quiet
machine, 540 s at load 12; 355 s with the deleted-checkpoint run).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from jvm_fixtures import spark_submit

from pyspark_persist.state import PersistClient

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.postgres]

JOB = Path(__file__).resolve().parents[2] / "examples" / "persist_to_postgres.py"
KILLS = 10
RUNNING = "[deliver] "
"""The job's line after each delivered micro-batch: kills come after the run's first (before
it, only Spark's start-up would be killed)."""
MAX_DELAY_S = 3.0
"""A kill lands uniformly within this long after RUNNING: a few deliveries (up to 4 a
second) and the writer's micro-batches (2 a second)."""
START_TIMEOUT_S = 180.0
RUN_TIMEOUT_S = 300.0


@dataclass
class Pipeline:
    """The fixed names of the killed pipeline and what its runs left behind."""

    shard: str
    table: str
    checkpoints: Path
    log: Path
    consumer: str
    java_options: str
    url: str
    kills: list[float]


def _command(p: Pipeline, seconds: float) -> list[str]:
    return [
        spark_submit(),
        "--master",
        "local[2]",
        "--driver-java-options",
        p.java_options,
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.sql.shuffle.partitions=2",
        str(JOB),
        "--seconds",
        str(seconds),
        "--url",
        p.url,
        "--shard",
        p.shard,
        "--table",
        p.table,
        "--consumer",
        p.consumer,
        "--rows-per-second",
        "200",
        "--checkpoints",
        str(p.checkpoints),
    ]


def _start(p: Pipeline, seconds: float) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    with open(p.log, "ab") as out:
        # A session of its own: SIGKILL to the group takes the JVM, the driver and workers.
        return subprocess.Popen(
            _command(p, seconds),
            cwd=JOB.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-60:])


def _kill_while_running(p: Pipeline, rng: random.Random, on_token: bool) -> None:
    """Start the job, wait until it delivered once, SIGKILL it a random moment later, or
    (``on_token``) the moment PostgreSQL holds one more token after that: a delivery just
    committed, most likely before Spark's commit log records its micro-batch."""
    offset = p.log.stat().st_size if p.log.exists() else 0
    proc = _start(p, seconds=600)
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while RUNNING not in p.log.read_bytes()[offset:].decode(errors="replace"):
            assert proc.poll() is None, f"the job ended before running:\n{_tail(p.log)}"
            assert time.monotonic() < deadline, f"the job never ran:\n{_tail(p.log)}"
            time.sleep(0.05)
        delay = rng.uniform(0, MAX_DELAY_S)
        time.sleep(delay)
        if on_token:
            with psycopg.connect(p.url, autocommit=True) as conn:
                seen = _tokens(conn, p.table)
                while _tokens(conn, p.table) == seen:
                    assert time.monotonic() < deadline, f"no delivery:\n{_tail(p.log)}"
                    time.sleep(0.002)
        p.kills.append(delay)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def _tokens(conn: psycopg.Connection, table: str) -> int:
    row = conn.execute("SELECT count(*) FROM persist_tokens WHERE target = %s", (table,))
    return int(row.fetchone()[0])  # type: ignore[index]


def _finish(p: Pipeline) -> str:
    """Run the job to its end (a short run, the drain, the check); its output."""
    offset = p.log.stat().st_size if p.log.exists() else 0
    proc = _start(p, seconds=3)
    try:
        code = proc.wait(RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = p.log.read_bytes()[offset:].decode(errors="replace")
    assert code == 0, f"the last run exited {code}:\n{_tail(p.log)}"
    return out


def _table(p: Pipeline) -> Counter[tuple[int, str]]:
    with psycopg.connect(p.url) as conn:
        return Counter(conn.execute(f"SELECT id, payload FROM {p.table}").fetchall())


def _snapshot(p: Pipeline) -> Counter[tuple[int, str]]:
    got: Counter[tuple[int, str]] = Counter()
    with PersistClient.open().open_shard(p.shard, create=False).reader() as reader:
        for u in reader.snapshot_table().to_pylist():
            got[(u["id"], u["payload"])] += u["_diff"]
    return got


def _check_exactly_once(p: Pipeline) -> int:
    """The table equals the shard's snapshot, and both are what the rate source's values
    make: every value 0..n-1 once, minus those every third value retracted. Returns n."""
    table, snapshot = _table(p), _snapshot(p)
    assert table == snapshot, f"table and shard differ: {(table - snapshot)=} {(snapshot - table)=}"
    assert set(table.values()) == {1}, "a row landed twice"
    # The rate values the writer turned into updates: 0..n-1; n-1 itself is never retracted
    # (only a value n + 2 would), so it is the highest id.
    n = max(i for i, _ in table) + 1
    retracted = {u for u in range(0, n, 3) if u + 3 <= n - 1}
    assert {i for i, _ in table} == set(range(n)) - retracted
    assert all(payload == f"row-{i}" for i, payload in table)
    return n


@pytest.fixture(scope="module")
def killed_pipeline(
    tmp_path_factory: pytest.TempPathFactory, spark_submit_java_options: str, postgres_url: str
) -> Iterator[Pipeline]:
    """The pipeline after KILLS kills at random moments and one run to the end (its table
    dropped after the module)."""
    base = tmp_path_factory.mktemp("pg-kill")
    name = f"kill-{uuid.uuid4().hex[:8]}"
    p = Pipeline(
        shard=name,
        table=name.replace("-", "_"),
        checkpoints=base / "checkpoints",
        log=base / "job.log",
        consumer="to-pg",
        java_options=spark_submit_java_options,
        url=postgres_url,
        kills=[],
    )
    rng = random.Random(20261127)
    for i in range(KILLS):
        _kill_while_running(p, rng, on_token=i % 2 == 1)
    out = _finish(p)
    assert "equal: True" in out, out[-3000:]
    yield p
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {p.table}")


def test_sigkill_at_random_points_then_restart_delivers_exactly_once(
    killed_pipeline: Pipeline,
) -> None:
    """After 10 kills and a run to the end, every row landed once and every retraction was
    applied: the table is the shard's snapshot."""
    p = killed_pipeline
    assert len(p.kills) == KILLS
    n = _check_exactly_once(p)
    assert n > 100, f"only {n} values written: the runs did little"
    log = p.log.read_text(errors="replace")
    applied = len(re.findall(r"\[deliver\] applied", log))
    # A kill on a fresh token lands before Spark's commit log more often than not (2 of the
    # first 3 in one run measured, 5 of 5 in another), so some micro-batch was replayed and
    # skipped by its token.
    replays = len(re.findall(r"\[deliver\] skipped \(applied before", log))
    # Every run delivered: each killed one at least once before its kill (a run's first
    # delivery may be the replay of the micro-batch its predecessor was killed in, so under
    # load a run may apply nothing new: CI once saw 10 applied over 11 runs), the last one
    # to its end.
    assert applied >= 1 and applied + replays > KILLS, (
        f"{applied} micro-batches applied and {replays} replays skipped over {KILLS + 1} runs"
    )
    print(
        f"{KILLS} kills, {applied} micro-batches applied, {replays} replays skipped, "
        f"{n} rate values, {len(_table(p))} rows in the table"
    )
    assert replays >= 1, "no kill fell between PostgreSQL's commit and Spark's commit log"


def test_a_deleted_checkpoint_resumes_from_the_consumer_and_lands_nothing_twice(
    killed_pipeline: Pipeline,
) -> None:
    p = killed_pipeline
    shutil.rmtree(p.checkpoints / "deliver")
    out = _finish(p)
    assert "equal: True" in out, out[-3000:]
    _check_exactly_once(p)
