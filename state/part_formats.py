"""Part formats: how a batch builder makes parts of each format, one strategy per format.

A :class:`~.staging.BatchBuilder` hands conformed updates to the
:class:`PartFormat` of the format it stages, which decides what to hold
back, when to cut a part, and how to encode one into Blob:

- :class:`ParquetParts` (the Python API's and compaction's): updates are
  buffered until a part's worth, then encoded into Blob on an upload thread.
- :class:`ArrowParts`: updates stream into an open Arrow IPC part as they
  arrive (:meth:`~.blob.Blob.open_writer`), so no part is held whole, as a
  table or as bytes, where the store takes a stream (a file).
- :class:`ArrowRowsParts` (the Spark sink's, for inserts at one time): the
  same stream holding only the row columns, fed row tables as they are.

All of them upload through one :class:`Uploads` per builder (at most
``max_outstanding_parts`` at a time) and let a write small enough ride
inline in state instead (nothing in Blob at all).
"""

from __future__ import annotations

import functools
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import ClassVar

import pyarrow as pa

from .blob import Blob, BlobWriter
from .codec import ARROW, ARROW_ROWS, PARQUET, ArrowPartEncoder, encode_inline, write_parquet_part
from .columns import constant_column
from .config import PersistConfig
from .fetch import release_memory
from .keys import part_key
from .schema import DIFF_TYPE, TIME_TYPE, data_schema
from .state import PartRef
from .stats import part_ref


def new_part_key(shard_id: str, fmt: str) -> str:
    """A fresh, never reused Blob key for a part of ``shard_id`` in format ``fmt``: created
    now by this process's clock, with a random nonce (see :mod:`.keys`)."""
    return part_key(shard_id, fmt, time.time_ns() // 1_000_000, uuid.uuid4().hex)


class Uploads:
    """The parts one builder made: those done, those still uploading on at most
    ``max_outstanding`` threads, and the seconds spent waiting for and doing the work."""

    def __init__(self, max_outstanding: int) -> None:
        self._max_outstanding = max_outstanding
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[PartRef]] = []
        self.done: list[PartRef] = []
        """Parts made: uploaded, or inline."""
        self._lock = threading.Lock()
        self.queued_s = 0.0
        self.upload_s = 0.0

    @property
    def started(self) -> bool:
        """Whether any part was made or is on its way."""
        return bool(self.done or self._pending)

    def run(self, upload: Callable[[], PartRef], last: bool = False) -> None:
        """Make a part with ``upload`` on an upload thread, once one is free.

        The ``last`` part of a builder that started no thread (a small write's
        only part) is made in the caller's thread: there is nothing to overlap it
        with, and on a busy machine a thread to start and join costs more.
        """
        if last and self._pool is None:
            self.done.append(upload())
            return
        started = time.perf_counter()
        while len(self._pending) >= self._max_outstanding:
            self.done.append(self._pending.pop(0).result())
        self.queued_s += time.perf_counter() - started
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self._max_outstanding, thread_name_prefix="persist-upload"
            )
        self._pending.append(self._pool.submit(upload))

    def add_upload_s(self, seconds: float) -> None:
        """Count seconds spent encoding or uploading (from any thread)."""
        with self._lock:
            self.upload_s += seconds

    def join(self) -> list[PartRef]:
        """Wait for every upload; every part made. Raises what a failed upload raised."""
        while self._pending:
            self.done.append(self._pending.pop(0).result())
        return self.done

    def abandon(self) -> list[PartRef]:
        """Wait for every upload, ignoring failures (a failed upload left nothing behind); take
        every part made, to delete."""
        for f in self._pending:
            try:
                self.done.append(f.result())
            except Exception:  # noqa: BLE001, S112 - a failed upload left nothing to delete
                continue
        self._pending.clear()
        made, self.done = self.done, []
        return made

    def shutdown(self) -> None:
        """Stop the upload threads (after :meth:`join` or :meth:`abandon`)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


@dataclass(frozen=True)
class Stage:
    """What the part format of one builder works with."""

    blob: Blob
    shard_id: str
    config: PersistConfig
    inline_limit: int
    """The most bytes a write may take inline (0 or less: none rides inline)."""
    uploads: Uploads


class PartFormat(ABC):
    """How a builder makes parts of one format from conformed updates: what it holds back,
    when it cuts a part, and how it encodes one into Blob.

    The builder keeps what every format shares: the checks of the updates, the
    uploads, and deleting what was made on abort.
    """

    fmt: ClassVar[str]

    def __init__(self, stage: Stage) -> None:
        self._stage = stage

    @abstractmethod
    def add(self, table: pa.Table) -> None:
        """Take non-empty updates in part layout."""

    @abstractmethod
    def finish(self) -> None:
        """Make parts of everything held (the builder then waits for the uploads)."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what is held and the part being written, if any (parts already made are the
        builder's to delete)."""

    def _inline(self, table: pa.Table) -> PartRef | None:
        """``table`` as an inline part, if it is the whole write (no part made yet) and it
        encodes within the inline limit; else None."""
        stage = self._stage
        if stage.inline_limit <= 0 or stage.uploads.started:
            return None
        encoded = encode_inline(table)
        if len(encoded) > stage.inline_limit:
            return None
        # Inline bytes are always an Arrow IPC stream whatever the format; the reference keeps
        # PartRef's default format, so state encodes an inline part as it always did.
        return part_ref(table, None, encoded, len(encoded), None, PARQUET)


