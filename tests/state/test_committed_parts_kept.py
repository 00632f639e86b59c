"""No committed part is ever deleted: cleanup after unknown outcomes, stale compactions, sweeps.

Each test drives one interleaving deterministically (a fault-injecting
wrapper plus an explicit hook that runs the competing step at the exact
moment), then reads every allowed ``as_of`` and compares it with the writes
that were acknowledged.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Callable
from dataclasses import replace as dc_replace

import pyarrow as pa
import pytest
from key_helpers import SCHEMA, counts, updates

from pyspark_persist.state import PersistClient, PersistConfig, StagedBatch
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.commands import Committed, UpperMismatch
from pyspark_persist.state.consensus import (
    CaSResult,
    Consensus,
    SeqNo,
    VersionedData,
    open_consensus,
)
from pyspark_persist.state.errors import (
    Indeterminate,
    InvalidUsage,
    SchemaMismatch,
    StagedPartsExpired,
)
from pyspark_persist.state.maintenance import compact
from pyspark_persist.state.maintenance_policy import compaction_request
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus


class HookedConsensus(UnreliableConsensus):
    """Loses the reply of the next compare-and-set and runs ``hook`` before reporting it."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(
            inner, Faults(seed=0, fail_after=1.0, ops=frozenset({"compare_and_set"})), enabled=False
        )
        self.hook: Callable[[], object] | None = None

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """The inner call; when armed, its reply is lost after ``hook`` ran (once)."""
        try:
            return super().compare_and_set(key, expected, new)
        except Indeterminate:
            self.enabled = False
            if self.hook is not None:
                self.hook()
            raise


@pytest.fixture(params=["mem", "file-sqlite"])
def location(request: pytest.FixtureRequest, tmp_path: object) -> tuple[str, str]:
    """A fresh Blob and Consensus URI pair."""
    if request.param == "mem":
        tag = uuid.uuid4().hex
        return f"mem://{tag}", f"mem://{tag}"
    return f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/consensus.db"


def client_on(
    loc: tuple[str, str], config: PersistConfig, consensus: Consensus | None = None
) -> PersistClient:
    """A client with its own state cache, optionally over a wrapped Consensus."""
    return PersistClient(
        open_blob(loc[0]),
        consensus if consensus is not None else open_consensus(loc[1]),
        config=config,
        cache=StateCache(),
    )


BLOB_ONLY = PersistConfig(compaction_fan_in=2, inline_write_max_bytes=1, maintenance=False)


def test_compaction_lost_reply_keeps_its_committed_merge(location: tuple[str, str]) -> None:
    """Issue 13 item 1: a merge whose reply was lost, then merged again elsewhere, is kept.

    The first compaction commits its merge but loses the reply; before it
    retries, another client merges that merge with its neighbour by
    concatenating part lists (so the new state references the first merge's
    parts). The retry is refused; the old code then deleted the merged parts
    and every read failed with PartNotFound.
    """
    hooked = HookedConsensus(open_consensus(location[1]))
    a = client_on(location, BLOB_ONLY, hooked)
    b = client_on(
        location, PersistConfig(compaction_fan_in=2, compaction_memory_bytes=1, maintenance=False)
    )
    try:
        shard = a.open_shard("merge", SCHEMA)
        writer = shard.writer()
        for t in range(4):
            writer.compare_and_append(updates([t, 100 + t], t), t, t + 1)
        request = shard.machine.fetch_latest().trace[:2]
        other = b.open_shard("merge", SCHEMA)
        hooked.hook = other.compact
        hooked.enabled = True
        report = compact(shard.machine, request)
        assert hooked.injected["fail_after"] == 1
        assert not report.applied  # the retry found its inputs (and its own merge) replaced
        state = other.machine.fetch_latest()
        assert len(state.trace) == 1
        with other.reader() as reader:
            got = counts(reader.snapshot_table(3))
        assert got == collections.Counter({k: 1 for t in range(4) for k in (t, 100 + t)})
    finally:
        a.close()
        b.close()


