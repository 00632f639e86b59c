"""Parts: Arrow updates <-> the bytes persisted in Blob (Parquet or Arrow IPC) or inline in state.

Every part holds the shard's row columns plus ``_time`` (uint64) and
``_diff`` (int64). A part is written once under a fresh key and never
changed; what a reader sees of it is further shaped by the part's
``ts_rewrite`` and by the time bounds of the snapshot or listen that handed it
out (a :class:`LeasedPart`), so one stored part serves every read.
"""

from __future__ import annotations

import functools
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from zlib_ng.zlib_ng import crc32 as _crc32

from .blob import Blob, BlobWriter
from .errors import (
    CorruptData,
    InvalidUpdates,
    InvalidUsage,
    PartNotFound,
    SchemaMismatch,
)
from .state import PartRef, Time

TIME = "_time"
DIFF = "_diff"
RESERVED = (TIME, DIFF)
TIME_TYPE = pa.uint64()
DIFF_TYPE = pa.int64()
MAX_TIME = 2**64 - 1
PARQUET = "parquet"
ARROW = "arrow"
PART_FORMATS = (PARQUET, ARROW)


def validate_schema(schema: pa.Schema) -> pa.Schema:
    """Check a user schema for shard creation: at least one column, no reserved names."""
    if not isinstance(schema, pa.Schema):
        raise InvalidUsage(f"a shard schema must be a pyarrow.Schema, got {type(schema).__name__}")
    if len(schema) == 0:
        raise InvalidUsage("a shard schema needs at least one column")
    clash = [n for n in schema.names if n in RESERVED]
    if clash:
        raise InvalidUsage(
            f"column names {clash} are reserved for persist's update time and multiplicity; "
            "rename those columns"
        )
    if len(set(schema.names)) != len(schema.names):
        raise InvalidUsage(f"schema has duplicate column names: {schema.names}")
    return schema.remove_metadata()


@functools.lru_cache(maxsize=64)
def data_schema(schema: pa.Schema) -> pa.Schema:
    """The schema of a part: the row columns, then ``_time`` and ``_diff`` (cached per schema)."""
    return schema.append(pa.field(TIME, TIME_TYPE, nullable=False)).append(
        pa.field(DIFF, DIFF_TYPE, nullable=False)
    )


def encode_schema(schema: pa.Schema) -> bytes:
    """Serialize a schema for the shard's state."""
    return bytes(schema.serialize().to_pybytes())


@functools.lru_cache(maxsize=64)
def decode_schema(data: bytes) -> pa.Schema:
    """Read a schema that :func:`encode_schema` wrote (cached: handles follow state's schema)."""
    try:
        return pa.ipc.read_schema(pa.py_buffer(data))
    except (pa.ArrowInvalid, OSError) as e:
        raise CorruptData(f"the shard's schema in state cannot be decoded: {e}") from e


def schema_mismatch_message(
    shard: str, expected: pa.Schema, actual: pa.Schema, add_hint: str = ""
) -> str:
    """Say which columns differ between two schemas, so the user knows what to change.

    ``add_hint`` says how the caller could add columns the shard lacks instead.
    """
    exp = {f.name: f.type for f in expected}
    act = {f.name: f.type for f in actual}
    missing = [f"missing column {n!r} ({t})" for n, t in exp.items() if n not in act]
    extra = [f"unexpected column {n!r} ({t})" for n, t in act.items() if n not in exp]
    problems = missing + extra
    evolve = (
        f" ({add_hint} to add new columns or write null in missing nullable ones)"
        if add_hint and (missing or extra)
        else ""
    )
    problems += [
        f"column {n!r} is {act[n]}, the shard has {t}"
        for n, t in exp.items()
        if n in act and act[n] != t
    ]
    exp_null = {f.name: f.nullable for f in expected}
    problems += [
        f"column {f.name!r} is {'nullable' if f.nullable else 'non-nullable'}, the shard's is "
        f"{'nullable' if exp_null[f.name] else 'non-nullable'}"
        for f in actual
        if f.name in exp_null
        and f.name in exp
        and exp[f.name] == f.type
        and exp_null[f.name] != f.nullable
    ]
    if not problems and expected.names != actual.names:
        problems.append(f"column order {actual.names} differs from the shard's {expected.names}")
    return (
        f"schema does not match shard {shard!r}: {'; '.join(problems)}. "
        f"Write with the shard's schema{evolve} or use a new shard name"
    )


