"""Schema evolution: ``merge_schema`` adds nullable columns in the data's own compare-and-set,
older parts read null there everywhere (snapshot, listen, compaction), and incompatible changes
are refused before anything is staged or committed."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
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
    UpperMismatch,
    decode_schema,
)
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.config import PersistConfig
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import SchemaMismatch
from pyspark_persist.state.read import iter_parts
from pyspark_persist.state.schema import MAX_TIME
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
QUIET = PersistConfig(maintenance=False)
"""No background compaction or GC: every SeqNo a test sees is its own writes'."""


def open_pair() -> tuple[str, str]:
    """A fresh named ``mem://`` (Blob, Consensus) pair."""
    tag = uuid.uuid4().hex
    return f"mem://{tag}", f"mem://{tag}"


def rows(n: int, start: int = 0, **extra: list[Any]) -> pa.Table:
    """``(id, name)`` rows from ``start``, plus the given extra columns."""
    cols: dict[str, Any] = {
        "id": pa.array(range(start, start + n), pa.int64()),
        "name": [f"n{i}" for i in range(start, start + n)],
    }
    cols.update(extra)
    return pa.table(cols)


def records(table: pa.Table) -> list[dict[str, Any]]:
    """The rows of a read without ``_time``, sorted by id."""
    return sorted(
        (
            {k: v for k, v in r.items() if k != TIME}
            for r in table.select([n for n in table.column_names if n != TIME]).to_pylist()
        ),
        key=lambda r: r["id"],
    )


def part_keys(client: PersistClient, shard: str) -> set[str]:
    return {m.key for m in client.blob.list_keys(shard + "/part/")}


@pytest.fixture
def client() -> Iterator[PersistClient]:
    c = PersistClient.open(*open_pair(), config=QUIET)
    yield c
    c.close()


def test_merge_schema_adds_a_column_in_the_same_seqno_as_its_data(client: PersistClient) -> None:
    """One state transition carries the new column and the rows that brought it."""
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer()
    w.append(rows(2))
    before = shard.state()
    res = w.append(rows(1, 2, score=pa.array([1.5])), merge_schema=True)
    assert isinstance(res, Committed)
    after = shard.state()
    assert after.seqno == before.seqno + 1 == res.seqno
    assert decode_schema(before.schema).names == ["id", "name"]
    assert decode_schema(after.schema).names == ["id", "name", "score"]
    assert shard.schema.names == ["id", "name", "score"]
    assert records(shard.reader().snapshot_table()) == [
        {"id": 0, "name": "n0", "score": None, DIFF: 1},
        {"id": 1, "name": "n1", "score": None, DIFF: 1},
        {"id": 2, "name": "n2", "score": 1.5, DIFF: 1},
    ]
    assert [c.columns_added for c in shard.history()] == [None, None, "score"]
    # Another process (its own state cache) sees the new schema too.
    other = PersistClient(client.blob, client.consensus, config=QUIET, cache=StateCache())
    assert other.open_shard("s").schema.names == ["id", "name", "score"]


def test_merge_schema_fills_missing_columns_and_plain_writes_stay_strict(
    client: PersistClient,
) -> None:
    """With merge_schema a shard column the updates lack is null; without it the write is
    refused, as before."""
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer()
    w.append(pa.table({"id": pa.array([7], pa.int64())}), merge_schema=True)
    assert records(shard.reader().snapshot_table()) == [{"id": 7, "name": None, DIFF: 1}]
    with pytest.raises(SchemaMismatch, match="'name'"):
        w.append(pa.table({"id": pa.array([8], pa.int64())}))


def test_new_column_without_merge_schema_is_refused_before_anything_is_written(
    client: PersistClient,
) -> None:
    """The error names the column and the fix; no part is staged, no SeqNo taken."""
    shard = client.open_shard("s", SCHEMA)
    before = shard.state()
    big = rows(20_000, extra=pa.array(["x"] * 20_000))  # big enough for Blob, not inline
    with pytest.raises(SchemaMismatch, match=r"'extra'.*merge_schema=True"):
        shard.writer().append(big)
    assert shard.state().seqno == before.seqno
    assert part_keys(client, "s") == set()


