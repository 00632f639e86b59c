"""Maintenance planned as data: the policy of ``maintenance_policy`` tested as pure functions,
and what ``--dry-run`` shows is what the real pass then does.

Every function of ``maintenance_policy`` is pure: a state (and the Consensus rows, Blob listing
and time the caller read) in, a decision out; the tests past the first three build those by
hand. The first three go through a client: each plans, checks nothing changed, runs the real
pass, and compares.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyspark_persist.state import PersistClient, PersistConfig, commands
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import VersionedData, open_consensus
from pyspark_persist.state.diff import encode
from pyspark_persist.state.maintenance import plan_gc
from pyspark_persist.state.maintenance_policy import (
    BACKGROUND_COMPACTION_ROUNDS,
    CompactRequest,
    GcPlan,
    GcRequest,
    MergePlan,
    background_gc,
    backpressure_due,
    compaction_due,
    compaction_plan,
    compaction_request,
    concatenation,
    gc_plan,
    gc_walk,
    orphans,
    plan_merge,
    requests_after_commit,
    stale_rollups,
    truncation_point,
)
from pyspark_persist.state.state import Batch, LeasedReaderState, PartRef, ShardState

SCHEMA = pa.schema([("id", pa.int64())])


def make_client(fan_in: int, clock: list[int] | None = None) -> PersistClient:
    """A mem client; with ``clock``, its clock reads ``clock[0]`` (milliseconds)."""
    tag = uuid.uuid4().hex
    config = PersistConfig(
        maintenance=False,
        compaction_fan_in=fan_in,
        inline_write_max_bytes=1,
        staged_part_grace_s=1,
        retry_timeout_s=0.25,  # less than half the grace, as PersistConfig requires
    )
    return PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=config,
        clock_ms=None if clock is None else (lambda: clock[0]),
    )


@pytest.mark.parametrize(
    ("fan_in", "sizes", "merges"),
    [
        (2, [1], []),  # one batch: nothing to merge
        (2, [1, 1], [2]),
        (4, [1, 1, 1], []),  # fewer than fan_in batches
        (2, [1, 1, 1, 1, 1], [5]),  # a run of one tier merges whole
        (2, [2, 1, 1], [2, 2]),  # the merge joins the tier before it
        (2, [4, 2, 1, 1], [2, 2, 2]),  # a cascade
        (3, [50, 9, 9, 1, 1, 1, 9], [3]),  # the merge lands between other tiers: done
    ],
)
def test_compaction_plan_names_the_merges_compaction_then_makes(
    fan_in: int, sizes: list[int], merges: list[int]
) -> None:
    client = make_client(fan_in)
    shard = client.open_shard("s", SCHEMA)
    writer = shard.writer()
    start = 0
    for n in sizes:  # distinct ids: consolidation cancels nothing, so the plan is exact
        writer.append(pa.table({"id": list(range(start, start + n))}))
        start += n
    state = shard.state()
    plan = compaction_plan(state, client.config)
    assert shard.state() is state  # planning changed nothing
    reports = shard.compact()
    assert [(r.batches_in, r.rows_in) for r in reports] == [
        (len(merge), sum(b.rows for b in merge)) for merge in plan
    ]
    assert all(r.applied for r in reports)
    assert [len(merge) for merge in plan] == merges
    assert compaction_plan(shard.state(), client.config) == []
    client.close()


def test_plan_gc_names_what_gc_then_deletes_and_writes_nothing() -> None:
    clock = [time.time_ns() // 1_000_000]
    client = make_client(2, clock)
    shard = client.open_shard("s", SCHEMA)
    writer = shard.writer()
    for i in range(8):
        writer.append(pa.table({"id": [i]}))
    shard.compact()
    staged = writer.builder()
    staged.add(pa.table({"id": [99]}))
    orphan = staged.finish().parts[0].key  # staged, never committed
    clock[0] += 2000  # past staged_part_grace_s: an orphan the sweep deletes
    rows_before = client.consensus.scan("s", 0)
    keys_before = {m.key for m in client.blob.list_keys()}
    plan = plan_gc(shard.machine)
    assert client.consensus.scan("s", 0) == rows_before
    assert {m.key for m in client.blob.list_keys()} == keys_before
    assert len(plan.parts) > 0 and orphan in plan.orphans
    assert plan.consensus_rows > 0 and plan.readers_expired == ()
    report = shard.gc()
    assert report.parts_deleted == len(plan.parts)
    assert report.orphans_deleted == len(plan.orphans)
    gone = keys_before - {m.key for m in client.blob.list_keys()}
    assert gone == set(plan.parts) | set(plan.orphans)
    assert report.consensus_rows_deleted >= plan.consensus_rows
    assert sorted(shard.reader().snapshot_table()["id"].to_pylist()) == list(range(8))
    client.close()


def test_plan_gc_counts_readers_whose_lease_ran_out() -> None:
    clock = [time.time_ns() // 1_000_000]
    client = make_client(2, clock)
    shard = client.open_shard("s", SCHEMA)
    shard.writer().append(pa.table({"id": [1]}))
    shard.reader("sleepy")
    clock[0] += int(client.config.reader_lease_s * 1000) + 1
    plan = plan_gc(shard.machine)
    assert plan.readers_expired == ("sleepy",)
    assert "sleepy" in shard.machine.fetch_latest().leased_readers  # planned, not done
    assert shard.gc().readers_expired == ("sleepy",)
    other = PersistClient(client.blob, client.consensus, cache=StateCache())
    assert "sleepy" not in other.open_shard("s").state().leased_readers
    client.close()


# --- what a commit asks for: pure, over hand-built states ---------------------------------


def _state(
    batch_rows: list[int], seqno: int, last_gc_seqno: int, reader_seqno: int | None
) -> ShardState:
    """A state with one batch of ``rows`` updates per entry (tiers follow rows), at ``seqno``,
    last collected at ``last_gc_seqno``, with one leased reader holding ``reader_seqno``."""
    batches = [
        Batch(i, i + 1, 0, (PartRef(f"p{i}", None, 10, rows, i, i),))
        for i, rows in enumerate(batch_rows)
    ]
    readers = {} if reader_seqno is None else {"r": LeasedReaderState(0, reader_seqno, 0, 1000)}
    return ShardState(
        shard_id="s",
        seqno=seqno,
        schema=b"",
        since=0,
        upper=len(batch_rows),
        last_gc_seqno=last_gc_seqno,
        batches=MappingProxyType({b.key: b for b in batches}),
        leased_readers=MappingProxyType(readers),
    )


def test_only_a_commit_that_can_make_a_merge_due_asks_for_compaction() -> None:
    """A commit that left the batches alone (a reader's heartbeat or since downgrade) asks
    for no compaction, unless it moved the since of a shard with retention (which can
    expire a run of batches); one that changed the batches does."""
    config = PersistConfig(compaction_fan_in=2, gc_interval=32)
    before = _state([1, 1], 1, 0, None)
    held = replace(before, seqno=2, since=1)  # the same batches mapping, as apply keeps it
    assert requests_after_commit(held, config, before) == ()
    appended = replace(held, seqno=3, batches=MappingProxyType(dict(held.batches)))
    assert requests_after_commit(appended, config, held) == (
        CompactRequest(BACKGROUND_COMPACTION_ROUNDS),
    )
    retained = replace(before, retention_ms=1000)
    assert requests_after_commit(replace(retained, seqno=2, since=1), config, retained) == (
        CompactRequest(BACKGROUND_COMPACTION_ROUNDS),
    )


@pytest.mark.parametrize(
    ("batch_rows", "seqno", "last_gc", "reader", "maintenance", "want"),
    [
        ([1], 1, 0, None, True, []),
        ([1, 1], 1, 0, None, True, ["compact"]),  # fan_in (2) batches of one tier
        ([100, 1], 1, 0, None, True, []),  # two tiers: nothing to merge yet
        ([1], 40, 0, None, True, ["gc"]),  # 40 SeqNos since the last GC >= gc_interval (32)
        ([1], 40, 10, None, True, []),  # only 30 since
        ([1], 40, 0, 20, True, []),  # a reader holds SeqNo 20: only 20 collectable
        ([1], 40, 0, 32, True, ["gc"]),
        ([1, 1], 40, 0, None, True, ["compact", "gc"]),
        ([1, 1], 40, 0, None, False, []),  # maintenance off: never
    ],
)
def test_a_commit_asks_for_maintenance_as_data(
    batch_rows: list[int],
    seqno: int,
    last_gc: int,
    reader: int | None,
    maintenance: bool,
    want: list[str],
) -> None:
    """requests_after_commit returns the requests a commit's new state calls for (no I/O)."""
    config = PersistConfig(compaction_fan_in=2, gc_interval=32, maintenance=maintenance)
    got = requests_after_commit(_state(batch_rows, seqno, last_gc, reader), config)
    names = {CompactRequest: "compact", GcRequest: "gc"}
    assert [names[type(r)] for r in got] == want
    assert all(
        r == CompactRequest(BACKGROUND_COMPACTION_ROUNDS)
        if isinstance(r, CompactRequest)
        else r == GcRequest(sweep_orphans=False, force=False)
        for r in got
    )


@settings(max_examples=400, deadline=None)
@given(
    batch_rows=st.lists(st.integers(0, 5000), max_size=70),
    fan_in=st.integers(2, 9),
    retention=st.booleans(),
    since=st.integers(0, 70),
)
def test_compaction_due_answers_what_compaction_request_would(
    batch_rows: list[int], fan_in: int, retention: bool, since: int
) -> None:
    """The cheap check every commit runs agrees with the full request on any trace: runs of
    one tier anywhere, traces past fan_in * MAX_TIERS, and retention's expired runs."""
    config = PersistConfig(compaction_fan_in=fan_in)
    state = replace(
        _state(batch_rows, 1, 0, None),
        retention_ms=1000 if retention else 0,
        since=min(since, max(len(batch_rows) - 1, 0)),
    )
    assert compaction_due(state, config) == (compaction_request(state, config) is not None)


# --- the policy as pure functions: a state (and what GC read) in, the decision out ----------------


def _trace(*spec: tuple[int, int] | tuple[int, int, PartRef]) -> MappingProxyType[str, Batch]:
    """Batches tiling ``[0, ...)`` from ``(upper, rows)`` (one Blob part of ``rows`` updates,
    100 bytes per row) or ``(upper, since, part)``."""
    batches, lower = {}, 0
    for entry in spec:
        if len(entry) == 2:
            upper, rows = entry
            parts: tuple[PartRef, ...] = (
                PartRef(f"p{upper}", None, 100 * rows, rows, lower, lower),
            )
            since = 0
        else:
            upper, since, part = entry
            parts = (part,)
        batch = Batch(lower, upper, since, parts)
        batches[batch.key] = batch
        lower = upper
    return MappingProxyType(batches)


def _policy_state(*spec: tuple[int, int] | tuple[int, int, PartRef], **fields: Any) -> ShardState:
    batches = _trace(*spec)
    upper = max((b.upper for b in batches.values()), default=0)
    base = ShardState(shard_id="s", seqno=1, schema=b"", since=0, upper=upper, batches=batches)
    return replace(base, **fields)


@pytest.mark.parametrize(
    ("rows", "merged"),
    [
        ([1000, 1, 1, 1, 50], (1, 4)),  # the oldest run of fan_in of one tier, not the first batch
        ([1, 1, 9, 9, 9], (0, 2)),  # the oldest of two runs
        ([1, 9, 1, 9, 1, 9], None),  # tiers interleaved, trace short: nothing
        # Past fan_in * MAX_TIERS (2 * 6) with no run: the lightest adjacent fan_in merge,
        ([2, 8] * 6 + [1], (11, 13)),
        ([2, 8] * 6 + [2], (0, 2)),  # the oldest of equally light ones
    ],
)
def test_compaction_request_takes_the_oldest_run_of_one_tier_else_the_lightest_window(
    rows: list[int], merged: tuple[int, int] | None
) -> None:
    config = PersistConfig(compaction_fan_in=2)
    state = _policy_state(*((i + 1, n) for i, n in enumerate(rows)))
    want = None if merged is None else state.trace[merged[0] : merged[1]]
    assert compaction_request(state, config) == want


def test_compaction_request_merges_what_retention_expired_first() -> None:
    """On a shard with retention, the leading batches since has passed merge before any tier
    run (they fold into the contents at since): every batch whose times are all at or below
    since, so ``[2, 3)`` too at since 2."""
    config = PersistConfig(compaction_fan_in=2)
    state = _policy_state((1, 10), (2, 100), (3, 1), (4, 1), since=1, retention_ms=1000)
    assert compaction_request(state, config) == state.trace[:2]
    assert compaction_request(replace(state, since=2), config) == state.trace[:3]
    assert compaction_request(replace(state, retention_ms=0), config) == state.trace[2:]


@pytest.mark.parametrize(
    ("batches", "maintenance", "due"),
    [(24, True, False), (25, True, True), (25, False, False)],
)
def test_backpressure_is_due_past_twice_the_bounded_trace(
    batches: int, maintenance: bool, due: bool
) -> None:
    """fan_in (2) * MAX_TIERS (6) * BACKPRESSURE (2) = 24 batches; past them a writer compacts."""
    config = PersistConfig(compaction_fan_in=2, maintenance=maintenance)
    state = _policy_state(*((i + 1, 1) for i in range(batches)))
    assert backpressure_due(state, config) is due


def _part(key: str, dmin: int | None = 1, dmax: int | None = 1, negate: bool = False) -> PartRef:
    return PartRef(key, None, 100, 1, 0, 0, negate=negate, dmin=dmin, dmax=dmax)


@pytest.mark.parametrize(
    ("since", "batch_sinces", "want"),
    [
        (3, (0, 0), 3),  # times below the shard's since advance to it
        (50, (0, 0), 19),  # clamped inside the merged interval [0, 20)
        (3, (0, 7), 7),  # never below a since a batch already has
    ],
)
def test_a_merge_rewrites_at_the_shards_since_clamped_to_the_run(
    since: int, batch_sinces: tuple[int, int], want: int
) -> None:
    state = _policy_state(
        (10, batch_sinces[0], _part("a")), (20, batch_sinces[1], _part("b")), since=since
    )
    plan = plan_merge(state, state.trace, PersistConfig())
    assert plan == MergePlan(state.trace, rewrite=True, since=want, consolidate=False)
    assert plan.parts == (_part("a"), _part("b"))
    assert plan.merged((_part("m"),)) == Batch(0, 20, want, (_part("m"),))


@pytest.mark.parametrize(
    ("part", "consolidate"),
    [
        (_part("x"), False),  # inserts only: nothing can cancel
        (_part("x", dmin=-1, dmax=1), True),  # a retraction
        (_part("x", dmin=1, dmax=1, negate=True), True),  # a replace's negated reference
        (_part("x", dmin=None, dmax=None), True),  # unknown diffs: assume the worst
    ],
)
def test_a_merge_consolidates_only_when_some_update_may_be_a_retraction(
    part: PartRef, consolidate: bool
) -> None:
    state = _policy_state((10, 0, _part("a")), (20, 0, part))
    assert plan_merge(state, state.trace, PersistConfig()).consolidate is consolidate


@pytest.mark.parametrize("why", ["over the memory budget", "no parts"])
def test_a_merge_past_the_memory_budget_or_without_parts_concatenates(why: str) -> None:
    """Nothing is read or rewritten: the parts go side by side at the oldest since of the run."""
    if why == "no parts":
        batches = (Batch(0, 10, 2, ()), Batch(10, 20, 5, ()))
        state = _policy_state(
            since=9, upper=20, batches=MappingProxyType({b.key: b for b in batches})
        )
        config = PersistConfig()
    else:
        state = _policy_state((10, 2, _part("a", dmin=-1)), (20, 5, _part("b")), since=9)
        config = PersistConfig(compaction_memory_bytes=199)
    plan = plan_merge(state, state.trace, config)
    assert plan == MergePlan(state.trace, rewrite=False, since=2, consolidate=False)
    assert plan.merged(plan.parts) == concatenation(state.trace)
    assert concatenation(state.trace) == Batch(0, 20, 2, plan.parts)


def _rows(start: ShardState, *steps: Any) -> tuple[list[VersionedData], ShardState]:
    """Consensus rows of the commands ``steps`` (state -> Outcome) applied from ``start``, and
    the state they lead to."""
    rows, state = [], start
    for step in steps:
        outcome = step(state)
        assert isinstance(outcome, commands.Apply)
        rows.append(VersionedData(state.seqno + 1, encode(outcome.diff)))
        state = state.apply(outcome.diff)
    return rows, state


def _merge(lower: int, upper: int, key: str) -> Any:
    """A command merging the batches of ``[lower, upper)`` into one Blob part ``key``."""

    def step(s: ShardState) -> Any:
        run = tuple(b for b in s.trace if lower <= b.lower and b.upper <= upper)
        return commands.apply_merge(s, replaced=run, merged=Batch(lower, upper, 0, (_part(key),)))

    return step


def _history() -> tuple[ShardState, list[VersionedData], ShardState]:
    """From a state at SeqNo 5 with parts p10 and p20: merge them into m (SeqNo 6), append p30
    (7), merge everything into m2 (8), append an inline part (9). The start, the rows, the head."""
    start = replace(_policy_state((10, 1), (20, 1)), seqno=5)
    inline = PartRef(None, b"x", 1, 1, 30, 30)
    rows, head = _rows(
        start,
        _merge(0, 20, "m"),
        lambda s: commands.compare_and_append(
            s,
            parts=(_part("p30"),),
            expected_upper=20,
            new_upper=30,
            writer_id="w",
            token=1,
            now_ms=0,
        ),
        _merge(0, 30, "m2"),
        lambda s: commands.compare_and_append(
            s, parts=(inline,), expected_upper=30, new_upper=31, writer_id="w", token=2, now_ms=0
        ),
    )
    return start, rows, head


@pytest.mark.parametrize(
    ("seqno_since", "garbage", "keep"),
    [
        (5, set(), {"p10", "p20"}),  # a reader holds the oldest state: nothing goes
        (6, {"p10", "p20"}, {"m"}),
        (7, {"p10", "p20"}, {"m", "p30"}),
        (8, {"p10", "p20", "m", "p30"}, {"m2"}),
        (9, {"p10", "p20", "m", "p30"}, {"m2"}),  # inline parts have no key to delete
    ],
)
def test_gc_walk_deletes_what_diffs_before_seqno_since_removed_and_no_kept_state_needs(
    seqno_since: int, garbage: set[str], keep: set[str]
) -> None:
    start, rows, _ = _history()
    walk = gc_walk(start, rows, seqno_since)
    assert walk.garbage == garbage
    assert walk.keep == keep
    assert walk.live == {"m", "p30", "m2"}  # what the states after the oldest reference
    assert walk.at_since.seqno == seqno_since


def test_gc_walk_keeps_parts_a_removed_batch_shares_with_the_state_at_seqno_since() -> None:
    """A concatenating merge removes batches whose parts its batch still references."""
    start = replace(_policy_state((10, 1), (20, 1)), seqno=5)
    rows, _ = _rows(
        start,
        lambda s: commands.apply_merge(s, replaced=s.trace, merged=concatenation(s.trace)),
    )
    walk = gc_walk(start, rows, 6)
    assert walk.garbage == set() and walk.keep == {"p10", "p20"}


@pytest.mark.parametrize(
    ("rollups", "first", "want"),
    [
        ({90: "r"}, 90, (90, False)),  # a rollup 10 SeqNos back (< rollup_interval / 2): use it
        ({60: "r"}, 60, (100, True)),  # 40 back: write a new one at seqno_since
        ({}, 1, (100, True)),  # none yet
        ({95: "r"}, 97, (100, True)),  # older than the oldest row left: it cannot start a load
        ({90: "r", 105: "r"}, 90, (90, False)),  # one past the state at seqno_since is no use
    ],
)
def test_truncation_point_truncates_below_a_rollup_at_or_just_before_seqno_since(
    rollups: dict[int, str], first: int, want: tuple[int, bool]
) -> None:
    at_since = _policy_state(seqno=100, rollups=MappingProxyType(rollups))
    assert truncation_point(at_since, first, PersistConfig(rollup_interval=32)) == want


def test_stale_rollups_are_those_below_the_truncation_point() -> None:
    state = _policy_state(rollups=MappingProxyType({10: "a", 40: "b", 70: "c"}))
    assert stale_rollups(state, 40) == (10,)
    assert stale_rollups(state, 71) == (10, 40, 70)


HOUR = 3_600_000


@dataclass(frozen=True)
class Listed:
    key: str
    modified_ms: int | None


@pytest.mark.parametrize(
    ("key_ms", "store_ms", "live", "doomed"),
    [
        (0, 0, False, True),  # past the grace by both clocks
        (0, 0, True, False),  # a state references it
        (HOUR // 2, 0, False, False),  # the key says it is fresh: the store's clock is behind
        (0, HOUR // 2, False, False),  # the store says it is fresh: the writer's clock is behind
        (None, 0, False, True),  # a key without a time: the store's alone
        (None, None, False, False),  # no time at all: never taken
    ],
)
def test_an_orphan_part_goes_once_the_grace_passed_by_the_later_of_both_clocks(
    key_ms: int | None, store_ms: int | None, live: bool, doomed: bool
) -> None:
    key = f"s/part/{key_ms:013d}-abc.parquet" if key_ms is not None else "s/part/abc.parquet"
    found = orphans(
        [Listed(key, store_ms)],
        [],
        live={key} if live else set(),
        oldest_rollup=0,
        recorded={},
        now_ms=HOUR,
        config=PersistConfig(),
    )
    assert found == ([key] if doomed else [])


def test_a_stray_rollup_goes_when_below_the_oldest_and_not_recorded() -> None:
    listed = [Listed(f"s/rollup/{n:020d}", 0) for n in (10, 20, 30, 40)]
    found = orphans(
        [],
        listed,
        live=set(),
        oldest_rollup=30,
        recorded={20: "r"},
        now_ms=0,
        config=PersistConfig(),
    )
    assert found == [f"s/rollup/{10:020d}"]


def test_gc_plan_names_every_deletion_of_a_pass_at_now() -> None:
    """Expiring a reader whose lease ran out moves seqno_since, and with it what may go."""
    start, rows, head = _history()
    lapsed = LeasedReaderState(since=0, seqno=6, last_heartbeat_ms=0, lease_duration_ms=10)
    live = LeasedReaderState(since=0, seqno=8, last_heartbeat_ms=HOUR, lease_duration_ms=10)
    head = replace(
        head,
        leased_readers=MappingProxyType({"lapsed": lapsed, "live": live}),
        rollups=MappingProxyType({5: "r5", 8: "r8"}),
    )
    config = PersistConfig(rollup_interval=4)
    stray = Listed("s/part/0000000000000-stray.arrow", 0)
    kept = Listed("m2", 0)
    plan = gc_plan(head, (start, rows, 5), [stray, kept], [], config, now_ms=HOUR)
    assert plan == GcPlan(
        seqno_since=8,
        readers_expired=("lapsed",),
        parts=("m", "p10", "p20", "p30"),
        rollups=(5,),
        consensus_rows=3,  # rows 5, 6 and 7: the rollup at 8 starts the history after
        orphans=(stray.key,),
    )
    assert gc_plan(head, None, [], [], config, now_ms=HOUR) == GcPlan(8, ("lapsed",), (), (), 0, ())


def test_every_sixteenth_background_gc_sweeps_orphans() -> None:
    swept = [n for n in range(1, 50) if background_gc(GcRequest(), n).sweep_orphans]
    assert swept == [16, 32, 48]
    assert background_gc(GcRequest(force=True), 16) == GcRequest(sweep_orphans=True, force=True)
