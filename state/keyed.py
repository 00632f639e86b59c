"""Keyed shards: key columns checked, and what an upsert writes, as pure functions of tables.

A keyed shard names key columns in its state (``ShardState.keys``, set at
creation). Every write to it is an *upsert*: for each key the write names,
the key's current row (if any) is retracted and the write's row inserted, at
the commit's time, so at every time the shard holds at most one row per key
(Materialize's ``ENVELOPE UPSERT``, Paimon's primary-key tables). A delete
retracts the current row and inserts nothing.

This module decides; :mod:`.upsert` finds the current rows and commits.
Within one write the last row of a key wins, or, with a sequence column,
the row with the highest sequence (ties: the later row in the write). Pure:
no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .columns import bounds
from .errors import InvalidUpdates, InvalidUsage, KeysMismatch
from .schema import DIFF, DIFF_TYPE, RESERVED, TIME_TYPE, data_schema
from .updates import consolidate

SUPPORTED = "integers, strings, binary, booleans, dates and timestamps"
"""The key column types, as errors name them: types whose values compare exactly (no floats,
whose NaN equals nothing, and no nested types)."""

_ROW = "__persist_row"
"""A column added to a table for the length of one computation: each row's position."""


def _key_type_ok(typ: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(typ)
        or pa.types.is_string(typ)
        or pa.types.is_large_string(typ)
        or pa.types.is_binary(typ)
        or pa.types.is_large_binary(typ)
        or pa.types.is_boolean(typ)
        or pa.types.is_date(typ)
        or pa.types.is_timestamp(typ)
    )


def validate_keys(schema: pa.Schema, keys: Sequence[str], shard: str) -> tuple[str, ...]:
    """The key columns of a shard of ``schema``, checked before the shard is created.

    Each must be a column of the schema of a type whose values compare exactly
    (:data:`SUPPORTED`), named once.
    """
    if isinstance(keys, str) or not all(isinstance(k, str) for k in keys):
        raise InvalidUsage(
            f"keys of shard {shard!r} must be a list of column names, got {keys!r}: "
            'pass e.g. keys=["id"]'
        )
    names = tuple(keys)
    if not names:
        raise InvalidUsage(
            f"keys of shard {shard!r} is empty: name at least one key column, or pass "
            "keys=None for an unkeyed shard"
        )
    if len(set(names)) != len(names):
        raise InvalidUsage(f"keys of shard {shard!r} name a column twice: {list(names)}")
    for name in names:
        if name in RESERVED or name not in schema.names:
            raise InvalidUsage(
                f"key column {name!r} of shard {shard!r} is not a column of its schema "
                f"({', '.join(schema.names)}): name one of those"
            )
        typ = schema.field(name).type
        if not _key_type_ok(typ):
            raise InvalidUsage(
                f"key column {name!r} of shard {shard!r} has type {typ}, which cannot be a key: "
                f"key columns must be {SUPPORTED}"
            )
    return names


def check_keys_match(shard: str, stored: tuple[str, ...], given: Sequence[str] | None) -> None:
    """KeysMismatch when a caller names other keys than the shard's (``None``: any)."""
    if isinstance(given, str):
        raise InvalidUsage(f'keys of shard {shard!r} must be a list: pass keys=["{given}"]')
    if given is None or tuple(given) == stored:
        return
    have = f"keys {list(stored)}" if stored else "no keys (an unkeyed shard)"
    raise KeysMismatch(
        f"shard {shard!r} has {have}, but this call names keys {list(given)}: open it with "
        "the shard's keys (or none), or write to another shard"
    )


def check_key_columns(
    table: pa.Table, keys: tuple[str, ...], schema: pa.Schema, shard: str
) -> None:
    """Refuse a write whose key columns are missing, of another type than the shard's, or null.

    Checked before anything is staged; the message names the column and the fix.
    """
    for name in keys:
        want = schema.field(name).type
        if name not in table.column_names:
            raise InvalidUpdates(
                f"the write to keyed shard {shard!r} lacks key column {name!r} ({want}): "
                f"every upsert and delete carries all the keys {list(keys)}"
            )
        got = table.schema.field(name).type
        if got != want:
            raise InvalidUpdates(
                f"key column {name!r} of the write to shard {shard!r} is {got}, the shard's is "
                f"{want}: cast it to {want}"
            )
        nulls = table.column(name).null_count
        if nulls:
            raise InvalidUpdates(
                f"{nulls} rows of the write to keyed shard {shard!r} have a null key {name!r}: "
                "a key identifies one row, so drop or fill those rows"
            )


