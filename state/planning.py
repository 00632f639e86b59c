"""Read planning: which parts of one ShardState answer a read, and how to split them.

Every read of a shard, whatever drives it, asks the same question of one
state: *which parts hold the updates with times in* ``[lower, upper)``, *and
at what time are they read?* :func:`plan_read` is the only answer in the
project. The snapshot (``ReadHandle.snapshot``, ``persist shards show``, the
Spark batch read), the change feed (``readChanges``), each listen event,
each micro-batch of the streaming source and each cut of a capped snapshot
are all calls to it, with different arguments:

- ``as_of=t``: the collection at ``t``, i.e. every update at a time in
  ``[0, t]`` read as at ``t``. Over that whole range a part referenced
  negated (an atomic replace's retraction) and a plain reference to the same
  data cancel, so neither is fetched.
- ``lower``/``upper`` without ``as_of``: every update in ``[lower, upper)``
  with its own time (a listen event, a change range, a streaming
  micro-batch).
- both: one cut of a snapshot, the updates at times in ``[lower, upper)``
  read as at ``as_of`` (a streaming source under a read limit).

:class:`ReadLimits` caps the range (``max_bytes``/``max_parts``/``max_rows``:
the plan's ``upper`` is then where the longest run of whole batches that fits
ends, and always past at least one batch with data) and splits the parts
over tasks by size (``split_bytes``, ``min_splits``): see :func:`split_parts`.

It is pure: no I/O, no leases, no clock. Which state to plan from (leased,
so GC keeps its parts) and which frontiers to refuse (with the caller's own
error) stay with the caller.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .codec import ARROW, ARROW_ROWS
from .errors import InvalidUsage
from .state import Batch, PartRef, ShardState, Time

CUT_ROWS = 65536
"""Where a split may cut an Arrow part: at multiples of this many of its stored rows, the
batch size both writers stage (so a task reads whole stored batches, in place)."""
CUTTABLE_FORMATS = (ARROW, ARROW_ROWS)
"""The part formats a split may cut: a task reads an Arrow IPC part's batches in its row range
without decoding the others. A Parquet part is never cut (its row groups are about a million
rows: two tasks would each decode most of the part)."""


@dataclass(frozen=True)
class LeasedPart:
    """A part handed out by a snapshot or listen, with everything a remote process needs.

    The reader keeps updates with ``lower <= time < upper`` (after the part's
    ``ts_rewrite``) and, for a snapshot, advances every time to ``as_of``.
    ``seqno`` is the SeqNo of the state the part was read from: the holder of
    the lease on it keeps GC from deleting the part until it is returned.
    """

    shard_id: str
    blob_uri: str
    part: PartRef
    lower: Time
    upper: Time
    as_of: Time | None
    seqno: int
    row_range: tuple[int, int] | None = None
    """The stored rows ``[start, stop)`` of the part that this reader reads (a split cut the
    part between tasks, see :func:`split_parts`); ``None``: all of them."""

    def to_json(self) -> dict[str, Any]:
        """Encode for shipping to another process (a Spark InputPartition)."""
        out = {
            "shard": self.shard_id,
            "blob": self.blob_uri,
            "part": self.part.to_json(),
            "lower": self.lower,
            "upper": self.upper,
            "as_of": self.as_of,
            "seqno": self.seqno,
        }
        if self.row_range is not None:
            out["rows"] = list(self.row_range)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeasedPart:
        """Decode what :meth:`to_json` produced."""
        return cls(
            shard_id=str(d["shard"]),
            blob_uri=str(d["blob"]),
            part=PartRef.from_json(d["part"]),
            lower=int(d["lower"]),
            upper=int(d["upper"]),
            as_of=None if d.get("as_of") is None else int(d["as_of"]),
            seqno=int(d["seqno"]),
            row_range=None if d.get("rows") is None else (int(d["rows"][0]), int(d["rows"][1])),
        )

    @property
    def read_bytes(self) -> int:
        """The part's bytes this reader reads: all of them, or its row range's share."""
        if self.row_range is None or not self.part.rows:
            return self.part.size_bytes
        start, stop = self.row_range
        return self.part.size_bytes * (stop - start) // self.part.rows

    @property
    def needs_filter(self) -> bool:
        """False when every update of the part is inside the bounds (the common case)."""
        return not (
            self.lower <= self.part.effective_min_time and self.part.effective_max_time < self.upper
        )


@dataclass(frozen=True)
class ReadLimits:
    """How much one read may take and how to spread it over tasks (``None``: no cap).

    The caps count whole batches of the trace, so a read never ends inside a
    batch unless the requested range itself does.
    """

    max_bytes: int | None = None
    """Encoded bytes of the batches read (Spark's ``maxBytesPerTrigger``)."""
    max_parts: int | None = None
    """Parts (files) of the batches read (Spark's ``maxFilesPerTrigger``)."""
    max_rows: int | None = None
    """Stored updates of the batches read (Spark's ``maxRowsPerTrigger``)."""
    split_bytes: int | None = None
    """Target bytes per split; ``None``: all parts in one split."""
    min_splits: int = 1
    """At least this many splits (never more than :func:`split_count` allows)."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "max_parts", "max_rows", "split_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidUsage(f"read limit {name}={value} must be positive (or None: no cap)")
        if self.min_splits < 1:
            raise InvalidUsage(f"read limit min_splits={self.min_splits} must be at least 1")

    @property
    def caps(self) -> bool:
        """True when some cap may end the read before the requested upper."""
        return (self.max_bytes, self.max_parts, self.max_rows) != (None, None, None)


NO_LIMITS = ReadLimits()
"""Everything in the range, in one split."""


class PartTotals:
    """What a set of leased parts adds up to: shared by a read plan and a snapshot."""

    parts: tuple[LeasedPart, ...]

    @property
    def size_bytes(self) -> int:
        """Encoded bytes to fetch."""
        return sum(p.part.size_bytes for p in self.parts)

    @property
    def rows(self) -> int:
        """Updates stored in the parts (an upper bound on the rows the read yields)."""
        return sum(p.part.rows for p in self.parts)


@dataclass(frozen=True)
class ReadPlan(PartTotals):
    """The parts answering ``[lower, upper)`` (read as at ``as_of`` when set) of state ``seqno``.

    ``upper`` is the end actually planned: the requested one, or earlier where
    a cap of the limits cut the range. ``splits`` partitions ``parts``.
    """

    shard_id: str
    seqno: int
    lower: Time
    upper: Time
    as_of: Time | None
    parts: tuple[LeasedPart, ...]
    splits: tuple[tuple[LeasedPart, ...], ...]

    @property
    def may_retract(self) -> bool:
        """True when some part may hold a negative diff (so a consolidated read must
        see all parts together); unknown diff bounds count as may."""
        return any((p.part.effective_dmin or -1) <= 0 for p in self.parts)


def plan_read(
    state: ShardState,
    blob_uri: str,
    *,
    as_of: Time | None = None,
    lower: Time = 0,
    upper: Time | None = None,
    limits: ReadLimits = NO_LIMITS,
    skip: Callable[[PartRef], bool] | None = None,
) -> ReadPlan:
    """The parts of ``state`` to read for the range and ``as_of`` given (see the module doc).

    ``upper`` defaults to ``as_of + 1`` for a snapshot, else the shard's
    upper. ``skip`` drops parts the caller can prove hold nothing it wants
    (pushed-down filters), before splitting. Raises InvalidUsage for a range
    that ends before it starts or, with ``as_of``, reaches past ``as_of``.
    """
    if upper is None:
        upper = state.upper if as_of is None else as_of + 1
    if upper < lower:
        raise InvalidUsage(
            f"read range [{lower}, {upper}) of shard {state.shard_id!r} ends before it starts: "
            "plan with upper >= lower"
        )
    if as_of is not None and upper > as_of + 1:
        raise InvalidUsage(
            f"read range [{lower}, {upper}) of shard {state.shard_id!r} reaches past as_of "
            f"{as_of}: a snapshot holds times up to as_of only; plan with upper <= {as_of + 1}"
        )
    if limits.caps:
        upper = limited_upper(state, lower, upper, limits)
    refs = [
        p
        for b in state.trace
        if b.upper > lower and b.lower < upper
        for p in b.parts
        if p.effective_max_time >= lower and p.effective_min_time < upper
    ]
    if as_of is not None and lower == 0 and upper == as_of + 1:
        refs = cancel_negations(refs, as_of)
    if skip is not None:
        refs = [p for p in refs if not skip(p)]
    parts = tuple(
        LeasedPart(state.shard_id, blob_uri, p, lower, upper, as_of, state.seqno) for p in refs
    )
    if limits.split_bytes is None:
        splits: tuple[tuple[LeasedPart, ...], ...] = (parts,) if parts else ()
    else:
        splits = tuple(tuple(s) for s in split_parts(parts, limits.split_bytes, limits.min_splits))
    return ReadPlan(state.shard_id, state.seqno, lower, upper, as_of, parts, splits)


def limited_upper(state: ShardState, lower: Time, target: Time, limits: ReadLimits) -> Time:
    """The upper of the longest run of whole batches from ``lower`` that fits every cap.

    A read always takes at least one batch with data, so a single batch
    larger than a cap still makes progress. A batch compacted across
    ``target`` (e.g. an AvailableNow upper) is taken up to ``target`` when
    nothing was taken yet (the parts are cut by time), or the reader would
    never move on.
    """
    costs: tuple[tuple[int | None, Callable[[Batch], int]], ...] = (
        (limits.max_bytes, lambda b: b.size_bytes),
        (limits.max_parts, lambda b: len(b.parts)),
        (limits.max_rows, lambda b: b.rows),
    )
    caps = [(cap, cost) for cap, cost in costs if cap is not None]
    used = [0] * len(caps)
    end = lower
    for b in state.trace:
        if b.upper <= lower:
            continue
        if b.upper > target:
            if not any(used):
                end = target
            break
        took = [cost(b) for _, cost in caps]
        if any(u > 0 and u + c > cap for u, c, (cap, _) in zip(used, took, caps, strict=True)):
            break
        used = [u + c for u, c in zip(used, took, strict=True)]
        end = b.upper
    return end


def cancel_negations(parts: list[PartRef], as_of: Time) -> list[PartRef]:
    """Drop each negated reference together with a plain reference to the same data.

    An atomic replace retracts old contents by referencing their parts
    negated; at an ``as_of`` that both wholly precede (all times advanced to
    ``as_of``) the pair sums to nothing, so a snapshot need not fetch either.
    Only valid for a whole snapshot: a cut of one keeps different rows of
    the two (the negated reference's times are rewritten).
    """
    whole = [p for p in parts if p.effective_max_time <= as_of]
    negated = collections.Counter(p.identity for p in whole if p.negate)
    if not negated:
        return parts
    plain = collections.Counter(p.identity for p in whole if not p.negate)
    cancel = {k: min(n, plain[k]) for k, n in negated.items() if plain[k]}
    drop_plain, drop_neg = dict(cancel), dict(cancel)
    out = []
    for p in parts:
        pool = drop_neg if p.negate else drop_plain
        if p.effective_max_time <= as_of and pool.get(p.identity, 0) > 0:
            pool[p.identity] -= 1
            continue
        out.append(p)
    return out


def split_count(parts: Sequence[LeasedPart], split_bytes: int, min_splits: int) -> int:
    """How many tasks :func:`split_parts` makes: the parts' bytes over ``split_bytes``,
    rounded to the nearest power of two (tasks of 0.7 to 1.4 times ``split_bytes``), at
    least ``min_splits``, at most the pieces there are.

    A batch read's planner cannot know how many cores will run its tasks (Spark tells a
    Python source nothing of it), so the count from bytes is a power of two: equal tasks
    then finish together on 1, 2, 4, 8 ... cores (up to the count), where 5 tasks on 2
    cores leave one core idle for the last. A piece is a whole part, or :data:`CUT_ROWS`
    rows of a part a split may cut.
    """
    if not parts:
        return 0
    per_split = sum(p.part.size_bytes for p in parts) / max(split_bytes, 1)
    by_bytes = 1 << round(math.log2(per_split)) if per_split > 1 else 1
    return min(max(min_splits, by_bytes), sum(_pieces(p) for p in parts))


def split_parts(
    parts: Sequence[LeasedPart], split_bytes: int, min_splits: int
) -> list[list[LeasedPart]]:
    """Spread parts over :func:`split_count` tasks of about equal bytes.

    Largest parts first, each to the lightest task (the classic greedy balance). An Arrow
    part that would take that task past its share (the parts' bytes over the task count)
    is cut at a multiple of :data:`CUT_ROWS` rows: the task takes the rows that fill its
    share, and the rest of the part goes on to the next lightest task. So tasks differ by
    about one cut (3 MiB of a 64 MiB part of typical rows) whatever the parts' sizes, and a
    part is cut only where it does not fit whole.
    """
    n = split_count(parts, split_bytes, min_splits)
    if n == 0:
        return []
    share = sum(p.part.size_bytes for p in parts) / n
    bins: list[list[LeasedPart]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for p in sorted(parts, key=lambda p: p.part.size_bytes, reverse=True):
        start, rows = 0, p.part.rows
        while True:
            i = loads.index(min(loads))
            take = rows - start
            if _pieces(p) > 1:
                room = (share - loads[i]) * rows / p.part.size_bytes
                cut = round((start + room) / CUT_ROWS) * CUT_ROWS
                if start < cut < rows:
                    take = cut - start
            piece = p if take == rows else dataclasses.replace(p, row_range=(start, start + take))
            bins[i].append(piece)
            loads[i] += piece.read_bytes
            start += take
            if start >= rows:
                break
    return bins


def _pieces(p: LeasedPart) -> int:
    """How many pieces a split may cut part ``p`` into (1: it reads whole)."""
    if p.part.inline is not None or p.part.fmt not in CUTTABLE_FORMATS or p.part.size_bytes <= 0:
        return 1
    return max(1, -(-p.part.rows // CUT_ROWS))
