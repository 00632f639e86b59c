"""The shard API as a user sees it: create, write, snapshot, listen, reopen, failures.

Most tests take the ``client`` fixture and so run on every backend pair a user
deploys (mem/mem, file/sqlite, file/postgres, s3/postgres). Tests that need
one specific store (a ``mem://`` Consensus to plant garbage in, a dead
PostgreSQL port) build their own client.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import (
    DIFF,
    TIME,
    AlreadyCommitted,
    Committed,
    LeasedPart,
    PersistClient,
    PersistConfig,
    Shard,
    UpperMismatch,
    iter_parts,
)
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import CaSCommitted, VersionedData, open_consensus
from pyspark_persist.state.errors import (
    CorruptData,
    InvalidFrontier,
    InvalidUpdates,
    InvalidUri,
    InvalidUsage,
    PartNotFound,
    SchemaMismatch,
    ShardExists,
    ShardNotFound,
    StoreUnavailable,
)
from pyspark_persist.state.planning import ReadLimits
from pyspark_persist.state.read import iter_parts as read_iter_parts
from pyspark_persist.state.versions import rollup_key

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
BIG = 20_000
"""Rows in a write far too big to be kept inline in state, so it goes to Blob."""


def ids(n: int, start: int = 0) -> pa.Table:
    """``n`` rows ``(id, name)`` with consecutive ids from ``start``."""
    return pa.table(
        {
            "id": pa.array(range(start, start + n), pa.int64()),
            "name": pa.array([f"n{i}" for i in range(start, start + n)], pa.string()),
        }
    )


def at(rows: list[tuple[int, str]], time: int, diff: int = 1) -> pa.Table:
    """Updates of ``rows`` at ``time`` with multiplicity ``diff``."""
    return pa.table(
        {
            "id": pa.array([r[0] for r in rows], pa.int64()),
            "name": pa.array([r[1] for r in rows], pa.string()),
            TIME: pa.array([time] * len(rows), pa.uint64()),
            DIFF: pa.array([diff] * len(rows), pa.int64()),
        }
    )


def triples(table: pa.Table) -> list[tuple[Any, ...]]:
    """The updates of a table as sorted ``(id, name, _time, _diff)`` tuples."""
    cols = [table.column(n).to_pylist() for n in ("id", "name", TIME, DIFF)]
    return sorted(zip(*cols, strict=True))


def part_keys(client: PersistClient, shard: str) -> set[str]:
    """The part objects of ``shard`` in the client's Blob."""
    return {m.key for m in client.blob.list_keys(shard + "/part/")}


def mem_client(config: PersistConfig | None = None) -> tuple[PersistClient, str]:
    """A client on a fresh named ``mem://`` pair (returned with its tag, to reopen it)."""
    tag = uuid.uuid4().hex
    return PersistClient.open(f"mem://{tag}", f"mem://{tag}", config=config), tag


def fresh_client(location: tuple[str, str], config: PersistConfig | None = None) -> PersistClient:
    """A client on ``location`` with its own state cache: it must load state from the stores."""
    return PersistClient(
        open_blob(location[0]), open_consensus(location[1]), config=config, cache=StateCache()
    )


# --- create / open -------------------------------------------------------------------------


def test_open_creates_and_reopen_without_schema_gets_it(
    client: PersistClient, shard_name: str
) -> None:
    """open_shard with a schema creates the shard; reopening without one returns that schema."""
    shard = client.open_shard(shard_name, SCHEMA)
    assert shard.name == shard_name
    assert shard.schema.equals(SCHEMA)
    assert shard.upper == 0 and shard.since == 0
    again = client.open_shard(shard_name)
    assert again.schema.equals(SCHEMA)
    assert client.open_shard(shard_name, SCHEMA).schema.equals(SCHEMA)
    assert shard_name in client.list_shards()


def test_list_shards_lists_created(client: PersistClient, shard_name: str) -> None:
    """list_shards names every created shard (and not one that was only looked up)."""
    names = [f"{shard_name}-{i}" for i in range(3)]
    for n in names:
        client.create_shard(n, SCHEMA)
    with pytest.raises(ShardNotFound):
        client.open_shard(f"{shard_name}-missing")
    listed = client.list_shards()
    assert set(names) <= set(listed)
    assert f"{shard_name}-missing" not in listed
    assert listed == sorted(listed)