def check_sequence_column(table: pa.Table, schema: pa.Schema, column: str, shard: str) -> None:
    """Refuse a sequence column that is not the shard's, missing, not an integer, or null."""
    if column not in schema.names:
        raise InvalidUpdates(
            f"sequence column {column!r} is not a column of shard {shard!r} "
            f"({', '.join(schema.names)}): name a stored integer or timestamp column"
        )
    if column not in table.column_names:
        raise InvalidUpdates(
            f"the write to shard {shard!r} lacks its sequence column {column!r}: every row "
            "needs one (the highest sequence of a key wins)"
        )
    typ = table.schema.field(column).type
    if not (pa.types.is_integer(typ) or pa.types.is_timestamp(typ)):
        raise InvalidUpdates(
            f"sequence column {column!r} of the write to shard {shard!r} is {typ}: it must be "
            "an integer or a timestamp"
        )
    nulls = table.column(column).null_count
    if nulls:
        raise InvalidUpdates(
            f"{nulls} rows of the write to shard {shard!r} have a null sequence {column!r}: "
            "give every row its sequence"
        )


def winners(table: pa.Table, keys: tuple[str, ...], sequence: str | None = None) -> pa.Table:
    """One row per key: the last one of the write, or the one of highest ``sequence``
    (ties: the later row). Rows keep the order of the input."""
    n = table.num_rows
    if n <= 1:
        return table
    rows = table.append_column(_ROW, pa.array(np.arange(n, dtype=np.int64)))
    if sequence is None:
        picked = rows.group_by(list(keys), use_threads=False).aggregate([(_ROW, "max")])
        index = picked.column(f"{_ROW}_max")
    else:
        order = rows.sort_by([(sequence, "descending"), (_ROW, "descending")])
        first = order.group_by(list(keys), use_threads=False).aggregate([(_ROW, "first")])
        index = first.column(f"{_ROW}_first")
    if len(index) == n:
        return table
    return table.take(pa.array(np.sort(index.to_numpy())))


def key_table(table: pa.Table, keys: tuple[str, ...]) -> pa.Table:
    """The distinct keys of ``table`` (its key columns only)."""
    return table.select(list(keys)).group_by(list(keys), use_threads=False).aggregate([])


def rows_with_keys(table: pa.Table, keys: tuple[str, ...], wanted: pa.Table) -> pa.Table:
    """The rows of ``table`` whose key is one of ``wanted``'s (a key table)."""
    if table.num_rows == 0 or wanted.num_rows == 0:
        return table.slice(0, 0)
    if len(keys) == 1:
        (k,) = keys
        return table.filter(pc.is_in(table.column(k), value_set=wanted.column(k)))
    mask = mask_with_keys(table.select(list(keys)), keys, wanted)
    return table.filter(mask)


def mask_with_keys(key_columns: pa.Table, keys: tuple[str, ...], wanted: pa.Table) -> pa.Array:
    """A boolean per row of ``key_columns``: is its key one of ``wanted``'s."""
    if len(keys) == 1:
        (k,) = keys
        return pc.is_in(key_columns.column(k), value_set=wanted.column(k))
    n = key_columns.num_rows
    marked = key_columns.append_column(_ROW, pa.array(np.arange(n, dtype=np.int64)))
    hits = marked.join(wanted, list(keys), join_type="left semi", use_threads=False)
    mask = np.zeros(n, dtype=bool)
    mask[hits.column(_ROW).to_numpy()] = True
    return pa.array(mask)