def evolve_schema(current: pa.Schema, incoming: pa.Schema, shard: str, who: str) -> pa.Schema:
    """The shard schema once a write with ``incoming``'s row columns evolves ``current``.

    Only additions are possible, because parts are immutable: a column added
    later is null in every part written before it, so it must be nullable, and
    a column's type never changes (old parts keep theirs). New columns go
    after the existing ones in ``incoming``'s order; columns of ``current``
    that ``incoming`` lacks stay. ``who`` names the write in messages. Raises
    SchemaMismatch naming the column, both types and the fix.
    """
    known = {f.name: f for f in current}
    taken = {n.lower(): n for n in (*current.names, *RESERVED)}
    problems: list[str] = []
    added: list[pa.Field] = []
    for f in incoming:
        old = known.get(f.name)
        if old is not None:
            if old.type != f.type:
                problems.append(
                    f"column {f.name!r} is {f.type} in the write but {old.type} in the shard: a "
                    f"column's type cannot change (parts already written keep {old.type}); cast "
                    f"it back to {old.type}, or write to a new shard"
                )
            continue
        if f.name.lower() in taken:
            problems.append(
                f"new column {f.name!r} collides with {taken[f.name.lower()]!r} (names differ "
                "only in case, which Spark reads as one column, or it is reserved): rename it"
            )
        elif not f.nullable:
            problems.append(
                f"new column {f.name!r} ({f.type}) is non-nullable, but the rows written before "
                "it have no value there (they read as null): make it nullable"
            )
        else:
            taken[f.name.lower()] = f.name
            added.append(f)
    if problems:
        raise SchemaMismatch(
            f"{who}: the columns do not fit shard {shard!r}: {'; '.join(problems)}. "
            "Nothing was written"
        )
    evolved = current
    for f in added:
        evolved = evolved.append(f)
    return evolved


