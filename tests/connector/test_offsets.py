"""The streaming source's offset arithmetic from tables: state, previous offset, limits in; the
next offset (or what a micro-batch reads, or a refusal) out. No Spark, no store, no clock.

Each state is written as its trace, ``"0-1:100 1-2:100x2 2-3:0"``: batches ``[lower, upper)``
with their rows (``xN``: in N parts; no rows: no part), 10 bytes a row. Spark's behaviour on
top of these rules is checked in ``test_source_unit.py`` and ``test_stream_semantics_unit.py``
(on a store, through the reader Spark drives) and end to end in the ``*_spark.py`` files.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from test_layout import KERNEL, public_name_sources

from pyspark_persist.offsets import (
    LISTEN,
    SNAPSHOT,
    Gap,
    MicroBatch,
    Offset,
    Start,
    Starting,
    behind_end,
    caught_up,
    check_incarnation,
    initial_offset,
    micro_batch,
    next_offset,
    reads_nothing,
    since_after,
    upper_offset,
)
from pyspark_persist.state.errors import InvalidFrontier, ShardDropped
from pyspark_persist.state.planning import NO_LIMITS, ReadLimits
from pyspark_persist.state.state import Batch, PartRef, ShardState

SHARD = "s"
SEQNO = 9
"""The SeqNo of every state here: the one the offsets computed from it are observed at."""
INC = "inc-1"
FOUR = "0-1:100 1-2:100 2-3:100 3-4:100"
"""Four batches of 100 rows (1,000 bytes) each, one part apiece: upper 4."""


def shard(trace: str, since: int = 0) -> ShardState:
    """A state of shard ``s`` at SeqNo 9 whose batches are ``trace`` (see the module doc)."""
    batches = {}
    upper = 0
    for spec in trace.split():
        m = re.fullmatch(r"(\d+)-(\d+):(\d+)(?:x(\d+))?", spec)
        assert m, spec
        lower, upper, rows, n = int(m[1]), int(m[2]), int(m[3]), int(m[4] or 1)
        parts = tuple(
            PartRef(f"p{lower}-{i}", None, rows // n * 10, rows // n, lower, upper - 1)
            for i in range(n if rows else 0)
        )
        batches[f"{lower}-{upper}"] = Batch(lower, upper, 0, parts)
    state = ShardState(SHARD, SEQNO, b"", since, upper, incarnation=INC, batches=batches)
    state.check_invariants()
    return state


def listen(upper: int, seqno: int = SEQNO) -> Offset:
    """A ``listen`` offset: everything below ``upper`` emitted."""
    return Offset(SHARD, seqno, upper, LISTEN, None, INC)


def snap(upper: int = 0, as_of: int | None = None, seqno: int = SEQNO) -> Offset:
    """A ``snapshot`` offset: the snapshot at ``as_of`` emitted below ``upper``."""
    return Offset(SHARD, seqno, upper, SNAPSHOT, as_of, INC)


BEFORE_SNAPSHOT = snap(0, None, seqno=0)
"""A query's first offset by default (its SeqNo is 0: no state observed)."""


def rows(n: int) -> ReadLimits:
    """maxRowsPerTrigger=n."""
    return ReadLimits(max_rows=n)


# --- next_offset: Spark's latestOffset ---------------------------------------------------------


