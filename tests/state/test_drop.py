"""Dropping a shard: everything deleted, nothing while readers hold it, safe under races; and
a handle of a dropped shard never touches the shard created again under its name.

Runs on every backend pair (``client`` fixture). The race and crash tests
inject their fault at a named step (a wrapper whose call fails), so they are
deterministic.
"""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig, encode_schema
from pyspark_persist.state.blob import Blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import VersionedData
from pyspark_persist.state.diff import FENCE, TOMBSTONE, DiffBuilder, encode
from pyspark_persist.state.drop import drop_shard, holders
from pyspark_persist.state.errors import (
    ShardDropped,
    ShardExists,
    ShardInUse,
    ShardNotFound,
    StoreUnavailable,
)
from pyspark_persist.state.state import EMPTY_STATE
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus

SCHEMA = pa.schema([("id", pa.int64())])
QUIET = PersistConfig(maintenance=False)
"""No background compaction or GC: the tests count SeqNos."""


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
    return PersistClient(client.blob, client.consensus, config=QUIET, cache=StateCache())


def stored(client: PersistClient, name: str) -> tuple[int, int]:
    """(Consensus rows, Blob objects) of shard ``name``."""
    return len(client.consensus.scan(name, 0)), len(list(client.blob.list_keys(f"{name}/")))


def assert_dropped(client: PersistClient, name: str) -> None:
    """Nothing of shard ``name`` is left but the tombstone, and no listing shows it."""
    assert [r.data for r in client.consensus.scan(name, 0)] == [TOMBSTONE]
    assert list(client.blob.list_keys(f"{name}/")) == []
    assert name not in client.list_shards()


def ids_of(client: PersistClient, name: str) -> list[int]:
    """The ids in shard ``name`` now, read by a process that never saw it before."""
    with reopened(client).open_shard(name).reader() as reader:
        return sorted(reader.snapshot_table().column("id").to_pylist())


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
    assert_dropped(client, shard_name)
    assert stored(client, other)[1] > 0  # a shard whose name extends it is untouched
    with pytest.raises(ShardNotFound):
        reopened(client).open_shard(shard_name)
    fresh = reopened(client).open_shard(shard_name, SCHEMA)
    # Created on the tombstone (the fence's SeqNo + 1): its SeqNos go on from the dropped one's.
    assert fresh.state().seqno == report.seqno + 2 and fresh.upper == 0
    assert shard_name in client.list_shards()


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
    assert report.readers == ("crit",)
    assert_dropped(client, shard_name)


def test_an_expired_lease_does_not_hold_the_shard(client: PersistClient, shard_name: str) -> None:
    populate(client, shard_name, writes=1)
    client.open_shard(shard_name).reader("gone")
    later = now_ms() + int(client.config.reader_lease_s * 1000) + 1000
    assert holders(client.open_shard(shard_name).state(), later) == ()
    drop_shard(client.consensus, client.blob, shard_name, now_ms=later)
    assert_dropped(client, shard_name)


def test_a_writer_racing_the_drop_commits_nothing(client: PersistClient, shard_name: str) -> None:
    """A writer that opened the shard before the drop fails on its next commit; nothing lands."""
    populate(client, shard_name, writes=1)
    racer = PersistClient(client.blob, client.consensus, config=QUIET)
    writer = racer.open_shard(shard_name).writer("late")
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    with pytest.raises(ShardDropped, match=f"shard {shard_name!r} .*was dropped"):
        writer.append(pa.table({"id": [1]}))
    assert_dropped(client, shard_name)


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
    assert head is not None and head.data == FENCE
    with pytest.raises(ShardNotFound):
        reopened(client).open_shard(shard_name)
    with pytest.raises(ShardNotFound, match="being dropped"):  # the name stays taken
        reopened(client).open_shard(shard_name, SCHEMA)
    report = drop_shard(client.consensus, flaky, shard_name, now_ms=now_ms())
    assert report.seqno == head.seqno
    assert_dropped(client, shard_name)


