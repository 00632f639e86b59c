"""Transactions across shards: :class:`Txn`, the shell that checks, stages, commits and retries.

::

    with client.txn(writer_id="etl", token=7) as t:
        t.append("orders", orders)
        t.append("order_items", items)
        t.upsert("customers", customers)

Every ``append``/``upsert``/``delete`` checks its rows against the shard
(schema, keys) at once and stages nothing: a bad table raises there, before
a byte is written. The commit (a clean exit of the block, or
:meth:`Txn.commit`) stages every shard's share, in parallel when there is
more than one sizeable share, then commits them all with one
compare-and-set of several keys (:func:`~.txn.plan_txn` computes the
diffs). A lost race re-reads the shards that moved and plans again (a keyed
share's upsert is re-planned only when its own shard's upper moved; every
other staged part stays); a lost reply (``Indeterminate``) is retried the
same way, and the writer's token in every participant tells whether the
earlier attempt landed. An exception inside the block commits nothing and
stages nothing. A commit that fails deletes what it staged where no attempt
can reference it: at once when no attempt's outcome is unknown, else after
a fence of each shard (:func:`~.write.abandon_staged`); whatever it cannot
prove unreferenced is left to GC's orphan sweep.

Writers that stage in other processes (Spark's executors, for
``pyspark_persist.txn``) hand their staged batches to
:meth:`Txn.append_staged`: checked by the caller before staging, owned by the
transaction from then on (deleted as its own parts are when it fails or
lands nothing), and committed with the rest.

Shards that take no part pay nothing: their commits are single-key
compare-and-sets as before. The cost of the design is that every
participant must live in one Consensus store (they do: a client has one).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace
from types import TracebackType
from typing import Protocol

import pyarrow as pa

from . import retry
from .codec import ARROW, part_checksum
from .config import PersistConfig
from .consensus import CaSCommitted, CaSOp, Consensus, VersionedData
from .diff import encode
from .errors import Determinate, Indeterminate, InvalidUpdates, InvalidUsage, PersistError
from .machine import Machine
from .part_formats import new_part_key
from .schema import conform_updates, decode_schema
from .staging import BatchBuilder, StagedBatch, delete_staged
from .state import PartRef, ShardState, Time
from .txn import Replan, Share, TxnAlreadyCommitted, TxnPlan, commit_time, plan_txn
from .upsert import KnownRows, part_format, plan_attempt
from .upsert_input import UpsertWrite, prepare_delete, prepare_upsert
from .write import abandon_staged, check_staged, unreferenced

log = logging.getLogger(__name__)

_CONTENTION = retry.RetryPolicy(first_backoff_s=0.001, max_backoff_s=0.25)
"""Backoff between compare-and-set attempts (as a single shard's machine)."""


class Shards(Protocol):
    """Where a transaction's shards are: what it needs of a
    :class:`~.client.PersistClient` (which this module does not import: the client imports it)."""

    consensus: Consensus
    config: PersistConfig

    def machine(self, shard_id: str) -> Machine:
        """The machine of ``shard_id``."""
        ...


@dataclass
class _Member:
    """One shard's share while the transaction is built and committed."""

    machine: Machine
    tables: list[pa.Table] = field(default_factory=list)
    """Unkeyed appends, conformed to the shard's schema (staged at commit)."""
    prestaged: list[PartRef] = field(default_factory=list)
    """Unkeyed appends staged elsewhere (:meth:`Txn.append_staged`: Spark's executors)."""
    upsert: UpsertWrite | None = None
    """A keyed shard's one upsert or delete (planned and staged at commit)."""
    share: Share | None = None
    """What is staged for the next attempt."""
    known: KnownRows | None = None
    """A keyed share's lookup so far, caught up on a re-plan."""
    staged: list[PartRef] = field(default_factory=list)
    """Every part staged for this shard by any plan (superseded ones included)."""
    unknown_seqno: int = 0
    """The newest SeqNo an attempt with an unknown outcome tried to take here (0: none)."""


class Txn:
    """A transaction across shards of one client; see the module doc. Not thread-safe.

    ``writer_id`` and ``token`` make it idempotent as a plain write's are
    (:class:`~.write.WriteHandle`): a transaction resent with the same pair
    applies nothing. Without a token it is numbered at its commit under an
    identity of the committing thread's own (``<writer_id>.auto-<random>``:
    one writer entry per thread, not per transaction, so shards' writer maps
    stay small), and claims no idempotency across objects or restarts.
    """

    def __init__(self, client: Shards, writer_id: str | None, token: int | None) -> None:
        if token is not None and token < 0:
            raise InvalidUsage(f"transaction token {token} must be 0 or more")
        self._client = client
        self.writer_id = writer_id or "txn"
        """Who commits: ``writer_id``, or without a token the automatic identity (at commit)."""
        self.token = token
        """The idempotency token (without one given: the automatic one, at commit)."""
        self.txn_id = uuid.uuid4().hex[:16]
        """This transaction's id: recorded on its commit in every shard it writes."""
        self._members: dict[str, _Member] = {}
        self._done = False
        self.already_committed = False
        """Set by :meth:`commit` when the token had landed before (nothing was applied)."""
        self.commit_time: Time | None = None
        """What :meth:`commit` returned (for a transaction committed by its ``with`` block)."""

    def __enter__(self) -> Txn:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None and not self._done:
            self.commit()
            return
        if not self._done:
            # No commit was attempted: only parts staged elsewhere exist, and no state can
            # reference them, so they go at once.
            for m in self._members.values():
                _delete(m.machine, m.prestaged)
        self._done = True

    def _member(self, shard: str) -> _Member:
        """``shard``'s share so far, or a new one (joined by :meth:`_join` once its rows
        passed their checks); ShardNotFound or ShardDropped now, not at the commit."""
        if self._done:
            raise InvalidUsage("this transaction already committed or failed: start a new one")
        member = self._members.get(shard)
        if member is None:
            member = _Member(self._client.machine(shard))
            member.machine.state()
        return member

    def _join(self, shard: str, member: _Member) -> None:
        self._members.setdefault(shard, member)

    def append(self, shard: str, updates: pa.Table | pa.RecordBatch) -> None:
        """Add ``updates`` (the shard's columns; ``_diff`` optional, no ``_time``: the commit
        assigns it) to ``shard``'s share. On a keyed shard this is :meth:`upsert`."""
        member = self._member(shard)
        state = member.machine.state()
        if state.keys:
            self.upsert(shard, updates)
            return
        schema = decode_schema(state.schema)
        table, has_time = conform_updates(updates, schema, shard)
        if has_time:
            raise InvalidUpdates(
                f"the transaction's append to shard {shard!r} has a _time column: the commit "
                "assigns one time to every shard's updates, drop the column"
            )
        member.tables.append(table)
        self._join(shard, member)

    def append_staged(self, shard: str, batches: Sequence[StagedBatch]) -> None:
        """Add batches staged elsewhere to unkeyed ``shard``'s share; the transaction owns
        their parts from here on (deleted as its own when it fails or commits nothing).

        For writers that stage in other processes, as Spark's executors do
        (``pyspark_persist.txn``): each batch must have been staged against
        the shard's current schema, which the caller checked before staging,
        and without times (the commit assigns ``T``). No batches at all still
        makes ``shard`` a participant: its token is recorded, and its upper
        moves to ``T + 1``.
        """
        member = self._member(shard)
        state = member.machine.state()
        parts = [p for b in batches for p in b.parts]
        if state.keys:
            _delete(member.machine, parts)
            raise InvalidUsage(
                f"shard {shard!r} is keyed by {list(state.keys)}: staged batches cannot be "
                "appended to it; give its rows to upsert() or delete()"
            )
        timed = [b.shard_id for b in batches if b.has_time or b.shard_id != shard]
        if timed:
            _delete(member.machine, parts)
            raise InvalidUsage(
                f"batches staged for the transaction's shard {shard!r} must be staged for it "
                f"and carry no _time (the commit assigns one), got {timed[0]!r} batches that do "
                "not; stage them again"
            )
        member.prestaged.extend(parts)
        member.staged.extend(parts)
        self._join(shard, member)

    def upsert(
        self,
        shard: str,
        rows: pa.Table | pa.RecordBatch,
        *,
        sequence_column: str | None = None,
        delete_column: str | None = None,
    ) -> None:
        """Upsert ``rows`` into keyed ``shard`` at the transaction's time (as
        :meth:`~.write.WriteHandle.upsert`); one upsert or delete per shard per transaction."""
        member = self._member(shard)
        write = prepare_upsert(
            member.machine, rows, sequence=sequence_column, delete_column=delete_column
        )
        self._set_upsert(shard, member, write)
        self._join(shard, member)

    def delete(
        self, shard: str, keys: pa.Table | pa.RecordBatch, *, sequence_column: str | None = None
    ) -> None:
        """Delete the rows of ``keys`` from keyed ``shard`` at the transaction's time (as
        :meth:`~.write.WriteHandle.delete`)."""
        member = self._member(shard)
        self._set_upsert(shard, member, prepare_delete(member.machine, keys, sequence_column))
        self._join(shard, member)

    @staticmethod
    def _set_upsert(shard: str, member: _Member, write: UpsertWrite) -> None:
        if member.upsert is not None:
            raise InvalidUsage(
                f"the transaction already upserts or deletes in keyed shard {shard!r}: give "
                "all of its rows to one upsert (the last row of a key wins), deletes through "
                "its delete_column"
            )
        member.upsert = write

    def commit(self) -> Time | None:
        """Stage every share and commit them all at one time; return that time.

        ``None`` (and :attr:`already_committed` set) when the writer's token
        had landed before and the time is unknown to this call: a later token
        of the writer committed since. A resend right after an unknown
        outcome gets the time the first attempt committed at.
        """
        if self._done:
            raise InvalidUsage("this transaction already committed or failed: start a new one")
        if not self._members:
            raise InvalidUsage("the transaction names no shard: append or upsert first")
        self._done = True
        if self.token is None:
            self.writer_id, self.token = _auto_identity(self.writer_id)
        try:
            with retry.deadline_in(self._client.config.retry_timeout_s) as deadline:
                outcome = self._commit(deadline)
        except Determinate as e:
            self._give_up()
            if not any(m.unknown_seqno for m in self._members.values()):
                raise
            # An earlier attempt may have landed: a "surely did not happen" error would lie.
            raise Indeterminate(
                f"transaction {self.txn_id}: the outcome is unknown: a commit attempt lost its "
                f"reply and may have landed, and finding out failed: {e}. Resend it with the "
                "same writer id and token to learn whether it did"
            ) from e
        except BaseException:
            self._give_up()
            raise
        self.already_committed = isinstance(outcome, TxnAlreadyCommitted)
        self._clean_up(landed=not self.already_committed)
        self.commit_time = outcome.time
        return outcome.time

    def _commit(self, deadline: float) -> TxnPlan | TxnAlreadyCommitted:
        members = self._members
        assert self.token is not None
        self._stage_appends()
        states = {s: m.machine.state() for s, m in members.items()}
        backoff = retry.Backoff(_CONTENTION)
        mismatches = 0
        fresh = False
        while True:
            now = next(iter(members.values())).machine.clock_ms()
            t = commit_time(states, now)
            try:
                outcome = plan_txn(
                    states,
                    {s: m.share or Share(s) for s, m in members.items()},
                    writer_id=self.writer_id,
                    token=self.token,
                    txn_id=self.txn_id,
                    time=t,
                    now_ms=now,
                )
            except InvalidUsage:
                if fresh:
                    raise
                # The token in some states only may be the cache's doing: a resend after a
                # lost reply whose commit landed, with some of the cached states older than
                # it. Read every participant again before refusing.
                states = {s: m.machine.refetch() for s, m in members.items()}
                fresh = True
                continue
            if isinstance(outcome, TxnAlreadyCommitted):
                return outcome
            if isinstance(outcome, Replan):
                for s in outcome.shards:
                    states[s] = self._plan_upsert(members[s], states[s])
                continue
            for m in members.values():
                if m.share is not None:
                    check_staged(m.machine, [*m.share.parts, *m.share.tombstones])
            rows = {
                s: VersionedData(diff.to_seqno, encode(diff)) for s, diff in outcome.diffs.items()
            }
            ops: list[CaSOp] = [(s, states[s].seqno, rows[s]) for s in sorted(rows)]
            try:
                res = self._client.consensus.compare_and_set_many(ops)
            except (Indeterminate, Determinate) as e:
                if isinstance(e, Indeterminate):
                    for s, row in rows.items():
                        members[s].unknown_seqno = max(members[s].unknown_seqno, row.seqno)
                elif not retry.is_transient(e):
                    raise
                if time.monotonic() > deadline:
                    raise
                log.debug("transaction %s: commit failed (%s); retrying", self.txn_id, e)
                backoff.sleep(deadline)
                states = {s: m.machine.refetch() for s, m in members.items()}
                continue
            if isinstance(res, CaSCommitted):
                # Every participant announced (readers woken, PubSub pushed) before any
                # rollup or maintenance: a reader of the last shard waits on none of them.
                afters = {s: states[s].apply(outcome.diffs[s]) for s in members}
                for s, m in members.items():
                    m.machine.announce(afters[s], rows[s])
                for s, m in members.items():
                    m.machine.follow_up(states[s], afters[s])
                return outcome
            mismatches += 1
            if mismatches > 2:
                backoff.sleep(deadline)
            for s, head in (res.moved or dict.fromkeys(members, -1)).items():
                machine = members[s].machine
                if head is not None and 0 <= head <= states[s].seqno:
                    # Consensus is not ahead of what we held: our state was never its.
                    states[s] = machine.reload()
                else:
                    states[s] = machine.refetch()

    def _stage_appends(self) -> None:
        """Stage every unkeyed share's tables (in parallel when more than one is sizeable),
        and plan and stage every keyed share's upsert against its shard's state."""
        members = self._members
        cfg = self._client.config
        for m in members.values():
            if m.upsert is not None:
                self._plan_upsert(m, m.machine.state())
        todo = [m for m in members.values() if m.upsert is None and m.tables]
        big = [m for m in todo if sum(t.nbytes for t in m.tables) > cfg.inline_write_max_bytes]
        if len(big) > 1:
            with ThreadPoolExecutor(min(len(big), 8)) as pool:
                list(pool.map(self._stage_tables, big))
        for m in todo:
            if m.share is None:
                self._stage_tables(m)
        for m in members.values():
            if m.upsert is None and m.share is None:
                m.share = Share(m.machine.shard_id)
            if m.prestaged:
                assert m.share is not None
                m.share = dc_replace(m.share, parts=m.share.parts + self._fit_inline(m))

    def _fit_inline(self, member: _Member) -> tuple[PartRef, ...]:
        """The parts staged elsewhere, their inline ones written to Blob first when the
        shard's state cannot take them too (as :meth:`~.write.WriteHandle.fit_inline`)."""
        machine = member.machine
        share = member.share
        assert share is not None
        held = machine.state().inline_bytes + sum(
            p.size_bytes for p in share.parts if p.inline is not None
        )
        inline = sum(p.size_bytes for p in member.prestaged if p.inline is not None)
        if held + inline <= machine.config.inline_total_max_bytes:
            return tuple(member.prestaged)
        parts = []
        for p in member.prestaged:
            if p.inline is not None:
                key = new_part_key(machine.shard_id, ARROW)
                machine.blob.set(key, p.inline)
                p = dc_replace(p, key=key, inline=None, crc=part_checksum(p.inline), fmt=ARROW)
                member.staged.append(p)
            parts.append(p)
        return tuple(parts)

    def _stage_tables(self, member: _Member) -> None:
        machine = member.machine
        state = machine.state()
        builder = _builder(machine, state, decode_schema(state.schema))
        try:
            for table in member.tables:
                builder.add_conformed(table, False)
            staged = builder.finish()
        except BaseException:
            builder.abort()
            raise
        member.staged.extend(staged.parts)
        member.share = Share(machine.shard_id, staged.parts)

    def _plan_upsert(self, member: _Member, state: ShardState) -> ShardState:
        """Plan (again) a keyed share against ``state`` and stage it; the state planned on."""
        write = member.upsert
        assert write is not None
        machine = member.machine
        state, member.known, attempt = plan_attempt(machine, write, state, member.known)
        member.staged.extend(attempt.tombstones)
        builder = _builder(machine, state, attempt.schema)
        try:
            builder.add_conformed(attempt.updates, True)
            staged = builder.finish()
        except BaseException:
            builder.abort()
            raise
        member.staged.extend(staged.parts)
        member.share = Share(machine.shard_id, staged.parts, attempt.tombstones, attempt.upper)
        return state

    def _clean_up(self, *, landed: bool) -> None:
        """After the transaction landed (or had landed before), delete the staged parts no
        commit references: a landed commit references exactly its last plan's parts; when the
        token had landed earlier, by an attempt with an unknown outcome, which plan it used
        is read from Consensus."""
        for m in self._members.values():
            share = m.share if landed else None
            current = set() if share is None else {p.key for p in share.parts + share.tombstones}
            extra = [p for p in m.staged if p.key is not None and p.key not in current]
            if m.unknown_seqno and not landed:
                extra = unreferenced(m.machine, extra, after_seqno=m.unknown_seqno)
            _delete(m.machine, extra)

    def _give_up(self) -> None:
        """After a failed commit: delete what was staged, where no attempt can have landed."""
        for m in self._members.values():
            if not m.staged:
                continue
            if m.unknown_seqno:
                abandon_staged(m.machine, m.staged)
            else:
                _delete(m.machine, m.staged)


_AUTO = threading.local()
"""Per thread: the automatic identity of each writer id, and its last token."""


def _auto_identity(writer_id: str) -> tuple[str, int]:
    """The committing thread's automatic identity under ``writer_id`` and its next token.

    Per thread, because a thread commits one transaction after another, so its
    tokens land in the order they are drawn (two threads drawing from one
    counter could land 6 before 5, and 5 would then be taken for a resend).
    """
    idents: dict[str, tuple[str, int]] = _AUTO.__dict__.setdefault("idents", {})
    name, last = idents.get(writer_id) or (f"{writer_id}.auto-{uuid.uuid4().hex[:16]}", 0)
    idents[writer_id] = (name, last + 1)
    return name, last + 1


def _builder(machine: Machine, state: ShardState, schema: pa.Schema) -> BatchBuilder:
    """A builder for one share's parts (inline within the shard's inline budget)."""
    cfg = machine.config
    return BatchBuilder(
        machine.blob,
        machine.shard_id,
        schema,
        cfg,
        inline_budget=cfg.inline_total_max_bytes - state.inline_bytes,
        part_format=part_format(state),
    )


def _delete(machine: Machine, parts: list[PartRef]) -> None:
    """Delete staged parts that surely no commit references; a failure leaves them to GC."""
    try:
        delete_staged(machine.blob, parts)
    except PersistError as e:
        log.info("shard %s: kept %s staged parts for GC: %s", machine.shard_id, len(parts), e)