@pytest.mark.parametrize(
    ("updates", "words"),
    [
        (
            pa.table({"id": pa.array(["1"]), "name": ["a"]}),
            [r"'id'", "string", "int64", "cast it back"],
        ),
        (
            pa.table(
                {"id": pa.array([1], pa.int64()), "name": ["a"], "n": pa.array([1])},
                schema=pa.schema(
                    [("id", pa.int64()), ("name", pa.string()), pa.field("n", pa.int64(), False)]
                ),
            ),
            [r"'n'", "non-nullable", "make it nullable"],
        ),
        (
            pa.table({"id": pa.array([1], pa.int64()), "name": ["a"], "Name": ["b"]}),
            [r"'Name'", r"'name'", "rename it"],
        ),
        (
            pa.table({"id": pa.array([1], pa.int64()), "name": ["a"], "_TIME": [1]}),
            [r"'_TIME'", r"'_time'", "rename it"],
        ),
    ],
    ids=["retyped", "non-nullable", "case-collision", "reserved-collision"],
)
def test_incompatible_change_is_refused_even_with_merge_schema(
    client: PersistClient, updates: pa.Table, words: list[str]
) -> None:
    """Type changes, non-nullable adds and colliding names: a clear error, nothing written."""
    shard = client.open_shard("s", SCHEMA)
    before = shard.state()
    for call in (
        lambda: shard.writer().append(updates, merge_schema=True),
        lambda: shard.writer().compare_and_append(updates, 0, 1, merge_schema=True),
    ):
        with pytest.raises(SchemaMismatch) as err:
            call()
        for w in words:
            assert re.search(w, str(err.value)), (w, str(err.value))
    after = shard.state()
    assert (after.seqno, after.schema) == (before.seqno, before.schema)
    assert part_keys(client, "s") == set()


def test_failed_or_replayed_commit_never_splits_schema_from_data(client: PersistClient) -> None:
    """An UpperMismatch commits neither the column nor the rows; a replayed token neither."""
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer("w")
    w.append(rows(1))
    seqno, upper = shard.state().seqno, shard.upper
    evolved = SCHEMA.append(pa.field("score", pa.float64()))
    builder = w.builder(evolved)
    builder.add(rows(1, 1, score=pa.array([2.0])))
    staged = builder.finish()
    stale = w.compare_and_append_batches(
        [staged], upper - 1, upper + 5, ts_rewrite=upper - 1, schema=evolved
    )
    assert isinstance(stale, UpperMismatch)
    assert shard.state().seqno == seqno
    assert shard.schema.names == ["id", "name"]
    first = w.append(rows(1, 5, score=pa.array([3.0])), token=10, merge_schema=True)
    assert isinstance(first, Committed)
    again = w.append(rows(1, 5, score=pa.array([3.0])), token=10, merge_schema=True)
    assert isinstance(again, AlreadyCommitted)
    assert [r["id"] for r in records(shard.reader().snapshot_table())] == [0, 5]
    assert shard.schema.names == ["id", "name", "score"]


def test_racing_writers_both_add_their_columns(client: PersistClient) -> None:
    """A commit merges with the schema in the state it lands on: a concurrent writer's column
    stays; a conflicting one (same name, other type) is refused and changes nothing."""
    first = client.open_shard("s", SCHEMA)
    # A second process: its own cache, so it commits from a stale state and must retry.
    other = PersistClient(client.blob, client.consensus, config=QUIET, cache=StateCache())
    second = other.open_shard("s")
    first.writer().append(rows(1, 0, a=pa.array(["x"])), merge_schema=True)
    second.writer().append(rows(1, 1, b=pa.array([True])), merge_schema=True)
    first.state()  # refresh this process's view: Shard.schema is the last state it saw
    assert first.schema.names == ["id", "name", "a", "b"]
    assert records(first.reader().snapshot_table()) == [
        {"id": 0, "name": "n0", "a": "x", "b": None, DIFF: 1},
        {"id": 1, "name": "n1", "a": None, "b": True, DIFF: 1},
    ]
    third = PersistClient(client.blob, client.consensus, config=QUIET, cache=StateCache())
    stale = third.open_shard("s")
    first.writer().append(rows(1, 2, c=pa.array([1], pa.int64())), merge_schema=True)
    before, keys = first.state(), part_keys(client, "s")
    big = rows(20_000, 3, c=pa.array(["y"] * 20_000))  # staged to Blob, not inline
    with pytest.raises(SchemaMismatch, match=r"'c'.*string.*int64"):
        stale.writer().append(big, merge_schema=True)
    after = first.state()
    assert (after.seqno, after.upper) == (before.seqno, before.upper)
    assert part_keys(client, "s") == keys  # the refused commit's staged part was deleted