def test_a_drop_in_progress_reads_as_dropped_after_its_blob_step(
    client: PersistClient, shard_name: str
) -> None:
    """Steps 1 and 2 of a drop done (the fence; Blob emptied, rollups too), the tombstone
    not yet: a process opening the shard learns it is being dropped, and a handle opened
    before gets ShardDropped. Before, a shard whose history starts at a rollup (GC truncated
    Consensus below it) looked ten times for that rollup, deleted by step 2, and failed
    with CorruptData (found by persist check's drop fault kind)."""
    populate(client, shard_name, writes=4)
    shard = client.open_shard(shard_name)
    writer = shard.writer("w")
    shard.gc()
    rows = client.consensus.scan(shard_name, 0)
    assert rows[0].seqno > 1  # the history starts at a rollup
    fence = VersionedData(rows[-1].seqno + 1, FENCE)
    client.consensus.compare_and_set(shard_name, rows[-1].seqno, fence)
    for meta in list(client.blob.list_keys(f"{shard_name}/")):
        client.blob.delete(meta.key)
    with pytest.raises(ShardNotFound):
        reopened(client).open_shard(shard_name)
    with pytest.raises(ShardNotFound, match="being dropped"):  # the name stays taken
        reopened(client).open_shard(shard_name, SCHEMA)
    with pytest.raises(ShardDropped):
        writer.fetch_upper()


def test_a_drop_that_died_before_truncating_reads_as_dropped_and_the_name_is_free(
    client: PersistClient, shard_name: str
) -> None:
    """The tombstone landed, the truncation below it failed: the shard is gone all the same
    (the rows left under the tombstone are never read), a rerun of the drop deletes them,
    and the name can be used again."""
    populate(client, shard_name, writes=2)
    flaky = UnreliableConsensus(
        client.consensus, Faults(seed=0, fail_before=1.0, max_faults=1, ops=frozenset({"truncate"}))
    )
    with pytest.raises(StoreUnavailable):
        drop_shard(flaky, client.blob, shard_name, now_ms=now_ms())
    rows = client.consensus.scan(shard_name, 0)
    assert rows[-1].data == TOMBSTONE and len(rows) > 2
    assert shard_name not in client.list_shards()
    with pytest.raises(ShardNotFound):
        reopened(client).open_shard(shard_name)
    with pytest.raises(ShardNotFound, match="was dropped"):
        drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    assert_dropped(client, shard_name)
    fresh = reopened(client).open_shard(shard_name, SCHEMA)
    fresh.writer().append(pa.table({"id": [5]}))
    assert ids_of(client, shard_name) == [5]


def test_dropping_a_missing_shard_is_shard_not_found(client: PersistClient) -> None:
    with pytest.raises(ShardNotFound, match="does not exist"):
        drop_shard(client.consensus, client.blob, "never-created", now_ms=now_ms())


def test_a_process_that_opens_the_name_again_after_a_drop_sees_the_new_shard_exactly(
    client: PersistClient, shard_name: str
) -> None:
    """Another process (its own cache) held the shard when it was dropped and created again
    under its name, with another schema. Opening the name again there gives the new shard
    alone (schema, rows), and its writes land in it; the handle it held before stays the
    dropped shard's and fails."""
    holder = reopened(client)
    old = holder.open_shard(shard_name, SCHEMA)
    for i in range(3):
        old.writer().append(pa.table({"id": [i]}))
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    schema = pa.schema([("id", pa.int64()), ("v", pa.string())])
    new = client.open_shard(shard_name, schema)
    new.writer().append(pa.table({"id": [100], "v": ["new"]}, schema=schema))

    seen = holder.open_shard(shard_name)
    assert seen.schema.equals(schema)
    assert seen.state().seqno == new.state().seqno
    assert seen.reader().snapshot_table().column("id").to_pylist() == [100]
    seen.writer().append(pa.table({"id": [7], "v": ["held"]}, schema=schema))
    assert ids_of(client, shard_name) == [7, 100]
    with pytest.raises(ShardDropped):
        old.state()


def test_a_process_holding_a_dropped_shard_finds_it_gone_then_creates_it_anew(
    client: PersistClient, shard_name: str
) -> None:
    """The holder of a dropped shard's state is told it is gone (not served its cache), and
    its create makes a new, empty shard."""
    holder = reopened(client)
    old = holder.open_shard(shard_name, SCHEMA)
    for i in range(3):
        old.writer().append(pa.table({"id": [i]}))
    dropped_at = old.state().seqno
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    with pytest.raises(ShardNotFound, match="pass a schema"):
        holder.open_shard(shard_name)
    created = holder.open_shard(shard_name, SCHEMA)
    state = created.state()
    assert (state.upper, dict(state.batches)) == (0, {}) and state.seqno > dropped_at
    assert state.incarnation != old.machine.incarnation