@pytest.mark.parametrize(
    ("other", "column"),
    [
        (pa.schema([("id", pa.int32()), ("name", pa.string())]), "id"),
        (pa.schema([("id", pa.int64())]), "name"),
        (pa.schema([("id", pa.int64()), ("name", pa.string()), ("extra", pa.bool_())]), "extra"),
    ],
    ids=["type", "missing", "extra"],
)
def test_open_with_different_schema_names_the_column(
    client: PersistClient, shard_name: str, other: pa.Schema, column: str
) -> None:
    """A schema that differs from the shard's is SchemaMismatch naming the differing column."""
    client.create_shard(shard_name, SCHEMA)
    with pytest.raises(SchemaMismatch, match=f"'{column}'"):
        client.open_shard(shard_name, other)


def test_nullability_mismatch_names_the_column() -> None:
    """A schema differing only in a column's nullability still says which column differs."""
    client, _ = mem_client()
    client.create_shard("s", SCHEMA)
    other = pa.schema([pa.field("id", pa.int64(), nullable=False), ("name", pa.string())])
    with pytest.raises(SchemaMismatch, match="'id'"):
        client.open_shard("s", other)


def test_create_existing_is_shard_exists(client: PersistClient, shard_name: str) -> None:
    """create_shard refuses a name that is taken, even with the same schema."""
    client.create_shard(shard_name, SCHEMA)
    with pytest.raises(ShardExists, match=shard_name):
        client.create_shard(shard_name, SCHEMA)


def test_open_unknown_without_schema_is_not_found(client: PersistClient, shard_name: str) -> None:
    """Opening a shard that does not exist without a schema names it; create=False too."""
    with pytest.raises(ShardNotFound, match=shard_name):
        client.open_shard(shard_name)
    with pytest.raises(ShardNotFound, match=shard_name):
        client.open_shard(shard_name, SCHEMA, create=False)
    assert shard_name not in client.list_shards()


@pytest.mark.parametrize("name", ["a/b", "..", "", "x" * 300, "a..b", "-x", "a b"])
def test_invalid_shard_names(name: str) -> None:
    """Names that could escape a Blob prefix or a key are refused before anything is written."""
    client, _ = mem_client()
    with pytest.raises(InvalidUsage, match="invalid shard name"):
        client.open_shard(name, SCHEMA)
    with pytest.raises(InvalidUsage):
        client.create_shard(name, SCHEMA)
    assert client.list_shards() == []


@pytest.mark.parametrize("reserved", [TIME, DIFF])
def test_reserved_column_names(reserved: str) -> None:
    """A schema may not use persist's own update columns."""
    client, _ = mem_client()
    schema = pa.schema([("id", pa.int64()), (reserved, pa.int64())])
    with pytest.raises(InvalidUsage, match=reserved):
        client.open_shard("s", schema)
    assert client.list_shards() == []


# --- compare_and_append ----------------------------------------------------------------


def test_compare_and_append_commits_and_rejects_wrong_upper(
    client: PersistClient, shard_name: str
) -> None:
    """Committed carries the new upper; a wrong expected upper writes nothing, not even parts."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    res = w.compare_and_append(ids(BIG), 0, 3)
    assert isinstance(res, Committed) and res.upper == 3
    assert shard.upper == 3 and w.fetch_upper() == 3
    before_snap = triples(shard.reader().snapshot_table())
    before_keys = part_keys(client, shard_name)
    assert len(before_keys) == 1

    res = w.compare_and_append(ids(BIG, start=BIG), 0, 5)
    assert res == UpperMismatch(current=3)
    assert shard.upper == 3
    assert triples(shard.reader().snapshot_table()) == before_snap
    assert part_keys(client, shard_name) == before_keys


@pytest.mark.parametrize(("expected", "new"), [(2, 2), (3, 2), (0, 0), (0, 2**64)])
def test_bad_frontier_is_refused_before_writing(
    client: PersistClient, shard_name: str, expected: int, new: int
) -> None:
    """new_upper must exceed expected_upper (and fit u64): refused before any part is staged."""
    shard = client.open_shard(shard_name, SCHEMA)
    with pytest.raises(InvalidFrontier, match="new_upper"):
        shard.writer().compare_and_append(ids(BIG), expected, new)
    assert part_keys(client, shard_name) == set()
    assert shard.upper == 0


@pytest.mark.parametrize("time", [0, 4, 5, 100])
def test_times_outside_batch_are_invalid(time: int) -> None:
    """Every update time must lie in [expected_upper, new_upper)."""
    client, _ = mem_client()
    shard = client.open_shard("s", SCHEMA)
    shard.writer().compare_and_append(ids(1), 0, 2)
    with pytest.raises(InvalidUpdates, match=r"\[2, 4\)"):
        shard.writer().compare_and_append(at([(1, "a")], time), 2, 4)
    assert shard.upper == 2


def test_times_outside_batch_leave_no_parts() -> None:
    """A write refused for out-of-range times leaves no orphan part objects in Blob."""
    client, _ = mem_client()
    shard = client.open_shard("s", SCHEMA)
    table = ids(BIG).append_column(TIME, pa.array([7] * BIG, pa.uint64()))
    with pytest.raises(InvalidUpdates):
        shard.writer().compare_and_append(table, 0, 5)
    assert part_keys(client, "s") == set()


def test_wrong_type_or_missing_column_is_schema_mismatch(
    client: PersistClient, shard_name: str
) -> None:
    """Updates must carry exactly the shard's columns with its types; the message names them."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    wrong_type = pa.table({"id": pa.array([1], pa.int32()), "name": ["a"]})
    with pytest.raises(SchemaMismatch, match="'id'"):
        w.compare_and_append(wrong_type, 0, 1)
    with pytest.raises(SchemaMismatch, match="'name'"):
        w.compare_and_append(pa.table({"id": pa.array([1], pa.int64())}), 0, 1)
    with pytest.raises(SchemaMismatch, match="'extra'"):
        w.compare_and_append(ids(1).append_column("extra", pa.array([1])), 0, 1)
    assert shard.upper == 0
    # Column order alone does not matter.
    res = w.compare_and_append(ids(2).select(["name", "id"]), 0, 1)
    assert isinstance(res, Committed)
    assert triples(shard.reader().snapshot_table()) == [(0, "n0", 0, 1), (1, "n1", 0, 1)]


