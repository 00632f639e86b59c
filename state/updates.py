"""Updates as a reader sees them: a leased part's times and diffs applied, and consolidation.

A stored part is never changed; what a read sees of it is shaped by the
part's reference (``ts_rewrite``, ``negate``) and by the bounds of the
snapshot or listen that handed it out (a :class:`~.planning.LeasedPart`), so
one stored part serves every read (:func:`shape_updates`). A collection is
the consolidated multiset of its updates (:func:`consolidate`). Pure
functions of Arrow tables.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .columns import bounds, constant_column, int_scalar
from .errors import InvalidUsage
from .planning import LeasedPart
from .schema import DIFF, DIFF_TYPE, TIME, TIME_TYPE


def with_times(
    table: pa.Table, times: pa.Array | pa.ChunkedArray, time_type: pa.DataType = TIME_TYPE
) -> pa.Table:
    """Replace the ``_time`` column (non-null, of ``time_type``) so tables concatenate."""
    idx = table.schema.get_field_index(TIME)
    return table.set_column(idx, pa.field(TIME, time_type, nullable=False), times)


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


def repeat_by_diff(table: pa.Table, shard: str) -> pa.Table:
    """Each update ``_diff`` times: the bag of rows a read shows when it returns no ``_diff``
    (a Spark schema that leaves it out), so counts and sums come out as with it.

    Free when every diff is +1 (inserts: the common case). A retraction (or a zero) has
    no such form: InvalidUsage naming the fix, return ``_diff``.
    """
    n = table.num_rows
    if n == 0:
        return table
    low, high = bounds(table.column(DIFF), n)
    if low == high == 1:
        return table
    if low < 1:
        raise InvalidUsage(
            f"persist read: shard {shard!r} holds retractions (_diff {low}) where this read "
            "returns no _diff column, so it cannot show them: add _diff (long) to the schema "
            "(or read a time whose collection has none)"
        )
    diffs = table.column(DIFF).to_numpy()
    return table.take(np.repeat(np.arange(n), diffs))
