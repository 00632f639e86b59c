"""Read planning (``state/planning.py``) as pure functions over hand-built ShardStates: no I/O.

Every reader (snapshot, listen, change feed, the Spark batch and stream
readers, ``persist shards show``) plans through :func:`plan_read`, so these
tables are the rules all of them follow.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from types import MappingProxyType

import pytest

from pyspark_persist.state.errors import InvalidUsage
from pyspark_persist.state.planning import (
    CUT_ROWS,
    LeasedPart,
    ReadLimits,
    limited_upper,
    plan_read,
    split_count,
    split_parts,
)
from pyspark_persist.state.state import Batch, PartRef, ShardState

URI = "mem://b"


def part(name: str, tmin: int, tmax: int, **kw: object) -> PartRef:
    """A 100-byte part of 10 updates at times [tmin, tmax]."""
    return PartRef(name, None, 100, 10, tmin, tmax, **kw)  # type: ignore[arg-type]


def shard(*batches: Batch, since: int = 0, seqno: int = 9) -> ShardState:
    """A state holding ``batches`` (which tile [0, upper))."""
    return ShardState(
        shard_id="s",
        seqno=seqno,
        schema=b"",
        since=since,
        upper=batches[-1].upper,
        batches=MappingProxyType({b.key: b for b in batches}),
    )


# [0, 10): a at 0..4, b at 5..9 (20 rows, 200 bytes, 2 parts); [10, 20): c at 12..15;
# [20, 30): empty; [30, 40): d at 30.
STATE = shard(
    Batch(0, 10, 0, (part("a", 0, 4, dmin=1, dmax=1), part("b", 5, 9, dmin=1, dmax=1))),
    Batch(10, 20, 0, (part("c", 12, 15, dmin=-1, dmax=1),)),
    Batch(20, 30, 0, ()),
    Batch(30, 40, 0, (part("d", 30, 30, dmin=1, dmax=1),)),
)

# An atomic replace at 10 retracts a (referenced negated, read at time 10) and adds n.
REPLACED = shard(
    Batch(0, 10, 0, (part("a", 0, 4),)),
    Batch(10, 20, 0, (part("a", 0, 4, ts_rewrite=10, negate=True), part("n", 10, 10)), 1),
)


def keys(parts: tuple[LeasedPart, ...]) -> list[str]:
    """The parts' keys, negated ones as ``-key``."""
    return [("-" if p.part.negate else "") + (p.part.key or "") for p in parts]


@pytest.mark.parametrize(
    ("state", "as_of", "want"),
    [
        (STATE, 0, ["a"]),
        (STATE, 4, ["a"]),
        (STATE, 5, ["a", "b"]),
        (STATE, 12, ["a", "b", "c"]),
        (STATE, 29, ["a", "b", "c"]),
        (STATE, 39, ["a", "b", "c", "d"]),
        (REPLACED, 9, ["a"]),
        (REPLACED, 10, ["n"]),  # a and -a cancel: neither is fetched
        (REPLACED, 19, ["n"]),
    ],
)
def test_snapshot_is_every_part_up_to_as_of_read_at_as_of(
    state: ShardState, as_of: int, want: list[str]
) -> None:
    """A snapshot plans the parts with times at or before as_of, each read as at as_of."""
    plan = plan_read(state, URI, as_of=as_of)
    assert keys(plan.parts) == want
    assert (plan.lower, plan.upper, plan.as_of, plan.seqno) == (0, as_of + 1, as_of, state.seqno)
    assert all(
        (p.lower, p.upper, p.as_of, p.seqno, p.blob_uri) == (0, as_of + 1, as_of, 9, URI)
        for p in plan.parts
    )


@pytest.mark.parametrize(
    ("state", "lower", "upper", "as_of", "want"),
    [
        (STATE, 0, 40, None, ["a", "b", "c", "d"]),
        (STATE, 6, 40, None, ["b", "c", "d"]),
        (STATE, 10, 12, None, []),
        (STATE, 10, 20, None, ["c"]),  # a listen event for the batch [10, 20)
        (STATE, 20, 30, None, []),  # an empty batch: pure progress
        (STATE, 15, 31, None, ["c", "d"]),
        (STATE, 5, 10, 39, ["b"]),  # a cut of the snapshot at 39
        # A cut keeps both references: the rows of each in the cut differ (a's are at 0..4,
        # -a's at 10), so they do not cancel as they do over the whole snapshot.
        (REPLACED, 0, 11, 19, ["a", "-a", "n"]),
        (REPLACED, 10, 20, 19, ["-a", "n"]),
        (REPLACED, 0, 20, 19, ["n"]),  # the whole snapshot: they cancel
    ],
)
def test_a_range_is_every_part_with_times_in_it(
    state: ShardState, lower: int, upper: int, as_of: int | None, want: list[str]
) -> None:
    """A range plans the parts whose times meet [lower, upper), each cut to the range."""
    plan = plan_read(state, URI, as_of=as_of, lower=lower, upper=upper)
    assert keys(plan.parts) == want
    assert all((p.lower, p.upper, p.as_of) == (lower, upper, as_of) for p in plan.parts)