def test_null_time_or_diff_is_invalid() -> None:
    """Every update needs a time and a multiplicity: nulls are InvalidUpdates."""
    client, _ = mem_client()
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer()
    null_time = ids(2).append_column(TIME, pa.array([0, None], pa.uint64()))
    with pytest.raises(InvalidUpdates, match=TIME):
        w.compare_and_append(null_time, 0, 1)
    null_diff = ids(2).append_column(DIFF, pa.array([1, None], pa.int64()))
    with pytest.raises(InvalidUpdates, match=DIFF):
        w.compare_and_append(null_diff, 0, 1)
    negative_time = ids(1).append_column(TIME, pa.array([-1], pa.int64()))
    with pytest.raises(InvalidUpdates, match=TIME):
        w.compare_and_append(negative_time, 0, 1)
    assert shard.upper == 0


@pytest.mark.parametrize("n", [1, 20_000], ids=["inline", "blob"])
def test_nulls_in_non_nullable_column_is_persist_error(n: int) -> None:
    """Nulls in a column the shard declares non-nullable are a persist error naming it."""
    client, _ = mem_client()
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False)])
    shard = client.open_shard("s", schema)
    table = pa.table({"id": pa.array([1, None] * n, pa.int64())})
    with pytest.raises((InvalidUpdates, SchemaMismatch), match="'id'"):
        shard.writer().compare_and_append(table, 0, 1)
    assert shard.upper == 0


def test_diff_defaults_to_one_and_time_to_expected_upper(
    client: PersistClient, shard_name: str
) -> None:
    """Without _diff every update is +1; without _time every update is at expected_upper."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    assert isinstance(w.compare_and_append(ids(1), 0, 3), Committed)
    assert isinstance(w.compare_and_append(ids(2, start=10), 3, 7), Committed)
    # With an explicit _time, _diff still defaults to +1.
    explicit = ids(1, start=20).append_column(TIME, pa.array([8], pa.uint64()))
    assert isinstance(w.compare_and_append(explicit, 7, 9), Committed)
    events = shard.reader().fetch(shard.reader().snapshot(8).parts)
    assert triples(events) == [
        (0, "n0", 8, 1),
        (10, "n10", 8, 1),
        (11, "n11", 8, 1),
        (20, "n20", 8, 1),
    ]
    listen = shard.reader().listen(0)
    times = []
    for _ in range(3):
        ev = listen.next(timeout_s=5)
        assert ev is not None
        times += shard.reader().fetch(ev.parts).column(TIME).to_pylist()
    assert sorted(times) == [3, 3, 8]


# --- idempotency -----------------------------------------------------------------------


def test_same_token_twice_is_already_committed(client: PersistClient, shard_name: str) -> None:
    """A retry with the same token is AlreadyCommitted and applies nothing, whatever the upper."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer("writer-a")
    assert w.compare_and_append(ids(3), 0, 1, token=7) == Committed(upper=1, seqno=2)
    again = w.compare_and_append(ids(3), 0, 1, token=7)
    assert again == AlreadyCommitted(token=7, upper=1)
    # Token is checked before the upper: a stale retry still learns it landed.
    other = shard.writer("writer-b")
    assert isinstance(other.compare_and_append(ids(1, start=50), 1, 2), Committed)
    assert w.compare_and_append(ids(3), 0, 1, token=7) == AlreadyCommitted(token=7, upper=2)
    snap = shard.reader().snapshot_table()
    assert triples(snap) == [(0, "n0", 1, 1), (1, "n1", 1, 1), (2, "n2", 1, 1), (50, "n50", 1, 1)]


