"""Batches staged elsewhere (``Txn.append_staged``, what Spark's executors hand the driver) join
a transaction as the shard's share: committed with the rest at one time, owned (and deleted)
by the transaction when it fails or lands nothing."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest

from pyspark_persist.state import ARROW_ROWS, BatchBuilder, PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import InvalidUsage
from pyspark_persist.state.staging import StagedBatch

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string())])


@pytest.fixture
def client() -> Iterator[PersistClient]:
    tag = uuid.uuid4().hex
    config = PersistConfig(inline_write_max_bytes=16, maintenance=False)
    c = PersistClient(open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"), config=config)
    yield c
    c.close()


def stage(client: PersistClient, shard: str, ids: list[int], inline: bool = False) -> StagedBatch:
    """Stage ``ids`` as a Spark sink task does: rows only, no time, in Blob (or inline)."""
    config = PersistConfig(inline_write_max_bytes=1 << 20 if inline else 16)
    builder = BatchBuilder(client.blob, shard, SCHEMA, config, part_format=ARROW_ROWS)
    table = pa.table({"id": ids, "v": [str(i) for i in ids]}, schema=SCHEMA)
    builder.add_inserts(table)
    return builder.finish()


def ids(client: PersistClient, shard: str, as_of: int) -> list[int]:
    return sorted(client.open_shard(shard).reader().snapshot_table(as_of).column("id").to_pylist())


def blob_keys(client: PersistClient) -> set[str]:
    return {m.key for m in client.blob.list_keys("") if "/rollup" not in m.key}


def test_staged_batches_land_with_the_rest_at_one_time(client: PersistClient) -> None:
    a, b = "a" + uuid.uuid4().hex[:8], "b" + uuid.uuid4().hex[:8]
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    before = blob_keys(client)
    with client.txn(writer_id="etl", token=3) as t:
        t.append_staged(a, [stage(client, a, [1, 2]), stage(client, a, [3], inline=True)])
        t.append_staged(b, [stage(client, b, [4])])
        t.append(b, pa.table({"id": [5], "v": ["5"]}, schema=SCHEMA))
    at = t.commit_time
    assert at is not None
    assert ids(client, a, at) == [1, 2, 3] and ids(client, b, at) == [4, 5]
    assert ids(client, a, at - 1) == [] and ids(client, b, at - 1) == []
    landed = blob_keys(client) - before
    # A resend stages again (as a replayed micro-batch's tasks do): it lands nothing and its
    # parts are deleted.
    again = client.txn(writer_id="etl", token=3)
    again.append_staged(a, [stage(client, a, [1, 2])])
    again.append_staged(b, [stage(client, b, [4])])
    assert again.commit() == at and again.already_committed
    assert ids(client, a, at) == [1, 2, 3] and blob_keys(client) - before == landed


def test_an_exception_deletes_the_staged_batches(client: PersistClient) -> None:
    a, b = "a" + uuid.uuid4().hex[:8], "b" + uuid.uuid4().hex[:8]
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    before = blob_keys(client)
    seqnos = [client.open_shard(s).state().seqno for s in (a, b)]
    with pytest.raises(RuntimeError, match="boom"), client.txn(writer_id="etl", token=1) as t:
        t.append_staged(a, [stage(client, a, [1])])
        t.append_staged(b, [stage(client, b, [2])])
        raise RuntimeError("boom")
    assert [client.open_shard(s).state().seqno for s in (a, b)] == seqnos
    assert blob_keys(client) == before


def test_a_keyed_shard_takes_no_staged_batch(client: PersistClient) -> None:
    k = "k" + uuid.uuid4().hex[:8]
    client.open_shard(k, SCHEMA, keys=["id"])
    before = blob_keys(client)
    t = client.txn(writer_id="etl", token=1)
    with pytest.raises(InvalidUsage, match="keyed by"):
        t.append_staged(k, [stage(client, k, [1])])
    assert blob_keys(client) == before


def test_inline_batches_go_to_blob_when_state_is_full(client: PersistClient) -> None:
    """Parts staged inline elsewhere (tiny Spark tasks) ride in state only within its inline
    cap; past it they are written to Blob before the commit references them."""
    tag = uuid.uuid4().hex
    config = PersistConfig(inline_write_max_bytes=16, inline_total_max_bytes=64, maintenance=False)
    small = PersistClient(client.blob, client.consensus, config=config)
    a = "a" + tag[:8]
    small.open_shard(a, SCHEMA)
    batch = stage(small, a, list(range(50)), inline=True)
    assert all(p.inline is not None for p in batch.parts) and batch.size_bytes > 64
    with small.txn(writer_id="etl", token=1) as t:
        t.append_staged(a, [batch])
    state = small.open_shard(a).state()
    assert state.inline_bytes == 0 and ids(small, a, t.commit_time) == list(range(50))
