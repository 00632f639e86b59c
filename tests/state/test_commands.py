"""Every transition of ``commands.py``, tested as the pure function it is: a state in, the exact
diff (``Apply``) or refusal (``Refuse``) out. No store, no client, no clock, no ``tmp_path``.

States are built by hand; each expected diff is spelled out field by field, so a command that
writes one entry too many (or one too few) fails here, not in a long run against a store. Each
applied diff is also applied, checked against the state invariants, and round-tripped through the
encoding Consensus stores, as the machine would.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, TypeVar

import pyarrow as pa
import pytest

from pyspark_persist.state.commands import (
    AlreadyCommitted,
    Apply,
    Committed,
    CriticalSince,
    Outcome,
    Refuse,
    UpperMismatch,
    add_rollup,
    apply_merge,
    claim_gc,
    compare_and_append,
    compare_and_downgrade_since,
    create_shard,
    expire_leased_readers,
    expire_writers,
    fence,
    heartbeat_leased_reader,
    register_critical_reader,
    register_leased_reader,
    remove_rollups,
)
from pyspark_persist.state.diff import decode, encode
from pyspark_persist.state.errors import SchemaMismatch
from pyspark_persist.state.schema import decode_schema, encode_schema
from pyspark_persist.state.state import (
    EMPTY_STATE,
    Batch,
    CriticalReaderState,
    LeasedReaderState,
    PartRef,
    ShardState,
    StateDiff,
    WriterState,
)

R = TypeVar("R")

SCHEMA = encode_schema(pa.schema([("id", pa.int64())]))


def part(key: str, tmin: int = 0, tmax: int | None = None, **kw: Any) -> PartRef:
    """A Blob part of 2 rows at ``[tmin, tmax]`` (``tmax`` defaults to ``tmin``)."""
    return PartRef(key, None, 100, 2, tmin, tmin if tmax is None else tmax, **kw)


def shard(
    *trace: Batch,
    seqno: int = 5,
    since: int = 0,
    schema: bytes = SCHEMA,
    writers: Mapping[str, WriterState] | None = None,
    leased: Mapping[str, LeasedReaderState] | None = None,
    critical: Mapping[str, CriticalReaderState] | None = None,
    rollups: Mapping[int, str] | None = None,
    **scalars: Any,
) -> ShardState:
    """A state at ``seqno`` whose batches are ``trace`` (its upper is the last one's)."""
    return ShardState(
        shard_id="s",
        seqno=seqno,
        schema=schema,
        since=since,
        upper=trace[-1].upper if trace else 0,
        batches=MappingProxyType({b.key: b for b in trace}),
        writers=MappingProxyType(dict(writers or {})),
        leased_readers=MappingProxyType(dict(leased or {})),
        critical_readers=MappingProxyType(dict(critical or {})),
        rollups=MappingProxyType(dict(rollups or {})),
        **scalars,
    )


def diff(
    before: ShardState,
    scalars: Mapping[str, Any] | None = None,
    **maps: tuple[Mapping[Any, Any], set[Any]],
) -> StateDiff:
    """The diff from ``before`` to its next SeqNo: ``scalars`` set, and per map its
    ``(puts, deleted keys)``."""
    return StateDiff(
        before.shard_id,
        before.seqno,
        before.seqno + 1,
        dict(scalars or {}),
        {name: (dict(puts), frozenset(dels)) for name, (puts, dels) in maps.items()},
    )


def applied(before: ShardState, outcome: Outcome[R]) -> ShardState:
    """The state after ``outcome``'s diff, as every process that reads it from Consensus gets it
    (encoded and decoded), checked against the invariants."""
    assert isinstance(outcome, Apply), outcome
    stored = decode(encode(outcome.diff), where="test")
    after = before.apply(stored)
    assert after == before.apply(outcome.diff)
    after.check_invariants()
    assert after.upper >= before.upper and after.since >= before.since
    return after


# --- create_shard -------------------------------------------------------------------------------


def test_create_shard_takes_the_empty_state_to_seqno_1() -> None:
    created = create_shard("s", SCHEMA, 7, incarnation="i1")
    assert created == StateDiff(
        "",
        0,
        1,
        {"shard_id": "s", "schema": SCHEMA, "created_ms": 7, "incarnation": "i1"},
        {},
    )
    state = EMPTY_STATE.apply(created)
    assert (state.seqno, state.upper, state.since, state.retention_ms) == (1, 0, 0, 0)
    assert state.last_gc_seqno == 0


def test_create_shard_on_a_tombstone_goes_on_from_its_seqno_and_sets_retention() -> None:
    """Created again after a drop: the SeqNos continue from the tombstone's, and GC starts
    there (nothing of this incarnation lies below it)."""
    created = create_shard("s", SCHEMA, 7, incarnation="i2", retention_ms=60_000, after_seqno=9)
    assert created == StateDiff(
        "",
        9,
        10,
        {
            "shard_id": "s",
            "schema": SCHEMA,
            "created_ms": 7,
            "incarnation": "i2",
            "retention_ms": 60_000,
            "last_gc_seqno": 9,
        },
        {},
    )
    state = replace(EMPTY_STATE, seqno=9).apply(created)
    assert (state.seqno, state.incarnation, state.last_gc_seqno) == (10, "i2", 9)


# --- compare_and_append -------------------------------------------------------------------------


def append(state: ShardState, parts: tuple[PartRef, ...], lower: int, upper: int, **kw: Any) -> Any:
    """``compare_and_append`` by writer ``w`` at ``now_ms`` 50 with token 3 unless told."""
    args: dict[str, Any] = {"writer_id": "w", "token": 3, "now_ms": 50, **kw}
    return compare_and_append(state, parts=parts, expected_upper=lower, new_upper=upper, **args)


def test_an_append_at_the_upper_puts_one_batch_moves_the_upper_and_records_the_token() -> None:
    before = shard(Batch(0, 5, 0, (part("a"),)), since=2)
    new = (part("b", 5, 7),)
    outcome = append(before, new, 5, 8)
    batch = Batch(5, 8, 2, new)  # at the shard's since
    assert outcome == Apply(
        diff(
            before,
            {"upper": 8},
            batches=({"5-8": batch}, set()),
            writers=({"w": WriterState(last_token=3, last_heartbeat_ms=50)}, set()),
        ),
        Committed(upper=8, seqno=6),
    )
    assert applied(before, outcome).trace == (before.trace[0], batch)


def test_the_first_append_to_a_new_shard_starts_the_trace_at_zero() -> None:
    before = shard()
    outcome = append(before, (part("a"),), 0, 1)
    assert applied(before, outcome).trace == (Batch(0, 1, 0, (part("a"),)),)


@pytest.mark.parametrize(
    ("token", "expected_upper"),
    [
        (3, 5),  # the same token: this very commit landed before (a retry after a lost reply)
        (2, 5),  # an older token: a later commit of this writer landed
        (3, 0),  # checked before the upper: the writer learns its commit landed even after
        # other writers moved the upper on
    ],
)
def test_a_token_at_or_below_the_writers_last_is_already_committed(
    token: int, expected_upper: int
) -> None:
    before = shard(Batch(0, 5, 0, (part("a"),)), writers={"w": WriterState(3, 10)})
    outcome = append(before, (part("b", 5),), expected_upper, 9, token=token)
    assert outcome == Refuse(AlreadyCommitted(token=3, upper=5))


def test_tokens_are_per_writer() -> None:
    """Another writer's last token says nothing about this one's."""
    before = shard(Batch(0, 5, 0, (part("a"),)), writers={"other": WriterState(9, 10)})
    outcome = append(before, (part("b", 5),), 5, 6, token=1)
    assert isinstance(outcome, Apply) and outcome.result == Committed(6, 6)
    assert applied(before, outcome).writers == {
        "other": WriterState(9, 10),
        "w": WriterState(1, 50),
    }


@pytest.mark.parametrize("expected_upper", [0, 4, 6])
def test_an_append_at_another_upper_is_refused_with_the_current_one(expected_upper: int) -> None:
    before = shard(Batch(0, 5, 0, (part("a"),)), writers={"w": WriterState(2, 10)})
    outcome = append(before, (part("b", 6),), expected_upper, 9)
    assert outcome == Refuse(UpperMismatch(current=5))


def test_an_empty_append_extends_the_empty_batch_before_it() -> None:
    """An idle stream's empty micro-batches move the upper without growing the trace."""
    empty = Batch(5, 8, 1, ())
    before = shard(Batch(0, 5, 0, (part("a"),)), empty, since=1)
    outcome = append(before, (), 8, 12)
    assert outcome == Apply(
        diff(
            before,
            {"upper": 12},
            batches=({"5-12": Batch(5, 12, 1, ())}, {"5-8"}),
            writers=({"w": WriterState(3, 50)}, set()),
        ),
        Committed(12, 6),
    )
    assert len(applied(before, outcome).trace) == 2


@pytest.mark.parametrize(
    ("last", "since", "parts"),
    [
        (Batch(5, 8, 0, (part("b", 5),)), 0, ()),  # the batch before has parts
        (Batch(5, 8, 0, ()), 1, ()),  # since moved after it: the new batch has another since
        (Batch(5, 8, 0, ()), 0, (part("c", 8),)),  # this append has parts
    ],
)
def test_an_append_starts_a_batch_of_its_own_unless_both_are_empty_at_one_since(
    last: Batch, since: int, parts: tuple[PartRef, ...]
) -> None:
    before = shard(Batch(0, 5, 0, (part("a"),)), last, since=since)
    outcome = append(before, parts, 8, 12)
    assert isinstance(outcome, Apply)
    assert outcome.diff.maps["batches"] == ({"8-12": Batch(8, 12, since, parts)}, frozenset())


def test_an_empty_append_to_an_empty_shard_is_a_batch_without_parts() -> None:
    before = shard()
    outcome = append(before, (), 0, 3)
    assert applied(before, outcome).trace == (Batch(0, 3, 0, ()),)


def test_a_replace_retracts_every_part_at_the_first_time_of_the_new_rows() -> None:
    """Negated references at the new rows' first time: a read before it sees the old contents,
    from it on only the new ones."""
    a, b = part("a", 0, 4), part("b", 5, 7)
    before = shard(Batch(0, 5, 0, (a,)), Batch(5, 8, 0, (b,)))
    new = (part("c", 9, 11), part("d", 10))
    outcome = append(before, new, 8, 12, replace=True)
    negated = (replace(a, ts_rewrite=9, negate=True), replace(b, ts_rewrite=9, negate=True))
    assert outcome == Apply(
        diff(
            before,
            {"upper": 12},
            batches=({"8-12": Batch(8, 12, 0, negated + new, retractions=2)}, set()),
            writers=({"w": WriterState(3, 50)}, set()),
        ),
        Committed(12, 6),
    )


def test_a_replace_with_no_rows_retracts_at_its_last_time() -> None:
    a = part("a", 0, 4)
    before = shard(Batch(0, 5, 0, (a,)))
    outcome = append(before, (), 5, 9, replace=True)
    assert isinstance(outcome, Apply)
    assert outcome.diff.put_batches == (
        Batch(5, 9, 0, (replace(a, ts_rewrite=8, negate=True),), retractions=1),
    )


def test_a_replace_retracts_only_what_the_last_replace_left_and_what_came_after() -> None:
    """Everything up to the last replace adds up to that replace's own new parts, so only those
    and the later batches are negated (not every earlier reference again)."""
    a, b, c = part("a", 0), part("b", 5), part("c", 8)
    last_replace = Batch(5, 8, 0, (replace(a, ts_rewrite=5, negate=True), b), retractions=1)
    before = shard(Batch(0, 5, 0, (a,)), last_replace, Batch(8, 10, 0, (c,)))
    outcome = append(before, (part("d", 11),), 10, 12, replace=True)
    assert isinstance(outcome, Apply)
    (batch,) = outcome.diff.put_batches
    assert batch.retractions == 2
    assert batch.parts[:2] == (
        replace(b, ts_rewrite=11, negate=True),
        replace(c, ts_rewrite=11, negate=True),
    )


def test_a_replace_after_compaction_merged_the_last_one_retracts_the_merge_whole() -> None:
    """A merge holds the old retractions as plain negated parts: retracting them flips them back,
    which cancels them like every other part."""
    a, b = part("a", 0), part("b", 5)
    merged = Batch(0, 8, 0, (a, replace(a, ts_rewrite=5, negate=True), b))
    before = shard(merged)
    outcome = append(before, (), 8, 9, replace=True)
    assert isinstance(outcome, Apply)
    (batch,) = outcome.diff.put_batches
    assert batch.parts == (
        replace(a, ts_rewrite=8, negate=True),
        replace(a, ts_rewrite=8, negate=False),
        replace(b, ts_rewrite=8, negate=True),
    )
    assert batch.retractions == 3


def schema_of(*fields: tuple[str, pa.DataType]) -> bytes:
    return encode_schema(pa.schema([pa.field(n, t, nullable=True) for n, t in fields]))


@pytest.mark.parametrize("written", ["none", "the shard's", "a subset"])
def test_an_append_whose_schema_adds_nothing_leaves_the_schema_alone(written: str) -> None:
    current = schema_of(("id", pa.int64()), ("name", pa.string()))
    before = shard(schema=current)
    schema = {"none": None, "the shard's": current, "a subset": schema_of(("id", pa.int64()))}
    outcome = append(before, (part("a"),), 0, 1, schema=schema[written])
    assert isinstance(outcome, Apply) and "schema" not in outcome.diff.scalars


def test_a_merge_schema_append_adds_its_columns_to_the_schema_in_the_same_diff() -> None:
    """Merged with *this* state's schema: a column a racing writer added stays."""
    before = shard(schema=schema_of(("id", pa.int64()), ("raced", pa.string())))
    written = schema_of(("id", pa.int64()), ("new", pa.float64()))
    outcome = append(before, (part("a"),), 0, 1, schema=written)
    evolved = schema_of(("id", pa.int64()), ("raced", pa.string()), ("new", pa.float64()))
    assert isinstance(outcome, Apply)
    assert outcome.diff.scalars == {"schema": evolved, "upper": 1}
    assert decode_schema(applied(before, outcome).schema).names == ["id", "raced", "new"]


def test_a_merge_schema_append_that_changes_a_columns_type_is_refused_by_an_error() -> None:
    before = shard()
    with pytest.raises(SchemaMismatch, match="'id' is string in the write but int64"):
        append(before, (part("a"),), 0, 1, schema=schema_of(("id", pa.string())))


# --- rollups, fence, GC claims ------------------------------------------------------------------


def test_add_rollup_records_a_new_rollup_once() -> None:
    before = shard(rollups={2: "s/rollup/2"})
    outcome = add_rollup(before, seqno=5, key="s/rollup/5")
    assert outcome == Apply(diff(before, rollups=({5: "s/rollup/5"}, set())), True)
    assert applied(before, outcome).rollups == {2: "s/rollup/2", 5: "s/rollup/5"}
    assert add_rollup(before, seqno=2, key="s/rollup/2") == Refuse(False)


def test_remove_rollups_forgets_the_recorded_ones_among_those_named() -> None:
    before = shard(rollups={2: "k2", 3: "k3", 5: "k5"})
    outcome = remove_rollups(before, seqnos=(3, 4, 2))
    assert outcome == Apply(diff(before, rollups=({}, {2, 3})), (3, 2))
    assert applied(before, outcome).rollups == {5: "k5"}
    assert remove_rollups(before, seqnos=(1, 4)) == Refuse(())
    assert remove_rollups(before, seqnos=()) == Refuse(())


def test_fence_takes_the_next_seqno_and_changes_nothing_else() -> None:
    before = shard(Batch(0, 5, 0, (part("a"),)), seqno=8)
    outcome = fence(before)
    assert outcome == Apply(diff(before), 9)
    assert applied(before, outcome) == replace(before, seqno=9)


@pytest.mark.parametrize(("last_gc", "claimed"), [(0, True), (39, True), (40, False), (41, False)])
def test_claim_gc_claims_only_a_seqno_since_past_the_last_claim(
    last_gc: int, claimed: bool
) -> None:
    before = shard(seqno=50, last_gc_seqno=last_gc)
    outcome = claim_gc(before, seqno_since=40)
    if claimed:
        assert outcome == Apply(diff(before, {"last_gc_seqno": 40}), True)
    else:
        assert outcome == Refuse(False)


# --- leased readers and since -------------------------------------------------------------------


def reader(since: int, seqno: int, hb: int = 100, lease: int = 50) -> LeasedReaderState:
    return LeasedReaderState(
        since=since, seqno=seqno, last_heartbeat_ms=hb, lease_duration_ms=lease
    )


def test_a_new_leased_reader_holds_the_current_since_and_seqno() -> None:
    before = shard(Batch(0, 5, 0, (part("a"),)), seqno=7, since=3)
    outcome = register_leased_reader(before, reader_id="r", now_ms=100, lease_ms=50)
    held = reader(3, 7)
    assert outcome == Apply(diff(before, leased_readers=({"r": held}, set())), held)
    assert applied(before, outcome).since == 3


def test_registering_a_known_reader_returns_its_holds_unchanged() -> None:
    before = shard(seqno=7, since=3, leased={"r": reader(1, 4)})
    assert register_leased_reader(before, reader_id="r", now_ms=900, lease_ms=9) == Refuse(
        reader(1, 4)
    )


def test_a_heartbeat_of_an_expired_reader_is_refused_with_none() -> None:
    assert heartbeat_leased_reader(shard(), reader_id="r", now_ms=1, seqno=None) == Refuse(None)


@pytest.mark.parametrize(
    ("held", "leased", "now", "want_seqno", "want_hb"),
    [
        (4, None, 120, 9, 120),  # no lease left: the hold moves to the current SeqNo
        (4, 6, 120, 6, 120),  # the oldest SeqNo it still leases
        (4, 2, 120, 4, 120),  # never back: a reader leases only at or after its hold
        (4, 12, 120, 9, 120),  # never past the state it is given
        (4, None, 80, 9, 100),  # a heartbeat from a clock behind does not shorten the lease
    ],
)
def test_a_heartbeat_extends_the_lease_and_advances_the_seqno_hold(
    held: int, leased: int | None, now: int, want_seqno: int, want_hb: int
) -> None:
    before = shard(seqno=9, leased={"r": reader(0, held)})
    outcome = heartbeat_leased_reader(before, reader_id="r", now_ms=now, seqno=leased)
    updated = reader(0, want_seqno, hb=want_hb)
    assert outcome == Apply(diff(before, leased_readers=({"r": updated}, set())), updated)


@pytest.mark.parametrize(
    ("new_since", "want_reader", "want_shard"),
    [
        (None, 2, 2),  # no downgrade asked: the holds stay
        (1, 2, 2),  # a since before the reader's: never back
        (4, 4, 3),  # the shard's since is the meet of the holds: the critical reader's 3
        (9, 9, 3),
    ],
)
def test_a_heartbeat_downgrades_the_readers_since_and_the_shards_is_the_meet_of_the_holds(
    new_since: int | None, want_reader: int, want_shard: int
) -> None:
    before = shard(
        Batch(0, 10, 0, (part("a"),)),
        seqno=9,
        since=2,
        leased={"r": reader(2, 9)},
        critical={"c": CriticalReaderState(since=3, opaque=1)},
    )
    outcome = heartbeat_leased_reader(
        before, reader_id="r", now_ms=100, seqno=9, new_since=new_since
    )
    after = applied(before, outcome)
    assert after.leased_readers["r"].since == want_reader
    assert after.since == want_shard
    assert isinstance(outcome, Apply)
    assert ("since" in outcome.diff.scalars) == (want_shard != 2)


def test_the_shards_since_never_goes_back_below_where_it_is() -> None:
    """Retention may have moved since past a hold; a reader's heartbeat does not pull it back."""
    before = shard(Batch(0, 10, 0, (part("a"),)), seqno=9, since=6, leased={"r": reader(2, 9)})
    outcome = heartbeat_leased_reader(before, reader_id="r", now_ms=100, seqno=9, new_since=4)
    assert applied(before, outcome).since == 6


def test_expiring_named_readers_drops_their_holds_and_since_moves_to_the_next() -> None:
    before = shard(
        Batch(0, 10, 0, (part("a"),)),
        since=1,
        leased={"slow": reader(1, 2), "fast": reader(7, 5), "mid": reader(4, 3)},
    )
    outcome = expire_leased_readers(before, reader_ids=("slow", "gone"))
    assert outcome == Apply(
        diff(before, {"since": 4}, leased_readers=({}, {"slow"})),
        ("slow",),
    )
    assert applied(before, outcome).seqno_since == 3


@pytest.mark.parametrize(("now", "expired"), [(150, ()), (151, ("a",)), (300, ("a", "b"))])
def test_readers_whose_lease_ran_out_expire_strictly_after_it(
    now: int, expired: tuple[str, ...]
) -> None:
    before = shard(leased={"a": reader(0, 1, hb=100, lease=50), "b": reader(0, 1, hb=200)})
    outcome = expire_leased_readers(before, now_ms=now)
    if not expired:
        assert outcome == Refuse(())
    else:
        assert outcome == Apply(diff(before, leased_readers=({}, set(expired))), expired)


def test_when_the_last_hold_goes_since_stays_where_it_is() -> None:
    before = shard(Batch(0, 10, 0, (part("a"),)), since=4, leased={"r": reader(4, 2)})
    outcome = expire_leased_readers(before, reader_ids=("r",))
    assert outcome == Apply(diff(before, leased_readers=({}, {"r"})), ("r",))


def test_expiring_nobody_is_refused() -> None:
    assert expire_leased_readers(shard(), reader_ids=("x",), now_ms=10**9) == Refuse(())


# --- critical readers: since holds fenced by an opaque token ------------------------------------


def test_a_new_critical_reader_holds_the_current_since() -> None:
    before = shard(since=3)
    outcome = register_critical_reader(before, reader_id="c", opaque=7)
    held = CriticalReaderState(since=3, opaque=7)
    assert outcome == Apply(diff(before, critical_readers=({"c": held}, set())), held)


def test_registering_a_known_critical_reader_keeps_its_hold_and_token() -> None:
    known = CriticalReaderState(since=2, opaque=7)
    before = shard(critical={"c": known})
    assert register_critical_reader(before, reader_id="c", opaque=99) == Refuse(known)


def downgrade(state: ShardState, expected: int, new: int, since: int) -> Any:
    return compare_and_downgrade_since(
        state, reader_id="c", expected_opaque=expected, new_opaque=new, new_since=since
    )


def test_the_holder_of_the_token_moves_the_hold_and_takes_the_next_token() -> None:
    before = shard(
        Batch(0, 10, 0, (part("a"),)),
        since=2,
        critical={"c": CriticalReaderState(2, 1)},
        leased={"r": reader(5, 1)},
    )
    outcome = downgrade(before, 1, 2, 8)
    moved = CriticalReaderState(since=8, opaque=2)
    assert outcome == Apply(
        diff(before, {"since": 5}, critical_readers=({"c": moved}, set())),
        CriticalSince(ok=True, current=moved),
    )


def test_a_stale_token_is_fenced_out_and_told_the_current_hold() -> None:
    """The opaque token is the fencing epoch: a holder that lost it (a restarted consumer's old
    incarnation, or a retry after its own reply was lost) changes nothing."""
    current = CriticalReaderState(since=4, opaque=2)
    before = shard(Batch(0, 10, 0, (part("a"),)), critical={"c": current})
    assert downgrade(before, 1, 3, 9) == Refuse(CriticalSince(ok=False, current=current))


def test_a_critical_hold_never_goes_back() -> None:
    before = shard(
        Batch(0, 10, 0, (part("a"),)), since=4, critical={"c": CriticalReaderState(4, 1)}
    )
    outcome = downgrade(before, 1, 2, 3)
    kept = CriticalReaderState(since=4, opaque=2)
    assert outcome == Apply(
        diff(before, critical_readers=({"c": kept}, set())), CriticalSince(True, kept)
    )


def test_a_downgrade_that_changes_nothing_writes_nothing() -> None:
    """The same token and a since at or before the hold: ``ok``, and no Consensus write (a
    named consumer committing the position it already has costs no SeqNo)."""
    held = CriticalReaderState(since=4, opaque=1)
    before = shard(Batch(0, 10, 0, (part("a"),)), since=4, critical={"c": held})
    assert downgrade(before, 1, 1, 4) == Refuse(CriticalSince(ok=True, current=held))
    assert downgrade(before, 1, 1, 2) == Refuse(CriticalSince(ok=True, current=held))


def test_a_downgrade_of_an_unknown_critical_reader_registers_it() -> None:
    """Its expected token is taken as the one it holds, at the shard's since."""
    before = shard(Batch(0, 10, 0, (part("a"),)), since=3)
    outcome = downgrade(before, 5, 6, 7)
    held = CriticalReaderState(since=7, opaque=6)
    assert outcome == Apply(
        diff(before, {"since": 7}, critical_readers=({"c": held}, set())),
        CriticalSince(True, held),
    )
    unchanged = CriticalReaderState(since=3, opaque=5)
    outcome = downgrade(before, 5, 5, 0)
    assert outcome == Apply(
        diff(before, critical_readers=({"c": unchanged}, set())), CriticalSince(True, unchanged)
    )


# --- compaction's swap --------------------------------------------------------------------------


def test_a_merge_replaces_its_batches_while_they_are_still_as_read() -> None:
    b1, b2, b3 = (Batch(i * 3, i * 3 + 3, 0, (part(f"p{i}", i * 3),)) for i in range(3))
    before = shard(b1, b2, b3)
    merged = Batch(0, 6, 2, (part("m", 2, 5),))
    outcome = apply_merge(before, replaced=(b1, b2), merged=merged)
    assert outcome == Apply(diff(before, batches=({"0-6": merged}, {"0-3", "3-6"})), True)
    assert applied(before, outcome).trace == (merged, b3)


def test_a_merge_of_one_batch_puts_the_rewrite_over_it() -> None:
    b1, b2 = Batch(0, 3, 0, (part("a"),)), Batch(3, 5, 0, (part("b", 3),))
    before = shard(b1, b2)
    rewritten = Batch(0, 3, 2, (part("a2", 2),))
    outcome = apply_merge(before, replaced=(b1,), merged=rewritten)
    assert outcome == Apply(diff(before, batches=({"0-3": rewritten}, set())), True)


@pytest.mark.parametrize(
    "changed",
    [
        "another merge took one",  # a batch is gone
        "a write extended one",  # an empty batch extended by an empty append: same lower
        "its since moved",  # a different batch under the same key
    ],
)
def test_a_merge_is_refused_when_any_of_its_batches_changed(changed: str) -> None:
    b1, b2 = Batch(0, 3, 0, (part("a"),)), Batch(3, 5, 0, ())
    now = {
        "another merge took one": (Batch(0, 5, 0, (part("a"),)),),
        "a write extended one": (b1, Batch(3, 9, 0, ())),
        "its since moved": (b1, Batch(3, 5, 1, ())),
    }[changed]
    before = shard(*now)
    assert apply_merge(before, replaced=(b1, b2), merged=Batch(0, 5, 0, (part("m"),))) == Refuse(
        False
    )


def test_a_merge_already_in_state_is_reported_landed() -> None:
    """A retry after a lost reply finds its own merge, so the compactor keeps its parts."""
    b1, b2 = Batch(0, 3, 0, (part("a"),)), Batch(3, 5, 0, (part("b", 3),))
    merged = Batch(0, 5, 0, (part("m", 0, 3),))
    assert apply_merge(shard(merged), replaced=(b1, b2), merged=merged) == Refuse(True)


# --- writers ------------------------------------------------------------------------------------


def test_writers_idle_past_the_expiry_are_forgotten_with_their_tokens() -> None:
    before = shard(
        writers={
            "old": WriterState(4, 100),
            "edge": WriterState(2, 150),
            "new": WriterState(1, 900),
        }
    )
    outcome = expire_writers(before, now_ms=1000, idle_ms=850)
    assert outcome == Apply(diff(before, writers=({}, {"old"})), ("old",))
    outcome = expire_writers(before, now_ms=1001, idle_ms=850)
    assert outcome == Apply(diff(before, writers=({}, {"edge", "old"})), ("edge", "old"))
    assert expire_writers(before, now_ms=1000, idle_ms=10_000) == Refuse(())
