"""``changeTypes``: each update of a read labelled with Delta Change Data Feed's ``_change_type``.

Persist streams carry an update as a retraction and an insertion at one
time; Delta's CDF users expect ``insert``, ``update_preimage``,
``update_postimage`` and ``delete`` instead. On an unkeyed shard there is
nothing to pair: a ``+`` row is an insert and a ``-`` row a delete (a row
with ``|_diff| > 1`` stays one row, its ``_diff`` saying how many). On a
keyed shard the updates of one key at one time are paired: a retraction
and an insertion are an update's pre- and post-image, an insertion alone an
insert, a retraction alone a delete. The updates are consolidated first, so
an upsert that rewrites a row unchanged labels nothing (it is no change),
and the answer does not depend on whether compaction has run.

Pairing needs every update of a (key, time) in one task:
:func:`colocate_times` merges a read's splits so that parts whose times
overlap are read by the same task. Pure: no Spark, no store.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

from pyspark_persist.state import DIFF, TIME, LeasedPart, consolidate

CHANGE_TYPE = "_change_type"
"""The column a ``changeTypes`` read adds (Delta CDF's name)."""
INSERT = "insert"
UPDATE_PREIMAGE = "update_preimage"
UPDATE_POSTIMAGE = "update_postimage"
DELETE = "delete"

_NEG = "__persist_neg"
_POS = "__persist_pos"


def label_changes(table: pa.Table, keys: Sequence[str]) -> pa.Table:
    """``table`` (row columns, ``_time``, ``_diff``) with ``_change_type`` appended.

    ``keys`` empty: by the sign of ``_diff`` alone, row for row. Otherwise
    the updates are consolidated and paired by key and time (see the module
    doc); every update of a (key, time) must be in ``table``.
    """
    if not keys:
        labels = pc.if_else(pc.greater(table.column(DIFF), 0), INSERT, DELETE)
        return table.append_column(CHANGE_TYPE, labels.cast(pa.string()))
    rows = [n for n in table.column_names if n not in (TIME, DIFF)]
    table = consolidate(table, rows)
    if table.num_rows == 0:
        return table.append_column(CHANGE_TYPE, pa.array([], pa.string()))
    positive = pc.greater(table.column(DIFF), 0)
    flags = table.select([*keys, TIME]).append_column(
        _NEG, pc.cast(pc.invert(positive), pa.int64())
    )
    flags = flags.append_column(_POS, pc.cast(positive, pa.int64()))
    groups = flags.group_by([*keys, TIME], use_threads=False).aggregate(
        [(_NEG, "max"), (_POS, "max")]
    )
    joined = table.join(groups, keys=[*keys, TIME], use_threads=False)
    paired = pc.and_(
        pc.equal(joined.column(f"{_NEG}_max"), 1), pc.equal(joined.column(f"{_POS}_max"), 1)
    )
    is_positive = pc.greater(joined.column(DIFF), 0)
    labels = pc.if_else(
        is_positive,
        pc.if_else(paired, UPDATE_POSTIMAGE, INSERT),
        pc.if_else(paired, UPDATE_PREIMAGE, DELETE),
    )
    out = joined.select(table.column_names).append_column(CHANGE_TYPE, labels.cast(pa.string()))
    return out.sort_by([(TIME, "ascending")])


def pairing_keys(keys: Sequence[str], splits: Sequence[Sequence[LeasedPart]]) -> tuple[str, ...]:
    """The keys a read's tasks must pair by: ``keys``, unless no part may hold a retraction.

    Without retractions every update is an insert whatever the key, so the
    read labels by sign and keeps its splits (a keyed shard's first load, an
    append-only range) instead of merging them and holding each task in memory.
    """
    parts = (p.part for split in splits for p in split)
    if any((p.effective_dmin or -1) <= 0 for p in parts):  # unknown bounds count as may
        return tuple(keys)
    return ()


def colocate_times(splits: Sequence[Sequence[LeasedPart]]) -> list[tuple[LeasedPart, ...]]:
    """``splits`` merged so that parts whose read times may overlap share a split.

    A part is read at times ``[min, max]`` (its effective times, each first
    advanced to the read's ``as_of`` when there is one, so a snapshot's
    parts all meet at ``as_of``). The parts of one commit share its time and
    a compacted part spans several: the intervals are swept in order and
    each chain of overlapping ones joins its splits. Parts of disjoint times
    keep their own tasks, so a change read stays spread over tasks by commit.
    """
    owner: list[int] = list(range(len(splits)))

    def root(i: int) -> int:
        while owner[i] != i:
            owner[i] = owner[owner[i]]
            i = owner[i]
        return i

    spans = sorted(
        (
            max(p.part.effective_min_time, p.as_of or 0),
            max(p.part.effective_max_time, p.as_of or 0),
            i,
        )
        for i, split in enumerate(splits)
        for p in split
    )
    reach, chain = -1, -1
    for lo, hi, i in spans:
        if lo <= reach:
            owner[root(i)] = root(chain)
        else:
            chain = i
        reach = max(reach, hi)
    merged: dict[int, list[LeasedPart]] = {}
    for i, split in enumerate(splits):
        merged.setdefault(root(i), []).extend(split)
    return [tuple(parts) for parts in merged.values() if parts]