def test_lower_token_after_higher_is_already_committed(
    client: PersistClient, shard_name: str
) -> None:
    """Tokens only go up: a lower token after a higher one is AlreadyCommitted, nothing written."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer("w")
    assert isinstance(w.compare_and_append(ids(1), 0, 1, token=5), Committed)
    assert w.compare_and_append(ids(1, start=1), 1, 2, token=3) == AlreadyCommitted(5, 1)
    assert shard.upper == 1
    assert shard.state().writers["w"].last_token == 5
    # A write without a token is numbered under the handle's own identity: it lands, and the
    # caller's token order of "w" is untouched.
    res = w.compare_and_append(ids(1, start=2), 1, 2)
    assert isinstance(res, Committed)
    assert shard.state().writers["w"].last_token == 5


def test_new_handle_with_same_writer_id_continues_the_callers_tokens(
    client: PersistClient, shard_name: str
) -> None:
    """A new WriteHandle of a known writer_id (a restart) resends with the caller's tokens:
    a token that landed is AlreadyCommitted, the next one is written."""
    shard = client.open_shard(shard_name, SCHEMA)
    w1 = shard.writer("stable")
    for i in range(3):
        assert isinstance(w1.compare_and_append(ids(1, start=i), i, i + 1, token=i + 1), Committed)
    assert shard.state().writers["stable"].last_token == 3
    w2 = shard.writer("stable")
    assert w2.compare_and_append(ids(1, start=2), 3, 4, token=3) == AlreadyCommitted(3, 3)
    res = w2.compare_and_append(ids(1, start=3), 3, 4, token=4)
    assert isinstance(res, Committed)
    assert shard.state().writers["stable"].last_token == 4
    assert isinstance(w2.append(ids(1, start=4)), Committed)
    assert len(shard.reader().snapshot_table()) == 5


def test_new_handle_in_process_with_stale_cache_does_not_drop_data() -> None:
    """A restarted writer identity in a process that read the shard earlier still writes."""
    client, tag = mem_client()
    shard = client.open_shard("s", SCHEMA)
    other = PersistClient(
        open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"), cache=StateCache()
    )
    stale = other.open_shard("s")  # this process's cache now holds SeqNo 1
    assert isinstance(shard.writer("w").compare_and_append(ids(1), 0, 1), Committed)
    res = stale.writer("w").append(ids(1, start=1))
    assert isinstance(res, Committed)
    assert len(shard.reader().snapshot_table()) == 2


# --- snapshot --------------------------------------------------------------------------


def test_snapshot_as_of_each_time(client: PersistClient, shard_name: str) -> None:
    """Insert at 1, retract at 3, re-insert at 5: each as_of sees the consolidated multiset."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    x, y = (1, "x"), (2, "y")
    assert isinstance(w.compare_and_append(at([x, y], 1), 0, 2), Committed)
    assert isinstance(w.compare_and_append(at([x], 3, -1), 2, 4), Committed)
    assert isinstance(
        w.compare_and_append(pa.concat_tables([at([x], 5), at([y], 5, 2)]), 4, 6), Committed
    )
    r = shard.reader()
    expected = {
        0: [],
        1: [(1, "x", 1, 1), (2, "y", 1, 1)],
        2: [(1, "x", 2, 1), (2, "y", 2, 1)],
        3: [(2, "y", 3, 1)],
        4: [(2, "y", 4, 1)],
        5: [(1, "x", 5, 1), (2, "y", 5, 3)],
    }
    for as_of, rows in expected.items():
        table = r.snapshot_table(as_of)
        assert table.column_names == ["id", "name", TIME, DIFF]
        assert triples(table) == rows, as_of
    assert triples(r.snapshot_table()) == expected[5]
    assert r.snapshot().as_of == 5


def test_snapshot_at_or_past_upper_names_the_upper(client: PersistClient, shard_name: str) -> None:
    """as_of >= upper is InvalidFrontier saying what the upper is; so is an empty shard."""
    shard = client.open_shard(shard_name, SCHEMA)
    with pytest.raises(InvalidFrontier, match="upper is 0"):
        shard.reader().snapshot_table()
    shard.writer().compare_and_append(ids(1), 0, 4)
    for as_of in (4, 5, 2**63):
        with pytest.raises(InvalidFrontier, match="upper 4"):
            shard.reader().snapshot(as_of)
    assert len(shard.reader().snapshot_table(3)) == 1


