"""Part bytes: updates encoded as Parquet or Arrow IPC, and decoded back, whatever the format.

A part's reference records its format (``PartRef.fmt``): Parquet (the
Python API's and compaction's), Arrow IPC (cheaper to write and read), or
``arrow-rows`` (Arrow IPC of the row columns alone: the Spark sink's inserts
at one time). Tiny parts ride inline in state as an Arrow IPC stream
(:func:`encode_inline`). Every part's bytes carry a CRC-32
(:func:`part_checksum`), counted as they are encoded.

Pure: encoders write to a :class:`ByteSink` the caller hands them (a Blob
writer, in practice) and decoders read bytes they are given; where those
bytes come from or go is the caller's business (:mod:`.fetch`, :mod:`.part_formats`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import pyarrow as pa
import pyarrow.parquet as pq
from zlib_ng.zlib_ng import crc32 as _crc32

from .columns import bounds, constant_column
from .errors import CorruptData, InvalidUsage
from .schema import DIFF, DIFF_TYPE, RESERVED, TIME, TIME_TYPE, data_schema
from .state import PartRef
from .stats import PartStats

PARQUET = "parquet"
"""A Parquet file of the part's updates (snappy): compact, what compaction writes."""
ARROW = "arrow"
"""An Arrow IPC stream of the part's updates, uncompressed (see :data:`ARROW_COMPRESSION`):
cheaper to write and read than Parquet, and read in place."""
ARROW_ROWS = "arrow-rows"
"""An Arrow IPC stream of the row columns only: every update of the part is an insert (diff
+1) at the one time its reference records, so ``_time`` and ``_diff`` are not stored. On the
Spark sink's rows (int64, float64, 32-char string) that is 16 of every 68 bytes not copied,
checksummed, written or mapped back."""
PART_FORMATS = (PARQUET, ARROW, ARROW_ROWS)
"""Every format a part may have; every reader reads each of them."""


