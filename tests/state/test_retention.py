"""Per-shard retention: since follows the clock, storage stays bounded, readers' holds win.

The pure tests are tables over :mod:`pyspark_persist.state.retention` (no
I/O). The run test writes an upsert workload on the mem backend with a fake
clock, runs the maintenance entry points (GC applies retention, compaction
consolidates), and measures the parts in Blob against a same-run peer shard
without retention; a reader registered mid-run and then paused reads every
update it registered for, each at its own time.
"""

from __future__ import annotations

import time
import uuid
from types import MappingProxyType

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.commands import Apply, Refuse, create_shard
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.diff import decode, encode, full_diff
from pyspark_persist.state.errors import InvalidUsage
from pyspark_persist.state.retention import (
    advance_since,
    expired_run,
    format_retention,
    parse_retention,
    retention_since,
    set_retention,
)
from pyspark_persist.state.state import (
    EMPTY_STATE,
    Batch,
    CriticalReaderState,
    LeasedReaderState,
    PartRef,
    ShardState,
)

H = 3_600_000
D = 24 * H


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("7d", 7 * D),
        ("12h", 12 * H),
        ("30m", 30 * 60_000),
        ("45s", 45_000),
        ("500ms", 500),
        ("2w", 14 * D),
        ("86400000", D),
        (" 3 D ", 3 * D),
        ("0", 0),
        ("off", 0),
        (D, D),
    ],
)
def test_parse_retention_accepts_durations_and_milliseconds(text: str | int, ms: int) -> None:
    assert parse_retention(text) == ms


@pytest.mark.parametrize("bad", ["7 days", "-1d", "1.5h", "", "d", -5, True])
def test_parse_retention_refuses_with_the_accepted_forms(bad: str | int) -> None:
    with pytest.raises(InvalidUsage, match="retention"):
        parse_retention(bad)


@pytest.mark.parametrize(
    ("ms", "text"),
    [
        (0, "none"),
        (7 * D, "7d"),
        (14 * D, "14d"),
        (3 * D, "3d"),
        (90 * 60_000, "90m"),
        (1500, "1500ms"),
    ],
)
def test_format_retention_is_the_shortest_exact_form(ms: int, text: str) -> None:
    assert format_retention(ms) == text
    assert parse_retention(text) == ms


def _state(
    *,
    retention: int,
    since: int,
    upper: int,
    leased: tuple[int, ...] = (),
    critical: tuple[int, ...] = (),
) -> ShardState:
    return ShardState(
        shard_id="s",
        seqno=5,
        schema=b"",
        since=since,
        upper=upper,
        retention_ms=retention,
        leased_readers=MappingProxyType(
            {f"r{i}": LeasedReaderState(s, 1, 0, 60_000) for i, s in enumerate(leased)}
        ),
        critical_readers=MappingProxyType(
            {f"c{i}": CriticalReaderState(s, 0) for i, s in enumerate(critical)}
        ),
    )


@pytest.mark.parametrize(
    ("retention", "since", "upper", "now", "leased", "critical", "expected"),
    [
        (0, 10, 1000, 10_000, (), (), 10),  # no retention: only readers move since
        (100, 10, 10_000, 1000, (), (), 900),  # now - retention
        (100, 950, 10_000, 1000, (), (), 950),  # never back
        (100, 10, 500, 1000, (), (), 499),  # never past upper - 1: latest time stays readable
        (100, 0, 0, 1000, (), (), 0),  # nothing written: nothing to pass
        (100, 10, 10_000, 1000, (300,), (), 300),  # a lagging leased reader holds it
        (100, 10, 10_000, 1000, (950,), (), 900),  # a reader ahead does not pull it past retention
        (100, 10, 10_000, 1000, (950,), (200,), 200),  # the lowest hold wins, critical too
        (100, 400, 10_000, 1000, (300,), (), 400),  # a hold below since (read earlier) is moot
    ],
)
def test_retention_since_is_clock_minus_retention_held_by_every_reader(
    retention: int,
    since: int,
    upper: int,
    now: int,
    leased: tuple[int, ...],
    critical: tuple[int, ...],
    expected: int,
) -> None:
    state = _state(retention=retention, since=since, upper=upper, leased=leased, critical=critical)
    assert retention_since(state, now) == expected
    outcome = advance_since(state, now_ms=now)
    if expected == since:
        assert outcome == Refuse(since)
    else:
        assert isinstance(outcome, Apply) and outcome.result == expected
        after = state.apply(outcome.diff)
        assert after.since == expected and after.seqno == state.seqno + 1