def test_snapshot_plan_splits_a_leased_snapshot_over_tasks(
    client: PersistClient, shard_name: str
) -> None:
    """snapshot_plan leases like snapshot() and splits its parts by size: every task's parts
    together read back the whole collection; the lease holds until released."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    for i in range(4):
        w.compare_and_append(ids(BIG, start=i * BIG), i, i + 1)
    reader = shard.reader()
    whole = reader.snapshot()
    plan = reader.snapshot_plan(3, ReadLimits(split_bytes=1, min_splits=2))
    assert (plan.as_of, plan.seqno) == (3, whole.seqno)
    assert plan.parts == whole.parts
    assert len(plan.splits) == len(whole.parts) == 4
    assert sorted(p.part.key or "" for s in plan.splits for p in s) == sorted(
        p.part.key or "" for p in whole.parts
    )
    assert reader.leased_seqnos() == [plan.seqno]
    got = [t for s in plan.splits for t in read_iter_parts(client.blob, s)]
    assert triples(pa.concat_tables(got)) == triples(reader.snapshot_table())
    reader.release(whole.seqno)
    reader.release(plan.seqno)
    assert reader.leased_seqnos() == []
    reader.close()


def test_snapshot_parts_travel_as_json(
    client: PersistClient, location: tuple[str, str], shard_name: str
) -> None:
    """LeasedParts roundtrip through JSON and are readable by another client on the same URIs."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    w.compare_and_append(ids(2), 0, 1)  # inline
    w.compare_and_append(ids(BIG, start=100), 1, 2)  # in Blob
    snap = shard.reader().snapshot()
    assert len(snap.parts) == 2
    assert {p.part.key is None for p in snap.parts} == {True, False}
    wire = json.loads(json.dumps([p.to_json() for p in snap.parts]))
    parts = [LeasedPart.from_json(d) for d in wire]
    assert parts == list(snap.parts)
    expected = triples(shard.reader().snapshot_table())
    assert len(expected) == BIG + 2

    other = fresh_client(location)
    try:
        got = pa.concat_tables(read_iter_parts(other.blob, parts))
        assert triples(got) == expected
    finally:
        other.close()
    remote_blob = open_blob(parts[0].blob_uri)
    try:
        assert triples(pa.concat_tables(iter_parts(remote_blob, parts))) == expected
    finally:
        remote_blob.close()


# --- listen / subscribe ----------------------------------------------------------------


def test_listen_yields_batches_in_order_with_progress(
    client: PersistClient, shard_name: str
) -> None:
    """listen(as_of) yields every later batch with its bounds and contents; empty = progress."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    w.compare_and_append(at([(0, "a")], 1), 0, 2)
    w.compare_and_append(at([(1, "b")], 2), 2, 3)
    r = shard.reader()
    listen = r.listen(1)
    events = [listen.next(timeout_s=5)]
    w.compare_and_append(ids(0), 3, 5)  # empty: progress only
    events.append(listen.next(timeout_s=5))
    w.compare_and_append(ids(0), 5, 6)  # merged in state with the previous empty batch
    events.append(listen.next(timeout_s=5))
    w.compare_and_append(at([(2, "c")], 7, -1), 6, 9)
    events.append(listen.next(timeout_s=5))
    assert all(e is not None for e in events)
    got = [(e.lower, e.upper, triples(r.fetch(e.parts))) for e in events if e is not None]
    assert got == [
        (2, 3, [(1, "b", 2, 1)]),
        (3, 5, []),
        (5, 6, []),
        (6, 9, [(2, "c", 7, -1)]),
    ]
    assert events[1] is not None and events[1].parts == ()
    assert events[2] is not None and events[2].parts == ()
    assert listen.frontier == 9
    assert listen.next(timeout_s=0.2) is None
    # A listen started later sees the two empty appends as the one merged batch.
    late = r.listen(2)
    bounds = [
        (e.lower, e.upper, e.parts == ()) for e in (late.next(5), late.next(5)) if e is not None
    ]
    assert bounds == [(3, 6, True), (6, 9, False)]
    # Listening from a time in the middle of a batch starts right after it.
    from_zero = r.listen(0)
    first = from_zero.next(timeout_s=5)
    assert first is not None and (first.lower, first.upper) == (1, 2)
    assert triples(r.fetch(first.parts)) == [(0, "a", 1, 1)]


def test_listen_sees_writes_from_another_thread(client: PersistClient, shard_name: str) -> None:
    """A listen started before another thread's writes sees each of them, exactly, in order."""
    shard = client.open_shard(shard_name, SCHEMA)
    shard.writer().compare_and_append(ids(1), 0, 1)
    listen = shard.reader().listen(0)
    assert listen.next(timeout_s=0.05) is None
    errors: list[BaseException] = []

    def write() -> None:
        try:
            w = shard.writer()
            for i in range(1, 21):
                res = w.compare_and_append(at([(i, f"r{i}"), (-i, "neg")], i), i, i + 1)
                assert isinstance(res, Committed)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    t = threading.Thread(target=write)
    t.start()
    got: list[tuple[Any, ...]] = []
    bounds: list[tuple[int, int]] = []
    try:
        # Compaction may merge batches before the listen reads them: then one event
        # covers several batches. The events must still tile [1, 21) exactly.
        while listen.frontier < 21:
            ev = listen.next(timeout_s=20)
            assert ev is not None, (errors, bounds)
            bounds.append((ev.lower, ev.upper))
            updates = triples(shard.reader().fetch(ev.parts))
            assert all(ev.lower <= u[2] < ev.upper for u in updates), (ev.lower, ev.upper)
            got += updates
    finally:
        t.join(30)
    assert not errors
    assert bounds[0][0] == 1 and bounds[-1][1] == 21
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert sorted(got) == sorted(
        u for i in range(1, 21) for u in [(i, f"r{i}", i, 1), (-i, "neg", i, 1)]
    )