def test_stale_compaction_loses_race_instead_of_failing(location: tuple[str, str]) -> None:
    """The race-test flake: a compaction reading a stale state whose parts GC collected.

    Compaction reads its inputs without a SeqNo lease. When another client
    has meanwhile merged those batches and GC deleted their parts, the read
    meets PartNotFound: the merge has lost its race (its inputs are no longer
    in state) and must say so, not fail.
    """
    a = client_on(location, BLOB_ONLY)
    b = client_on(location, BLOB_ONLY)
    try:
        shard = a.open_shard("stale", SCHEMA)
        writer = shard.writer()
        for t in range(4):
            writer.compare_and_append(updates([t], t), t, t + 1)
        stale = compaction_request(shard.machine.fetch_latest(), BLOB_ONLY)
        assert stale is not None
        other = b.open_shard("stale", SCHEMA)
        other.compact()
        assert other.gc().parts_deleted > 0
        report = compact(shard.machine, stale)  # a's cache still holds the stale state
        assert not report.applied
        with other.reader() as reader:
            assert counts(reader.snapshot_table(3)) == collections.Counter(range(4))
    finally:
        a.close()
        b.close()


HOUR_MS = 3_600_000
SWEEP = PersistConfig(inline_write_max_bytes=1, maintenance=False)


