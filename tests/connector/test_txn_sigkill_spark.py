"""``pyspark_persist.txn`` in ``foreachBatch`` survives SIGKILL of the whole Spark application.

A child ``spark-submit`` job (``sink_jobs/txn_orders.py``) turns a ``rate-micro-batch``
stream into orders and their items, two shards with different columns, written in one
transaction a micro-batch with ``txnVersion=batch_id``, on a file Blob and a SQLite (or
PostgreSQL) Consensus, with a fixed checkpoint. The parent kills the job (its whole process
group, SIGKILL: the driver JVM, the Python driver and its workers) at each chosen step of a
micro-batch's commit, the job holding there until the kill, and (on SQLite) once at a random
moment;
each restart uses the same checkpoint, and the last run goes on two micro-batches past the
furthest any run reached, then stops.

* ``before-cas``: both shards' rows staged by the executors, the one ``compare_and_set_many``
  not made. Nothing landed: the restart replays the micro-batch and commits it.
* ``committed``: the transaction landed in both shards, Spark's commit log lacks the
  micro-batch: the restart replays it and the commit answers "already committed" at the
  time it landed, applying nothing.
* ``random``: wherever the job is a moment after its first commit of the run (staging,
  committing, between micro-batches).

Then every micro-batch is in both shards or in neither, each exactly once, every one that
Spark's commit log records is there, both shards took each transaction at one time (reads
as of any of those times agree), and the parts the killed attempts staged are left to GC's
orphan sweep (``Shard.gc``, which ``persist shards gc`` runs), after which the data reads
the same. Each ``spark-submit`` run costs Spark's start-up: four runs on SQLite, three on
PostgreSQL (no random kill), ~20 s each on a quiet machine.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
from jvm_fixtures import spark_submit

from pyspark_persist.state import PersistClient, PersistConfig, Shard

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = Path(__file__).parent / "sink_jobs" / "txn_orders.py"
ROWS_PER_BATCH = 200
"""The job's orders a micro-batch (its ``ROWS_PER_BATCH``); each order has two items."""
KILLS = {"sqlite": ("before-cas", "committed", "random"), "postgres": ("before-cas", "committed")}
"""The step each killed run is held at (``random``: none, killed a random moment later). On
PostgreSQL, the chosen steps only: each run costs Spark's start-up, and the random moments
(mostly while the executors stage) exercise Consensus no differently."""
MAX_RANDOM_DELAY_S = 2.0
"""A random kill lands within this long after the run's first commit (a micro-batch or so)."""
RUN_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class Marker:
    """One line of the job's markers: ``held <step> <batch>`` or
    ``committed <batch> <time> <applied|already>``."""

    kind: str
    batch: int
    step: str = ""
    time: int = 0
    outcome: str = ""


def _markers(path: Path) -> list[Marker]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        w = line.split()
        if w[0] == "held":
            out.append(Marker("held", int(w[2]), step=w[1]))
        elif w[0] == "committed":
            # A replay that cannot tell its commit's time says None: no time matches -1.
            at = -1 if w[2] == "None" else int(w[2])
            out.append(Marker("committed", int(w[1]), time=at, outcome=w[3]))
    return out


@dataclass
class Job:
    """The fixed names of the killed job and where its runs leave their traces."""

    blob: str
    consensus: str
    orders: str
    items: str
    checkpoint: Path
    markers: Path
    log: Path
    java_options: str

    def start(self, hold: str, until: int) -> subprocess.Popen[bytes]:
        """A run held at step ``hold`` (``""``: nowhere) that stops after micro-batch ``until``."""
        env = dict(
            os.environ,
            PYSPARK_PYTHON=sys.executable,
            PYSPARK_DRIVER_PYTHON=sys.executable,
            TXN_TEST_MARKERS=str(self.markers),
            TXN_TEST_HOLD=hold,
        )
        cmd = [
            spark_submit(),
            "--master",
            "local[2]",
            "--driver-java-options",
            self.java_options,
            "--conf",
            "spark.ui.enabled=false",
            "--conf",
            "spark.sql.shuffle.partitions=2",
            str(JOB),
            self.blob,
            self.consensus,
            str(self.checkpoint),
            self.orders,
            self.items,
            str(until),
        ]
        with open(self.log, "ab") as out:
            # A session of its own: SIGKILL to the group takes the JVM, the driver and workers.
            return subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return "\n".join(line for line in lines[-400:] if not line.startswith("\tat "))[-4000:]

    def wait_for(self, proc: subprocess.Popen[bytes], seen: int, kind: str) -> Marker:
        """The first new marker of ``kind`` (after the first ``seen``)."""
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while True:
            hit = next((m for m in _markers(self.markers)[seen:] if m.kind == kind), None)
            if hit is not None:
                return hit
            assert proc.poll() is None, f"the job exited before {kind!r}:\n{self.tail()}"
            assert time.monotonic() < deadline, f"no {kind!r} in {RUN_TIMEOUT_S} s:\n{self.tail()}"
            time.sleep(0.02)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    assert proc.poll() is None, "the job ended before its kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def _spark_log(checkpoint: Path, log: str) -> set[int]:
    """The micro-batch ids in the checkpoint's ``offsets`` or ``commits`` log."""
    return {int(p.name) for p in (checkpoint / log).iterdir() if p.name.isdigit()}


