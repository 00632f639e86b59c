"""Per-shard retention: since follows the clock, so storage stays bounded without readers.

Readers' holds alone move a shard's since; a shard nobody reads keeps every
version forever, and compaction cannot consolidate any of it away. With a
retention period (``retention_ms`` in state, set at creation or altered
later), maintenance also advances since to ``now - retention``, so
compaction folds older updates into the state at since and GC deletes the
parts they replace.

What a registered reader has not read is never dropped: since stops at the
lowest reader hold (leased, critical or a named consumer's), and at ``upper - 1`` so the latest
complete time stays readable. That is the difference from Delta Lake's
retention, which deletes a lagging reader's files: here a reader that falls
behind keeps its data, and storage grows by what it has not read until it
catches up or its lease runs out.

Compaction's tiered policy merges batches by size alone, so a batch merged
while its times were still above since keeps every version it held once
since has passed it. On a shard with retention (and on a keyed shard),
:func:`expired_run` also asks compaction to merge the leading batches wholly
at or below since: in the background once the ones after the first hold as
many rows as it (or are ``fan_in``), which bounds both storage and how often
a row is rewritten; when someone asks for compaction (``settle``), at once, so
an idle keyed shard reads like the same rows written once (issue 35: after
100 upserts the read carried up to a head's worth of retraction and insert
pairs to sum, 0.41x-0.77x the written-once read's speed).

Everything here is pure; :func:`pyspark_persist.state.maintenance.gc` runs
:func:`advance_since` with its clock, and
:func:`~pyspark_persist.state.maintenance_policy.compaction_request` asks
:func:`expired_run` first.
"""

from __future__ import annotations

import re

from .commands import Apply, Outcome, Refuse, consumer_holds
from .diff import DiffBuilder
from .errors import InvalidUsage
from .state import Batch, ShardState, Time

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000, "w": 604_800_000}
_RETENTION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d|w)?\s*$", re.IGNORECASE)


