"""Compaction and GC: a shard stays small under endless tiny writes, and no read ever breaks.

What is checked:

- **Churn**: 10,000 one-row writes (keys ``i % 500``, occasional retractions)
  with a reader that keeps downgrading its since. At every 1,000 writes,
  once background maintenance is idle, the live batches and parts, the Blob
  objects and the Consensus rows stay below bounds derived from the design,
  and the snapshot equals a ``Counter`` of the acknowledged writes.
- **Leases**: a reader holding a lease on an old SeqNo reads every part of
  its snapshot after compaction and GC ran many times; once released, GC
  reclaims those parts.
- **Expiry**: a reader that stops heartbeating expires and stops holding
  back since and GC; a critical since handle never expires, and one with a
  stale opaque is fenced.
- **Staged orphans** are swept by ``shard.gc()`` once older than
  ``staged_part_grace_s``, and not before.
- **Consolidation**: retract/insert pairs vanish once since passes them.
- **Lost races**: a compaction whose input changed underneath leaves state
  exact and deletes its output.
- **Races**: compaction and GC in threads and processes alongside writers
  and readers lose or double nothing; every snapshot at every allowed
  ``as_of`` equals the reference.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import multiprocessing
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import (
    ARROW,
    DIFF,
    TIME,
    BatchBuilder,
    Committed,
    PersistClient,
    PersistConfig,
    Shard,
    UpperMismatch,
)
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import LeaseExpired
from pyspark_persist.state.maintenance import compact
from pyspark_persist.state.maintenance_policy import compaction_request
from pyspark_persist.state.state import ShardState

SCHEMA = pa.schema([("k", pa.int64())])
Ref = collections.Counter[int]

# --- helpers ---------------------------------------------------------------------------------


def make_location(pair: str, root: Path) -> tuple[str, str]:
    """``(blob_uri, consensus_uri)`` for ``mem-mem``, ``file-sqlite`` (under ``root``)."""
    if pair == "mem-mem":
        tag = uuid.uuid4().hex
        return f"mem://{tag}", f"mem://{tag}"
    if pair == "file-sqlite":
        root.mkdir(parents=True, exist_ok=True)
        return f"file://{root}/blob", f"sqlite:///{root}/consensus.db"
    raise ValueError(pair)


def updates(keys: list[int], diffs: list[int], t: int) -> pa.Table:
    """One batch of updates of ``k`` at time ``t``."""
    return pa.table(
        {"k": keys, TIME: pa.array([t] * len(keys), pa.uint64()), DIFF: diffs},
        schema=pa.schema([("k", pa.int64()), (TIME, pa.uint64()), (DIFF, pa.int64())]),
    )


def as_counter(table: pa.Table) -> Ref:
    """The multiset a (consolidated or not) table of updates denotes, zeros dropped."""
    out: Ref = collections.Counter()
    for k, d in zip(table.column("k").to_pylist(), table.column(DIFF).to_pylist(), strict=True):
        out[k] += d
    return Ref({k: v for k, v in out.items() if v != 0})


def reference(acks: list[tuple[int, list[int], list[int]]], as_of: int) -> Ref:
    """The multiset of the acknowledged writes ``(time, keys, diffs)`` with time <= ``as_of``."""
    out: Ref = collections.Counter()
    for t, keys, diffs in acks:
        if t <= as_of:
            for k, d in zip(keys, diffs, strict=True):
                out[k] += d
    return Ref({k: v for k, v in out.items() if v != 0})


def part_keys(state: ShardState) -> set[str]:
    """Blob keys of the parts ``state`` references."""
    return {p.key for b in state.batches.values() for p in b.parts if p.key is not None}


def blob_keys(client: PersistClient, shard: str, kind: str = "part") -> set[str]:
    """Blob keys of ``shard`` under ``<shard>/<kind>/``."""
    return {m.key for m in client.blob.list_keys(f"{shard}/{kind}/")}


@pytest.fixture(params=["mem-mem", "file-sqlite"])
def loc(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A fresh location on the two embedded pairs."""
    return make_location(request.param, tmp_path)


def open_client(location: tuple[str, str], config: PersistConfig, **kw: Any) -> PersistClient:
    """A client with its own state cache (so it sees other clients only through Consensus)."""
    return PersistClient(
        open_blob(location[0]),
        open_consensus(location[1]),
        config=config,
        cache=StateCache(),
        **kw,
    )


