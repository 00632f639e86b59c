"""changeTypes without Spark: the pairing of a keyed shard's updates, the labels of an unkeyed
one, and the merging of splits that makes each task see every update of its times."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.change_types import CHANGE_TYPE, colocate_times, label_changes, pairing_keys
from pyspark_persist.state import LeasedPart, PartRef


def _table(rows: list[tuple[Any, ...]]) -> pa.Table:
    """(id, name, _time, _diff) rows."""
    schema = pa.schema(
        [("id", pa.int64()), ("name", pa.string()), ("_time", pa.int64()), ("_diff", pa.int64())]
    )
    return pa.Table.from_pylist([dict(zip(schema.names, r, strict=True)) for r in rows], schema)


def _labelled(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(tuple(r.values()) for r in table.to_pylist())


def test_an_upsert_pairs_into_pre_and_post_images_and_lone_updates_are_inserts_and_deletes() -> (
    None
):
    updates = _table(
        [
            (1, "a", 1, 1),
            (2, "b", 1, 1),
            (1, "a", 2, -1),  # key 1 updated at time 2
            (1, "a2", 2, 1),
            (2, "b", 3, -1),  # key 2 deleted at time 3
            (3, "c", 3, 1),  # key 3 inserted at time 3
        ]
    )
    assert _labelled(label_changes(updates, ["id"])) == [
        (1, "a", 1, 1, "insert"),
        (1, "a", 2, -1, "update_preimage"),
        (1, "a2", 2, 1, "update_postimage"),
        (2, "b", 1, 1, "insert"),
        (2, "b", 3, -1, "delete"),
        (3, "c", 3, 1, "insert"),
    ]


def test_pairing_is_by_time_too_a_delete_then_a_later_insert_is_no_update() -> None:
    updates = _table([(1, "a", 1, 1), (1, "a", 2, -1), (1, "b", 3, 1)])
    assert [r[CHANGE_TYPE] for r in label_changes(updates, ["id"]).to_pylist()] == [
        "insert",
        "delete",
        "insert",
    ]


def test_an_upsert_of_an_unchanged_row_labels_nothing_and_split_updates_consolidate() -> None:
    """The retraction and insertion of the same row cancel (no change); one update read from
    two parts (before compaction) is labelled as the compacted one would be."""
    updates = _table([(1, "a", 1, 1), (1, "a", 2, -1), (1, "a", 2, 1), (2, "b", 2, 2)])
    updates = pa.concat_tables([updates, _table([(2, "b", 2, -1)])])
    assert _labelled(label_changes(updates, ["id"])) == [
        (1, "a", 1, 1, "insert"),
        (2, "b", 2, 1, "insert"),
    ]


def test_keys_of_several_columns_pair_only_when_every_key_column_matches() -> None:
    schema = pa.schema(
        [("region", pa.string()), ("id", pa.int64()), ("_time", pa.int64()), ("_diff", pa.int64())]
    )
    updates = pa.Table.from_pylist(
        [
            {"region": "eu", "id": 1, "_time": 5, "_diff": -1},
            {"region": "us", "id": 1, "_time": 5, "_diff": 1},
        ],
        schema,
    )
    labels = label_changes(updates, ["region", "id"]).column(CHANGE_TYPE).to_pylist()
    assert sorted(labels) == ["delete", "insert"]


def test_an_unkeyed_shard_is_labelled_by_sign_row_for_row_keeping_multiplicities() -> None:
    updates = _table([(1, "a", 1, 3), (1, "a", 2, -1), (1, "b", 2, 1), (1, "a", 2, 1)])
    out = label_changes(updates, ())
    assert out.to_pylist() == [
        {"id": 1, "name": "a", "_time": 1, "_diff": 3, CHANGE_TYPE: "insert"},
        {"id": 1, "name": "a", "_time": 2, "_diff": -1, CHANGE_TYPE: "delete"},
        {"id": 1, "name": "b", "_time": 2, "_diff": 1, CHANGE_TYPE: "insert"},
        {"id": 1, "name": "a", "_time": 2, "_diff": 1, CHANGE_TYPE: "insert"},
    ]


def test_nothing_to_label_gives_an_empty_labelled_table() -> None:
    for keys in ((), ("id",)):
        out = label_changes(_table([]), keys)
        assert out.num_rows == 0 and out.schema.field(CHANGE_TYPE).type == pa.string()


def _part(name: str, lo: int, hi: int, as_of: int | None = None) -> LeasedPart:
    ref = PartRef(key=name, inline=None, size_bytes=10, rows=1, min_time=lo, max_time=hi)
    return LeasedPart("s", "mem://", ref, 0, 100, as_of, 1)


def _names(splits: list[tuple[LeasedPart, ...]]) -> list[list[str | None]]:
    return sorted(sorted(p.part.key for p in s) for s in splits)


def test_colocate_times_joins_the_splits_of_one_commit_and_of_overlapping_compacted_parts() -> None:
    splits = [
        (_part("t1-a", 1, 1), _part("t3-a", 3, 3)),
        (_part("t1-b", 1, 1),),  # commit 1's other part: same task as t1-a
        (_part("t2", 2, 2),),  # alone at time 2: keeps its own task
        (_part("t5-7", 5, 7),),  # a compacted part spanning 5..7
        (_part("t6", 6, 6), _part("t9", 9, 9)),
    ]
    assert _names(colocate_times(splits)) == [
        ["t1-a", "t1-b", "t3-a"],
        ["t2"],
        ["t5-7", "t6", "t9"],
    ]


def test_colocate_times_puts_a_snapshots_parts_together_since_all_read_at_as_of() -> None:
    splits = [(_part("a", 1, 1, as_of=9),), (_part("b", 4, 4, as_of=9),), ()]
    assert _names(colocate_times(splits)) == [["a", "b"]]


def test_bad_combinations_are_refused_naming_the_fix() -> None:
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from pyspark_persist.options import PersistOptions
    from pyspark_persist.schema import check_change_type_column, read_schema
    from pyspark_persist.state.errors import InvalidUsage

    base = [StructField("id", LongType()), StructField("_time", LongType())]
    with pytest.raises(InvalidUsage, match=r"lacks it: add _change_type STRING NOT NULL"):
        check_change_type_column(StructType(base), change_types=True)
    labelled = StructType([*base, StructField(CHANGE_TYPE, StringType())])
    with pytest.raises(InvalidUsage, match=r'only .option\("changeTypes", "true"\) fills'):
        check_change_type_column(labelled, change_types=False)
    with pytest.raises(InvalidUsage, match="declare it STRING"):
        check_change_type_column(
            StructType([*base, StructField(CHANGE_TYPE, LongType())]), change_types=True
        )
    check_change_type_column(labelled, change_types=True)
    clash = pa.schema([("id", pa.int64()), (CHANGE_TYPE, pa.string())])
    with pytest.raises(InvalidUsage, match="has a column named _change_type"):
        read_schema(clash, change_types=True)
    assert read_schema(clash).fieldNames() == ["id", CHANGE_TYPE, "_time", "_diff"]
    with pytest.raises(InvalidUsage, match="history reads the shard's commits, so changeTypes"):
        PersistOptions.parse({"path": "s", "history": "true", "changeTypes": "true"}, "read")
    with pytest.raises(InvalidUsage, match="changeTypes applies to"):
        PersistOptions.parse({"path": "s", "changeTypes": "true"}, "write")


def test_a_read_without_retractions_keeps_its_splits_and_labels_by_sign() -> None:
    def part(dmin: int | None) -> LeasedPart:
        ref = PartRef(key="p", inline=None, size_bytes=1, rows=1, min_time=1, max_time=1, dmin=dmin)
        return LeasedPart("s", "mem://", ref, 0, 100, None, 1)

    assert pairing_keys(["id"], [(part(1),), (part(1),)]) == ()
    assert pairing_keys(["id"], [(part(1),), (part(-1),)]) == ("id",)
    assert pairing_keys(["id"], [(part(None),)]) == ("id",)  # unknown bounds: may retract


def test_a_read_with_change_types_must_return_what_labelling_needs() -> None:
    """changeTypes on a column subset: the subset keeps _diff (and, on a keyed shard, the keys
    and _time), or the read is refused on the driver naming what to add."""
    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from pyspark_persist.schema import check_change_columns
    from pyspark_persist.state.errors import InvalidUsage

    def schema(*names: str) -> StructType:
        return StructType([StructField(n, LongType()) for n in names])

    full = StructType([*schema("id", "v", "_time", "_diff"), StructField("x", StringType())])
    check_change_columns(full, ("id",), "s")
    check_change_columns(schema("v", "_diff"), (), "s")
    with pytest.raises(InvalidUsage, match="needs _diff"):
        check_change_columns(schema("v", "_time"), (), "s")
    with pytest.raises(InvalidUsage, match="needs id, _time"):
        check_change_columns(schema("v", "_diff"), ("id",), "s")
