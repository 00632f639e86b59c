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

:func:`history` reads the commits out of those steps (Delta's ``DESCRIBE
HISTORY``): each SeqNo that changed the data, with its operation
(``create``, ``append``, ``overwrite``, ``compaction``), the writer and its
wall-clock commit time (recorded with the writer's idempotency token), the
time range ``[lower, upper)`` it covers, and the rows and bytes it added and
retracted, from the parts' sizes and diff bounds. Reader registrations,
heartbeats, since moves, rollups and GC claims are SeqNos too, but change no
data and are left out.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from .blob import Blob
from .consensus import Consensus
from .diff import TOMBSTONE, decode
from .errors import CorruptData, InvalidFrontier, ShardNotFound
from .schema import decode_schema
from .state import Batch, PartRef, ShardState, StateDiff
from .versions import history_start


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
        if not rows or rows[-1].data == TOMBSTONE:
            raise ShardNotFound(f"shard {shard_id!r} does not exist in consensus {consensus.uri}")
        start = history_start(shard_id, rows, blob)
        if start is None:
            continue  # truncated past the oldest row meanwhile: scan again
        base, todo, _ = start
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


@dataclass(frozen=True)
class Commit:
    """One data-changing SeqNo of a shard's history (see the module doc).

    ``rows_added``/``bytes_added`` count parts whose diffs are all positive,
    ``rows_retracted``/``bytes_retracted`` parts whose diffs are all negative
    (an overwrite's negated references, a retraction write); a part holding
    both counts under ``rows_mixed``/``bytes_mixed``, since telling them apart
    would mean reading it. A compaction adds and retracts nothing: it rewrites
    ``rows_before`` updates of the batches it merged as ``rows_after``.
    """

    seqno: int
    operation: str
    committed_ms: int | None
    writer_id: str | None
    lower: int
    upper: int
    parts: int
    rows_added: int = 0
    bytes_added: int = 0
    rows_retracted: int = 0
    bytes_retracted: int = 0
    rows_mixed: int = 0
    bytes_mixed: int = 0
    rows_before: int = 0
    rows_after: int = 0
    columns_added: str | None = None
    """The columns a merge-schema write added, comma-separated (None: the schema stayed)."""
    txn_id: str | None = None
    """The transaction across shards this commit was one shard's share of (None: a plain
    write); the same id, at the same time, is on a commit of every shard it wrote."""

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (for JSON, a DataFrame row)."""
        return asdict(self)


def _sign(p: PartRef) -> int:
    """+1 when every diff in ``p`` (as read) is positive, -1 when every one is negative, else 0."""
    lo, hi = p.dmin, p.dmax
    if p.negate:
        lo, hi = (None if hi is None else -hi), (None if lo is None else -lo)
    if lo is not None and lo > 0:
        return 1
    if hi is not None and hi < 0:
        return -1
    return 1 if lo is None and hi is None else 0  # no bounds recorded: a plain insert write


def commit_of(step: Step) -> Commit | None:
    """The commit ``step`` made, or None when it changed no data (a pure function)."""
    before, after, diff = step.before, step.after, step.diff
    if not before.shard_id:  # the empty state a shard is created from (at SeqNo 0 or a tombstone)
        return Commit(step.seqno, "create", after.created_ms or None, None, 0, 0, 0)
    puts, dels = diff.maps.get("batches", ({}, frozenset()))
    if not puts and not dels:
        return None
    new: list[Batch] = [b for b in puts.values() if before.batches.get(b.key) != b]
    gone = [before.batches[k] for k in dels if k in before.batches]
    writers = diff.maps.get("writers", ({}, frozenset()))[0]
    writer_id, committed, txn_id = None, None, None
    for wid, w in writers.items():
        writer_id, committed = str(wid), w.last_heartbeat_ms
        txn_id = None if w.txn is None else w.txn.txn_id
    if after.upper == before.upper:
        lower = min(b.lower for b in gone) if gone else min(b.lower for b in new)
        upper = max(b.upper for b in gone) if gone else max(b.upper for b in new)
        return Commit(
            step.seqno,
            "compaction",
            committed,
            writer_id,
            lower,
            upper,
            sum(len(b.parts) for b in new),
            rows_before=sum(b.rows for b in gone),
            rows_after=sum(b.rows for b in new),
        )
    columns = None
    if after.schema != before.schema:
        old = set(decode_schema(before.schema).names)
        columns = ",".join(n for n in decode_schema(after.schema).names if n not in old)
    added = [p for b in new if b.lower >= before.upper for p in b.parts]
    sums = {1: [0, 0], -1: [0, 0], 0: [0, 0]}
    for p in added:
        sums[_sign(p)][0] += p.rows
        sums[_sign(p)][1] += p.size_bytes
    return Commit(
        step.seqno,
        "overwrite" if any(p.negate for p in added) else "append",
        committed,
        writer_id,
        before.upper,
        after.upper,
        len(added),
        rows_added=sums[1][0],
        bytes_added=sums[1][1],
        rows_retracted=sums[-1][0],
        bytes_retracted=sums[-1][1],
        rows_mixed=sums[0][0],
        bytes_mixed=sums[0][1],
        columns_added=columns,
        txn_id=txn_id,
    )


def history(past: Replay) -> list[Commit]:
    """Every commit among the kept steps, oldest first."""
    return [c for c in (commit_of(step) for step in past) if c is not None]