def _run(job: Job, kills: tuple[str, ...], rng: random.Random) -> dict[str, int]:
    """A killed run for each of ``kills``, then one to two micro-batches past the furthest
    any run reached; the micro-batch held at each chosen step."""
    held: dict[str, int] = {}
    for step in kills:
        seen = len(_markers(job.markers))
        proc = job.start("" if step == "random" else step, until=10**6)
        try:
            if step == "random":
                job.wait_for(proc, seen, "committed")
                time.sleep(rng.uniform(0, MAX_RANDOM_DELAY_S))
            else:
                held[step] = job.wait_for(proc, seen, "held").batch
        finally:
            _kill(proc)
    furthest = max(m.batch for m in _markers(job.markers))
    proc = job.start("", until=furthest + 2)
    try:
        assert proc.wait(RUN_TIMEOUT_S) == 0, job.tail()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return held


def _by_batch(table: pa.Table, *key: str) -> dict[int, list[tuple[int, ...]]]:
    """Each micro-batch's rows in ``table``, as their ``key`` columns."""
    out: dict[int, list[tuple[int, ...]]] = {}
    columns = [table.column(k).to_pylist() for k in key]
    for b, *row in zip(table.column("batch").to_pylist(), *columns, strict=True):
        out.setdefault(b, []).append(tuple(row))
    return out


def _check_once(orders: pa.Table, items: pa.Table, checkpoint: Path) -> list[int]:
    """Each micro-batch exactly once in both shards, none lost; the micro-batch ids."""
    for table in (orders, items):  # a diff of 2: a row applied twice
        assert set(table.column("_diff").to_pylist()) == {1}, "a micro-batch applied twice"
    order_ids, item_keys = _by_batch(orders, "order_id"), _by_batch(items, "order_id", "line")
    batches = sorted(order_ids)
    assert batches == sorted(item_keys) == list(range(len(batches))), "a micro-batch lost"
    for b in batches:
        # Its rate values, each order once, each with its two items.
        values = range(b * ROWS_PER_BATCH, (b + 1) * ROWS_PER_BATCH)
        assert sorted(order_ids[b]) == [(v,) for v in values], f"micro-batch {b}'s orders"
        assert sorted(item_keys[b]) == [(v, line) for v in values for line in (0, 1)], b
    # Every micro-batch Spark committed is in the shards; none Spark never planned is.
    assert _spark_log(checkpoint, "commits") <= set(batches)
    assert set(batches) <= _spark_log(checkpoint, "offsets")
    return batches


def _check_times(orders: Shard, items: Shard, batches: list[int]) -> dict[int, int]:
    """One commit a micro-batch in each shard, the same transaction at the same time, and
    reads as of each such time agree; each micro-batch's commit time."""
    txns = [{c.upper - 1: c.txn_id for c in s.history() if c.txn_id} for s in (orders, items)]
    assert txns[0] == txns[1] and len(txns[0]) == len(batches)
    at = {}
    for i, t in enumerate(sorted(txns[0])):
        # As of each transaction's time both shards hold the same whole micro-batches, one
        # more than as of the time before.
        cut = [
            Counter(s.reader().snapshot_table(t).column("batch").to_pylist())
            for s in (orders, items)
        ]
        assert sorted(cut[0]) == sorted(cut[1]) == batches[: i + 1], (t, cut)
        assert all(n == ROWS_PER_BATCH for n in cut[0].values()), (t, cut[0])
        assert all(n == 2 * ROWS_PER_BATCH for n in cut[1].values()), (t, cut[1])
        at[batches[i]] = t
    return at


