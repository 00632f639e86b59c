"""Parts: Arrow updates <-> the bytes persisted in Blob (Parquet or Arrow IPC) or inline in state.

Every part holds the shard's row columns plus ``_time`` (uint64) and
``_diff`` (int64), stored, or (an ``arrow-rows`` part: inserts at one time,
what the Spark sink stages) recorded once in its reference and added back
as constant columns by every read. A part is written once under a fresh key and never
changed; what a reader sees of it is further shaped by the part's
``ts_rewrite`` and by the time bounds of the snapshot or listen that handed it
out (a :class:`LeasedPart`), so one stored part serves every read.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from zlib_ng.zlib_ng import crc32 as _crc32

from .blob import Blob, BlobWriter
from .errors import (
    CorruptData,
    InvalidUpdates,
    InvalidUsage,
    PartNotFound,
    SchemaMismatch,
)
from .state import PartRef, Time

TIME = "_time"
DIFF = "_diff"
RESERVED = (TIME, DIFF)
TIME_TYPE = pa.uint64()
DIFF_TYPE = pa.int64()
MAX_TIME = 2**64 - 1
PARQUET = "parquet"
ARROW = "arrow"
ARROW_ROWS = "arrow-rows"
"""An Arrow IPC stream of the row columns only: every update of the part is an insert (diff
+1) at the one time its reference records, so ``_time`` and ``_diff`` are not stored. On the
Spark sink's rows (int64, float64, 32-char string) that is 16 of every 68 bytes not copied,
checksummed, written or mapped back."""
PART_FORMATS = (PARQUET, ARROW, ARROW_ROWS)


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


SMALL_ROWS = 64
"""Up to this many rows, plain Python beats a compute kernel's fixed cost (tiny writes)."""


def _bounds(col: pa.ChunkedArray | pa.Array, rows: int) -> tuple[int, int]:
    if rows <= SMALL_ROWS:
        values = col.to_pylist()
        return min(values), max(values)
    numbers = _numeric_view(col)
    if numbers is not None:
        return int(numbers.min()), int(numbers.max())
    mm = pc.min_max(col)
    return int(mm["min"].as_py()), int(mm["max"].as_py())