def parse_retention(value: str | int, *, name: str = "retention") -> int:
    """A retention period in milliseconds, from ``7d``, ``12h``, ``30m``, ``45s``, ``500ms``,
    ``2w`` or a plain number of milliseconds; ``0`` (or ``none``/``off``) turns it off.

    Raises :class:`InvalidUsage` naming ``name`` and the accepted forms.
    """
    if isinstance(value, bool):
        raise InvalidUsage(f"{name} must be a duration such as 7d or 12h, not {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise InvalidUsage(f"{name} must not be negative (got {value}); use 0 to turn it off")
        return value
    text = str(value)
    if text.strip().lower() in ("none", "off"):
        return 0
    m = _RETENTION_RE.match(text)
    if m is None:
        raise InvalidUsage(
            f"{name} {text!r} is not a duration: write a whole number with a unit, "
            "e.g. 7d, 12h, 30m, 45s, 500ms, or a number of milliseconds (0 or off: no retention)"
        )
    return int(m.group(1)) * _UNITS_MS[(m.group(2) or "ms").lower()]


def format_retention(ms: int) -> str:
    """The shortest exact form of a retention period in days or less (``7d``, ``90m``), or
    ``none``."""
    if ms <= 0:
        return "none"
    for unit in ("d", "h", "m", "s"):
        if ms % _UNITS_MS[unit] == 0:
            return f"{ms // _UNITS_MS[unit]}{unit}"
    return f"{ms}ms"


def set_retention(state: ShardState, *, retention_ms: int) -> Outcome[int]:
    """Set the shard's retention period (0: none). Returns the period now in force.

    Changing it never moves since back: a longer period keeps more of what
    is still there, it cannot bring back what was compacted.
    """
    if retention_ms < 0:
        raise InvalidUsage(f"retention must not be negative (got {retention_ms} ms)")
    if state.retention_ms == retention_ms:
        return Refuse(retention_ms)
    return Apply(DiffBuilder(state).set(retention_ms=retention_ms).build(), retention_ms)


def retention_since(state: ShardState, now_ms: int) -> Time:
    """The since retention allows at ``now_ms``: ``now - retention``, held back by every
    reader's since (unexpired consumers' too) and by ``upper - 1``, and never below the
    current since."""
    if state.retention_ms <= 0:
        return state.since
    holds = [r.since for r in state.leased_readers.values()]
    holds += [r.since for r in state.critical_readers.values()]
    holds += consumer_holds(state.consumers)
    target = min([now_ms - state.retention_ms, state.upper - 1, *holds])
    return max(state.since, target)


def advance_since(state: ShardState, *, now_ms: int) -> Outcome[Time]:
    """Move since up to what retention allows at ``now_ms``; refuses when it would not move."""
    since = retention_since(state, now_ms)
    if since == state.since:
        return Refuse(since)
    return Apply(DiffBuilder(state).set(since=since).build(), since)


def _retracts(batch: Batch) -> bool:
    """Whether ``batch`` may hold retractions (a part's smallest diff is negative or unknown)."""
    return any(p.effective_dmin is None or p.effective_dmin < 0 for p in batch.parts)


def _unconsolidated(batch: Batch, since: int) -> bool:
    """Whether ``batch`` may hold retractions that advancing its times to ``since`` cancels."""
    return batch.since < since and _retracts(batch)


def expired_run(
    state: ShardState, fan_in: int, *, settle: bool = False, memory_bytes: int | None = None
) -> tuple[Batch, ...] | None:
    """The leading batches wholly at or below since, when retention applies and they are worth
    merging, or None.

    Merging them folds every version before since into one batch holding the
    contents at since (compaction advances their times to it), so the
    history retention expired stops taking space. A batch belongs to the run
    once all its times are at or below since (``upper <= since + 1``): a
    since held at ``upper - 1``, where retention stops it, takes in the last
    batch too. Only shards with a retention period ask for it, and keyed
    shards, whose upserts retract a key's old row with every update: folded,
    a key updated a thousand times before since is one row. There a lone
    leading batch below since is rewritten too while it still holds
    retractions at times since passed (once: the rewrite consolidates them
    away); others keep the size-tiered policy alone.

    In the background (``settle`` False) the head, what earlier folds left,
    is rewritten only once the batches after it hold as many rows as it
    (write amplification about 2: a fold writes the head once more for at
    least as many new rows), or once they are ``fan_in`` (amplification up to
    the head's rows over ``fan_in`` batches': 1,000,000 over 8 upserts of
    10,000 keys, their 160,000 rows, is about 7). Between folds a keyed shard
    carries fewer than a head's worth of retraction and insert pairs, which
    every snapshot sums against the head's rows of their keys.
    ``settle`` (a compaction someone asked for: ``Shard.compact()``,
    ``persist compact``) folds the whole run at once when a batch after the
    head may hold retractions, so a shard idle since then reads as if written
    once: its cost is one rewrite of the head per call that finds upserts to
    fold, the caller's choice (an append-only run is left to the tiers). A
    run bigger than ``memory_bytes`` (what one rewrite may hold) is not
    folded: compaction would concatenate its parts, which folds nothing (and
    a lone batch would be asked for again forever).
    """
    if state.retention_ms <= 0 and not state.keys:
        return None
    run: list[Batch] = []
    size = 0
    for b in state.trace:
        size += b.size_bytes
        if b.upper > state.since + 1 or (memory_bytes is not None and size > memory_bytes):
            break
        run.append(b)
    if len(run) == 1 and state.keys and _unconsolidated(run[0], state.since):
        return (run[0],)
    if len(run) < 2:
        return None
    head, rest = run[0], run[1:]
    if settle and any(_retracts(b) for b in rest):
        return tuple(run)
    if len(run) < fan_in and sum(b.rows for b in rest) < head.rows:
        return None
    return tuple(run)
