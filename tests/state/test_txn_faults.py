"""Transactions through a faulty Blob and Consensus: every failure leaves each transaction in
all of its shards or in none, and a resend with the same token applies it exactly once.

Seeded faults on every store call (a call refused before it reaches the store, a reply lost
after the change landed, a timeout that landed too, slowness). After each failed commit the
test looks, faults off, at every shard the transaction names: it must be in all or none. Then
it resends with the same writer id and token until a commit returns. At the end each shard holds
exactly the transactions that named it, once each.
"""

from __future__ import annotations

import random
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import PersistError
from pyspark_persist.state.unreliable import Faults, UnreliableBlob, UnreliableConsensus

SCHEMA = pa.schema([("id", pa.int64()), ("pad", pa.string())])
TXNS = 60


@pytest.mark.parametrize(
    "backend", ["mem", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_faults_leave_each_transaction_whole_or_absent_and_resends_apply_once(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    tag = uuid.uuid4().hex
    if backend == "mem":
        blob_uri, consensus_uri = f"mem://{tag}", f"mem://{tag}"
    else:
        blob_uri = f"file://{tmp_path}/blob"
        consensus_uri = (
            f"sqlite:///{tmp_path}/c.db"
            if backend == "sqlite"
            else str(request.getfixturevalue("postgres_url"))
        )
    faults = Faults(seed=37, fail_before=0.08, fail_after=0.08, timeout=0.04, slow_s=0.001)
    consensus = UnreliableConsensus(open_consensus(consensus_uri), faults, enabled=False)
    blob = UnreliableBlob(open_blob(blob_uri), faults, enabled=False)
    config = PersistConfig(inline_write_max_bytes=64, maintenance=False, retry_timeout_s=2.0)
    client = PersistClient(blob, consensus, config=config)
    shards = [f"f{uuid.uuid4().hex[:12]}" for _ in range(5)]
    for s in shards:
        client.open_shard(s, SCHEMA)
    rng = random.Random(37)
    members = {i: rng.sample(shards, rng.randint(2, 5)) for i in range(1, TXNS + 1)}
    failures = 0

    def present(i: int) -> list[bool]:
        out = []
        for s in members[i]:
            shard = client.open_shard(s)
            ids = shard.reader().snapshot_table().column("id").to_pylist() if shard.upper else []
            out.append(i in ids)
        return out

    for i, names in members.items():
        while True:
            consensus.enabled = blob.enabled = True
            try:
                t = client.txn(writer_id="faulty", token=i)
                for s in names:
                    t.append(s, pa.table({"id": [i], "pad": ["p" * 100]}, schema=SCHEMA))
                t.commit()
                break
            except PersistError:
                failures += 1
            finally:
                consensus.enabled = blob.enabled = False
            seen = present(i)
            assert all(seen) or not any(seen), f"txn {i} is in some of {names} only: {seen}"
    assert failures >= 5, f"only {failures} failed commits: the faults exercised too little"
    assert sum(consensus.injected.values()) and sum(blob.injected.values())

    for s in shards:
        table = client.open_shard(s).reader().snapshot_table()
        assert table.column("_diff").to_pylist() == [1] * table.num_rows
        got = sorted(table.column("id").to_pylist())
        assert got == sorted(i for i, names in members.items() if s in names), s
    client.close()