def _batches(*spec: tuple[int, int, int]) -> MappingProxyType[str, Batch]:
    """Batches tiling the time line from (upper, since, rows) triples; one part each."""
    out, lower = {}, 0
    for upper, since, rows in spec:
        part = PartRef(f"k{upper}", None, rows * 10, rows, lower, upper - 1)
        b = Batch(lower, upper, since, (part,))
        out[b.key] = b
        lower = upper
    return MappingProxyType(out)


@pytest.mark.parametrize(
    ("retention", "since", "spec", "merged"),
    [
        (0, 100, [(10, 0, 5), (20, 0, 5), (30, 0, 5)], 0),  # no retention: tiers alone
        (60, 100, [(10, 0, 5), (200, 0, 5)], 0),  # one batch below since: nothing to fold
        (60, 100, [(10, 9, 5), (20, 0, 5), (200, 0, 5)], 2),  # head and one as big
        (60, 100, [(10, 9, 50), (20, 0, 5), (30, 0, 5), (200, 0, 5)], 0),  # head much bigger
        (60, 100, [(10, 9, 50), (20, 0, 5), (30, 0, 5), (40, 0, 5), (200, 0, 5)], 4),  # fan_in
        (60, 25, [(10, 9, 5), (20, 0, 5), (30, 0, 5)], 2),  # a batch across since stays out
    ],
)
def test_expired_run_folds_the_leading_batches_since_has_passed(
    retention: int, since: int, spec: list[tuple[int, int, int]], merged: int
) -> None:
    state = ShardState(
        shard_id="s",
        seqno=3,
        schema=b"",
        since=since,
        upper=spec[-1][0],
        retention_ms=retention,
        batches=_batches(*spec),
    )
    state.check_invariants()
    run = expired_run(state, fan_in=4)
    assert (0 if run is None else len(run)) == merged
    if run is not None:
        assert run == state.trace[:merged] and all(b.upper - 1 <= since for b in run)


def _keyed(since: int, *spec: tuple[int, int, int, int | None]) -> ShardState:
    """A keyed shard (no retention) from (upper, since, rows, smallest diff) batches, one part
    each of 10 bytes a row; a smallest diff of None: unknown."""
    out, lower = {}, 0
    for upper, b_since, rows, dmin in spec:
        part = PartRef(f"k{upper}", None, rows * 10, rows, lower, upper - 1, dmin=dmin, dmax=1)
        b = Batch(lower, upper, b_since, (part,))
        out[b.key] = b
        lower = upper
    state = ShardState(
        shard_id="s",
        seqno=3,
        schema=b"",
        since=since,
        upper=lower,
        keys=("id",),
        batches=MappingProxyType(out),
    )
    state.check_invariants()
    return state


# A keyed shard after upserts: the head (what earlier folds left, inserts only) and the pairs of
# retraction and insert of a few upserts after it; since held at upper - 1 (retention stops it
# there), so the last batch's times are all at or below since.
HEAD = (10, 9, 1000, 1)
PAIRS = ((20, 0, 40, -1), (30, 0, 40, -1))