def test_commit_refuses_parts_the_sweep_took(location: tuple[str, str]) -> None:
    """Issue 13 item 2: a slow writer's parts swept before its commit: refused, nothing lands.

    A second client whose clock is past the grace sweeps the staged parts
    (they are old and unreferenced, as far as it can tell); the commit then
    fails with StagedPartsExpired and state is unchanged. The old code
    committed references to the deleted parts: every later read failed.
    """
    a = client_on(location, SWEEP)
    later = [time.time_ns() // 1_000_000 + 2 * HOUR_MS]
    sweeper = PersistClient(
        open_blob(location[0]),
        open_consensus(location[1]),
        config=SWEEP,
        cache=StateCache(),
        clock_ms=lambda: later[0],
    )
    try:
        shard = a.open_shard("slow", SCHEMA)
        writer = shard.writer()
        writer.compare_and_append(updates([1], 0), 0, 1)
        builder = writer.builder()
        builder.add(updates([2, 3], 1))
        staged = builder.finish()
        assert all(p.key is not None for p in staged.parts)
        assert sweeper.open_shard("slow", SCHEMA).gc().orphans_deleted == len(staged.parts)
        before = shard.machine.fetch_latest()
        with pytest.raises(StagedPartsExpired, match="stage the updates again"):
            writer.compare_and_append_batches([staged], 1, 2)
        after = shard.machine.fetch_latest()
        assert (after.seqno, after.upper) == (before.seqno, before.upper)
        with shard.reader() as reader:
            assert counts(reader.snapshot_table(0)) == collections.Counter({1: 1})
    finally:
        a.close()
        sweeper.close()


def test_commit_refuses_parts_past_half_the_grace(location: tuple[str, str]) -> None:
    """A writer whose parts are older than half the grace (by the store's time) may not commit:
    the sweep could take them between the check and the compare-and-set."""
    clock = [time.time_ns() // 1_000_000]
    a = PersistClient(
        open_blob(location[0]),
        open_consensus(location[1]),
        config=SWEEP,
        cache=StateCache(),
        clock_ms=lambda: clock[0],
    )
    try:
        shard = a.open_shard("half", SCHEMA)
        writer = shard.writer()
        builder = writer.builder()
        builder.add(updates([2], 0))
        staged = builder.finish()
        clock[0] += HOUR_MS // 2 + 1000
        with pytest.raises(StagedPartsExpired, match="over half"):
            writer.compare_and_append_batches([staged], 0, 1)
        assert shard.machine.fetch_latest().upper == 0
        clock[0] -= HOUR_MS // 2  # within half the grace: the same parts commit
        assert isinstance(writer.compare_and_append_batches([staged], 0, 1), Committed)
    finally:
        a.close()


def test_sweep_measures_age_by_the_store_not_the_writer_clock(location: tuple[str, str]) -> None:
    """Issue 13 item 2: a part staged by a writer whose clock is two hours behind is fresh.

    Its key carries the writer's (wrong) time; the old sweep read only that
    and deleted the part at once, so the commit after it referenced a part
    that was gone.
    """
    a = client_on(location, SWEEP)
    try:
        shard = a.open_shard("skew", SCHEMA)
        writer = shard.writer()
        builder = writer.builder()
        builder.add(updates([5, 6], 0))
        (part,) = builder.finish().parts
        assert part.key is not None
        skewed_ms = time.time_ns() // 1_000_000 - 2 * HOUR_MS
        key = f"skew/part/{skewed_ms:013d}-{uuid.uuid4().hex}.parquet"
        data = a.blob.get(part.key)
        assert data is not None
        a.blob.set(key, data)  # what a writer with the skewed clock uploads
        a.blob.delete(part.key)
        staged = StagedBatch("skew", (dc_replace(part, key=key),), has_time=True)
        assert shard.gc().orphans_deleted == 0
        assert isinstance(writer.compare_and_append_batches([staged], 0, 1), Committed)
        with shard.reader() as reader:
            assert counts(reader.snapshot_table(0)) == collections.Counter({5: 1, 6: 1})
    finally:
        a.close()


def lossy_client(loc: tuple[str, str], faults: Faults) -> tuple[PersistClient, UnreliableConsensus]:
    """A client whose Consensus injects ``faults`` (armed later) and hands every error straight
    to the caller: a lost reply ends the call with Indeterminate, as after a failed deadline."""
    consensus = UnreliableConsensus(open_consensus(loc[1]), faults, enabled=False)
    config = PersistConfig(inline_write_max_bytes=1, maintenance=False, retry_timeout_s=1e-9)
    return client_on(loc, config, consensus), consensus


LOSE_ONE_REPLY = Faults(seed=0, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set"}))


def test_resend_after_indeterminate_keeps_the_landed_parts(location: tuple[str, str]) -> None:
    """Issue 33 item 1: a resent StagedBatch refused with UpperMismatch deletes nothing it landed.

    The first commit (no token) lands but its reply is lost: Indeterminate.
    Resending the same staged batch at the same expected upper is refused
    (the first commit moved the upper); the old code then deleted the staged
    parts the landed batch references, and every read failed with PartNotFound.
    """
    a, lossy = lossy_client(location, LOSE_ONE_REPLY)
    try:
        shard = a.open_shard("resend", SCHEMA)
        writer = shard.writer()
        builder = writer.builder()
        builder.add(updates([7, 8], 0))
        staged = builder.finish()
        assert all(p.key is not None for p in staged.parts)
        lossy.enabled = True
        with pytest.raises(Indeterminate):
            writer.compare_and_append_batches([staged], 0, 1)
        assert lossy.injected["fail_after"] == 1
        assert writer.compare_and_append_batches([staged], 0, 1) == UpperMismatch(current=1)
        with shard.reader() as reader:
            assert counts(reader.snapshot_table(0)) == collections.Counter({7: 1, 8: 1})
    finally:
        a.close()


def test_schema_mismatch_after_indeterminate_keeps_the_landed_parts(
    location: tuple[str, str],
) -> None:
    """Issue 33 item 1: a resend refused with SchemaMismatch deletes nothing the first one landed.

    The first commit lands with its reply lost; another writer then adds a
    column ``note`` (a string); the resend, carrying its own ``note`` (an
    integer), is refused. The old code deleted the staged parts the landed
    batch references.
    """
    a, lossy = lossy_client(location, LOSE_ONE_REPLY)
    b = client_on(location, BLOB_ONLY)
    try:
        shard = a.open_shard("resend-schema", SCHEMA)
        writer = shard.writer()
        builder = writer.builder()
        builder.add(pa.table({"k": pa.array([7, 8], pa.int64())}))  # times set by the commit
        staged = builder.finish()
        lossy.enabled = True
        with pytest.raises(Indeterminate):
            writer.compare_and_append_batches([staged], 0, 1, ts_rewrite=0)
        other = b.open_shard("resend-schema", SCHEMA).writer()
        with_note = updates([9], 1).append_column("note", pa.array(["n"], pa.string()))
        assert isinstance(other.compare_and_append(with_note, 1, 2, merge_schema=True), Committed)
        evolved = SCHEMA.append(pa.field("note", pa.int64()))
        assert writer.fetch_upper() == 2
        with pytest.raises(SchemaMismatch):
            writer.compare_and_append_batches([staged], 2, 3, ts_rewrite=2, schema=evolved)
        with shard.reader() as reader:
            got = counts(reader.snapshot_table())
        assert got == collections.Counter({7: 1, 8: 1, 9: 1})
    finally:
        a.close()
        b.close()


class BlipConsensus(UnreliableConsensus):
    """Refuses the next compare-and-set (StoreUnavailable: surely not applied) after ``hook``."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(
            inner,
            Faults(seed=0, fail_before=1.0, max_faults=1, ops=frozenset({"compare_and_set"})),
            enabled=False,
        )
        self.hook: Callable[[], object] | None = None

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """The inner call; when armed, ``hook`` runs and the call is refused (once)."""
        if not self.enabled:
            return super().compare_and_set(key, expected, new)
        if self.hook is not None:
            self.hook()
        try:
            return super().compare_and_set(key, expected, new)
        finally:
            self.enabled = False


def test_commit_rechecks_staged_parts_on_every_attempt(location: tuple[str, str]) -> None:
    """Issue 33 item 3: parts swept while a commit retries a store blip are not committed.

    The first attempt checks the staged parts (fresh) and is refused by the
    store; meanwhile the orphan sweep of a client whose clock is past the
    grace deletes them. The old code checked only once, so the retry landed
    references to deleted parts (and was acknowledged); every read failed.
    """
    blip = BlipConsensus(open_consensus(location[1]))
    a = client_on(location, SWEEP, blip)
    later = time.time_ns() // 1_000_000 + 2 * HOUR_MS
    sweeper = PersistClient(
        open_blob(location[0]),
        open_consensus(location[1]),
        config=SWEEP,
        cache=StateCache(),
        clock_ms=lambda: later,
    )
    try:
        shard = a.open_shard("blip", SCHEMA)
        writer = shard.writer()
        writer.compare_and_append(updates([1], 0), 0, 1)
        builder = writer.builder()
        builder.add(updates([2, 3], 1))
        staged = builder.finish()
        swept = sweeper.open_shard("blip", SCHEMA)
        blip.hook = swept.gc
        blip.enabled = True
        with pytest.raises(StagedPartsExpired):
            writer.compare_and_append_batches([staged], 1, 2)
        assert blip.injected["fail_before"] == 1
        assert shard.machine.fetch_latest().upper == 1
        with shard.reader() as reader:
            assert counts(reader.snapshot_table(0)) == collections.Counter({1: 1})
    finally:
        a.close()
        sweeper.close()


def test_config_refuses_retry_timeout_beyond_staged_grace() -> None:
    """Issue 33 item 3: a commit may retry for retry_timeout_s after checking its parts, which
    must be younger than half the grace: a retry window reaching past that half is refused."""
    with pytest.raises(InvalidUsage, match=r"retry_timeout_s=60.*staged_part_grace_s=100"):
        PersistConfig(staged_part_grace_s=100)
    with pytest.raises(InvalidUsage, match=r"retry_timeout_s=5.*staged_part_grace_s=10"):
        PersistConfig.from_options({"staged_part_grace_s": 10, "retry_timeout_s": 5})
    assert PersistConfig(staged_part_grace_s=10, retry_timeout_s=4.9).retry_timeout_s == 4.9
    assert PersistConfig().retry_timeout_s < PersistConfig().staged_part_grace_s / 2
