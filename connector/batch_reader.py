"""``spark.read.format("persist")``: the collection at ``asOf``, split over tasks by bytes.

Each output row carries its multiplicity in ``_diff`` and ``_time = asOf``.
When no part holds a retraction (append-only data, and the common case after
an overwrite, whose retractions cancel at planning), parts are spread over
tasks by size and read as they are. When some do, one task reads them all and
consolidates, so a retracted row never shows up; compaction keeps that set
small. The snapshot's SeqNo stays leased for ``reader_lease_s`` (60 s) after
planning: Spark reports nothing back when batch tasks finish.

``pushFilters`` (opt-in: Spark refuses a reader that implements it unless
``spark.sql.python.filterPushdown.enabled`` is true, so it is used only with
``.option("filterPushdown", "true")``) skips parts whose per-column min/max
show no row can match; Spark still applies every filter to the rows read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceReader,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    LessThan,
    LessThanOrEqual,
)
from pyspark.sql.types import StructType

from pyspark_persist.options import PersistOptions
from pyspark_persist.source import blob_for, client_for
from pyspark_persist.state.errors import InvalidFrontier
from pyspark_persist.state.parts import consolidate
from pyspark_persist.state.read import ReadHandle, iter_parts
from pyspark_persist.state.state import PartRef
from pyspark_persist.stream_reader import PersistInputPartition, read_partition, split_parts

log = logging.getLogger(__name__)


class ConsolidatingPartition(PersistInputPartition):
    """A task that must consolidate its parts (some hold retractions)."""


class PersistBatchReader(DataSourceReader):
    """The batch reader; see the module doc."""

    def __init__(self, opts: PersistOptions, schema: StructType) -> None:
        self._opts = opts
        self._schema = schema
        self._filters: list[Filter] = []

    def partitions(self) -> Sequence[InputPartition]:
        """Lease the snapshot at ``asOf`` and split it (driver)."""
        client = client_for(self._opts)
        shard = client.open_shard(self._opts.shard, create=False)
        # Not heartbeated: Spark tells a batch reader nothing when its tasks finish, so the
        # lease on what it planned simply runs out after reader_lease_s.
        reader = ReadHandle(shard.machine, shard.schema)
        as_of = self._opts.as_of
        if as_of is None:
            as_of = reader.latest_as_of()
        state = shard.machine.fetch_latest()
        if as_of < state.since or as_of >= state.upper:
            raise InvalidFrontier(
                f"persist: asOf {as_of} is outside the readable times [{state.since}, "
                f"{state.upper - 1}] of shard {self._opts.shard!r}: pick a time in that range "
                "(earlier times were compacted away)"
            )
        snap = reader.snapshot(as_of)
        parts = [p for p in snap.parts if not _skip(p.part, self._filters)]
        skipped = len(snap.parts) - len(parts)
        if skipped:
            log.debug("persist: pushed filters skipped %s of %s parts", skipped, len(snap.parts))
        if any((p.part.effective_dmin or -1) <= 0 for p in parts):
            return [ConsolidatingPartition(client.blob.uri, parts)] if parts else []
        splits = split_parts(parts, self._opts.split_size_bytes, self._opts.min_partitions)
        return [PersistInputPartition(client.blob.uri, s) for s in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Stream one task's parts as Arrow batches (executor)."""
        from pyspark_persist.schema import output_arrow_schema

        if not isinstance(partition, PersistInputPartition):
            return  # partitions() found nothing to read: Spark still runs one (None) task
        if not isinstance(partition, ConsolidatingPartition):
            yield from read_partition(partition, self._schema)
            return
        target = output_arrow_schema(self._schema)
        row_columns = [n for n in target.names if n not in ("_time", "_diff")]
        parts = list(iter_parts(blob_for(partition.blob_uri), partition.leased_parts()))
        if parts:
            table = consolidate(pa.concat_tables(parts), row_columns)
            yield from table.select(target.names).cast(target).to_batches()


class PersistPushdownBatchReader(PersistBatchReader):
    """The batch reader with ``pushFilters`` (see the module doc for why it is opt-in)."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        """Keep the filters to skip parts; return all of them, for Spark to apply to rows."""
        self._filters = list(filters)
        return filters


def make_batch_reader(opts: PersistOptions, schema: StructType) -> PersistBatchReader:
    """The reader class the options ask for."""
    if opts.filter_pushdown:
        return PersistPushdownBatchReader(opts, schema)
    return PersistBatchReader(opts, schema)


def _skip(part: PartRef, filters: Sequence[Filter]) -> bool:
    """True when the part's statistics prove that some filter matches none of its rows."""
    if not part.stats:
        return False
    return any(_excludes(part.stats, f) for f in filters)


def _excludes(stats: Any, f: Filter) -> bool:
    attr = getattr(f, "attribute", None)
    if not attr or len(attr) != 1 or attr[0] not in stats:
        return False
    lo, hi = stats[attr[0]]
    try:
        if isinstance(f, EqualTo):
            return bool(f.value < lo or f.value > hi)
        if isinstance(f, GreaterThan):
            return bool(hi <= f.value)
        if isinstance(f, GreaterThanOrEqual):
            return bool(hi < f.value)
        if isinstance(f, LessThan):
            return bool(lo >= f.value)
        if isinstance(f, LessThanOrEqual):
            return bool(lo > f.value)
        if isinstance(f, In):
            return all(v < lo or v > hi for v in f.value)
    except TypeError:
        return False  # a value of another type than the column: never skip on it
    return False