def test_listen_and_iter_snapshot_conform_old_parts() -> None:
    """A listen across the change and a streamed snapshot give every event the new columns."""
    blob, consensus = open_pair()
    client = PersistClient.open(blob, consensus, config=QUIET)
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer()
    w.append(rows(1))
    reader = shard.reader()
    as_of = shard.upper - 1
    listen = reader.listen(as_of)
    w.append(rows(1, 1))
    w.append(rows(1, 2, tag=pa.array(["t"])), merge_schema=True)
    fetched = []
    while listen.frontier < shard.upper:
        event = listen.next(timeout_s=5)
        assert event is not None
        fetched.append(reader.fetch(event.parts))
    assert all(t.column_names == ["id", "name", "tag", TIME, DIFF] for t in fetched)
    assert [r["tag"] for r in records(pa.concat_tables(fetched))] == [None, "t"]
    slices = list(reader.iter_snapshot())
    assert all(t.column_names == ["id", "name", "tag", TIME, DIFF] for t in slices)
    assert [r["tag"] for r in records(pa.concat_tables(slices))] == [None, None, "t"]
    listen.close()
    reader.close()
    client.close()


def test_compaction_writes_the_current_schema() -> None:
    """Merging parts written under two schemas rewrites them under the newest; reads agree."""
    blob, consensus = open_pair()
    config = PersistConfig(maintenance=False, compaction_fan_in=2)
    client = PersistClient.open(blob, consensus, config=config)
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer()
    w.append(rows(2))
    w.append(rows(1, 2, score=pa.array([0.5])), merge_schema=True)
    w.append(rows(1, 3, score=pa.array([1.5])))
    expected = records(shard.reader().snapshot_table())
    reports = shard.compact()
    assert any(r.rewritten and r.applied for r in reports)
    state = shard.state()
    assert len(state.trace) < 3
    parts = [p for b in state.trace for p in b.parts]
    assert parts
    leased = [LeasedPart("s", client.blob.uri, p, 0, MAX_TIME, None, state.seqno) for p in parts]
    stored = list(iter_parts(client.blob, leased))  # no schema given: as stored
    assert all(t.column_names == ["id", "name", "score", TIME, DIFF] for t in stored)
    assert records(shard.reader().snapshot_table()) == expected
    assert [r["score"] for r in expected] == [None, None, 0.5, 1.5]
    client.close()


def test_lost_reply_of_a_merge_commit_applies_column_and_rows_once() -> None:
    """The compare-and-set carrying the new column lands but its reply is lost: the retry finds
    its token committed, so the column and the rows are in state once, in one commit."""
    blob, consensus = open_pair()
    store = UnreliableConsensus(
        open_consensus(consensus),
        Faults(seed=1, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set"})),
        enabled=False,
    )
    client = PersistClient(open_blob(blob), store, config=QUIET, cache=StateCache())
    shard = client.open_shard("s", SCHEMA)
    w = shard.writer("w")
    w.append(rows(2), token=1)
    store.enabled = True
    result = w.append(rows(1, 2, score=pa.array([1.0])), token=2, merge_schema=True)
    store.enabled = False
    assert store.injected["fail_after"] == 1
    assert isinstance(result, Committed | AlreadyCommitted)
    assert shard.state().seqno == 3
    assert shard.schema.names == ["id", "name", "score"]
    assert [c.columns_added for c in shard.history()] == [None, None, "score"]
    assert [(r["id"], r["score"]) for r in records(shard.reader().snapshot_table())] == [
        (0, None),
        (1, None),
        (2, 1.0),
    ]
    client.close()
