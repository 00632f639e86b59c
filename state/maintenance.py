"""Compaction and GC: what keeps a shard small and fast after weeks of tiny writes.

**Compaction** merges a run of adjacent batches into one. It reads their
parts, advances every time below the shard's since up to it (clamped inside
the merged interval), consolidates (sums the diffs of equal ``(row, time)``,
drops zeros) and writes the result as new parts; then
:func:`~pyspark_persist.state.commands.apply_merge` swaps it into state by
compare-and-set, only if the batches are still exactly as read, so losing a
race with a write or another compaction costs nothing but the work. The
policy is tiered: a batch's tier is ``floor(log_fanin(rows))``, and once
``compaction_fan_in`` trailing batches share a tier they are merged, so the
trace holds O(fan_in * log(rows)) batches. Runs bigger than
``compaction_memory_bytes`` are merged by concatenating their part lists
(no rewrite), which keeps memory bounded.

**GC** first moves since up by the shard's retention period, if it has one
(:mod:`~pyspark_persist.state.retention`), then deletes what no reader can
need any more. The oldest SeqNo any
reader holds (``seqno_since``) fixes the line: every state at or after it
must stay readable, so GC keeps the parts its state references and deletes
the parts of batches removed by diffs before it. Then it makes sure a rollup
sits at or just below that SeqNo, truncates Consensus below the rollup, and
forgets older rollups. An occasional sweep deletes parts that were staged
but never committed (a crash between staging and commit) once they are
older than ``staged_part_grace_s``, by the later of the Blob store's own
timestamp and the time in the part key (a writer's clock that is behind
cannot make a fresh part look old). Every commit attempt refuses parts older
than half the grace (:func:`~pyspark_persist.state.write.check_staged`), and
lands within ``retry_timeout_s``, less than that half, so the sweep never
takes a part a commit is about to reference.

Maintenance is data. What to merge is planned by the pure
:func:`compaction_request` (:func:`compaction_plan` for a dry run), what is
garbage by the pure :func:`gc_walk` and :func:`truncation_point` (:func:`plan_gc`
for a dry run). After each commit the pure :func:`requests_after_commit`
turns the new state into :class:`CompactRequest`/:class:`GcRequest` values;
:class:`Maintenance` queues them (``PersistConfig.maintenance``) and one
runner, :func:`run_request`, executes them, in the background and on demand
(:meth:`Maintenance.compact_now`, :meth:`Maintenance.gc_now`).
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from . import commands, retention
from .columns import int_scalar
from .config import PersistConfig
from .consensus import VersionedData
from .diff import decode
from .errors import PartNotFound, PersistError, ShardDropped
from .keys import part_key_created_ms
from .machine import Machine, RunInfo
from .planning import LeasedPart
from .read import ReadHandle, iter_parts
from .schema import MAX_TIME, TIME, TIME_TYPE, decode_schema
from .staging import BatchBuilder, delete_staged
from .state import Batch, ShardState
from .tracing import traced
from .updates import consolidate, with_times
from .versions import read_history, rollup_key, write_rollup
from .write import check_staged, never_committed

log = logging.getLogger(__name__)


def tier(batch: Batch, fan_in: int) -> int:
    """The size tier of a batch: batches of one tier are merged together."""
    return _tier(batch.rows, fan_in)


@functools.lru_cache(maxsize=4096)
def _tier(rows: int, fan_in: int) -> int:
    """(Cached: every commit asks for the tier of every batch in the trace.)"""
    return int(math.log(max(rows, 1), fan_in))


MAX_TIERS = 6
"""With more than ``fan_in * MAX_TIERS`` batches, the lightest adjacent ``fan_in`` merge anyway."""

BACKPRESSURE = 2
"""A trace past ``BACKPRESSURE * fan_in * MAX_TIERS`` batches means background compaction is
falling behind (e.g. starved by a tight write loop): writers then compact before returning."""


def compaction_request(state: ShardState, config: PersistConfig) -> tuple[Batch, ...] | None:
    """The run of adjacent batches that should be merged now, or None. Pure.

    First choice: the oldest run of at least ``fan_in`` adjacent batches of
    one tier, anywhere in the trace. Consolidation can shrink a merge below
    its inputs' tier and leave tiers interleaved so that no such run forms;
    so, second, once the trace holds more than ``fan_in * MAX_TIERS``
    batches, the adjacent ``fan_in`` with the fewest rows merge. Together
    they bound the trace at about ``fan_in * MAX_TIERS`` batches. Before
    either, on a shard with retention, the leading batches since has passed
    (:func:`~pyspark_persist.state.retention.expired_run`).
    """
    trace = state.trace
    fan = config.compaction_fan_in
    expired = retention.expired_run(state, fan)
    if expired is not None:
        return expired
    if len(trace) < fan:
        return None
    run = _oldest_tier_run(trace, fan)
    if run is not None:
        return trace[run[0] : run[1]]
    if len(trace) > fan * MAX_TIERS:
        windows = range(len(trace) - fan + 1)
        best = min(windows, key=lambda i: sum(b.rows for b in trace[i : i + fan]))
        return trace[best : best + fan]
    return None


def compaction_due(state: ShardState, config: PersistConfig) -> bool:
    """Whether :func:`compaction_request` asks for a merge now, without finding which. Pure.

    Every commit asks this (:func:`requests_after_commit`), so it stops at the
    first sign: a trace past ``fan_in * MAX_TIERS`` batches always has a
    lightest window to merge, which the full request would sum window by window
    (a one-row write spent a tenth of its time building the request only to
    test it against None).
    """
    trace = state.trace
    fan = config.compaction_fan_in
    if retention.expired_run(state, fan) is not None:
        return True
    if len(trace) < fan:
        return False
    return len(trace) > fan * MAX_TIERS or _oldest_tier_run(trace, fan) is not None


def _oldest_tier_run(trace: tuple[Batch, ...], fan: int) -> tuple[int, int] | None:
    """``(start, end)`` of the oldest run of at least ``fan`` adjacent batches of one tier."""
    start, last = 0, -1
    for i, b in enumerate(trace):
        t = _tier(b.rows, fan)
        if t != last:
            if i - start >= fan:
                return start, i
            start, last = i, t
    return (start, len(trace)) if len(trace) - start >= fan else None


def compaction_plan(
    state: ShardState, config: PersistConfig, max_rounds: int = 1000
) -> list[tuple[Batch, ...]]:
    """The merges compaction would run now, in order, as data (``--dry-run``). Pure.

    Each planned merge is applied to a copy of the state as its inputs' parts
    side by side, so the next round is planned on what the merge leaves. Real
    compaction consolidates, and a merge whose updates cancel out ends up
    smaller, which can change the rounds after it; the first is exact.
    """
    plan: list[tuple[Batch, ...]] = []
    for _ in range(max_rounds):
        request = compaction_request(state, config)
        if request is None:
            break
        plan.append(request)
        parts = tuple(p for b in request for p in b.parts)
        merged = Batch(request[0].lower, request[-1].upper, min(b.since for b in request), parts)
        outcome = commands.apply_merge(state, replaced=request, merged=merged)
        if not isinstance(outcome, commands.Apply):
            break
        state = state.apply(outcome.diff)
    return plan


@dataclass(frozen=True)
class CompactionReport:
    """What one compaction did."""

    batches_in: int
    rows_in: int
    rows_out: int
    rewritten: bool
    applied: bool


@traced("compact")
def compact(machine: Machine, batches: tuple[Batch, ...]) -> CompactionReport:
    """Merge ``batches`` (adjacent, in time order) and swap the merge into state if still valid."""
    state = machine.state()
    lower, upper = batches[0].lower, batches[-1].upper
    rows_in = sum(b.rows for b in batches)
    parts = tuple(p for b in batches for p in b.parts)
    size = sum(p.size_bytes for p in parts)
    if not parts or size > machine.config.compaction_memory_bytes:
        merged = Batch(lower, upper, min(b.since for b in batches), parts)
        ok = machine.run(lambda s: commands.apply_merge(s, replaced=batches, merged=merged))
        return CompactionReport(len(batches), rows_in, rows_in, False, ok)
    since = max(min(state.since, upper - 1), max(b.since for b in batches))
    leased = [
        LeasedPart(state.shard_id, machine.blob.uri, p, 0, MAX_TIME, None, state.seqno)
        for p in parts
    ]
    schema = decode_schema(state.schema)
    try:
        # Parts written before a column was added get it as nulls: the merge has the
        # current schema.
        tables = list(iter_parts(machine.blob, leased, machine.config.read_batch_rows, schema))
    except PartNotFound:
        # Compaction reads without a SeqNo lease: if another compaction replaced these
        # batches and GC collected their parts meanwhile, this merge has lost its race.
        # Parts missing from batches still in state are real loss: that is raised.
        current = machine.fetch_latest()
        if all(current.batches.get(b.key) == b for b in batches):
            raise
        return CompactionReport(len(batches), rows_in, rows_in, True, False)
    table = pa.concat_tables(tables) if tables else None
    # Compaction output always goes to Blob: it is what moves inline writes out of state.
    builder = BatchBuilder(machine.blob, state.shard_id, schema, machine.config, allow_inline=False)
    rows_out = 0
    if table is not None and table.num_rows:
        times = pc.max_element_wise(table.column(TIME), int_scalar(since, TIME_TYPE))
        table = with_times(table, times)
        if any(p.effective_dmin is None or p.effective_dmin < 0 for p in parts):
            table = consolidate(table, schema.names)  # retractions may cancel insertions
        # Else insert-only: summing equal updates would only fold duplicates together (the
        # same multiset), and its group_by loads Arrow's acero, and pandas with it, into the
        # committing process (a Spark sink's committer: ~0.2 s holding the GIL its next
        # commit waits for, seconds on a busy machine).
        rows_out = table.num_rows
        builder.add(table)
    staged = builder.finish()
    merged = Batch(lower, upper, since, staged.parts)
    info = RunInfo()

    def swap(s: ShardState) -> commands.Outcome[bool]:
        # Like a write, every attempt that would reference the merge's parts checks they
        # are still there and safe from the orphan sweep (a compaction slower than the
        # grace, or held back by a store blip, loses them).
        outcome = commands.apply_merge(s, replaced=batches, merged=merged)
        if isinstance(outcome, commands.Apply):
            check_staged(machine, staged.parts)
        return outcome

    ok = machine.run(swap, info=info)
    if not ok:
        delete_staged(machine.blob, never_committed(machine, staged.parts, info))
    return CompactionReport(len(batches), rows_in, rows_out, True, ok)


@dataclass(frozen=True)
class GcReport:
    """What one GC pass did."""

    seqno_since: int
    parts_deleted: int
    rollups_deleted: int
    consensus_rows_deleted: int
    orphans_deleted: int
    readers_expired: tuple[str, ...]
    writers_expired: tuple[str, ...] = ()


@traced("gc")
def gc(machine: Machine, *, sweep_orphans: bool = False, force: bool = False) -> GcReport:
    """Expire stale readers and idle writers, advance since by the shard's retention, delete
    unreferenced parts and rollups, truncate Consensus."""
    now = machine.clock_ms()
    expired = machine.run(lambda s: commands.expire_leased_readers(s, now_ms=now))
    idle_ms = int(machine.config.writer_idle_expiry_s * 1000)
    writers = machine.run(lambda s: commands.expire_writers(s, now_ms=now, idle_ms=idle_ms))
    machine.run(lambda s: retention.advance_since(s, now_ms=now))
    state = machine.fetch_latest()
    seqno_since = state.seqno_since
    claimed = machine.run(lambda s: commands.claim_gc(s, seqno_since=seqno_since))
    if not claimed and not force and not sweep_orphans:
        return GcReport(seqno_since, 0, 0, 0, 0, expired, writers)
    shard = machine.shard_id
    history = read_history(machine.shard_id, machine.consensus, machine.blob)
    if history is None:
        return GcReport(seqno_since, 0, 0, 0, 0, expired, writers)
    start, pending, first = history
    walk = gc_walk(start, pending, seqno_since)
    garbage, live, keep, at_since = walk.garbage, walk.live, walk.keep, walk.at_since
    machine.blob.delete_many(sorted(garbage))

    # Truncate Consensus below a rollup at (or a little before) seqno_since.
    rollup_at, new_rollup = truncation_point(at_since, first, machine.config)
    if new_rollup:
        key = write_rollup(machine.blob, at_since)
        machine.run(lambda s: commands.add_rollup(s, seqno=at_since.seqno, key=key))
    truncated = machine.consensus.truncate(shard, rollup_at) if rollup_at > first else 0
    current = machine.fetch_latest()
    old_rollups = tuple(s for s in current.rollups if s < rollup_at)
    removed = machine.run(lambda s: commands.remove_rollups(s, seqnos=old_rollups))
    machine.blob.delete_many(rollup_key(shard, s) for s in removed)

    orphans = 0
    if sweep_orphans:
        orphans = _sweep_orphans(machine, live | keep, rollup_at, set(current.rollups), now)
    log.debug(
        "shard %s: gc to SeqNo %s deleted %s parts, %s rollups, %s rows, %s orphans",
        shard,
        seqno_since,
        len(garbage),
        len(removed),
        truncated,
        orphans,
    )
    return GcReport(seqno_since, len(garbage), len(removed), truncated, orphans, expired, writers)


def _sweep_orphans(
    machine: Machine, live: set[str], oldest_rollup: int, rollups: set[int], now_ms: int
) -> int:
    """Delete parts no live state references once past the grace period, stray rollups, and
    what part writers that never committed left in Blob (a crashed executor's temp file)."""
    deleted = machine.blob.delete_many(_orphans(machine, live, oldest_rollup, rollups, now_ms))
    grace_ms = int(machine.config.staged_part_grace_s * 1000)
    return deleted + machine.blob.delete_abandoned(f"{machine.shard_id}/part/", grace_ms)


def _orphans(
    machine: Machine, live: set[str], oldest_rollup: int, rollups: set[int], now_ms: int
) -> list[str]:
    """The keys the orphan sweep deletes (reads the shard's Blob listing, changes nothing)."""
    shard = machine.shard_id
    grace_ms = int(machine.config.staged_part_grace_s * 1000)
    doomed = []
    for meta in list(machine.blob.list_keys(f"{shard}/part/")):
        # The later of the store's timestamp and the writer's (in the key): a writer
        # whose clock is behind cannot make a fresh part look old, nor can the store.
        stamps = [s for s in (meta.modified_ms, part_key_created_ms(meta.key)) if s is not None]
        if meta.key not in live and stamps and now_ms - max(stamps) >= grace_ms:
            doomed.append(meta.key)
    for meta in list(machine.blob.list_keys(f"{shard}/rollup/")):
        seqno = int(meta.key.rsplit("/", 1)[1])
        if seqno < oldest_rollup and seqno not in rollups:
            doomed.append(meta.key)
    return doomed


@dataclass(frozen=True)
class GcWalk:
    """What walking a shard's live diffs tells GC (see :func:`gc_walk`)."""

    garbage: set[str]
    """Part keys of batches removed before ``seqno_since`` that no kept state references."""
    live: set[str]
    """Part keys some state from the oldest row on references (the sweep keeps them)."""
    keep: set[str]
    """Part keys the state at ``seqno_since`` references."""
    at_since: ShardState
    """The state at ``seqno_since`` (or the newest before it)."""


def gc_walk(start: ShardState, rows: list[VersionedData], seqno_since: int) -> GcWalk:
    """Apply ``rows`` to ``start`` and sort the part keys met into garbage and live. Pure.

    Parts of batches removed by diffs at or before ``seqno_since`` are garbage
    unless the state at ``seqno_since`` still references them: every state
    from ``seqno_since`` on must stay readable.
    """
    shard = start.shard_id
    candidates: set[str] = set()
    live: set[str] = set()
    walk = at_since = start
    for row in rows:
        diff = decode(row.data, where=f"consensus row {shard!r} SeqNo {row.seqno}")
        if row.seqno <= seqno_since:
            for key in diff.deleted_batches:
                old = walk.batches.get(key)
                if old is not None:
                    candidates.update(p.key for p in old.parts if p.key is not None)
        walk = walk.apply(diff)
        if walk.seqno <= seqno_since:
            at_since = walk
        live.update(p.key for b in walk.batches.values() for p in b.parts if p.key is not None)
    keep = {p.key for b in at_since.batches.values() for p in b.parts if p.key is not None}
    return GcWalk(candidates - keep, live, keep, at_since)


def truncation_point(at_since: ShardState, first: int, config: PersistConfig) -> tuple[int, bool]:
    """The SeqNo GC truncates Consensus below, and whether it first writes a rollup there. Pure.

    A rollup sits at (or a little before) ``seqno_since``; a new one is
    written when the newest is more than half a ``rollup_interval`` behind,
    or older than the oldest row left.
    """
    rollup_at = max((s for s in at_since.rollups if s <= at_since.seqno), default=0)
    if at_since.seqno - rollup_at >= config.rollup_interval // 2 or rollup_at < first:
        return at_since.seqno, True
    return rollup_at, False


@dataclass(frozen=True)
class GcPlan:
    """What a full GC pass (with the orphan sweep) would do now; nothing was changed."""

    seqno_since: int
    readers_expired: tuple[str, ...]
    parts: tuple[str, ...]
    rollups: tuple[int, ...]
    consensus_rows: int
    orphans: tuple[str, ...]


def plan_gc(machine: Machine) -> GcPlan:
    """The deletions :func:`gc` with ``sweep_orphans`` would make now, read without writing.

    It reads state, the Consensus rows and the Blob listing, and runs the
    pure steps :func:`gc` runs (reader expiry, :func:`gc_walk`,
    :func:`truncation_point`), so what it names is what a pass started now
    would delete, unless the shard changes first.
    """
    now = machine.clock_ms()
    state = machine.fetch_latest()
    outcome = commands.expire_leased_readers(state, now_ms=now)
    if isinstance(outcome, commands.Apply):
        state = state.apply(outcome.diff)
    seqno_since = state.seqno_since
    history = read_history(machine.shard_id, machine.consensus, machine.blob)
    if history is None:
        return GcPlan(seqno_since, outcome.result, (), (), 0, ())
    start, pending, first = history
    walk = gc_walk(start, pending, seqno_since)
    rollup_at, _ = truncation_point(walk.at_since, first, machine.config)
    # Every row from ``first`` up to the head is there (rows are consecutive).
    rows = min(rollup_at, state.seqno) - first if rollup_at > first else 0
    rollups = tuple(s for s in state.rollups if s < rollup_at)
    orphans = _orphans(machine, walk.live | walk.keep, rollup_at, set(state.rollups), now)
    return GcPlan(
        seqno_since,
        outcome.result,
        tuple(sorted(walk.garbage)),
        rollups,
        rows,
        tuple(orphans),
    )


@dataclass(frozen=True)
class CompactRequest:
    """Compaction is due: run up to ``max_rounds`` merges, each planned afresh by
    :func:`compaction_request` from the newest state (a queued plan would be stale)."""

    max_rounds: int = 1000


@dataclass(frozen=True)
class GcRequest:
    """GC is due: one pass (see :func:`gc`), with the orphan sweep when ``sweep_orphans``,
    even when another process claimed the same ``seqno_since`` when ``force``."""

    sweep_orphans: bool = False
    force: bool = False


MaintenanceRequest = CompactRequest | GcRequest
"""Maintenance as data: what a commit (or a user) asks for, run by :func:`run_request`."""

BACKGROUND_COMPACTION_ROUNDS = 8
"""Merges one background compaction request runs before yielding to other queued work."""


def requests_after_commit(
    state: ShardState, config: PersistConfig, previous: ShardState | None = None
) -> tuple[MaintenanceRequest, ...]:
    """The maintenance a commit that produced ``state`` (from ``previous``, when known) calls
    for. Pure and cheap: it runs after every commit (persist's "routine maintenance" returned
    from a command).

    Compaction is asked for only by a commit that can make a merge due: one that changed
    the batches, or the since of a shard with retention (see :func:`compaction_request`).
    A reader's heartbeat or since downgrade changes neither, so a merge still due after it
    is the one the commit that made it due asked for, which that process is running (or
    its next commit retries): asking again would race it with a second compaction of the
    same batches, rewriting them twice for one to win the compare-and-set.
    """
    if not config.maintenance:
        return ()
    requests: list[MaintenanceRequest] = []
    if _may_make_a_merge_due(state, previous) and compaction_due(state, config):
        requests.append(CompactRequest(max_rounds=BACKGROUND_COMPACTION_ROUNDS))
    if state.seqno_since - state.last_gc_seqno >= config.gc_interval:
        requests.append(GcRequest())
    return tuple(requests)


def _may_make_a_merge_due(state: ShardState, previous: ShardState | None) -> bool:
    """Whether the commit from ``previous`` to ``state`` may have made a merge due."""
    if previous is None or state.batches is not previous.batches:
        return True  # (a diff that leaves the batches alone keeps the very same mapping)
    return state.retention_ms > 0 and state.since != previous.since


def run_compaction(machine: Machine, request: CompactRequest) -> list[CompactionReport]:
    """Run compaction until the policy asks for nothing more (or ``request.max_rounds``)."""
    reports = []
    for _ in range(request.max_rounds):
        batches = compaction_request(machine.fetch_latest(), machine.config)
        if batches is None:
            break
        reports.append(compact(machine, batches))
    return reports


def run_gc(machine: Machine, request: GcRequest) -> GcReport:
    """Run one GC pass as ``request`` says."""
    return gc(machine, sweep_orphans=request.sweep_orphans, force=request.force)


def run_request(machine: Machine, request: MaintenanceRequest) -> None:
    """The one runner of maintenance requests (the background thread's, and on demand)."""
    if isinstance(request, CompactRequest):
        run_compaction(machine, request)
    else:
        run_gc(machine, request)


ORPHAN_SWEEP_EVERY = 16
"""Every this many background GC passes of a shard also sweep orphans (a Blob listing)."""

_STOP = object()
"""Queued to wake the background thread so it notices it should stop."""

_LIVE: weakref.WeakSet[Maintenance] = weakref.WeakSet()


def _stop_all() -> None:
    """At interpreter exit, stop background work before the thread pools it uses shut down."""
    for m in list(_LIVE):
        m.close(timeout_s=2.0)


# concurrent.futures refuses new work from its own hook in threading's exit sequence, which
# runs before atexit's; registered there too (later, so run earlier), maintenance stops first.
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_stop_all)
else:  # pragma: no cover - every CPython since 3.9 has it
    atexit.register(_stop_all)