def part_checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC-32 of a part's bytes, as ``PartRef.crc`` records it (zlib's polynomial).

    zlib-ng's folding implementation gives the same value as ``zlib.crc32`` at
    10-20 GB/s where zlib managed 2-3 on this project's machines (64 MiB, best of 5),
    and like zlib it releases the GIL: a profile of a Spark read had zlib's CRC as
    persist's largest cost, about a tenth of the executors' CPU.
    """
    return int(_crc32(data))


class ByteSink(Protocol):
    """Where an encoder writes a part: a :class:`~.blob.BlobWriter`, or anything that takes
    bytes in order (the encoder never commits or aborts it: its caller does)."""

    def write(self, data: memoryview, /) -> int:
        """Take ``data`` (which does not change afterwards); the number of bytes taken."""


def write_parquet_part(table: pa.Table, out: ByteSink) -> tuple[int, int]:
    """Encode a part table as Parquet straight into ``out``; its size in bytes and CRC-32.

    The encoder's pages go to ``out`` (through a 1 MiB buffer, not one Python call per page)
    as they are made, with the CRC folded on the way: no whole encoded copy of the part is
    ever held, which for a 64 MiB part was a second 20-60 MiB buffer per part in flight.
    ``out`` is not committed. No page checksums: the part's whole-object CRC-32
    (``PartRef.crc``, checked on every fetch) already catches any flipped or missing byte,
    and page checksums cost about a tenth of the encode and a fifth of the decode on top.
    """
    sink = _ChecksumSink(out)
    with pa.BufferedOutputStream(pa.PythonFile(sink, mode="w"), buffer_size=1 << 20) as stream:
        pq.write_table(table, stream, compression="snappy", write_statistics=True)
    return sink.size, sink.crc


ARROW_COMPRESSION: str | None = None
"""Compression of Arrow IPC parts: none. Measured on 84 MiB of the benchmark rows, best of 3:
CPU to encode / decode, one thread: uncompressed 36 / 0 ms (the batches are read in place),
lz4 75 / 33 ms (with IPC threads on, uncompressed encode rose to 156 ms: they stay off).
lz4 stores 0.65x the bytes, and with the fsync'd file write and read counted it was as fast
(IPC none 245-263 / 127-143 ms, lz4 149-217 / 91-134 ms, Parquet 554-704 / 228-304 ms). But
in a Spark task the encode and decode sit on the task's thread while the upload and the
fetch run beside it, and a py-spy profile of the sink put lz4 first among persist's costs:
on CPU-bound executors the bytes are cheaper than the compression."""


class _ChecksumSink:
    """What a part encoder writes through: sizes and CRC-32s the bytes on their way out.

    The CRC is folded piece by piece as the bytes pass (zlib-ng, GIL released),
    so the part is checksummed without a second pass over a whole encoded copy.
    """

    closed = False

    def __init__(self, out: ByteSink) -> None:
        self._out = out
        self.size = 0
        self.crc = 0

    def write(self, data: pa.Buffer | bytes) -> int:
        view = memoryview(data)  # an Arrow body buffer is passed as is: no copy
        self.crc = _crc32(view, self.crc)
        self.size += view.nbytes
        return self._out.write(view)

    def flush(self) -> None:
        """Nothing buffered here (the blob writer's commit makes the bytes durable)."""

    def close(self) -> None:
        """The encoder is done; ``out`` stays open for the caller to commit or abort."""
        self.closed = True


class ArrowPartEncoder:
    """Streams one Arrow IPC part into a :class:`ByteSink` as its updates arrive.

    Updates are coalesced into record batches of exactly ``batch_rows`` rows
    (the last one of a part may be shorter), so a reader hands Spark few,
    large batches; each is written to ``out`` as soon as it is full, its
    statistics gathered on the way, and the part's size and CRC-32 are counted
    as the bytes pass. The encoder so holds less than one batch of rows, never
    the part: keeping the batches for one write at the end made a second copy
    of every byte (into the encoded buffer), and their fresh pages cost a page
    fault each, the sink's largest costs in a py-spy profile (coalescing into
    fresh memory 645 samples, encoding into the buffer 405, of 1,354 staging).
    """

    def __init__(
        self, schema: pa.Schema, out: ByteSink, batch_rows: int = 65536, rows_only: bool = False
    ) -> None:
        self._batch_rows = batch_rows
        self._rows_only = rows_only
        """An ``arrow-rows`` part: ``_time`` and ``_diff`` are checked constant, not stored."""
        self._insert_time: int | None = None
        """The one time of an ``arrow-rows`` part (set by its first updates)."""
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self._row_bytes: float | None = None
        """Bytes a row of the first table took in Arrow (until a batch is written)."""
        self.stats = PartStats()
        self.rows = 0
        """Updates added so far."""
        self._sink = _ChecksumSink(out)
        options = pa.ipc.IpcWriteOptions(compression=ARROW_COMPRESSION, use_threads=False)
        if rows_only:
            schema = pa.schema([f for f in schema if f.name not in RESERVED])
        self._writer = pa.ipc.new_stream(self._sink, schema, options=options)

    def rows_room(self, target_bytes: int, incoming: pa.Table) -> int:
        """How many more rows keep the part within ``target_bytes`` (at least 1).

        Sized in rows, from the bytes already written per row (the part's real
        size, header included), or before any batch is written from the first
        ``incoming`` table's size: measuring every incoming table's ``nbytes``
        walked its string columns' offsets, once per Spark batch.

        A part that holds at least one whole batch ends on a whole batch (up to
        one batch under the target; past it only if the estimate shrank below
        what the part already holds). Every batch a reader gets is then full,
        and inputs of exactly ``batch_rows`` rows (Spark's Arrow batches with
        ``spark.sql.execution.arrow.maxRecordsPerBatch`` at persist's batch
        size) are stored as they come, never copied to coalesce: a part cut
        inside one would leave every later input straddling two batches.
        """
        written = self.rows - self._pending_rows
        if written:
            per_row = self._sink.size / written
        else:
            if self._row_bytes is None:
                self._row_bytes = max(incoming.nbytes / max(incoming.num_rows, 1), 1.0)
            per_row = self._row_bytes
        fits = int(target_bytes / per_row)
        if fits < self._batch_rows:
            return max(1, fits - self.rows)
        room = fits - fits % self._batch_rows - self.rows
        return room if room > 0 else self._batch_rows - self.rows % self._batch_rows

    def write(self, table: pa.Table) -> None:
        """Add updates in part layout."""
        if table.num_rows == 0:
            return
        if self._rows_only:
            table = self._rows_of_inserts(table)
        self._append(table)

    def write_inserts(self, rows: pa.Table, time: int) -> None:
        """Add row columns (no ``_time``, no ``_diff``), every row an insert at ``time``, to
        an ``arrow-rows`` part: stored as they are, nothing to check constant."""
        if not self._rows_only:
            raise InvalidUsage(f"only an {ARROW_ROWS} part takes rows without _time and _diff")
        if self._insert_time is None:
            self._insert_time = time
        elif self._insert_time != time:
            raise InvalidUsage(
                f"an {ARROW_ROWS} part holds inserts at one time only, not at {time} and "
                f"{self._insert_time}"
            )
        if rows.num_rows:
            self._append(rows)

    def _append(self, table: pa.Table) -> None:
        self.rows += table.num_rows
        self._pending.append(table)
        self._pending_rows += table.num_rows
        while self._pending_rows >= self._batch_rows:
            self._cut_pending(self._batch_rows)

    def _rows_of_inserts(self, table: pa.Table) -> pa.Table:
        """The row columns of updates that are all inserts at the part's one time.

        Two numpy passes over constant columns (about 40 us per 65,536 rows) buy
        not storing them; anything else is the caller's bug (only insert-only
        writes ask for ``arrow-rows``) and is refused before a byte is written.
        """
        n = table.num_rows
        t_lo, t_hi = bounds(table.column(TIME), n)
        if self._insert_time is None:
            self._insert_time = t_lo
        if not (t_lo == t_hi == self._insert_time and bounds(table.column(DIFF), n) == (1, 1)):
            raise InvalidUsage(
                f"an {ARROW_ROWS} part holds inserts (_diff +1) at one time only: these updates "
                "have other diffs or times; stage them in the 'arrow' or 'parquet' format"
            )
        return table.drop_columns(list(RESERVED))

    def _cut_pending(self, rows: int) -> None:
        """Write the first ``rows`` pending rows as one record batch; keep the rest pending."""
        if not self._pending:
            return
        take: list[pa.Table] = []
        taken = 0
        while taken < rows:
            head = self._pending.pop(0)
            if taken + head.num_rows > rows:
                split = rows - taken
                self._pending.insert(0, head.slice(split))
                head = head.slice(0, split)
            take.append(head)
            taken += head.num_rows
        self._pending_rows -= taken
        table = take[0] if len(take) == 1 else pa.concat_tables(take)
        batch = table.combine_chunks().to_batches()[0]
        # Per coalesced batch: a few numpy passes per batch_rows rows.
        self.stats.add(batch, self._insert_time if self._rows_only else None)
        self._writer.write_batch(batch)

    def finish(self) -> tuple[int, int]:
        """End the IPC stream; the part's size in bytes and its CRC-32 (``out`` not committed)."""
        if self._pending_rows:
            self._cut_pending(self._pending_rows)
        self._writer.close()
        return self._sink.size, self._sink.crc


_IPC_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
"""The IPC stream's end marker: a continuation token and a zero-length message."""

_last_schema_message: tuple[pa.Schema, bytes | None] | None = None
"""The last schema :func:`encode_inline` encoded and its IPC message (one writer's tiny writes
all share one schema, and serialising it is a third of a one-row encode)."""


def _schema_message(schema: pa.Schema) -> bytes | None:
    """The IPC message of ``schema``; None if a column holds dictionaries (see encode_inline)."""
    global _last_schema_message  # noqa: PLW0603 - a one-entry cache, replaced atomically
    last = _last_schema_message
    if last is not None and last[0].equals(schema, check_metadata=True):
        return last[1]
    dictionary = any(_has_dictionary(f.type) for f in schema)
    message = None if dictionary else schema.serialize().to_pybytes()
    _last_schema_message = (schema, message)
    return message


def _has_dictionary(typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        return True
    return any(_has_dictionary(typ.field(i).type) for i in range(typ.num_fields))


def encode_inline(table: pa.Table) -> bytes:
    """Encode a tiny part as an Arrow IPC stream, cheap enough to live in a state diff.

    The stream is assembled from the schema's and each batch's IPC messages
    (the very bytes ``pa.ipc.new_stream`` writes, at a third of its cost on a
    one-row write, the inline case). Dictionary columns need the stream
    writer's dictionary messages, so they go through it.
    """
    schema_message = _schema_message(table.schema)
    if schema_message is None:
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        return bytes(sink.getvalue().to_pybytes())
    messages = [schema_message]
    messages.extend(b.serialize().to_pybytes() for b in table.to_batches())
    messages.append(_IPC_END_OF_STREAM)
    return b"".join(messages)


def iter_part_batches(
    data: bytes | memoryview,
    part: PartRef,
    shard_id: str,
    batch_rows: int = 65536,
    row_range: tuple[int, int] | None = None,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.RecordBatch]:
    """The stored updates of a part's bytes, batch by batch, whatever its format.

    Arrow parts (and inline ones) come in the batches they were written in
    (about ``batch_rows`` rows for a staged part), read in place: views of
    ``data``, no copy. Parquet parts are decoded ``batch_rows`` rows at a time.
    With ``row_range`` only the stored rows ``[start, stop)`` (a split cut the
    part): an Arrow part's batches before ``start`` are skipped undecoded.

    ``columns``: the row columns to read (None: all of them), in that order, then
    ``_time`` and ``_diff``, which every batch has. A query that needs 2 of 40
    columns so pays for 2: Parquet decodes only their column chunks, and an Arrow
    batch is narrowed to them without a copy (the other columns' bytes are never
    decoded or copied; only the checksum of :func:`~.fetch.fetch_part_bytes` reads
    them). A named column the part lacks (it was written before the column was
    added) is left out, for :func:`~.schema.conform_columns` to read as null.
    """
    try:
        if part.inline is not None or part.fmt == ARROW:
            stream = pa.ipc.open_stream(pa.py_buffer(data))
            yield from _rows(_selected(stream, columns), row_range)
        elif part.fmt == ARROW_ROWS:
            stream = pa.ipc.open_stream(pa.py_buffer(data))
            batches = _rows(_selected(stream, columns, rows_only=True), row_range)
            yield from _with_insert_columns(batches, part, shard_id)
        elif part.fmt == PARQUET:
            parquet = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data)))
            wanted = None
            if columns is not None:
                wanted = _names_in(parquet.schema_arrow, columns)
            batches = parquet.iter_batches(batch_size=batch_rows, columns=wanted)
            yield from _rows(batches, row_range)
        else:
            raise CorruptData(
                f"part {part.key!r} of shard {shard_id!r} has format {part.fmt!r}, which this "
                f"version cannot read (it reads {', '.join(PART_FORMATS)}): upgrade the reader"
            )
    except (pa.ArrowInvalid, OSError) as e:
        where = "an inline part" if part.key is None else f"part {part.key}"
        raise CorruptData(f"{where} of shard {shard_id!r} cannot be decoded: {e}") from e