def _check_replays(markers: list[Marker], held: dict[str, int], at: dict[int, int]) -> None:
    """What the job's commits answered: each micro-batch applied once, at its time."""
    outcomes = [(m.batch, m.outcome) for m in markers]
    applied = Counter(b for b, o in outcomes if o == "applied")
    assert all(n == 1 for n in applied.values()), f"a micro-batch applied twice: {outcomes}"
    # Killed before its compare-and-set, a micro-batch had landed nowhere: its replay applied
    # it. Killed after its commit, it had landed everywhere: its replay applied nothing, and
    # learnt the time it had landed at.
    assert (held["before-cas"], "already") not in outcomes
    assert (held["before-cas"], "applied") in outcomes
    assert [o for b, o in outcomes if b == held["committed"]][:2] == ["applied", "already"]
    assert all(at[m.batch] == m.time for m in markers), "the job saw another commit time"


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkill_at_each_step_of_a_spark_txn_leaves_every_micro_batch_whole_once(
    backend: str,
    tmp_path: Path,
    spark_submit_java_options: str,
    request: pytest.FixtureRequest,
) -> None:
    job = Job(
        blob=f"file://{tmp_path}/blob",
        consensus=(
            f"sqlite:///{tmp_path}/consensus.db"
            if backend == "sqlite"
            else str(request.getfixturevalue("postgres_url"))
        ),
        orders=f"orders-{uuid.uuid4().hex[:8]}",
        items=f"items-{uuid.uuid4().hex[:8]}",
        checkpoint=tmp_path / "checkpoint",
        markers=tmp_path / "markers.txt",
        log=tmp_path / "job.log",
        java_options=spark_submit_java_options,
    )
    started = time.monotonic()
    held = _run(job, KILLS[backend], random.Random(37))
    runs_s = time.monotonic() - started

    client = PersistClient.open(
        job.blob,
        job.consensus,
        config=PersistConfig(staged_part_grace_s=0.2, retry_timeout_s=0.05, maintenance=False),
    )
    try:
        orders, items = client.open_shard(job.orders), client.open_shard(job.items)
        order_rows = orders.reader().snapshot_table()
        item_rows = items.reader().snapshot_table()
        batches = _check_once(order_rows, item_rows, job.checkpoint)
        at = _check_times(orders, items, batches)
        markers = [m for m in _markers(job.markers) if m.kind == "committed"]
        _check_replays(markers, held, at)

        # The killed attempts' staged parts: in Blob, referenced by no state; the orphan sweep
        # deletes them, and every shard reads the same after.
        def unreferenced() -> set[str]:
            out = set()
            for shard in (orders, items):
                state = shard.state()
                live = {p.key for b in state.batches.values() for p in b.parts if p.key}
                listed = {m.key for m in client.blob.list_keys(f"{shard.name}/part/")}
                out |= listed - live
            return out

        orphans = unreferenced()
        # At least the parts of the attempt killed before its commit: one per task (local[2]:
        # two) in each shard.
        assert len(orphans) >= 4, f"the kill before the commit left {len(orphans)} parts"
        time.sleep(0.3)  # past the grace the sweep gives staged parts
        swept = sum(shard.gc().orphans_deleted for shard in (orders, items))
        assert swept >= len(orphans) and unreferenced() == set()
        for shard, rows, key in ((orders, order_rows, "order_id"), (items, item_rows, "sku")):
            assert shard.reader().snapshot_table().sort_by(key).equals(rows.sort_by(key))
    finally:
        client.close()
    replays = sum(m.outcome == "already" for m in markers)
    print(
        f"{backend}: killed at {held} and at {len(KILLS[backend]) - len(held)} random moment(s); "
        f"{len(batches)} micro-batches in both shards, {replays} replay(s) applied nothing, "
        f"{len(orphans)} orphan parts swept ({swept} deleted); the runs took {runs_s:.0f} s"
    )