class Maintenance:
    """A client's background workers: compaction and GC after commits, reader heartbeats.

    One daemon thread per client runs maintenance; requests for the same
    shard and kind are deduplicated while queued. A request starts
    ``maintenance_delay_s`` after the commit that asked for it, so a
    compaction does not take the CPU from the work right after a commit (a
    Spark micro-batch's next phases, a reader fetching what was committed).
    Failures are logged, never raised into writers: maintenance that does
    not happen is retried by the next commit. Reader heartbeats have a
    thread of their own, so a long compaction or GC never delays them past
    ``reader_lease_s``.
    """

    def __init__(self, config: PersistConfig) -> None:
        self._config = config
        self._queue: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._inline = threading.Lock()
        _LIVE.add(self)
        self._queued: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._readers: weakref.WeakSet[ReadHandle] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self._heartbeats: threading.Thread | None = None
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._sweeps: dict[str, int] = {}

    def after_commit(
        self, machine: Machine, state: ShardState, previous: ShardState | None = None
    ) -> None:
        """Queue the requests :func:`requests_after_commit` returns for the commit from
        ``previous`` to ``state``."""
        for request in requests_after_commit(state, self._config, previous):
            self._submit(machine, request)

    def backpressure(self, machine: Machine) -> None:
        """Compact in the caller's thread while the trace is past the backpressure bound.

        Runs after a command, outside the machine's lock; one caller at a time
        per client (others return at once and let it work).
        """
        cap = BACKPRESSURE * self._config.compaction_fan_in * MAX_TIERS
        if not self._config.maintenance or len(machine.state().trace) <= cap:
            return
        if threading.current_thread() is self._heartbeats:
            return  # a heartbeat must never wait for a compaction
        if not self._inline.acquire(blocking=False):
            return
        try:
            while len(machine.state().trace) > cap:
                request = compaction_request(machine.state(), self._config)
                if request is None or not compact(machine, request).applied:
                    break
        except PersistError as e:
            log.info("shard %s: backpressure compaction failed: %s", machine.shard_id, e)
        finally:
            self._inline.release()

    def track_reader(self, reader: ReadHandle) -> None:
        """Heartbeat ``reader`` from the background thread until it is closed or collected."""
        with self._lock:
            self._readers.add(reader)
            if self._stop.is_set():
                return
            if self._heartbeats is None or not self._heartbeats.is_alive():
                self._heartbeats = threading.Thread(
                    target=self._heartbeat_loop, name="persist-heartbeat", daemon=True
                )
                self._heartbeats.start()

    def compact_now(self, machine: Machine, max_rounds: int = 1000) -> list[CompactionReport]:
        """Run compaction until the policy asks for nothing more (or ``max_rounds``)."""
        return run_compaction(machine, CompactRequest(max_rounds=max_rounds))

    def gc_now(self, machine: Machine, *, sweep_orphans: bool = True) -> GcReport:
        """Run a full GC pass now, including the orphan sweep."""
        return run_gc(machine, GcRequest(sweep_orphans=sweep_orphans, force=True))

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """Block until no maintenance is queued or running; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while self._queued or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(remaining)
        return True

    def _submit(self, machine: Machine, request: MaintenanceRequest) -> None:
        key = (type(request).__name__, machine.shard_id)
        with self._lock:
            if key in self._queued:
                return
            self._queued.add(key)
        self._queue.put((machine, request, time.monotonic() + self._config.maintenance_delay_s))
        self._ensure_thread()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._stop.is_set():
                return
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="persist-maintenance", daemon=True
                )
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the background thread after the task at hand; queued work is dropped."""
        self._stop.set()
        self._queue.put(_STOP)
        for thread in (self._thread, self._heartbeats):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():
            item = self._queue.get()
            if item is _STOP:
                break
            machine, request, due = item
            # Still queued while it waits: commits meanwhile fold into this request.
            if self._stop.wait(max(0.0, due - time.monotonic())):
                break
            with self._lock:
                self._queued.discard((type(request).__name__, machine.shard_id))
                self._busy += 1
            try:
                self._run(machine, request)
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _heartbeat_loop(self) -> None:
        """Heartbeat every tracked reader each ``heartbeat_interval_s`` until stopped."""
        while not self._stop.wait(self._config.heartbeat_interval_s):
            self._heartbeat_all()

    def _run(self, machine: Machine, request: MaintenanceRequest) -> None:
        kind = "compact" if isinstance(request, CompactRequest) else "gc"
        if isinstance(request, GcRequest):
            n = self._sweeps.get(machine.shard_id, 0) + 1
            self._sweeps[machine.shard_id] = n
            if n % ORPHAN_SWEEP_EVERY == 0:
                request = dc_replace(request, sweep_orphans=True)
        try:
            run_request(machine, request)
        except RuntimeError:
            if not self._stop.is_set():
                log.exception("shard %s: background %s failed", machine.shard_id, kind)
            # else stopping at exit: thread pools refuse new work; the next run redoes it.
        except PersistError as e:
            log.info("shard %s: background %s failed, will retry: %s", machine.shard_id, kind, e)
        except Exception:
            log.exception("shard %s: background %s failed", machine.shard_id, kind)

    def _heartbeat_all(self) -> None:
        with self._lock:
            readers = list(self._readers)
        for reader in readers:
            try:
                reader.heartbeat()
            except ShardDropped as e:
                with self._lock:
                    self._readers.discard(reader)  # its shard is gone for good: stop beating
                log.info("reader %s: %s", reader.reader_id, e)
            except PersistError as e:
                log.info(
                    "reader %s of shard %s: heartbeat failed: %s",
                    reader.reader_id,
                    reader.shard_id,
                    e,
                )
