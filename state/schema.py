"""The shard's columns: its row schema, the part layout around it, and how a write must fit.

A shard's schema is the user's row columns (an Arrow schema fixed at
creation and evolved only by adding nullable columns, :func:`evolve_schema`).
Every part holds those columns plus ``_time`` (uint64) and ``_diff`` (int64)
(:func:`data_schema`). A write's updates are checked against the schema and
brought into that layout before anything is staged (:func:`conform_updates`,
:func:`conform_inserts`), so a bad write fails before a byte is written; a
read brings a part written before a column was added to the shard's columns
(:func:`conform_columns`). Pure: every function depends on its arguments
alone (the caches below only remember answers).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from .columns import constant_column
from .errors import CorruptData, InvalidUpdates, InvalidUsage, SchemaMismatch

TIME = "_time"
"""The column of an update's time in every part (and in reads that keep times)."""
DIFF = "_diff"
"""The column of an update's multiplicity: +1 an insert, -1 a retraction."""
RESERVED = (TIME, DIFF)
"""Column names a shard's own columns may not take."""
TIME_TYPE = pa.uint64()
"""The type of ``_time`` in a part."""
DIFF_TYPE = pa.int64()
"""The type of ``_diff`` in a part."""
MAX_TIME = 2**64 - 1
"""The largest time (``_time`` is unsigned 64-bit)."""


def validate_schema(schema: pa.Schema) -> pa.Schema:
    """Check a user schema for shard creation: at least one column, no reserved names."""
    if not isinstance(schema, pa.Schema):
        raise InvalidUsage(f"a shard schema must be a pyarrow.Schema, got {type(schema).__name__}")
    if len(schema) == 0:
        raise InvalidUsage("a shard schema needs at least one column")
    clash = [n for n in schema.names if n in RESERVED]
    if clash:
        raise InvalidUsage(
            f"column names {clash} are reserved for persist's update time and multiplicity; "
            "rename those columns"
        )
    if len(set(schema.names)) != len(schema.names):
        raise InvalidUsage(f"schema has duplicate column names: {schema.names}")
    return schema.remove_metadata()


@functools.lru_cache(maxsize=64)
def data_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of a part: the row columns, then ``_time`` and ``_diff`` (cached per schema)."""
    return schema.append(pa.field(TIME, TIME_TYPE, nullable=False)).append(
        pa.field(DIFF, DIFF_TYPE, nullable=False)
    )


def encode_schema(schema: pa.Schema) -> bytes:
    """Serialize a schema for the shard's state."""
    return bytes(schema.serialize().to_pybytes())