def test_subscribe_yields_snapshot_then_batches(client: PersistClient, shard_name: str) -> None:
    """subscribe is the snapshot as one event, then every later batch."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    w.compare_and_append(at([(1, "a"), (2, "b")], 0), 0, 1)
    w.compare_and_append(at([(1, "a")], 2, -1), 1, 3)
    r = shard.reader()
    sub = r.subscribe()
    first = next(sub)
    assert (first.lower, first.upper) == (0, 3)
    assert triples(r.fetch(first.parts)) == sorted(
        [(1, "a", 2, 1), (2, "b", 2, 1), (1, "a", 2, -1)]
    )
    w.compare_and_append(at([(3, "c")], 4), 3, 5)
    second = next(sub)
    assert (second.lower, second.upper) == (3, 5)
    assert triples(r.fetch(second.parts)) == [(3, "c", 4, 1)]
    sub_old = r.subscribe(0)
    ev = next(sub_old)
    assert (ev.lower, ev.upper) == (0, 1)
    assert triples(r.fetch(ev.parts)) == [(1, "a", 0, 1), (2, "b", 0, 1)]
    ev = next(sub_old)
    assert (ev.lower, ev.upper) == (1, 3)
    assert triples(r.fetch(ev.parts)) == [(1, "a", 2, -1)]


# --- large and tiny writes -------------------------------------------------------------


def test_large_write_is_cut_into_parts(location: tuple[str, str], shard_name: str) -> None:
    """300,000 rows with a 1 MiB part target make several parts and read back exactly."""
    client = PersistClient.open(*location, config=PersistConfig(part_target_bytes=1 << 20))
    try:
        shard = client.open_shard(shard_name, SCHEMA)
        n = 300_000
        res = shard.writer().compare_and_append(ids(n), 0, 1)
        assert isinstance(res, Committed)
        snap = shard.reader().snapshot()
        assert len(snap.parts) > 1
        assert all(p.part.key is not None for p in snap.parts)
        assert snap.rows == n
        assert len(part_keys(client, shard_name)) == len(snap.parts)
        table = shard.reader().snapshot_table()
        assert table.num_rows == n
        assert sorted(table.column("id").to_pylist()) == list(range(n))
        assert set(table.column(DIFF).to_pylist()) == {1}
        names = dict(
            zip(table.column("id").to_pylist(), table.column("name").to_pylist(), strict=True)
        )
        assert all(names[i] == f"n{i}" for i in range(0, n, 997))
    finally:
        client.close()


def test_tiny_write_is_inline_and_big_goes_to_blob(client: PersistClient, shard_name: str) -> None:
    """A tiny write rides in state (no Blob object); one over inline_write_max_bytes does not."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    w.compare_and_append(ids(1), 0, 1)
    snap = shard.reader().snapshot()
    assert len(snap.parts) == 1 and snap.parts[0].part.key is None
    assert part_keys(client, shard_name) == set()
    assert client.config.inline_write_max_bytes == 4096
    w.compare_and_append(ids(2000, start=1), 1, 2)
    part = shard.reader().snapshot().parts[1].part
    assert part.key is not None and part.inline is None
    assert part.size_bytes > 0 and part.rows == 2000
    assert part_keys(client, shard_name) == {part.key}
    assert len(shard.reader().snapshot_table()) == 2001


