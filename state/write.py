"""Committing a write: staged batches made visible with one compare_and_append, and cleanup.

A write has two halves that may run in different processes. Staging
(:mod:`.staging`) uploads parts anywhere, invisibly, and yields
:class:`~.staging.StagedBatch` values. The commit,
:meth:`WriteHandle.compare_and_append_batches`, makes any number of staged
batches visible in one state change, iff the shard's upper is still the
expected one. A retry after an unknown outcome, or a replay of the same
token, is answered :class:`~pyspark_persist.state.commands.AlreadyCommitted`
and applies nothing.

Parts that were staged but never committed are invisible. A commit refused
for good deletes them, and so does ``abort``, but only where no state
references them and no attempt with an unknown outcome (a lost reply, an
attempt still in flight) can land any more (:func:`abandon_staged`);
whatever that cannot prove, and whatever a crash left, GC's orphan sweep
deletes once it is older than ``staged_part_grace_s``. Every attempt that
would reference staged parts first checks they are still there and safe
from that sweep (:func:`check_staged`).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import replace as dc_replace

import pyarrow as pa

from . import commands
from .codec import ARROW, part_checksum
from .commands import AlreadyCommitted, AppendResult, Committed, UpperMismatch
from .diff import decode
from .errors import (
    InvalidFrontier,
    InvalidUpdates,
    InvalidUsage,
    PersistError,
    SchemaMismatch,
    StagedPartsExpired,
)
from .machine import Machine, RunInfo
from .part_formats import new_part_key
from .schema import MAX_TIME, RESERVED, conform_updates, decode_schema, encode_schema, evolve_schema
from .staging import BatchBuilder, StagedBatch, delete_staged
from .state import PartRef, ShardState, Time
from .stats import time_bounds
from .tracing import traced
from .upsert import UpsertAttempt, UpsertCommit, part_format, refuse_keyed, run_upsert
from .upsert_input import prepare_delete, prepare_upsert
from .versions import read_history

log = logging.getLogger(__name__)


def check_staged(machine: Machine, parts: Sequence[PartRef]) -> None:
    """Raise StagedPartsExpired unless every Blob part exists and is safe from the orphan sweep.

    One batched metadata request (``Blob.stat_many``), made before every
    compare-and-set attempt that would reference the parts. The sweep deletes
    unreferenced parts ``staged_part_grace_s`` after the store wrote them;
    refusing parts older than half of that (by this process's clock against
    the store's timestamp) leaves the other half for the attempt to land
    (within ``retry_timeout_s``, which PersistConfig keeps below half the
    grace) and for clock skew, so a commit never references a part the sweep
    may delete meanwhile.
    """
    keys = [p.key for p in parts if p.key is not None]
    if not keys:
        return
    found = machine.blob.stat_many(keys)
    missing = [k for k in keys if k not in found]
    limit_ms = machine.config.staged_part_grace_s * 500
    now = machine.clock_ms()
    stale = [
        k for k, m in found.items() if m.modified_ms is not None and now - m.modified_ms >= limit_ms
    ]
    if missing or stale:
        what = f"{len(missing)} missing" if missing else f"{len(stale)} staged over half"
        example = (missing or stale)[0]
        raise StagedPartsExpired(
            f"cannot commit to shard {machine.shard_id!r}: {what} of the staged parts "
            f"(e.g. {example!r}) in blob {machine.blob.uri} are gone or about to be swept "
            f"(staged_part_grace_s={machine.config.staged_part_grace_s:g}); nothing was "
            "committed: stage the updates again and commit within the grace period"
        )


class WriteHandle:
    """Appends to one shard; exactly once per idempotency token the caller passes.

    Idempotency is explicit. A commit given ``token=`` is recorded under
    ``writer_id``, whose tokens only go up: the same (or a lower) token again
    is answered AlreadyCommitted and applies nothing, so a caller that resends
    a write after a crash or an error passes the token it used the first time
    (the Spark sink passes the micro-batch id). Which data a token stands for
    is the caller's promise: two handles, or two processes, that give one
    ``writer_id`` and token to different data lose the second.

    A commit without a token is numbered by this handle under an identity of
    its own (``<writer_id>.auto-<random>``), never shared with another handle:
    two live handles of one ``writer_id`` cannot drop each other's writes, and
    the machine's retry after a lost reply still finds its own commit. Such
    writes claim no idempotency across handles or restarts: resending one
    through a new handle applies it again. A token is spent as soon as a
    commit is attempted, so after an unknown outcome (Indeterminate) the next
    write never reuses it for different data.
    """

    def __init__(self, machine: Machine, writer_id: str | None) -> None:
        self._machine = machine
        self.writer_id = writer_id or f"w-{uuid.uuid4().hex}"
        self._auto_id = f"{self.writer_id}.auto-{uuid.uuid4().hex[:16]}"
        self._next_token = 1
        self._token_lock = threading.Lock()

    @property
    def shard_id(self) -> str:
        """The shard this handle writes."""
        return self._machine.shard_id

    @property
    def schema(self) -> pa.Schema:
        """The shard's schema as this process last saw it (a merge-schema write may add to it)."""
        return decode_schema(self._machine.state().schema)

    def _write_schema(self, updates: pa.Table | pa.RecordBatch, merge_schema: bool) -> pa.Schema:
        """The schema to stage ``updates`` with: the shard's, plus their new columns if merging.

        Incompatible changes raise here, before anything is staged.
        """
        if not merge_schema:
            return self.schema
        if not isinstance(updates, pa.Table | pa.RecordBatch):
            raise InvalidUpdates(
                f"updates must be a pyarrow.Table or RecordBatch, got {type(updates).__name__}"
            )
        rows = pa.schema([f for f in updates.schema if f.name not in RESERVED])
        return evolve_schema(self.schema, rows, self.shard_id, "write with merge_schema=True")

    @property
    def upper(self) -> Time:
        """The shard's upper as this process last saw it (may be stale; a commit says the truth)."""
        return self._machine.state().upper

    @traced("WriteHandle.fetch_upper")
    def fetch_upper(self) -> Time:
        """The shard's upper, read from Consensus now."""
        return self._machine.fetch_latest().upper

    def _stage(self, table: pa.Table, has_time: bool, schema: pa.Schema) -> StagedBatch:
        """Stage conformed updates in one batch; delete what was uploaded if that fails."""
        builder = self.builder(schema)
        try:
            builder.add_conformed(table, has_time)
            return builder.finish()
        except BaseException:
            builder.abort()
            raise

    def builder(self, schema: pa.Schema | None = None) -> BatchBuilder:
        """A builder to stage parts of this shard (possibly from another thread).

        ``schema``: the columns to stage (default the shard's); commit parts
        staged with added columns with ``compare_and_append_batches(schema=...)``.
        Tiny writes ride inline in state only while the inline data there
        stays within ``inline_total_max_bytes`` (which bounds rollups too).
        A keyed shard's parts are Arrow (see :func:`~.upsert.part_format`).
        """
        cfg, state = self._machine.config, self._machine.state()
        return BatchBuilder(
            self._machine.blob,
            self.shard_id,
            self.schema if schema is None else schema,
            cfg,
            inline_budget=cfg.inline_total_max_bytes - state.inline_bytes,
            part_format=part_format(state),
        )

    @traced("WriteHandle.fit_inline")
    def fit_inline(self, batches: Sequence[StagedBatch]) -> list[StagedBatch]:
        """``batches``, with their inline parts written to Blob first if state cannot take them.

        Parts staged inline elsewhere (tiny Spark sink tasks, which cannot see
        state) ride in the commit's state diff only while the inline data in
        state stays within ``inline_total_max_bytes``, as :meth:`builder`'s do;
        past it, each becomes an Arrow part in Blob (the inline bytes are one
        already) before the commit references it. Nothing is visible until
        the commit; a part written here and never committed is an orphan GC sweeps.
        """
        inline = sum(p.size_bytes for b in batches for p in b.parts if p.inline is not None)
        cap = self._machine.config.inline_total_max_bytes
        if not inline or self._machine.state().inline_bytes + inline <= cap:
            return list(batches)
        return [
            dc_replace(b, parts=tuple(self._inline_to_blob(p) for p in b.parts)) for b in batches
        ]

    def _inline_to_blob(self, part: PartRef) -> PartRef:
        if part.inline is None:
            return part
        key = new_part_key(self.shard_id, ARROW)
        self._machine.blob.set(key, part.inline)
        return dc_replace(part, key=key, inline=None, crc=part_checksum(part.inline), fmt=ARROW)

    @traced("WriteHandle.compare_and_append")
    def compare_and_append(
        self,
        updates: pa.Table | pa.RecordBatch,
        expected_upper: Time,
        new_upper: Time,
        *,
        token: int | None = None,
        merge_schema: bool = False,
    ) -> AppendResult:
        """Append ``updates`` iff the upper is ``expected_upper``; advance it to ``new_upper``.

        Every update's ``_time`` must lie in ``[expected_upper, new_upper)``;
        without a ``_time`` column every update gets ``expected_upper``.
        ``_diff`` defaults to +1. Returns Committed, UpperMismatch (with the
        actual upper; nothing written) or AlreadyCommitted (a retry).
        ``merge_schema`` (Delta's mergeSchema): columns the shard lacks are
        added to its schema by the same commit (nullable ones only; older
        rows read null there), and shard columns the updates lack are null.
        """
        _check_uppers(expected_upper, new_upper)
        refuse_keyed(self._machine.state(), "compare_and_append() of chosen updates")
        schema = self._write_schema(updates, merge_schema)
        table, has_time = conform_updates(updates, schema, self.shard_id, fill_missing=merge_schema)
        if has_time and table.num_rows:
            tmin, tmax = time_bounds(table)
            if tmin < expected_upper or tmax >= new_upper:
                raise InvalidUpdates(
                    f"update times [{tmin}, {tmax}] of shard {self.shard_id!r} fall outside the "
                    f"batch [{expected_upper}, {new_upper}): give every update a _time in "
                    "that range"
                )
        staged = self._stage(table, has_time, schema)
        writer, tok = self._identity(token)
        return self._append_batches(
            [staged],
            expected_upper,
            new_upper,
            writer,
            tok,
            None if staged.has_time else expected_upper,
            True,
            False,
            encode_schema(schema) if merge_schema else None,
            RunInfo(),
            staged_here=True,
        )

    def compare_and_append_batches(
        self,
        batches: Sequence[StagedBatch],
        expected_upper: Time,
        new_upper: Time,
        *,
        token: int | None = None,
        ts_rewrite: Time | None = None,
        delete_on_mismatch: bool = True,
        replace: bool = False,
        schema: pa.Schema | None = None,
    ) -> AppendResult:
        """Commit staged batches as one batch ``[expected_upper, new_upper)`` in one state change.

        ``token``: see the class doc. ``ts_rewrite`` gives parts staged
        without times their time (every time is read as at least it). A
        commit refused (UpperMismatch, SchemaMismatch) gives its parts up,
        unless ``delete_on_mismatch`` is False (a caller that will retry the
        same staged batches at a new upper): they may be a resend's, whose
        earlier attempt landed or is still in flight, so they go through
        :func:`abandon_staged` (a fence, one history read), which deletes
        only what no commit can reference. With ``replace`` the commit
        atomically retracts the shard's current contents too, so afterwards
        it holds exactly these batches. ``schema``, the schema the batches
        were staged with, adds the columns the shard lacks to its schema in
        the same state change (see :func:`~pyspark_persist.state.commands.compare_and_append`).
        """
        writer, tok = self._identity(token)
        return self._append_batches(
            batches,
            expected_upper,
            new_upper,
            writer,
            tok,
            ts_rewrite,
            delete_on_mismatch,
            replace,
            None if schema is None else encode_schema(schema),
            RunInfo(),
            staged_here=False,
        )

    @traced("WriteHandle.upsert")
    def upsert(
        self,
        rows: pa.Table | pa.RecordBatch,
        *,
        token: int | None = None,
        sequence_column: str | None = None,
        delete_column: str | None = None,
    ) -> Committed | AlreadyCommitted:
        """Upsert ``rows`` into a keyed shard: each key's current row (if any) is retracted and
        its new row inserted, at one commit time; at most one row per key at every time.

        Within ``rows`` the last row of a key wins, or with ``sequence_column``
        the highest sequence (ties: the later row), within and across writes:
        a row older than its key's current one (or than its delete) is ignored.
        ``delete_column`` names a boolean column whose true rows delete their
        key (it is not stored). Races with other writers are retried against
        the new state; ``token`` makes a resend apply nothing (see the class doc).
        Bad keys (missing, another type, null) raise before anything is staged.
        """
        m = self._machine
        write = prepare_upsert(m, rows, sequence=sequence_column, delete_column=delete_column)
        return run_upsert(m, write, self._upsert_commit(token))

    @traced("WriteHandle.delete")
    def delete(
        self,
        keys: pa.Table | pa.RecordBatch,
        *,
        token: int | None = None,
        sequence_column: str | None = None,
    ) -> Committed | AlreadyCommitted:
        """Delete the rows of the keys in ``keys`` (a table of the key columns) from a keyed shard,
        at one commit time. With ``sequence_column`` (a column of ``keys`` too) a delete older
        than its key's current row is ignored, and a later upsert older than the delete does
        not bring the key back (see :meth:`upsert`)."""
        write = prepare_delete(self._machine, keys, sequence_column)
        return run_upsert(self._machine, write, self._upsert_commit(token))

    def _upsert_commit(self, token: int | None) -> UpsertCommit:
        """How an upsert commits each attempt: its updates staged, then compare_and_append
        with one token for every attempt."""
        writer, tok = self._identity(token)

        def commit(attempt: UpsertAttempt) -> AppendResult:
            staged = [self._stage(attempt.updates, True, attempt.schema)]
            args = (attempt.upper, attempt.new_upper, writer, tok, None, True, False, None)
            return self._append_batches(
                staged, *args, RunInfo(), staged_here=True, tombstones=attempt.tombstones
            )

        return commit

    def _identity(self, token: int | None) -> tuple[str, int]:
        """Who commits with which token: the caller's under ``writer_id``, else an automatic one.

        An automatic token is spent here, before the attempt (see the class doc).
        """
        if token is not None:
            return self.writer_id, token
        with self._token_lock:
            self._next_token += 1
            return self._auto_id, self._next_token - 1

    @traced("WriteHandle.compare_and_append_batches")
    def _append_batches(
        self,
        batches: Sequence[StagedBatch],
        expected_upper: Time,
        new_upper: Time,
        writer: str,
        token: int,
        ts_rewrite: Time | None,
        delete_on_mismatch: bool,
        replace: bool,
        schema: bytes | None,
        info: RunInfo,
        *,
        staged_here: bool,
        tombstones: tuple[PartRef, ...] = (),
    ) -> AppendResult:
        """compare_and_append_batches as ``writer`` with ``token``.

        ``info`` collects the attempts with unknown outcomes (across calls
        that commit the same staged parts, as :meth:`append`'s retries do).
        ``staged_here``: the parts were staged for this commit alone, so no
        attempt but those in ``info`` ever named them.
        """
        _check_uppers(expected_upper, new_upper)
        parts: list[PartRef] = []
        for b in batches:
            if b.shard_id != self.shard_id:
                raise InvalidUsage(
                    f"staged batch belongs to shard {b.shard_id!r}, not {self.shard_id!r}"
                )
            if not b.has_time and ts_rewrite is None and b.parts:
                raise InvalidUpdates(
                    "staged updates carry no _time: pass ts_rewrite (their commit time)"
                )
            for p in b.parts:
                part = p if ts_rewrite is None else _with_rewrite(p, ts_rewrite)
                if part.effective_min_time < expected_upper or part.effective_max_time >= new_upper:
                    raise InvalidUpdates(
                        f"update times [{part.effective_min_time}, {part.effective_max_time}] of "
                        f"shard {self.shard_id!r} fall outside the batch "
                        f"[{expected_upper}, {new_upper}): give every update a _time in "
                        "that range"
                    )
                parts.append(part)

        def append(s: ShardState) -> commands.Outcome[AppendResult]:
            outcome = commands.compare_and_append(
                s,
                parts=tuple(parts),
                expected_upper=expected_upper,
                new_upper=new_upper,
                writer_id=writer,
                token=token,
                now_ms=self._machine.clock_ms(),
                replace=replace,
                schema=schema,
                tombstones=tombstones,
            )
            if isinstance(outcome, commands.Apply):
                # Every attempt that will reference the parts checks them (the sweep may take
                # them while a store blip holds the commit back); a retry answered
                # AlreadyCommitted must not fail because GC moved on since.
                check_staged(self._machine, [*parts, *tombstones])
            return outcome

        try:
            result = self._machine.run(append, info=info)
        except SchemaMismatch:
            # A merge-schema commit that met a conflicting column can never land: its parts
            # go now (those an attempt with an unknown outcome did or may commit stay).
            self._give_up([*parts, *tombstones], info, staged_here)
            raise
        if isinstance(result, UpperMismatch) and delete_on_mismatch:
            self._give_up([*parts, *tombstones], info, staged_here)
        return result

    def _give_up(self, parts: Sequence[PartRef], info: RunInfo, staged_here: bool) -> None:
        """Delete the parts of a refused commit that no commit can reference.

        Parts staged for this commit alone were attempted only by the runs in
        ``info``; any other parts may be a resend's (see :func:`abandon_staged`).
        """
        if staged_here:
            delete_staged(self._machine.blob, never_committed(self._machine, parts, info))
        else:
            abandon_staged(self._machine, parts)

    @traced("WriteHandle.append")
    def append(
        self,
        updates: pa.Table | pa.RecordBatch,
        *,
        token: int | None = None,
        merge_schema: bool = False,
    ) -> Committed | AlreadyCommitted:
        """Append updates at one new time (the later of the upper and the wall clock, ms).

        Sugar over :meth:`compare_and_append_batches`: stages once, then
        commits at the current upper, retrying races with other writers with
        the same staged parts and the same token (the commit assigns their
        time). Pass ``token`` to make a resend of this write idempotent (see
        the class doc); without it the write always lands once per call.
        ``merge_schema``: as for :meth:`compare_and_append`. On a keyed shard
        this is :meth:`upsert`.
        """
        if self._machine.state().keys and not merge_schema:
            return self.upsert(updates, token=token)
        refuse_keyed(self._machine.state(), "append(merge_schema=True)")
        schema = self._write_schema(updates, merge_schema)
        table, has_time = conform_updates(updates, schema, self.shard_id, fill_missing=merge_schema)
        if has_time:
            raise InvalidUpdates(
                "append() assigns the time itself: drop the _time column, or use "
                "compare_and_append() to choose times"
            )
        staged = self._stage(table, has_time, schema)
        writer, tok = self._identity(token)
        evolves = encode_schema(schema) if merge_schema else None
        info = RunInfo()  # every retry's lost replies, for the cleanup
        upper = self.upper
        while True:
            t = max(upper, self._machine.clock_ms())
            result = self._append_batches(
                [staged],
                upper,
                t + 1,
                writer,
                tok,
                t,
                False,
                False,
                evolves,
                info,
                staged_here=True,
            )
            if isinstance(result, Committed | AlreadyCommitted):
                return result
            upper = result.current


def _check_uppers(expected_upper: Time, new_upper: Time) -> None:
    if not (0 <= expected_upper < new_upper <= MAX_TIME):
        raise InvalidFrontier(
            f"new_upper {new_upper} must be greater than expected_upper {expected_upper} "
            "(both unsigned 64-bit): a batch covers the times [expected_upper, new_upper)"
        )


def _with_rewrite(part: PartRef, ts_rewrite: Time) -> PartRef:
    current = part.ts_rewrite
    return dc_replace(part, ts_rewrite=ts_rewrite if current is None else max(current, ts_rewrite))


def never_committed(machine: Machine, parts: Sequence[PartRef], info: RunInfo) -> list[PartRef]:
    """The keyed ``parts`` a refused command may delete: those no committed state references.

    Only for parts that no command but the runs ``info`` saw ever tried to
    commit (staged for this command alone: a write's own, a merge's output);
    parts that may have been attempted elsewhere go through
    :func:`abandon_staged`. Without a lost reply the command surely
    committed nothing, so all of them. After one, the attempt may have
    landed and a later state (another compaction's merge, a reader's leased
    SeqNo) may reference its parts, so only parts that no state kept in
    Consensus references, read now, and only once the head is past every
    unknown attempt (an attempt still in flight could land later). Whatever
    this cannot prove stays for GC: a landed attempt's parts are collected
    like any replaced batch's, an unlanded one's by the orphan sweep.
    """
    keyed = [p for p in parts if p.key is not None]
    if not info.uncertain or not keyed:
        return keyed
    return unreferenced(machine, keyed, after_seqno=max(info.indeterminate_seqnos))


def abandon_staged(machine: Machine, parts: Sequence[PartRef]) -> list[PartRef]:
    """Delete the Blob objects of staged ``parts`` given up for good, where no commit can need
    them; return those deleted.

    For parts that some commit attempt with an unknown outcome may reference,
    unknown to this call: an earlier call's whose reply was lost (a resend of
    the same StagedBatch), another process's (Spark runs a sink's ``abort``
    in another worker than its ``commit``), or one still in flight in a slow
    store. First a :func:`~pyspark_persist.state.commands.fence` takes the
    next SeqNo, so no attempt sent before this call can land any more (each
    expects a SeqNo at or below the head read here); then one read of the
    history keeps every part some state kept in Consensus references (an
    attempt that landed, and whatever merged it since). When either fails
    (the fence's own outcome unknown, the history unreadable) nothing is
    deleted: GC collects what a landed attempt wrote like any replaced
    batch's parts, and the orphan sweep the rest after ``staged_part_grace_s``.

    Only attempts sent before the call are fenced off: call it once the
    commit returned or raised, never while it may still be retrying.
    """
    keyed = [p for p in parts if p.key is not None]
    if not keyed:
        return []
    try:
        fenced = machine.run(commands.fence)
    except PersistError as e:
        log.info("shard %s: kept %s given-up parts: %s", machine.shard_id, len(keyed), e)
        return []
    doomed = unreferenced(machine, keyed, after_seqno=fenced)
    delete_staged(machine.blob, doomed)
    return doomed


def unreferenced(machine: Machine, parts: Sequence[PartRef], after_seqno: int = 0) -> list[PartRef]:
    """The keyed ``parts`` that no state kept in Consensus references (read now).

    Empty when that cannot be shown: the history is unreadable, or the head
    is still before ``after_seqno`` (a commit attempted there may yet land).
    States older than the oldest row are unreadable to everyone, so a part
    only they referenced is garbage as well.
    """
    keyed = [p for p in parts if p.key is not None]
    try:
        history = read_history(machine.shard_id, machine.consensus, machine.blob)
    except PersistError as e:
        log.info("shard %s: kept staged parts after an unknown outcome: %s", machine.shard_id, e)
        return []
    if history is None:
        return []
    start, rows, _ = history
    head = rows[-1].seqno if rows else start.seqno
    if head < after_seqno:
        return []
    # A batch enters state only by a diff's put: the start state's batches and every batch a
    # later diff puts are all that any kept state references (no state is rebuilt).
    batches = list(start.batches.values())
    for row in rows:
        batches.extend(decode(row.data, where=f"consensus row {start.shard_id!r}").put_batches)
    referenced = {p.key for b in batches for p in b.all_parts if p.key is not None}
    return [p for p in keyed if p.key not in referenced]
