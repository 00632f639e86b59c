"""Transactions across shards (``client.txn``): every shard changes at one time or none does.

Run on mem, SQLite and (marker ``postgres``) PostgreSQL Consensus. What a user checks: the
rows in each shard, read as of the transaction's time and just before it; the shard's
history; what is left in Blob after a failure; and the answer a resend gets.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import (
    CaSManyMismatch,
    CaSManyResult,
    CaSOp,
    Consensus,
    open_consensus,
)
from pyspark_persist.state.drop import drop_shard
from pyspark_persist.state.errors import (
    Indeterminate,
    InvalidUpdates,
    InvalidUsage,
    SchemaMismatch,
    ShardDropped,
    StoreUnavailable,
)
from pyspark_persist.state.machine import NoopPublisher
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string())])
SMALL_INLINE = PersistConfig(inline_write_max_bytes=16, maintenance=False)
"""Every part goes to Blob, so what a failed transaction leaves there can be seen."""


def rows(ids: Sequence[int], tag: str = "x") -> pa.Table:
    return pa.table({"id": list(ids), "v": [f"{tag}{i}" for i in ids]}, schema=SCHEMA)


class Hooked(UnreliableConsensus):
    """A Consensus that runs ``before_many`` ahead of each compare_and_set_many (once each,
    popped), or loses a reply without applying (``lose_unapplied``), and logs the results."""

    def __init__(self, inner: Consensus, faults: Faults | None = None) -> None:
        super().__init__(inner, faults or Faults(seed=0), enabled=faults is not None)
        self.before_many: list[object] = []
        self.lose_unapplied = 0
        self.results: list[CaSManyResult] = []

    def compare_and_set_many(self, ops: Sequence[CaSOp]) -> CaSManyResult:
        if self.before_many:
            hook = self.before_many.pop(0)
            assert callable(hook)
            hook()
        if self.lose_unapplied:
            self.lose_unapplied -= 1
            raise Indeterminate("test: the request was lost before the store (not applied)")
        res = super().compare_and_set_many(ops)
        self.results.append(res)
        return res


@pytest.fixture(
    params=["mem", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
)
def uris(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """``(blob, consensus)`` URIs, fresh for the test."""
    tag = uuid.uuid4().hex
    if request.param == "mem":
        return f"mem://{tag}", f"mem://{tag}"
    blob = f"file://{tmp_path}/blob"
    if request.param == "sqlite":
        return blob, f"sqlite:///{tmp_path}/consensus.db"
    url: str = request.getfixturevalue("postgres_url")
    return blob, url


@pytest.fixture
def hooked(uris: tuple[str, str]) -> Iterator[tuple[PersistClient, Hooked]]:
    """A client whose Consensus is :class:`Hooked`, every part in Blob."""
    consensus = Hooked(open_consensus(uris[1]))
    client = PersistClient(open_blob(uris[0]), consensus, config=SMALL_INLINE)
    yield client, consensus
    client.close()


def names(n: int) -> list[str]:
    return [f"t{uuid.uuid4().hex[:12]}" for _ in range(n)]


def ids_at(client: PersistClient, shard: str, as_of: int | None = None) -> list[int]:
    handle = client.open_shard(shard)
    if handle.upper == 0 or as_of is not None and as_of < 0:
        return []
    table = handle.reader().snapshot_table(as_of)
    out: list[int] = []
    for i, d in zip(table.column("id").to_pylist(), table.column("_diff").to_pylist(), strict=True):
        out.extend([i] * d)
    return sorted(out)


def staged_keys(client: PersistClient) -> set[str]:
    return {m.key for m in client.blob.list_keys("") if "/rollup" not in m.key}


def test_lands_in_every_shard_at_one_time(hooked: tuple[PersistClient, Hooked]) -> None:
    """Two plain shards and a keyed one change at one time T: as of T every shard shows the
    transaction, as of T - 1 none does; each history names the transaction; a shard that
    took no part kept its SeqNo."""
    client, _ = hooked
    a, b, k, other = names(4)
    for s in (a, b, other):
        client.open_shard(s, SCHEMA)
    client.open_shard(k, SCHEMA, keys=["id"])
    client.open_shard(k).writer().upsert(rows([7], "old"))
    client.open_shard(a).writer().append(rows([0]))
    other_seqno = client.open_shard(other).state().seqno
    with client.txn(writer_id="etl", token=1) as t:
        t.append(a, rows([1, 2]))
        t.append(b, rows([3]))
        t.upsert(k, rows([7, 8], "new"))
    time = t.commit_time
    assert time is not None
    for s in (a, b, k):
        assert client.open_shard(s).upper == time + 1
    assert ids_at(client, a, time) == [0, 1, 2] and ids_at(client, a, time - 1) == [0]
    assert ids_at(client, b, time) == [3] and ids_at(client, b, time - 1) == []
    keyed = client.open_shard(k).reader().snapshot_table(time).to_pylist()
    assert sorted((r["id"], r["v"]) for r in keyed) == [(7, "new7"), (8, "new8")]
    for s in (a, b, k):
        last = client.open_shard(s).history()[-1]
        assert (last.txn_id, last.writer_id) == (t.txn_id, "etl")
    assert client.open_shard(other).state().seqno == other_seqno


def test_resend_applies_nothing(hooked: tuple[PersistClient, Hooked]) -> None:
    """The same writer id and token again (a new Txn, other data even) lands nothing, and
    learns the first commit's time."""
    client, _ = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    first = client.txn(writer_id="etl", token=5)
    first.append(a, rows([1]))
    first.append(b, rows([2]))
    time = first.commit()
    again = client.txn(writer_id="etl", token=5)
    again.append(a, rows([1]))
    again.append(b, rows([2]))
    before = staged_keys(client)
    assert again.commit() == time and again.already_committed
    assert ids_at(client, a) == [1] and ids_at(client, b) == [2]
    assert staged_keys(client) == before  # the resend's staged parts are gone again


