"""A capped snapshot survives SIGKILL of the whole Spark application mid-snapshot (issue 17).

The child job of the sink kill test (``sink_jobs/files_to_persist.py`` with
``persist:NAME`` input) streams a source shard of three batches with
``maxFilesPerTrigger=1`` (so the first snapshot is cut into three
micro-batches) into another shard through the hooked persist sink, and is
killed (its process group, SIGKILL) while a cut is staged and right after a
cut's commit (before Spark records it), then restarted from the same checkpoint. Every source
row must land exactly once: Spark replays a cut with the offsets it
checkpointed, and the source reads the same time range again.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
import test_sink_kill
from test_sink_kill import _kill_at, _markers, _start, _tail

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.writer import read_sink_metrics

pytestmark = [pytest.mark.spark, pytest.mark.slow]

BATCHES = 3
ROWS = 40
RUN_TIMEOUT_S = 420.0
"""Per run: several micro-batches of hooked sleeps, and a JVM start on a busy machine."""
KILL_PLAN = (("stage", 0.3), ("postcommit", 0.0))
"""While the first cut stages; then right after a cut's commit, before Spark's commit log
records it, so the restart replays that cut."""


def test_sigkill_mid_snapshot_then_restart_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spark_submit_java_options: str
) -> None:
    """Kills inside the cut snapshot's micro-batches lose nothing and duplicate nothing."""
    import os
    import signal

    monkeypatch.setattr(test_sink_kill, "RUN_TIMEOUT_S", RUN_TIMEOUT_S)

    rng = random.Random(20261123)
    source, out = f"snap-{uuid.uuid4().hex[:8]}", f"snap-out-{uuid.uuid4().hex[:8]}"
    client = PersistClient.open(config=PersistConfig(maintenance=False))
    shard = client.open_shard(source, pa.schema([("id", pa.int64()), ("payload", pa.string())]))
    writer = shard.writer()
    for b in range(BATCHES):
        ids = list(range(b * ROWS, b * ROWS + ROWS))
        writer.compare_and_append(
            pa.table({"id": ids, "payload": [f"batch{b}-row{i}" for i in ids]}), b, b + 1
        )
    assert len(shard.state().trace) == BATCHES
    checkpoint, markers, log = tmp_path / "checkpoint", tmp_path / "markers.txt", tmp_path / "log"
    kills = []
    for phase, max_delay in KILL_PLAN:
        seen = len(_markers(markers))
        proc = _start(
            f"persist:{source}",  # type: ignore[arg-type]
            checkpoint,
            out,
            markers,
            log,
            spark_submit_java_options,
            kill_in=phase,
        )
        hit = _kill_at(proc, markers, seen, phase, rng.uniform(0, max_delay), log)
        assert hit is not None, f"the job finished before a kill at {phase}; log:\n{_tail(log)}"
        kills.append(hit)
    # Never killed: no kill windows, so the hooks do not sleep.
    proc = _start(
        f"persist:{source}",  # type: ignore[arg-type]
        checkpoint,
        out,
        markers,
        log,
        spark_submit_java_options,
        sleep_s=0.0,
    )
    try:
        assert proc.wait(RUN_TIMEOUT_S) == 0, _tail(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)

    table = client.open_shard(out, create=False).reader().snapshot_table()
    assert sorted(table.column("id").to_pylist()) == list(range(BATCHES * ROWS)), f"{kills}"
    assert set(table.column("_diff").to_pylist()) == {1}
    outcomes = [(m["batch_id"], m["outcome"]) for m in read_sink_metrics(str(checkpoint))]
    # One micro-batch per source batch: the snapshot was cut, and each cut committed once.
    assert sorted(b for b, o in outcomes if o == "committed") == list(range(BATCHES)), outcomes
    assert (int(kills[-1][1]), "already committed") in outcomes, outcomes
