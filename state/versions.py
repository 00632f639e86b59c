"""Reading a shard's state: diffs from Consensus, rollups from Blob.

Consensus holds one row per SeqNo, each an encoded
:class:`~pyspark_persist.state.diff.StateDiff`. Rows below the oldest one a
reader may need are truncated by GC, but only down to a SeqNo whose full
state was first written to Blob as a rollup, so the oldest live row always
has a rollup: load it, then apply every newer diff. A shard created again
after a drop starts on top of the drop's tombstone row instead (its SeqNos
go on from the dropped shard's): its history is the rows after the newest
tombstone, applied to an empty state at the tombstone's SeqNo. A process
that already holds the state at SeqNo ``n`` reads row ``n`` again and the
rows after it: row ``n`` must still be the one its state was built from,
and no tombstone may follow it (a shard dropped and created again under its
name starts a new history, which a cached state must never be continued
with), else it loads the shard afresh.
"""

from __future__ import annotations

from dataclasses import replace

from .blob import Blob
from .consensus import Consensus, VersionedData
from .diff import FENCE, TOMBSTONE, decode, encode, full_diff, row_checksum
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


_HEAD = "_head_checksum"
"""Where a state keeps the checksum of the Consensus row at its SeqNo (beside the cached
properties in its ``__dict__``; not a field, so ``apply`` never copies it to the next state)."""


def remember_head(state: ShardState, row: VersionedData) -> ShardState:
    """Note that ``state`` is what Consensus row ``row`` (at its SeqNo) made; returns it."""
    state.__dict__[_HEAD] = row_checksum(row.data)
    return state


def apply_rows(state: ShardState, rows: list[VersionedData], shard_id: str) -> ShardState:
    """Apply consecutive Consensus rows, newest last, to ``state`` (rows it has are skipped)."""
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
    if rows and rows[-1].seqno == state.seqno:
        remember_head(state, rows[-1])
    return state


def _continue(cached: ShardState, consensus: Consensus, shard_id: str) -> ShardState | None:
    """``cached`` brought up to date, or None when Consensus no longer continues it.

    The row at the cached SeqNo is read again: gone (the shard was dropped, or
    GC truncated past a state this far behind), not the row the state was
    built from, or followed by a tombstone (dropped and created again) means
    the rows after it belong to another history. A state of unknown origin is
    trusted as before.
    """
    rows = consensus.scan(shard_id, cached.seqno)
    if not rows or rows[0].seqno != cached.seqno:
        return None
    if any(row.data == TOMBSTONE for row in rows):
        return None  # dropped (and maybe created again): the rows after it are another shard's
    known = cached.__dict__.get(_HEAD)
    if known is not None and known != row_checksum(rows[0].data):
        return None
    return apply_rows(cached, rows, shard_id)


def history_start(
    shard_id: str, rows: list[VersionedData], blob: Blob
) -> tuple[ShardState, list[VersionedData], int] | None:
    """Where the shard's history in ``rows`` (a scan from SeqNo 0, not empty) starts: the
    state to apply the rest to, the rows to apply, and the SeqNo of the oldest row of that
    history (the tombstone, SeqNo 1, or the row the rollup is of).

    After the newest tombstone when there is one (rows before it are a dropped shard's
    that the drop had not deleted yet), from the empty state at SeqNo 0 when the oldest
    row is SeqNo 1, else from the rollup of the oldest row. None when that rollup is gone
    (GC truncated past the oldest row meanwhile: scan again).
    """
    for i in range(len(rows) - 1, -1, -1):
        if rows[i].data == TOMBSTONE:
            return replace(EMPTY_STATE, seqno=rows[i].seqno), rows[i + 1 :], rows[i].seqno
    first = rows[0]
    if first.seqno == 1:
        return EMPTY_STATE, rows, 1
    data = blob.get(rollup_key(shard_id, first.seqno))
    if data is None:
        return None
    diff = decode(data, where=f"rollup {rollup_key(shard_id, first.seqno)!r}")
    return remember_head(EMPTY_STATE.apply(diff), first), rows[1:], first.seqno


def load_state(
    shard_id: str, consensus: Consensus, blob: Blob, cached: ShardState | None = None
) -> ShardState | None:
    """The newest state of ``shard_id``, or ``None`` if it does not exist (never created, or
    dropped and not created again).

    Starts from ``cached`` while Consensus still continues it (see
    :func:`_continue`), else from where its history starts (see
    :func:`history_start`). Retries when GC truncates underneath it.
    """
    if cached is not None:
        state = _continue(cached, consensus, shard_id)
        if state is not None:
            return state
    for _ in range(10):
        rows = consensus.scan(shard_id, 0)
        if not rows or rows[-1].data == TOMBSTONE:
            return None
        if rows[-1].data == FENCE:
            # Being dropped: its rollups may be deleted already, so the oldest row may have
            # none; the fence says what there is to know.
            decode(rows[-1].data, where=f"consensus row {shard_id!r} SeqNo {rows[-1].seqno}")
        start = history_start(shard_id, rows, blob)
        if start is None:
            continue  # GC truncated past the oldest row and deleted its rollup meanwhile
        base, todo, _ = start
        return apply_rows(base, todo, shard_id)
    raise CorruptData(
        f"shard {shard_id!r}: the oldest Consensus row keeps changing and has no rollup in Blob"
    )


def read_history(
    shard: str, consensus: Consensus, blob: Blob
) -> tuple[ShardState, list[VersionedData], int] | None:
    """The state at the oldest Consensus row of the shard's history, the rows to apply to it,
    and that row's SeqNo (see :func:`history_start`).

    None if the shard does not exist, or if another GC truncated meanwhile
    (the oldest row's rollup is gone: that GC did the work). What GC walks,
    and what a cleanup after an unknown outcome searches for references.
    """
    rows = consensus.scan(shard, 0)
    if not rows or rows[-1].data == TOMBSTONE:
        return None
    return history_start(shard, rows, blob)
