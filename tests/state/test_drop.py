"""Dropping a shard: everything deleted, nothing while readers hold it, safe under races.

Runs on every backend pair (``client`` fixture). The race and crash tests
inject their fault at a named step (a wrapper whose call fails), so they are
deterministic.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import Blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.diff import DROPPED
from pyspark_persist.state.drop import drop_shard, holders
from pyspark_persist.state.errors import ShardInUse, ShardNotFound, StoreUnavailable

SCHEMA = pa.schema([("id", pa.int64())])


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def populate(client: PersistClient, name: str, writes: int = 4) -> None:
    shard = client.open_shard(name, SCHEMA)
    writer = shard.writer("w")
    for i in range(writes):
        writer.append(pa.table({"id": list(range(i * 1000, i * 1000 + 2000))}))  # not inline
    shard.compact()


def reopened(client: PersistClient) -> PersistClient:
    """A client on the same stores with a cache of its own: another process's view."""
    return PersistClient(client.blob, client.consensus, cache=StateCache())


def stored(client: PersistClient, name: str) -> tuple[int, int]:
    """(Consensus rows, Blob objects) of shard ``name``."""
    return len(client.consensus.scan(name, 0)), len(list(client.blob.list_keys(f"{name}/")))


def test_drop_deletes_every_row_and_object_and_the_name_is_free_again(
    client: PersistClient, shard_name: str
) -> None:
    populate(client, shard_name)
    other = shard_name + "x"
    populate(client, other, writes=1)
    rows, objects = stored(client, shard_name)
    assert rows > 1 and objects > 0
    report = drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    assert (report.consensus_rows, report.blob_objects) == (rows + 1, objects)  # + the fence
    assert report.blob_bytes > 0 and report.readers == ()
    assert stored(client, shard_name) == (0, 0)
    assert shard_name not in client.list_shards()
    assert stored(client, other)[1] > 0  # a shard whose name extends it is untouched
    with pytest.raises(ShardNotFound):
        reopened(client).open_shard(shard_name)
    fresh = reopened(client).open_shard(shard_name, SCHEMA)
    assert fresh.state().seqno == 1 and fresh.upper == 0


def test_readers_holding_the_shard_block_the_drop_and_nothing_is_written(
    client: PersistClient, shard_name: str
) -> None:
    populate(client, shard_name, writes=1)
    shard = client.open_shard(shard_name, SCHEMA)
    reader = shard.reader("r1")
    shard.critical_reader("crit")
    before = client.consensus.scan(shard_name, 0)
    assert holders(shard.state(), now_ms()) == ("r1", "crit")
    with pytest.raises(ShardInUse, match="r1, crit"):
        drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    assert client.consensus.scan(shard_name, 0) == before
    reader.close()
    with pytest.raises(ShardInUse, match="crit"):
        drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    report = drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms(), force=True)
    assert report.readers == ("crit",) and stored(client, shard_name) == (0, 0)


def test_an_expired_lease_does_not_hold_the_shard(client: PersistClient, shard_name: str) -> None:
    populate(client, shard_name, writes=1)
    client.open_shard(shard_name).reader("gone")
    later = now_ms() + int(client.config.reader_lease_s * 1000) + 1000
    assert holders(client.open_shard(shard_name).state(), later) == ()
    drop_shard(client.consensus, client.blob, shard_name, now_ms=later)
    assert stored(client, shard_name) == (0, 0)


def test_a_writer_racing_the_drop_commits_nothing(client: PersistClient, shard_name: str) -> None:
    """A writer that opened the shard before the drop fails on its next commit; nothing lands."""
    populate(client, shard_name, writes=1)
    config = PersistConfig(maintenance=False)
    racer = PersistClient(client.blob, client.consensus, config=config)
    writer = racer.open_shard(shard_name).writer("late")
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    with pytest.raises(ShardNotFound):
        writer.append(pa.table({"id": [1]}))
    assert stored(client, shard_name) == (0, 0)


