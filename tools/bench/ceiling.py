"""The ceilings of Spark's Python Data Source API, measured beside persist in the Spark benchmarks.

A Python source's rows travel from the Python worker to the JVM as Arrow batches,
where Spark turns them into rows one at a time; a Python sink's rows travel the other
way. Those conversions are Spark's, and on a small machine they alone can cost more
than Spark's own Parquet reader or writer spends in all. To tell persist's cost from
the API's, the benchmarks run two do-nothing peers in the same Spark session:

- ``persist-bench-no-io``: a source that yields ``rows`` rows of the read schema from
  batches built once in memory (no fetch, no decode), over ``partitions`` tasks;
- ``persist-bench-in-memory``: the same, but every batch a task yields is a distinct copy
  held in its worker's memory (built on the worker's first task and kept), so every byte
  Spark takes is a byte of its own, as a real source's are (persist's: its parts in the
  page cache), and none is fetched, checked or decoded. The no-I/O source hands over one
  batch again and again, whose few MiB may stay in the CPU's caches; this peer shows
  whether that flatters the ceiling (measured, it did not: see
  bench-report/history.md);
- ``persist-bench-discard``: a sink whose tasks count the Arrow batches they receive
  and keep nothing (batch writes), and whose streaming writer drains them and commits
  nothing: the per-phase floor of any Python streaming sink;
- ``persist-bench-no-io-stream``: a streaming source whose every micro-batch is one
  row made in memory (offsets a counter kept in the driver's source process): the
  per-phase floor of any Python streaming source.

Whatever these reach is the most any Python source or sink reaches on the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import ReadLimit
from pyspark.sql.types import LongType, StructField, StructType

NO_IO = "persist-bench-no-io"
IN_MEMORY = "persist-bench-in-memory"
DISCARD = "persist-bench-discard"
NO_IO_STREAM = "persist-bench-no-io-stream"
BATCH_ROWS = 65536
"""Rows per yielded batch: what persist's reader yields (``iter_parts``' slice size)."""


_batches: dict[tuple[str, str, int], pa.RecordBatch] = {}
"""The no-I/O source's batch, built once per Python worker process and reused by its tasks:
building it (the benchmark's strings) cost a tenth of a second per task, which the ceiling
would otherwise pay in every scan, understating it. Keyed by the builder's name, because
Spark hands each task a fresh unpickled copy of the function."""


def _key(make_batch: Callable[[int], pa.RecordBatch], rows: int) -> tuple[str, str, int]:
    return make_batch.__module__, make_batch.__qualname__, rows


def _batch(make_batch: Callable[[int], pa.RecordBatch], rows: int) -> pa.RecordBatch:
    key = _key(make_batch, rows)
    batch = _batches.get(key)
    if batch is None:
        batch = _batches[key] = make_batch(rows)
    return batch


_copies: dict[tuple[str, str, int], list[pa.RecordBatch]] = {}
"""The in-memory source's distinct batches, per Python worker process (grown to the largest
share a task of it was asked for), so a timed scan builds none of them."""


def _distinct_batches(
    make_batch: Callable[[int], pa.RecordBatch], rows: int, total: int
) -> list[pa.RecordBatch]:
    """At least ``total`` rows as distinct copies of the ``rows``-row batch."""
    copies = _copies.setdefault(_key(make_batch, rows), [])
    batch = _batch(make_batch, rows)
    while len(copies) * rows < total:
        copies.append(pa.concat_batches([batch]))  # a copy: buffers of its own
    return copies


class NoIOPartition(InputPartition):
    """One task's share of the rows."""

    def __init__(self, rows: int) -> None:
        self.rows = rows


