"""changeTypes through the connector's planner and tasks, called as Spark calls them, without
a JVM: a commit whose updates lie in several parts (an overwrite of a keyed shard: negated
references to the old parts plus the new rows) is read by one task and paired, however many
tasks the read is split over, while other commits keep their own tasks."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest

import pyspark_persist.batch_reader as batch_reader
import pyspark_persist.source as source
from pyspark_persist.batch_reader import make_batch_reader
from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import read_schema
from pyspark_persist.state import PersistClient, PersistConfig, Shard
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.stream_reader import PersistStreamReader

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
ROWS = 2_000
"""Rows of each write: past inline_write_max_bytes, so parts live in Blob."""


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Shard, dict[str, str]]]:
    """A keyed shard of three upserts and an overwrite, and the options that locate it."""
    tag = uuid.uuid4().hex
    client = PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=PersistConfig(maintenance=False),
    )
    key = (f"mem://{tag}", f"mem://{tag}")
    monkeypatch.setitem(source._clients, (*key, None), client)
    monkeypatch.setitem(batch_reader._lease_clients, key, client)
    shard = client.open_shard("customers", SCHEMA, keys=["id"])
    shard.writer("loader").upsert(pa.table({"id": range(ROWS), "name": ["a"] * ROWS}), token=1)
    yield shard, {"blob": f"mem://{tag}", "consensus": f"mem://{tag}", "path": "customers"}
    client.close()


def _upsert_and_overwrite(shard: Shard) -> None:
    """Commit 2 upserts every even id; commit 3 overwrites, keeping ids below ROWS/2, id 0
    renamed: every other kept row comes back unchanged."""
    writer = shard.writer("loader")
    writer.upsert(pa.table({"id": range(0, ROWS, 2), "name": ["b"] * (ROWS // 2)}), token=2)
    kept = ["z"] + ["b" if i % 2 == 0 else "a" for i in range(1, ROWS // 2)]
    staged = writer.builder()
    staged.add(pa.table({"id": range(ROWS // 2), "name": kept}))
    upper = writer.fetch_upper()
    writer.compare_and_append_batches(
        [staged.finish()], upper, upper + 1, token=3, ts_rewrite=upper, replace=True
    )


def _counts(rows: list[dict[str, Any]]) -> dict[tuple[int, str], int]:
    """How many rows of each (commit, change type): commits numbered from 1 by time."""
    times = sorted({r["_time"] for r in rows})
    out: dict[tuple[int, str], int] = {}
    for r in rows:
        k = (times.index(r["_time"]) + 1, r["_change_type"])
        out[k] = out.get(k, 0) + 1
    return out


EXPECTED = {
    (1, "insert"): ROWS,
    (2, "update_preimage"): ROWS // 2,
    (2, "update_postimage"): ROWS // 2,
    (3, "update_preimage"): 1,  # id 0: b -> z
    (3, "update_postimage"): 1,
    (3, "delete"): ROWS // 2,  # ids ROWS/2.. are gone; the rest came back unchanged: nothing
}


def test_read_changes_pairs_an_overwrite_whose_parts_a_split_would_scatter(
    keyed: tuple[Shard, dict[str, str]],
) -> None:
    shard, where = keyed
    _upsert_and_overwrite(shard)
    opts = PersistOptions.parse(
        {**where, "readChanges": "true", "changeTypes": "true", "minPartitions": "8"}, "read"
    )
    reader = make_batch_reader(opts, read_schema(SCHEMA, change_types=True))
    partitions = reader.partitions()
    assert len(partitions) > 1  # the other commits are still read by other tasks
    rows = [r for p in partitions for b in reader.read(p) for r in b.to_pylist()]
    assert _counts(rows) == EXPECTED
    post = [r for r in rows if r["_change_type"] == "update_postimage" and r["id"] == 0]
    assert [r["name"] for r in sorted(post, key=lambda r: r["_time"])] == ["b", "z"]


def test_a_stream_pairs_each_micro_batch_and_labels_its_snapshot_inserts(
    keyed: tuple[Shard, dict[str, str]],
) -> None:
    shard, where = keyed
    opts = PersistOptions.parse(
        {**where, "changeTypes": "true", "minPartitions": "8"}, "stream_read"
    )
    stream = PersistStreamReader(opts, read_schema(SCHEMA, change_types=True))

    def micro_batch(start: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        end = stream.latestOffset(start, stream.getDefaultReadLimit())
        rows = [
            r for p in stream.partitions(start, end) for b in stream.read(p) for r in b.to_pylist()
        ]
        stream.commit(end)
        return end, rows

    try:
        end, snapshot = micro_batch(stream.initialOffset())
        _upsert_and_overwrite(shard)
        _, rows = micro_batch(end)
    finally:
        stream.stop()
    assert _counts(snapshot) == {(1, "insert"): ROWS}
    assert _counts(rows) == {
        (1, "update_preimage"): ROWS // 2,
        (1, "update_postimage"): ROWS // 2,
        (2, "update_preimage"): 1,
        (2, "update_postimage"): 1,
        (2, "delete"): ROWS // 2,
    }