@pytest.mark.parametrize(
    ("trace", "start", "limits", "available_now", "expected"),
    [
        # listen: everything up to the upper, or where a cap ends a run of whole batches
        (FOUR, listen(0), NO_LIMITS, None, listen(4)),
        (FOUR, listen(1), NO_LIMITS, None, listen(4)),
        (FOUR, listen(4, seqno=3), NO_LIMITS, None, listen(4, seqno=3)),  # nothing new: start
        (FOUR, listen(1), rows(200), None, listen(3)),
        (FOUR, listen(1), rows(150), None, listen(2)),
        (FOUR, listen(1), rows(50), None, listen(2)),  # one batch over the cap still goes
        (FOUR, listen(0), ReadLimits(max_parts=2), None, listen(2)),
        (FOUR, listen(0), ReadLimits(max_bytes=2500), None, listen(2)),
        ("0-1:100x3 1-2:100", listen(0), ReadLimits(max_parts=3), None, listen(1)),
        ("0-1:100 1-3:0 3-4:100", listen(0), rows(100), None, listen(3)),  # empty rides along
        # Trigger.AvailableNow: no further than the upper seen when it was prepared
        (FOUR, listen(0), NO_LIMITS, 2, listen(2)),
        (FOUR, listen(2), NO_LIMITS, 2, listen(2)),
        (FOUR, listen(0), NO_LIMITS, 6, listen(4)),  # a cached state behind it: no further
        (FOUR, listen(0), rows(300), 2, listen(2)),
        (FOUR, listen(0), rows(100), 3, listen(1)),
        ("0-4:400", listen(1), rows(100), 2, listen(2)),  # merged across it: cut by time
        # the snapshot, whole: at the newest complete time, or at the time asked for
        (FOUR, BEFORE_SNAPSHOT, NO_LIMITS, None, listen(4)),
        ("", BEFORE_SNAPSHOT, NO_LIMITS, None, BEFORE_SNAPSHOT),  # nothing written yet
        (FOUR, snap(0, 1), NO_LIMITS, None, listen(2)),
        (FOUR, snap(0, 4), NO_LIMITS, None, snap(0, 4)),  # time 4 is not complete yet
        (FOUR, BEFORE_SNAPSHOT, NO_LIMITS, 2, listen(2)),
        # the snapshot, cut: snapshot offsets at one as_of, the last cut ends it in listen
        (FOUR, BEFORE_SNAPSHOT, rows(200), None, snap(2, 3)),
        (FOUR, snap(2, 3), rows(200), None, listen(4)),
        (FOUR, snap(0, 2), rows(100), None, snap(1, 2)),
        (FOUR, snap(1, 2), rows(100), None, snap(2, 2)),
        (FOUR, snap(2, 2), rows(100), None, listen(3)),
        ("0-2:100 2-6:100", snap(0, 3), rows(100), None, snap(2, 3)),
        ("0-2:100 2-6:100", snap(2, 3), rows(100), None, listen(4)),  # cut at as_of + 1
        (FOUR, BEFORE_SNAPSHOT, rows(100), 2, snap(1, 1)),
    ],
)
def test_next_offset(
    trace: str, start: Offset, limits: ReadLimits, available_now: int | None, expected: Offset
) -> None:
    """The end of the next micro-batch (``start`` itself when nothing is new)."""
    assert next_offset(shard(trace), start, limits, available_now) == expected


@pytest.mark.parametrize(
    ("start", "upper", "expected"),
    [
        (listen(4), 4, True),
        (listen(5), 4, True),
        (listen(3), 4, False),
        (snap(0, None), 0, False),
        (snap(2, 3), 4, False),
    ],
)
def test_caught_up_when_next_offset_has_nothing_new(
    start: Offset, upper: int, expected: bool
) -> None:
    """A listen start at or past the upper has nothing new (the source may wait for a commit);
    a snapshot start is never caught up."""
    state = shard(" ".join(f"{t}-{t + 1}:10" for t in range(upper)))
    assert caught_up(state, start) is expected
    if expected:
        assert next_offset(state, start) == start


# --- initial_offset: where a query with no checkpoint starts --------------------------------


def outcome(decided: Start | MicroBatch | Gap) -> object:
    """A result as a table writes it: ``("refused", resume)`` for a Gap, else the offset (or the
    read as ``(lower, upper, as_of, whole_snapshot)``) and the resume of each gap skipped."""
    if isinstance(decided, Gap):
        return ("refused", decided.resume)
    if isinstance(decided, Start):
        return decided.offset, [g.resume for g in decided.skipped]
    read = (decided.lower, decided.upper, decided.as_of, decided.whole_snapshot)
    return read, [g.resume for g in decided.skipped]


@pytest.mark.parametrize(
    ("since", "starting", "fail_on_data_loss", "expected"),
    [
        (0, Starting(), True, (BEFORE_SNAPSHOT, [])),
        (2, Starting(), True, (BEFORE_SNAPSHOT, [])),
        (0, Starting(latest=True), True, (listen(4), [])),
        (0, Starting(as_of=2), True, (snap(0, 2, seqno=0), [])),
        (2, Starting(as_of=2), True, (snap(0, 2, seqno=0), [])),
        (2, Starting(as_of=1), True, ("refused", 2)),
        (2, Starting(as_of=1), False, (snap(0, 2, seqno=0), [2])),  # the snapshot at since
        (0, Starting(changes_from=0), True, (listen(0), [])),
        (0, Starting(changes_from=2), True, (listen(2), [])),
        (0, Starting(changes_from=4), True, (listen(4), [])),  # from the upper: new changes
        (2, Starting(changes_from=0), True, (listen(0), [])),  # from 0 nothing merged away
        (2, Starting(changes_from=3), True, (listen(3), [])),
        (2, Starting(changes_from=2), True, ("refused", 3)),  # needs the collection at 1
        (2, Starting(changes_from=2), False, (listen(3), [3])),
    ],
)
def test_initial_offset(
    since: int, starting: Starting, fail_on_data_loss: bool, expected: object
) -> None:
    """The first offset for each starting option, and a gap refused or skipped."""
    assert outcome(initial_offset(shard(FOUR, since), starting, fail_on_data_loss)) == expected