def live_rows(updates: pa.Table, row_columns: list[str]) -> pa.Table:
    """The rows ``updates`` add up to (time ignored), each with its multiplicity in ``_diff``.

    For a shard's updates before its upper this is the collection at
    ``upper - 1``: what an upsert committed at the upper retracts.
    """
    if updates.num_rows == 0 or pc.min(updates.column(DIFF)).as_py() > 0:
        # No retraction among them (a compacted history): nothing cancels, no group-by.
        return updates.select([*row_columns, DIFF])
    grouped = updates.group_by(row_columns, use_threads=False).aggregate([(DIFF, "sum")])
    out = grouped.rename_columns([*row_columns, DIFF]).select([*row_columns, DIFF])
    return out.filter(pc.greater(out.column(DIFF), pa.scalar(0, DIFF_TYPE)))


def consolidate_keyed(table: pa.Table, row_columns: list[str], keys: tuple[str, ...]) -> pa.Table:
    """:func:`~.updates.consolidate` of a keyed shard's updates, summing only the keys that
    need it: the same multiset, rows in another order.

    A keyed shard holds at most one row per key at every time, so a key whose
    updates are all ``+1`` has exactly one (a second insert with no retraction
    between would be a second live row): that update is already consolidated
    and passes through untouched. Only the rows of keys with some other diff
    (an upsert's retraction and the insert beside it) are grouped. A snapshot
    of a compacted shard has no such key and is returned as it is; one that
    still holds upserts' pairs groups those keys' rows instead of every row
    (``persist bench upsert``: 1,000,000 rows grouped took 120-300 ms, about
    ten times the read's fetch). Should the invariant ever fail, a key would
    show its rows unsummed, still twice: the fault stays visible, as
    ``persist check`` looks for it.
    """
    n = table.num_rows
    if n == 0:
        return table
    low, high = bounds(table.column(DIFF), n)
    if low == high == 1:
        return table
    odd = pc.not_equal(table.column(DIFF), pa.scalar(1, DIFF_TYPE))
    touched = table.filter(odd).select(list(keys))  # (repeats are fine: a set, or a semi join)
    summed = mask_with_keys(table.select(list(keys)), keys, touched)
    kept = table.filter(pc.invert(summed))
    return pa.concat_tables([kept, consolidate(table.filter(summed), row_columns)])


def upsert_updates(schema: pa.Schema, current: pa.Table, inserts: pa.Table, time: int) -> pa.Table:
    """The updates of one upsert at ``time``: ``current`` (live rows with their multiplicity,
    as :func:`live_rows` gives them) retracted, ``inserts`` (rows in ``schema``) inserted."""
    names = schema.names
    parts = []
    if current.num_rows:
        diff = pc.negate(current.column(DIFF))
        parts.append(_with_time_diff(current.select(names), schema, time, diff))
    if inserts.num_rows:
        ones = pa.array(np.ones(inserts.num_rows, dtype=np.int64))
        parts.append(_with_time_diff(inserts.select(names), schema, time, ones))
    if not parts:
        return data_schema(schema).empty_table()
    return pa.concat_tables(parts)


def _with_time_diff(
    rows: pa.Table, schema: pa.Schema, time: int, diff: pa.Array | pa.ChunkedArray
) -> pa.Table:
    n = rows.num_rows
    times = pa.array(np.full(n, time, dtype=np.uint64), type=TIME_TYPE)
    arrays = [*(rows.column(f.name).cast(f.type) for f in schema), times, diff]
    return pa.Table.from_arrays(arrays, schema=data_schema(schema))


DELETE = "__persist_delete"
"""The column of a prepared write that says a row deletes its key (it is never stored)."""


def prepare_write(
    rows: pa.Table,
    schema: pa.Schema,
    keys: tuple[str, ...],
    shard: str,
    *,
    deletes: pa.Array | pa.ChunkedArray | bool,
    sequence: str | None,
) -> pa.Table:
    """A write's rows in the shard's columns plus :data:`DELETE`, one row per key, checked.

    ``deletes``: True when every row deletes its key (then only the key
    columns, and the sequence column, need be given), or a boolean per row.
    Raises before anything is staged when a key or the sequence column is
    missing, of another type, or null.
    """
    check_key_columns(rows, keys, schema, shard)
    if sequence is not None:
        check_sequence_column(rows, schema, sequence, shard)
    n = rows.num_rows
    flags = pa.array(np.full(n, deletes)) if isinstance(deletes, bool) else deletes
    if deletes is True:
        given = set(rows.column_names)
        arrays = [
            rows.column(f.name).cast(f.type) if f.name in given else pa.nulls(n, f.type)
            for f in schema
        ]
        rows = pa.Table.from_arrays(arrays, schema=schema)
    table = rows.append_column(pa.field(DELETE, pa.bool_()), flags)
    return winners(table, keys, sequence)