def test_inline_total_max_bytes_bounds_inline_state() -> None:
    """Once state holds inline_total_max_bytes of inline data, tiny writes go to Blob.

    Maintenance is off so compaction cannot move inline data out first.
    """
    client, _ = mem_client(PersistConfig(inline_total_max_bytes=2048, maintenance=False))
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer()
    for i in range(20):
        w.compare_and_append(ids(1, start=i), i, i + 1)
    state = shard.state()
    assert state.inline_bytes <= 2048
    assert state.trace[-1].parts[0].key is not None
    assert len(shard.reader().snapshot_table()) == 20


# --- reopen from elsewhere -------------------------------------------------------------

_CHILD = """
import json, sys
from pyspark_persist.state import PersistClient
client = PersistClient.open(sys.argv[1], sys.argv[2])
shard = client.open_shard(sys.argv[3])
table = shard.reader().snapshot_table()
cols = [table.column(n).to_pylist() for n in ("id", "name", "_time", "_diff")]
print(json.dumps({"upper": shard.upper, "schema": shard.schema.names,
                  "rows": sorted(zip(*cols))}))
"""


def test_reopen_from_fresh_process(
    client: PersistClient, location: tuple[str, str], shard_name: str
) -> None:
    """Another process opening the same URIs sees exactly what was committed."""
    if location[1].startswith("mem://"):
        pytest.skip("a mem:// store is invisible to other processes")
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    w.compare_and_append(at([(1, "a"), (2, "b")], 0), 0, 1)
    w.compare_and_append(ids(BIG, start=10), 1, 2)
    w.compare_and_append(at([(1, "a")], 2, -1), 2, 3)
    expected = [list(t) for t in triples(shard.reader().snapshot_table())]
    assert len(expected) == BIG + 1
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, *location, shard_name],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["upper"] == 3
    assert got["schema"] == ["id", "name"]
    assert got["rows"] == expected


def test_rollups_let_a_fresh_client_load_state(location: tuple[str, str], shard_name: str) -> None:
    """Past rollup_interval commits, rollups land in Blob and state loads from one.

    Background maintenance is off so compaction and GC cannot move SeqNos or
    rollups underneath the comparison; the truncation below is what GC does.
    """
    config = PersistConfig(rollup_interval=8, maintenance=False)
    client = PersistClient.open(*location, config=config)
    try:
        shard = client.open_shard(shard_name, SCHEMA)
        w = shard.writer("w")
        for i in range(20):
            res = w.compare_and_append(at([(i, f"r{i}")], i), i, i + 1, token=i + 1)
            assert isinstance(res, Committed)
        expected = triples(shard.reader().snapshot_table())
        state = shard.state()
        assert state.rollups, state.seqno
        rollup_objects = {m.key for m in client.blob.list_keys(f"{shard_name}/rollup/")}
        assert set(state.rollups.values()) <= rollup_objects
        assert all(rollup_key(shard_name, s) == k for s, k in state.rollups.items())

        # A fresh cache reads every diff; after truncation it must start from a rollup.
        for truncate in (False, True):
            if truncate:
                client.consensus.truncate(shard_name, max(state.rollups))
                assert client.consensus.scan(shard_name, 0)[0].seqno == max(state.rollups)
            fresh = fresh_client(location, config)
            try:
                again = fresh.open_shard(shard_name, SCHEMA)
                loaded = again.state()
                assert loaded == state
                loaded.check_invariants()
                assert triples(again.reader().snapshot_table()) == expected
                # The fresh client keeps writing where the writer's tokens left off.
                u = state.upper
                token = state.writers["w"].last_token + 1
                res = again.writer("w").compare_and_append(
                    at([(99, "z")], u), u, u + 1, token=token
                )
                assert isinstance(res, Committed) and res.upper == u + 1
                assert again.state().writers["w"].last_token == state.writers["w"].last_token + 1
            finally:
                fresh.close()
            expected = triples(shard.reader().snapshot_table())
            state = shard.state()
            assert state.upper == u + 1
    finally:
        client.close()


# --- corruption and unavailable stores -------------------------------------------------


def test_garbage_consensus_row_is_corrupt_data() -> None:
    """A row that is not a state diff makes loading fail with CorruptData naming shard and SeqNo."""
    client, tag = mem_client()
    shard = client.open_shard("victim", SCHEMA)
    shard.writer().compare_and_append(ids(1), 0, 1)
    head = client.consensus.head("victim")
    assert head is not None
    bad = head.seqno + 1
    res = client.consensus.compare_and_set("victim", head.seqno, VersionedData(bad, b"garbage"))
    assert res == CaSCommitted()
    fresh = PersistClient(
        open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"), cache=StateCache()
    )
    with pytest.raises(CorruptData, match=rf"'victim'.*SeqNo {bad}"):
        fresh.open_shard("victim")
    # A client that already holds the older state fails the same way on its next read.
    with pytest.raises(CorruptData, match=rf"'victim'.*SeqNo {bad}"):
        shard.state()


