"""The sink survives SIGKILL of the whole Spark application at chosen moments of a micro-batch.

A child ``spark-submit`` job (``tests/sink_jobs/files_to_persist.py``) streams
a directory of small JSON files (one file a micro-batch, every row a unique
id) into a shard with a fixed checkpoint. Its sink is the real persist
writer with test hooks that write a phase marker and sleep at each phase, so
the parent can kill the job (its whole process group, SIGKILL) while a task
stages, between staging and commit, and right after the commit (before
Spark's own commit log records the batch, so Spark replays it). After each
kill the job restarts from the same checkpoint; the last run finishes
(``availableNow``). Then the shard must hold every input row exactly once,
the replay must have been answered "already committed", and GC must reclaim
every part the killed attempts staged.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from jvm_fixtures import spark_submit

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.writer import read_sink_metrics

pytestmark = [pytest.mark.spark, pytest.mark.slow]

JOB = Path(__file__).parent / "sink_jobs" / "files_to_persist.py"
FILES = 4
ROWS_PER_FILE = 40
PAD = "x" * 200
"""Added to every payload: a file's rows stage past inline_write_max_bytes, as parts in Blob
(a tiny task would carry its rows inline), so the kills leave staged parts for GC to sweep."""
SLEEP_S = 0.6
"""Each hook's sleep: the window in which a kill lands in that phase."""
RUN_TIMEOUT_S = 150.0
KILL_PLAN = (("stage", 2 * SLEEP_S), ("precommit", SLEEP_S), ("postcommit", SLEEP_S))
"""(phase marker to wait for, upper bound of the random delay after it before SIGKILL)."""
HOLD_AT = {"stage": "staged", "precommit": "precommit", "postcommit": "postcommit"}
"""The hook that ends each kill phase, held in a run killed in that phase: a kill that lands
late (a parent slow to see the marker on a busy machine) would otherwise fall past the
phase, say after the commit it was meant to precede."""
NEXT_PHASE = {"stage": "precommit", "precommit": "postcommit", "postcommit": "stage"}
"""The marker that begins the phase after each kill phase: seen after the hit, the kill was late."""