# --- churn: 10,000 one-row writes ------------------------------------------------------------

CHURN_WRITES = 10_000
CHURN_KEYS = 500
CHECK_EVERY = 1_000
SINCE_LAG = 50
"""The reader downgrades since to ``upper - SINCE_LAG`` every ``DOWNGRADE_EVERY`` writes."""
DOWNGRADE_EVERY = 10
CHURN_CONFIG = PersistConfig()
"""The shipped defaults: fan_in 8, gc_interval 32, rollup_interval 64; bounds derive from them."""

_FAN = CHURN_CONFIG.compaction_fan_in
_TIERS = 5
"""Tiers a batch of at most 10,000 rows can be in: floor(log_8(10_000)) + 1 = 5."""
MAX_BATCHES = 64
"""Tiered compaction leaves at most fan_in - 1 = 7 batches per tier once idle: 7 x 5 = 35,
plus the never-merged empty/progress batch and slack; 64 leaves ~2x headroom."""
MAX_PARTS = MAX_BATCHES
"""A one-row write is one part, and a compaction of <= 10,000 tiny rows (far below
part_target_bytes) writes one part: at most one part per batch."""
MAX_BLOB_OBJECTS = 160
"""Live parts (<= 64) + garbage not yet collected: GC runs once seqno_since moved gc_interval = 32
SeqNos, the reader's SeqNo hold lags at most DOWNGRADE_EVERY writes (~12 SeqNos), each SeqNo
creates at most one part, so <= 32 + 12 + a queued round (~16) garbage parts; + rollups: one at
or below seqno_since and one per rollup_interval = 64 SeqNos above it (<= 3). 64+60+3 < 160."""
MAX_CONSENSUS_ROWS = 200
"""GC truncates below a rollup at most rollup_interval // 2 = 32 SeqNos under seqno_since, and
runs again once seqno_since moved 32 more, with the hold lagging ~12 SeqNos: rows <= 32 + 32 +
12 + a round of in-flight maintenance commits (~16) ~ 92 < 200."""


@dataclass
class Checkpoint:
    """What the shard looked like at one checkpoint of the churn run."""

    writes: int
    batches: int
    parts: int
    blob_objects: int
    consensus_rows: int
    exact: bool
    trace_rows: list[int]


@dataclass
class ChurnRun:
    """The whole churn run: checkpoints, and whether the final snapshot was exact."""

    pair: str
    checkpoints: list[Checkpoint]
    final_exact: bool
    idle: bool


def _checkpoint(
    client: PersistClient, shard: Shard, reader_snapshot: Callable[[], pa.Table], ref: Ref, n: int
) -> Checkpoint:
    state = shard.state()
    return Checkpoint(
        writes=n,
        batches=len(state.batches),
        parts=sum(len(b.parts) for b in state.batches.values()),
        blob_objects=sum(1 for _ in client.blob.list_keys(f"{shard.name}/")),
        consensus_rows=len(client.consensus.scan(shard.name, 0)),
        exact=as_counter(reader_snapshot()) == +ref,
        trace_rows=[b.rows for b in state.trace],
    )