# --- a handle of a dropped shard never touches the shard created again under its name ----------
#
# "other-process": the stale handle's client has a cache of its own; "same-client": the client
# that holds it also drops the shard and creates it again; "other-client": another client of
# the same process (they share the process's cached state).

HOLDERS = ["other-process", "same-client", "other-client"]


def holder_and_creator(client: PersistClient, where: str) -> tuple[PersistClient, PersistClient]:
    """The client holding the old handle and the client creating the shard again."""
    creator = PersistClient(client.blob, client.consensus, config=QUIET)
    if where == "other-process":
        return reopened(client), creator
    if where == "same-client":
        return creator, creator
    return PersistClient(client.blob, client.consensus, config=QUIET), creator


@pytest.mark.parametrize("where", HOLDERS)
@pytest.mark.parametrize("head", [-1, 0, 2], ids=["new-head-behind", "same-seqno", "ahead"])
def test_writer_opened_before_drop_never_commits_into_recreated_shard(
    client: PersistClient, shard_name: str, where: str, head: int
) -> None:
    """A writer handle of the dropped shard gets ShardDropped, and the new shard has exactly
    its own rows and stays readable.

    Before the fix a drop deleted every Consensus row, so the new shard started again at
    SeqNo 1 and the stale handle's compare-and-set (matched on SeqNo alone) landed in it
    once its head reached the handle's SeqNo (``same-seqno``): the old shard's diff went
    onto the new one's log, the writer got Committed and every read failed; with the new
    head elsewhere the handle reloaded and appended its rows to the new shard. Now the drop
    leaves a tombstone the new shard is created on (its SeqNos never repeat the old ones),
    and the handle is bound to the incarnation it opened. ``head`` is how far past the
    stale SeqNo the test commits the new shard's head (on the old code: -1, 0 or +2; now
    the new shard starts past it whatever is committed)."""
    holder, creator = holder_and_creator(client, where)
    old = holder.open_shard(shard_name, SCHEMA)
    stale = old.writer("stale")
    for i in range(3):
        stale.append(pa.table({"id": [i]}))
    stale_seqno = old.state().seqno
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())

    new = creator.open_shard(shard_name, SCHEMA)
    writer = new.writer("new")
    written = []
    while not written or new.state().seqno < stale_seqno + head:
        written.append(100 + len(written))
        writer.append(pa.table({"id": [written[-1]]}))

    with pytest.raises(ShardDropped, match=f"{shard_name!r}.*Open the shard again"):
        stale.append(pa.table({"id": [666]}))
    with pytest.raises(ShardDropped):
        old.writer("another").append(pa.table({"id": [667]}))
    assert ids_of(client, shard_name) == written
    assert "stale" not in new.state().writers
    assert new.state().seqno > stale_seqno  # the new shard's SeqNos are past the old ones
    # Opening the name again (in the holder's process too) gives the new shard.
    holder.open_shard(shard_name).writer("again").append(pa.table({"id": [7]}))
    assert ids_of(client, shard_name) == sorted([7, *written])


@pytest.mark.parametrize("where", HOLDERS)
def test_listen_opened_before_drop_ends_with_shard_dropped(
    client: PersistClient, shard_name: str, where: str
) -> None:
    """A listen of the dropped shard raises ShardDropped at its next call; before the fix it
    went on into the shard created again under the name, emitting that shard's rows as its
    continuation with no registration (no holds) there."""
    holder, creator = holder_and_creator(client, where)
    old = holder.open_shard(shard_name, SCHEMA)
    for i in range(5):
        old.writer().append(pa.table({"id": [i]}))
    reader = old.reader("listener")
    listen = reader.listen(old.upper - 1)
    assert listen.next(timeout_s=0) is None
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms(), force=True)
    new = creator.open_shard(shard_name, SCHEMA)
    for i in range(2):  # (on the old code the new shard's SeqNos stayed below the reader's)
        new.writer().append(pa.table({"id": [100 + i]}))

    # (The timeout only bounds the old code's wait; the listen finds out at its first poll.)
    with pytest.raises(ShardDropped, match=repr(shard_name)):
        listen.next(timeout_s=30)
    with pytest.raises(ShardDropped):
        listen.next(timeout_s=0)
    with pytest.raises(ShardDropped):
        reader.heartbeat()
    assert dict(new.state().leased_readers) == {}
    assert ids_of(client, shard_name) == [100, 101]


