"""What compaction and GC should do, decided from state alone: maintenance as data.

Everything here is a pure function of a :class:`~pyspark_persist.state.state.ShardState`
(plus the config, the Consensus rows and Blob listing the caller read, and the time the caller
took): no Blob, no Consensus, no clock, no thread. :mod:`~pyspark_persist.state.maintenance`
reads what these functions need, asks them, and performs the answer, as persist-client's
machine performs the ``RoutineMaintenance`` its commands return.

**Compaction** is tiered: a batch's tier is ``floor(log_fanin(rows))``, and once
``compaction_fan_in`` adjacent batches share a tier they are merged
(:func:`compaction_request`), so the trace holds O(fan_in * log(rows)) batches.
:func:`plan_merge` says how a run is merged: rewritten (times below since advanced to it,
consolidated when retractions may cancel insertions) or, past ``compaction_memory_bytes``,
by concatenating part lists, which keeps memory bounded.

**GC** keeps every state from the oldest SeqNo any reader holds (``seqno_since``) readable:
:func:`gc_walk` sorts the parts the Consensus rows name into garbage and live,
:func:`truncation_point` puts a rollup at or just below ``seqno_since`` to truncate below,
:func:`stale_rollups` names the rollups older than it, and :func:`orphans` the parts staged
but never committed that the grace period has passed. :func:`gc_plan` is all of it at once,
for a dry run.

**Requests**: after each commit :func:`requests_after_commit` turns the new state into
:class:`CompactRequest`/:class:`GcRequest` values for the runner to queue.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from dataclasses import replace as dc_replace
from typing import Protocol

from . import commands, retention
from .config import PersistConfig
from .diff import decode
from .keys import part_key_created_ms
from .state import Batch, PartRef, ShardState, Time


class DiffRow(Protocol):
    """A Consensus row (:class:`~pyspark_persist.state.consensus.VersionedData`), as GC reads it."""

    @property
    def seqno(self) -> int:
        """The SeqNo the row's diff leads to."""

    @property
    def data(self) -> bytes:
        """The encoded state diff."""


class ListedKey(Protocol):
    """A Blob key as a listing names it (a :class:`~pyspark_persist.state.blob.BlobMeta`)."""

    @property
    def key(self) -> str:
        """The Blob key."""

    @property
    def modified_ms(self) -> int | None:
        """When the store wrote it, by the store's clock (None: the store cannot tell)."""


# --- compaction -----------------------------------------------------------------------------


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


def compaction_request(
    state: ShardState, config: PersistConfig, *, settle: bool = False
) -> tuple[Batch, ...] | None:
    """The run of adjacent batches that should be merged now, or None.

    First choice: the oldest run of at least ``fan_in`` adjacent batches of
    one tier, anywhere in the trace. Consolidation can shrink a merge below
    its inputs' tier and leave tiers interleaved so that no such run forms;
    so, second, once the trace holds more than ``fan_in * MAX_TIERS``
    batches, the adjacent ``fan_in`` with the fewest rows merge. Together
    they bound the trace at about ``fan_in * MAX_TIERS`` batches. Before
    either, on a shard with retention or keys, the leading batches since has
    passed (:func:`~pyspark_persist.state.retention.expired_run`; ``settle``:
    compaction someone asked for, which folds them all at once).
    """
    trace = state.trace
    fan = config.compaction_fan_in
    memory = config.compaction_memory_bytes
    expired = retention.expired_run(state, fan, settle=settle, memory_bytes=memory)
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
    """Whether :func:`compaction_request` asks for a merge now, without finding which.

    Every commit asks this (:func:`requests_after_commit`), so it stops at the
    first sign: a trace past ``fan_in * MAX_TIERS`` batches always has a
    lightest window to merge, which the full request would sum window by window
    (a one-row write spent a tenth of its time building the request only to
    test it against None).
    """
    trace = state.trace
    fan = config.compaction_fan_in
    memory = config.compaction_memory_bytes
    if retention.expired_run(state, fan, memory_bytes=memory) is not None:
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


def backpressure_due(state: ShardState, config: PersistConfig) -> bool:
    """Whether a writer should compact before returning: the trace is past
    ``BACKPRESSURE * fan_in * MAX_TIERS`` batches (and maintenance is on)."""
    cap = BACKPRESSURE * config.compaction_fan_in * MAX_TIERS
    return config.maintenance and len(state.trace) > cap


def concatenation(batches: tuple[Batch, ...]) -> Batch:
    """The merge of adjacent ``batches`` that rewrites nothing: their parts side by side, at the
    oldest since among them (no time was advanced)."""
    parts = tuple(p for b in batches for p in b.parts)
    since = min(b.since for b in batches)
    return Batch(batches[0].lower, batches[-1].upper, since, parts, tombstones=_tombs(batches))


