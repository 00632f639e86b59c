"""Writing a shard: stage parts anywhere, then commit them with one compare_and_append.

A write has two halves that may run in different processes:

1. *Staging*: a :class:`BatchBuilder` cuts updates into parts of about
   ``part_target_bytes`` and uploads them to Blob, at most
   ``max_outstanding_parts`` at a time, so memory stays within
   ``B * (2N + 1)`` whatever the data size. Parts are Parquet, or with
   ``part_format="arrow"`` (the Spark sink) Arrow IPC streams encoded as the
   updates arrive, so no part is ever held whole as a table. The result, a
   :class:`StagedBatch`, is a small JSON-able value: nothing is visible yet.
2. *Commit*: :meth:`WriteHandle.compare_and_append_batches` makes any number
   of staged batches visible in one state change, iff the shard's upper is
   still the expected one. A retry after an unknown outcome, or a replay of
   the same token, is answered :class:`~pyspark_persist.state.commands.AlreadyCommitted`
   and applies nothing.

Parts that were staged but never committed are invisible and are deleted by
``abort`` or, after a crash, by GC once they are older than its grace period.
"""

from __future__ import annotations

import threading
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from . import commands
from .blob import Blob
from .commands import AlreadyCommitted, AppendResult, Committed
from .config import PersistConfig
from .errors import InvalidFrontier, InvalidUpdates, InvalidUsage
from .machine import Machine
from .parts import (
    ARROW,
    MAX_TIME,
    PARQUET,
    PART_FORMATS,
    ArrowPartEncoder,
    conform_updates,
    encode_inline,
    encode_parquet,
    new_part_key,
    part_ref,
    release_memory,
    time_bounds,
)
from .state import PartRef, Time
from .tracing import traced


