"""Schemas between Spark and the shard: Spark's StructType <-> the shard's Arrow schema.

A shard created by the sink stores the DataFrame's columns (as Spark's own
Arrow conversion gives them, every field nullable so a query whose
nullability differs still matches); reads add ``_time`` and ``_diff``, both
``long`` (Spark has no unsigned type; times are milliseconds, far below 2^63),
and with ``changeTypes`` a string ``_change_type`` (see :mod:`.change_types`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pyspark_persist.state import DIFF, TIME, evolve_schema, select_columns
from pyspark_persist.state.errors import InvalidUsage, SchemaMismatch

RESERVED = (TIME, DIFF)
"""The columns every read may return besides the shard's."""
SHARD_COLUMN = "_shard"
"""The column a stream of several shards (``shards``) names each row's shard in."""


VARIABLE_WIDTH_BYTES = 36
"""The bytes a string, binary or nested value is counted as in :func:`read_share` (a row's
width is not in a part's statistics): 32 of data and its 4-byte offset."""
CHECKSUM_SHARE = 1 / 8
"""What the columns a read skips still cost it, as a share of their bytes: a task checks the
whole part's checksum (state/fetch.py) at memory speed, about eight times as fast as Spark
takes the named columns' rows from a Python source."""


def read_share(shard_schema: pa.Schema, names: Sequence[str]) -> float:
    """The share of a part's stored bytes that a read of the shard columns ``names`` costs.

    Splits are sized by bytes (``splitSizeBytes``); a read of 2 of 40 columns handing Spark
    a twentieth of each part's bytes would otherwise be cut into as many tasks as a full
    scan, each with little to do but its start-up (measured on a 40-column 512 MiB shard:
    9 tasks took twice the time of 2). Each column counts its fixed width (strings and
    nested values :data:`VARIABLE_WIDTH_BYTES`), ``_time`` and ``_diff`` 8 each; the columns
    skipped add :data:`CHECKSUM_SHARE` of theirs. A read of every column costs 1.0.
    """
    widths = {f.name: _width(f.type) for f in shard_schema}
    stored = sum(widths.values()) + 16
    read = sum(widths[n] for n in names if n in widths) + 16
    if read >= stored:
        return 1.0
    return min(1.0, (read + CHECKSUM_SHARE * (stored - read)) / stored)


def _width(t: pa.DataType) -> float:
    """The bytes one value of ``t`` is counted as (see :func:`read_share`)."""
    try:
        return t.bit_width / 8
    except ValueError:  # variable width: strings, binary, lists, structs
        return VARIABLE_WIDTH_BYTES


def read_schema(shard_schema: pa.Schema, change_types: bool = False) -> StructType:
    """The Spark schema of a read: the shard's columns, then ``_time`` and ``_diff`` (and
    ``_change_type`` with ``changeTypes``)."""
    from pyspark_persist.change_types import CHANGE_TYPE

    fields = list(from_arrow_schema(shard_schema).fields)
    fields += [StructField(TIME, LongType(), False), StructField(DIFF, LongType(), False)]
    if change_types:
        if CHANGE_TYPE in shard_schema.names:
            raise InvalidUsage(
                f"persist: the shard has a column named {CHANGE_TYPE}, which changeTypes would "
                "add: read without changeTypes, or rename the column"
            )
        fields.append(StructField(CHANGE_TYPE, StringType(), False))
    return StructType(fields)


def union_read_schema(shard_schemas: Mapping[str, pa.Schema]) -> StructType:
    """The Spark schema of a stream of several shards: every column of any of them, in the
    order first met (shards in the order named), all nullable (a row of one shard is null in
    another's columns), then ``_shard``, ``_time`` and ``_diff``.

    A column two shards hold with different types has no one type to read it as: refused,
    naming both, before anything runs.
    """
    fields: dict[str, StructField] = {}
    owner: dict[str, str] = {}
    for shard, schema in shard_schemas.items():
        if SHARD_COLUMN in schema.names:
            raise InvalidUsage(
                f"persist: shard {shard!r} has a column named {SHARD_COLUMN}, which a stream of "
                "several shards adds: read it alone (option shard)"
            )
        for f in from_arrow_schema(schema).fields:
            seen = fields.get(f.name)
            if seen is None:
                fields[f.name] = StructField(f.name, f.dataType, True)
                owner[f.name] = shard
            elif seen.dataType != f.dataType:
                raise SchemaMismatch(
                    f"persist: column {f.name!r} is {seen.dataType.simpleString()} in shard "
                    f"{owner[f.name]!r} but {f.dataType.simpleString()} in shard {shard!r}, so "
                    "a stream of both has no one type for it: read them in two streams and "
                    "cast before a union"
                )
    return StructType(
        [
            *fields.values(),
            StructField(SHARD_COLUMN, StringType(), False),
            StructField(TIME, LongType(), False),
            StructField(DIFF, LongType(), False),
        ]
    )