def _tombs(batches: tuple[Batch, ...]) -> tuple[PartRef, ...]:
    """The tombstones of merged ``batches``: a merge keeps every one (see ``Batch.tombstones``)."""
    return tuple(t for b in batches for t in b.tombstones)


@dataclass(frozen=True)
class MergePlan:
    """How compaction merges a run of adjacent batches (see :func:`plan_merge`)."""

    replaced: tuple[Batch, ...]
    """The batches the merge replaces, in time order."""
    rewrite: bool
    """Read the parts and write new ones; False: concatenate their part lists."""
    since: Time
    """The merged batch's since: what a rewrite advances times below to."""
    consolidate: bool
    """Sum the diffs of equal updates and drop zeros (some part may hold a retraction)."""

    @property
    def parts(self) -> tuple[PartRef, ...]:
        """The parts of the replaced batches, in order."""
        return tuple(p for b in self.replaced for p in b.parts)

    def merged(self, parts: tuple[PartRef, ...]) -> Batch:
        """The batch that replaces the run once its merge is written as ``parts``."""
        r = self.replaced
        return Batch(r[0].lower, r[-1].upper, self.since, parts, tombstones=_tombs(r))


def plan_merge(state: ShardState, batches: tuple[Batch, ...], config: PersistConfig) -> MergePlan:
    """How to merge ``batches`` (adjacent, in time order, read from ``state``).

    Runs bigger than ``compaction_memory_bytes`` (or without parts) are
    concatenated, which keeps memory bounded. A rewrite advances times to the
    shard's since, clamped inside the merged interval (``upper - 1``) and never
    below a since a batch already has. Only a run that may hold retractions
    is consolidated: for inserts alone summing equal updates would only fold
    duplicates together (the same multiset), and its group-by loads Arrow's
    acero, and pandas with it, into the committing process (a Spark sink's
    committer: ~0.2 s holding the GIL its next commit waits for).
    """
    if not any(b.parts for b in batches) or (
        sum(b.size_bytes for b in batches) > config.compaction_memory_bytes
    ):
        return MergePlan(batches, False, min(b.since for b in batches), False)
    upper = batches[-1].upper
    since = max(min(state.since, upper - 1), max(b.since for b in batches))
    consolidate = any(
        p.effective_dmin is None or p.effective_dmin < 0 for b in batches for p in b.parts
    )
    return MergePlan(batches, True, since, consolidate)


def compaction_plan(
    state: ShardState, config: PersistConfig, max_rounds: int = 1000, *, settle: bool = False
) -> list[tuple[Batch, ...]]:
    """The merges compaction would run now, in order, as data (``--dry-run``).

    Each planned merge is applied to a copy of the state as its inputs' parts
    side by side, so the next round is planned on what the merge leaves. Real
    compaction consolidates, and a merge whose updates cancel out ends up
    smaller, which can change the rounds after it; the first is exact.
    """
    plan: list[tuple[Batch, ...]] = []
    for _ in range(max_rounds):
        request = compaction_request(state, config, settle=settle)
        if request is None:
            break
        plan.append(request)
        outcome = commands.apply_merge(state, replaced=request, merged=concatenation(request))
        if not isinstance(outcome, commands.Apply):
            break
        state = state.apply(outcome.diff)
    return plan


# --- GC ----------------------------------------------------------------------------------------


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


