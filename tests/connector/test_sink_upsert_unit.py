"""The sink on keyed shards through its Python objects, without Spark: upserts per micro-batch,
deletes and sequences by option, exactly once on replay, overwrite, and bad options."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import BooleanType, LongType, StringType, StructField, StructType

from pyspark_persist.options import PersistOptions
from pyspark_persist.state import PersistClient
from pyspark_persist.state.errors import InvalidUpdates, InvalidUsage, KeysMismatch
from pyspark_persist.writer import PersistBatchWriter, PersistStreamWriter, read_sink_metrics

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("name", StringType()),
        StructField("lsn", LongType()),
        StructField("is_deleted", BooleanType()),
    ]
)
OPTIONS = {"upsertKeys": "id", "deleteColumn": "is_deleted", "sequenceColumn": "lsn"}


def _stream(shard: str, ckpt: Path, **extra: str) -> PersistStreamWriter:
    opts = {"path": shard, "checkpointLocation": str(ckpt), **OPTIONS, **extra}
    return PersistStreamWriter(PersistOptions.parse(opts, "stream_write"), SCHEMA, False)


def _rows(ids: list[int], names: list[str], lsns: list[int], gone: list[bool]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict(
        {
            "id": pa.array(ids, pa.int64()),
            "name": names,
            "lsn": pa.array(lsns, pa.int64()),
            "is_deleted": gone,
        }
    )


def _live(shard: str) -> dict[int, tuple[str, int]]:
    table = PersistClient.open().open_shard(shard).reader().snapshot_table()
    rows = table.to_pylist()
    assert all(r["_diff"] == 1 for r in rows) and "is_deleted" not in table.column_names
    out = {r["id"]: (r["name"], r["lsn"]) for r in rows}
    assert len(out) == len(rows)
    return out


def test_micro_batches_upsert_exactly_once_with_deletes_and_sequences(tmp_path: Path) -> None:
    shard = f"cdc-{uuid.uuid4().hex[:8]}"
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}) + "\n")
    w = _stream(shard, ckpt)
    assert PersistClient.open().open_shard(shard).keys == ("id",)  # created keyed
    batch0 = [
        w.write(iter([_rows([1, 2, 3], ["a", "b", "c"], [1, 2, 3], [False] * 3)])),
        w.write(iter([_rows([1], ["a2"], [4], [False])])),
    ]
    w.commit(batch0, 0)
    assert _live(shard) == {1: ("a2", 4), 2: ("b", 2), 3: ("c", 3)}
    w = _stream(shard, ckpt)
    batch1 = [
        w.write(iter([_rows([2, 3, 1], ["", "c0", "a-late"], [5, 1, 3], [True, False, False])]))
    ]
    w.commit(batch1, 1)
    # id 2 deleted; late events for 3 and 1 ignored
    assert _live(shard) == {1: ("a2", 4), 3: ("c", 3)}
    replay = _stream(shard, ckpt)
    replay.commit([replay.write(iter([_rows([3], ["x"], [9], [False])]))], 1)  # a replay
    w = _stream(shard, ckpt)
    w.commit([w.write(iter([_rows([2], ["b-old"], [4], [False])]))], 2)  # older than the delete
    assert _live(shard) == {1: ("a2", 4), 3: ("c", 3)}
    outcomes = [(m["batch_id"], m["outcome"]) for m in read_sink_metrics(str(ckpt))]
    assert outcomes == [
        (0, "committed"),
        (1, "committed"),
        (1, "already committed"),
        (2, "committed"),
    ]
    client = PersistClient.open()
    staged_left = [m.key for m in client.blob.list_keys(f"{shard}/part/")]
    referenced = {p.key for b in client.open_shard(shard).state().trace for p in b.all_parts}
    assert set(staged_left) <= referenced  # the rows read back were deleted


def test_overwrite_of_a_keyed_shard_keeps_one_row_per_key() -> None:
    shard = f"ow-{uuid.uuid4().hex[:8]}"
    opts = PersistOptions.parse({"path": shard, **OPTIONS}, "write")
    w = PersistBatchWriter(opts, SCHEMA, False)
    w.commit([w.write(iter([_rows([1, 2], ["a", "b"], [1, 1], [False, False])]))])
    w = PersistBatchWriter(opts, SCHEMA, True)
    w.commit(
        [
            w.write(
                iter(
                    [
                        _rows(
                            [3, 3, 4, 5],
                            ["c", "c2", "d", ""],
                            [1, 2, 1, 1],
                            [False, False, False, True],
                        )
                    ]
                )
            )
        ]
    )
    assert _live(shard) == {3: ("c2", 2), 4: ("d", 1)}


def test_bad_keyed_options_fail_before_any_task() -> None:
    shard = f"bad-{uuid.uuid4().hex[:8]}"
    opts = PersistOptions.parse({"path": shard, "upsertKeys": "id"}, "write")
    plain = StructType([StructField("id", LongType()), StructField("name", StringType())])
    PersistBatchWriter(opts, plain, False)
    other = PersistOptions.parse({"path": shard, "upsertKeys": "name,id"}, "write")
    with pytest.raises(KeysMismatch, match=r"keys \['id'\].*\['name', 'id'\]"):
        PersistBatchWriter(other, plain, False)
    flag = PersistOptions.parse({"path": shard, "deleteColumn": "name"}, "write")
    with pytest.raises(InvalidUpdates, match="deleteColumn 'name' is string: it must be boolean"):
        PersistBatchWriter(flag, plain, False)
    unkeyed = f"plain-{uuid.uuid4().hex[:8]}"
    seq = PersistOptions.parse({"path": unkeyed, "sequenceColumn": "id"}, "write")
    with pytest.raises(InvalidUsage, match="sequenceColumn apply to a keyed shard"):
        PersistBatchWriter(seq, plain, False)
    with pytest.raises(InvalidUsage, match="upsertKeys=' , '"):
        PersistOptions.parse({"path": shard, "upsertKeys": " , "}, "write")
