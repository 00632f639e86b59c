"""What a read sees of a stored part, as pure functions (state/updates.py, state/keys.py): a
part's updates and the LeasedPart that handed it out in, the updates the read returns out.
No store: the stored updates are tables built here."""

from __future__ import annotations

import time

import pyarrow as pa
import pytest

from pyspark_persist.state import DIFF, TIME, LeasedPart, PartRef, consolidate
from pyspark_persist.state.keys import part_key, part_key_created_ms
from pyspark_persist.state.part_formats import new_part_key
from pyspark_persist.state.schema import data_schema
from pyspark_persist.state.updates import shape_updates

STORED = pa.table(
    {
        "k": ["a", "b", "c", "d"],
        TIME: pa.array([3, 5, 7, 9], pa.uint64()),
        DIFF: pa.array([1, 1, -1, 2], pa.int64()),
    },
    schema=data_schema(pa.schema([("k", pa.string())])),
)
"""A part's stored updates at times 3..9."""


def leased(lower: int, upper: int, as_of: int | None, **ref: object) -> LeasedPart:
    """STORED as handed out for ``[lower, upper)`` (read as at ``as_of`` when set)."""
    part = PartRef("k", None, 100, 4, 3, 9, **ref)  # type: ignore[arg-type]
    return LeasedPart("s", "mem://", part, lower, upper, as_of, 1)


def seen(table: pa.Table) -> list[tuple[str, int, int]]:
    """(row, time, diff) of each update, in order."""
    return list(zip(*(table.column(c).to_pylist() for c in ("k", TIME, DIFF)), strict=True))


@pytest.mark.parametrize(
    ("handed_out", "expected"),
    [
        # A listen of [0, 10): every update with its own time.
        (leased(0, 10, None), [("a", 3, 1), ("b", 5, 1), ("c", 7, -1), ("d", 9, 2)]),
        # A listen of [5, 8): only the updates at times in the range.
        (leased(5, 8, None), [("b", 5, 1), ("c", 7, -1)]),
        # A snapshot as of 9: every update, read at 9.
        (leased(0, 10, 9), [("a", 9, 1), ("b", 9, 1), ("c", 9, -1), ("d", 9, 2)]),
        # Staged before its commit time (the sink's parts): every time is at least 6.
        (leased(0, 10, None, ts_rewrite=6), [("a", 6, 1), ("b", 6, 1), ("c", 7, -1), ("d", 9, 2)]),
        # ... and a listen of [6, 7) sees the updates the rewrite moved there.
        (leased(6, 7, None, ts_rewrite=6), [("a", 6, 1), ("b", 6, 1)]),
        # Referenced negated (an atomic replace's retraction): every diff flips.
        (leased(0, 10, None, negate=True), [("a", 3, -1), ("b", 5, -1), ("c", 7, 1), ("d", 9, -2)]),
        # A cut of a snapshot: the updates in [3, 6), read as at 9.
        (leased(3, 6, 9), [("a", 9, 1), ("b", 9, 1)]),
    ],
)
def test_a_leased_part_reads_as_its_bounds_rewrite_and_sign_say(
    handed_out: LeasedPart, expected: list[tuple[str, int, int]]
) -> None:
    """The one stored part serves every read: its ts_rewrite first, then the read's time
    bounds, its negation, and a snapshot's as_of."""
    shaped = shape_updates(STORED, handed_out)
    assert seen(shaped) == expected
    assert shaped.schema.field(TIME).nullable is False


def test_times_come_out_in_the_type_the_consumer_asks_for() -> None:
    """Spark has no unsigned type: a read can ask for int64 times, listen or snapshot alike."""
    for handed_out in (leased(0, 10, None), leased(0, 10, 9)):
        shaped = shape_updates(STORED, handed_out, pa.int64())
        assert shaped.schema.field(TIME).type == pa.int64()
    assert shape_updates(STORED, leased(0, 10, 9), pa.int64()).column(TIME).to_pylist() == [9] * 4


def test_a_snapshot_consolidates_to_the_multiset_at_as_of() -> None:
    """Read as of 9, ``c``'s retraction cancels an earlier insert of ``c``; diffs of equal rows
    sum and rows summing to zero disappear."""
    earlier = pa.table(
        {"k": ["c"], TIME: pa.array([1], pa.uint64()), DIFF: pa.array([1])}, schema=STORED.schema
    )
    earlier_part = LeasedPart("s", "mem://", PartRef("e", None, 1, 1, 1, 1), 0, 10, 9, 1)
    snapshot = pa.concat_tables(
        [shape_updates(earlier, earlier_part), shape_updates(STORED, leased(0, 10, 9))]
    )
    assert sorted(seen(consolidate(snapshot, ["k"]))) == [("a", 9, 1), ("b", 9, 1), ("d", 9, 2)]


def test_a_part_key_carries_its_creation_time_for_gc() -> None:
    """A key names the shard, its creation time in milliseconds (zero-padded, so keys sort by
    it) and its format; GC reads the time back. Keys of another form have none."""
    key = part_key("events", "arrow", 1_700_000_000_123, "ab12")
    assert key == "events/part/1700000000123-ab12.arrow"
    assert part_key_created_ms(key) == 1_700_000_000_123
    assert part_key("s", "parquet", 42, "x") < part_key("s", "parquet", 1_000, "x")
    assert part_key_created_ms(part_key("s", "parquet", 42, "x")) == 42
    for other in ("events/part/nodash.parquet", "x/part/12a-b.arrow"):
        assert part_key_created_ms(other) is None


def test_a_new_part_key_is_fresh_and_stamped_with_the_clock() -> None:
    """The shell names new parts: two keys are never equal, and each carries the time it was
    made at by this process's clock."""
    before = time.time_ns() // 1_000_000
    keys = [new_part_key("s", "arrow") for _ in range(2)]
    after = time.time_ns() // 1_000_000
    assert keys[0] != keys[1]
    for key in keys:
        created = part_key_created_ms(key)
        assert created is not None and before <= created <= after
        assert key.startswith("s/part/") and key.endswith(".arrow")
