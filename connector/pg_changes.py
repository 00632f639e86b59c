"""What one micro-batch of persist updates does to a PostgreSQL table, decided from its rows.

Pure (Arrow and Spark types in, Arrow, text and refusals out; no connection): the shell
that talks to PostgreSQL is :mod:`pyspark_persist.sinks`.

A persist stream is updates ``(row, _diff)`` (and ``_time``, and with ``changeTypes`` a
``_change_type``: both only describe the update, the table stores the row). Without keys
the table is the shard's multiset of rows: ``_diff`` copies of a row inserted for
``_diff > 0``, ``-_diff`` matching rows deleted for ``_diff < 0``. Inserting every
insertion before deleting every retraction is right whatever order the updates of the
micro-batch came in: the table the micro-batch ends at has every retracted row (a
retraction never exceeds what the shard held), so no consolidation is needed.

With keys the table has one row per key, the shard's current row: the micro-batch's
updates are consolidated per row, then each key it touched is deleted and, when a row of
it survives (net +1), that row inserted: an upsert on a keyed shard is ``(old, -1)`` and
``(new, +1)``, a delete ``(old, -1)`` alone. A key left with two rows, or a net diff past
one, means the keys given do not identify the shard's rows: refused.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
from pyspark.sql.types import DataType, DecimalType, StructType

from pyspark_persist.state import DIFF, TIME
from pyspark_persist.state.errors import InvalidUsage

CHANGE_TYPE = "_change_type"
METADATA = (DIFF, TIME, CHANGE_TYPE)
"""Columns of a persist read that describe an update rather than hold the row."""

COUNT = "_persist_n"
"""The column of the retractions' table: how many copies of the row to delete."""

PG_TYPES = {
    "long": "bigint",
    "integer": "integer",
    "short": "smallint",
    "byte": "smallint",
    "string": "text",
    "double": "double precision",
    "float": "real",
    "boolean": "boolean",
    "timestamp": "timestamptz",
    "timestamp_ntz": "timestamp",
    "date": "date",
    "binary": "bytea",
}
"""Spark's type names to the PostgreSQL types a created table uses (decimals: ``numeric``)."""


def data_columns(schema: StructType, keys: Sequence[str] | None, table: str) -> list[str]:
    """The columns of ``schema`` the table stores, checked: ``_diff`` present (a persist
    stream's), every key one of them, at least one column.

    Refused before anything is written, naming what is wrong and what to do.
    """
    names = schema.fieldNames()
    if DIFF not in names:
        raise InvalidUsage(
            f"sinks.postgres({table!r}): the micro-batch has no {DIFF} column (its columns: "
            f"{', '.join(names)}): it applies a persist stream's updates, so read the stream "
            f'with spark.readStream.format("persist") and keep {DIFF} in the select'
        )
    columns = [n for n in names if n not in METADATA]
    if not columns:
        raise InvalidUsage(
            f"sinks.postgres({table!r}): the micro-batch has only persist's update columns "
            f"({', '.join(names)}), no row to store"
        )
    missing = [k for k in keys or () if k not in columns]
    if missing:
        raise InvalidUsage(
            f"sinks.postgres({table!r}): key column(s) {', '.join(missing)} not in the "
            f"micro-batch's columns {', '.join(columns)}: give keys=[...] from these"
        )
    return columns


def pg_type(data_type: DataType, column: str, table: str) -> str:
    """The PostgreSQL type a created table gives a Spark column; refused for types a table
    created here does not hold (arrays, maps, structs: create the table yourself)."""
    if isinstance(data_type, DecimalType):
        return f"numeric({data_type.precision},{data_type.scale})"
    name = data_type.typeName()
    if name not in PG_TYPES:
        raise InvalidUsage(
            f"sinks.postgres({table!r}): column {column!r} is {data_type.simpleString()}, "
            f"which the sink cannot create a column for (it can: {', '.join(sorted(PG_TYPES))}, "
            "decimal); select it as one of those (to_json(...) for nested values)"
        )
    return PG_TYPES[name]