@pytest.mark.parametrize(
    ("starting", "message"),
    [
        (
            Starting(as_of=4, what="startingAsOf"),
            r"^persist source: startingAsOf 4 is at or past the upper 4 .*\[since, upper\)",
        ),
        (
            Starting(changes_from=5, what="startingTimestamp"),
            r"^persist source: startingTimestamp: time 5 is past the upper 4 .*"
            r"\[since, upper\] = \[1, 4\].*startingPosition=latest",
        ),
    ],
)
def test_a_start_past_the_upper_is_refused_naming_both_frontiers(
    starting: Starting, message: str
) -> None:
    """A time not written yet is no data loss: InvalidFrontier, whatever failOnDataLoss says."""
    for fail_on_data_loss in (True, False):
        with pytest.raises(InvalidFrontier, match=message):
            initial_offset(shard(FOUR, since=1), starting, fail_on_data_loss)


def test_a_gap_says_what_was_compacted_and_where_reading_resumes() -> None:
    """The refusal's text names the option as the user wrote it and both frontiers; it is the
    same Gap that failOnDataLoss=false skips."""
    state = shard(FOUR, since=2)
    gap = initial_offset(state, Starting(as_of=1, what="startingAsOf"))
    assert isinstance(gap, Gap) and gap.resume == 2
    assert re.search(
        r"startingAsOf 1 is before the since 2 .*\[since, upper\) = \[2, 4\)", gap.what
    )
    lenient = initial_offset(state, Starting(as_of=1, what="startingAsOf"), False)
    assert isinstance(lenient, Start) and lenient.skipped == (gap,)
    gap = initial_offset(state, Starting(changes_from=2, what="startingVersion 5"))
    assert isinstance(gap, Gap) and gap.resume == 3
    assert gap.what.startswith("startingVersion 5: time 2 needs the collection as of 1, ")
    assert "before the since 2" in gap.what


# --- micro_batch: what partitions(start, end) reads ------------------------------------------


@pytest.mark.parametrize(
    ("since", "start", "end", "fail_on_data_loss", "expected"),
    [
        # the whole snapshot in one micro-batch, at the time its end says
        (0, BEFORE_SNAPSHOT, listen(4), True, ((0, 4, 3, True), [])),
        (0, snap(0, 2, seqno=0), listen(3), True, ((0, 3, 2, True), [])),
        # cuts of a capped snapshot, each read as at the snapshot's time
        (0, BEFORE_SNAPSHOT, snap(2, 3), True, ((0, 2, 3, False), [])),
        (0, snap(2, 3), snap(3, 3), True, ((2, 3, 3, False), [])),
        (0, snap(2, 3), listen(4), True, ((2, 4, 3, False), [])),
        (2, snap(3, 3), listen(4), True, ((3, 4, 3, False), [])),
        # listen ranges, each update at its own time
        (0, listen(1), listen(3), True, ((1, 3, None, False), [])),
        (2, listen(0), listen(4), True, ((0, 4, None, False), [])),  # from 0: nothing merged
        (2, listen(3), listen(4), True, ((3, 4, None, False), [])),
        # compaction merged what a replayed micro-batch has still to read
        (2, listen(2), listen(4), True, ("refused", 3)),
        (2, listen(2), listen(4), False, ((3, 4, None, False), [3])),
        (2, snap(2, 3), listen(4), True, ("refused", 3)),
        (2, snap(2, 3), listen(4), False, ((3, 4, 3, False), [3])),
        (2, snap(0, 1, seqno=0), listen(2), True, ("refused", 2)),
        (2, snap(0, 1, seqno=0), listen(2), False, ((0, 3, 2, True), [2])),  # at the since
        # both: the snapshot's time and the cut's start were merged away
        (3, snap(1, 1), listen(2), True, ("refused", 3)),
        (3, snap(1, 1), listen(2), False, ((4, 4, 3, False), [3, 4])),
    ],
)
def test_micro_batch(
    since: int, start: Offset, end: Offset, fail_on_data_loss: bool, expected: object
) -> None:
    """The times ``(start, end]`` reads, at the snapshot's time or their own, and the gaps."""
    assert not reads_nothing(start, end)
    assert outcome(micro_batch(shard(FOUR, since), start, end, fail_on_data_loss)) == expected


def test_micro_batch_gaps_name_the_times_merged() -> None:
    """Each refusal says which times compaction merged before the query read them."""
    state = shard(FOUR, since=2)
    cases = [
        (listen(2), listen(4), r"^times \[2, 2\] were compacted before this query read them$"),
        (snap(2, 3), listen(4), r"^the snapshot's times \[2, 2\] were compacted with earlier"),
        (BEFORE_SNAPSHOT, listen(2), r"^the snapshot at 1 is before the shard's since 2$"),
    ]
    for start, end, message in cases:
        gap = micro_batch(state, start, end)
        assert isinstance(gap, Gap) and re.search(message, gap.what), (start, end, gap)