@pytest.mark.parametrize(
    ("lower", "target", "limits", "want"),
    [
        (0, 40, ReadLimits(), 40),
        (0, 40, ReadLimits(max_rows=10), 10),  # one batch over the cap is still taken
        (0, 40, ReadLimits(max_rows=30), 30),  # the empty batch costs nothing
        (0, 40, ReadLimits(max_rows=1000), 40),
        (10, 40, ReadLimits(max_parts=1), 30),
        (0, 40, ReadLimits(max_parts=3), 30),
        (0, 25, ReadLimits(max_bytes=1000), 20),  # never past the target
        (20, 25, ReadLimits(max_rows=1), 25),  # a batch across the target: cut at the target
        (5, 40, ReadLimits(max_rows=10), 10),  # from inside a batch: to its end
        (0, 40, ReadLimits(max_rows=100, max_parts=2), 10),  # every cap holds
        (40, 40, ReadLimits(max_rows=10), 40),  # nothing left
    ],
)
def test_limits_end_the_read_where_whole_batches_fit(
    lower: int, target: int, limits: ReadLimits, want: int
) -> None:
    """Caps count whole batches; at least one batch with data is always taken."""
    assert limited_upper(STATE, lower, target, limits) == want
    plan = plan_read(STATE, URI, lower=lower, upper=target, limits=limits)
    assert plan.upper == want
    assert plan == plan_read(STATE, URI, lower=lower, upper=want)


def test_a_capped_snapshot_cut_is_read_at_the_snapshot_time() -> None:
    """A cut of the snapshot at 39 capped to one batch: [0, 10), read as at 39."""
    plan = plan_read(STATE, URI, as_of=39, lower=0, upper=40, limits=ReadLimits(max_rows=1))
    assert (plan.upper, keys(plan.parts)) == (10, ["a", "b"])
    assert {(p.lower, p.upper, p.as_of) for p in plan.parts} == {(0, 10, 39)}


@pytest.mark.parametrize(
    ("limits", "splits"),
    [
        (ReadLimits(), [["a", "b", "c", "d"]]),
        (ReadLimits(split_bytes=1000), [["a", "b", "c", "d"]]),
        (ReadLimits(split_bytes=200), [["a", "c"], ["b", "d"]]),
        (ReadLimits(split_bytes=1), [["a"], ["b"], ["c"], ["d"]]),
        (ReadLimits(split_bytes=1000, min_splits=3), [["a", "d"], ["b"], ["c"]]),
    ],
)
def test_splits_partition_the_parts_by_bytes(limits: ReadLimits, splits: list[list[str]]) -> None:
    """Splits are about split_bytes each, at least min_splits, and hold every part once."""
    plan = plan_read(STATE, URI, as_of=39, limits=limits)
    assert [keys(s) for s in plan.splits] == splits


def test_skip_drops_parts_before_splitting() -> None:
    """Parts a pushed filter rules out are neither planned nor split."""
    plan = plan_read(
        STATE, URI, as_of=39, limits=ReadLimits(split_bytes=1), skip=lambda p: p.key in ("b", "d")
    )
    assert keys(plan.parts) == ["a", "c"]
    assert [keys(s) for s in plan.splits] == [["a"], ["c"]]
    assert plan_read(STATE, URI, as_of=39, skip=lambda p: True).splits == ()


@pytest.mark.parametrize(
    ("as_of", "may_retract", "size", "rows"),
    [(9, False, 200, 20), (19, True, 300, 30), (39, True, 400, 40)],
)
def test_plan_figures(as_of: int, may_retract: bool, size: int, rows: int) -> None:
    """may_retract (a consolidated read needs every part at once), bytes and rows to fetch."""
    plan = plan_read(STATE, URI, as_of=as_of)
    assert (plan.may_retract, plan.size_bytes, plan.rows) == (may_retract, size, rows)
    assert plan_read(REPLACED, URI, as_of=9).may_retract  # diff bounds unknown: may


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lower": 10, "upper": 5}, r"\[10, 5\) .* ends before it starts"),
        ({"as_of": 5, "lower": 0, "upper": 7}, r"reaches past as_of 5.*upper <= 6"),
    ],
)
def test_a_range_that_cannot_be_planned_is_refused(kwargs: dict[str, int], message: str) -> None:
    """An inverted range, or a snapshot cut past its as_of, is a usage error naming the fix."""
    with pytest.raises(InvalidUsage, match=message):
        plan_read(STATE, URI, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"max_rows": 0}, {"max_bytes": -1}, {"max_parts": 0}, {"split_bytes": 0}, {"min_splits": 0}],
)
def test_limits_must_be_positive(kwargs: dict[str, int]) -> None:
    """A zero or negative limit is refused when the limits are made, naming the field."""
    with pytest.raises(InvalidUsage, match=next(iter(kwargs))):
        ReadLimits(**kwargs)