def _start(
    input_dir: Path,
    checkpoint: Path,
    shard: str,
    markers: Path,
    log: Path,
    java_options: str,
    sleep_s: float = SLEEP_S,
    kill_in: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start the child job with the driver JVM's ``java_options``; ``sleep_s`` is its hooks'
    sleep (0 for a run nobody kills), ``kill_in`` the phase it will be killed in, whose
    ending hook holds until the kill."""
    env = dict(
        os.environ,
        PYSPARK_PYTHON=sys.executable,
        PYSPARK_DRIVER_PYTHON=sys.executable,
        SINK_TEST_MARKERS=str(markers),
        SINK_TEST_SLEEP_S=str(sleep_s),
        SINK_TEST_HOLD="" if kill_in is None else HOLD_AT[kill_in],
    )
    cmd = [
        spark_submit(),
        "--master",
        "local[2]",
        "--driver-java-options",
        java_options,
        "--conf",
        "spark.ui.enabled=false",
        "--conf",
        "spark.sql.shuffle.partitions=2",
        "--conf",
        "spark.sql.streaming.noDataMicroBatches.enabled=false",
        str(JOB),
        str(input_dir),
        str(checkpoint),
        shard,
    ]
    with open(log, "ab") as out:
        # A session of its own: SIGKILL to the group takes the JVM and the Python driver.
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )


def _markers(path: Path) -> list[tuple[str, str]]:
    if not path.exists():
        return []
    return [tuple(line.split()[:2]) for line in path.read_text().splitlines() if line.strip()]  # type: ignore[misc]


def _kill_at(
    proc: subprocess.Popen[bytes], markers: Path, seen: int, phase: str, delay_s: float, log: Path
) -> tuple[str, str] | None:
    """Wait for a new ``phase`` marker, wait ``delay_s``, SIGKILL the job's process group.

    Checks that the kill landed inside the phase: no marker of the next phase (NEXT_PHASE)
    was written after the hit.
    """
    deadline = time.monotonic() + RUN_TIMEOUT_S
    hit = None
    while hit is None:
        new = _markers(markers)[seen:]
        hit = next((m for m in new if m[0] == phase), None)
        if hit is None:
            if proc.poll() is not None:
                return None  # finished before reaching the phase
            assert time.monotonic() < deadline, f"no {phase} marker; log:\n{_tail(log)}"
            time.sleep(0.02)
    time.sleep(delay_s)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    new = _markers(markers)[seen:]
    past = [m for m in new[new.index(hit) + 1 :] if m[0] == NEXT_PHASE[phase]]
    assert not past, f"the kill meant for {phase} landed past it: markers {new}"
    return hit


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-40:]) if log.exists() else ""


def test_sigkill_at_random_points_then_restart_exactly_once(
    tmp_path: Path, spark_submit_java_options: str
) -> None:
    """Kills during staging, before and after the commit lose nothing and duplicate nothing.

    Protects: exactly-once across driver crashes (the writer id is the query id
    kept in the checkpoint, the token the batch id), the "already committed"
    answer to a replayed batch, and GC reclaiming parts staged by killed attempts.
    """
    rng = random.Random(20240611)
    shard = f"kill-{uuid.uuid4().hex[:8]}"
    input_dir, checkpoint = tmp_path / "in", tmp_path / "checkpoint"
    markers, log = tmp_path / "markers.txt", tmp_path / "child.log"
    input_dir.mkdir()
    for f in range(FILES):
        lines = [
            json.dumps({"id": f * ROWS_PER_FILE + i, "payload": f"file{f}-row{i}{PAD}"})
            for i in range(ROWS_PER_FILE)
        ]
        (input_dir / f"part-{f:03d}.json").write_text("\n".join(lines) + "\n")

    kills: list[tuple[str, str]] = []
    for phase, max_delay in KILL_PLAN:
        seen = len(_markers(markers))
        proc = _start(
            input_dir, checkpoint, shard, markers, log, spark_submit_java_options, kill_in=phase
        )
        hit = _kill_at(proc, markers, seen, phase, rng.uniform(0, max_delay), log)
        assert hit is not None, f"the job finished before a kill at {phase}; log:\n{_tail(log)}"
        kills.append(hit)

    # The last run is never killed: its hooks need no kill window, so they do not sleep.
    proc = _start(
        input_dir, checkpoint, shard, markers, log, spark_submit_java_options, sleep_s=0.0
    )
    try:
        assert proc.wait(RUN_TIMEOUT_S) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    client = PersistClient.open(
        config=PersistConfig(staged_part_grace_s=0.2, retry_timeout_s=0.05, maintenance=False)
    )
    handle = client.open_shard(shard, create=False)
    table = handle.reader().snapshot_table()
    ids = sorted(table.column("id").to_pylist())
    assert ids == list(range(FILES * ROWS_PER_FILE)), f"kills {kills}"
    assert set(table.column("_diff").to_pylist()) == {1}

    state = handle.state()
    assert len(state.writers) == 1, "restarts from one checkpoint must be one writer"
    (writer,) = state.writers.values()
    assert writer.last_token == FILES - 1

    replayed = int(kills[-1][1])  # killed right after committing this batch: Spark replays it
    outcomes = [(m["batch_id"], m["outcome"]) for m in read_sink_metrics(str(checkpoint))]
    assert (replayed, "already committed") in outcomes, outcomes
    assert sorted(b for b, o in outcomes if o == "committed") == list(range(FILES))

    def unreferenced() -> set[str]:
        st = handle.state()
        live = {p.key for b in st.batches.values() for p in b.parts if p.key is not None}
        return {m.key for m in client.blob.list_keys(f"{shard}/part/")} - live

    # The precommit kill and the replay each left staged parts no state references.
    assert unreferenced(), "expected parts staged by killed attempts"
    time.sleep(0.5)
    report = handle.gc()
    assert report.orphans_deleted > 0
    assert unreferenced() == set()
    assert sorted(handle.reader().snapshot_table().column("id").to_pylist()) == ids