@pytest.mark.parametrize(
    ("start", "end", "expected"),
    [
        (listen(3), listen(3), True),
        (listen(3), listen(2), True),
        (listen(3), listen(4), False),
        (BEFORE_SNAPSHOT, BEFORE_SNAPSHOT, False),  # a snapshot start always plans
        (snap(2, 3), snap(2, 3), False),
    ],
)
def test_reads_nothing(start: Offset, end: Offset, expected: bool) -> None:
    """An empty listen range needs no state at all; a snapshot start is always planned."""
    assert reads_nothing(start, end) is expected


# --- after a micro-batch: the since to hold, the lag, the newest offset --------------------


@pytest.mark.parametrize(
    ("end", "expected"),
    [
        (listen(4), 3),
        (listen(1), 0),
        (listen(0), None),  # nothing emitted up to a time yet
        (snap(2, 3), None),  # a cut of the snapshot holds the snapshot's time, not its own
        (BEFORE_SNAPSHOT, None),
    ],
)
def test_since_after_a_committed_end(end: Offset, expected: int | None) -> None:
    """The since a reader may hold once Spark committed ``end``: the last time it emitted."""
    assert since_after(end) == expected


@pytest.mark.parametrize(
    ("trace", "end", "expected"),
    [
        (FOUR, None, {"rows": 400, "bytes": 4000, "parts": 4, "times": 4}),
        (FOUR, listen(2), {"rows": 200, "bytes": 2000, "parts": 2, "times": 2}),
        (FOUR, snap(2, 3), {"rows": 200, "bytes": 2000, "parts": 2, "times": 2}),
        (FOUR, listen(4), {"rows": 0, "bytes": 0, "parts": 0, "times": 0}),
        ("0-4:400x2", listen(2), {"rows": 400, "bytes": 4000, "parts": 2, "times": 2}),
    ],
)
def test_behind_end(trace: str, end: Offset | None, expected: dict[str, int]) -> None:
    """What is left after ``end``, in whole batches (a batch merged across it counts whole)."""
    assert behind_end(shard(trace), end).to_dict() == expected


def test_upper_offset_is_the_newest_listen_offset_of_the_state() -> None:
    """startingPosition=latest and the offset Spark's progress shows: at the upper, in listen,
    with the state's SeqNo and incarnation."""
    assert upper_offset(shard(FOUR)) == Offset(SHARD, SEQNO, 4, LISTEN, None, INC)
    assert upper_offset(shard(FOUR)).to_dict() == {
        "shard": SHARD,
        "seqno": SEQNO,
        "upper": 4,
        "phase": "listen",
        "as_of": -1,
        "incarnation": INC,
    }


# --- incarnations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("opened", "named", "dropped"),
    [
        (INC, INC, False),
        (INC, "", False),  # checkpointed before incarnations existed: any
        (None, "", False),
        (INC, "inc-0", True),  # the shard the query read was dropped and created again
        (None, INC, True),
    ],
)
def test_check_incarnation(opened: str | None, named: str, dropped: bool) -> None:
    """An offset naming another incarnation than the one the query opened: ShardDropped."""
    offset = Offset(SHARD, 3, 4, LISTEN, None, named)
    if dropped:
        with pytest.raises(ShardDropped, match=r"shard 's' as it was before it was dropped"):
            check_incarnation(opened, offset)
        with pytest.raises(ShardDropped):  # whichever of a micro-batch's offsets names it
            check_incarnation(opened, Offset(SHARD, 3, 2, LISTEN), offset)
    else:
        check_incarnation(opened, offset)


# --- the module itself --------------------------------------------------------------------------


def test_offsets_decide_with_no_spark_store_clock_or_thread() -> None:
    """``offsets.py`` imports no Spark, no Blob/Consensus/handle module, nothing that keeps
    time or runs threads: besides the standard modules below it names only state's public
    names and its errors, deferred imports too, and each name it takes from
    ``pyspark_persist.state`` comes from a module of the pure kernel (tests/test_layout.py)."""
    top = Path(__file__).resolve().parents[2]
    named: set[str] = set()
    from_state: set[str] = set()
    for node in ast.walk(ast.parse((top / "connector" / "offsets.py").read_text())):
        if isinstance(node, ast.Import):
            named.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            named.add(node.module or "")
            if node.module == "pyspark_persist.state":
                from_state.update(alias.name for alias in node.names)
    assert named == {
        "__future__",
        "dataclasses",
        "json",  # a consumer's position is the canonical JSON of an offset
        "typing",
        "pyspark_persist.state",
        "pyspark_persist.state.errors",
    }
    sources = public_name_sources(top)
    assert {n: sources[n] for n in from_state if sources[n] not in KERNEL} == {}