def conform_columns(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with exactly ``schema``'s columns, in its order: the read side of evolution.

    A part written before a column was added lacks it and reads null there;
    columns it has keep their own type (a caller casting to ``schema`` after
    does that). Free when the part already has the schema's columns in order.
    """
    if table.schema.names == schema.names:
        return table
    n = table.num_rows
    have = set(table.column_names)
    fields = [table.schema.field(f.name) if f.name in have else f for f in schema]
    arrays = [table.column(f.name) if f.name in have else pa.nulls(n, f.type) for f in schema]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def conform_updates(
    updates: pa.Table | pa.RecordBatch,
    schema: pa.Schema,
    shard: str,
    *,
    fill_missing: bool = False,
) -> tuple[pa.Table, bool]:
    """Check updates against the shard's schema and add missing ``_diff`` (+1).

    Returns the table in part layout (``_time`` zero-filled when absent) and
    whether the input carried its own ``_time`` column. With ``fill_missing``
    (a merge-schema write) nullable shard columns the updates lack are null.
    """
    if isinstance(updates, pa.RecordBatch):
        updates = pa.Table.from_batches([updates])
    if not isinstance(updates, pa.Table):
        raise InvalidUpdates(
            f"updates must be a pyarrow.Table or RecordBatch, got {type(updates).__name__}"
        )
    names = updates.column_names
    has_time = TIME in names
    row_fields = [f for f in updates.schema if f.name not in RESERVED]
    n = updates.num_rows
    if [(f.name, f.type) for f in row_fields] != [(f.name, f.type) for f in schema]:
        given = {f.name: f.type for f in row_fields}
        missing = [f for f in schema if f.name not in given]
        if not (
            set(given) <= set(schema.names)
            and all(given[f.name] == f.type for f in schema if f.name in given)
            and (not missing or (fill_missing and all(f.nullable for f in missing)))
        ):
            row_schema = pa.schema(row_fields)
            raise SchemaMismatch(
                schema_mismatch_message(shard, schema, row_schema, "write with merge_schema=True")
            )
    time = _checked_column(updates, TIME, TIME_TYPE, 0)
    diff = _checked_column(updates, DIFF, DIFF_TYPE, 1)
    present = set(names)
    columns = [updates.column(f.name) if f.name in present else pa.nulls(n, f.type) for f in schema]
    for f, col in zip(schema, columns, strict=True):
        if not f.nullable and col.null_count:
            raise InvalidUpdates(
                f"column {f.name!r} of shard {shard!r} is non-nullable but {col.null_count} "
                "updates have a null there: fill or drop those rows"
            )
    if n == 0:
        return data_schema(schema).empty_table(), has_time
    table = pa.Table.from_arrays([*columns, time, diff], schema=data_schema(schema))
    return table, has_time


def _checked_column(
    table: pa.Table, name: str, typ: pa.DataType, default: int
) -> pa.ChunkedArray | pa.Array:
    """The column, checked and cast to ``typ``; or ``default`` repeated when it is absent."""
    if name not in table.column_names:
        return constant_column(default, table.num_rows, typ)
    col = table.column(name)
    if col.null_count:
        raise InvalidUpdates(f"column {name!r} has {col.null_count} nulls; every update needs one")
    if col.type == typ:
        return col
    if not pa.types.is_integer(col.type):
        raise InvalidUpdates(f"column {name!r} must be an integer column ({typ}), got {col.type}")
    try:
        return pc.cast(col, typ, safe=True)
    except pa.ArrowInvalid as e:
        raise InvalidUpdates(f"column {name!r} does not fit {typ}: {e}") from e


SMALL_ROWS = 64
"""Up to this many rows, plain Python beats a compute kernel's fixed cost (tiny writes)."""


def _bounds(col: pa.ChunkedArray | pa.Array, rows: int) -> tuple[int, int]:
    if rows <= SMALL_ROWS:
        values = col.to_pylist()
        return min(values), max(values)
    mm = pc.min_max(col)
    return int(mm["min"].as_py()), int(mm["max"].as_py())


def time_bounds(table: pa.Table) -> tuple[Time, Time]:
    """The smallest and largest ``_time`` of a non-empty part table."""
    return _bounds(table.column(TIME), table.num_rows)


def part_ref(
    table: pa.Table,
    key: str | None,
    inline: bytes | None,
    size: int,
    crc: int | None = None,
    fmt: str = PARQUET,
) -> PartRef:
    """Describe a non-empty part: where it lives, its size, and its time and diff ranges.

    Column statistics (for skipping parts on reads) are kept for Blob parts
    only: an inline part is tiny and read straight from state anyway.
    """
    stats = PartStats(with_columns=key is not None)
    stats.add(table)
    return stats.ref(key, inline, size, crc, fmt)


MAX_STAT_STRING = 64


class PartStats:
    """The time, diff and column ranges of a part, gathered table by table as it is written.

    Lets a part be encoded as its rows arrive (no whole-part table to scan at
    the end). Column (min, max) are kept for integer, floating and short string
    columns, ignoring nulls, and only where they compare exactly: a column that
    shows a NaN or a string longer than MAX_STAT_STRING anywhere gets no range
    (a truncated bound could skip a part wrongly).
    """

    def __init__(self, with_columns: bool = True) -> None:
        self.rows = 0
        self._time: tuple[int, int] | None = None
        self._diff: tuple[int, int] | None = None
        self._with_columns = with_columns
        self._columns: dict[str, tuple[Any, Any]] = {}
        self._unusable: set[str] = set()

    def add(self, table: pa.Table | pa.RecordBatch) -> None:
        """Fold the ranges of ``table`` (in part layout) into the part's."""
        n = table.num_rows
        if n == 0:
            return
        self.rows += n
        self._time = _merge(self._time, _bounds(table.column(TIME), n))
        self._diff = _merge(self._diff, _bounds(table.column(DIFF), n))
        if not self._with_columns:
            return
        for f in table.schema:
            if f.name in RESERVED or f.name in self._unusable or not _has_stats(f.type):
                continue
            col = table.column(f.name)
            if col.null_count == len(col):
                continue
            bounds = _column_bounds(col)
            if bounds is None:
                self._unusable.add(f.name)
                continue
            lo, hi = bounds
            if isinstance(lo, str) and (len(lo) > MAX_STAT_STRING or len(hi) > MAX_STAT_STRING):
                self._unusable.add(f.name)
                continue
            self._columns[f.name] = _merge(self._columns.get(f.name), (lo, hi))

    def ref(
        self, key: str | None, inline: bytes | None, size: int, crc: int | None, fmt: str
    ) -> PartRef:
        """The reference of the part these ranges describe (at least one row added)."""
        assert self._time is not None and self._diff is not None, "an empty part has no ref"
        columns = {k: v for k, v in self._columns.items() if k not in self._unusable}
        return PartRef(
            key,
            inline,
            size,
            self.rows,
            self._time[0],
            self._time[1],
            dmin=self._diff[0],
            dmax=self._diff[1],
            stats=columns if self._with_columns else None,
            crc=crc,
            fmt=fmt,
        )


def _column_bounds(col: pa.ChunkedArray | pa.Array) -> tuple[Any, Any] | None:
    """The exact (min, max) of a column's non-null values; None when it holds a NaN.

    A column of one null-free chunk (what the Arrow part encoder hands over)
    takes a numpy path: floats in two SIMD passes that also reveal a NaN (numpy's
    min propagates it), equal-width strings by :func:`_extreme_row`. In a sink
    profile Arrow's ``min_max`` over a 32-byte string column compared row by row
    and cost about as much as writing the part. Anything else goes to ``min_max``.
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) == 1 and chunks[0].null_count == 0:
        arr = chunks[0]
        if pa.types.is_floating(arr.type):
            # A view of the values buffer: Array.to_numpy would import pandas (see
            # constant_column), which a fresh Spark worker needs for nothing else.
            width = arr.type.bit_width // 8
            floats = np.frombuffer(
                arr.buffers()[1], f"<f{width}", count=len(arr), offset=arr.offset * width
            )
            lo = floats.min()
            return None if np.isnan(lo) else (float(lo), float(floats.max()))
        if pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
            values = _equal_width(arr)
            if values is not None:
                return _extreme_row(values, largest=False), _extreme_row(values, largest=True)
    if pa.types.is_floating(col.type) and pc.any(pc.is_nan(col)).as_py():
        return None
    mm = pc.min_max(col)
    return mm["min"].as_py(), mm["max"].as_py()


@dataclass(frozen=True)
class _EqualWidth:
    """A null-free string array whose values all take ``width`` bytes, row ``i`` at
    ``data[first + i * width:]``."""

    data: pa.Buffer
    first: int
    rows: int
    width: int


def _equal_width(arr: pa.Array) -> _EqualWidth | None:
    """The layout of a null-free string array if every value has one width in bytes."""
    n = len(arr)
    offset_type = np.dtype(np.int64 if pa.types.is_large_string(arr.type) else np.int32)
    _, offsets_buf, data = arr.buffers()
    offsets = np.frombuffer(
        offsets_buf, offset_type, count=n + 1, offset=arr.offset * offset_type.itemsize
    )
    first, width = int(offsets[0]), int(offsets[1] - offsets[0])
    if int(offsets[-1]) - first != n * width or not (np.diff(offsets) == width).all():
        return None
    return _EqualWidth(data if data is not None else pa.py_buffer(b""), first, n, width)


def _extreme_row(values: _EqualWidth, largest: bool) -> str:
    """The smallest (or largest) value of an equal-width string array, in bytewise order.

    Bytewise order of UTF-8 is code point order, Python's ``str`` order and
    Arrow's. Values are compared 8 bytes at a time as big-endian integers read
    in place (a strided view, no copy), each window narrowing the candidates
    to those that tie so far: one pass over the first 8 bytes of every value,
    then (for distinct prefixes) next to nothing.
    """
    n, width = values.rows, values.width
    candidates = np.arange(n)
    for start in range(0, width, 8):
        at = values.first + start
        if start + 8 <= width:
            window = np.ndarray((n,), ">u8", values.data, at, (width,))
            keys = window if len(candidates) == n else window[candidates]
        else:  # the last, short window: the same bytes zero-padded in every value
            tail = np.ndarray((n, width - start), np.uint8, values.data, at, (width, 1))
            padded = np.zeros((len(candidates), 8), np.uint8)
            padded[:, : width - start] = tail[candidates]
            keys = padded.view(">u8").ravel()
        best = keys.max() if largest else keys.min()
        candidates = candidates[keys == best]
        if len(candidates) == 1:
            break
    row = values.first + int(candidates[0]) * width
    return memoryview(values.data)[row : row + width].tobytes().decode()


def _has_stats(t: pa.DataType) -> bool:
    return bool(
        pa.types.is_integer(t)
        or pa.types.is_floating(t)
        or pa.types.is_string(t)
        or pa.types.is_large_string(t)
    )


def _merge(a: tuple[Any, Any] | None, b: tuple[Any, Any]) -> tuple[Any, Any]:
    return b if a is None else (min(a[0], b[0]), max(a[1], b[1]))


def new_part_key(shard_id: str, fmt: str = PARQUET) -> str:
    """A fresh, never reused Blob key for a part of ``shard_id``.

    The key starts with its creation time in milliseconds, so GC can tell a
    part staged moments ago (its commit may be on the way) from one a crashed
    writer left behind.
    """
    return f"{shard_id}/part/{time.time_ns() // 1_000_000:013d}-{uuid.uuid4().hex}.{fmt}"


def part_key_created_ms(key: str) -> int | None:
    """The creation time encoded in a part key, or None for a key of another form."""
    name = key.rsplit("/", 1)[-1]
    stamp, sep, _ = name.partition("-")
    return int(stamp) if sep and stamp.isdigit() else None


def release_memory() -> None:
    """Hand Arrow's freed pages back to the OS after a part is done with.

    Arrow's allocator otherwise keeps them cached, so a writer or reader that
    handled many parts shows an RSS far above what it holds (the memory model
    counts what is held: B per part in flight).
    """
    pa.default_memory_pool().release_unused()


def encode_parquet(table: pa.Table) -> memoryview:
    """Encode a part table as Parquet (a view of Arrow's buffer: no copy into ``bytes``).

    No page checksums: the part's whole-object CRC-32 (``PartRef.crc``, checked on
    every fetch) already catches any flipped or missing byte, and page checksums
    cost about a tenth of the encode and a fifth of the decode on top of it.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy", write_statistics=True)
    return memoryview(sink.getvalue())


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
    """What an IPC writer writes a part through: sizes and CRC-32s the bytes on their way out.

    The CRC is folded piece by piece as the bytes pass (zlib-ng, GIL released),
    so the part is checksummed without a second pass over a whole encoded copy.
    """

    closed = False

    def __init__(self, out: BlobWriter) -> None:
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


class ArrowPartEncoder:
    """Streams one Arrow IPC part into a :class:`BlobWriter` as its updates arrive.

    Updates are coalesced into record batches of ``batch_rows`` rows (so a
    reader hands Spark few, large batches; larger inputs are split to that
    size); each is written to ``out`` as soon as it is cut, its statistics
    gathered on the way, and the part's size and CRC-32 are counted as the
    bytes pass. The encoder so holds less than one batch of rows, never the
    part: keeping the batches for one write at the end made a second copy of
    every byte (into the encoded buffer), and their fresh pages cost a page
    fault each, the sink's largest costs in a py-spy profile (coalescing into
    fresh memory 645 samples, encoding into the buffer 405, of 1,354 staging).
    """

    def __init__(self, schema: pa.Schema, out: BlobWriter, batch_rows: int = 65536) -> None:
        self._batch_rows = batch_rows
        self._pending: list[pa.Table] = []
        self._pending_rows = 0
        self.stats = PartStats()
        self.nbytes = 0
        """Arrow bytes added so far (what the part holds decoded)."""
        self.rows = 0
        """Updates added so far."""
        self._sink = _ChecksumSink(out)
        options = pa.ipc.IpcWriteOptions(compression=ARROW_COMPRESSION, use_threads=False)
        self._writer = pa.ipc.new_stream(self._sink, schema, options=options)

    def write(self, table: pa.Table) -> None:
        """Add updates in part layout."""
        if table.num_rows == 0:
            return
        self.nbytes += table.nbytes
        self.rows += table.num_rows
        self._pending.append(table)
        self._pending_rows += table.num_rows
        if self._pending_rows >= self._batch_rows:
            self._cut_pending()

    def _cut_pending(self) -> None:
        if not self._pending:
            return
        table = pa.concat_tables(self._pending).combine_chunks()
        self._pending.clear()
        self._pending_rows = 0
        self.stats.add(table)  # per coalesced batch: a few kernel calls per batch_rows rows
        for batch in table.to_batches(max_chunksize=self._batch_rows):
            self._writer.write_batch(batch)

    def finish(self) -> tuple[int, int]:
        """End the IPC stream; the part's size in bytes and its CRC-32 (``out`` not committed)."""
        self._cut_pending()
        self._writer.close()
        return self._sink.size, self._sink.crc


def encode_inline(table: pa.Table) -> bytes:
    """Encode a tiny part as an Arrow IPC stream, cheap enough to live in a state diff."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


@dataclass(frozen=True)
class LeasedPart:
    """A part handed out by a snapshot or listen, with everything a remote process needs.

    The reader keeps updates with ``lower <= time < upper`` (after the part's
    ``ts_rewrite``) and, for a snapshot, advances every time to ``as_of``.
    ``seqno`` is the SeqNo of the state the part was read from: the holder of
    the lease on it keeps GC from deleting the part until it is returned.
    """

    shard_id: str
    blob_uri: str
    part: PartRef
    lower: Time
    upper: Time
    as_of: Time | None
    seqno: int

    def to_json(self) -> dict[str, Any]:
        """Encode for shipping to another process (a Spark InputPartition)."""
        return {
            "shard": self.shard_id,
            "blob": self.blob_uri,
            "part": self.part.to_json(),
            "lower": self.lower,
            "upper": self.upper,
            "as_of": self.as_of,
            "seqno": self.seqno,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> LeasedPart:
        """Decode what :meth:`to_json` produced."""
        return cls(
            shard_id=str(d["shard"]),
            blob_uri=str(d["blob"]),
            part=PartRef.from_json(d["part"]),
            lower=int(d["lower"]),
            upper=int(d["upper"]),
            as_of=None if d.get("as_of") is None else int(d["as_of"]),
            seqno=int(d["seqno"]),
        )

    @property
    def needs_filter(self) -> bool:
        """False when every update of the part is inside the bounds (the common case)."""
        return not (
            self.lower <= self.part.effective_min_time and self.part.effective_max_time < self.upper
        )


def part_checksum(data: bytes | bytearray | memoryview) -> int:
    """The CRC-32 of a part's bytes, as ``PartRef.crc`` records it (zlib's polynomial).

    zlib-ng's folding implementation gives the same value as ``zlib.crc32`` at
    10-20 GB/s where zlib managed 2-3 on this project's machines (64 MiB, best of 5),
    and like zlib it releases the GIL: a profile of a Spark read had zlib's CRC as
    persist's largest cost, about a tenth of the executors' CPU.
    """
    return int(_crc32(data))


def fetch_part_bytes(blob: Blob, part: PartRef, shard_id: str) -> memoryview:
    """The stored bytes of a part, checked against its CRC; PartNotFound when Blob no longer
    has it. A view (``Blob.get_view``): a file part is mapped, not copied."""
    if part.inline is not None:
        return memoryview(part.inline)
    assert part.key is not None
    data = blob.get_view(part.key)
    if data is None:
        raise PartNotFound(
            f"part {part.key!r} of shard {shard_id!r} is missing from blob {blob.uri}: it was "
            "deleted by GC (read with a lease, or from a newer as_of) or the blob store is wrong"
        )
    if part.crc is not None and part_checksum(data) != part.crc:
        raise CorruptData(
            f"part {part.key!r} of shard {shard_id!r} in blob {blob.uri} does not match its "
            "checksum: the object is corrupt (restore it from a backup of the blob store)"
        )
    return data


def iter_part_batches(
    data: bytes | memoryview, part: PartRef, shard_id: str, batch_rows: int = 65536
) -> Iterator[pa.RecordBatch]:
    """The stored updates of a part's bytes, batch by batch, whatever its format.

    Arrow parts (and inline ones) come in the batches they were written in
    (about ``batch_rows`` rows for a staged part), read in place: views of
    ``data``, no copy. Parquet parts are decoded ``batch_rows`` rows at a time.
    """
    try:
        if part.inline is not None or part.fmt == ARROW:
            yield from pa.ipc.open_stream(pa.py_buffer(data))
        elif part.fmt == PARQUET:
            parquet = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data)))
            yield from parquet.iter_batches(batch_size=batch_rows)
        else:
            raise CorruptData(
                f"part {part.key!r} of shard {shard_id!r} has format {part.fmt!r}, which this "
                f"version cannot read (it reads {', '.join(PART_FORMATS)}): upgrade the reader"
            )
    except (pa.ArrowInvalid, OSError) as e:
        where = "an inline part" if part.key is None else f"part {part.key}"
        raise CorruptData(f"{where} of shard {shard_id!r} cannot be decoded: {e}") from e


def with_times(
    table: pa.Table, times: pa.Array | pa.ChunkedArray, time_type: pa.DataType = TIME_TYPE
) -> pa.Table:
    """Replace the ``_time`` column (non-null, of ``time_type``) so tables concatenate."""
    idx = table.schema.get_field_index(TIME)
    return table.set_column(idx, pa.field(TIME, time_type, nullable=False), times)


@functools.lru_cache(maxsize=16)
def constant_column(value: int, rows: int, typ: pa.DataType) -> pa.Array:
    """``rows`` copies of the integer ``value`` as a ``typ`` array (shared: Arrow arrays are
    immutable, and a read or write asks for a handful of lengths, so each is built a few
    times rather than once per batch). Built with numpy: ``pa.repeat`` of a scalar took
    0.5 ms per 65,536 rows, twenty times ``np.full``."""
    # No pa.scalar, pa.array(ndarray) or DataType.to_pandas_dtype() here: each imports
    # pandas, ~0.2 s in every fresh Spark worker, which needs it for nothing else.
    unsigned = pa.types.is_unsigned_integer(typ)
    lo, hi = (
        (0, 2**typ.bit_width - 1)
        if unsigned
        else (-(2 ** (typ.bit_width - 1)), 2 ** (typ.bit_width - 1) - 1)
    )
    if not lo <= value <= hi:
        raise OverflowError(f"{value} does not fit {typ}")
    kind = "u" if unsigned else "i"
    values = np.full(rows, value, dtype=np.dtype(f"{kind}{typ.bit_width // 8}"))
    return pa.Array.from_buffers(typ, rows, [None, pa.py_buffer(values)])


def int_scalar(value: int, typ: pa.DataType) -> pa.Scalar:
    """The integer ``value`` as a ``typ`` scalar for compute kernels, without pandas (which
    ``pa.scalar`` and a plain Python operand import: ~0.2 s, holding the GIL, in a process
    that needs it for nothing else; a profile of the Spark sink's committer had that import
    in its first compaction at a third of the pipeline's Python CPU)."""
    return constant_column(value, 1, typ)[0]


def shape_updates(
    table: pa.Table | pa.RecordBatch, leased: LeasedPart, time_type: pa.DataType = TIME_TYPE
) -> pa.Table:
    """Apply a leased part's ts_rewrite, time bounds and as_of to decoded updates.

    ``_time`` comes out as ``time_type``: the part layout's uint64, or int64
    for a consumer with no unsigned type (Spark); a time that does not fit it
    raises ``ArrowInvalid``. A snapshot part wholly inside its bounds (the
    common case) only gets its times set to ``as_of``: the ``ts_rewrite`` it
    would otherwise apply first cannot change what a constant replaces.
    """
    if isinstance(table, pa.RecordBatch):
        table = pa.Table.from_batches([table])
    part = leased.part
    if leased.as_of is not None and not leased.needs_filter:
        times = constant_column(leased.as_of, table.num_rows, time_type)
        table = with_times(table, times, time_type)
        return _negated(table) if part.negate else table
    if part.ts_rewrite is not None and part.min_time < part.ts_rewrite:
        times = pc.max_element_wise(table.column(TIME), int_scalar(part.ts_rewrite, TIME_TYPE))
        table = with_times(table, times)
    if leased.needs_filter:
        t = table.column(TIME)
        mask = pc.and_(
            pc.greater_equal(t, int_scalar(leased.lower, TIME_TYPE)),
            pc.less(t, int_scalar(leased.upper, TIME_TYPE)),
        )
        table = table.filter(mask)
    if part.negate:
        table = _negated(table)
    if leased.as_of is not None:
        times = constant_column(leased.as_of, table.num_rows, time_type)
        return with_times(table, times, time_type)
    if time_type != TIME_TYPE:
        table = with_times(table, pc.cast(table.column(TIME), time_type), time_type)
    return table


def _negated(table: pa.Table) -> pa.Table:
    """The updates with every ``_diff`` negated (a retraction by reference)."""
    idx = table.schema.get_field_index(DIFF)
    return table.set_column(idx, table.schema.field(idx), pc.negate(table.column(DIFF)))


def consolidate(table: pa.Table, row_columns: list[str]) -> pa.Table:
    """Sum ``_diff`` of equal (row, time) and drop the zeros: the multiset the updates denote."""
    if table.num_rows == 0:
        return table
    keys = [*row_columns, TIME]
    grouped = table.group_by(keys, use_threads=False).aggregate([(DIFF, "sum")])
    out = pa.Table.from_arrays(
        [*(grouped.column(k) for k in keys), grouped.column(f"{DIFF}_sum")],
        schema=table.schema,
    )
    return out.filter(pc.not_equal(out.column(DIFF), int_scalar(0, DIFF_TYPE)))