def check_union_schema(given: StructType, union: StructType) -> None:
    """A ``.schema(...)`` given to a stream of several shards must name columns of the union
    (:func:`union_read_schema`) with its types and ``_shard``: checked on the driver."""
    if SHARD_COLUMN not in given.fieldNames():
        raise InvalidUsage(
            f"persist: a stream of several shards tags each row with {SHARD_COLUMN}: add "
            f"{SHARD_COLUMN} STRING to the schema given to .schema(...), or drop the schema"
        )
    known = {f.name: f for f in union.fields}
    for f in given.fields:
        have = known.get(f.name)
        if have is None:
            raise SchemaMismatch(
                f"persist: none of the shards has a column {f.name!r}: the columns are "
                f"{', '.join(known)}"
            )
        if have.dataType != f.dataType:
            raise SchemaMismatch(
                f"persist: column {f.name!r} is {have.dataType.simpleString()}, but the schema "
                f"says {f.dataType.simpleString()}: declare it as {have.dataType.simpleString()}"
            )
        if have.nullable and not f.nullable:
            raise SchemaMismatch(
                f"persist: column {f.name!r} is null in the rows of shards without it: declare "
                "it nullable"
            )


def check_change_columns(schema: StructType, keys: Sequence[str], shard: str) -> None:
    """A read with ``changeTypes`` returns what labelling needs: ``_diff`` (its sign tells an
    insert from a delete), and on a keyed shard its keys and ``_time`` (an update is a key's
    retraction and insertion at one time). Checked on the driver, before any task."""
    missing = [n for n in (*keys, TIME, DIFF) if n not in schema.fieldNames()]
    if keys:
        why = f"pairs shard {shard!r}'s updates by its keys and _time and labels them by _diff"
    else:
        missing = [n for n in missing if n == DIFF]
        why = "labels each update by the sign of its _diff"
    if missing:
        raise InvalidUsage(
            f"persist read: changeTypes {why}, so the read needs {', '.join(missing)}: add "
            f"{'it' if len(missing) == 1 else 'them'} to the schema (or the columns option), "
            "or drop changeTypes"
        )


def check_change_type_column(schema: StructType, change_types: bool) -> None:
    """A read's schema (the user's, if given one) has ``_change_type`` exactly when the read
    has ``changeTypes``: Spark would otherwise fail on the first batch, far from the cause."""
    from pyspark_persist.change_types import CHANGE_TYPE

    has = CHANGE_TYPE in schema.fieldNames()
    if change_types and not has:
        raise InvalidUsage(
            f"persist: changeTypes adds a {CHANGE_TYPE} column, but the read's schema lacks it: "
            f"add {CHANGE_TYPE} STRING NOT NULL to the schema given to .schema(...), or drop "
            "the schema to read the shard's own"
        )
    if has and not change_types:
        raise InvalidUsage(
            f"persist: the read's schema has a {CHANGE_TYPE} column, which only "
            '.option("changeTypes", "true") fills: add that option, or drop the column'
        )
    if has and not isinstance(schema[CHANGE_TYPE].dataType, StringType):
        raise InvalidUsage(
            f"persist: {CHANGE_TYPE} is a string column, the read's schema gives it "
            f"{schema[CHANGE_TYPE].dataType.simpleString()}: declare it STRING"
        )