def plan_upsert(
    writes: pa.Table,
    current: pa.Table,
    schema: pa.Schema,
    keys: tuple[str, ...],
    time: int,
    sequence: str | None = None,
    known_sequences: pa.Table | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The updates of an upsert at ``time``, and the writes that took effect.

    ``writes``: :func:`prepare_write`'s rows; ``current``: the shard's
    updates of those keys before the upper (any times; summed here). With a
    ``sequence`` column a write older than its key's current row (or than
    ``known_sequences``, the keys' sequences remembered for deleted keys) is
    dropped: ties go to the write. Writing a key's current row again changes
    nothing (a retraction and insertion of one row at one time cancel out).
    """
    names = schema.names
    live = live_rows(current, names)
    if sequence is not None:
        writes = _not_older(writes, live, keys, sequence, known_sequences)
    touched = key_table(writes, keys)
    retract = rows_with_keys(live, keys, touched)
    inserts = writes.filter(pc.invert(writes.column(DELETE))).drop_columns([DELETE])
    updates = upsert_updates(schema, retract, inserts, time)
    if updates.num_rows:
        grouped = updates.group_by(names, use_threads=False).aggregate([(DIFF, "sum")])
        updates = pa.Table.from_arrays(
            [
                *(grouped.column(n) for n in names),
                _times(grouped.num_rows, time),
                grouped.column(f"{DIFF}_sum"),
            ],
            schema=data_schema(schema),
        )
        updates = updates.filter(pc.not_equal(updates.column(DIFF), pa.scalar(0, DIFF_TYPE)))
    return updates, writes


def _times(n: int, time: int) -> pa.Array:
    return pa.array(np.full(n, time, dtype=np.uint64), type=TIME_TYPE)


def _not_older(
    writes: pa.Table,
    live: pa.Table,
    keys: tuple[str, ...],
    sequence: str,
    known: pa.Table | None,
) -> pa.Table:
    """The writes whose sequence is at least their key's current one (live row or remembered)."""
    cols = [*keys, sequence]
    seen = [live.select(cols)]
    if known is not None and known.num_rows:
        seen.append(known.select(cols).cast(live.select(cols).schema))
    have = pa.concat_tables(seen)
    if have.num_rows == 0:
        return writes
    top = have.group_by(list(keys), use_threads=False).aggregate([(sequence, "max")])
    top = top.rename_columns([*keys, "__persist_seen"])
    n = writes.num_rows
    marked = writes.append_column(_ROW, pa.array(np.arange(n, dtype=np.int64)))
    joined = marked.join(top, list(keys), join_type="left outer", use_threads=False)
    seen_col = joined.column("__persist_seen")
    ok = pc.or_kleene(pc.is_null(seen_col), pc.greater_equal(joined.column(sequence), seen_col))
    keep = np.sort(joined.filter(ok).column(_ROW).to_numpy())
    return writes.take(pa.array(keep))


def latest_rows(
    rows: pa.Table,
    schema: pa.Schema,
    keys: tuple[str, ...],
    shard: str,
    *,
    delete_column: str | None = None,
    sequence: str | None = None,
) -> pa.Table:
    """What a keyed shard replaced by ``rows`` holds: one row per key, picked as an upsert picks
    it (the last, or the highest ``sequence``), in ``schema``; rows whose ``delete_column`` is
    true delete their key, and that column is not kept (an overwrite of a keyed shard)."""
    deletes: pa.ChunkedArray | bool = False
    if delete_column is not None:
        deletes = rows.column(delete_column)
        rows = rows.drop_columns([delete_column])
    rows = rows.select(schema.names)
    kept = prepare_write(rows, schema, keys, shard, deletes=deletes, sequence=sequence)
    return kept.filter(pc.invert(kept.column(DELETE))).drop_columns([DELETE])