def _numeric_view(col: pa.ChunkedArray | pa.Array) -> np.ndarray[Any, Any] | None:
    """A numpy view of a null-free, one-chunk integer or float column's values; else None.

    numpy's min and max over the view run in a tenth of the time ``pc.min_max`` takes
    for the same 65,536 values (its kernel call and result struct dominate). No
    ``Array.to_numpy``: it imports pandas (see :func:`constant_column`).
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) != 1 or chunks[0].null_count:
        return None
    arr = chunks[0]
    typ = arr.type
    if pa.types.is_floating(typ):
        kind = "f"
    elif pa.types.is_signed_integer(typ):
        kind = "i"
    elif pa.types.is_unsigned_integer(typ):
        kind = "u"
    else:
        return None
    width = typ.bit_width // 8
    return np.frombuffer(
        arr.buffers()[1], f"<{kind}{width}", count=len(arr), offset=arr.offset * width
    )


def time_bounds(table: pa.Table) -> tuple[Time, Time]:
    """The smallest and largest ``_time`` of a non-empty part table."""
    return _bounds(table.column(TIME), table.num_rows)


def part_ref(
    table: pa.Table,
    key: str | None,
    inline: bytes | None,
    size: int,
    crc: int | None = None,
    fmt: str = PARQUET,
) -> PartRef:
    """Describe a non-empty part: where it lives, its size, and its time and diff ranges.

    Column statistics (for skipping parts on reads) are kept for Blob parts
    only: an inline part is tiny and read straight from state anyway.
    """
    stats = PartStats(with_columns=key is not None)
    stats.add(table)
    return stats.ref(key, inline, size, crc, fmt)


MAX_STAT_STRING = 64


class PartStats:
    """The time, diff and column ranges of a part, gathered table by table as it is written.

    Lets a part be encoded as its rows arrive (no whole-part table to scan at
    the end). Column (min, max) are kept for integer, floating and short string
    columns, ignoring nulls, and only where they compare exactly: a column that
    shows a NaN or a string longer than MAX_STAT_STRING anywhere gets no range
    (a truncated bound could skip a part wrongly).
    """

    def __init__(self, with_columns: bool = True) -> None:
        self.rows = 0
        self._time: tuple[int, int] | None = None
        self._diff: tuple[int, int] | None = None
        self._with_columns = with_columns
        self._columns: dict[str, tuple[Any, Any]] = {}
        self._unusable: set[str] = set()

    def add(self, table: pa.Table | pa.RecordBatch, insert_time: int | None = None) -> None:
        """Fold the ranges of ``table`` (in part layout) into the part's.

        With ``insert_time`` the table holds the row columns only, every one an
        insert at that time (an ``arrow-rows`` batch).
        """
        n = table.num_rows
        if n == 0:
            return
        self.rows += n
        if insert_time is None:
            self._time = _merge(self._time, _bounds(table.column(TIME), n))
            self._diff = _merge(self._diff, _bounds(table.column(DIFF), n))
        else:
            self._time = _merge(self._time, (insert_time, insert_time))
            self._diff = _merge(self._diff, (1, 1))
        if not self._with_columns:
            return
        for f in table.schema:
            if f.name in RESERVED or f.name in self._unusable or not _has_stats(f.type):
                continue
            col = table.column(f.name)
            if col.null_count == len(col):
                continue
            bounds = _column_bounds(col)
            if bounds is None:
                self._unusable.add(f.name)
                continue
            lo, hi = bounds
            if isinstance(lo, str) and (len(lo) > MAX_STAT_STRING or len(hi) > MAX_STAT_STRING):
                self._unusable.add(f.name)
                continue
            self._columns[f.name] = _merge(self._columns.get(f.name), (lo, hi))

    def ref(
        self, key: str | None, inline: bytes | None, size: int, crc: int | None, fmt: str
    ) -> PartRef:
        """The reference of the part these ranges describe (at least one row added)."""
        assert self._time is not None and self._diff is not None, "an empty part has no ref"
        columns = {k: v for k, v in self._columns.items() if k not in self._unusable}
        return PartRef(
            key,
            inline,
            size,
            self.rows,
            self._time[0],
            self._time[1],
            dmin=self._diff[0],
            dmax=self._diff[1],
            stats=columns if self._with_columns else None,
            crc=crc,
            fmt=fmt,
        )


def _column_bounds(col: pa.ChunkedArray | pa.Array) -> tuple[Any, Any] | None:
    """The exact (min, max) of a column's non-null values; None when it holds a NaN.

    A column of one null-free chunk (what the Arrow part encoder hands over)
    takes a numpy path: floats in two SIMD passes that also reveal a NaN (numpy's
    min propagates it), equal-width strings by :func:`_string_range`. In a sink
    profile Arrow's ``min_max`` over a 32-byte string column compared row by row
    and cost about as much as writing the part. Anything else goes to ``min_max``.
    """
    numbers = _numeric_view(col)
    if numbers is not None:
        lo = numbers.min()
        if numbers.dtype.kind == "f":
            return None if np.isnan(lo) else (float(lo), float(numbers.max()))
        return int(lo), int(numbers.max())
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) == 1 and chunks[0].null_count == 0:
        arr = chunks[0]
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            values = _equal_width(arr)
            if values is not None:
                return _string_range(values)
    if pa.types.is_float16(col.type):
        return None  # with nulls or in chunks: Arrow's min_max has no half-float kernel
    if pa.types.is_floating(col.type) and pc.any(pc.is_nan(col)).as_py():
        return None
    mm = pc.min_max(col)
    return mm["min"].as_py(), mm["max"].as_py()


@dataclass(frozen=True)
class _EqualWidth:
    """A null-free string array whose values all take ``width`` bytes, row ``i`` at
    ``data[first + i * width:]``."""

    data: pa.Buffer
    first: int
    rows: int
    width: int


def _equal_width(arr: pa.Array) -> _EqualWidth | None:
    """The layout of a null-free string array if every value has one width in bytes."""
    n = len(arr)
    offset_type = np.dtype(np.int64 if pa.types.is_large_string(arr.type) else np.int32)
    _, offsets_buf, data = arr.buffers()
    offsets = np.frombuffer(
        offsets_buf, offset_type, count=n + 1, offset=arr.offset * offset_type.itemsize
    )
    first, width = int(offsets[0]), int(offsets[1] - offsets[0])
    if int(offsets[-1]) - first != n * width or not (np.diff(offsets) == width).all():
        return None
    return _EqualWidth(data if data is not None else pa.py_buffer(b""), first, n, width)


def _string_range(values: _EqualWidth) -> tuple[str, str]:
    """The smallest and largest value of an equal-width string array, in bytewise order.

    Bytewise order of UTF-8 is code point order, Python's ``str`` order and
    Arrow's. Values are compared 8 bytes at a time as big-endian integers, one
    window of every row still in play at a time, each narrowing the candidates
    to the rows that tie so far. The window's keys are converted to native
    order once and serve the min and the max alike; a window where every row
    ties (min equals max: a common prefix, such as zero padding) narrows
    nothing, so it costs one pass and no index. A sink profile had the former
    per-direction search at 0.6 ms per 65,536 rows of 32 bytes, 44% of staging.
    """
    if values.width == 0:
        return "", ""
    low: np.ndarray[Any, Any] | None = None
    high: np.ndarray[Any, Any] | None = None
    """Rows that tie so far for the min and the max (None: every row, not materialised)."""
    for start in range(0, values.width, 8):
        if low is None and high is None:
            keys = _window_keys(values, start, None)
            lo, hi = keys.min(), keys.max()
            if lo == hi:
                continue  # every row ties here
            low = np.flatnonzero(keys == lo)
            high = np.flatnonzero(keys == hi)
        else:
            low = _narrow(values, start, low, largest=False)
            high = _narrow(values, start, high, largest=True)
        if len(low) == 1 and len(high) == 1:
            break
    return _row_string(values, low), _row_string(values, high)


def _narrow(
    values: _EqualWidth, start: int, rows: np.ndarray[Any, Any] | None, largest: bool
) -> np.ndarray[Any, Any]:
    """The ``rows`` whose window at ``start`` holds their best key (all rows if None)."""
    if rows is not None and len(rows) == 1:
        return rows
    keys = _window_keys(values, start, rows)
    ties = np.flatnonzero(keys == (keys.max() if largest else keys.min()))
    return ties if rows is None else rows[ties]


def _window_keys(
    values: _EqualWidth, start: int, rows: np.ndarray[Any, Any] | None
) -> np.ndarray[Any, Any]:
    """Bytes ``start:start + 8`` of each of ``rows`` (None: all) as native integers that
    order as the bytes do (a short last window zero-padded alike in every value)."""
    n, width = values.rows, values.width
    at = values.first + start
    if start + 8 <= width:
        window = np.ndarray((n,), ">u8", values.data, at, (width,))
        picked = window if rows is None else window[rows]
    else:
        tail = np.ndarray((n, width - start), np.uint8, values.data, at, (width, 1))
        chosen = tail if rows is None else tail[rows]
        padded = np.zeros((len(chosen), 8), np.uint8)
        padded[:, : width - start] = chosen
        picked = padded.view(">u8").ravel()
    return picked.astype(np.uint64)


def _row_string(values: _EqualWidth, rows: np.ndarray[Any, Any] | None) -> str:
    """The value of the first of ``rows`` (None: every row ties, so row 0)."""
    row = values.first + (0 if rows is None else int(rows[0])) * values.width
    return memoryview(values.data)[row : row + values.width].tobytes().decode()


def _has_stats(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    )


def _merge(a: tuple[Any, Any] | None, b: tuple[Any, Any]) -> tuple[Any, Any]:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))


def new_part_key(shard_id: str, fmt: str = PARQUET) -> str:
    """A fresh, never reused Blob key for a part of ``shard_id``.

    The key starts with its creation time in milliseconds, so GC can tell a
    part staged moments ago (its commit may be on the way) from one a crashed
    writer left behind.
    """
    return f"{shard_id}/part/{time.time_ns() // 1_000_000:013d}-{uuid.uuid4().hex}.{fmt}"


def part_key_created_ms(key: str) -> int | None:
    """The creation time encoded in a part key, or None for a key of another form."""
    name = key.rsplit("/", 1)[-1]
    stamp, sep, _ = name.partition("-")
    return int(stamp) if sep and stamp.isdigit() else None


def release_memory() -> None:
    """Hand Arrow's freed pages back to the OS after a part is done with.

    Arrow's allocator otherwise keeps them cached, so a writer or reader that
    handled many parts shows an RSS far above what it holds (the memory model
    counts what is held: B per part in flight).
    """
    pa.default_memory_pool().release_unused()


def write_parquet_part(table: pa.Table, out: BlobWriter) -> tuple[int, int]:
    """Encode a part table as Parquet straight into ``out``; its size in bytes and CRC-32.

    The encoder's pages go to ``out`` (through a 1 MiB buffer, not one Python call per page)
    as they are made, with the CRC folded on the way: no whole encoded copy of the part is
    ever held, which for a 64 MiB part was a second 20-60 MiB buffer per part in flight.
    ``out`` is not committed. No page checksums: the part's whole-object CRC-32
    (``PartRef.crc``, checked on every fetch) already catches any flipped or missing byte,
    and page checksums cost about a tenth of the encode and a fifth of the decode on top.
    """
    sink = _ChecksumSink(out)
    with pa.BufferedOutputStream(pa.PythonFile(sink, mode="w"), buffer_size=1 << 20) as stream:
        pq.write_table(table, stream, compression="snappy", write_statistics=True)
    return sink.size, sink.crc


ARROW_COMPRESSION: str | None = None
"""Compression of Arrow IPC parts: none. Measured on 84 MiB of the benchmark rows, best of 3:
CPU to encode / decode, one thread: uncompressed 36 / 0 ms (the batches are read in place),
lz4 75 / 33 ms (with IPC threads on, uncompressed encode rose to 156 ms: they stay off).
lz4 stores 0.65x the bytes, and with the fsync'd file write and read counted it was as fast
(IPC none 245-263 / 127-143 ms, lz4 149-217 / 91-134 ms, Parquet 554-704 / 228-304 ms). But
in a Spark task the encode and decode sit on the task's thread while the upload and the
fetch run beside it, and a py-spy profile of the sink put lz4 first among persist's costs:
on CPU-bound executors the bytes are cheaper than the compression."""


class _ChecksumSink:
    """What a part encoder writes through: sizes and CRC-32s the bytes on their way out.

    The CRC is folded piece by piece as the bytes pass (zlib-ng, GIL released),
    so the part is checksummed without a second pass over a whole encoded copy.
    """

    closed = False

    def __init__(self, out: BlobWriter) -> None:
        self._out = out
        self.size = 0
        self.crc = 0

    def write(self, data: pa.Buffer | bytes) -> int:
        view = memoryview(data)  # an Arrow body buffer is passed as is: no copy
        self.crc = _crc32(view, self.crc)
        self.size += view.nbytes
        return self._out.write(view)

    def flush(self) -> None:
        """Nothing buffered here (the blob writer's commit makes the bytes durable)."""

    def close(self) -> None:
        """The encoder is done; ``out`` stays open for the caller to commit or abort."""
        self.closed = True


class ArrowPartEncoder:
    """Streams one Arrow IPC part into a :class:`BlobWriter` as its updates arrive.

    Updates are coalesced into record batches of exactly ``batch_rows`` rows
    (the last one of a part may be shorter), so a reader hands Spark few,
    large batches; each is written to ``out`` as soon as it is full, its
    statistics gathered on the way, and the part's size and CRC-32 are counted
    as the bytes pass. The encoder so holds less than one batch of rows, never
    the part: keeping the batches for one write at the end made a second copy
    of every byte (into the encoded buffer), and their fresh pages cost a page
    fault each, the sink's largest costs in a py-spy profile (coalescing into
    fresh memory 645 samples, encoding into the buffer 405, of 1,354 staging).
    """

    def __init__(
        self, schema: pa.Schema, out: BlobWriter, batch_rows: int = 65536, rows_only: bool = False
    ) -> None:
        self._batch_rows = batch_rows
        self._rows_only = rows_only
        """An ``arrow-rows`` part: ``_time`` and ``_diff`` are checked constant, not stored."""
        self._insert_time: int | None = None
        """The one time of an ``arrow-rows`` part (set by its first updates)."""
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._row_bytes: float | None = None
        """Bytes a row of the first table took in Arrow (until a batch is written)."""
        self.stats = PartStats()
        self.rows = 0
        """Updates added so far."""
        self._sink = _ChecksumSink(out)
        options = pa.ipc.IpcWriteOptions(compression=ARROW_COMPRESSION, use_threads=False)
        if rows_only:
            schema = pa.schema([f for f in schema if f.name not in RESERVED])
        self._writer = pa.ipc.new_stream(self._sink, schema, options=options)

    def rows_room(self, target_bytes: int, incoming: pa.Table) -> int:
        """How many more rows keep the part within ``target_bytes`` (at least 1).

        Sized in rows, from the bytes already written per row (the part's real
        size, header included), or before any batch is written from the first
        ``incoming`` table's size: measuring every incoming table's ``nbytes``
        walked its string columns' offsets, once per Spark batch.

        A part that holds at least one whole batch ends on a whole batch (up to
        one batch under the target; past it only if the estimate shrank below
        what the part already holds). Every batch a reader gets is then full,
        and inputs of exactly ``batch_rows`` rows (Spark's Arrow batches with
        ``spark.sql.execution.arrow.maxRecordsPerBatch`` at persist's batch
        size) are stored as they come, never copied to coalesce: a part cut
        inside one would leave every later input straddling two batches.
        """
        written = self.rows - self._pending_rows
        if written:
            per_row = self._sink.size / written
        else:
            if self._row_bytes is None:
                self._row_bytes = max(incoming.nbytes / max(incoming.num_rows, 1), 1.0)
            per_row = self._row_bytes
        fits = int(target_bytes / per_row)
        if fits < self._batch_rows:
            return max(1, fits - self.rows)
        room = fits - fits % self._batch_rows - self.rows
        return room if room > 0 else self._batch_rows - self.rows % self._batch_rows

    def write(self, table: pa.Table) -> None:
        """Add updates in part layout."""
        if table.num_rows == 0:
            return
        if self._rows_only:
            table = self._rows_of_inserts(table)
        self._append(table)

    def write_inserts(self, rows: pa.Table, time: int) -> None:
        """Add row columns (no ``_time``, no ``_diff``), every row an insert at ``time``, to
        an ``arrow-rows`` part: stored as they are, nothing to check constant."""
        if not self._rows_only:
            raise InvalidUsage(f"only an {ARROW_ROWS} part takes rows without _time and _diff")
        if self._insert_time is None:
            self._insert_time = time
        elif self._insert_time != time:
            raise InvalidUsage(
                f"an {ARROW_ROWS} part holds inserts at one time only, not at {time} and "
                f"{self._insert_time}"
            )
        if rows.num_rows:
            self._append(rows)

    def _append(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self._batch_rows:
            self._cut_pending(self._batch_rows)

    def _rows_of_inserts(self, table: pa.Table) -> pa.Table:
        """The row columns of updates that are all inserts at the part's one time.

        Two numpy passes over constant columns (about 40 us per 65,536 rows) buy
        not storing them; anything else is the caller's bug (only insert-only
        writes ask for ``arrow-rows``) and is refused before a byte is written.
        """
        n = table.num_rows
        t_lo, t_hi = _bounds(table.column(TIME), n)
        if self._insert_time is None:
            self._insert_time = t_lo
        if not (t_lo == t_hi == self._insert_time and _bounds(table.column(DIFF), n) == (1, 1)):
            raise InvalidUsage(
                f"an {ARROW_ROWS} part holds inserts (_diff +1) at one time only: these updates "
                "have other diffs or times; stage them in the 'arrow' or 'parquet' format"
            )
        return table.drop_columns(list(RESERVED))

    def _cut_pending(self, rows: int) -> None:
        """Write the first ``rows`` pending rows as one record batch; keep the rest pending."""
        if not self._pending:
            return
        take: list[pa.Table] = []
        taken = 0
        while taken < rows:
            head = self._pending.pop(0)
            if taken + head.num_rows > rows:
                split = rows - taken
                self._pending.insert(0, head.slice(split))
                head = head.slice(0, split)
            take.append(head)
            taken += head.num_rows
        self._pending_rows -= taken
        table = take[0] if len(take) == 1 else pa.concat_tables(take)
        batch = table.combine_chunks().to_batches()[0]
        # Per coalesced batch: a few numpy passes per batch_rows rows.
        self.stats.add(batch, self._insert_time if self._rows_only else None)
        self._writer.write_batch(batch)

    def finish(self) -> tuple[int, int]:
        """End the IPC stream; the part's size in bytes and its CRC-32 (``out`` not committed)."""
        if self._pending_rows:
            self._cut_pending(self._pending_rows)
        self._writer.close()
        return self._sink.size, self._sink.crc


_IPC_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The IPC stream's end marker: a continuation token and a zero-length message."""

_last_schema_message: tuple[pa.Schema, bytes | None] | None = None
"""The last schema :func:`encode_inline` encoded and its IPC message (one writer's tiny writes
all share one schema, and serialising it is a third of a one-row encode)."""


def _schema_message(schema: pa.Schema) -> bytes | None:
    """The IPC message of ``schema``; None if a column holds dictionaries (see encode_inline)."""
    global _last_schema_message  # noqa: PLW0603 - a one-entry cache, replaced atomically
    last = _last_schema_message
    if last is not None and last[0].equals(schema, check_metadata=True):
        return last[1]
    dictionary = any(_has_dictionary(f.type) for f in schema)
    message = None if dictionary else schema.serialize().to_pybytes()
    _last_schema_message = (schema, message)
    return message


def _has_dictionary(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        return True
    return any(_has_dictionary(typ.field(i).type) for i in range(typ.num_fields))


def encode_inline(table: pa.Table) -> bytes:
    """Encode a tiny part as an Arrow IPC stream, cheap enough to live in a state diff.

    The stream is assembled from the schema's and each batch's IPC messages
    (the very bytes ``pa.ipc.new_stream`` writes, at a third of its cost on a
    one-row write, the inline case). Dictionary columns need the stream
    writer's dictionary messages, so they go through it.
    """
    schema_message = _schema_message(table.schema)
    if schema_message is None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return bytes(sink.getvalue().to_pybytes())
    messages = [schema_message]
    messages.extend(b.serialize().to_pybytes() for b in table.to_batches())
    messages.append(_IPC_END_OF_STREAM)
    return b"".join(messages)


@dataclass(frozen=True)
class LeasedPart:
    """A part handed out by a snapshot or listen, with everything a remote process needs.

    The reader keeps updates with ``lower <= time < upper`` (after the part's
    ``ts_rewrite``) and, for a snapshot, advances every time to ``as_of``.
    ``seqno`` is the SeqNo of the state the part was read from: the holder of
    the lease on it keeps GC from deleting the part until it is returned.
    """

    shard_id: str
    blob_uri: str
    part: PartRef
    lower: Time
    upper: Time
    as_of: Time | None
    seqno: int

    def to_json(self) -> dict[str, Any]:
        """Encode for shipping to another process (a Spark InputPartition)."""
        return {
            "shard": self.shard_id,
            "blob": self.blob_uri,
            "part": self.part.to_json(),
            "lower": self.lower,
            "upper": self.upper,
            "as_of": self.as_of,
            "seqno": self.seqno,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeasedPart:
        """Decode what :meth:`to_json` produced."""
        return cls(
            shard_id=str(d["shard"]),
            blob_uri=str(d["blob"]),
            part=PartRef.from_json(d["part"]),
            lower=int(d["lower"]),
            upper=int(d["upper"]),
            as_of=None if d.get("as_of") is None else int(d["as_of"]),
            seqno=int(d["seqno"]),
        )

    @property
    def needs_filter(self) -> bool:
        """False when every update of the part is inside the bounds (the common case)."""
        return not (
            self.lower <= self.part.effective_min_time and self.part.effective_max_time < self.upper
        )


def part_checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC-32 of a part's bytes, as ``PartRef.crc`` records it (zlib's polynomial).

    zlib-ng's folding implementation gives the same value as ``zlib.crc32`` at
    10-20 GB/s where zlib managed 2-3 on this project's machines (64 MiB, best of 5),
    and like zlib it releases the GIL: a profile of a Spark read had zlib's CRC as
    persist's largest cost, about a tenth of the executors' CPU.
    """
    return int(_crc32(data))


def fetch_part_bytes(blob: Blob, part: PartRef, shard_id: str) -> memoryview:
    """The stored bytes of a part, checked against its CRC; PartNotFound when Blob no longer
    has it. A view (``Blob.get_view``): a file part is mapped, not copied."""
    if part.inline is not None:
        return memoryview(part.inline)
    assert part.key is not None
    data = blob.get_view(part.key)
    if data is None:
        raise PartNotFound(
            f"part {part.key!r} of shard {shard_id!r} is missing from blob {blob.uri}: it was "
            "deleted by GC (read with a lease, or from a newer as_of) or the blob store is wrong"
        )
    if part.crc is not None and part_checksum(data) != part.crc:
        raise CorruptData(
            f"part {part.key!r} of shard {shard_id!r} in blob {blob.uri} does not match its "
            "checksum: the object is corrupt (restore it from a backup of the blob store)"
        )
    return data


def iter_part_batches(
    data: bytes | memoryview, part: PartRef, shard_id: str, batch_rows: int = 65536
) -> Iterator[pa.RecordBatch]:
    """The stored updates of a part's bytes, batch by batch, whatever its format.

    Arrow parts (and inline ones) come in the batches they were written in
    (about ``batch_rows`` rows for a staged part), read in place: views of
    ``data``, no copy. Parquet parts are decoded ``batch_rows`` rows at a time.
    """
    try:
        if part.inline is not None or part.fmt == ARROW:
            yield from pa.ipc.open_stream(pa.py_buffer(data))
        elif part.fmt == ARROW_ROWS:
            yield from _with_insert_columns(pa.ipc.open_stream(pa.py_buffer(data)), part, shard_id)
        elif part.fmt == PARQUET:
            parquet = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data)))
            yield from parquet.iter_batches(batch_size=batch_rows)
        else:
            raise CorruptData(
                f"part {part.key!r} of shard {shard_id!r} has format {part.fmt!r}, which this "
                f"version cannot read (it reads {', '.join(PART_FORMATS)}): upgrade the reader"
            )
    except (pa.ArrowInvalid, OSError) as e:
        where = "an inline part" if part.key is None else f"part {part.key}"
        raise CorruptData(f"{where} of shard {shard_id!r} cannot be decoded: {e}") from e


def _with_insert_columns(
    batches: Iterator[pa.RecordBatch], part: PartRef, shard_id: str
) -> Iterator[pa.RecordBatch]:
    """An ``arrow-rows`` part's batches in part layout: its one time and diff +1 added back
    (shared constant columns, so nothing is copied)."""
    if not (part.min_time == part.max_time and part.dmin == part.dmax == 1):
        raise CorruptData(
            f"part {part.key!r} of shard {shard_id!r} is an {ARROW_ROWS} part, but its reference "
            f"records times {part.min_time}..{part.max_time} and diffs {part.dmin}..{part.dmax}"
            " (it must be one time and +1): the state is corrupt"
        )
    schema: pa.Schema | None = None
    for rb in batches:
        if schema is None:
            schema = data_schema(rb.schema)
        n = rb.num_rows
        time = constant_column(part.min_time, n, TIME_TYPE)
        diff = constant_column(1, n, DIFF_TYPE)
        yield pa.RecordBatch.from_arrays([*rb.columns, time, diff], schema=schema)


def with_times(
    table: pa.Table, times: pa.Array | pa.ChunkedArray, time_type: pa.DataType = TIME_TYPE
) -> pa.Table:
    """Replace the ``_time`` column (non-null, of ``time_type``) so tables concatenate."""
    idx = table.schema.get_field_index(TIME)
    return table.set_column(idx, pa.field(TIME, time_type, nullable=False), times)


@functools.lru_cache(maxsize=16)
def constant_column(value: int, rows: int, typ: pa.DataType) -> pa.Array:
    """``rows`` copies of the integer ``value`` as a ``typ`` array (shared: Arrow arrays are
    immutable, and a read or write asks for a handful of lengths, so each is built a few
    times rather than once per batch). Built with numpy: ``pa.repeat`` of a scalar took
    0.5 ms per 65,536 rows, twenty times ``np.full``."""
    # No pa.scalar, pa.array(ndarray) or DataType.to_pandas_dtype() here: each imports
    # pandas, ~0.2 s in every fresh Spark worker, which needs it for nothing else.
    unsigned = pa.types.is_unsigned_integer(typ)
    lo, hi = (
        (0, 2**typ.bit_width - 1)
        if unsigned
        else (-(2 ** (typ.bit_width - 1)), 2 ** (typ.bit_width - 1) - 1)
    )
    if not lo <= value <= hi:
        raise OverflowError(f"{value} does not fit {typ}")
    kind = "u" if unsigned else "i"
    values = np.full(rows, value, dtype=np.dtype(f"{kind}{typ.bit_width // 8}"))
    return pa.Array.from_buffers(typ, rows, [None, pa.py_buffer(values)])


def int_scalar(value: int, typ: pa.DataType) -> pa.Scalar:
    """The integer ``value`` as a ``typ`` scalar for compute kernels, without pandas (which
    ``pa.scalar`` and a plain Python operand import: ~0.2 s, holding the GIL, in a process
    that needs it for nothing else; a profile of the Spark sink's committer had that import
    in its first compaction at a third of the pipeline's Python CPU)."""
    return constant_column(value, 1, typ)[0]


def shape_updates(
    table: pa.Table | pa.RecordBatch, leased: LeasedPart, time_type: pa.DataType = TIME_TYPE
) -> pa.Table:
    """Apply a leased part's ts_rewrite, time bounds and as_of to decoded updates.

    ``_time`` comes out as ``time_type``: the part layout's uint64, or int64
    for a consumer with no unsigned type (Spark); a time that does not fit it
    raises ``ArrowInvalid``. A snapshot part wholly inside its bounds (the
    common case) only gets its times set to ``as_of``: the ``ts_rewrite`` it
    would otherwise apply first cannot change what a constant replaces.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    part = leased.part
    if leased.as_of is not None and not leased.needs_filter:
        times = constant_column(leased.as_of, table.num_rows, time_type)
        table = with_times(table, times, time_type)
        return _negated(table) if part.negate else table
    if part.ts_rewrite is not None and part.min_time < part.ts_rewrite:
        if part.min_time == part.max_time:  # one time (a sink's part): a shared constant
            times = constant_column(part.effective_min_time, table.num_rows, TIME_TYPE)
        else:
            times = pc.max_element_wise(table.column(TIME), int_scalar(part.ts_rewrite, TIME_TYPE))
        table = with_times(table, times)
    if leased.needs_filter:
        t = table.column(TIME)
        mask = pc.and_(
            pc.greater_equal(t, int_scalar(leased.lower, TIME_TYPE)),
            pc.less(t, int_scalar(leased.upper, TIME_TYPE)),
        )
        table = table.filter(mask)
    if part.negate:
        table = _negated(table)
    if leased.as_of is not None:
        times = constant_column(leased.as_of, table.num_rows, time_type)
        return with_times(table, times, time_type)
    if time_type != TIME_TYPE:
        table = with_times(table, pc.cast(table.column(TIME), time_type), time_type)
    return table


def _negated(table: pa.Table) -> pa.Table:
    """The updates with every ``_diff`` negated (a retraction by reference)."""
    idx = table.schema.get_field_index(DIFF)
    return table.set_column(idx, table.schema.field(idx), pc.negate(table.column(DIFF)))


def consolidate(table: pa.Table, row_columns: list[str]) -> pa.Table:
    """Sum ``_diff`` of equal (row, time) and drop the zeros: the multiset the updates denote."""
    if table.num_rows == 0:
        return table
    keys = [*row_columns, TIME]
    grouped = table.group_by(keys, use_threads=False).aggregate([(DIFF, "sum")])
    out = pa.Table.from_arrays(
        [*(grouped.column(k) for k in keys), grouped.column(f"{DIFF}_sum")],
        schema=table.schema,
    )
    return out.filter(pc.not_equal(out.column(DIFF), int_scalar(0, DIFF_TYPE)))
