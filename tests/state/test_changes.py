"""Change-range planning as pure functions over a hand-built ShardState (no I/O)."""

from __future__ import annotations

from types import MappingProxyType

import pytest

from pyspark_persist.state.changes import check_change_range
from pyspark_persist.state.errors import InvalidFrontier
from pyspark_persist.state.planning import plan_read
from pyspark_persist.state.state import Batch, PartRef, ShardState


def part(name: str, tmin: int, tmax: int) -> PartRef:
    """A part whose updates lie at times [tmin, tmax]."""
    return PartRef(name, None, 100, 10, tmin, tmax)


# Batches [0, 10) with parts at 0..4 and 5..9, [10, 20) with one at 12..15, [20, 30) empty,
# [30, 40) with one at 30..30; since 5.
STATE = ShardState(
    shard_id="s",
    seqno=9,
    schema=b"",
    since=5,
    upper=40,
    batches=MappingProxyType(
        {
            b.key: b
            for b in (
                Batch(0, 10, 5, (part("a", 0, 4), part("b", 5, 9))),
                Batch(10, 20, 5, (part("c", 12, 15),)),
                Batch(20, 30, 5, ()),
                Batch(30, 40, 5, (part("d", 30, 30),)),
            )
        }
    ),
)


@pytest.mark.parametrize(
    ("lower", "upper", "keys"),
    [
        (0, 40, ["a", "b", "c", "d"]),
        (6, 40, ["b", "c", "d"]),
        (10, 12, []),
        (10, 13, ["c"]),
        (16, 30, []),
        (15, 31, ["c", "d"]),
        (30, 31, ["d"]),
    ],
)
def test_change_parts_are_the_parts_with_times_in_range(
    lower: int, upper: int, keys: list[str]
) -> None:
    """Exactly the parts whose (effective) times meet [lower, upper), each cut to the range."""
    check_change_range(STATE, lower, upper, "readChanges")
    got = plan_read(STATE, "mem://b", lower=lower, upper=upper).parts
    assert [p.part.key for p in got] == keys
    assert all((p.lower, p.upper, p.as_of, p.seqno) == (lower, upper, None, 9) for p in got)


@pytest.mark.parametrize(
    ("lower", "upper", "message"),
    [
        (3, 10, r"\[3, 10\) reaches before the since 5: .*\[since, upper\) = \[5, 40\)"),
        (5, 10, r"reaches before the since 5"),
        (0, 5, r"\[0, 5\) reaches before the since 5"),
        (10, 41, r"ends at 41, past the upper 40 .*\[since, upper\) = \[5, 40\)"),
        (12, 12, r"the range \[12, 12\) is empty"),
    ],
)
def test_ranges_the_shard_cannot_answer_name_both_frontiers(
    lower: int, upper: int, message: str
) -> None:
    """Before since (merged away), past upper (not written), empty: refused, naming since/upper."""
    with pytest.raises(InvalidFrontier, match=message):
        check_change_range(STATE, lower, upper, "readChanges")


@pytest.mark.parametrize(
    ("lower", "rows", "parts", "times"),
    [
        (0, 40, 4, 40),
        (10, 20, 2, 30),
        (12, 20, 2, 28),
        (30, 10, 1, 10),
        (40, 0, 0, 0),
        (45, 0, 0, 0),
    ],
)
def test_behind_counts_whole_batches_from_lower_to_upper(
    lower: int, rows: int, parts: int, times: int
) -> None:
    """What a reader at ``lower`` still has to read: batches ending after it, and the times."""
    from pyspark_persist.state.changes import behind

    got = behind(STATE, lower)
    assert (got.rows, got.parts, got.times, got.bytes) == (rows, parts, times, parts * 100)
