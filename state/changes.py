"""The change feed's rules: which ranges ``[lower, upper)`` a shard answers, and what is left.

A snapshot consolidates: it answers "what is the collection at t". The
change feed answers "what changed between t0 and t1": every update with a
time in ``[lower, upper)``, with its own ``_time`` and ``_diff``, nothing
consolidated away. A shard holds exactly that natively (its batches are the
changelog), so planning is choosing the parts whose times overlap the range;
each read keeps only the rows in range.

Compaction forwards every time below ``since`` to ``since``, so the changes
are kept apart only from ``since`` on: a range is exact when its ``lower`` is
0 (everything, with the compacted updates at ``since``) or past ``since``,
and it must end past ``since`` and at most at ``upper`` (later times are not
written yet). :func:`check_change_range` is that rule, with an error naming
both frontiers; the plan itself is :func:`~pyspark_persist.state.planning.plan_read`
over ``[lower, upper)``. :func:`behind` is the other side: how much a reader
at some time has still to read.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidFrontier
from .state import ShardState, Time
from .times import describe


def check_change_range(state: ShardState, lower: Time, upper: Time, what: str) -> None:
    """Refuse a change range the shard cannot answer exactly (see the module doc)."""
    frontiers = (
        f"shard {state.shard_id!r} keeps changes apart in [since, upper) = "
        f"[{state.since}, {state.upper}); earlier ones were compacted into the since"
    )
    if lower >= upper:
        raise InvalidFrontier(
            f"{what}: the range [{describe(lower)}, {describe(upper)}) is empty: the end must be "
            "after the start"
        )
    if upper > state.upper:
        raise InvalidFrontier(
            f"{what}: the range ends at {describe(upper)}, past the upper {describe(state.upper)} "
            f"(those times are not written yet); {frontiers}"
        )
    if (lower > 0 and lower - 1 < state.since) or upper - 1 < state.since:
        raise InvalidFrontier(
            f"{what}: the range [{describe(lower)}, {describe(upper)}) reaches before the since "
            f"{describe(state.since)}: {frontiers}. Start at 0 (the compacted past, at the "
            f"since) or after {state.since}, and end after {state.since}"
        )


@dataclass(frozen=True)
class Behind:
    """How much of the shard a reader at ``lower`` has still to read, up to the upper.

    Counted in whole batches: a batch compaction merged across ``lower`` counts
    in full, so this is an upper bound (exact when batches are as written).
    ``times`` is ``upper - lower``: milliseconds for Spark-written shards.
    """

    rows: int
    bytes: int
    parts: int
    times: int

    def to_dict(self) -> dict[str, int]:
        """A plain dict (for JSON)."""
        return {"rows": self.rows, "bytes": self.bytes, "parts": self.parts, "times": self.times}


def behind(state: ShardState, lower: Time) -> Behind:
    """What lies in ``[lower, upper)`` (see :class:`Behind`); nothing when ``lower >= upper``."""
    batches = [b for b in state.trace if b.upper > lower]
    return Behind(
        rows=sum(b.rows for b in batches),
        bytes=sum(b.size_bytes for b in batches),
        parts=sum(len(b.parts) for b in batches),
        times=max(state.upper - lower, 0),
    )