class ParquetParts(PartFormat):
    """Parquet parts: updates are buffered until a part's worth, then encoded into Blob on an
    upload thread while the next part's updates arrive."""

    fmt = PARQUET

    def __init__(self, stage: Stage) -> None:
        super().__init__(stage)
        self._buffer: list[pa.Table] = []
        self._measured = 0
        """How many tables at the head of ``_buffer`` were measured exactly."""
        self._measured_bytes = 0
        """Their bytes (``Table.nbytes``)."""
        self._unmeasured_bound = 0
        """An upper bound of the bytes of the rest of ``_buffer`` (their total buffer sizes)."""

    def add(self, table: pa.Table) -> None:
        """Buffer updates; cut a part whenever ``part_target_bytes`` are buffered."""
        target = self._stage.config.part_target_bytes
        # Table.nbytes walks every buffer range (a one-row write's largest cost); the total
        # buffer size is a near-free upper bound, enough to know a table is far from the target.
        bound = table.get_total_buffer_size()
        if self._measured_bytes + self._unmeasured_bound + bound < target:  # no slicing
            self._buffer.append(table)
            self._unmeasured_bound += bound
            return
        # Near the target: measure what was buffered unmeasured, once, and cut exactly.
        self._measured_bytes += sum(t.nbytes for t in self._buffer[self._measured :])
        self._unmeasured_bound = 0
        size = table.nbytes
        if self._measured_bytes + size < target:
            self._buffer.append(table)
            self._measured_bytes += size
            self._measured = len(self._buffer)
            return
        while table.num_rows:
            room = max(target - self._measured_bytes, 1)
            rows_fit = max(1, int(table.num_rows * room / max(table.nbytes, 1)))
            head, table = table.slice(0, rows_fit), table.slice(rows_fit)
            self._buffer.append(head)
            self._measured_bytes += head.nbytes
            self._measured = len(self._buffer)
            if self._measured_bytes >= target:
                self._stage.uploads.run(functools.partial(self._upload, self._take()))

    def finish(self) -> None:
        """The buffered rest: inline if it is the whole, tiny write, else a last part."""
        if not self._buffer:
            return
        table = self._take()
        inline = self._inline(table)
        if inline is not None:
            self._stage.uploads.done.append(inline)
        else:
            self._stage.uploads.run(functools.partial(self._upload, table), last=True)

    def abort(self) -> None:
        """Drop what is buffered."""
        self._buffer.clear()

    def _take(self) -> pa.Table:
        """Everything buffered, as one table; the buffer is empty afterwards."""
        # No combine_chunks: Parquet encodes chunked columns directly, and a merged
        # copy would hold a second B bytes while the slices are still referenced.
        table = self._buffer[0] if len(self._buffer) == 1 else pa.concat_tables(self._buffer)
        self._buffer.clear()
        self._measured_bytes = 0
        self._measured = 0
        self._unmeasured_bound = 0
        return table

    def _upload(self, table: pa.Table) -> PartRef:
        """Encode a Parquet part into Blob as it is made (``write_parquet_part``) and commit it."""
        stage = self._stage
        started = time.perf_counter()
        key = new_part_key(stage.shard_id, PARQUET)
        out = stage.blob.open_writer(key)
        try:
            size, crc = write_parquet_part(table, out)
            out.commit()
        except BaseException:
            out.abort()
            raise
        stage.uploads.add_upload_s(time.perf_counter() - started)
        ref = part_ref(table, key, None, size, crc, PARQUET)
        del table
        release_memory()
        return ref