@pytest.mark.parametrize(
    ("state", "settle", "memory", "merged"),
    [
        # In the background the pairs wait until they hold as many rows as the head ...
        (_keyed(29, HEAD, *PAIRS), False, None, 0),
        (_keyed(29, HEAD, (20, 0, 600, -1), (30, 0, 400, -1)), False, None, 3),
        # ... a compaction someone asked for folds them at once, the last batch too (its
        # times, below upper 30, are all at or below since 29) ...
        (_keyed(29, HEAD, *PAIRS), True, None, 3),
        # ... but not a batch with times past since, nor appends with nothing to cancel,
        (_keyed(28, HEAD, *PAIRS), True, None, 2),
        (_keyed(29, HEAD, (20, 0, 40, 1), (30, 0, 40, 1)), True, None, 0),
        # nor more than one rewrite may hold (compaction would concatenate: nothing folds).
        (_keyed(29, HEAD, *PAIRS), True, 10_500, 2),
        (_keyed(29, HEAD, *PAIRS), True, 9_000, 0),
        # A lone batch still holding retractions at times since passed is rewritten once,
        (_keyed(29, (30, 0, 80, -1)), False, None, 1),
        (_keyed(29, (30, 29, 80, -1)), False, None, 0),  # (already rewritten at since)
        (_keyed(29, (30, 0, 80, None)), True, 500, 0),  # unless it is too big to rewrite.
    ],
)
def test_expired_run_of_a_keyed_shard_folds_upserts_at_once_when_asked(
    state: ShardState, settle: bool, memory: int | None, merged: int
) -> None:
    """Shard.compact() (settle) leaves an idle keyed shard one batch, as if written once."""
    run = expired_run(state, fan_in=8, settle=settle, memory_bytes=memory)
    assert (0 if run is None else len(run)) == merged
    if run is not None:
        assert run == state.trace[:merged]


def test_set_retention_is_a_state_change_that_survives_encoding_and_rollups() -> None:
    created = EMPTY_STATE.apply(
        decode(encode(create_shard("s", b"x", 1, incarnation="i", retention_ms=7 * D)), where="t")
    )
    assert created.retention_ms == 7 * D
    assert set_retention(created, retention_ms=7 * D) == Refuse(7 * D)
    outcome = set_retention(created, retention_ms=12 * H)
    assert isinstance(outcome, Apply) and outcome.result == 12 * H
    altered = created.apply(decode(encode(outcome.diff), where="t"))
    assert altered.retention_ms == 12 * H
    assert EMPTY_STATE.apply(decode(encode(full_diff(altered)), where="t")) == altered
    with pytest.raises(InvalidUsage):
        set_retention(created, retention_ms=-1)
    # A shard created without retention (and every state written before it existed) has none.
    assert EMPTY_STATE.apply(create_shard("s", b"x", 1, incarnation="i")).retention_ms == 0


# --- a long run on the mem backend with a fake clock ---------------------------------------------

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.int64())])
KEYS = 32


def _value(step: int, key: int) -> int:
    """Key ``key``'s value after write ``step``: scrambled, so Parquet cannot compress history
    away and stored bytes follow the rows kept."""
    return (step * 0x9E3779B97F4A7C15 + key * 0xBF58476D1CE4E5B9) % (1 << 62)


MINUTE = 60_000
T0 = time.time_ns() // 1_000_000
"""The fake clock starts at the real one: the mem Blob stamps parts with the real clock."""


def _updates(step: int, t: int) -> pa.Table:
    """Write ``step`` of the upsert workload: every key's value changes."""
    ids, vs, diffs = [], [], []
    for k in range(KEYS):
        if step > 0:
            ids.append(k)
            vs.append(_value(step - 1, k))
            diffs.append(-1)
        ids.append(k)
        vs.append(_value(step, k))
        diffs.append(1)
    n = len(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "v": pa.array(vs, pa.int64()),
            "_time": pa.array([t] * n, pa.uint64()),
            "_diff": pa.array(diffs, pa.int64()),
        }
    )


def _stored(client: PersistClient, shard: str) -> tuple[int, int]:
    """Parts in Blob for ``shard``: how many, and their bytes."""
    metas = list(client.blob.list_keys(f"{shard}/part/"))
    return len(metas), sum(m.size_bytes for m in metas)