@pytest.fixture(scope="module", params=["mem-mem", "file-sqlite"])
def churn(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ChurnRun:
    """Run the 10,000-write churn once per pair; the tests below judge its checkpoints."""
    location = make_location(request.param, tmp_path_factory.mktemp("churn"))
    client = PersistClient.open(*location, config=CHURN_CONFIG)
    try:
        shard = client.open_shard("churn", SCHEMA)
        writer = shard.writer()
        reader = shard.reader()
        ref: Ref = collections.Counter()
        checkpoints: list[Checkpoint] = []
        idle = True
        for i in range(CHURN_WRITES):
            if i % 13 == 12:  # retract the key written just before (present: count >= 1)
                key, diff = (i - 1) % CHURN_KEYS, -1
            else:
                key, diff = i % CHURN_KEYS, 1
            res = writer.compare_and_append(updates([key], [diff], i), i, i + 1)
            assert isinstance(res, Committed), res
            ref[key] += diff
            if i % DOWNGRADE_EVERY == DOWNGRADE_EVERY - 1:
                reader.downgrade_since(max(0, i + 1 - SINCE_LAG))
            if (i + 1) % CHECK_EVERY == 0:
                idle &= client.maintenance.wait_idle(60)
                checkpoints.append(_checkpoint(client, shard, reader.snapshot_table, ref, i + 1))
        final = as_counter(reader.snapshot_table(CHURN_WRITES - 1)) == +ref
        reader.close()
        return ChurnRun(request.param, checkpoints, final, idle)
    finally:
        client.maintenance.wait_idle(60)
        client.close()


def test_churn_storage_bounded_and_exact(churn: ChurnRun) -> None:
    """Blob objects and Consensus rows stay bounded; every checkpoint and the end are exact."""
    assert churn.idle, "background maintenance did not go idle within 60 s"
    assert len(churn.checkpoints) == CHURN_WRITES // CHECK_EVERY
    for cp in churn.checkpoints:
        assert cp.exact, f"snapshot after {cp.writes} writes differs from the acknowledged writes"
        assert cp.blob_objects <= MAX_BLOB_OBJECTS, cp
        assert cp.consensus_rows <= MAX_CONSENSUS_ROWS, cp
    assert churn.final_exact


def test_churn_live_batches_bounded(churn: ChurnRun) -> None:
    """Live batches and parts stay below fan_in x tiers at every checkpoint."""
    for cp in churn.checkpoints:
        assert cp.batches <= MAX_BATCHES, (cp.writes, cp.batches, cp.trace_rows)
        assert cp.parts <= MAX_PARTS, (cp.writes, cp.parts)


# --- leases ---------------------------------------------------------------------------------

BLOB_CONFIG = dict(
    inline_write_max_bytes=1,  # every part goes to Blob, so GC has objects to delete
    compaction_fan_in=2,
    gc_interval=1,
    rollup_interval=4,
)


def test_lease_on_old_seqno_survives_compaction_and_gc(loc: tuple[str, str]) -> None:
    """An old snapshot stays readable through many compactions and GCs; release frees it."""
    client = open_client(loc, PersistConfig(**BLOB_CONFIG))  # type: ignore[arg-type]
    try:
        shard = client.open_shard("lease", SCHEMA)
        writer = shard.writer()
        acks: list[tuple[int, list[int], list[int]]] = []

        def write(t: int) -> None:
            keys, diffs = [t % 7, 100 + t], [1, 1 if t % 3 else -1]
            assert isinstance(
                writer.compare_and_append(updates(keys, diffs, t), t, t + 1), Committed
            )
            acks.append((t, keys, diffs))

        for t in range(20):
            write(t)
        old = shard.reader()
        snap = old.snapshot(19)
        old.downgrade_since(19)
        old.heartbeat()  # record the hold at exactly the snapshot's SeqNo
        old_keys = {p.part.key for p in snap.parts if p.part.key is not None}
        assert old_keys
        mover = shard.reader()
        t = 20
        for _ in range(25):
            for _ in range(4):
                write(t)
                t += 1
            mover.downgrade_since(t - 1)
            shard.compact()
            shard.gc()
            old.heartbeat()
        client.maintenance.wait_idle(30)
        live = part_keys(shard.state())
        replaced = old_keys - live
        assert replaced, "compaction should have replaced the snapshot's parts"
        assert replaced <= blob_keys(client, "lease"), "GC deleted parts of a leased SeqNo"
        got = as_counter(old.fetch(snap.parts))
        assert got == reference(acks, 19)

        old.release(snap.seqno)
        old.heartbeat()
        shard.gc()
        assert not replaced & blob_keys(client, "lease"), "released parts were not reclaimed"
        assert as_counter(mover.snapshot_table()) == reference(acks, t - 1)
        assert old.since == 19 and shard.since == 19
    finally:
        client.maintenance.wait_idle(30)
        client.close()


# --- expiry and critical readers --------------------------------------------------------------


def test_stale_reader_expires_critical_never(tmp_path: Path) -> None:
    """A reader that stops heartbeating expires; a critical hold never does and is fenced."""
    clock = [1_700_000_000_000]
    cfg = PersistConfig(
        reader_lease_s=5.0,
        heartbeat_interval_s=3600.0,
        maintenance=False,
        # The clock jumps ten years: parts it stages must not look past the grace to commits.
        staged_part_grace_s=1e12,
        **BLOB_CONFIG,  # type: ignore[arg-type]
    )
    client = open_client(make_location("file-sqlite", tmp_path), cfg, clock_ms=lambda: clock[0])
    try:
        shard = client.open_shard("expiry", SCHEMA)
        writer = shard.writer()
        upper = 0

        def write(n: int) -> None:
            nonlocal upper
            for _ in range(n):
                res = writer.compare_and_append(updates([upper], [1], upper), upper, upper + 1)
                assert isinstance(res, Committed)
                upper += 1

        write(4)
        stale = shard.reader()  # holds since 0 and the current SeqNo, then never heartbeats
        live = shard.reader()
        write(8)
        live.downgrade_since(upper - 1)
        shard.compact()
        assert shard.since == 0, "the stale reader still holds since"
        before = part_keys(shard.state())
        report = shard.gc()
        assert report.readers_expired == ()
        garbage = blob_keys(client, "expiry") - before
        assert garbage, "compaction should have left replaced parts for GC"
        assert report.seqno_since <= shard.state().leased_readers[stale.reader_id].seqno

        clock[0] += 5_001  # the stale reader's lease runs out; the live one heartbeats
        live.heartbeat()
        report = shard.gc()
        assert report.readers_expired == (stale.reader_id,)
        assert shard.since == upper - 1, "since should jump to the live reader's hold"
        assert not garbage & blob_keys(client, "expiry"), "GC should reclaim what it held back"
        with pytest.raises(LeaseExpired):
            stale.heartbeat()
        with pytest.raises(LeaseExpired):
            stale.snapshot()

        # A critical hold never expires, however long it goes untouched.
        crit = shard.critical_reader("controller", opaque=1)
        held = crit.since
        assert held == shard.since
        clock[0] += 10 * 365 * 86_400_000
        live.heartbeat()
        write(6)
        live.downgrade_since(upper - 1)
        assert shard.gc().readers_expired == ()
        assert shard.since == held and "controller" in shard.state().critical_readers

        # The holder of the newest opaque moves it; a handle with an old opaque is fenced.
        ok = crit.compare_and_downgrade_since(1, 2, upper - 1)
        assert ok.ok and shard.since == upper - 1
        other = shard.critical_reader("controller", opaque=99)
        assert other.opaque == 2, "registering an existing hold must return it, not reset it"
        write(3)
        fenced = other.compare_and_downgrade_since(1, 3, upper - 1)
        assert not fenced.ok and fenced.current.opaque == 2 and fenced.current.since == upper - 4
        assert shard.since == upper - 4
        assert shard.state().critical_readers["controller"].opaque == 2
    finally:
        client.close()


# --- staged orphans -----------------------------------------------------------------------------

GRACE_S = 1.0
RETRY_S = GRACE_S / 4
"""A commit retries for less than half the grace (PersistConfig refuses more)."""


def test_gc_sweeps_staged_parts_after_grace(loc: tuple[str, str]) -> None:
    """Parts staged but never committed survive GC within the grace period, then go."""
    cfg = PersistConfig(
        staged_part_grace_s=GRACE_S,
        retry_timeout_s=RETRY_S,
        inline_write_max_bytes=1,
        maintenance=False,
    )
    client = open_client(loc, cfg)
    try:
        shard = client.open_shard("orphans", SCHEMA)
        writer = shard.writer()
        writer.compare_and_append(updates([1, 2], [1, 1], 0), 0, 1)
        committed = part_keys(shard.state())
        builder = writer.builder()
        builder.add(updates([7, 8, 9], [1, 1, 1], 5))
        staged = {p.key for p in builder.finish().parts if p.key is not None}
        assert staged and not staged & committed
        shard.gc()
        assert staged <= blob_keys(client, "orphans"), "swept a staged part inside its grace"
        time.sleep(GRACE_S + 0.2)
        report = shard.gc()
        keys = blob_keys(client, "orphans")
        assert not staged & keys, "staged part older than the grace survived the sweep"
        assert committed <= keys, "the sweep deleted a committed part"
        assert report.orphans_deleted >= len(staged)
        assert as_counter(shard.reader().snapshot_table()) == {1: 1, 2: 1}
    finally:
        client.close()


def test_gc_sweeps_a_crashed_writers_half_streamed_part(tmp_path: Path) -> None:
    """A part whose writer died while streaming it (no commit, no abort) leaves no key; the
    orphan sweep deletes what it left in Blob once the grace period has passed."""
    cfg = PersistConfig(
        staged_part_grace_s=GRACE_S,
        retry_timeout_s=RETRY_S,
        inline_write_max_bytes=1,
        maintenance=False,
    )
    client = open_client(make_location("file-sqlite", tmp_path), cfg)
    try:
        shard = client.open_shard("crashed", SCHEMA)
        shard.writer().compare_and_append(updates([1, 2], [1, 1], 0), 0, 1)
        part_dir = tmp_path / "blob" / "crashed" / "part"
        before = set(part_dir.iterdir())
        crashed = BatchBuilder(client.blob, "crashed", SCHEMA, cfg, part_format=ARROW)
        crashed.add(updates(list(range(100_000)), [1] * 100_000, 5))  # streams, never finishes
        left = set(part_dir.iterdir()) - before
        assert left and all(p.name.startswith(".tmp~") for p in left)
        shard.gc()
        assert left <= set(part_dir.iterdir()), "swept a stream inside its grace"
        time.sleep(GRACE_S + 0.2)
        report = shard.gc()
        assert not left & set(part_dir.iterdir())
        assert report.orphans_deleted >= len(left)
        assert as_counter(shard.reader().snapshot_table()) == {1: 1, 2: 1}
    finally:
        client.close()


# --- consolidation ------------------------------------------------------------------------------


@pytest.mark.parametrize("since_passes", [True, False], ids=["since-passed", "since-held"])
def test_compaction_consolidates_once_since_passes(
    loc: tuple[str, str], since_passes: bool
) -> None:
    """Retract/insert pairs vanish from compacted parts iff since has passed them."""
    client = open_client(loc, PersistConfig(compaction_fan_in=2, maintenance=False))
    try:
        shard = client.open_shard("consolidate", SCHEMA)
        writer = shard.writer()
        reader = shard.reader()
        script = [(10, 1), (10, -1), (20, 1), (20, -1), (30, 1)]
        acks = []
        for t, (k, d) in enumerate(script):
            assert isinstance(writer.compare_and_append(updates([k], [d], t), t, t + 1), Committed)
            acks.append((t, [k], [d]))
        if since_passes:
            reader.downgrade_since(4)
        reports = shard.compact()
        assert reports and reports[-1].applied
        state = shard.state()
        assert len(state.batches) == 1
        assert state.trace[0].rows == (1 if since_passes else 5)
        for as_of in range(state.since, state.upper):
            assert as_counter(reader.snapshot_table(as_of)) == reference(acks, as_of)
    finally:
        client.close()


def test_a_readers_commits_leave_compaction_to_the_writer(loc: tuple[str, str]) -> None:
    """A reader's heartbeats and since downgrades never start a compaction in its process:
    only the commit that made a merge due asks for it (a second compaction of the same
    batches elsewhere would rewrite them for nothing: one loses the compare-and-set)."""
    cfg = PersistConfig(compaction_fan_in=2, inline_write_max_bytes=1)
    writing = open_client(loc, dataclasses.replace(cfg, maintenance=False))
    reading = open_client(loc, cfg)
    try:
        writer = writing.open_shard("holds", SCHEMA).writer()
        for t in range(2):
            writer.compare_and_append(updates([t], [1], t), t, t + 1)
        shard = reading.open_shard("holds", create=False)
        assert compaction_request(shard.state(), cfg) is not None  # a merge is due
        reader = shard.reader()
        reader.heartbeat()
        reader.downgrade_since(1)
        assert reading.maintenance.wait_idle()
        assert len(shard.machine.fetch_latest().trace) == 2  # the reader merged nothing
        # A commit through the reading client (a writer there) does compact.
        shard.writer().compare_and_append(updates([2], [1], 2), 2, 3)
        assert reading.maintenance.wait_idle()
        assert len(shard.machine.fetch_latest().trace) < 3
        reader.close()
    finally:
        reading.close()
        writing.close()


def test_background_compaction_waits_maintenance_delay_s_after_the_commit(tmp_path: Path) -> None:
    """The compaction a commit asks for starts ``maintenance_delay_s`` later, not while the
    work right after the commit (a Spark micro-batch's next phases) runs; commits meanwhile
    fold into the one request, and ``wait_idle`` still waits for it."""
    delay_s = 1.0
    cfg = PersistConfig(compaction_fan_in=2, inline_write_max_bytes=1, maintenance_delay_s=delay_s)
    client = open_client(make_location("mem-mem", tmp_path), cfg)
    try:
        shard = client.open_shard("delayed", SCHEMA)
        writer = shard.writer()
        started = time.monotonic()
        for t in range(3):
            writer.compare_and_append(updates([t], [1], t), t, t + 1)
        assert compaction_request(shard.state(), cfg) is not None  # a merge is due
        if time.monotonic() - started < delay_s / 2:  # else the machine was too busy to tell
            assert len(shard.state().trace) == 3, "compaction started before the delay"
        assert client.maintenance.wait_idle(30)
        assert time.monotonic() - started >= delay_s
        assert len(shard.state().trace) < 3
        assert sorted(shard.reader().snapshot_table().column("k").to_pylist()) == [0, 1, 2]
    finally:
        client.close()


def test_maintenance_delay_zero_means_at_once() -> None:
    """0 is a valid delay (no wait); a negative one is refused naming the knob."""
    assert PersistConfig(maintenance_delay_s=0).maintenance_delay_s == 0
    with pytest.raises(Exception, match="maintenance_delay_s"):
        PersistConfig(maintenance_delay_s=-1)


# --- a compaction that loses its race ---------------------------------------------------------


def test_compaction_losing_race_deletes_output(loc: tuple[str, str]) -> None:
    """A compaction of batches already replaced is refused, deletes its parts, changes nothing."""
    cfg = PersistConfig(compaction_fan_in=2, inline_write_max_bytes=1, maintenance=False)
    client = open_client(loc, cfg)
    try:
        shard = client.open_shard("race", SCHEMA)
        writer = shard.writer()
        acks = []
        for t in range(4):
            writer.compare_and_append(updates([t, 50], [1, 1], t), t, t + 1)
            acks.append((t, [t, 50], [1, 1]))
        stale = compaction_request(shard.state(), cfg)
        assert stale is not None and len(stale) == 4
        # A write lands between the compaction's read and its swap: the swap still applies,
        # since appending never changes the batches being merged.
        writer.compare_and_append(updates([4], [1], 4), 4, 5)
        acks.append((4, [4], [1]))
        ok = compact(shard.machine, stale)
        assert ok.applied and ok.rewritten
        assert as_counter(shard.reader().snapshot_table()) == reference(acks, 4)

        # Now a compaction from a stale read, of batches another compaction already replaced.
        for t in range(5, 8):
            writer.compare_and_append(updates([t], [1], t), t, t + 1)
            acks.append((t, [t], [1]))
        stale = tuple(shard.state().trace[-2:])
        shard.compact()
        state = shard.state()
        assert any(state.batches.get(b.key) != b for b in stale)
        keys_before = blob_keys(client, "race")
        lost = compact(shard.machine, stale)
        assert not lost.applied
        assert blob_keys(client, "race") == keys_before, "the losing compaction left its output"
        after = shard.state()
        assert dict(after.batches) == dict(state.batches)
        after.check_invariants()
        reader = shard.reader()
        for as_of in range(after.since, after.upper):
            assert as_counter(reader.snapshot_table(as_of)) == reference(acks, as_of)
    finally:
        client.close()


def test_inline_total_cap_sends_writes_to_blob() -> None:
    """Inline data in state never exceeds inline_total_max_bytes: the rest goes to Blob."""
    tag = uuid.uuid4().hex
    cfg = PersistConfig(inline_total_max_bytes=1200, maintenance=False)
    client = open_client((f"mem://{tag}", f"mem://{tag}"), cfg)
    shard = client.open_shard("inline", SCHEMA)
    writer = shard.writer()
    for t in range(3):
        writer.compare_and_append(updates([t], [1], t), t, t + 1)
    state = shard.state()
    assert 0 < state.trace[0].inline_bytes <= cfg.inline_total_max_bytes
    assert state.inline_bytes <= cfg.inline_total_max_bytes
    later = [p for b in state.trace[2:] for p in b.parts]
    assert all(p.inline is None for p in later), "writes past the inline cap stayed inline"


# --- races: threads ---------------------------------------------------------------------------

RACE_CONFIG = PersistConfig(
    compaction_fan_in=2, gc_interval=2, rollup_interval=8, inline_write_max_bytes=200
)
"""Aggressive: compaction every other batch, GC every 2 SeqNos, a mix of inline and Blob parts."""


def write_loop(
    shard: Shard, tag: int, writes: int, seed: int
) -> list[tuple[int, list[int], list[int]]]:
    """Append ``writes`` batches at ``[upper, upper + 1)``, retrying lost races; return the acks."""
    rng = random.Random(seed)
    writer = shard.writer()
    upper = writer.fetch_upper()
    acks: list[tuple[int, list[int], list[int]]] = []
    for _ in range(writes):
        n = rng.choice([1, 2, 40])  # 40 rows do not fit inline_write_max_bytes
        keys = [rng.randrange(30) for _ in range(n)]
        diffs = [rng.choice([1, 1, -1]) for _ in range(n)]
        keys.append(1000 + tag)
        diffs.append(1)
        while True:
            res = writer.compare_and_append(updates(keys, diffs, upper), upper, upper + 1)
            if isinstance(res, Committed):
                acks.append((upper, keys, diffs))
                upper = res.upper
                break
            assert isinstance(res, UpperMismatch), res
            upper = res.current
    return acks


def read_loop(
    shard: Shard, stop: threading.Event, seed: int, downgrade: bool
) -> list[tuple[int, Ref]]:
    """Take snapshots at random allowed as_ofs (downgrading since now and then) until stopped."""
    rng = random.Random(seed)
    seen: list[tuple[int, Ref]] = []
    with shard.reader() as reader:
        while not stop.is_set() or not seen:
            state = shard.state()
            if state.upper == 0:
                time.sleep(0.005)
                continue
            lo = max(reader.since, state.since)
            as_of = rng.randint(min(lo, state.upper - 1), state.upper - 1)
            if as_of < reader.since:
                continue
            seen.append((as_of, as_counter(reader.snapshot_table(as_of))))
            if downgrade and rng.random() < 0.5:
                reader.downgrade_since(rng.randint(reader.since, as_of))
    return seen


def maintain_loop(shard: Shard, stop: threading.Event, kind: str) -> int:
    """Run compaction or GC on demand in a loop until stopped; return the rounds run."""
    rounds = 0
    while not stop.is_set():
        if kind == "compact":
            shard.compact()
        else:
            shard.gc()
        rounds += 1
        time.sleep(0.002)
    return rounds


def run_threads(targets: list[Callable[[], Any]], timeout_s: float = 60.0) -> list[Any]:
    """Run callables in threads; re-raise the first error; return their results in order."""
    results: list[Any] = [None] * len(targets)
    errors: list[BaseException] = []

    def wrap(i: int, f: Callable[[], Any]) -> None:
        try:
            results[i] = f()
        except BaseException as e:  # noqa: BLE001 - reported to the test thread below
            errors.append(e)

    threads = [
        threading.Thread(target=wrap, args=(i, f), daemon=True) for i, f in enumerate(targets)
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(th.is_alive() for th in threads), "a racing thread hung"
    return results


def check_race(
    shard: Shard, acks: list[tuple[int, list[int], list[int]]], seen: list[tuple[int, Ref]]
) -> None:
    """No acknowledged write lost or doubled; every recorded snapshot equals the reference."""
    times = [t for t, _, _ in acks]
    assert len(times) == len(set(times)), "two acknowledged writes landed at the same time"
    state = shard.state()
    state.check_invariants()
    assert state.upper == len(acks)
    for as_of, got in seen:
        assert got == reference(acks, as_of), f"snapshot at {as_of} differs from the reference"
    with shard.reader() as reader:
        assert as_counter(reader.snapshot_table(state.upper - 1)) == reference(acks, state.upper)
        for as_of in range(max(state.since, reader.since), state.upper):
            assert as_counter(reader.snapshot_table(as_of)) == reference(acks, as_of)


def test_race_threads(loc: tuple[str, str]) -> None:
    """Writers, readers, compaction and GC in threads, each with its own client and cache."""
    clients = [open_client(loc, RACE_CONFIG) for _ in range(7)]
    try:
        shards = [c.open_shard("race", SCHEMA) for c in clients]
        stop = threading.Event()
        writers = [lambda i=i: write_loop(shards[i], i, 25, seed=i) for i in range(3)]
        others = [
            lambda: read_loop(shards[3], stop, seed=3, downgrade=True),
            lambda: read_loop(shards[4], stop, seed=4, downgrade=False),
            lambda: maintain_loop(shards[5], stop, "compact"),
            lambda: maintain_loop(shards[6], stop, "gc"),
        ]

        def writers_then_stop() -> list[Any]:
            try:
                return run_threads(writers)
            finally:
                stop.set()

        results = run_threads([writers_then_stop, *others])
        acks = [a for w in results[0] for a in w]
        seen = results[1] + results[2]
        for c in clients:
            assert c.maintenance.wait_idle(30)
        assert results[3] > 0 and results[4] > 0
        check_race(shards[0], acks, seen)
        shards[0].gc()
        live = part_keys(shards[0].state())
        assert live <= blob_keys(clients[0], "race"), "GC deleted a live part"
    finally:
        for c in clients:
            c.maintenance.wait_idle(30)
            c.close()


# --- races: processes -------------------------------------------------------------------------

PROC_WRITERS = 3
PROC_WRITES = 15


def _proc_main(blob: str, consensus: str, shard_name: str, tag: int, out: str) -> None:
    """Child: write with retries, compacting and collecting every few writes; dump the acks."""
    client = PersistClient.open(blob, consensus, config=RACE_CONFIG)
    shard = client.open_shard(shard_name, SCHEMA)
    acks = []
    for round_ in range(PROC_WRITES // 5):
        acks += write_loop(shard, tag, 5, seed=tag * 100 + round_)
        shard.compact()
        shard.gc()
    client.maintenance.wait_idle(30)
    client.close()
    Path(out).write_text(json.dumps(acks))


@pytest.fixture(params=["file-sqlite", pytest.param("file-postgres", marks=pytest.mark.postgres)])
def proc_loc(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str, str]]:
    """``(blob, consensus, shard)`` shared by processes: file Blob with SQLite or PostgreSQL."""
    blob = f"file://{tmp_path}/blob"
    if request.param == "file-sqlite":
        yield blob, f"sqlite:///{tmp_path}/consensus.db", "race"
    else:
        yield blob, request.getfixturevalue("postgres_url"), f"s{uuid.uuid4().hex[:16]}"


@pytest.mark.slow
def test_race_processes(proc_loc: tuple[str, str, str], tmp_path: Path) -> None:
    """Writer processes that also compact and GC, racing readers and GC in this process."""
    blob, consensus, name = proc_loc
    client = open_client((blob, consensus), RACE_CONFIG)
    try:
        shard = client.open_shard(name, SCHEMA)
        ctx = multiprocessing.get_context("spawn")
        outs = [tmp_path / f"acks-{i}.json" for i in range(PROC_WRITERS)]
        procs = [
            ctx.Process(target=_proc_main, args=(blob, consensus, name, i, str(outs[i])))
            for i in range(PROC_WRITERS)
        ]
        stop = threading.Event()

        def children() -> None:
            try:
                for p in procs:
                    p.start()
                for p in procs:
                    p.join(90)
            finally:
                stop.set()

        _, seen_a, seen_b, _ = run_threads(
            [
                children,
                lambda: read_loop(shard, stop, seed=11, downgrade=True),
                lambda: read_loop(shard, stop, seed=12, downgrade=False),
                lambda: maintain_loop(shard, stop, "gc"),
            ],
            timeout_s=120,
        )
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        acks = [tuple(a) for o in outs for a in json.loads(o.read_text())]
        assert len(acks) == PROC_WRITERS * PROC_WRITES
        check_race(shard, acks, seen_a + seen_b)  # type: ignore[arg-type]
    finally:
        client.maintenance.wait_idle(30)
        client.close()