@pytest.mark.parametrize("where", HOLDERS)
def test_reader_and_leases_of_a_dropped_shard_get_shard_dropped_never_the_new_rows(
    client: PersistClient, shard_name: str, where: str
) -> None:
    """A leased reader opened before the drop: its snapshot, the parts of a snapshot it
    holds, its heartbeat, its leases and a critical reader of the old handle all raise
    ShardDropped; none of them reads or registers in the shard created again. Before the
    fix the reader's next snapshot returned the new shard's rows."""
    holder, creator = holder_and_creator(client, where)
    old = holder.open_shard(shard_name, SCHEMA)
    old.writer().append(pa.table({"id": list(range(2000))}))  # parts in Blob, not inline
    reader = old.reader("r-old")
    held = reader.snapshot()
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms(), force=True)
    new = creator.open_shard(shard_name, SCHEMA)
    new.writer().append(pa.table({"id": [5000, 5001]}))

    with pytest.raises(ShardDropped):
        reader.fetch(held.parts)  # its parts went with the drop: that is the error to see
    with pytest.raises(ShardDropped):
        reader.snapshot_table()
    with pytest.raises(ShardDropped):
        reader.heartbeat()
    with pytest.raises(ShardDropped):
        old.critical_reader("crit")
    with pytest.raises(ShardDropped):
        old.reader("r-late")
    state = new.state()
    assert (dict(state.leased_readers), dict(state.critical_readers)) == ({}, {})
    assert ids_of(client, shard_name) == [5000, 5001]


@pytest.mark.parametrize("fault", ["fail_after", "fail_before"])
def test_open_shard_create_retries_a_lost_reply(
    client: PersistClient, shard_name: str, fault: str
) -> None:
    """The creation's compare-and-set loses its reply (it landed) or fails before reaching
    the store: open_shard(create=True) retries it and returns the shard, where it raised
    Indeterminate (or StoreUnavailable) before although calling it again found the shard.
    create_shard likewise recognises its own creation by its incarnation id: no ShardExists."""
    for name, create in ((shard_name, "open_shard"), (shard_name + "c", "create_shard")):
        lossy = UnreliableConsensus(
            client.consensus,
            Faults(seed=0, max_faults=1, ops=frozenset({"compare_and_set"}), **{fault: 1.0}),
        )
        creator = PersistClient(client.blob, lossy, config=QUIET, cache=StateCache())
        shard = getattr(creator, create)(name, SCHEMA)
        assert lossy.injected[fault] == 1
        shard.writer().append(pa.table({"id": [1, 2]}))
        assert [r.seqno for r in client.consensus.scan(name, 0)] == [1, 2]  # created once
        assert ids_of(client, name) == [1, 2]
    with pytest.raises(ShardExists):
        reopened(client).create_shard(shard_name + "c", SCHEMA)


def test_a_shard_created_before_incarnations_loads_and_its_drop_fences_old_handles(
    client: PersistClient, shard_name: str
) -> None:
    """A shard whose creation diff has no incarnation id (created by an earlier version) is
    read and written as before, and its handles fail with ShardDropped once it is dropped
    and created again."""
    legacy = DiffBuilder(EMPTY_STATE).set(
        shard_id=shard_name, schema=encode_schema(SCHEMA), created_ms=1
    )
    client.consensus.compare_and_set(shard_name, None, VersionedData(1, encode(legacy.build())))
    holder = reopened(client)
    old = holder.open_shard(shard_name, SCHEMA)
    assert old.state().incarnation == ""
    old.writer().append(pa.table({"id": [1]}))
    assert ids_of(client, shard_name) == [1]
    drop_shard(client.consensus, client.blob, shard_name, now_ms=now_ms())
    new = client.open_shard(shard_name, SCHEMA)
    assert new.state().incarnation != ""
    with pytest.raises(ShardDropped):
        old.writer().append(pa.table({"id": [2]}))
    assert new.upper == 0