def insertions(updates: pa.Table, columns: Sequence[str]) -> pa.Table:
    """The rows to insert: each row with ``_diff > 0``, ``_diff`` times."""
    diffs = updates.column(DIFF).to_numpy(zero_copy_only=False)
    positive = diffs > 0
    if (diffs == 1).all():
        return updates.select(list(columns))
    index = np.flatnonzero(positive)
    return updates.select(list(columns)).take(np.repeat(index, diffs[index]))


def retractions(updates: pa.Table, columns: Sequence[str]) -> pa.Table:
    """The rows to delete, with how many copies of each (:data:`COUNT`), summed per row."""
    negative = updates.filter(pc.less(updates.column(DIFF), 0))
    if negative.num_rows == 0:
        return pa.table(
            {**{c: updates.column(c).slice(0, 0) for c in columns}, COUNT: pa.array([], pa.int64())}
        )
    summed = negative.group_by(list(columns), use_threads=False).aggregate([(DIFF, "sum")])
    return summed.select(list(columns)).append_column(
        COUNT, pc.negate(summed.column(f"{DIFF}_sum"))
    )


def keyed_changes(
    updates: pa.Table, columns: Sequence[str], keys: Sequence[str], table: str
) -> tuple[pa.Table, pa.Table]:
    """(the keys the micro-batch touched, one row each; the rows those keys hold after it).

    Delete the first from the table, insert the second: an upsert or delete by key.
    """
    summed = updates.group_by(list(columns), use_threads=False).aggregate([(DIFF, "sum")])
    net = summed.column(f"{DIFF}_sum")
    changed = summed.filter(pc.not_equal(net, 0))
    net = changed.column(f"{DIFF}_sum")
    if changed.num_rows and (pc.max(net).as_py() > 1 or pc.min(net).as_py() < -1):
        raise InvalidUsage(
            f"sinks.postgres({table!r}): with keys {list(keys)} a row's net diff in one "
            f"micro-batch is within [-1, 1], here [{pc.min(net).as_py()}, "
            f"{pc.max(net).as_py()}]: the keys do not identify the shard's rows (give the "
            "shard's key columns, or no keys for a table of every row)"
        )
    rows = changed.filter(pc.equal(net, 1)).select(list(columns))
    per_key = rows.group_by(list(keys), use_threads=False).aggregate([([], "count_all")])
    doubled = per_key.filter(pc.greater(per_key.column("count_all"), 1))
    if doubled.num_rows:
        key = doubled.select(list(keys)).slice(0, 1).to_pylist()[0]
        raise InvalidUsage(
            f"sinks.postgres({table!r}): key {key} "
            f"has {doubled.column('count_all')[0].as_py()} rows after the micro-batch: the keys "
            f"{list(keys)} do not identify the shard's rows (give the shard's key columns, or "
            "no keys for a table of every row)"
        )
    touched = changed.group_by(list(keys), use_threads=False).aggregate([]).select(list(keys))
    return touched, rows


def csv_payload(rows: pa.Table) -> bytes:
    """``rows`` as the CSV ``COPY ... (FORMAT csv)`` reads: no header, NULL as an empty
    unquoted field (every string is quoted, so an empty string stays one), binary as
    PostgreSQL's ``\\x`` hex."""
    for i, field in enumerate(rows.schema):
        if pa.types.is_binary(field.type) or pa.types.is_large_binary(field.type):
            hexed = pa.array(
                [None if v is None else "\\x" + v.hex() for v in rows.column(i).to_pylist()],
                pa.string(),
            )
            rows = rows.set_column(i, field.name, hexed)
    out = io.BytesIO()
    pa_csv.write_csv(rows, out, pa_csv.WriteOptions(include_header=False))
    return out.getvalue()
