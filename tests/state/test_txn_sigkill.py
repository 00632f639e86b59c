"""Transactions survive SIGKILL at every step of a commit: each is in all its shards or none.

A child process commits transactions over three shards in a loop (every part staged in Blob),
logging each token it saw committed, and whether a commit was the resend of one that had
landed. The parent kills it with SIGKILL and restarts it from the token after the last one
logged, so the first transaction of a restart resends the one the kill interrupted. Kills land
at chosen steps of a commit, each held there by the child until the kill: while staging (a
part written to Blob), just before the one compare-and-set of several keys, and just after it
landed, before the child heard (the resend must then be answered "already committed"); and at
random moments. Then every transaction must be in all three shards or none, at one time in
each, none twice, every acknowledged one present, and reads as of one time agree.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from pyspark_persist.state import PersistClient, PersistConfig

SHARDS = 3
TXNS_PER_RUN = 400
PHASES = ("staging", "before-cas", "after-cas", "random") * 2
"""Where each run is killed; ``random``: after a random delay, wherever the child is."""

CHILD = textwrap.dedent(
    """
    import sys, threading, time
    import pyarrow as pa
    from pyspark_persist.state import PersistClient, PersistConfig
    from pyspark_persist.state.blob import open_blob
    from pyspark_persist.state.consensus import open_consensus
    from pyspark_persist.state.unreliable import Faults, UnreliableBlob, UnreliableConsensus

    blob_uri, consensus_uri, log, phase, start, count, *shards = sys.argv[1:]
    hold_after = int(start) + 3  # the transaction held at the phase (after a few commits)
    token = 0

    once = threading.Lock()  # staging runs on several threads: the first one logs

    def hold(here):
        if phase == here and token == hold_after:
            if once.acquire(blocking=False):
                with open(log, "a") as out:
                    out.write(f"held {here} {token}\\n")
            time.sleep(60)  # the parent kills us here

    class Blob(UnreliableBlob):
        def set(self, key, value):
            super().set(key, value)
            hold("staging")

    class Consensus(UnreliableConsensus):
        def compare_and_set_many(self, ops):
            hold("before-cas")
            res = super().compare_and_set_many(ops)
            hold("after-cas")
            return res

    off = Faults(seed=0)
    blob = Blob(open_blob(blob_uri), off, enabled=False)
    consensus = Consensus(open_consensus(consensus_uri), off, enabled=False)
    config = PersistConfig(inline_write_max_bytes=16, maintenance=False)
    client = PersistClient(blob, consensus, config=config)
    schema = pa.schema([("id", pa.int64()), ("pad", pa.string())])
    for s in shards:
        client.open_shard(s, schema)
    for token in range(int(start), int(start) + int(count)):
        with client.txn(writer_id="killed", token=token) as t:
            for s in shards:
                t.append(s, pa.table({"id": [token], "pad": ["x" * 200]}, schema=schema))
        with open(log, "a") as out:
            out.write(f"{'already' if t.already_committed else 'acked'} {token}\\n")
    """
)


def _log(path: Path) -> list[tuple[str, int]]:
    if not path.exists():
        return []
    words = [line.split() for line in path.read_text().splitlines() if line.strip()]
    return [(w[0], int(w[-1])) for w in words]


def _acked(path: Path) -> list[int]:
    return [t for kind, t in _log(path) if kind in ("acked", "already")]


def _wait_for(path: Path, seen: int, kind: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while not any(k == kind for k, _ in _log(path)[seen:]):
        assert proc.poll() is None, f"the child exited ({proc.returncode}) before {kind!r}"
        assert time.monotonic() < deadline, f"no {kind!r} from the child in 120 s"
        time.sleep(0.01)


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkill_at_every_step_leaves_each_transaction_whole_or_absent(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    blob = f"file://{tmp_path}/blob"
    consensus = (
        f"sqlite:///{tmp_path}/consensus.db"
        if backend == "sqlite"
        else str(request.getfixturevalue("postgres_url"))
    )
    shards = [f"k{uuid.uuid4().hex[:12]}" for _ in range(SHARDS)]
    log = tmp_path / "txns.log"
    rng = random.Random(37)
    for phase in (*PHASES, "finish"):
        seen = len(_log(log))
        acked = _acked(log)
        start = acked[-1] + 1 if acked else 1
        args = [blob, consensus, str(log), phase, str(start), str(TXNS_PER_RUN), *shards]
        proc = subprocess.Popen([sys.executable, "-c", CHILD, *args])
        if phase == "finish":
            assert proc.wait(timeout=300) == 0
            break
        if phase == "random":
            _wait_for(log, seen, "acked", proc)  # started and committing
            time.sleep(rng.uniform(0.0, 0.3))
        else:
            _wait_for(log, seen, "held", proc)
        assert proc.poll() is None, "the child finished before its kill: make runs longer"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        if phase != "random":
            held = [t for k, t in _log(log)[seen:] if k == "held"]
            assert held == [start + 3] and _acked(log)[-1] == start + 2
    # A kill after the compare-and-set left its transaction landed but unacknowledged: the next
    # run's resend was answered "already committed". One before it landed nothing: the resend
    # committed it.
    already = {t for k, t in _log(log) if k == "already"}
    assert set(_held(log, "after-cas")) <= already
    assert not already & {*_held(log, "before-cas"), *_held(log, "staging")}

    client = PersistClient.open(blob, consensus, config=PersistConfig(maintenance=False))
    try:
        ids: list[list[int]] = []
        uppers: list[list[int]] = []
        for s in shards:
            shard = client.open_shard(s)
            table = shard.reader().snapshot_table()
            got = table.column("id").to_pylist()
            assert table.column("_diff").to_pylist() == [1] * len(got), f"{s}: a row twice"
            assert len(set(got)) == len(got), f"shard {s}: a transaction applied twice"
            ids.append(sorted(got))
            # Nothing compacts (maintenance is off): each transaction is one batch per shard.
            uppers.append([b.upper for b in shard.state().trace])
        assert all(i == ids[0] for i in ids), "a transaction in some shards only"
        assert all(u == uppers[0] for u in uppers), "a transaction at different times"
        assert len(uppers[0]) == len(ids[0]), "a commit that is not one transaction's"
        assert set(_acked(log)) <= set(ids[0]), "an acknowledged transaction was lost"
        # Every transaction of the runs is there: each restart resumed after the last ack, and
        # an unacknowledged one that landed was answered "already committed" by its resend.
        assert ids[0] == list(range(1, len(ids[0]) + 1))
        # Consistent cuts: as of any transaction's time every shard holds the same ones.
        for upper in rng.sample(uppers[0], 15):
            cut = [
                sorted(
                    client.open_shard(s).reader().snapshot_table(upper - 1).column("id").to_pylist()
                )
                for s in shards
            ]
            assert all(c == cut[0] for c in cut)
    finally:
        client.close()


def _held(path: Path, phase: str) -> list[int]:
    """The tokens held (and killed) at ``phase``."""
    lines = path.read_text().splitlines()
    return [int(line.split()[2]) for line in lines if line.startswith(f"held {phase} ")]
