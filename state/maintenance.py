"""Compaction and GC, performed: what keeps a shard small and fast after weeks of tiny writes.

What to do is decided by the pure :mod:`~pyspark_persist.state.maintenance_policy`; this
module reads what the policy needs (state, Consensus rows, Blob listings, the clock), asks it,
and does what it says.

**Compaction** (:func:`compact`) merges a run of adjacent batches into one. It reads their
parts, advances every time below the shard's since up to it (clamped inside
the merged interval), consolidates (sums the diffs of equal ``(row, time)``,
drops zeros) and writes the result as new parts; then
:func:`~pyspark_persist.state.commands.apply_merge` swaps it into state by
compare-and-set, only if the batches are still exactly as read, so losing a
race with a write or another compaction costs nothing but the work.

**GC** (:func:`gc`) first moves since up by the shard's retention period, if it has one
(:mod:`~pyspark_persist.state.retention`), then deletes what no reader can
need any more. The oldest SeqNo any
reader holds (``seqno_since``) fixes the line: every state at or after it
must stay readable, so GC keeps the parts its state references and deletes
the parts of batches removed by diffs before it. Then it makes sure a rollup
sits at or just below that SeqNo, truncates Consensus below the rollup, and
forgets older rollups. An occasional sweep deletes parts that were staged
but never committed (a crash between staging and commit) once they are
older than ``staged_part_grace_s``. Every commit attempt refuses parts older
than half the grace (:func:`~pyspark_persist.state.write.check_staged`), and
lands within ``retry_timeout_s``, less than that half, so the sweep never
takes a part a commit is about to reference.

After each commit, :class:`Maintenance` queues the requests
:func:`~pyspark_persist.state.maintenance_policy.requests_after_commit` returns
(``PersistConfig.maintenance``) and one runner, :func:`run_request`, executes them, in the
background and on demand (:meth:`Maintenance.compact_now`, :meth:`Maintenance.gc_now`).
:func:`plan_gc` reads what a pass would and reports what it would delete.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from . import commands, consumers, retention
from .blob import BlobMeta
from .columns import int_scalar
from .config import PersistConfig
from .errors import PartNotFound, PersistError, ShardDropped
from .keyed import consolidate_keyed
from .machine import Machine, RunInfo
from .maintenance_policy import (
    CompactRequest,
    GcPlan,
    GcRequest,
    MaintenanceRequest,
    background_gc,
    backpressure_due,
    compaction_request,
    gc_plan,
    gc_walk,
    orphans,
    plan_merge,
    requests_after_commit,
    stale_rollups,
    truncation_point,
)
from .planning import LeasedPart
from .read import ReadHandle, iter_parts
from .schema import MAX_TIME, TIME, TIME_TYPE, decode_schema
from .staging import BatchBuilder, delete_staged
from .state import Batch, ShardState
from .tracing import traced
from .updates import consolidate, with_times
from .upsert import part_format
from .versions import read_history, rollup_key, write_rollup
from .write import check_staged, never_committed

log = logging.getLogger(__name__)


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
    plan = plan_merge(state, batches, machine.config)
    rows_in = sum(b.rows for b in batches)
    if not plan.rewrite:
        concatenated = plan.merged(plan.parts)
        ok = machine.run(lambda s: commands.apply_merge(s, replaced=batches, merged=concatenated))
        return CompactionReport(len(batches), rows_in, rows_in, False, ok)
    leased = [
        LeasedPart(state.shard_id, machine.blob.uri, p, 0, MAX_TIME, None, state.seqno)
        for p in plan.parts
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
    builder = BatchBuilder(
        machine.blob,
        state.shard_id,
        schema,
        machine.config,
        allow_inline=False,
        part_format=part_format(state),
    )
    rows_out = 0
    if table is not None and table.num_rows:
        times = pc.max_element_wise(table.column(TIME), int_scalar(plan.since, TIME_TYPE))
        table = with_times(table, times)
        if plan.consolidate and state.keys:  # (not for inserts alone: see plan_merge)
            table = consolidate_keyed(table, schema.names, state.keys)
        elif plan.consolidate:
            table = consolidate(table, schema.names)
        rows_out = table.num_rows
        builder.add(table)
    staged = builder.finish()
    merged = plan.merged(staged.parts)
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
    consumers_expired: tuple[str, ...] = ()
    """Named consumers idle past their expiry: they stopped holding data (state/consumers.py)."""


@traced("gc")
def gc(machine: Machine, *, sweep_orphans: bool = False, force: bool = False) -> GcReport:
    """Expire stale readers, idle writers and idle consumers, advance since by the shard's
    retention, delete unreferenced parts and rollups, truncate Consensus."""
    now = machine.clock_ms()
    expired = machine.run(lambda s: commands.expire_leased_readers(s, now_ms=now))
    idle = machine.run(lambda s: consumers.expire_consumers(s, now_ms=now))
    idle_ms = int(machine.config.writer_idle_expiry_s * 1000)
    writers = machine.run(lambda s: commands.expire_writers(s, now_ms=now, idle_ms=idle_ms))
    machine.run(lambda s: retention.advance_since(s, now_ms=now))
    state = machine.fetch_latest()
    seqno_since = state.seqno_since
    claimed = machine.run(lambda s: commands.claim_gc(s, seqno_since=seqno_since))
    if not claimed and not force and not sweep_orphans:
        return GcReport(seqno_since, 0, 0, 0, 0, expired, writers, idle)
    shard = machine.shard_id
    history = read_history(machine.shard_id, machine.consensus, machine.blob)
    if history is None:
        return GcReport(seqno_since, 0, 0, 0, 0, expired, writers, idle)
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
    old_rollups = stale_rollups(current, rollup_at)
    removed = machine.run(lambda s: commands.remove_rollups(s, seqnos=old_rollups))
    machine.blob.delete_many(rollup_key(shard, s) for s in removed)

    swept = 0
    if sweep_orphans:
        swept = _sweep_orphans(machine, live | keep, rollup_at, current, now)
    log.debug(
        "shard %s: gc to SeqNo %s deleted %s parts, %s rollups, %s rows, %s orphans",
        shard,
        seqno_since,
        len(garbage),
        len(removed),
        truncated,
        swept,
    )
    return GcReport(
        seqno_since, len(garbage), len(removed), truncated, swept, expired, writers, idle
    )


def _sweep_orphans(
    machine: Machine, live: set[str], oldest_rollup: int, state: ShardState, now_ms: int
) -> int:
    """Delete parts no live state references once past the grace period, stray rollups (see
    :func:`~pyspark_persist.state.maintenance_policy.orphans`), and what part writers that
    never committed left in Blob (a crashed executor's temp file)."""
    part_keys, rollup_keys = _listing(machine)
    doomed = orphans(
        part_keys,
        rollup_keys,
        live=live,
        oldest_rollup=oldest_rollup,
        recorded=state.rollups,
        now_ms=now_ms,
        config=machine.config,
    )
    deleted = machine.blob.delete_many(doomed)
    grace_ms = int(machine.config.staged_part_grace_s * 1000)
    return deleted + machine.blob.delete_abandoned(f"{machine.shard_id}/part/", grace_ms)


def _listing(machine: Machine) -> tuple[list[BlobMeta], list[BlobMeta]]:
    """The shard's part keys and rollup keys in Blob, as the orphan sweep judges them."""
    shard = machine.shard_id
    parts = list(machine.blob.list_keys(f"{shard}/part/"))
    return parts, list(machine.blob.list_keys(f"{shard}/rollup/"))


def plan_gc(machine: Machine) -> GcPlan:
    """The deletions :func:`gc` with ``sweep_orphans`` would make now, read without writing.

    It reads state, the Consensus rows and the Blob listing, and asks
    :func:`~pyspark_persist.state.maintenance_policy.gc_plan`, which runs the
    pure steps :func:`gc` runs, so what it names is what a pass started now
    would delete, unless the shard changes first.
    """
    now = machine.clock_ms()
    state = machine.fetch_latest()
    history = read_history(machine.shard_id, machine.consensus, machine.blob)
    part_keys, rollup_keys = _listing(machine) if history is not None else ([], [])
    return gc_plan(state, history, part_keys, rollup_keys, machine.config, now)


def run_compaction(machine: Machine, request: CompactRequest) -> list[CompactionReport]:
    """Run compaction until the policy asks for nothing more (or ``request.max_rounds``)."""
    reports = []
    for _ in range(request.max_rounds):
        batches = compaction_request(machine.fetch_latest(), machine.config, settle=request.settle)
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
        if not backpressure_due(machine.state(), self._config):
            return
        if threading.current_thread() is self._heartbeats:
            return  # a heartbeat must never wait for a compaction
        if not self._inline.acquire(blocking=False):
            return
        try:
            while backpressure_due(machine.state(), self._config):
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
        """Run compaction until the policy asks for nothing more (or ``max_rounds``), folding
        at once what since has passed (see :func:`~.retention.expired_run`)."""
        return run_compaction(machine, CompactRequest(max_rounds=max_rounds, settle=True))

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
            request = background_gc(request, n)
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