def fake_part(size: int, i: int) -> LeasedPart:
    """A leased part of ``size`` bytes (never fetched)."""
    ref = PartRef(f"k/part/{i}", None, size, 1, 0, 0)
    return LeasedPart("k", "mem://x", ref, 0, 1, None, 1)


def test_split_parts_balances_by_bytes_and_respects_min_and_max() -> None:
    """Every part goes to exactly one task; task count follows bytes, minPartitions and #parts."""
    parts = [fake_part(s, i) for i, s in enumerate([100, 90, 50, 40, 30, 10])]
    assert split_parts([], 1, 4) == []
    one = split_parts(parts, 10_000, 1)
    assert len(one) == 1 and len(one[0]) == 6
    assert len(split_parts(parts, 110, 1)) == 4  # 320 bytes / 110 -> 2.9: a power of two, 4
    by_bytes = split_parts(parts, 160, 1)  # 320 bytes / 160 -> 2 tasks
    assert len(by_bytes) == 2
    loads = sorted(sum(p.part.size_bytes for p in b) for b in by_bytes)
    assert loads[-1] - loads[0] <= 20  # greedy balance
    assert len(split_parts(parts, 10_000, 4)) == 4
    assert len(split_parts(parts, 1, 1)) == 6  # never more tasks than parts
    assert len(split_parts(parts, 1, 100)) == 6
    for split in (one, by_bytes, split_parts(parts, 1, 1)):
        got = sorted(p.part.key or "" for b in split for p in b)
        assert got == sorted(p.part.key or "" for p in parts)


MiB = 1 << 20
ROW_BYTES = 52
"""Bytes per row of the benchmarks' rows (int64, float64, 32-char string)."""


def arrow_part(rows: int, i: int, fmt: str = "arrow-rows") -> LeasedPart:
    """A leased Arrow part of ``rows`` benchmark rows, as the Spark sink stages them."""
    ref = PartRef(f"k/part/{i}", None, rows * ROW_BYTES, rows, 0, 0, dmin=1, dmax=1, fmt=fmt)
    return LeasedPart("k", "mem://x", ref, 0, 1, 0, 1)


