"""The streaming source: a snapshot split over many tasks, then listen ranges keyed by SeqNo.

Where each micro-batch starts and ends (the offsets, their JSON, the read
limits, the starting positions, data loss) is decided by the pure functions
of :mod:`pyspark_persist.offsets`; this module is the shell around them.
Spark calls ``initialOffset``/``latestOffset``/``partitions``/``commit`` in
one long-lived Python process on the driver, and ``read`` on executors. The
driver side keeps a :class:`LeaseHolder`: a leased persist reader that
reads the state the offsets are computed from, leases the SeqNo of every part
it hands out in ``partitions()``, and returns
those leases (and downgrades its since to what was emitted) only when
Spark's ``commit(end)`` says the micro-batch is done. So GC never deletes a
part a running task still has to read, and if the driver dies, its reader
stops heartbeating and its holds expire. Writing the returned leases and the
new since to state is a compare-and-set that Spark would wait for before the
next micro-batch; a background :class:`HoldUpdater` does it instead. ``read()``
is stateless: the
:class:`PersistInputPartition` carries the Blob URI and the leased parts.

With the ``consumer`` option the lease holder also holds a named consumer
(:class:`ConsumerLink`, over :mod:`pyspark_persist.state.consumers`): it
acquires it when the query starts, records each micro-batch as planned before
its tasks run, replays a planned one when asked for the same start (a query
resuming without its checkpoint, from the consumer's position), and advances
it in ``commit`` only, after Spark committed the micro-batch.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, TypeVar

import pyarrow as pa
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxFiles,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from pyspark_persist import offsets
from pyspark_persist.change_types import (
    CHANGE_TYPE,
    colocate_times,
    label_changes,
    pairing_keys,
)
from pyspark_persist.offsets import Gap, MicroBatch, Offset, Start, Starting
from pyspark_persist.options import (
    STARTING_AS_OF,
    STARTING_SEQNO,
    STARTING_TIME,
    PersistOptions,
)
from pyspark_persist.source import blob_for, freeze_worker_heap
from pyspark_persist.state import (
    DIFF,
    NO_LIMITS,
    TIME,
    ConsumerState,
    LeasedPart,
    Machine,
    ReadHandle,
    ReadLimits,
    Shard,
    ShardState,
    behind,
    conform_columns,
    decode_schema,
    iter_parts,
    plan_read,
    repeat_by_diff,
    state_at,
)
from pyspark_persist.state.errors import (
    ConsumerFenced,
    DataLoss,
    InvalidUsage,
    SchemaChanged,
    UnknownConsumer,
)

log = logging.getLogger(__name__)

Splits = tuple[tuple[LeasedPart, ...], ...]
"""The parts of one micro-batch, one tuple per read task."""

_Decided = TypeVar("_Decided", Start, MicroBatch)
"""What the offsets decided past any data loss: a query's start, or a micro-batch's read."""

COMMIT_WAIT_S = 0.01
"""How long ``latestOffset`` waits for a PubSub commit notice when nothing is new (about
Spark's polling delay between triggers that found nothing)."""


class PersistInputPartition(InputPartition):
    """One read task: leased parts (as JSON) and the Blob URI their bytes live under."""

    def __init__(
        self,
        blob_uri: str,
        parts: Sequence[LeasedPart],
        change_keys: tuple[str, ...] | None = None,
        shard: str = "",
    ) -> None:
        """``change_keys``: with changeTypes, the keys to pair updates by (``()``: unkeyed,
        label by sign); None without. ``shard``: whose parts they are (a stream of several
        shards tags their rows with it)."""
        super().__init__(None)
        self.shard = shard
        self.blob_uri = blob_uri
        self.parts = tuple(json.dumps(p.to_json()) for p in parts)
        self.change_keys = change_keys

    def leased_parts(self) -> list[LeasedPart]:
        """The parts to read, decoded."""
        return [LeasedPart.from_json(json.loads(p)) for p in self.parts]


class HoldUpdater:
    """Records a reader's returned leases and new since in state, off Spark's critical path.

    Spark calls the source's ``commit`` inside the offset-log phase of the
    *next* micro-batch (``walCommit``), so a compare-and-set there delays every
    micro-batch by a Consensus round trip. The leases are returned in memory at
    once; this thread then writes the holds to state, folding the commits that
    arrive meanwhile into one. Late is safe (GC and compaction only wait a
    little longer); a failure (the reader expired) is raised by the next call.
    """

    def __init__(self, reader: ReadHandle) -> None:
        self._reader = reader
        self._cond = threading.Condition()
        self._pending = False
        self._busy = False
        self._since: int | None = None
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="persist-source-holds", daemon=True)
        self._thread.start()

    def request(self, since: int | None) -> None:
        """Record the holds (and ``since``, when given) soon."""
        with self._cond:
            self._raise()
            if since is not None:
                self._since = since if self._since is None else max(self._since, since)
            self._pending = True
            self._cond.notify_all()

    def check(self) -> None:
        """Raise what the last background update failed with, if anything."""
        with self._cond:
            self._raise()

    def flush(self) -> None:
        """Wait until every requested update is in state (or failed: then raise)."""
        with self._cond:
            while (self._pending or self._busy) and self._error is None and not self._closed:
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        """Stop the thread; updates not yet written are dropped (the reader is going away)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                since, self._since, self._pending, self._busy = self._since, None, False, True
            error: BaseException | None = None
            try:
                if since is None:
                    self._reader.heartbeat()
                else:
                    self._reader.downgrade_since(since)
            except BaseException as e:  # noqa: BLE001 - handed to the next caller
                error = e
            with self._cond:
                self._busy = False
                if error is not None:
                    self._error = error
                self._cond.notify_all()


class ConsumerLink:
    """A query's hold on a named consumer: the driver-side I/O of ``state/consumers.py``.

    A micro-batch must be recorded as planned before its tasks run (so a query resuming
    without its checkpoint replays it, not another range), and its position advanced
    once Spark commits it. Spark plans micro-batch N (``latestOffset``), then commits
    N - 1 (``commit``), then runs N (``partitions``): so ``commit`` records both in one
    compare-and-set, and ``partitions`` writes the plan only when no commit came
    between (a query's first micro-batch, one Spark re-runs from its offset log).
    ``latestOffset`` writes nothing; whether the query was fenced is read from the
    state it reads anyway.
    """

    def __init__(self, shard: Shard, name: str, expiry_ms: int, reader_id: str) -> None:
        """``reader_id``: the query's leased reader, whose lease bounds its hold."""
        self._shard = shard
        self.name = name
        started = datetime.now(UTC).isoformat(timespec="seconds")
        self.holder = (
            f"query {uuid.uuid4().hex[:12]} pid {os.getpid()} on {socket.gethostname()} "
            f"since {started}"
        )
        acquired = shard.acquire_consumer(name, self.holder, expiry_ms, reader_id=reader_id)
        self.epoch = acquired.epoch
        self.position = acquired.position
        self._planned = acquired.planned
        self._next: tuple[str, str] | None = None
        """The micro-batch ``latestOffset`` planned last, not yet recorded."""

    def current(self, state: ShardState) -> ConsumerState:
        """The consumer in ``state``, if this query still holds it; else ConsumerFenced naming
        both holders (UnknownConsumer once it was dropped)."""
        consumer = state.consumers.get(self.name)
        if consumer is None:
            raise UnknownConsumer(state.shard_id, self.name, tuple(sorted(state.consumers)))
        if consumer.epoch != self.epoch:
            raise ConsumerFenced(state.shard_id, self.name, consumer.holder, self.holder)
        self._planned = consumer.planned
        return consumer

    def planned(self, start: Offset, end: Offset) -> None:
        """``latestOffset`` planned the micro-batch ``(start, end]``: record it with the next
        commit (or at ``partitions``, whichever comes first)."""
        batch = (offsets.offset_json(start), offsets.offset_json(end))
        self._next = None if batch in self._planned else batch

    def ensure_planned(self, start: Offset, end: Offset) -> None:
        """Before the micro-batch ``(start, end]`` runs: recorded as planned, now if not yet."""
        batch = (offsets.offset_json(start), offsets.offset_json(end))
        if batch in self._planned:
            return
        recorded = self._shard.plan_consumer_batch(
            self.name, self.epoch, *batch, holder=self.holder
        )
        self._planned, self._next = recorded.planned, None

    def advance(self, end: Offset) -> None:
        """Spark committed every micro-batch up to ``end``: move the position (and hold) there,
        recording the micro-batch planned after it in the same step."""
        self.position = offsets.offset_json(end)
        plan = self._next if self._next is not None and self._next[0] == self.position else None
        advanced = self._shard.advance_consumer(
            self.name,
            self.epoch,
            position=self.position,
            upper=offsets.consumed_upper(end),
            since=offsets.since_after(end) or 0,
            holder=self.holder,
            plan=plan,
        )
        self._planned = advanced.planned
        if plan is not None:
            self._next = None

    def release(self) -> None:
        """The query stops: let go of the consumer (a no-op once fenced)."""
        self._shard.release_consumer(self.name, self.epoch)


class LeaseHolder:
    """The driver-side half of the source: the I/O around :mod:`pyspark_persist.offsets`.

    It reads the state offsets are computed from, leases and plans the parts of each
    micro-batch, holds those leases until Spark commits it, and records its figures.
    """

    def __init__(self, opts: PersistOptions, schema: StructType | None = None) -> None:
        """``schema``: the query's (default: the shard's columns now)."""
        from pyspark_persist.source import client_for

        self._opts = opts
        self._client = client_for(opts)
        self._shard = self._client.open_shard(opts.shard, create=False)
        self._schema = schema
        from pyspark_persist.schema import check_change_columns, read_columns, read_share

        shard_columns = self._shard.schema.names
        names = shard_columns
        if schema is not None:
            names = read_columns(self._shard.schema, schema, opts.shard, opts.columns)
        self._share = read_share(self._shard.schema, names)
        if opts.change_types and schema is not None:
            check_change_columns(schema, self._shard.machine.state().keys, opts.shard)
        """The share of each part's bytes the query's columns take (splits are sized by it)."""
        self._columns: frozenset[str] | None = (
            frozenset(names) if set(names) >= set(shard_columns) else None
        )
        """The query's columns if it reads all of the shard's (see :meth:`check_schema`);
        None when it reads some only: a column added later is then none of its business."""
        self._checked_schema: bytes | None = None
        self._reader: ReadHandle = self._shard.reader()
        self.holds = HoldUpdater(self._reader)
        self._lock = threading.Lock()
        self._leased: dict[int, list[int]] = {}  # end upper -> SeqNos leased for that batch
        self._figures: dict[int, dict[str, Any]] = {}  # end upper -> that batch's figures
        self._last_end: Offset | None = None
        self._waited_ms = 0.0
        self._polled_ms: int | None = None
        """The client's clock when :meth:`current_state` last read Consensus."""
        self.available_now_upper: int | None = None
        self.consumer: ConsumerLink | None = None
        if opts.consumer is not None:
            self.consumer = ConsumerLink(
                self._shard, opts.consumer, opts.consumer_expiry_ms, self._reader.reader_id
            )

    @property
    def machine(self) -> Machine:
        """The shard's state machine in this process."""
        return self._shard.machine

    def current_state(self) -> ShardState:
        """The newest state: the cached one while PubSub delivers this shard (every push
        was confirmed against Consensus) and Consensus was read less than ``pubsubPollMs``
        ago, else read from Consensus now (PubSub off, broken, or reconnecting: never
        staler than polling).

        A push is a hint, never the only way to learn of a commit: one may be lost (a full
        send queue, a writer with PubSub off or on another server), and that commit must
        not stay hidden until something else refreshes the cache. A clock that went back
        counts as stale.
        """
        machine = self.machine
        now = machine.clock_ms()
        polled = self._polled_ms
        if (
            self._opts.pubsub is not None
            and machine.shared.push_healthy
            and polled is not None
            and 0 <= now - polled < self._opts.pubsub_poll_ms
        ):
            return machine.state()
        state = machine.fetch_latest()
        self._polled_ms = now
        return state

    def initial_offset(self) -> Offset:
        """Where a query with no checkpoint starts: at its consumer's position when it has
        one and no starting option was given; else before the snapshot, at the upper for
        'latest', or where the starting option says."""
        if self.consumer is not None and self.consumer.position and not self._opts.starting_given:
            resumed = Offset.from_dict(json.loads(self.consumer.position), self._opts.shard)
            offsets.check_incarnation(self.machine.incarnation, resumed)
            log.info(
                "shard %s: resuming from consumer %r's position %s",
                self._opts.shard,
                self.consumer.name,
                self.consumer.position,
            )
            return resumed
        return self.initial_offset_at(self.current_state())

    def initial_offset_at(self, state: ShardState, *, changes_ahead: bool = False) -> Offset:
        """Where a query with no checkpoint starts, as the starting options say, from
        ``state`` (a stream of several shards reads their states at one instant, and may
        start a shard's changes past its upper: ``changes_ahead``, see
        :func:`~pyspark_persist.offsets.initial_offset`)."""
        state, starting = self._starting(state)
        start = offsets.initial_offset(
            state, starting, self._opts.fail_on_data_loss, changes_ahead=changes_ahead
        )
        return self._settle(start).offset

    def _starting(self, state: ShardState) -> tuple[ShardState, Starting]:
        """The starting options in times, and the state to start from.

        startingSeqNo S starts with the changes from the upper SeqNo S - 1 left, read
        from the shard's history (whose head is the state to start from when newer).
        """
        opts = self._opts
        if opts.starting_position == "latest":
            return state, Starting(latest=True)
        if opts.starting_seqno is not None:
            name = opts.spelled(STARTING_SEQNO)
            what = f"{name} {opts.starting_seqno} (from the upper SeqNo"
            what += f" {opts.starting_seqno - 1} left)"
            past = self._shard.replay()
            at = state_at(past, opts.starting_seqno - 1, f"persist source: {name}")
            state = past.head if past.head.seqno > state.seqno else state
            return state, Starting(changes_from=at.upper, what=what)
        if opts.starting_time is not None:
            return state, Starting(
                changes_from=opts.starting_time, what=opts.spelled(STARTING_TIME)
            )
        if opts.starting_as_of is not None:
            return state, Starting(as_of=opts.starting_as_of, what=opts.spelled(STARTING_AS_OF))
        return state, Starting()

    def latest_offset(self, start: Offset, limit: ReadLimit) -> Offset:
        """The end of the next micro-batch: everything available, cut by the read limit."""
        began = time.perf_counter()
        self._waited_ms = 0.0
        end = self._latest_offset(start, limit)
        self.note_latest(start, end, began)
        return end

    def note_latest(self, start: Offset, end: Offset, began: float) -> None:
        """Record the end ``latestOffset`` answered (begun at ``perf_counter()`` ``began``):
        its figures, for the metrics line of the micro-batch, and what ``behind`` counts from."""
        if end == start:
            return
        self._last_end = end
        with self._lock:
            figures = self._figures.setdefault(end.upper, {})
            figures["latest_offset_ms"] = round((time.perf_counter() - began) * 1000, 3)
            figures["waited_ms"] = round(self._waited_ms, 3)

    def _wait_for_commit(self, state: ShardState, upper: int) -> ShardState:
        """With nothing past ``upper``, wait up to COMMIT_WAIT_S for PubSub to bring a commit.

        Spark sleeps its polling delay (10 ms) after a trigger found nothing
        new, so a commit that lands just after ``latestOffset`` answered waits
        for the next trigger; waiting here instead picks it up in this one, at
        once. Only while PubSub delivers this shard: polling Consensus here
        would cost more than Spark's own wait.
        """
        if self._opts.pubsub is None or not self.machine.shared.push_healthy:
            return state
        began = time.perf_counter()
        deadline = time.monotonic() + COMMIT_WAIT_S
        while state.upper <= upper:  # a hold update moves the SeqNo, not the upper: wait on
            remaining = deadline - time.monotonic()
            newer = (
                self.machine.shared.wait_for_seqno_after(state.seqno, remaining)
                if remaining > 0
                else None
            )
            if newer is None:
                break
            state = self.machine.state()  # ShardDropped if ``newer`` is another incarnation's
        self._waited_ms = (time.perf_counter() - began) * 1000
        return state

    def check_schema(self, state: ShardState) -> None:
        """Stop the query once a write added columns it does not have (SchemaChanged).

        Spark fixes a query's columns when it starts (Delta stops the same
        way), and columns are only ever added, so any column of the shard
        missing from the query's means its schema changed. Checked before
        every micro-batch is cut or planned, so nothing past it is emitted.
        """
        if state.schema == self._checked_schema or self._columns is None:
            return
        added = [f for f in decode_schema(state.schema) if f.name not in self._columns]
        if added:
            listed = ", ".join(f"{f.name!r} ({f.type})" for f in added)
            raise SchemaChanged(
                f"persist source: shard {state.shard_id!r} gained column(s) {listed} (a write "
                "with mergeSchema) after this query started, and Spark fixes a query's columns "
                "when it starts. Restart the query with the same checkpointLocation: it goes on "
                "exactly where it stopped, with the new columns (rows written before read null "
                "there)"
            )
        self._checked_schema = state.schema

    def _latest_offset(self, start: Offset, limit: ReadLimit) -> Offset:
        self.holds.check()
        offsets.check_incarnation(self.machine.incarnation, start)
        state = self.current_state()
        if self.available_now_upper is None and offsets.caught_up(state, start):
            state = self._wait_for_commit(state, start.upper)
        self.check_schema(state)
        if self.consumer is None:
            return offsets.next_offset(state, start, read_limits(limit), self.available_now_upper)
        planned = self.consumer.current(state).planned
        end = offsets.replayed_end(planned, start, self._opts.shard)
        if end is None:
            end = offsets.next_offset(state, start, read_limits(limit), self.available_now_upper)
            if end != start:
                self.consumer.planned(start, end)
        return end

    def report_latest(self) -> dict[str, Any]:
        """The newest offset with ``behind``: what is left to read once the micro-batch being
        planned is done (the only figure a Python source can add to Spark's progress)."""
        state = self.machine.state()
        latest = offsets.upper_offset(state).to_dict()
        latest["behind"] = offsets.behind_end(state, self._last_end).to_dict()
        return latest

    def plan(self, start: Offset, end: Offset) -> list[PersistInputPartition]:
        """Lease and split the parts of ``(start, end]``; held until ``commit(end)``."""
        began = time.perf_counter()
        partitions = self._plan(start, end)
        parts = [p.part for partition in partitions for p in partition.leased_parts()]
        with self._lock:
            figures = self._figures.pop(end.upper, {})
            for u in [u for u in self._figures if u < end.upper]:
                del self._figures[u]  # ends Spark asked for but planned another way
        figures["partitions_ms"] = round((time.perf_counter() - began) * 1000, 3)
        figures["tasks"] = len(partitions)
        figures["parts"] = len(parts)
        figures["planned_bytes"] = sum(p.size_bytes for p in parts)
        figures["planned_rows"] = sum(p.rows for p in parts)
        self._record(end, figures)
        return partitions

    def _plan(self, start: Offset, end: Offset) -> list[PersistInputPartition]:
        self.holds.check()
        offsets.check_incarnation(self.machine.incarnation, start, end)
        if self.consumer is not None and start != end:
            self.consumer.ensure_planned(start, end)
        if offsets.reads_nothing(start, end):
            return []
        state = self.machine.state()
        if state.seqno < end.seqno or state.upper < end.upper:
            state = self.machine.fetch_latest()
        self.check_schema(state)
        batch = self._settle(offsets.micro_batch(state, start, end, self._opts.fail_on_data_loss))
        if batch.whole_snapshot:  # the whole snapshot in one micro-batch
            splits = self._snapshot_splits(batch)
        else:
            splits = self._listen_splits(state, batch)
        if self._schema is not None:
            check_diffs_shown(self._schema, [p for s in splits for p in s], self._opts.shard)
        blob_uri = self._client.blob.uri
        keys = pairing_keys(state.keys, splits) if self._opts.change_types else None
        if keys:  # a task pairs the updates of a key at a time: it must read all of them
            splits = tuple(colocate_times(splits))
        return [PersistInputPartition(blob_uri, s, keys, self._opts.shard) for s in splits]

    def _split_limits(self) -> ReadLimits:
        """Split by splitSizeBytes of what the query reads of each part (its share for a
        column subset: :func:`~pyspark_persist.schema.read_share`), over at least
        minPartitions tasks."""
        return ReadLimits(
            split_bytes=max(1, round(self._opts.split_size_bytes / self._share)),
            min_splits=self._opts.min_partitions,
        )

    def _snapshot_splits(self, batch: MicroBatch) -> Splits:
        plan = self._reader.snapshot_plan(batch.as_of, self._split_limits())
        self._remember(batch.upper, plan.seqno)
        return plan.splits

    def _listen_splits(self, state: ShardState, batch: MicroBatch) -> Splits:
        state = self._reader.lease_state(state)  # in effect before any part is handed out
        self._remember(batch.upper, state.seqno)
        uri = self._client.blob.uri
        limits = self._split_limits()
        lower, upper, as_of = batch.lower, batch.upper, batch.as_of
        return plan_read(state, uri, as_of=as_of, lower=lower, upper=upper, limits=limits).splits

    def _remember(self, end_upper: int, seqno: int) -> None:
        with self._lock:
            self._leased.setdefault(end_upper, []).append(seqno)

    def commit(self, end: Offset) -> None:
        """Spark finished every micro-batch up to ``end``: return their leases, move since on,
        and advance the consumer there (the only place it moves).

        The leases go at once; state learns of it through ``holds`` (see HoldUpdater).
        """
        self.holds.check()
        with self._lock:
            done = [u for u in self._leased if u <= end.upper]
            seqnos = [s for u in done for s in self._leased.pop(u)]
        for s in seqnos:
            self._reader.release(s)
        self.holds.request(offsets.since_after(end))
        if self.consumer is not None:
            self.consumer.advance(end)

    def _record(self, end: Offset, figures: dict[str, Any]) -> None:
        """Log a planned micro-batch's figures and the lag left after it; append them to
        metricsFile. At planning, because Spark reports the end of the last micro-batch of
        an AvailableNow query to nobody (its commit() never comes)."""
        state = self.machine.state()
        line = {
            "shard": self._opts.shard,
            "end": end.to_dict(),
            **figures,
            "upper": state.upper,
            "behind": offsets.behind_end(state, end).to_dict(),
        }
        if self.consumer is not None and self.consumer.name in state.consumers:
            # What the consumer has left to read from its committed position.
            line["consumer"] = self.consumer.name
            committed = state.consumers[self.consumer.name].upper
            line["consumer_behind"] = behind(state, committed).to_dict()
        log.info("persist source micro-batch %s", json.dumps(line, sort_keys=True))
        if self._opts.metrics_file:
            with self._lock, open(self._opts.metrics_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(line, sort_keys=True) + "\n")

    def close(self) -> None:
        """Release the consumer and expire the reader now (Spark stopped the query)."""
        self.holds.close()
        if self.consumer is not None:
            try:
                self.consumer.release()
            except Exception as e:  # noqa: BLE001 - stopping anyway; an acquire takes it over
                log.warning("shard %s: releasing consumer failed: %s", self._opts.shard, e)
        self._reader.close()

    def _settle(self, decided: _Decided | Gap) -> _Decided:
        """Apply failOnDataLoss to what the offsets decided: a gap refused is DataLoss; the
        gaps skipped are logged."""
        if isinstance(decided, Gap):
            raise DataLoss(
                f"persist source, shard {self._opts.shard!r}: {decided.what}. The data is gone; "
                "set option failOnDataLoss=false to skip ahead to what is still readable"
            )
        for gap in decided.skipped:
            log.warning(
                "shard %s: %s; failOnDataLoss=false: skipping ahead to %s",
                self._opts.shard,
                gap.what,
                gap.resume,
            )
        return decided


def read_limits(limit: ReadLimit) -> ReadLimits:
    """Spark's read limit as persist's caps (whole batches, see
    :func:`~pyspark_persist.state.planning.limited_upper`)."""
    if isinstance(limit, ReadMaxBytes):
        return ReadLimits(max_bytes=limit.max_bytes)
    if isinstance(limit, ReadMaxFiles):
        return ReadLimits(max_parts=limit.max_files)
    if isinstance(limit, ReadMaxRows):
        return ReadLimits(max_rows=limit.max_rows)
    return NO_LIMITS  # ReadAllAvailable, or a limit persist does not know: everything


def default_read_limit(opts: PersistOptions) -> ReadLimit:
    """The read limit the options set (maxBytes/Files/RowsPerTrigger), else everything."""
    if opts.max_bytes is not None:
        return ReadMaxBytes(opts.max_bytes)
    if opts.max_files is not None:
        return ReadMaxFiles(opts.max_files)
    if opts.max_rows is not None:
        return ReadMaxRows(opts.max_rows)
    return ReadAllAvailable()


class PersistStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """``spark.readStream.format("persist")``. Pickled to executors: only options travel."""

    def __init__(self, opts: PersistOptions, schema: StructType) -> None:
        self._opts = opts
        self._schema = schema
        self._holder: LeaseHolder | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_holder"] = None
        return state

    @property
    def holder(self) -> LeaseHolder:
        """The driver-side lease holder, created on first use (only the driver uses it)."""
        if self._holder is None:
            self._holder = LeaseHolder(self._opts, self._schema)
        return self._holder

    def _offset(self, d: dict[str, Any]) -> Offset:
        return Offset.from_dict(d, self._opts.shard)

    def initialOffset(self) -> dict[str, Any]:
        """Before the snapshot (default), at the current upper ('latest'), or at startingAsOf."""
        return self.holder.initial_offset().to_dict()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        """The next micro-batch's end offset under ``limit``."""
        return self.holder.latest_offset(self._offset(start), limit).to_dict()

    def getDefaultReadLimit(self) -> ReadLimit:
        """maxBytes/Files/RowsPerTrigger if set, else everything available."""
        return default_read_limit(self._opts)

    def reportLatestOffset(self) -> dict[str, Any] | None:
        """The newest offset with what is left to read (``behind``: rows, bytes, parts, times),
        so Spark's progress (``sources[].latestOffset``) shows how far behind the query is."""
        return self.holder.report_latest()

    def prepareForTriggerAvailableNow(self) -> None:
        """Trigger.AvailableNow: stop at the upper Consensus holds now (read there, never
        cached: a commit whose push was lost must not be left out of the run)."""
        self.holder.available_now_upper = self.holder.machine.fetch_latest().upper

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        """Lease and split the parts between two offsets."""
        return self.holder.plan(self._offset(start), self._offset(end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Stream the partition's leased parts as Arrow batches in the output schema."""
        if not isinstance(partition, PersistInputPartition):
            return  # partitions() found nothing to read: Spark still runs one (None) task
        yield from read_partition(partition, self._schema)

    def commit(self, end: dict[str, Any]) -> None:
        """Return the leases of finished micro-batches and downgrade since."""
        self.holder.commit(self._offset(end))

    def stop(self) -> None:
        """Expire the driver's reader."""
        if self._holder is not None:
            self._holder.close()


def read_partition(
    partition: PersistInputPartition, schema: StructType
) -> Iterator[pa.RecordBatch]:
    """Fetch a partition's parts (the next one while emitting the current) as Arrow batches
    of ``schema``: only its columns are read (see :func:`read_columns`), and without a
    ``_diff`` column each update is repeated ``_diff`` times.

    With changeTypes, each labelled: part by part on an unkeyed shard; on a
    keyed one the whole task at once, its updates paired by key and time
    (the planner gave the task every part of its times: ``colocate_times``).
    """
    from pyspark_persist.schema import output_arrow_schema

    freeze_worker_heap()

    target = output_arrow_schema(schema)
    keys = partition.change_keys
    if keys is None:
        for table in _read_tables(partition, target):
            yield from table.to_batches()
        return
    rows = pa.schema([f for f in target if f.name != CHANGE_TYPE])
    if not keys:
        for table in _read_tables(partition, rows):
            yield from label_changes(table, keys).cast(target).to_batches()
        return
    tables = list(_read_tables(partition, rows))
    if tables:
        yield from label_changes(pa.concat_tables(tables), keys).cast(target).to_batches()


def _read_tables(partition: PersistInputPartition, target: pa.Schema) -> Iterator[pa.Table]:
    """The partition's parts as tables in ``target`` (empty ones skipped)."""
    from pyspark_persist.schema import RESERVED

    parts = partition.leased_parts()
    if not parts:
        return
    columns = [n for n in target.names if n not in RESERVED]
    time_type = target.field(TIME).type if TIME in target.names else pa.int64()
    bag = DIFF not in target.names
    blob = blob_for(partition.blob_uri)
    for table in iter_parts(blob, parts, time_type=time_type, columns=columns):
        if not table.num_rows:
            continue
        if bag:
            table = repeat_by_diff(table, parts[0].shard_id)
        if not table.schema.equals(target):  # usually equal: the stored types are Spark's
            # A part written before a column was added reads null there.
            table = conform_columns(table, target).cast(target)
        yield table


def check_diffs_shown(schema: StructType, parts: Sequence[LeasedPart], shard: str) -> None:
    """Refuse, before its tasks run, a read without ``_diff`` of parts that hold retractions:
    a row cannot be repeated -1 times (see :func:`~pyspark_persist.state.repeat_by_diff`)."""
    if DIFF in schema.fieldNames():
        return
    dmin = min((d for d in (p.part.effective_dmin for p in parts) if d is not None), default=1)
    if dmin < 1:
        raise InvalidUsage(
            f"persist read: these changes of shard {shard!r} hold retractions (_diff {dmin}), "
            "which a read without a _diff column cannot show: add _diff (long) to the schema "
            "(or filter _diff > 0 after reading it)"
        )