@pytest.mark.parametrize("landed", [True, False], ids=["reply-lost", "request-lost"])
def test_unknown_outcome_is_retried_and_applies_once(uris: tuple[str, str], landed: bool) -> None:
    """A compare_and_set_many whose reply is lost (it landed) or whose request is lost (it did
    not) is retried with the same token: each shard holds the rows exactly once either way,
    and nothing staged is left unreferenced."""
    faults = Faults(seed=1, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set_many"}))
    consensus = Hooked(open_consensus(uris[1]), faults if landed else None)
    if not landed:
        consensus.lose_unapplied = 1
    client = PersistClient(open_blob(uris[0]), consensus, config=SMALL_INLINE)
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    t = client.txn(writer_id="etl", token=3)
    t.append(a, rows([1, 2]))
    t.append(b, rows([3]))
    time = t.commit()
    assert time is not None and t.already_committed == landed
    assert ids_at(client, a) == [1, 2] and ids_at(client, b) == [3]
    referenced = {
        p.key for s in (a, b) for batch in client.open_shard(s).state().trace for p in batch.parts
    }
    assert staged_keys(client) == referenced
    client.close()


def test_a_moved_shard_lands_nothing_then_the_retry_is_serial(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """A plain append to one participant between the transaction's read and its commit fails
    the whole compare-and-set (the other shard unchanged, the mismatch naming the moved one);
    the retry lands after the append, in both shards at one time."""
    client, consensus = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    rival = PersistClient(open_blob(client.blob.uri), open_consensus(client.consensus.uri))
    seen: dict[str, int] = {}

    def race() -> None:
        seen["a"] = client.consensus.head(a).seqno  # type: ignore[union-attr]
        rival.open_shard(b).writer().append(rows([99], "rival"))

    consensus.before_many.append(race)
    t = client.txn(writer_id="etl", token=1)
    t.append(a, rows([1]))
    t.append(b, rows([2]))
    time = t.commit()
    first = consensus.results[0]
    assert isinstance(first, CaSManyMismatch) and set(first.moved) == {b}
    assert time is not None
    assert ids_at(client, b, time - 1) == [99] and ids_at(client, b, time) == [2, 99]
    assert ids_at(client, a, time - 1) == [] and ids_at(client, a, time) == [1]
    rival.close()


def test_keyed_share_is_planned_again_when_its_shard_moved(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """A rival upsert of the same key lands first: the transaction's upsert is planned again
    against it, so the key still has exactly one row (the transaction's, the later write)."""
    client, consensus = hooked
    a, k = names(2)
    client.open_shard(a, SCHEMA)
    client.open_shard(k, SCHEMA, keys=["id"]).writer().upsert(rows([1], "v0-"))
    rival = PersistClient(open_blob(client.blob.uri), open_consensus(client.consensus.uri))
    consensus.before_many.append(
        lambda: rival.open_shard(k).writer().upsert(rows([1, 2], "rival-"))
    )
    with client.txn(writer_id="etl", token=1) as t:
        t.append(a, rows([5]))
        t.upsert(k, rows([1], "txn-"))
    table = client.open_shard(k).reader().snapshot_table()
    assert sorted((r["id"], r["v"], r["_diff"]) for r in table.to_pylist()) == [
        (1, "txn-1", 1),
        (2, "rival-2", 1),
    ]
    rival.close()


def test_exception_in_the_block_commits_and_stages_nothing(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    client, _ = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    before = staged_keys(client)
    seqnos = [client.open_shard(s).state().seqno for s in (a, b)]
    with pytest.raises(RuntimeError, match="boom"), client.txn(writer_id="etl", token=1) as t:
        t.append(a, rows(range(100)))
        t.append(b, rows(range(100)))
        raise RuntimeError("boom")
    assert [client.open_shard(s).state().seqno for s in (a, b)] == seqnos
    assert staged_keys(client) == before
    with pytest.raises(InvalidUsage, match="already committed or failed"):
        t.commit()


def test_bad_rows_raise_at_the_call_before_anything_is_staged(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """Schema and keys are checked by append/upsert themselves; nothing is staged, and the
    shard whose rows were refused does not join the transaction."""
    client, _ = hooked
    a, k = names(2)
    client.open_shard(a, SCHEMA)
    client.open_shard(k, SCHEMA, keys=["id"])
    before = staged_keys(client)
    t = client.txn(writer_id="etl", token=1)
    with pytest.raises(SchemaMismatch):
        t.append(a, pa.table({"id": ["not an int"], "v": ["x"]}))
    with pytest.raises(InvalidUpdates):
        t.append(a, rows([1]).append_column("_time", pa.array([5], pa.uint64())))
    with pytest.raises(InvalidUsage, match="needs a keyed shard"):
        t.upsert(a, rows([1]))
    with pytest.raises(InvalidUpdates, match="id"):
        t.upsert(k, pa.table({"v": ["no key"]}))
    t.upsert(k, rows([1]))
    with pytest.raises(InvalidUsage, match="one upsert"):
        t.upsert(k, rows([2]))
    assert staged_keys(client) == before
    t.commit()
    assert client.open_shard(a).upper == 0  # refused rows: shard a never joined


def test_dropping_a_member_fails_the_transaction_clearly(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """A member dropped between the transaction's first look and its commit: ShardDropped,
    nothing lands in the other member, and the parts staged for both are deleted."""
    client, consensus = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    a_seqno = client.open_shard(a).state().seqno
    before = staged_keys(client)
    t = client.txn(writer_id="etl", token=1)
    t.append(a, rows([1]))
    t.append(b, rows([2]))
    consensus.before_many.append(
        lambda: drop_shard(client.consensus, client.blob, b, now_ms=time.time_ns() // 10**6)
    )
    with pytest.raises(ShardDropped, match=b):
        t.commit()
    assert client.open_shard(a).state().seqno == a_seqno
    assert {k for k in staged_keys(client) if k.startswith(f"{a}/")} == {
        k for k in before if k.startswith(f"{a}/")
    }


def test_a_token_spent_outside_the_transaction_is_refused(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """Writer "etl" committed token 4 to one shard alone: a transaction with token 4 over that
    shard and another cannot be all-or-nothing, so it is refused and lands nowhere."""
    client, _ = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    client.open_shard(a).writer("etl").append(rows([1]), token=4)
    t = client.txn(writer_id="etl", token=4)
    t.append(a, rows([2]))
    t.append(b, rows([3]))
    with pytest.raises(InvalidUsage, match=f"already committed token 4.*{a}"):
        t.commit()
    assert ids_at(client, a) == [1] and ids_at(client, b) == []


def test_concurrent_transactions_and_appends_read_as_a_serial_history(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """Threads run transactions over (a, b) and (b, c) and plain appends to a and c, each
    with its own client. Afterwards every write is in its shards exactly once, and as of every
    transaction's time each of its shards holds it while as of the time before none does."""
    client, _ = hooked
    shards = names(3)
    for s in shards:
        client.open_shard(s, SCHEMA)
    per_thread = 8
    commits: dict[int, tuple[int, tuple[str, ...]]] = {}
    lock = threading.Lock()

    def work(n: int) -> None:
        mine = PersistClient(open_blob(client.blob.uri), open_consensus(client.consensus.uri))
        try:
            for i in range(per_thread):
                op = n * 1000 + i
                if n < 2:
                    pair = (shards[0], shards[1]) if n == 0 else (shards[1], shards[2])
                    t = mine.txn(writer_id=f"w{n}", token=i)
                    for s in pair:
                        t.append(s, rows([op]))
                    time = t.commit()
                    assert time is not None
                    with lock:
                        commits[op] = (time, pair)
                else:
                    target = shards[0] if n == 2 else shards[2]
                    mine.open_shard(target).writer().append(rows([op]))
        finally:
            mine.close()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    final = {s: ids_at(client, s) for s in shards}
    assert final[shards[0]] == sorted([*range(0, per_thread), *range(2000, 2000 + per_thread)])
    assert final[shards[1]] == sorted([*range(0, per_thread), *range(1000, 1000 + per_thread)])
    assert final[shards[2]] == sorted([*range(1000, 1000 + per_thread), *range(3000, 3008)])
    for op, (at, pair) in commits.items():
        for s in pair:
            assert op in ids_at(client, s, at) and op not in ids_at(client, s, at - 1)


def test_without_a_token_each_thread_keeps_one_writer_entry(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """Tokenless transactions all land, each once, and a shard's writers map grows by one
    entry per committing thread, not one per transaction."""
    client, _ = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)

    def commit_some(start: int) -> None:
        for i in range(start, start + 5):
            with client.txn(writer_id="loader") as t:
                t.append(a, rows([i]))
                t.append(b, rows([i]))

    commit_some(0)
    thread = threading.Thread(target=commit_some, args=(100,))
    thread.start()
    thread.join()
    expected = [*range(5), *range(100, 105)]
    assert ids_at(client, a) == expected and ids_at(client, b) == expected
    for s in (a, b):
        writers = client.open_shard(s).state().writers
        assert len(writers) == 2 and all(w.startswith("loader.auto-") for w in writers)


def test_compaction_retention_and_gc_keep_transactions_whole(uris: tuple[str, str]) -> None:
    """With a retention period (since follows the clock), many small transactions are
    compacted and collected like plain writes: afterwards every shard reads
    each transaction once, a reader as of any time it may still read sees the same ones in
    every shard, and GC leaves no staged part of theirs behind."""
    # Maintenance run by hand (not in the background, where it could replace batches after
    # the GC below), on every shard.
    config = PersistConfig(inline_write_max_bytes=16, compaction_fan_in=2, maintenance=False)
    client = PersistClient(open_blob(uris[0]), open_consensus(uris[1]), config=config)
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA, retention_ms=1)
    for i in range(40):
        with client.txn(writer_id="etl", token=i) as t:
            t.append(a, rows([i]))
            t.append(b, rows([i]))
    for s in (a, b):
        shard = client.open_shard(s)
        shard.compact()
        shard.gc()
        assert len(shard.state().trace) < 40  # compaction merged the transactions' batches
    assert ids_at(client, a) == ids_at(client, b) == list(range(40))
    since = max(client.open_shard(s).since for s in (a, b))
    upper = client.open_shard(a).upper
    for at in range(since, upper, max(1, (upper - since) // 5)):
        assert ids_at(client, a, at) == ids_at(client, b, at)
    referenced = {
        p.key for s in (a, b) for batch in client.open_shard(s).state().trace for p in batch.parts
    }
    assert {k for k in staged_keys(client) if "/rollup" not in k} == referenced
    client.close()


def test_a_sure_failure_after_a_lost_request_is_reported_unknown(
    hooked: tuple[PersistClient, Hooked],
) -> None:
    """A commit attempt lost (it might have landed), then the store refuses for good: the
    commit raises Indeterminate, not the refusal (which would claim nothing happened), and a
    resend with the same token commits once."""
    client, consensus = hooked
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    consensus.lose_unapplied = 1

    def refuse() -> None:
        raise StoreUnavailable("test: permission denied", transient=False)

    consensus.before_many += [lambda: None, refuse]
    t = client.txn(writer_id="etl", token=1)
    t.append(a, rows([1]))
    t.append(b, rows([2]))
    with pytest.raises(Indeterminate, match="Resend it with the same writer id and token"):
        t.commit()
    again = client.txn(writer_id="etl", token=1)
    again.append(a, rows([1]))
    again.append(b, rows([2]))
    assert again.commit() is not None and not again.already_committed
    assert ids_at(client, a) == [1] and ids_at(client, b) == [2]


def test_resend_after_a_lost_reply_reads_stale_cached_states_again(uris: tuple[str, str]) -> None:
    """A commit's reply is lost (it landed) and the caller resends with the same token while
    the client's cached state of one participant is fresh and another's is from before the
    commit: the resend reads them again and learns the first commit's time, instead of
    refusing the token as spent outside the transaction (the checker's ``txns`` piece found
    this)."""
    faults = Faults(seed=1, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set_many"}))
    consensus = Hooked(open_consensus(uris[1]), faults)
    config = PersistConfig(retry_timeout_s=1e-9, maintenance=False)
    client = PersistClient(open_blob(uris[0]), consensus, config=config)
    a, b = names(2)
    for s in (a, b):
        client.open_shard(s, SCHEMA)
    first = client.txn(writer_id="etl", token=4)
    first.append(a, rows([1]))
    first.append(b, rows([2]))
    with pytest.raises(Indeterminate):
        first.commit()
    client.open_shard(a).writer().fetch_upper()  # a's cached state now holds the token
    again = client.txn(writer_id="etl", token=4)
    again.append(a, rows([1]))
    again.append(b, rows([2]))
    time = again.commit()
    assert again.already_committed and time == client.open_shard(b).upper - 1
    assert ids_at(client, a) == [1] and ids_at(client, b) == [2]
    client.close()


class RecordingPublisher(NoopPublisher):
    """A publisher that notes each push, in order, in a shared event list."""

    def __init__(self, events: list[tuple[str, str]]) -> None:
        self.events = events

    def push(self, shard_id: str, seqno: int) -> None:
        self.events.append(("push", shard_id))


def test_every_shard_is_announced_before_any_rollup_or_maintenance(uris: tuple[str, str]) -> None:
    """A reader of the transaction's last shard hears of the commit (its PubSub push) before
    the first shard's follow-up work (a due rollup, telling maintenance) runs, so it never
    waits on that work."""
    events: list[tuple[str, str]] = []
    client = PersistClient(
        open_blob(uris[0]),
        open_consensus(uris[1]),
        config=SMALL_INLINE,
        publisher=RecordingPublisher(events),
    )
    try:
        a, b = names(2)
        for shard in (a, b):
            client.open_shard(shard, SCHEMA).writer().append(rows([0]))
            client.machine(shard).on_commit = lambda m, after, before: events.append(
                ("follow-up", m.shard_id)
            )
        events.clear()
        with client.txn() as t:
            t.append(a, rows([1]))
            t.append(b, rows([2]))
        assert events == [("push", a), ("push", b), ("follow-up", a), ("follow-up", b)]
        assert ids_at(client, b) == [0, 2]
    finally:
        client.close()