def test_retention_bounds_storage_while_a_paused_reader_keeps_what_it_registered_for() -> None:
    tag = uuid.uuid4().hex
    clock = [T0]
    config = PersistConfig(
        maintenance=False,
        inline_write_max_bytes=1,  # every write is a part in Blob: storage is what Blob holds
        reader_lease_s=7 * 24 * 3600,
        staged_part_grace_s=30 * 24 * 3600,  # the fake clock runs hours ahead of the store's
    )
    client = PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=config,
        clock_ms=lambda: clock[0],
    )
    kept = client.open_shard("kept", SCHEMA, retention_ms="10m")
    peer = client.open_shard("peer", SCHEMA)  # the same writes, no retention
    shards = (kept, peer)
    writers = {s.name: s.writer() for s in shards}
    sizes: dict[str, list[tuple[int, int]]] = {s.name: [] for s in shards}
    times: list[int] = []

    def write(step: int) -> None:
        clock[0] += MINUTE
        t = clock[0]
        times.append(t)
        for s in shards:
            upper = s.upper
            writers[s.name].compare_and_append(_updates(step, t), upper, t + 1)
            s.gc()  # applies retention at the fake clock
            s.compact()
            s.gc()  # deletes what compaction replaced
            sizes[s.name].append(_stored(client, s.name))

    for step in range(60):
        write(step)
    bound = max(b for _, b in sizes["kept"][10:60])

    # A reader registers, notes where it starts, and pauses for 90 minutes of writes (nine
    # retention periods) while heartbeating, as a live reader's background thread does.
    reader = kept.reader()
    start = reader.latest_as_of()
    for step in range(60, 150):
        write(step)
        reader.heartbeat()
        assert kept.since <= reader.since  # since never passes the live reader's hold
    paused = sizes["kept"][-1][1]

    # It reads everything it registered for: the shard at its start, then each write after it
    # at that write's own time, none compacted together.
    snap = reader.snapshot_table(start)
    assert sorted(zip(snap["id"].to_pylist(), snap["v"].to_pylist(), strict=True)) == [
        (k, _value(59, k)) for k in range(KEYS)
    ]
    listen = reader.listen(start)
    seen: dict[int, list[tuple[int, int, int]]] = {}
    upper = kept.upper
    while listen.frontier < upper:
        event = listen.next(timeout_s=5)
        assert event is not None
        for row in reader.fetch(event.parts).to_pylist():
            seen.setdefault(row["_time"], []).append((row["id"], row["v"], row["_diff"]))
    listen.close()
    assert sorted(seen) == times[60:]
    for step, t in zip(range(60, 150), times[60:], strict=True):
        expected = sorted((r["id"], r["v"], r["_diff"]) for r in _updates(step, t).to_pylist())
        assert sorted(seen[t]) == expected
    reader.close()

    for step in range(150, 200):
        write(step)
    kept_final = sizes["kept"][-1][1]
    peer_final = sizes["peer"][-1][1]
    print(
        f"\nparts bytes after 200 writes: retention 10m {kept_final} B "
        f"({sizes['kept'][-1][0]} parts), no retention {peer_final} B "
        f"({sizes['peer'][-1][0]} parts); with retention the most over writes 10-60 was "
        f"{bound} B, {paused} B while the reader was paused"
    )
    # Bounded: after the reader leaves, storage is back to what it was before it came (the
    # same sawtooth as compaction rounds go by, whatever the number of writes); the peer
    # grows with every write.
    assert max(b for _, b in sizes["kept"][170:]) <= bound * 1.1
    assert paused > bound  # what the paused reader had not read was kept
    assert peer_final > 3 * kept_final
    final = kept.reader()
    table = final.snapshot_table()
    assert sorted(zip(table["id"].to_pylist(), table["v"].to_pylist(), strict=True)) == [
        (k, _value(199, k)) for k in range(KEYS)
    ]
    assert kept.since == times[-1] - 10 * MINUTE
    final.close()
    client.close()


def test_open_shard_alters_retention_and_refuses_a_bad_one_before_writing() -> None:
    tag = uuid.uuid4().hex
    client = PersistClient(open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"))
    shard = client.open_shard("s", SCHEMA)
    assert shard.retention_ms == 0
    seqno = shard.state().seqno
    with pytest.raises(InvalidUsage, match="7 days"):
        client.open_shard("s", SCHEMA, retention_ms="7 days")
    assert shard.state().seqno == seqno
    assert client.open_shard("s", SCHEMA, retention_ms="7d").retention_ms == 7 * D
    assert client.open_shard("s").retention_ms == 7 * D  # not given: left as it is
    assert shard.set_retention(0) == 0 and shard.retention_ms == 0
    client.close()