def read_columns(
    shard_schema: pa.Schema,
    schema: StructType,
    shard: str,
    columns: tuple[str, ...] | None = None,
) -> list[str]:
    """The shard columns a read returning ``schema`` reads, in its order; checked on the
    driver before any task runs.

    ``schema`` is what Spark hands the reader: the user's ``.schema(...)``, or the
    one :func:`read_schema` derived. Each of its columns must be one of the shard's
    with the type Spark reads it as (and nullable where the shard's is), or
    ``_time``/``_diff`` as ``long``; ``columns`` (the option), if also given, must
    name the same ones. A mismatch is a SchemaMismatch naming the column, both types
    and the fix, instead of nulls or a failed cast in a task.
    """
    who = "persist read"
    for name in RESERVED:
        if name in schema.fieldNames() and not isinstance(schema[name].dataType, LongType):
            raise SchemaMismatch(
                f"{who}: column {name} is a long (bigint), not "
                f"{schema[name].dataType.simpleString()}: declare it as long in the schema"
            )
    from pyspark_persist.change_types import CHANGE_TYPE

    names = [n for n in schema.fieldNames() if n not in (*RESERVED, CHANGE_TYPE)]
    if columns is not None and names != [n for n in columns if n not in RESERVED]:
        raise InvalidUsage(
            f"{who}: the schema's columns {names} and option columns={','.join(columns)} "
            "differ: give one of them (either reads only the columns it names)"
        )
    selected = select_columns(shard_schema, names, shard, who)
    for field, stored in zip(
        (schema[n] for n in names), from_arrow_schema(selected).fields, strict=True
    ):
        if field.dataType != stored.dataType:
            raise SchemaMismatch(
                f"{who}: column {field.name!r} of shard {shard!r} is "
                f"{stored.dataType.simpleString()}, but the schema says "
                f"{field.dataType.simpleString()}: declare it as "
                f"{stored.dataType.simpleString()} (cast it after reading for another type)"
            )
        if stored.nullable and not field.nullable:
            raise SchemaMismatch(
                f"{who}: column {field.name!r} of shard {shard!r} may hold nulls, but the schema "
                "declares it NOT NULL: declare it nullable"
            )
    return names


def output_arrow_schema(schema: StructType) -> pa.Schema:
    """The exact Arrow schema Spark expects from ``read()`` for ``schema``."""
    return to_arrow_schema(schema, timezone="UTC")


def write_schema(schema: StructType) -> tuple[pa.Schema, bool]:
    """The shard schema for a DataFrame, and whether it carries its own ``_diff`` column.

    ``_time`` is assigned by the sink at commit (the micro-batch's time), so a
    ``_time`` input column is refused with the fix spelled out.
    """
    names = schema.fieldNames()
    if TIME in names:
        raise InvalidUsage(
            "persist sink: the DataFrame has a _time column, but the sink assigns each "
            "micro-batch's time itself: drop or rename _time (use the Python API "
            "compare_and_append to choose times)"
        )
    has_diff = DIFF in names
    if has_diff and not isinstance(schema[DIFF].dataType, LongType):
        raise InvalidUsage(
            f"persist sink: column _diff must be a long (bigint) multiplicity, got "
            f"{schema[DIFF].dataType.simpleString()}: cast it, e.g. col('_diff').cast('long')"
        )
    rows = StructType([f for f in schema.fields if f.name != DIFF])
    if not rows.fields:
        raise InvalidUsage("persist sink: the DataFrame has no columns besides _diff")
    arrow = to_arrow_schema(rows, timezone="UTC")
    return pa.schema([f.with_nullable(True) for f in arrow]), has_diff


def sink_schema(shard_schema: pa.Schema, frame: pa.Schema, shard: str, merge: bool) -> pa.Schema:
    """The schema a sink stages with: the shard's, plus the DataFrame's new columns if ``merge``.

    Delta's rules: a new column needs ``mergeSchema`` (and may only be added,
    nullable, never retyped); a shard column the DataFrame lacks is written as
    null (so it must be nullable). Checked on the driver before any task runs,
    so a refused write stages nothing.
    """
    evolved = evolve_schema(shard_schema, frame, shard, "persist sink")
    new = [f for f in frame if f.name not in shard_schema.names]
    absent = [f"{f.name!r} ({f.type})" for f in shard_schema if f.name not in frame.names]
    if new and not merge:
        listed = ", ".join(f"{f.name!r} ({f.type})" for f in new)
        renamed = (
            f" (and lacks the shard's {', '.join(absent)}: a column cannot be renamed)"
            if absent
            else ""
        )
        raise SchemaMismatch(
            f"persist sink: the DataFrame has column(s) {listed} that shard {shard!r} "
            f"lacks{renamed}: to add them to the shard's schema, write with "
            '.option("mergeSchema", "true") (rows written before read null there), or drop '
            "them. Nothing was written"
        )
    required = [f.name for f in shard_schema if f.name not in frame.names and not f.nullable]
    if required:
        raise SchemaMismatch(
            f"persist sink: the DataFrame lacks column(s) {required} of shard {shard!r}, which "
            "are non-nullable (a missing nullable column is written as null): add them. "
            "Nothing was written"
        )
    return evolved