class ArrowParts(PartFormat):
    """Arrow IPC parts: updates stream into the open part as they arrive, and a part holding
    the target bytes is committed to Blob on an upload thread.

    While nothing was streamed, tiny updates are held back instead: if they are
    the whole write, it rides inline and never reaches Blob.
    """

    fmt = ARROW

    def __init__(self, stage: Stage) -> None:
        super().__init__(stage)
        self._held: list[pa.Table] = []
        """Tiny updates held back while they may be the whole write (they then ride inline)."""
        self._held_bytes = 0
        self._encoder: ArrowPartEncoder | None = None
        self._open: tuple[str, BlobWriter] | None = None
        """The key and Blob writer of the part being streamed (``_encoder``'s)."""

    def _may_ride_inline(self) -> bool:
        """Nothing streamed or uploaded yet: tiny updates are held back, they may be the
        whole write and then ride inline (no Blob object, no upload at all)."""
        stage = self._stage
        return stage.inline_limit > 0 and self._encoder is None and not stage.uploads.started

    def add(self, table: pa.Table) -> None:
        """Hold tiny updates back while they may ride inline; stream the rest into parts."""
        if self._may_ride_inline():
            if self._held_bytes + table.nbytes <= self._stage.inline_limit:
                self._held.append(table)
                self._held_bytes += table.nbytes
                return
            table = pa.concat_tables([*self._held, table]) if self._held else table
            self._held.clear()
            self._held_bytes = 0
        self._stream(table)

    def finish(self) -> None:
        """What was held back inline if it encodes small enough (else streamed), then the
        open part committed."""
        if self._held:
            table = self._held[0] if len(self._held) == 1 else pa.concat_tables(self._held)
            self._held.clear()
            self._held_bytes = 0
            inline = self._inline(table)
            if inline is not None:
                self._stage.uploads.done.append(inline)
            else:
                self._stream(table)
        self._submit(last=True)

    def abort(self) -> None:
        """Drop what is held back and the part being streamed (its key never becomes visible)."""
        self._held.clear()
        self._encoder = None
        if self._open is not None:
            self._open[1].abort()
            self._open = None

    def _stream(self, table: pa.Table, inserts: bool = False) -> None:
        """Stream updates into the open part; commit it once it holds the target bytes.

        ``inserts``: ``table`` holds row columns alone (an ``arrow-rows`` part's
        inserts, see :meth:`ArrowRowsParts.add_inserts`).
        """
        stage = self._stage
        target = stage.config.part_target_bytes
        started = time.perf_counter()
        while table.num_rows:
            if self._encoder is None:
                self._open_part(table.schema)
            assert self._encoder is not None
            room = self._encoder.rows_room(target, table)
            head = table if table.num_rows < room else table.slice(0, room)
            if inserts:
                self._encoder.write_inserts(head, 0)  # no _time: zero, rewritten at commit
            else:
                self._encoder.write(head)
            if head is table:
                break
            table = table.slice(room)
            self._submit()
        stage.uploads.add_upload_s(time.perf_counter() - started)

    def _new_encoder(self, schema: pa.Schema, out: BlobWriter) -> ArrowPartEncoder:
        """The encoder of one part of this format."""
        return ArrowPartEncoder(schema, out, self._stage.config.read_batch_rows)

    def _open_part(self, schema: pa.Schema) -> None:
        key = new_part_key(self._stage.shard_id, self.fmt)
        out = self._stage.blob.open_writer(key)
        try:
            self._encoder = self._new_encoder(schema, out)
        except BaseException:
            out.abort()
            raise
        self._open = (key, out)

    def _submit(self, last: bool = False) -> None:
        """End the open part and commit it to Blob (see :meth:`Uploads.run` for ``last``)."""
        encoder, self._encoder = self._encoder, None
        if encoder is None or self._open is None:
            return
        (key, out), self._open = self._open, None
        try:
            size, crc = encoder.finish()
        except BaseException:
            out.abort()
            raise
        ref = encoder.stats.ref(key, None, size, crc, self.fmt)
        del encoder
        self._stage.uploads.run(functools.partial(self._commit, out, ref), last=last)

    def _commit(self, out: BlobWriter, ref: PartRef) -> PartRef:
        """Make a streamed part durable under its key (a file's fsync and rename, an upload)."""
        started = time.perf_counter()
        try:
            out.commit()
        except BaseException:
            out.abort()
            raise
        self._stage.uploads.add_upload_s(time.perf_counter() - started)
        release_memory()
        return ref


class ArrowRowsParts(ArrowParts):
    """``arrow-rows`` parts: Arrow parts of the row columns alone, every update an insert at
    one time (see :data:`~.codec.ARROW_ROWS`); rows given as inserts go in as they are."""

    fmt = ARROW_ROWS

    def _new_encoder(self, schema: pa.Schema, out: BlobWriter) -> ArrowPartEncoder:
        return ArrowPartEncoder(schema, out, self._stage.config.read_batch_rows, rows_only=True)

    def add_inserts(self, rows: pa.Table) -> None:
        """Take non-empty rows of the shard's columns, every one an insert at the commit's time.

        Once a part streams they go to it as they are, without the constant
        ``_time`` and ``_diff`` columns the encoder would check and drop again;
        until then they are held back in part layout, as every update is.
        """
        if not self._may_ride_inline():
            self._stream(rows, inserts=True)
            return
        n = rows.num_rows
        time_col, diff_col = constant_column(0, n, TIME_TYPE), constant_column(1, n, DIFF_TYPE)
        self.add(
            pa.Table.from_arrays(
                [*rows.columns, time_col, diff_col], schema=data_schema(rows.schema)
            )
        )


FORMATS: dict[str, type[PartFormat]] = {
    f.fmt: f for f in (ParquetParts, ArrowParts, ArrowRowsParts)
}
"""The strategy that writes each part format (every one of PART_FORMATS)."""
