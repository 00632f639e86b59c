"""A shard's past, replayed from the state diffs Consensus still holds.

Consensus keeps one row per SeqNo, each the :class:`StateDiff` a command
made. GC truncates the rows below the oldest SeqNo any reader may still
fetch, first writing the full state at that SeqNo to Blob as a rollup. So
what is kept is: the state at the oldest live SeqNo (its rollup, or the
empty state when nothing was ever truncated) and every diff after it. That is
exactly what :func:`replay` returns; states and commits before it are gone
(their data is still in the shard, compacted, but not which commit wrote it).

Delta users name a point in a table's past by version; persist's version is
the SeqNo, and :func:`state_at` turns one into the state (and so the upper:
the changes committed up to it) it names.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from .blob import Blob
from .consensus import Consensus
from .diff import StateDiff, decode
from .errors import CorruptData, InvalidFrontier, ShardNotFound
from .state import EMPTY_STATE, ShardState
from .versions import rollup_key


@dataclass(frozen=True)
class Step:
    """One SeqNo of the shard's past: the diff that made it, and the states around it."""

    diff: StateDiff
    before: ShardState
    after: ShardState

    @property
    def seqno(self) -> int:
        """The SeqNo this step produced."""
        return self.after.seqno


@dataclass(frozen=True)
class Replay:
    """The oldest state Consensus (with its rollup) still describes, and every step after it."""

    base: ShardState
    steps: tuple[Step, ...]

    @property
    def head(self) -> ShardState:
        """The newest state."""
        return self.steps[-1].after if self.steps else self.base

    def __iter__(self) -> Iterator[Step]:
        return iter(self.steps)


def replay(shard_id: str, consensus: Consensus, blob: Blob) -> Replay:
    """Every state diff Consensus still holds for ``shard_id``, applied in order.

    Retries when GC truncates (and deletes the rollup) between the scan and the
    rollup read, as :func:`~pyspark_persist.state.versions.load_state` does.
    """
    for _ in range(10):
        rows = consensus.scan(shard_id, 0)
        if not rows:
            raise ShardNotFound(f"shard {shard_id!r} does not exist in consensus {consensus.uri}")
        first = rows[0]
        if first.seqno == 1:
            base, todo = EMPTY_STATE, rows
        else:
            data = blob.get(rollup_key(shard_id, first.seqno))
            if data is None:
                continue  # truncated past ``first`` meanwhile: scan again
            base = EMPTY_STATE.apply(decode(data, where=f"rollup of {shard_id!r}"))
            todo = rows[1:]
        steps = []
        state = base
        for row in todo:
            diff = decode(row.data, where=f"consensus row {shard_id!r} SeqNo {row.seqno}")
            after = state.apply(diff)
            steps.append(Step(diff, state, after))
            state = after
        return Replay(base, tuple(steps))
    raise CorruptData(
        f"shard {shard_id!r}: the oldest Consensus row keeps changing and has no rollup in Blob"
    )


def state_at(past: Replay, seqno: int, what: str) -> ShardState:
    """The state at ``seqno``; InvalidFrontier naming the SeqNos kept when it is not among them."""
    head = past.head
    if past.base.seqno <= seqno <= head.seqno:
        if seqno == past.base.seqno:
            return past.base
        return past.steps[seqno - past.base.seqno - 1].after
    side = (
        f"older than the oldest SeqNo kept, {past.base.seqno} (GC truncated the ones before)"
        if seqno < past.base.seqno
        else f"not written yet (the newest is {head.seqno})"
    )
    raise InvalidFrontier(
        f"{what}: SeqNo {seqno} of shard {head.shard_id!r} is {side}; the SeqNos kept are "
        f"[{past.base.seqno}, {head.seqno}]"
    )
