"""Transactions survive SIGKILL at random points: each is in all of its shards or in none.

A child process commits transactions over three shards in a loop (every part staged in
Blob, so a kill can land while staging, during the one compare-and-set of several keys, or
after it and before the child hears of it), printing each token it saw committed. The parent
kills it with SIGKILL after a random delay, several times, restarting it each time from the
last token it printed (so the first transaction of a restart may be a resend of one that
landed unacknowledged). Then every transaction must be in all three shards or none, at the
same time in each, none twice, and every acknowledged one present.
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
KILLS = 8

CHILD = textwrap.dedent(
    """
    import sys
    import pyarrow as pa
    from pyspark_persist.state import PersistClient, PersistConfig

    blob, consensus, log, start, count, *shards = sys.argv[1:]
    schema = pa.schema([("id", pa.int64()), ("pad", pa.string())])
    config = PersistConfig(inline_write_max_bytes=16, maintenance=False)
    client = PersistClient.open(blob, consensus, config=config)
    for s in shards:
        client.open_shard(s, schema)
    with open(log, "a") as out:
        for token in range(int(start), int(start) + int(count)):
            with client.txn(writer_id="killed", token=token) as t:
                for s in shards:
                    t.append(s, pa.table({"id": [token], "pad": ["x" * 200]}, schema=schema))
            out.write(f"{token}\\n")
            out.flush()
    """
)


def _acknowledged(log: Path) -> list[int]:
    if not log.exists():
        return []
    return [int(line) for line in log.read_text().split() if line.strip()]


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sigkill_at_random_points_leaves_each_transaction_whole_or_absent(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    blob = f"file://{tmp_path}/blob"
    consensus = (
        f"sqlite:///{tmp_path}/consensus.db"
        if backend == "sqlite"
        else str(request.getfixturevalue("postgres_url"))
    )
    shards = [f"k{uuid.uuid4().hex[:12]}" for _ in range(SHARDS)]
    log = tmp_path / "acked.log"
    rng = random.Random(37)
    killed = 0
    for run in range(KILLS + 1):
        acked = _acknowledged(log)
        start = acked[-1] + 1 if acked else 1
        args = [blob, consensus, str(log), str(start), str(TXNS_PER_RUN), *shards]
        proc = subprocess.Popen([sys.executable, "-c", CHILD, *args])
        if run == KILLS:
            assert proc.wait(timeout=300) == 0
            break
        # Let it start and commit for a while (imports take ~1 s), then kill it anywhere.
        while len(_acknowledged(log)) == len(acked) and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            killed += 1
        proc.wait(timeout=60)
    assert killed >= KILLS - 1, "the child finished before most kills: make runs longer"

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
        assert set(_acknowledged(log)) <= set(ids[0]), "an acknowledged transaction was lost"
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
