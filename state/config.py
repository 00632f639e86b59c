"""The tunable knobs of a persist client, each a named constant with its default.

Sizes follow persist's memory model: a writer holds at most
``part_target_bytes * (2 * max_outstanding_parts + 1)`` bytes per batch
builder and a reader at most about ``3 * part_target_bytes`` per snapshot or
listen, whatever the size of the data.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidUsage

MiB = 1 << 20


_MAY_BE_ZERO = frozenset({"maintenance_delay_s"})
"""Knobs for which 0 means "none" rather than a mistake."""


@dataclass(frozen=True)
class PersistConfig:
    """Knobs shared by every handle of one client. Validated on construction."""

    part_target_bytes: int = 64 * MiB
    """B: a batch builder cuts a part once this many bytes of Arrow data are buffered."""
    max_outstanding_parts: int = 2
    """N: parts a batch builder encodes and uploads at once before ``add`` blocks."""
    inline_write_max_bytes: int = 4096
    """Writes whose encoded updates fit this are kept inline in state: no Blob round trip."""
    inline_total_max_bytes: int = 256 * 1024
    """Inline data in state never exceeds this: further writes go to Blob until compaction
    moves inline data out (it keeps state, and so every rollup, small)."""
    rollup_interval: int = 64
    """A full state is written to Blob every this many SeqNos, so loading reads few diffs."""
    retry_timeout_s: float = 60.0
    """How long a command retries unavailable stores and lost races before giving up; less
    than half of ``staged_part_grace_s`` (a commit may land this long after checking its
    staged parts)."""
    listen_poll_min_s: float = 0.002
    """First Consensus poll delay of a waiting listen once its in-process wake-up timed out."""
    listen_poll_max_s: float = 0.1
    """Longest delay between Consensus polls of an idle listen (the polling fallback)."""
    listen_poll_pushed_s: float = 5.0
    """Delay between Consensus polls of an idle listen while PubSub delivers its shard: how
    late a listen may see a commit whose push was lost (a push is a hint, never the only way
    a reader learns of a commit)."""
    read_batch_rows: int = 65536
    """Rows per Arrow batch when a reader streams a part."""
    reader_lease_s: float = 60.0
    """A leased reader that has not heartbeated for this long may be expired by anyone."""
    heartbeat_interval_s: float = 10.0
    """How often a client heartbeats its leased readers (keep well under reader_lease_s)."""
    compaction_fan_in: int = 8
    """Compaction merges this many trailing batches of one size tier into one."""
    compaction_memory_bytes: int = 256 * MiB
    """Batches larger than this together are merged by concatenating parts, not rewriting."""
    gc_interval: int = 32
    """GC runs after the oldest held SeqNo has advanced by this many since the last GC."""
    staged_part_grace_s: float = 3600.0
    """Parts staged but never committed are deleted by an orphan sweep after this long; a
    commit accepts parts younger than half of it, and ``retry_timeout_s`` must be shorter
    than that half."""
    writer_idle_expiry_s: float = 30 * 86400.0
    """GC forgets a writer (its entry and last token) once it has not committed for this long
    (30 days), so the writers map stays small; a writer that then resends an old token has
    it applied again, so keep this longer than any retry of a write."""
    maintenance: bool = True
    """Run compaction and GC automatically after writes (they also run on demand)."""
    maintenance_delay_s: float = 0.05
    """Background compaction and GC a commit asks for start this long after it (0: at once),
    so they do not compete for the CPU with what follows the commit (the next Spark
    micro-batch, a reader picking the commit up)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            if f.name in _MAY_BE_ZERO:
                if not isinstance(value, int | float) or value < 0:
                    raise InvalidUsage(f"persist config {f.name}={value!r} must be 0 or more")
            elif not isinstance(value, int | float) or value <= 0:
                raise InvalidUsage(f"persist config {f.name}={value!r} must be a positive number")
        if self.listen_poll_min_s > self.listen_poll_max_s:
            raise InvalidUsage("persist config listen_poll_min_s must be <= listen_poll_max_s")
        if self.compaction_fan_in < 2:
            raise InvalidUsage("persist config compaction_fan_in must be at least 2")
        if self.retry_timeout_s >= self.staged_part_grace_s / 2:
            # A commit refuses staged parts older than half the grace, then may retry for
            # retry_timeout_s: a longer window lets it land after the orphan sweep took them.
            raise InvalidUsage(
                f"persist config retry_timeout_s={self.retry_timeout_s:g} must be less than "
                f"half of staged_part_grace_s={self.staged_part_grace_s:g}: a commit accepts "
                "staged parts younger than half the grace and may then retry for "
                "retry_timeout_s, so the orphan sweep could delete them before it lands. Raise "
                f"staged_part_grace_s above {2 * self.retry_timeout_s:g} or lower "
                f"retry_timeout_s below {self.staged_part_grace_s / 2:g}"
            )

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> PersistConfig:
        """Build from a dict of knob names; unknown names are an error listing the valid ones."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise InvalidUsage(f"unknown persist config {unknown}; valid ones: {sorted(known)}")
        return cls(**options)
