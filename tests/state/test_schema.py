"""The shard's schema rules as pure functions: schemas and tables in, a schema, a table or a
refusal out (state/schema.py). No store, no client: what a write may add, what it must carry,
and how a read sees a part written before a column was added."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pyspark_persist.state import (
    DIFF,
    DIFF_TYPE,
    TIME,
    TIME_TYPE,
    conform_columns,
    decode_schema,
    encode_schema,
    evolve_schema,
)
from pyspark_persist.state.errors import CorruptData, InvalidUpdates, InvalidUsage, SchemaMismatch
from pyspark_persist.state.schema import (
    conform_inserts,
    conform_updates,
    schema_mismatch_message,
    validate_schema,
)

SHARD = pa.schema([pa.field("id", pa.int64(), nullable=False), ("name", pa.string())])


def test_evolving_adds_the_writes_new_nullable_columns_after_the_shards() -> None:
    """New columns go after the shard's, in the write's order; the shard's columns the write
    lacks stay; a write with nothing new leaves the schema as it is."""
    incoming = pa.schema([("score", pa.float64()), ("id", pa.int64()), ("tag", pa.string())])
    evolved = evolve_schema(SHARD, incoming, "s", "w")
    assert evolved.names == ["id", "name", "score", "tag"]
    assert evolved.field("id").nullable is False
    assert evolve_schema(SHARD, pa.schema([("name", pa.string())]), "s", "w").equals(SHARD)


@pytest.mark.parametrize(
    ("incoming", "says"),
    [
        ([("id", pa.int32())], "column 'id' is int32 in the write but int64 in the shard"),
        ([pa.field("score", pa.float64(), nullable=False)], "make it nullable"),
        ([("NAME", pa.string())], "collides with 'name'"),
        ([("_Time", pa.int64())], "collides with '_time'"),
    ],
)
def test_evolving_refuses_what_old_parts_could_not_read_naming_the_fix(
    incoming: list[pa.Field | tuple[str, pa.DataType]], says: str
) -> None:
    """A type change, a new non-nullable column (rows written before have nothing there) and a
    new name that only differs in case from another (Spark reads them as one) are refused with
    the column, the shard and the fix named, and the promise that nothing was written."""
    with pytest.raises(SchemaMismatch, match="Nothing was written") as refused:
        evolve_schema(SHARD, pa.schema(incoming), "events", "a merge-schema write")
    assert says in str(refused.value)
    assert "a merge-schema write: the columns do not fit shard 'events'" in str(refused.value)


def test_a_new_shards_schema_is_checked_and_loses_its_metadata() -> None:
    """A shard needs a pyarrow.Schema of at least one column, no reserved or repeated names;
    metadata (a pandas index, say) is not kept."""
    for bad, says in [
        ("id int", "must be a pyarrow.Schema"),
        (pa.schema([]), "at least one column"),
        (pa.schema([("id", pa.int64()), (TIME, pa.uint64())]), "reserved"),
        (pa.schema([("id", pa.int64()), ("id", pa.string())]), "duplicate"),
    ]:
        with pytest.raises(InvalidUsage, match=says):
            validate_schema(bad)  # type: ignore[arg-type]
    assert validate_schema(SHARD.with_metadata({b"pandas": b"{}"})).metadata is None


def test_a_schema_survives_state_and_unreadable_bytes_are_corrupt_data() -> None:
    """State keeps the schema as bytes: they decode to the same schema; bytes that are not a
    schema are CorruptData, never a wrong schema."""
    assert decode_schema(encode_schema(SHARD)).equals(SHARD)
    with pytest.raises(CorruptData, match="schema in state cannot be decoded"):
        decode_schema(b"not a schema")


def test_updates_come_out_in_part_layout() -> None:
    """Rows without ``_diff`` are inserts (+1); without ``_time`` they get 0 (the commit gives
    their time) and the caller learns they had none; a narrower integer ``_time`` is widened."""
    rows = pa.table({"id": [1, 2], "name": ["a", None]}, schema=SHARD)
    table, has_time = conform_updates(rows, SHARD, "s")
    assert not has_time
    assert table.schema.names == ["id", "name", TIME, DIFF]
    assert table.schema.field(TIME).type == TIME_TYPE and table.schema.field(DIFF).type == DIFF_TYPE
    assert table.column(TIME).to_pylist() == [0, 0] and table.column(DIFF).to_pylist() == [1, 1]
    timed = rows.append_column(TIME, pa.array([5, 6], pa.int32()))
    table, has_time = conform_updates(timed, SHARD, "s")
    assert has_time and table.column(TIME).type == TIME_TYPE
    assert table.column(TIME).to_pylist() == [5, 6]


@pytest.mark.parametrize(
    ("updates", "error", "says"),
    [
        (
            pa.table({"id": [1, None], "name": ["a", "b"]}),
            InvalidUpdates,
            "'id' of shard 's' is non-nullable",
        ),
        (
            pa.table({"id": [1], "name": ["a"], TIME: [-1]}),
            InvalidUpdates,
            "'_time' does not fit uint64",
        ),
        (
            pa.table({"id": [1], "name": ["a"], DIFF: pa.array([None], pa.int64())}),
            InvalidUpdates,
            "'_diff' has 1 nulls",
        ),
        (
            pa.table({"id": [1], "name": ["a"], TIME: ["x"]}),
            InvalidUpdates,
            "must be an integer column",
        ),
        (
            pa.table({"id": [1], "name": ["a"], "extra": [1]}),
            SchemaMismatch,
            "unexpected column 'extra'",
        ),
        ([1, 2], InvalidUpdates, "must be a pyarrow.Table or RecordBatch"),
    ],
)
def test_updates_that_do_not_fit_are_refused_naming_the_column(
    updates: object, error: type[Exception], says: str
) -> None:
    """A null in a non-nullable column, a time that is not an unsigned 64-bit integer, a null
    diff, a column the shard lacks, or not a table: each is refused by name, before anything
    is staged (a missing nullable column is refused too, unless the write merges schemas)."""
    with pytest.raises(error, match=says):
        conform_updates(updates, SHARD, "s")  # type: ignore[arg-type]


def test_only_a_merge_schema_write_may_leave_out_nullable_columns() -> None:
    """Without ``name`` the write is refused, naming the column and merge_schema; with
    ``fill_missing`` (merge_schema) it reads null there."""
    rows = pa.table({"id": [1, 2]})
    with pytest.raises(SchemaMismatch, match="missing column 'name'.*merge_schema=True"):
        conform_updates(rows, SHARD, "s")
    table, _ = conform_updates(rows, SHARD, "s", fill_missing=True)
    assert table.column("name").to_pylist() == [None, None]


def test_inserts_carry_row_columns_alone() -> None:
    """Rows staged as inserts come back with exactly the shard's columns (reordered, a missing
    nullable one refused as for any write); a ``_time`` or ``_diff`` column is refused."""
    rows = pa.table({"name": ["a"], "id": [1]})
    assert conform_inserts(rows, SHARD, "s").schema.names == ["id", "name"]
    with pytest.raises(InvalidUsage, match="carry no _time or _diff"):
        conform_inserts(rows.append_column(DIFF, pa.array([1])), SHARD, "s")


def test_a_part_written_before_a_column_was_added_reads_null_there() -> None:
    """A read conforms each part to the shard's columns now: a column added later is null,
    the part's own columns keep their values, and the order is the shard's."""
    now = SHARD.append(pa.field("score", pa.float64()))
    old = pa.table({"name": ["a", "b"], "id": [1, 2]})
    read = conform_columns(old, now)
    assert read.schema.names == ["id", "name", "score"]
    assert read.to_pylist() == [
        {"id": 1, "name": "a", "score": None},
        {"id": 2, "name": "b", "score": None},
    ]
    same = pa.table({"id": [1], "name": ["a"], "score": [0.5]})
    assert conform_columns(same, now) is same


def test_a_mismatch_message_names_every_difference() -> None:
    """Missing, unexpected, retyped and re-nulled columns are each named, with how to evolve;
    a mere change of order is named when it is the only difference."""
    actual = pa.schema(
        [pa.field("id", pa.int64(), nullable=True), ("name", pa.int32()), ("x", pa.int8())]
    )
    message = schema_mismatch_message("s", SHARD.append(pa.field("y", pa.int8())), actual, "evolve")
    for part in [
        "missing column 'y' (int8)",
        "unexpected column 'x' (int8)",
        "column 'name' is int32, the shard has string",
        "column 'id' is nullable, the shard's is non-nullable",
        "(evolve to add new columns",
    ]:
        assert part in message
    reordered = pa.schema([SHARD.field("name"), SHARD.field("id")])
    assert "column order ['name', 'id'] differs" in schema_mismatch_message("s", SHARD, reordered)