def gc_walk(start: ShardState, rows: Sequence[DiffRow], seqno_since: int) -> GcWalk:
    """Apply ``rows`` to ``start`` and sort the part keys met into garbage and live.

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
                    candidates.update(p.key for p in old.all_parts if p.key is not None)
        walk = walk.apply(diff)
        if walk.seqno <= seqno_since:
            at_since = walk
        live.update(p.key for b in walk.batches.values() for p in b.all_parts if p.key is not None)
    keep = {p.key for b in at_since.batches.values() for p in b.all_parts if p.key is not None}
    return GcWalk(candidates - keep, live, keep, at_since)


def truncation_point(at_since: ShardState, first: int, config: PersistConfig) -> tuple[int, bool]:
    """The SeqNo GC truncates Consensus below, and whether it first writes a rollup there.

    A rollup sits at (or a little before) ``seqno_since``; a new one is
    written when the newest is more than half a ``rollup_interval`` behind,
    or older than the oldest row left.
    """
    rollup_at = max((s for s in at_since.rollups if s <= at_since.seqno), default=0)
    if at_since.seqno - rollup_at >= config.rollup_interval // 2 or rollup_at < first:
        return at_since.seqno, True
    return rollup_at, False


def stale_rollups(state: ShardState, rollup_at: int) -> tuple[int, ...]:
    """The rollups ``state`` records below the one GC truncated to: nothing loads them any more."""
    return tuple(s for s in state.rollups if s < rollup_at)


def orphans(
    part_keys: Iterable[ListedKey],
    rollup_keys: Iterable[ListedKey],
    *,
    live: Set[str],
    oldest_rollup: int,
    recorded: Mapping[int, str],
    now_ms: int,
    config: PersistConfig,
) -> list[str]:
    """The keys the orphan sweep deletes, from the listings of a shard's parts and rollups.

    A part no state from the oldest row on references (not in ``live``) goes
    once ``staged_part_grace_s`` has passed since it was written, by the later
    of the store's timestamp and the writer's (in the key): a writer whose
    clock is behind cannot make a fresh part look old, nor can the store. A
    rollup goes when it is below ``oldest_rollup`` and state no longer records
    it (``recorded``).
    """
    grace_ms = int(config.staged_part_grace_s * 1000)
    doomed = []
    for meta in part_keys:
        stamps = [s for s in (meta.modified_ms, part_key_created_ms(meta.key)) if s is not None]
        if meta.key not in live and stamps and now_ms - max(stamps) >= grace_ms:
            doomed.append(meta.key)
    for meta in rollup_keys:
        seqno = int(meta.key.rsplit("/", 1)[1])
        if seqno < oldest_rollup and seqno not in recorded:
            doomed.append(meta.key)
    return doomed


@dataclass(frozen=True)
class GcPlan:
    """What a full GC pass (with the orphan sweep) would do now; nothing was changed."""

    seqno_since: int
    readers_expired: tuple[str, ...]
    parts: tuple[str, ...]
    rollups: tuple[int, ...]
    consensus_rows: int
    orphans: tuple[str, ...]


def gc_plan(
    state: ShardState,
    history: tuple[ShardState, Sequence[DiffRow], int] | None,
    part_keys: Iterable[ListedKey],
    rollup_keys: Iterable[ListedKey],
    config: PersistConfig,
    now_ms: int,
) -> GcPlan:
    """The deletions a GC pass with the orphan sweep would make at ``now_ms``.

    ``history`` is what :func:`~pyspark_persist.state.versions.read_history`
    read (the state at the oldest row, the rows after it, that row's SeqNo);
    ``part_keys`` and ``rollup_keys`` list the shard's Blob. The same steps the pass
    runs: reader expiry, :func:`gc_walk`, :func:`truncation_point`,
    :func:`stale_rollups`, :func:`orphans`.
    """
    outcome = commands.expire_leased_readers(state, now_ms=now_ms)
    if isinstance(outcome, commands.Apply):
        state = state.apply(outcome.diff)
    seqno_since = state.seqno_since
    if history is None:
        return GcPlan(seqno_since, outcome.result, (), (), 0, ())
    start, rows, first = history
    walk = gc_walk(start, rows, seqno_since)
    rollup_at, _ = truncation_point(walk.at_since, first, config)
    # Every row from ``first`` up to the head is there (rows are consecutive).
    consensus_rows = min(rollup_at, state.seqno) - first if rollup_at > first else 0
    doomed = orphans(
        part_keys,
        rollup_keys,
        live=walk.live | walk.keep,
        oldest_rollup=rollup_at,
        recorded=state.rollups,
        now_ms=now_ms,
        config=config,
    )
    return GcPlan(
        seqno_since,
        outcome.result,
        tuple(sorted(walk.garbage)),
        stale_rollups(state, rollup_at),
        consensus_rows,
        tuple(doomed),
    )


# --- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CompactRequest:
    """Compaction is due: run up to ``max_rounds`` merges, each planned afresh by
    :func:`compaction_request` from the newest state (a queued plan would be stale).
    ``settle``: someone asked for it, so what since has passed is folded at once."""

    max_rounds: int = 1000
    settle: bool = False


@dataclass(frozen=True)
class GcRequest:
    """GC is due: one pass (see :func:`~pyspark_persist.state.maintenance.gc`), with the orphan
    sweep when ``sweep_orphans``, even when another process claimed the same ``seqno_since``
    when ``force``."""

    sweep_orphans: bool = False
    force: bool = False


MaintenanceRequest = CompactRequest | GcRequest
"""Maintenance as data: what a commit (or a user) asks for, run by
:func:`~pyspark_persist.state.maintenance.run_request`."""

BACKGROUND_COMPACTION_ROUNDS = 8
"""Merges one background compaction request runs before yielding to other queued work."""

ORPHAN_SWEEP_EVERY = 16
"""Every this many background GC passes of a shard also sweep orphans (a Blob listing)."""


def requests_after_commit(
    state: ShardState, config: PersistConfig, previous: ShardState | None = None
) -> tuple[MaintenanceRequest, ...]:
    """The maintenance a commit that produced ``state`` (from ``previous``, when known) calls
    for. Cheap: it runs after every commit (persist's "routine maintenance" returned from a
    command).

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


def background_gc(request: GcRequest, passes: int) -> GcRequest:
    """The GC request the background runner runs as a shard's ``passes``-th pass (from 1): every
    ``ORPHAN_SWEEP_EVERY``-th also sweeps orphans."""
    if passes % ORPHAN_SWEEP_EVERY == 0:
        return dc_replace(request, sweep_orphans=True)
    return request