class _FailingDeletes(Blob):
    """A Blob whose batched delete fails once: a drop that dies after fencing."""

    def __init__(self, inner: Blob) -> None:
        self.inner, self.failed = inner, False

    @property
    def uri(self) -> str:
        return self.inner.uri

    def get(self, key: str) -> bytes | None:
        return self.inner.get(key)

    def set(self, key: str, value: bytes | bytearray | memoryview) -> None:
        self.inner.set(key, value)

    def delete(self, key: str) -> int | None:
        return self.inner.delete(key)

    def delete_many(self, keys: object) -> int:
        if not self.failed:
            self.failed = True
            raise StoreUnavailable("injected: the blob store went away mid-drop")
        return self.inner.delete_many(keys)  # type: ignore[arg-type]

    def list_keys(self, prefix: str = "") -> object:  # type: ignore[override]
        return self.inner.list_keys(prefix)


def test_a_drop_that_died_after_fencing_reads_as_dropped_and_finishes_when_rerun(
    client: PersistClient, shard_name: str
) -> None:
    populate(client, shard_name, writes=2)
    flaky = _FailingDeletes(client.blob)
    with pytest.raises(StoreUnavailable):
        drop_shard(client.consensus, flaky, shard_name, now_ms=now_ms())
    head = client.consensus.head(shard_name)
    assert head is not None and head.data == DROPPED
    with pytest.raises(ShardNotFound):
        reopened(client).open_shard(shard_name)
    with pytest.raises(ShardNotFound, match="being dropped"):  # the name stays taken
        reopened(client).open_shard(shard_name, SCHEMA)
    report = drop_shard(client.consensus, flaky, shard_name, now_ms=now_ms())
    assert report.seqno == head.seqno and stored(client, shard_name) == (0, 0)


def test_dropping_a_missing_shard_is_shard_not_found(client: PersistClient) -> None:
    with pytest.raises(ShardNotFound, match="does not exist"):
        drop_shard(client.consensus, client.blob, "never-created", now_ms=now_ms())


@pytest.mark.parametrize("new_writes", [1, 3, 6], ids=["behind", "same-seqno", "ahead"])
def test_a_process_holding_the_dropped_shard_sees_the_new_one_exactly(
    client: PersistClient, shard_name: str, new_writes: int
) -> None:
    """Another process (its own cache) held the shard at SeqNo 4 when it was dropped and
    created again under its name, with another schema and fewer, as many or more SeqNos:
    it then reads the new shard alone (schema, rows), never the old history continued with
    the new one's rows, and its writes land in the new shard."""
    holder = reopened(client)
    old = holder.open_shard(shard_name, SCHEMA)
    for i in range(3):
        old.writer().append(pa.table({"id": [i]}))
    assert old.state().seqno == 4
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    new = client.open_shard(shard_name, schema)
    for i in range(new_writes):
        new.writer().append(pa.table({"id": [100 + i], "v": ["new"]}, schema=schema))
    assert new.state().seqno == 1 + new_writes

    seen = holder.open_shard(shard_name)
    assert seen.schema.equals(schema)
    assert seen.state().seqno == new.state().seqno
    assert sorted(seen.reader().snapshot_table().column("id").to_pylist()) == [
        100 + i for i in range(new_writes)
    ]
    seen.writer().append(pa.table({"id": [7], "v": ["held"]}, schema=schema))
    ids = reopened(client).open_shard(shard_name).reader().snapshot_table().column("id")
    assert sorted(ids.to_pylist()) == sorted([7, *(100 + i for i in range(new_writes))])


def test_a_process_holding_a_dropped_shard_finds_it_gone_then_creates_it_anew(
    client: PersistClient, shard_name: str
) -> None:
    """The holder of a dropped shard's state is told it is gone (not served its cache), and
    its create makes a new, empty shard."""
    holder = reopened(client)
    old = holder.open_shard(shard_name, SCHEMA)
    for i in range(3):
        old.writer().append(pa.table({"id": [i]}))
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    with pytest.raises(ShardNotFound):
        holder.open_shard(shard_name)
    created = holder.open_shard(shard_name, SCHEMA)
    assert (created.state().seqno, created.upper, created.state().batches) == (1, 0, {})
