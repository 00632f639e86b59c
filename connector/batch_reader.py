"""``spark.read.format("persist")``: the collection at ``asOf``, split over tasks by bytes.

With ``readChanges`` (Delta's ``readChangeFeed``) it is instead every update
in a time range ``[start, end)``, each with its own ``_time`` and ``_diff``,
nothing consolidated away (see :mod:`pyspark_persist.state.changes`). With
``changeTypes`` too, on a keyed shard, the splits are merged so that one
task reads every part of a time, and pairs its updates by key
(:mod:`pyspark_persist.change_types`).

Each output row carries its multiplicity in ``_diff`` and ``_time = asOf``.
When no part holds a retraction (append-only data, and the common case after
an overwrite, whose retractions cancel at planning), parts are spread over
tasks by size and read as they are. When some do, one task reads them all and
consolidates, so a retracted row never shows up; compaction keeps that set
small.

The snapshot's SeqNo is leased by a reader registered while planning, so GC
keeps its parts. Spark reports nothing back when batch tasks finish, so the
lease is held by the job's own work: a task heartbeats it once a third of the
lease has passed since planning or since its last heartbeat, when it starts
and while it reads. It therefore lasts as long as the job runs, and runs out
``leaseSeconds`` (default ``reader_lease_s``, 60 s) after the last task
stopped. Only a job whose tasks all wait longer than that (a queue on a busy
cluster) needs a longer ``leaseSeconds``; its tasks then fail with
LeaseExpired naming the option, never with a missing part. A task that
starts within a third of the lease touches no Consensus at all (no
connection, no state fetch, no compare-and-set before its first batch): the
planner's registration still holds for two thirds of the lease. The planner's
clock and the tasks' are compared, so executors whose clocks run more than a
third of the lease behind the driver's may beat late, and then fail with
LeaseExpired, never read a part GC took.

``pushFilters`` (opt-in: Spark refuses a reader that implements it unless
``spark.sql.python.filterPushdown.enabled`` is true, so it is used only with
``.option("filterPushdown", "true")``) skips parts whose per-column min/max
show no row can match; Spark still applies every filter to the rows read.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
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

from pyspark_persist.change_types import (
    CHANGE_TYPE,
    colocate_times,
    label_changes,
    pairing_keys,
)
from pyspark_persist.options import (
    AS_OF,
    ENDING_SEQNO,
    READ_CHANGES,
    STARTING_SEQNO,
    PersistOptions,
)
from pyspark_persist.source import blob_for, client_for, freeze_worker_heap
from pyspark_persist.state import (
    DIFF,
    TIME,
    LeasedPart,
    PartRef,
    PersistClient,
    PersistConfig,
    ReadHandle,
    ReadLimits,
    Shard,
    check_change_range,
    check_readable,
    conform_columns,
    consolidate,
    iter_parts,
    open_consensus,
    plan_read,
    repeat_by_diff,
    state_at,
)
from pyspark_persist.state.errors import LeaseExpired, ShardDropped, ShardNotFound
from pyspark_persist.stream_reader import (
    PersistInputPartition,
    check_diffs_shown,
    read_partition,
)

log = logging.getLogger(__name__)


class BatchPartition(PersistInputPartition):
    """A read task of a batch read, with the lease that holds its parts (see the module doc)."""

    def __init__(
        self,
        blob_uri: str,
        parts: Sequence[LeasedPart],
        lease: BatchLease,
        change_keys: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(blob_uri, parts, change_keys)
        self.lease = lease


class ConsolidatingPartition(BatchPartition):
    """A task that must consolidate its parts (some hold retractions).

    Rows are consolidated whole, so it reads every column of ``row_schema`` (the
    shard's at planning) whatever the query returns, then keeps the query's: a
    column subset sees the very rows and diffs a full read does.
    """

    def __init__(
        self,
        blob_uri: str,
        parts: Sequence[LeasedPart],
        lease: BatchLease,
        row_schema: pa.Schema,
        change_keys: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(blob_uri, parts, lease, change_keys)
        self.row_schema = row_schema


@dataclass(frozen=True)
class BatchLease:
    """The reader and SeqNo a batch read planned with, for its tasks to heartbeat."""

    reader_id: str
    seqno: int
    lease_ms: int
    planned_ms: int
    """When the planner registered the reader (its clock): the lease runs from then."""
    incarnation: str
    """The incarnation of the shard planned from: a task finding another one (the shard was
    dropped and created again) fails with ShardDropped rather than heartbeat it."""


_lease_clients: dict[tuple[str, str], PersistClient] = {}
_lease_clients_lock = threading.Lock()


def lease_client(opts: PersistOptions) -> PersistClient:
    """The client a task heartbeats through: one per location per process, reused by tasks.

    Not :func:`client_for`'s: a task's heartbeat must not start compaction or
    GC threads in an executor, nor subscribe it to PubSub.
    """
    key = (opts.blob, opts.consensus)
    with _lease_clients_lock:
        client = _lease_clients.get(key)
        if client is None:
            client = _lease_clients[key] = PersistClient(
                blob_for(opts.blob),
                open_consensus(opts.consensus),
                config=PersistConfig(maintenance=False),
            )
        return client


def clock_ms() -> int:
    """A task's clock: the wall clock in milliseconds, which persist clients stamp leases
    with (the planner's registration time included) unless given another."""
    return time.time_ns() // 1_000_000


class _LeaseKeeper:
    """Heartbeats one batch read's lease from a task, every third of the lease.

    The first third after planning needs no heartbeat (the registration holds),
    so the task opens its Consensus client, and fetches state, only when a beat
    is due: a short job's tasks never do.
    """

    def __init__(self, opts: PersistOptions, lease: BatchLease) -> None:
        self._opts = opts
        self._lease = lease
        self._shard: Shard | None = None
        self._last_ms = lease.planned_ms

    def beat(self) -> None:
        """Extend the lease if a third of it passed since the last beat; LeaseExpired if gone."""
        now = clock_ms()
        if now - self._last_ms < self._lease.lease_ms // 3:
            return
        lease = self._lease
        if self._shard is None:
            self._shard = self._open()
        if not self._shard.heartbeat_reader(lease.reader_id, seqno=lease.seqno, now_ms=now):
            raise LeaseExpired(
                f"persist: this batch read of shard {self._opts.shard!r} lost its lease on the "
                f"parts it planned (reader {lease.reader_id}): no task of the job ran for "
                f"{lease.lease_ms / 1000:g} s. Re-run the read, with a longer "
                '.option("leaseSeconds", ...) if its tasks wait that long to start'
            )
        self._last_ms = now

    def _open(self) -> Shard:
        """The lease client's handle of the shard, if it is still the incarnation planned from
        (it then stays bound to it); ShardDropped otherwise."""
        try:
            shard = lease_client(self._opts).open_shard(self._opts.shard, create=False)
            if shard.machine.state().incarnation == self._lease.incarnation:
                return shard
        except ShardNotFound:
            pass
        raise ShardDropped(
            f"persist: shard {self._opts.shard!r} was dropped (persist shards drop) while this "
            "batch read of it ran: its parts are gone. Re-run the read to read the shard of that "
            "name now, if there is one"
        )


class PersistBatchReader(DataSourceReader):
    """The batch reader; see the module doc."""

    def __init__(self, opts: PersistOptions, schema: StructType) -> None:
        self._opts = opts
        self._schema = schema
        self._filters: list[Filter] = []
        self._share = 1.0
        """The share of each part's bytes the read takes (set by :meth:`partitions`)."""

    def partitions(self) -> Sequence[InputPartition]:
        """Lease the snapshot at ``asOf`` and split it (driver)."""
        from pyspark_persist.schema import check_change_columns, read_columns, read_share

        client = client_for(self._opts)
        shard = client.open_shard(self._opts.shard, create=False)
        names = read_columns(shard.schema, self._schema, self._opts.shard, self._opts.columns)
        self._share = read_share(shard.schema, names)
        if self._opts.change_types:
            check_change_columns(self._schema, shard.machine.state().keys, self._opts.shard)
        # The driver does not heartbeat: Spark tells a batch reader nothing when its tasks
        # finish. The tasks heartbeat the lease while they run (BatchLease), and once they are
        # done it runs out after leaseSeconds (default reader_lease_s).
        planned_ms = shard.machine.clock_ms()
        reader = ReadHandle(shard.machine, lease_s=self._opts.lease_seconds)
        lease_ms = int((self._opts.lease_seconds or shard.machine.config.reader_lease_s) * 1000)
        if self._opts.read_changes:
            return self._change_partitions(shard, client.blob.uri, reader, lease_ms, planned_ms)
        as_of = self._opts.as_of
        if as_of is None:
            as_of = reader.latest_as_of()
        state = shard.machine.fetch_latest()
        name = f"persist: {self._opts.spelled(AS_OF)}"
        check_readable(as_of, state.since, state.upper, name, self._opts.shard)
        filters = self._filters
        plan = reader.snapshot_plan(as_of, self._split_limits(), lambda p: _skip(p, filters))
        if filters:
            log.debug("persist: %s parts left after the pushed filters", len(plan.parts))
        lease = BatchLease(reader.reader_id, plan.seqno, lease_ms, planned_ms, state.incarnation)
        # A snapshot (consolidated) has only insertions: labelled by sign, nothing to pair.
        labels = () if self._opts.change_types else None
        if plan.may_retract:
            # The newest schema this process knows covers every part of the plan's state.
            return [
                ConsolidatingPartition(client.blob.uri, plan.parts, lease, shard.schema, labels)
            ]
        return [BatchPartition(client.blob.uri, s, lease, labels) for s in plan.splits]

    def _split_limits(self) -> ReadLimits:
        """Split by splitSizeBytes of what the read takes of each part (all of its bytes, or
        its share for a column subset: :func:`~pyspark_persist.schema.read_share`), over at
        least minPartitions tasks."""
        return ReadLimits(
            split_bytes=max(1, round(self._opts.split_size_bytes / self._share)),
            min_splits=self._opts.min_partitions,
        )

    def _change_partitions(
        self,
        shard: Shard,
        blob_uri: str,
        reader: ReadHandle,
        lease_ms: int,
        planned_ms: int,
    ) -> Sequence[InputPartition]:
        """readChanges: every update in [start, end) with its own time, unconsolidated.

        The reader registered just before holds the state planned from (its SeqNo) and
        its since, so neither GC nor compaction can take the range away meanwhile; the
        tasks heartbeat that hold as a snapshot read's tasks do.
        """
        opts = self._opts
        state = shard.machine.state()
        lower, upper = opts.starting_time or 0, opts.ending_time
        if opts.starting_seqno is not None or opts.ending_seqno is not None:
            past = shard.replay()
            if opts.starting_seqno is not None:
                name = f"persist: {opts.spelled(STARTING_SEQNO)}"
                lower = state_at(past, opts.starting_seqno - 1, name).upper
            if opts.ending_seqno is not None:
                upper = state_at(
                    past, opts.ending_seqno, f"persist: {opts.spelled(ENDING_SEQNO)}"
                ).upper
        if upper is None:
            upper = state.upper
        check_change_range(state, lower, upper, f"persist: {opts.spelled(READ_CHANGES)}")
        plan = plan_read(state, blob_uri, lower=lower, upper=upper, limits=self._split_limits())
        check_diffs_shown(self._schema, plan.parts, opts.shard)
        lease = BatchLease(reader.reader_id, plan.seqno, lease_ms, planned_ms, state.incarnation)
        keys = pairing_keys(state.keys, plan.splits) if opts.change_types else None
        splits = colocate_times(plan.splits) if keys else plan.splits
        return [BatchPartition(blob_uri, s, lease, keys) for s in splits]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Stream one task's parts as Arrow batches (executor)."""
        from pyspark_persist.schema import output_arrow_schema

        if not isinstance(partition, BatchPartition):
            return  # partitions() found nothing to read: Spark still runs one (None) task
        if not isinstance(partition, ConsolidatingPartition):
            keeper = _LeaseKeeper(self._opts, partition.lease)
            keeper.beat()
            for batch in read_partition(partition, self._schema):
                keeper.beat()  # a no-op until a third of the lease has passed
                yield batch
            return
        freeze_worker_heap()
        target = output_arrow_schema(self._schema)
        rows = pa.schema([f for f in target if f.name != CHANGE_TYPE])
        keeper = _LeaseKeeper(self._opts, partition.lease)
        keeper.beat()
        rows = partition.row_schema
        whole = pa.schema(
            [*rows, pa.field(TIME, pa.int64(), False), pa.field(DIFF, pa.int64(), False)]
        )
        blob = blob_for(partition.blob_uri)
        parts = []
        for table in iter_parts(blob, partition.leased_parts(), schema=rows, time_type=pa.int64()):
            keeper.beat()
            parts.append(table.cast(whole))
        if not parts:
            return
        table = consolidate(pa.concat_tables(parts), rows.names)
        if DIFF not in target.names:
            table = repeat_by_diff(table, self._opts.shard)
        shown = pa.schema([f for f in target if f.name != CHANGE_TYPE])
        table = conform_columns(table, shown).cast(shown)
        if partition.change_keys is not None:
            table = label_changes(table, partition.change_keys)
        yield from table.cast(target).to_batches()


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