def _rows(
    batches: Iterator[pa.RecordBatch], row_range: tuple[int, int] | None
) -> Iterator[pa.RecordBatch]:
    """The rows ``[start, stop)`` of ``batches`` (all with ``None``), sliced in place; stops
    reading at ``stop``."""
    if row_range is None:
        yield from batches
        return
    start, stop = row_range
    at = 0
    for rb in batches:
        end = at + rb.num_rows
        if end > start:
            yield rb.slice(max(start - at, 0), min(end, stop) - max(at, start))
        if end >= stop:
            return
        at = end


def _names_in(schema: pa.Schema, columns: Sequence[str], rows_only: bool = False) -> list[str]:
    """The ``columns`` a part's ``schema`` has, in that order, then ``_time`` and ``_diff``
    (unless the part stores ``rows_only``)."""
    have = set(schema.names)
    names = [n for n in columns if n in have and n not in RESERVED]
    return names if rows_only else [*names, TIME, DIFF]


def _selected(
    reader: pa.ipc.RecordBatchStreamReader, columns: Sequence[str] | None, rows_only: bool = False
) -> Iterator[pa.RecordBatch]:
    """An IPC stream's batches narrowed to ``columns`` (see :func:`_names_in`): views of the
    same buffers, nothing copied."""
    if columns is None:
        yield from reader
        return
    schema = reader.schema
    indices = [schema.get_field_index(n) for n in _names_in(schema, columns, rows_only)]
    if indices == list(range(len(schema))):
        yield from reader
        return
    for rb in reader:
        yield rb.select(indices)


def _with_insert_columns(
    batches: Iterator[pa.RecordBatch], part: PartRef, shard_id: str
) -> Iterator[pa.RecordBatch]:
    """An ``arrow-rows`` part's batches in part layout: its one time and diff +1 added back
    (shared constant columns, so nothing is copied)."""
    if not (part.min_time == part.max_time and part.dmin == part.dmax == 1):
        raise CorruptData(
            f"part {part.key!r} of shard {shard_id!r} is an {ARROW_ROWS} part, but its reference "
            f"records times {part.min_time}..{part.max_time} and diffs {part.dmin}..{part.dmax}"
            " (it must be one time and +1): the state is corrupt"
        )
    schema: pa.Schema | None = None
    for rb in batches:
        if schema is None:
            schema = data_schema(rb.schema)
        n = rb.num_rows
        time = constant_column(part.min_time, n, TIME_TYPE)
        diff = constant_column(1, n, DIFF_TYPE)
        yield pa.RecordBatch.from_arrays([*rb.columns, time, diff], schema=schema)
