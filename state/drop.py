"""Dropping a shard: every Blob object and all but one Consensus row of it, deleted safely.

A shard is *in use* while a reader holds it: a leased reader whose lease has
not run out, or a critical reader (a since hold that never expires, such as
a controller's). :func:`drop_shard` refuses (:class:`ShardInUse`) to drop a
shard in use unless forced; a forced drop makes those readers fail.

The drop runs in four steps, each safe to repeat:

1. **Fence.** Compare-and-set a Consensus row, :data:`FENCE`, which is not a
   state diff: no process can build on it, so from here no commit can land.
   A writer racing the drop loses its compare-and-set, reads the fence and
   fails with :class:`ShardDropped`, its batch not committed.
2. **Blob.** Delete every object under the shard's prefix (parts, rollups,
   parts staged but never committed), in batches. The fence still holds the
   name, so no new shard of that name can have written there yet.
3. **Tombstone.** Compare-and-set :data:`TOMBSTONE` on top of the fence: the
   shard is gone, and its name is free.
4. **Consensus.** Truncate every row below the tombstone.

The tombstone stays: a shard created again under the name is created on top
of it, so its SeqNos go on from the dropped shard's. A handle of the dropped
shard still holds a SeqNo of it; were SeqNos to start at 1 again, its
compare-and-set would land in the new shard once that one's head reached
the same SeqNo. Each creation also mints an incarnation id
(``ShardState.incarnation``), so a handle, listen or lease of the dropped
shard fails with ShardDropped instead of reading the new one.

A drop that crashed part way is finished by dropping again: it finds the
fence as the head and resumes at step 2 (or the tombstone, and truncates
what step 4 left). A writer still uploading parts while the shard is dropped
may leave objects behind after step 2 (no state names them; a shard created
again under the name sweeps them as orphans); stop writers before dropping.
"""

from __future__ import annotations

from dataclasses import dataclass

from .blob import Blob
from .consensus import CaSCommitted, Consensus, VersionedData
from .diff import FENCE, TOMBSTONE
from .errors import Indeterminate, ShardInUse, ShardNotFound
from .state import ShardState
from .versions import load_state

_ATTEMPTS = 10
"""Fencing retries when the shard keeps changing under the drop (each re-checks readers)."""


@dataclass(frozen=True)
class DropReport:
    """What :func:`drop_shard` deleted."""

    shard: str
    seqno: int
    """The SeqNo of the fence (the shard's last state was one before it)."""
    consensus_rows: int
    blob_objects: int
    blob_bytes: int
    readers: tuple[str, ...]
    """Readers that held the shard when it was dropped (only with ``force``)."""


def holders(state: ShardState, now_ms: int) -> tuple[str, ...]:
    """The readers holding ``state``'s shard: live leased readers, then critical readers. Pure."""
    leased = sorted(r for r, s in state.leased_readers.items() if s.expires_at_ms >= now_ms)
    return (*leased, *sorted(state.critical_readers))


def drop_shard(
    consensus: Consensus, blob: Blob, name: str, *, now_ms: int, force: bool = False
) -> DropReport:
    """Delete shard ``name`` from ``consensus`` and ``blob``; see the module doc.

    ShardNotFound if there is no such shard; ShardInUse, before anything is
    written, if readers hold it and ``force`` is not set.
    """
    fence, readers = _fence(consensus, blob, name, now_ms, force)
    keys = list(blob.list_keys(f"{name}/"))
    blob.delete_many(m.key for m in keys)
    tombstone = _bury(consensus, name, fence)
    rows = consensus.truncate(name, tombstone)
    return DropReport(name, fence, rows, len(keys), sum(m.size_bytes for m in keys), readers)


def _bury(consensus: Consensus, name: str, fence: int) -> int:
    """Put the tombstone on top of the fence at ``fence`` (or find it there); its SeqNo.

    Nothing but a tombstone can follow a fence, so any row found past the
    fence means an earlier attempt (or a concurrent drop) wrote it.
    """
    row = VersionedData(fence + 1, TOMBSTONE)
    for _ in range(_ATTEMPTS):
        if consensus.scan(name, row.seqno, limit=1):
            return row.seqno  # (or a shard created on it since, whose GC truncated it)
        try:
            if isinstance(consensus.compare_and_set(name, fence, row), CaSCommitted):
                return row.seqno
        except Indeterminate:
            continue  # the next look finds it if it landed
    raise Indeterminate(
        f"shard {name!r}: the drop could not tell whether its last Consensus row landed; its "
        "data is deleted: drop it again to finish"
    )


def _fence(
    consensus: Consensus, blob: Blob, name: str, now_ms: int, force: bool
) -> tuple[int, tuple[str, ...]]:
    """Append the fence row (or find it, from an earlier attempt); return its SeqNo and the
    readers that held the shard."""
    for _ in range(_ATTEMPTS):
        head = consensus.head(name)
        if head is None:
            raise ShardNotFound(f"shard {name!r} does not exist in consensus {consensus.uri}")
        if head.data == FENCE:
            return head.seqno, ()
        if head.data == TOMBSTONE:
            consensus.truncate(name, head.seqno)  # what a drop that died at step 4 left
            raise ShardNotFound(
                f"shard {name!r} does not exist in consensus {consensus.uri} (it was dropped)"
            )
        try:
            state = load_state(name, consensus, blob)
        except ShardNotFound:
            state = None  # fenced by another drop since our look: the next look finds it
        if state is None:
            continue
        held = holders(state, now_ms)
        if held and not force:
            raise ShardInUse(
                f"shard {name!r} is in use by reader(s) {', '.join(held)}: stop them (a leased "
                "reader's hold ends when its lease runs out), or force the drop and let them fail"
            )
        row = VersionedData(state.seqno + 1, FENCE)
        try:
            if isinstance(consensus.compare_and_set(name, state.seqno, row), CaSCommitted):
                return row.seqno, held
        except Indeterminate:
            continue  # the next look finds the fence if it landed
    raise ShardInUse(
        f"shard {name!r} changed {_ATTEMPTS} times while it was being fenced for the drop: "
        "stop its writers and readers, then drop it again"
    )