class NoIOReader(DataSourceReader):
    """Yields the same in-memory batch over and over: only Spark's transfer costs; with
    ``distinct``, a distinct in-memory copy each time (see the module doc)."""

    def __init__(
        self,
        schema: StructType,
        rows: int,
        partitions: int,
        make_batch: Callable[[int], pa.RecordBatch],
        distinct: bool = False,
    ) -> None:
        self._schema = schema
        self._rows = rows
        self._partitions = partitions
        self._make_batch = make_batch
        self._distinct = distinct

    def partitions(self) -> list[NoIOPartition]:
        """``rows`` spread evenly over ``partitions`` tasks."""
        n = self._partitions
        return [NoIOPartition(self._rows // n + (1 if i < self._rows % n else 0)) for i in range(n)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Yield one batch (built once per worker) over and over, or with ``distinct`` each
        of the worker's copies in turn, the last slice at the end, until the share is out."""
        assert isinstance(partition, NoIOPartition)
        left = partition.rows
        if self._distinct:
            batches = _distinct_batches(self._make_batch, BATCH_ROWS, left)
        else:
            batches = [_batch(self._make_batch, BATCH_ROWS)]
        i = 0
        while left > 0:
            batch = batches[i % len(batches)]
            yield batch if left >= batch.num_rows else batch.slice(0, left)
            left -= batch.num_rows
            i += 1


def no_io_source(
    struct: StructType,
    rows: int,
    partitions: int,
    make_batch: Callable[[int], pa.RecordBatch],
    distinct: bool = False,
    name: str | None = None,
) -> type[DataSource]:
    """A source class named ``name`` (default ``NO_IO``, ``IN_MEMORY`` if ``distinct``) that
    yields ``rows`` rows of ``make_batch`` batches.

    ``make_batch(n)`` must return an ``n``-row batch exactly in Spark's Arrow form of
    ``struct``. The class carries its settings, so registering it is all it takes; sources
    of other settings registered in one session need names of their own.
    """
    source_name = name or (IN_MEMORY if distinct else NO_IO)

    class NoIOSource(DataSource):
        @classmethod
        def name(cls) -> str:
            return source_name

        def schema(self) -> StructType:
            return struct

        def reader(self, schema: StructType) -> DataSourceReader:
            return NoIOReader(schema, rows, partitions, make_batch, distinct)

    return NoIOSource


class DiscardWriter(DataSourceArrowWriter):
    """Receives every Arrow batch of its task and keeps nothing."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        """Drain the task's batches."""
        for _ in iterator:
            pass
        return WriterCommitMessage()


class DiscardStreamWriter(DataSourceStreamArrowWriter):
    """Drains each task's Arrow batches; a micro-batch's commit does nothing."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        """Drain the task's batches."""
        for _ in iterator:
            pass
        return WriterCommitMessage()

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Nothing to make visible."""


class DiscardSink(DataSource):
    """``df.write(Stream).format(DISCARD)``: the cost of handing rows to a Python sink, alone."""

    @classmethod
    def name(cls) -> str:
        return DISCARD

    def writer(self, schema: StructType, overwrite: bool) -> DiscardWriter:
        return DiscardWriter()

    def streamWriter(self, schema: StructType, overwrite: bool) -> DiscardStreamWriter:
        return DiscardStreamWriter()


class NoIOStreamReader(DataSourceStreamReader):
    """Every micro-batch is one new row, ``value`` = its offset: nothing read, nothing kept.

    ``every_s``: a new row at most once in that many seconds (0: one every time Spark asks,
    so micro-batches run back to back). The freshness benchmark's floor takes one a second,
    the cadence of its other readers: run back to back, the floor's reader kept a core busy
    and slowed the sink query beside it.
    """

    SCHEMA = StructType([StructField("value", LongType(), False)])

    def __init__(self, every_s: float = 0.0) -> None:
        self._every_s = every_s
        self._advanced = 0.0

    def initialOffset(self) -> dict[str, int]:
        """Start at 0."""
        return {"n": 0}

    def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
        """One row more than ``start``, or ``start`` while ``every_s`` has not passed."""
        now = time.monotonic()
        if now - self._advanced < self._every_s:
            return start
        self._advanced = now
        return {"n": start["n"] + 1}

    def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
        """One task holding the range."""
        return [InputPartition((start["n"], end["n"]))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The range's offsets as one batch."""
        lo, hi = partition.value
        yield pa.RecordBatch.from_pydict(
            {"value": pa.array(range(lo, hi), pa.int64())},
            schema=pa.schema([pa.field("value", pa.int64(), nullable=False)]),
        )

    def commit(self, end: dict[str, int]) -> None:
        """Nothing to release."""


class NoIOStreamSource(DataSource):
    """``spark.readStream.format(NO_IO_STREAM)``: the floor of a Python streaming source."""

    @classmethod
    def name(cls) -> str:
        return NO_IO_STREAM

    def schema(self) -> StructType:
        return NoIOStreamReader.SCHEMA

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """Option ``everySeconds``: see :class:`NoIOStreamReader` (default 0)."""
        return NoIOStreamReader(float(self.options.get("everySeconds", 0)))