def test_part_deleted_behind_persists_back(client: PersistClient, shard_name: str) -> None:
    """Reading a snapshot whose part is gone from Blob raises PartNotFound naming the key."""
    shard = client.open_shard(shard_name, SCHEMA)
    shard.writer().compare_and_append(ids(BIG), 0, 1)
    (key,) = part_keys(client, shard_name)
    client.blob.delete(key)
    with pytest.raises(PartNotFound, match=key):
        shard.reader().snapshot_table()
    with pytest.raises(PartNotFound, match=key):
        shard.reader().fetch(shard.reader().snapshot().parts)


@pytest.mark.parametrize(
    ("blob", "consensus"),
    [
        ("no-scheme", "mem://x"),
        ("ftp://host/x", "mem://x"),
        ("mem://bad name", "mem://x"),
        ("s3://", "mem://x"),
        ("mem://x", "no-scheme"),
        ("mem://x", "redis://host/0"),
        ("mem://x", "postgresql+nodriver://u@h/db"),
    ],
)
def test_malformed_uris(blob: str, consensus: str) -> None:
    """Malformed or unknown URIs are InvalidUri before any store is touched."""
    with pytest.raises(InvalidUri):
        PersistClient.open(blob, consensus)


def test_unreachable_postgres_is_store_unavailable_after_retry_timeout() -> None:
    """A PostgreSQL nobody listens on: opening the client touches nothing, and the first
    use retries for retry_timeout_s, then raises StoreUnavailable saying how long it tried."""
    config = PersistConfig(retry_timeout_s=0.5)
    dead = "postgresql://postgres@127.0.0.1:1/test"
    with PersistClient.open("mem://x", dead, config=config) as c:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"gave up for 0\.\d s"):
            c.open_shard("s", SCHEMA)
        assert time.monotonic() - started < 5


def test_shard_handles_share_state_in_process(client: PersistClient, shard_name: str) -> None:
    """Two handles of one shard in one process see each other's writes without a reopen."""
    a: Shard = client.open_shard(shard_name, SCHEMA)
    b: Shard = client.open_shard(shard_name)
    assert a.writer().append(ids(3)).upper > 0
    assert sorted(b.reader().snapshot_table().column("id").to_pylist()) == [0, 1, 2]
    assert isinstance(b.writer().append(ids(1, start=3)), Committed)
    assert len(a.reader().snapshot_table()) == 4


def test_longest_valid_shard_name(client: PersistClient) -> None:
    """A 200-character name is valid on every store (Blob keys and Consensus rows)."""
    name = f"{uuid.uuid4().hex}{'x' * 168}"
    assert len(name) == 200
    shard = client.open_shard(name, SCHEMA)
    assert isinstance(shard.writer().compare_and_append(ids(BIG), 0, 1), Committed)
    assert len(shard.reader().snapshot_table()) == BIG
    with pytest.raises(InvalidUsage):
        client.open_shard(name + "y", SCHEMA)


def test_racing_writers_exactly_one_wins(client: PersistClient, shard_name: str) -> None:
    """Writers racing for the same upper: one commits, the others learn the new upper."""
    shard = client.open_shard(shard_name, SCHEMA)
    start = threading.Barrier(4)
    results: list[Any] = [None] * 4

    def write(i: int) -> None:
        w = shard.writer()
        start.wait()
        results[i] = w.compare_and_append(ids(1, start=i), 0, 1)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sum(isinstance(r, Committed) for r in results) == 1
    assert [r for r in results if not isinstance(r, Committed)] == [UpperMismatch(1)] * 3
    assert len(shard.reader().snapshot_table()) == 1


def test_listen_in_other_client_polls_for_writes(
    client: PersistClient, location: tuple[str, str], shard_name: str
) -> None:
    """A listen with no in-process wake-up (another client's cache) still sees every batch."""
    shard = client.open_shard(shard_name, SCHEMA)
    w = shard.writer()
    w.compare_and_append(ids(1), 0, 1)
    other = fresh_client(location, PersistConfig(listen_poll_max_s=0.02))
    try:
        listen = other.open_shard(shard_name).reader().listen(0)
        assert listen.next(timeout_s=0.05) is None
        for i in range(1, 4):
            w.compare_and_append(at([(i, "p")], i), i, i + 1)
            ev = listen.next(timeout_s=10)
            assert ev is not None and (ev.lower, ev.upper) == (i, i + 1)
            assert triples(other.open_shard(shard_name).reader().fetch(ev.parts)) == [
                (i, "p", i, 1)
            ]
    finally:
        other.close()
