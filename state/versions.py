"""Reading a shard's state: diffs from Consensus, rollups from Blob.

Consensus holds one row per SeqNo, each an encoded
:class:`~pyspark_persist.state.diff.StateDiff`. Rows below the oldest one a
reader may need are truncated by GC, but only down to a SeqNo whose full
state was first written to Blob as a rollup, so the oldest live row always
has a rollup: load it, then apply every newer diff. A process that already
holds the state at SeqNo ``n`` only reads rows after ``n``.
"""

from __future__ import annotations

from .blob import Blob
from .consensus import Consensus, VersionedData
from .diff import decode, encode, full_diff
from .errors import CorruptData
from .state import EMPTY_STATE, ShardState


def rollup_key(shard_id: str, seqno: int) -> str:
    """The Blob key of the rollup of ``shard_id`` at ``seqno`` (deterministic: same state)."""
    return f"{shard_id}/rollup/{seqno:020d}"


def write_rollup(blob: Blob, state: ShardState) -> str:
    """Write the full state to Blob; return its key. Idempotent: the content is fixed by SeqNo."""
    key = rollup_key(state.shard_id, state.seqno)
    blob.set(key, encode(full_diff(state)))
    return key


def apply_rows(state: ShardState, rows: list[VersionedData], shard_id: str) -> ShardState:
    """Apply consecutive Consensus rows, newest last, to ``state``."""
    for row in rows:
        if row.seqno <= state.seqno:
            continue
        diff = decode(row.data, where=f"consensus row {shard_id!r} SeqNo {row.seqno}")
        if diff.to_seqno != row.seqno:
            raise CorruptData(
                f"consensus row {shard_id!r} SeqNo {row.seqno} holds a diff to "
                f"SeqNo {diff.to_seqno}"
            )
        state = state.apply(diff)
    return state


def load_state(
    shard_id: str, consensus: Consensus, blob: Blob, cached: ShardState | None = None
) -> ShardState | None:
    """The newest state of ``shard_id``, or ``None`` if it does not exist.

    Starts from ``cached`` when it is still contiguous with Consensus, else
    from the rollup at the oldest live SeqNo. Retries when GC truncates
    underneath it.
    """
    for _ in range(10):
        if cached is not None:
            rows = consensus.scan(shard_id, cached.seqno + 1)
            if not rows or rows[0].seqno == cached.seqno + 1:
                return apply_rows(cached, rows, shard_id)
        rows = consensus.scan(shard_id, 0)
        if not rows:
            return None
        first = rows[0]
        if first.seqno == 1:
            return apply_rows(EMPTY_STATE, rows, shard_id)
        data = blob.get(rollup_key(shard_id, first.seqno))
        if data is None:
            # GC truncated past ``first`` and deleted its rollup between our two reads.
            cached = None
            continue
        diff = decode(data, where=f"rollup {rollup_key(shard_id, first.seqno)!r}")
        state = EMPTY_STATE.apply(diff)
        return apply_rows(state, rows[1:], shard_id)
    raise CorruptData(
        f"shard {shard_id!r}: the oldest Consensus row keeps changing and has no rollup in Blob"
    )


def read_history(
    shard: str, consensus: Consensus, blob: Blob
) -> tuple[ShardState, list[VersionedData], int] | None:
    """The state at the oldest Consensus row, the rows to apply to it, and that row's SeqNo.

    None if there are no rows, or if another GC truncated meanwhile (the
    oldest row's rollup is gone: that GC did the work). What GC walks, and
    what a cleanup after an unknown outcome searches for references.
    """
    rows = consensus.scan(shard, 0)
    if not rows:
        return None
    first = rows[0].seqno
    if first == 1:
        return EMPTY_STATE, rows, first
    data = blob.get(rollup_key(shard, first))
    if data is None:
        return None
    start = EMPTY_STATE.apply(decode(data, where=f"rollup {rollup_key(shard, first)!r}"))
    return start, rows[1:], first
