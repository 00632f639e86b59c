"""The streaming source of several shards: ``readStream.format("persist").option("shards", ...)``.

::

    orders_and_items = (
        spark.readStream.format("persist").option("shards", "orders,order_items").load()
    )

One query reads every shard named, each row tagged with its shard's name in
``_shard``; the columns are the union of the shards' (nullable: a row of one
shard is null in another's columns). No micro-batch splits a transaction:
every micro-batch ends each shard at its upper as of one instant, so a
transaction committed to several of them (``client.txn`` or
``pyspark_persist.txn``) arrives whole in one micro-batch (the rules are the
pure functions of :mod:`pyspark_persist.joint_offsets`).

Each shard is read by its own :class:`~pyspark_persist.stream_reader.LeaseHolder`
(a leased reader, SeqNo leases held until Spark commits, since moved on after),
exactly as a single-shard source reads it; this module only reads their states
together, moves their offsets together and tags the rows.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from pyspark_persist import offsets
from pyspark_persist.joint_offsets import (
    JointOffset,
    joint_from_dict,
    joint_to_dict,
    next_joint,
    reads_nothing,
    settled,
)
from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import SHARD_COLUMN
from pyspark_persist.state import ShardState
from pyspark_persist.state.errors import Determinate
from pyspark_persist.stream_reader import (
    LeaseHolder,
    PersistInputPartition,
    check_diffs_shown,
    default_read_limit,
    read_limits,
    read_partition,
)

SETTLE_ROUNDS = 20
"""How many times ``latestOffset`` reads the shards again while some upper keeps moving
between two reads of them all (each read of all the shards takes a few milliseconds, so
under steady writes nearly every second one settles). If none settles, the trigger finds
nothing new and the next one tries again."""
START_SETTLE_S = 30.0
"""How long the query's start keeps reading until the shards' uppers settle."""


class ShardSet:
    """The driver side of a stream of several shards: a lease holder per shard, read together."""

    def __init__(self, opts: PersistOptions) -> None:
        assert opts.shards is not None, "a stream of several shards needs the shards option"
        self.names = opts.shards
        self.holders = {name: LeaseHolder(opts.for_shard(name)) for name in self.names}

    def states(self, rounds: int = SETTLE_ROUNDS) -> dict[str, ShardState] | None:
        """Every shard's state as of one instant (:func:`~pyspark_persist.joint_offsets.settled`),
        or None when some upper moved between every two of ``rounds`` reads.

        The first read is whatever this process holds (a state each shard really had,
        earlier); every later one is Consensus's newest.
        """
        before = {name: h.machine.state() for name, h in self.holders.items()}
        for _ in range(rounds):
            after = {name: h.machine.fetch_latest() for name, h in self.holders.items()}
            if settled(before, after):
                return after
            before = after
        return None

    def settled_states(self) -> dict[str, ShardState]:
        """:meth:`states`, read again until they settle, for up to :data:`START_SETTLE_S`."""
        deadline = time.monotonic() + START_SETTLE_S
        while True:
            states = self.states()
            if states is not None:
                return states
            if time.monotonic() > deadline:
                raise Determinate(
                    f"persist source: the uppers of shards {list(self.names)} kept moving for "
                    f"{START_SETTLE_S:.0f} s, so no instant at which to read them all was found "
                    "(each read of them all found a commit between): start the query again"
                )

    def check(self, offset: JointOffset) -> None:
        """Raise what a background hold update failed with, and ShardDropped for an offset of
        a shard dropped since."""
        for name, holder in self.holders.items():
            holder.holds.check()
            offsets.check_incarnation(holder.machine.incarnation, offset[name])

    def initial_offset(self) -> JointOffset:
        """Each shard's start, as the starting options say, read at one instant. A
        ``startingTime`` past a shard's upper (a shard written less often than the others)
        starts its changes there all the same."""
        states = self.settled_states()
        return {
            name: h.initial_offset_at(states[name], changes_ahead=True)
            for name, h in self.holders.items()
        }

    def nothing_new(self, start: JointOffset) -> bool:
        """Whether every shard, as far as this process knows, holds nothing past its start.

        Each holder's :meth:`~pyspark_persist.stream_reader.LeaseHolder.current_state` is
        the single-shard source's own: while PubSub delivers a shard, its cached state
        (pushes, and Consensus read at least every ``pubsubPollMs``), else Consensus read
        now. So an idle stream whose shards PubSub delivers reads Consensus only every
        ``pubsubPollMs``, not twice over all its shards on every trigger (Spark triggers
        again 10 ms after one that found nothing), and a push wakes it at the next trigger.
        A push never makes the cut: whatever is new is read again from Consensus, at one
        instant (:meth:`states`), since the pushes of one transaction's shards arrive one
        by one. Answering "nothing" is always safe: the next trigger asks again.
        """
        if any(h.available_now_upper is not None for h in self.holders.values()):
            return False
        return all(
            offsets.caught_up(h.current_state(), start[name]) for name, h in self.holders.items()
        )

    def latest_offset(self, start: JointOffset, limit: ReadLimit) -> JointOffset:
        """The end of the next micro-batch: each shard's upper at one instant, cut at one time
        by the read limit (:func:`~pyspark_persist.joint_offsets.next_joint`)."""
        began = time.perf_counter()
        self.check(start)
        if self.nothing_new(start):
            return start
        states = self.states()
        if states is None:
            return start
        for name, holder in self.holders.items():
            holder.check_schema(states[name])
        available_now = {
            name: h.available_now_upper
            for name, h in self.holders.items()
            if h.available_now_upper is not None
        }
        end = next_joint(
            states, start, read_limits(limit), available_now if available_now else None
        )
        for name, holder in self.holders.items():
            holder.note_latest(start[name], end[name], began)
        return end

    def plan(
        self, start: JointOffset, end: JointOffset, schema: StructType
    ) -> list[PersistInputPartition]:
        """Each shard's share of the micro-batch, planned and leased by its own holder (which
        checks its hold updates and the offsets' incarnation itself)."""
        partitions: list[PersistInputPartition] = []
        for name, holder in self.holders.items():
            if reads_nothing(start[name], end[name]):
                continue
            planned = holder.plan(start[name], end[name])
            check_diffs_shown(schema, [p for s in planned for p in s.leased_parts()], name)
            partitions += planned
        return partitions

    def available_now(self) -> None:
        """Trigger.AvailableNow: stop at each shard's upper in Consensus now, at one instant."""
        states = self.settled_states()
        for name, holder in self.holders.items():
            holder.available_now_upper = states[name].upper

    def commit(self, end: JointOffset) -> None:
        """Spark finished every micro-batch up to ``end``: each holder returns its leases."""
        for name, holder in self.holders.items():
            holder.commit(end[name])

    def report_latest(self) -> dict[str, Any]:
        """Each shard's newest offset and what is left to read of it."""
        return {"shards": {name: h.report_latest() for name, h in self.holders.items()}}

    def close(self) -> None:
        """Expire every shard's reader."""
        for holder in self.holders.values():
            holder.close()


class MultiShardStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``readStream.format("persist").option("shards", ...)``. Pickled to executors: only
    options and the schema travel."""

    def __init__(self, opts: PersistOptions, schema: StructType) -> None:
        assert opts.shards is not None, "a stream of several shards needs the shards option"
        self._opts = opts
        self._names = opts.shards
        self._schema = schema
        self._set: ShardSet | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_set"] = None
        return state

    @property
    def shard_set(self) -> ShardSet:
        """The driver-side holders, created on first use (only the driver uses them)."""
        if self._set is None:
            self._set = ShardSet(self._opts)
        return self._set

    def _offset(self, d: dict[str, Any]) -> JointOffset:
        return joint_from_dict(d, self._names)

    def initialOffset(self) -> dict[str, Any]:
        """Every shard's start, read at one instant."""
        return joint_to_dict(self.shard_set.initial_offset())

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The next micro-batch's end: every shard at one instant, cut at one time."""
        return joint_to_dict(self.shard_set.latest_offset(self._offset(start), limit))

    def getDefaultReadLimit(self) -> ReadLimit:
        """As a single shard's source: maxBytes/Files/RowsPerTrigger if set (each shard's cap)."""
        return default_read_limit(self._opts)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """Each shard's newest offset with what is left to read of it (``behind``)."""
        return self.shard_set.report_latest()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: stop at each shard's upper now (read at one instant)."""
        self.shard_set.available_now()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """Every shard's leased splits between the two offsets."""
        return self.shard_set.plan(self._offset(start), self._offset(end), self._schema)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """A split of one shard's parts as Arrow batches of the query's schema, ``_shard`` set."""
        if not isinstance(partition, PersistInputPartition):
            return  # partitions() found nothing to read: Spark still runs one (None) task
        at = self._schema.fieldNames().index(SHARD_COLUMN)
        rows = StructType([f for f in self._schema.fields if f.name != SHARD_COLUMN])
        tag = pa.field(SHARD_COLUMN, pa.string(), nullable=False)
        for batch in read_partition(partition, rows):
            names = pa.array([partition.shard] * batch.num_rows, pa.string())
            yield batch.add_column(at, tag, names)

    def commit(self, end: dict[str, Any]) -> None:
        """Return the leases of finished micro-batches and move each shard's since on."""
        self.shard_set.commit(self._offset(end))

    def stop(self) -> None:
        """Expire the driver's readers."""
        if self._set is not None:
            self._set.close()