@functools.lru_cache(maxsize=64)
def decode_schema(data: bytes) -> pa.Schema:
    """Read a schema that :func:`encode_schema` wrote (cached: handles follow state's schema)."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptData(f"the shard's schema in state cannot be decoded: {e}") from e


def schema_mismatch_message(
    shard: str, expected: pa.Schema, actual: pa.Schema, add_hint: str = ""
) -> str:
    """Say which columns differ between two schemas, so the user knows what to change.

    ``add_hint`` says how the caller could add columns the shard lacks instead.
    """
    exp = {f.name: f.type for f in expected}
    act = {f.name: f.type for f in actual}
    missing = [f"missing column {n!r} ({t})" for n, t in exp.items() if n not in act]
    extra = [f"unexpected column {n!r} ({t})" for n, t in act.items() if n not in exp]
    problems = missing + extra
    evolve = (
        f" ({add_hint} to add new columns or write null in missing nullable ones)"
        if add_hint and (missing or extra)
        else ""
    )
    problems += [
        f"column {n!r} is {act[n]}, the shard has {t}"
        for n, t in exp.items()
        if n in act and act[n] != t
    ]
    exp_null = {f.name: f.nullable for f in expected}
    problems += [
        f"column {f.name!r} is {'nullable' if f.nullable else 'non-nullable'}, the shard's is "
        f"{'nullable' if exp_null[f.name] else 'non-nullable'}"
        for f in actual
        if f.name in exp_null
        and f.name in exp
        and exp[f.name] == f.type
        and exp_null[f.name] != f.nullable
    ]
    if not problems and expected.names != actual.names:
        problems.append(f"column order {actual.names} differs from the shard's {expected.names}")
    return (
        f"schema does not match shard {shard!r}: {'; '.join(problems)}. "
        f"Write with the shard's schema{evolve} or use a new shard name"
    )


def evolve_schema(current: pa.Schema, incoming: pa.Schema, shard: str, who: str) -> pa.Schema:
    """The shard schema once a write with ``incoming``'s row columns evolves ``current``.

    Only additions are possible, because parts are immutable: a column added
    later is null in every part written before it, so it must be nullable, and
    a column's type never changes (old parts keep theirs). New columns go
    after the existing ones in ``incoming``'s order; columns of ``current``
    that ``incoming`` lacks stay. ``who`` names the write in messages. Raises
    SchemaMismatch naming the column, both types and the fix.
    """
    known = {f.name: f for f in current}
    taken = {n.lower(): n for n in (*current.names, *RESERVED)}
    problems: list[str] = []
    added: list[pa.Field] = []
    for f in incoming:
        old = known.get(f.name)
        if old is not None:
            if old.type != f.type:
                problems.append(
                    f"column {f.name!r} is {f.type} in the write but {old.type} in the shard: a "
                    f"column's type cannot change (parts already written keep {old.type}); cast "
                    f"it back to {old.type}, or write to a new shard"
                )
            continue
        if f.name.lower() in taken:
            problems.append(
                f"new column {f.name!r} collides with {taken[f.name.lower()]!r} (names differ "
                "only in case, which Spark reads as one column, or it is reserved): rename it"
            )
        elif not f.nullable:
            problems.append(
                f"new column {f.name!r} ({f.type}) is non-nullable, but the rows written before "
                "it have no value there (they read as null): make it nullable"
            )
        else:
            taken[f.name.lower()] = f.name
            added.append(f)
    if problems:
        raise SchemaMismatch(
            f"{who}: the columns do not fit shard {shard!r}: {'; '.join(problems)}. "
            "Nothing was written"
        )
    evolved = current
    for f in added:
        evolved = evolved.append(f)
    return evolved


def select_columns(schema: pa.Schema, columns: Sequence[str], shard: str, who: str) -> pa.Schema:
    """The shard's row ``schema`` narrowed to ``columns``, in their order: what a read of
    only those columns returns (``_time`` and ``_diff`` may be named; they are left out).

    A name the shard lacks is refused (SchemaMismatch naming it, a column that differs
    only in case, and the shard's columns), before anything is read.
    """
    names = [n for n in columns if n not in RESERVED]
    if len(set(names)) != len(names):
        raise InvalidUsage(f"{who}: column(s) named twice in {list(columns)}: name each once")
    missing = [n for n in names if n not in schema.names]
    if missing:
        lower = {n.lower(): n for n in schema.names}
        hints = [
            f"{n!r} (did you mean {lower[n.lower()]!r}?)" for n in missing if n.lower() in lower
        ]
        plain = [repr(n) for n in missing if n.lower() not in lower]
        raise SchemaMismatch(
            f"{who}: shard {shard!r} has no column(s) {', '.join(hints + plain)}; its columns "
            f"are {', '.join(schema.names)} (and {TIME}, {DIFF}): read only columns it has"
        )
    return pa.schema([schema.field(n) for n in names])


def conform_columns(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns, in its order: the read side of evolution.

    A part written before a column was added lacks it and reads null there;
    columns it has keep their own type (a caller casting to ``schema`` after
    does that). Free when the part already has the schema's columns in order.
    """
    if table.schema.names == schema.names:
        return table
    n = table.num_rows
    have = set(table.column_names)
    fields = [table.schema.field(f.name) if f.name in have else f for f in schema]
    arrays = [table.column(f.name) if f.name in have else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def conform_updates(
    updates: pa.Table | pa.RecordBatch,
    schema: pa.Schema,
    shard: str,
    *,
    fill_missing: bool = False,
) -> tuple[pa.Table, bool]:
    """Check updates against the shard's schema and add missing ``_diff`` (+1).

    Returns the table in part layout (``_time`` zero-filled when absent) and
    whether the input carried its own ``_time`` column. With ``fill_missing``
    (a merge-schema write) nullable shard columns the updates lack are null.
    The checks of the column names and types are planned once per pair of
    schemas (:func:`_conform_plan`): a sink hands over thousands of batches of
    one schema, and re-deriving the same answer cost more than the batch's copy.
    """
    if isinstance(updates, pa.RecordBatch):
        updates = pa.Table.from_batches([updates])
    if not isinstance(updates, pa.Table):
        raise InvalidUpdates(
            f"updates must be a pyarrow.Table or RecordBatch, got {type(updates).__name__}"
        )
    plan = _conform_plan(updates.schema, schema, shard, fill_missing)
    n = updates.num_rows
    if n == 0:
        return plan.out_schema.empty_table(), plan.has_time
    given = updates.columns  # one call: each Table.column(i) costs as much as all of them
    time = _checked_column(_source(given, plan.time), n, TIME, TIME_TYPE, 0)
    diff = _checked_column(_source(given, plan.diff), n, DIFF, DIFF_TYPE, 1)
    columns = _row_columns(plan, given, n, schema, shard)
    if plan.exact:
        return updates, plan.has_time  # already in part layout: every column checked above
    return pa.Table.from_arrays([*columns, time, diff], schema=plan.out_schema), plan.has_time


def conform_inserts(rows: pa.Table, schema: pa.Schema, shard: str) -> pa.Table:
    """Check rows that are all inserts at the commit's time against the shard's schema.

    What :func:`conform_updates` checks of the row columns, for the insert-only
    sink path: an ``arrow-rows`` part stores the row columns alone, so the
    constant ``_time`` and ``_diff`` columns are never built (nor checked
    constant and dropped again by the encoder: together 17% of staging in a
    sink profile). Returns the rows with exactly the shard's columns.
    """
    plan = _conform_plan(rows.schema, schema, shard, False)
    if plan.time is not None or plan.diff is not None:
        raise InvalidUsage(
            "rows staged as inserts carry no _time or _diff column: stage updates with "
            "their own times or diffs through BatchBuilder.add"
        )
    columns = _row_columns(plan, rows.columns, rows.num_rows, schema, shard)
    if rows.schema.equals(schema, check_metadata=True):
        return rows
    return pa.Table.from_arrays(columns, schema=schema)


def _row_columns(
    plan: _ConformPlan, given: list[pa.ChunkedArray], n: int, schema: pa.Schema, shard: str
) -> list[pa.ChunkedArray | pa.Array]:
    """The shard's row columns from ``given`` (absent ones null), non-nullable ones checked."""
    columns = [
        given[i] if i is not None else pa.nulls(n, f.type)
        for i, f in zip(plan.sources, schema, strict=True)
    ]
    for i in plan.non_nullable:
        if columns[i].null_count:
            raise InvalidUpdates(
                f"column {schema[i].name!r} of shard {shard!r} is non-nullable but "
                f"{columns[i].null_count} updates have a null there: fill or drop those rows"
            )
    return columns


def _source(columns: list[pa.ChunkedArray], index: int | None) -> pa.ChunkedArray | None:
    return None if index is None else columns[index]


@dataclass(frozen=True)
class _ConformPlan:
    """How updates of one schema become part layout for one shard schema."""

    sources: tuple[int | None, ...]
    """For each shard column, its index in the updates (None: filled with nulls)."""
    non_nullable: tuple[int, ...]
    """Shard columns that must hold no null (checked on every table: Arrow does not enforce a
    field's nullability, so only the data can tell)."""
    time: int | None
    """The index of the updates' ``_time`` column (None: absent)."""
    diff: int | None
    """The index of the updates' ``_diff`` column (None: absent)."""
    out_schema: pa.Schema
    exact: bool
    """The updates' schema is ``out_schema`` itself (metadata too): once their values pass the
    checks, the updates are returned as they are instead of rebuilt column by column."""

    @property
    def has_time(self) -> bool:
        """Whether the updates carry their own ``_time``."""
        return self.time is not None


_last_plan: tuple[pa.Schema, pa.Schema, str, bool, _ConformPlan] | None = None
"""The last plan :func:`_conform_plan` handed out and what it was asked for. A writer's
updates share one schema, and comparing two schemas costs a fraction of hashing them for the
plan cache (both, on every one-row append: 16 us of its conforming's 53)."""


def _conform_plan(
    given: pa.Schema, schema: pa.Schema, shard: str, fill_missing: bool
) -> _ConformPlan:
    """The plan for ``given`` updates of a shard of ``schema`` (see :func:`_plan_conform`)."""
    global _last_plan  # noqa: PLW0603 - a one-entry cache, replaced atomically
    last = _last_plan
    if (
        last is not None
        and last[2] == shard
        and last[3] == fill_missing
        and (last[0] is given or last[0].equals(given, check_metadata=True))
        and (last[1] is schema or last[1].equals(schema, check_metadata=True))
    ):
        return last[4]
    plan = _plan_conform(given, schema, shard, fill_missing)
    _last_plan = (given, schema, shard, fill_missing, plan)
    return plan


@functools.lru_cache(maxsize=64)
def _plan_conform(
    given: pa.Schema, schema: pa.Schema, shard: str, fill_missing: bool
) -> _ConformPlan:
    """Check a write's columns against the shard's once; SchemaMismatch when they do not fit.

    Exact equality (the usual case: the writer built its updates with the shard's
    schema) takes no per-column look-up at all.
    """
    out = data_schema(schema)
    row_fields = [f for f in given if f.name not in RESERVED]
    if given.equals(schema) or given.equals(out):
        sources: tuple[int | None, ...] = tuple(range(len(schema)))
    else:
        if [(f.name, f.type) for f in row_fields] != [(f.name, f.type) for f in schema]:
            types = {f.name: f.type for f in row_fields}
            missing = [f for f in schema if f.name not in types]
            if not (
                set(types) <= set(schema.names)
                and all(types[f.name] == f.type for f in schema if f.name in types)
                and (not missing or (fill_missing and all(f.nullable for f in missing)))
            ):
                raise SchemaMismatch(
                    schema_mismatch_message(
                        shard, schema, pa.schema(row_fields), "write with merge_schema=True"
                    )
                )
        index = {name: i for i, name in enumerate(given.names)}
        sources = tuple(index.get(f.name) for f in schema)
    non_nullable = tuple(i for i, f in enumerate(schema) if not f.nullable)
    exact = given.equals(out, check_metadata=True)
    return _ConformPlan(sources, non_nullable, _index(given, TIME), _index(given, DIFF), out, exact)


def _index(schema: pa.Schema, name: str) -> int | None:
    """The index of the first column ``name`` of ``schema``; None when it has none."""
    return schema.names.index(name) if name in schema.names else None


def _checked_column(
    col: pa.ChunkedArray | None, rows: int, name: str, typ: pa.DataType, default: int
) -> pa.ChunkedArray | pa.Array:
    """The column, checked and cast to ``typ``; or ``default`` repeated when it is absent."""
    if col is None:
        return constant_column(default, rows, typ)
    if col.null_count:
        raise InvalidUpdates(f"column {name!r} has {col.null_count} nulls; every update needs one")
    if col.type == typ:
        return col
    if not pa.types.is_integer(col.type):
        raise InvalidUpdates(f"column {name!r} must be an integer column ({typ}), got {col.type}")
    try:
        return pc.cast(col, typ, safe=True)
    except pa.ArrowInvalid as e:
        raise InvalidUpdates(f"column {name!r} does not fit {typ}: {e}") from e
