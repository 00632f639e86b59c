"""Schemas between Spark and the shard: Spark's StructType <-> the shard's Arrow schema.

A shard created by the sink stores the DataFrame's columns (as Spark's own
Arrow conversion gives them, every field nullable so a query whose
nullability differs still matches); reads add ``_time`` and ``_diff``, both
``long`` (Spark has no unsigned type; times are milliseconds, far below 2^63),
and with ``changeTypes`` a string ``_change_type`` (see :mod:`.change_types`).
"""

from __future__ import annotations

import pyarrow as pa
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pyspark_persist.state import DIFF, TIME, evolve_schema
from pyspark_persist.state.errors import InvalidUsage, SchemaMismatch


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