@dataclass(frozen=True)
class StagedBatch:
    """Parts uploaded (or kept inline) but not yet committed; JSON-able to cross processes."""

    shard_id: str
    parts: tuple[PartRef, ...]
    has_time: bool

    @property
    def rows(self) -> int:
        """Updates staged."""
        return sum(p.rows for p in self.parts)

    @property
    def size_bytes(self) -> int:
        """Encoded bytes staged."""
        return sum(p.size_bytes for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        """Encode for a Spark commit message or any other hop between processes."""
        return {
            "shard": self.shard_id,
            "parts": [p.to_json() for p in self.parts],
            "has_time": self.has_time,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StagedBatch:
        """Decode what :meth:`to_json` produced."""
        return cls(
            shard_id=str(d["shard"]),
            parts=tuple(PartRef.from_json(p) for p in d["parts"]),
            has_time=bool(d["has_time"]),
        )


class BatchBuilder:
    """Stages updates as parts of a target size with bounded memory. See the module doc.

    Usable from any process that can open the shard's Blob; it never touches
    Consensus. Not thread-safe: one builder per writing thread.
    """

    def __init__(
        self,
        blob: Blob,
        shard_id: str,
        schema: pa.Schema,
        config: PersistConfig,
        *,
        allow_inline: bool = True,
        inline_budget: int | None = None,
        part_format: str = PARQUET,
    ) -> None:
        if part_format not in PART_FORMATS:
            raise InvalidUsage(
                f"part format {part_format!r} is unknown: use one of {', '.join(PART_FORMATS)}"
            )
        self._format = part_format
        self._encoder: ArrowPartEncoder | None = None
        self._blob = blob
        self._shard_id = shard_id
        self._schema = schema
        self._config = config
        self._allow_inline = allow_inline
        limit = config.inline_write_max_bytes
        self._inline_limit = limit if inline_budget is None else min(limit, inline_budget)
        self._buffer: list[pa.Table] = []
        self._buffered_bytes = 0
        self._has_time: bool | None = None
        self._pending: list[Future[PartRef]] = []
        self._done: list[PartRef] = []
        self._pool: ThreadPoolExecutor | None = None
        self._finished = False
        self._timing_lock = threading.Lock()
        self.queued_s = 0.0
        """Seconds ``add``/``finish`` waited for an upload slot (parts queued behind uploads)."""
        self.upload_s = 0.0
        """Seconds spent encoding and uploading parts, summed over the upload threads."""

    def add(self, updates: pa.Table | pa.RecordBatch) -> None:
        """Buffer updates; cut and upload a part whenever ``part_target_bytes`` are buffered.

        Blocks while ``max_outstanding_parts`` uploads are in flight.
        """
        table, has_time = conform_updates(updates, self._schema, self._shard_id)
        self.add_conformed(table, has_time)

    def add_conformed(self, table: pa.Table, has_time: bool) -> None:
        """``add`` for updates already passed through ``conform_updates`` (no second check)."""
        if self._finished:
            raise InvalidUsage("this batch builder was already finished or aborted")
        if table.num_rows == 0:
            return
        if self._has_time is None:
            self._has_time = has_time
        elif self._has_time != has_time:
            raise InvalidUpdates(
                "some updates given to one batch carry a _time column and some do not; "
                "give every update a _time, or none (the commit then assigns one)"
            )
        if self._format == ARROW:
            self._add_arrow(table)
            return
        target = self._config.part_target_bytes
        size = table.nbytes
        if self._buffered_bytes + size < target:  # the common small case: no slicing
            self._buffer.append(table)
            self._buffered_bytes += size
            return
        while table.num_rows:
            room = max(target - self._buffered_bytes, 1)
            rows_fit = max(1, int(table.num_rows * room / max(table.nbytes, 1)))
            head, table = table.slice(0, rows_fit), table.slice(rows_fit)
            self._buffer.append(head)
            self._buffered_bytes += head.nbytes
            if self._buffered_bytes >= target:
                self._flush()

    def _add_arrow(self, table: pa.Table) -> None:
        """Encode updates into the open Arrow part; upload it once it holds the target bytes."""
        target = self._config.part_target_bytes
        while table.num_rows:
            if self._encoder is None:
                self._encoder = ArrowPartEncoder(table.schema, self._config.read_batch_rows)
            room = target - self._encoder.nbytes
            if table.nbytes <= room:
                self._encoder.write(table)
                break
            rows_fit = max(1, int(table.num_rows * room / max(table.nbytes, 1)))
            self._encoder.write(table.slice(0, rows_fit))
            table = table.slice(rows_fit)
            self._submit_arrow()

    def _submit_arrow(self) -> None:
        encoder, self._encoder = self._encoder, None
        if encoder is not None and encoder.rows:
            self._wait_for_slot()
            self._pending.append(self._executor().submit(self._upload_arrow, encoder))

    def _upload_arrow(self, encoder: ArrowPartEncoder) -> PartRef:
        started = time.perf_counter()
        data = encoder.finish()
        key = new_part_key(self._shard_id, ARROW)
        self._blob.set(key, data)
        with self._timing_lock:
            self.upload_s += time.perf_counter() - started
        ref = encoder.stats.ref(key, None, len(data), zlib.crc32(data), ARROW)
        del data, encoder
        release_memory()
        return ref

    @traced("BatchBuilder.finish", "_shard_id")
    def finish(self) -> StagedBatch:
        """Upload what is buffered, wait for every upload, and return the staged batch."""
        if self._finished:
            raise InvalidUsage("this batch builder was already finished or aborted")
        self._submit_arrow()
        if self._buffer:
            table = self._take_buffer()
            inline = encode_inline(table) if self._allow_inline and not self._pending else None
            if inline is not None and not self._done and len(inline) <= self._inline_limit:
                self._done.append(part_ref(table, None, inline, len(inline)))
            else:
                self._submit(table)
        try:
            for f in self._pending:
                self._done.append(f.result())
        except BaseException:
            self.abort()
            raise
        self._pending.clear()
        self._finished = True
        self._shutdown()
        return StagedBatch(self._shard_id, tuple(self._done), bool(self._has_time))

    def abort(self) -> None:
        """Delete every part this builder uploaded; the builder cannot be used afterwards."""
        self._finished = True
        for f in self._pending:
            try:
                self._done.append(f.result())
            except Exception:  # noqa: BLE001, S112 - a failed upload left nothing to delete
                continue
        self._pending.clear()
        delete_staged(self._blob, self._done)
        self._done.clear()
        self._buffer.clear()
        self._encoder = None
        self._shutdown()

    def _take_buffer(self) -> pa.Table:
        # No combine_chunks: Parquet encodes chunked columns directly, and a merged
        # copy would hold a second B bytes while the slices are still referenced.
        table = pa.concat_tables(self._buffer)
        self._buffer.clear()
        self._buffered_bytes = 0
        return table

    def _flush(self) -> None:
        self._submit(self._take_buffer())

    def _submit(self, table: pa.Table) -> None:
        self._wait_for_slot()
        self._pending.append(self._executor().submit(self._upload, table))

    def _wait_for_slot(self) -> None:
        started = time.perf_counter()
        while len(self._pending) >= self._config.max_outstanding_parts:
            self._done.append(self._pending.pop(0).result())
        self.queued_s += time.perf_counter() - started

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self._config.max_outstanding_parts, thread_name_prefix="persist-upload"
            )
        return self._pool

    def _upload(self, table: pa.Table) -> PartRef:
        started = time.perf_counter()
        data = encode_parquet(table)
        key = new_part_key(self._shard_id)
        self._blob.set(key, data)
        with self._timing_lock:
            self.upload_s += time.perf_counter() - started
        ref = part_ref(table, key, None, len(data), zlib.crc32(data))
        del data, table
        release_memory()
        return ref

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def delete_staged(blob: Blob, parts: Sequence[PartRef]) -> None:
    """Delete the Blob objects of parts that surely were not committed."""
    for p in parts:
        if p.key is not None:
            blob.delete(p.key)


class WriteHandle:
    """Appends to one shard as one writer identity, exactly once per idempotency token.

    ``writer_id`` names the writer in state; each commit carries an integer
    token that must exceed the writer's last committed one. Left to itself the
    handle numbers its commits; the Spark sink passes the micro-batch id.
    """

    def __init__(self, machine: Machine, schema: pa.Schema, writer_id: str | None) -> None:
        self._machine = machine
        self.schema = schema
        self.writer_id = writer_id or f"w-{uuid.uuid4().hex}"
        # Fresh from Consensus: a stale cache could restart the numbering at a spent token.
        known = machine.fetch_latest().writers.get(self.writer_id) if writer_id else None
        self._next_token = (known.last_token + 1) if known else 1

    @property
    def shard_id(self) -> str:
        """The shard this handle writes."""
        return self._machine.shard_id

    @property
    def upper(self) -> Time:
        """The shard's upper as this process last saw it (may be stale; a commit says the truth)."""
        return self._machine.state().upper

    @traced("WriteHandle.fetch_upper")
    def fetch_upper(self) -> Time:
        """The shard's upper, read from Consensus now."""
        return self._machine.fetch_latest().upper

    def _stage(self, table: pa.Table, has_time: bool) -> StagedBatch:
        """Stage conformed updates in one batch; delete what was uploaded if that fails."""
        builder = self.builder()
        try:
            builder.add_conformed(table, has_time)
            return builder.finish()
        except BaseException:
            builder.abort()
            raise

    def builder(self) -> BatchBuilder:
        """A builder to stage parts of this shard (possibly from another thread).

        Tiny writes ride inline in state only while the inline data there
        stays within ``inline_total_max_bytes`` (which bounds rollups too).
        """
        cfg = self._machine.config
        return BatchBuilder(
            self._machine.blob,
            self.shard_id,
            self.schema,
            cfg,
            inline_budget=cfg.inline_total_max_bytes - self._machine.state().inline_bytes,
        )

    @traced("WriteHandle.compare_and_append")
    def compare_and_append(
        self,
        updates: pa.Table | pa.RecordBatch,
        expected_upper: Time,
        new_upper: Time,
        *,
        token: int | None = None,
    ) -> AppendResult:
        """Append ``updates`` iff the upper is ``expected_upper``; advance it to ``new_upper``.

        Every update's ``_time`` must lie in ``[expected_upper, new_upper)``;
        without a ``_time`` column every update gets ``expected_upper``.
        ``_diff`` defaults to +1. Returns Committed, UpperMismatch (with the
        actual upper; nothing written) or AlreadyCommitted (a retry).
        """
        _check_uppers(expected_upper, new_upper)
        table, has_time = conform_updates(updates, self.schema, self.shard_id)
        if has_time and table.num_rows:
            tmin, tmax = time_bounds(table)
            if tmin < expected_upper or tmax >= new_upper:
                raise InvalidUpdates(
                    f"update times [{tmin}, {tmax}] of shard {self.shard_id!r} fall outside the "
                    f"batch [{expected_upper}, {new_upper}): give every update a _time in "
                    "that range"
                )
        staged = self._stage(table, has_time)
        ts_rewrite = None if staged.has_time else expected_upper
        return self.compare_and_append_batches(
            [staged], expected_upper, new_upper, token=token, ts_rewrite=ts_rewrite
        )

    @traced("WriteHandle.compare_and_append_batches")
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
    ) -> AppendResult:
        """Commit staged batches as one batch ``[expected_upper, new_upper)`` in one state change.

        ``ts_rewrite`` gives parts staged without times their time (every
        time is read as at least it). Parts of a surely-failed attempt
        (UpperMismatch) are deleted unless ``delete_on_mismatch`` is False
        (a caller that will retry the same staged batches at a new upper).
        With ``replace`` the commit atomically retracts the shard's current
        contents too, so afterwards it holds exactly these batches.
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
        tok = self._next_token if token is None else token
        result = self._machine.run(
            lambda s: commands.compare_and_append(
                s,
                parts=tuple(parts),
                expected_upper=expected_upper,
                new_upper=new_upper,
                writer_id=self.writer_id,
                token=tok,
                now_ms=self._machine.clock_ms(),
                replace=replace,
            )
        )
        if isinstance(result, Committed | AlreadyCommitted):
            self._next_token = max(self._next_token, tok + 1)
        elif delete_on_mismatch:
            delete_staged(self._machine.blob, parts)
        return result

    @traced("WriteHandle.append")
    def append(self, updates: pa.Table | pa.RecordBatch) -> Committed | AlreadyCommitted:
        """Append updates at one new time (the later of the upper and the wall clock, ms).

        Sugar over :meth:`compare_and_append_batches`: stages once, then
        commits at the current upper, retrying races with other writers with
        the same staged parts (the commit assigns their time).
        """
        table, has_time = conform_updates(updates, self.schema, self.shard_id)
        if has_time:
            raise InvalidUpdates(
                "append() assigns the time itself: drop the _time column, or use "
                "compare_and_append() to choose times"
            )
        staged = self._stage(table, has_time)
        token = self._next_token
        upper = self.upper
        while True:
            t = max(upper, self._machine.clock_ms())
            result = self.compare_and_append_batches(
                [staged], upper, t + 1, token=token, ts_rewrite=t, delete_on_mismatch=False
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
    from dataclasses import replace

    current = part.ts_rewrite
    return replace(part, ts_rewrite=ts_rewrite if current is None else max(current, ts_rewrite))