def sink_shard(mib: int, tasks: int = 2, part_rows: int = 19 * CUT_ROWS) -> list[LeasedPart]:
    """The parts the Spark sink writes for ``mib`` MiB of rows from ``tasks`` tasks: each task
    cuts its rows into parts of ``part_rows`` (64 MiB of Arrow) and a remainder."""
    per_task = mib * MiB // ROW_BYTES // tasks
    sizes = [part_rows] * (per_task // part_rows) + [per_task % part_rows]
    return [arrow_part(rows, i) for i, rows in enumerate(sizes * tasks)]


def assert_reads_every_row_once(parts: list[LeasedPart], splits: list[list[LeasedPart]]) -> None:
    """The splits' row ranges tile each part: every stored row read by exactly one task."""
    got: dict[str, list[tuple[int, int]]] = {}
    for piece in (p for s in splits for p in s):
        got.setdefault(piece.part.key or "", []).append(piece.row_range or (0, piece.part.rows))
    for p in parts:
        ranges = sorted(got.pop(p.part.key or ""))
        assert ranges[0][0] == 0 and ranges[-1][1] == p.part.rows, ranges
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges
    assert got == {}


def loads(splits: list[list[LeasedPart]]) -> list[int]:
    return [sum(p.read_bytes for p in s) for s in splits]


@pytest.mark.parametrize(
    ("sizes", "split_bytes", "min_splits", "count"),
    [
        ([64 * MiB] * 4, 64 * MiB, 1, 4),
        ([61 * MiB] * 4 + [4 * MiB] * 2, 64 * MiB, 1, 4),  # 252 MiB: not 5 tasks, 4
        ([61 * MiB] * 16 + [30 * MiB] * 2, 64 * MiB, 1, 16),  # 1 GiB
        ([100 * MiB], 64 * MiB, 1, 2),
        ([65 * MiB] * 2, 64 * MiB, 1, 2),
        ([64 * MiB] * 3, 64 * MiB, 1, 4),  # 3 by bytes, the nearest power of two: 4
        ([64 * MiB] * 5, 64 * MiB, 1, 4),
        ([10 * MiB], 64 * MiB, 1, 1),
        ([61 * MiB] * 4, 1 << 40, 2, 2),  # the benchmarks' tuned minPartitions = cores
        ([61 * MiB] * 4, 1 << 40, 3, 3),  # minPartitions is taken as given
        ([10 * MiB], 1, 1, 10 * MiB // ROW_BYTES // CUT_ROWS + 1),  # no more than the pieces
    ],
)
def test_split_count_is_a_power_of_two_from_bytes_or_min_splits(
    sizes: list[int], split_bytes: int, min_splits: int, count: int
) -> None:
    """Tasks from bytes round to the nearest power of two: equal tasks then keep 1, 2, 4, 8 ...
    cores busy to the end, whatever the parallelism Spark gives the read (which the planner
    cannot know); never more tasks than the parts can be cut into."""
    parts = [arrow_part(size // ROW_BYTES, i) for i, size in enumerate(sizes)]
    assert split_count(parts, split_bytes, min_splits) == count


@pytest.mark.parametrize(
    ("mib", "split_bytes", "min_splits", "tasks"),
    [
        (256, 64 * MiB, 1, 4),  # the default options
        (1024, 64 * MiB, 1, 16),
        (256, 1 << 40, 2, 2),  # minPartitions = cores, splitSizeBytes = 1t
        (1024, 1 << 40, 4, 4),
        (256, 1 << 40, 3, 3),
    ],
)
def test_a_sink_written_shard_splits_into_equal_tasks(
    mib: int, split_bytes: int, min_splits: int, tasks: int
) -> None:
    """A shard written by the Spark sink (64 MiB parts and one small remainder per writing
    task) splits into tasks within one cut (CUT_ROWS rows) of each other, each row read once.

    Whole parts spread greedily made 5 tasks of 122, 122, 8 ... MiB at 256 MiB, so on two
    cores one core waited for the other."""
    parts = sink_shard(mib)
    splits = split_parts(parts, split_bytes, min_splits)
    assert len(splits) == tasks
    assert_reads_every_row_once(parts, splits)
    assert max(loads(splits)) - min(loads(splits)) <= CUT_ROWS * ROW_BYTES


def test_a_part_is_cut_only_where_it_does_not_fit_whole() -> None:
    """Four 64 MiB parts over four tasks are read whole: cutting costs a task the part's
    fetch (its checksum covers the whole part), so a part is cut only to even the tasks."""
    parts = [arrow_part(20 * CUT_ROWS, i) for i in range(4)]
    splits = split_parts(parts, 64 * MiB, 1)
    assert [[p.row_range for p in s] for s in splits] == [[None]] * 4
    sink = sink_shard(256)
    cut = {p.part.key for s in split_parts(sink, 64 * MiB, 1) for p in s if p.row_range}
    assert cut <= {p.part.key for p in sink if p.part.rows < CUT_ROWS * 2}  # the remainders


@pytest.mark.parametrize("fmt", ["parquet", "inline"])
def test_parquet_and_inline_parts_are_never_cut(fmt: str) -> None:
    """A Parquet part's row groups hold about a million rows, so two tasks cutting one would
    each decode most of it; an inline part is tiny. Both are spread whole."""
    if fmt == "inline":
        ref = PartRef(None, b"x", 100 * MiB, 20 * CUT_ROWS, 0, 0)
        parts = [LeasedPart("k", "mem://x", ref, 0, 1, 0, 1)]
    else:
        parts = [arrow_part(20 * CUT_ROWS, 0, fmt="parquet")]
    assert split_count(parts, 1, 8) == 1
    assert [[p.row_range for p in s] for s in split_parts(parts, 1, 8)] == [[None]]


def test_a_cut_part_travels_with_its_row_range() -> None:
    """A piece's row range survives the JSON a Spark InputPartition carries; a whole part's
    JSON has none (what older readers wrote reads as whole)."""
    whole = arrow_part(3 * CUT_ROWS, 0)
    piece = replace(whole, row_range=(CUT_ROWS, 3 * CUT_ROWS))
    assert LeasedPart.from_json(piece.to_json()) == piece
    assert "rows" not in whole.to_json() and LeasedPart.from_json(whole.to_json()) == whole
    assert piece.read_bytes == 2 * CUT_ROWS * ROW_BYTES
