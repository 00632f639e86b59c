"""Reading a shard: snapshots as of a time, and listens that follow new batches.

- :meth:`ReadHandle.snapshot` names the parts that reconstruct the
  collection at ``as_of`` (``since <= as_of < upper``) as
  :class:`~pyspark_persist.state.planning.LeasedPart` values any process can
  fetch; :meth:`ReadHandle.snapshot_table` fetches and consolidates them.
- :meth:`ReadHandle.listen` yields every batch committed after ``as_of``, in
  time order, as :class:`ListenEvent` values (parts plus the new upper);
  a batch without parts is pure progress.
- :meth:`ReadHandle.subscribe` is a snapshot followed by a listen.

Waiting is push-first: an in-process write (or a PubSub diff) wakes a
waiting listen at once; otherwise it polls Consensus with backoff between
``listen_poll_min_s`` and ``listen_poll_max_s``, or only every
``listen_poll_pushed_s`` while PubSub delivers the shard.
"""

from __future__ import annotations

import collections
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import pyarrow as pa

from . import commands
from .blob import Blob
from .codec import iter_part_batches
from .errors import InvalidFrontier, LeaseExpired, PartNotFound, ShardDropped
from .fetch import fetch_part_bytes, release_memory
from .keyed import consolidate_keyed
from .machine import Count, Machine
from .planning import NO_LIMITS, LeasedPart, PartTotals, ReadLimits, ReadPlan, plan_read
from .schema import TIME_TYPE, conform_columns, data_schema, decode_schema, select_columns
from .state import Batch, PartRef, ShardState, Time
from .tracing import traced
from .updates import consolidate, shape_updates


class ReaderTracker(Protocol):
    """What heartbeats readers in the background (the client's
    :class:`~pyspark_persist.state.maintenance.Maintenance`)."""

    def track_reader(self, reader: ReadHandle) -> None:
        """Heartbeat ``reader`` until it is closed or collected."""


@dataclass(frozen=True)
class Snapshot(PartTotals):
    """The parts that make up the shard as of ``as_of``, read from state ``seqno``."""

    shard_id: str
    as_of: Time
    seqno: int
    parts: tuple[LeasedPart, ...]


@dataclass(frozen=True)
class ListenEvent:
    """Updates with times in ``[lower, upper)``, read from state ``seqno``; then upper is final."""

    lower: Time
    upper: Time
    seqno: int
    parts: tuple[LeasedPart, ...]


PREFETCH_MIN_BYTES = 1 << 20
"""Parts of fewer bytes than this in all are fetched one after another (see iter_parts)."""


def iter_parts(
    blob: Blob,
    parts: Sequence[LeasedPart],
    batch_rows: int = 65536,
    schema: pa.Schema | None = None,
    time_type: pa.DataType = TIME_TYPE,
    columns: Sequence[str] | None = None,
) -> Iterator[pa.Table]:
    """Yield the shaped updates of ``parts`` in slices, fetching the next part meanwhile.

    Reads every part format (``PartRef.fmt``): Arrow parts batch by batch as
    stored, Parquet parts ``batch_rows`` rows at a time. With ``schema`` (the
    shard's row columns at the read) every slice has exactly its columns: a
    part written before a column was added reads null there.
    ``_time`` comes out as ``time_type`` (see
    :func:`~pyspark_persist.state.updates.shape_updates`). ``columns``: read only these
    row columns (and ``_time``, ``_diff``), in this order: the others are neither
    decoded nor copied (see :func:`~.codec.iter_part_batches`); with ``schema`` every
    slice then has exactly them, a part that lacks one reading null there.

    Holds the bytes of at most two parts plus one decoded slice: about
    ``3 * part_target_bytes`` whatever the number of parts. Parts under
    :data:`PREFETCH_MIN_BYTES` in all are fetched in the caller's thread.
    """
    if not parts:
        return
    target = None
    if schema is not None:
        if columns is not None:
            schema = select_columns(schema, columns, parts[0].shard_id, "read")
        target = data_schema(schema)

    def shaped(data: memoryview, leased: LeasedPart) -> Iterator[pa.Table]:
        batches = iter_part_batches(
            data, leased.part, leased.shard_id, batch_rows, leased.row_range, columns
        )
        for rb in batches:
            table = shape_updates(rb, leased, time_type)
            yield table if target is None else conform_columns(table, target)

    if len(parts) == 1 or sum(p.part.size_bytes for p in parts) <= PREFETCH_MIN_BYTES:
        # Nothing worth fetching meanwhile (a streaming micro-batch's few small parts, say):
        # decoding a small part takes too little time to hide a fetch behind, while a thread
        # to start and join costs more than reading it on a busy machine.
        for leased in parts:
            yield from shaped(fetch_part_bytes(blob, leased.part, leased.shard_id), leased)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="persist-fetch") as pool:
        fut = pool.submit(fetch_part_bytes, blob, parts[0].part, parts[0].shard_id)
        for i, leased in enumerate(parts):
            data = fut.result()
            if i + 1 < len(parts):
                nxt = parts[i + 1]
                fut = pool.submit(fetch_part_bytes, blob, nxt.part, nxt.shard_id)
            yield from shaped(data, leased)
            del data
            release_memory()


class ReadHandle:
    """A leased reader: snapshots and listens of one shard, holding since and SeqNo leases.

    Registering puts the reader in the shard's state with a since hold (times
    it may still read) and a SeqNo hold (states whose parts it may still
    fetch). Every snapshot or listen event *leases* the SeqNo its parts come
    from; GC keeps those parts until the lease is released, here or, after
    the parts were handed to another process, when that process reports back.
    The client heartbeats the reader in the background; a reader that stops
    (its process died) expires after ``reader_lease_s`` and its holds go.
    Close it (or use it as a context manager) when done.
    """

    def __init__(
        self,
        machine: Machine,
        maintenance: ReaderTracker | None = None,
        reader_id: str | None = None,
        lease_s: float | None = None,
    ) -> None:
        self._machine = machine
        self.reader_id = reader_id or f"r-{uuid.uuid4().hex}"
        self._leases: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()
        self._expired = False
        lease_ms = int((machine.config.reader_lease_s if lease_s is None else lease_s) * 1000)
        registered = machine.run(
            lambda s: commands.register_leased_reader(
                s, reader_id=self.reader_id, now_ms=machine.clock_ms(), lease_ms=lease_ms
            )
        )
        self._since = registered.since
        self._registered = machine.state().seqno
        self._floor = registered.seqno
        """The highest SeqNo hold a heartbeat has proposed (landed or in flight): a lease
        below it is not in effect, since GC may already go by that hold."""
        if maintenance is not None:
            maintenance.track_reader(self)

    @property
    def shard_id(self) -> str:
        """The shard this handle reads."""
        return self._machine.shard_id

    @property
    def schema(self) -> pa.Schema:
        """The shard's row columns as this process last saw them: what reads conform parts to.

        Columns are only ever added (see ``merge_schema``), so the newest schema
        covers every part a snapshot or listen of an older state hands out.
        """
        return decode_schema(self._machine.state().schema)

    @property
    def since(self) -> Time:
        """This reader's since hold: compaction keeps times from it on distinguishable."""
        return self._since

    def lease(self, seqno: int) -> None:
        """Hold the parts of state ``seqno`` (e.g. one handed back by another process)."""
        with self._lock:
            self._leases[seqno] += 1

    def release(self, seqno: int) -> None:
        """Return one lease on ``seqno``; GC may reclaim its parts once no lease holds them."""
        with self._lock:
            if self._leases[seqno] <= 1:
                del self._leases[seqno]
            else:
                self._leases[seqno] -= 1

    def leased_seqnos(self) -> list[int]:
        """The SeqNos this reader currently leases (with repeats collapsed), oldest first."""
        with self._lock:
            return sorted(self._leases)

    def lease_state(self, state: ShardState) -> ShardState:
        """Lease a state whose parts are safe to hand out now: ``state``, or a newer one.

        The lease is in effect on return: the SeqNo hold recorded in the
        shard's state (or proposed by a heartbeat in flight) is at or below
        the leased SeqNo, and no later heartbeat moves it past a held lease.
        A ``state`` older than that hold may already have lost parts to GC,
        so the newest state this process knows is leased instead (it is at
        least as new as every hold, which are all taken from it); plan from
        the state returned.
        """
        with self._lock:
            if state.seqno < self._floor:
                state = self._machine.state()
            if self.reader_id not in state.leased_readers and state.seqno >= self._registered:
                self._expired = True  # expired in state: nothing would protect these parts
            self._check_live()
            self._leases[state.seqno] += 1
            return state

    def _hold(self) -> int:
        """The SeqNo to record as this reader's hold: its oldest lease, else the cached state.

        Taken under the lease lock together with the floor it raises, so a
        lease taken afterwards is at or above it (see :meth:`lease_state`).
        """
        with self._lock:
            hold = min(self._leases) if self._leases else self._machine.state().seqno
            self._floor = max(self._floor, hold)
            return hold

    def _check_live(self) -> None:
        if self._expired:
            raise LeaseExpired(
                f"reader {self.reader_id} of shard {self.shard_id!r} expired (it stopped "
                "heartbeating for longer than reader_lease_s) or was closed: open a new reader"
            )

    @traced("ReadHandle.heartbeat")
    def heartbeat(self) -> None:
        """Extend the lease and advance the SeqNo hold to the oldest lease still held."""
        self._update(None)

    @traced("ReadHandle.downgrade_since")
    def downgrade_since(self, since: Time) -> None:
        """Promise not to read times before ``since`` any more, so compaction may merge them."""
        self._update(since)

    def _update(self, new_since: Time | None) -> None:
        self._check_live()
        hold = self._hold()
        result = self._machine.run(
            lambda s: commands.heartbeat_leased_reader(
                s,
                reader_id=self.reader_id,
                now_ms=self._machine.clock_ms(),
                seqno=hold,
                new_since=new_since,
            )
        )
        if result is None:
            self._expired = True
            self._check_live()
        else:
            self._since = result.since

    @traced("ReadHandle.close")
    def close(self) -> None:
        """Expire this reader now, releasing its since and SeqNo holds."""
        if self._expired:
            return
        self._expired = True
        try:
            self._machine.run(
                lambda s: commands.expire_leased_readers(s, reader_ids=(self.reader_id,))
            )
        except ShardDropped:
            pass  # its holds went with the shard

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @traced("ReadHandle.latest_as_of")
    def latest_as_of(self) -> Time:
        """The newest time a snapshot can be read at now (``upper - 1``); fetches state."""
        state = self._machine.fetch_latest()
        if state.upper == 0:
            raise InvalidFrontier(
                f"shard {self.shard_id!r} has no complete time yet (upper is 0): write to it first"
            )
        return state.upper - 1

    @traced("ReadHandle.snapshot")
    def snapshot(self, as_of: Time | None = None) -> Snapshot:
        """The parts that reconstruct the shard at ``as_of`` (default: the latest complete time).

        The snapshot's SeqNo is leased: call :meth:`release` with ``snapshot.seqno``
        once every part has been fetched (wherever that happened).
        """
        plan = self.snapshot_plan(as_of)
        assert plan.as_of is not None
        return Snapshot(self.shard_id, plan.as_of, plan.seqno, plan.parts)

    def snapshot_plan(
        self,
        as_of: Time | None = None,
        limits: ReadLimits = NO_LIMITS,
        skip: Callable[[PartRef], bool] | None = None,
    ) -> ReadPlan:
        """:meth:`snapshot` as a :func:`~pyspark_persist.state.planning.plan_read` plan: split
        by ``limits``, without the parts ``skip`` rules out. ``plan.seqno`` is leased."""
        self._check_live()
        if as_of is None:
            as_of = self.latest_as_of()
        state = self._machine.state()
        if as_of >= state.upper:
            state = self._machine.fetch_latest()
        _check_as_of(state, as_of)
        state = self.lease_state(state)
        try:
            _check_as_of(state, as_of)
        except InvalidFrontier:
            self.release(state.seqno)
            raise
        try:
            return plan_read(state, self._machine.blob.uri, as_of=as_of, limits=limits, skip=skip)
        except BaseException:
            self.release(state.seqno)  # e.g. ``skip`` failed: no plan holds the lease
            raise

    def iter_snapshot(self, as_of: Time | None = None) -> Iterator[pa.Table]:
        """Stream the snapshot's updates (not consolidated across parts), part by part."""
        snap = self.snapshot(as_of)
        try:
            yield from iter_parts(
                self._machine.blob, snap.parts, self._machine.config.read_batch_rows, self.schema
            )
        except PartNotFound:
            self._machine.fetch_latest()  # ShardDropped if that is why the part is gone
            raise
        finally:
            self.release(snap.seqno)

    @traced("ReadHandle.snapshot_table")
    def snapshot_table(self, as_of: Time | None = None) -> pa.Table:
        """The shard at ``as_of`` as one consolidated table (row columns, ``_time``, ``_diff``).

        A keyed shard's is summed only where its keys need it (see
        :func:`~pyspark_persist.state.keyed.consolidate_keyed`)."""
        snap = self.snapshot(as_of)
        schema = self.schema
        try:
            table = self.fetch(snap.parts, schema)
        finally:
            self.release(snap.seqno)
        keys = self._machine.state().keys
        if keys:
            return consolidate_keyed(table, schema.names, keys)
        return consolidate(table, schema.names)

    @traced("ReadHandle.listen")
    def listen(self, as_of: Time) -> Listen:
        """Follow every update with a time after ``as_of`` (``as_of >= since``)."""
        state = self._machine.state()
        if as_of < state.since:
            state = self._machine.fetch_latest()
        if as_of < state.since:
            raise InvalidFrontier(
                f"cannot listen to shard {self.shard_id!r} from as_of {as_of}: it is before "
                f"since {state.since} (compacted away); listen from {state.since} or later"
            )
        return Listen(self, self._machine, as_of)

    def subscribe(self, as_of: Time | None = None) -> Iterator[ListenEvent]:
        """A snapshot at ``as_of`` as one event, then every later batch: the full history.

        Each event's SeqNo stays leased until the next event is asked for.
        """
        snap = self.snapshot(as_of)
        listen = self.listen(snap.as_of)
        try:
            yield ListenEvent(lower=0, upper=snap.as_of + 1, seqno=snap.seqno, parts=snap.parts)
        finally:
            self.release(snap.seqno)
        yield from listen

    @traced("ReadHandle.fetch")
    def fetch(self, parts: Sequence[LeasedPart], schema: pa.Schema | None = None) -> pa.Table:
        """Fetch leased parts (from a snapshot or listen event) into one table, unconsolidated.

        Its columns are ``schema``'s (default :attr:`schema`, the newest this
        process knows), then ``_time`` and ``_diff``; see :func:`iter_parts`.
        """
        schema = self.schema if schema is None else schema
        try:
            tables = list(iter_parts(self._machine.blob, parts, schema=schema))
        except PartNotFound:
            self._machine.fetch_latest()  # ShardDropped if that is why the part is gone
            raise
        return pa.concat_tables(tables) if tables else data_schema(schema).empty_table()


def _check_as_of(state: ShardState, as_of: Time) -> None:
    if as_of >= state.upper:
        raise InvalidFrontier(
            f"as_of {as_of} is at or past the upper {state.upper} of shard {state.shard_id!r}: "
            f"times from {state.upper} on are not final yet; read as of {state.upper - 1} "
            "or earlier, or wait for writes"
        )
    if as_of < state.since:
        raise InvalidFrontier(
            f"as_of {as_of} is before the since {state.since} of shard {state.shard_id!r}: "
            f"those times were compacted away; read as of {state.since} or later"
        )


class Listen:
    """An iterator of :class:`ListenEvent` for updates after ``as_of``, in time order.

    The SeqNo of the event last returned stays leased by the reader until
    the next call (or :meth:`close`), so its parts can be fetched meanwhile.
    """

    def __init__(self, reader: ReadHandle, machine: Machine, as_of: Time) -> None:
        self._reader = reader
        self._machine = machine
        self.as_of = as_of
        self._frontier = as_of + 1  # what has been returned
        self._queued_upto = as_of + 1  # what has been queued (>= frontier)
        self._pending: collections.deque[ListenEvent] = collections.deque()
        self._held: int | None = None
        # The polling fallback's schedule survives across next() calls, so a
        # caller looping on next(timeout_s) does not poll more often than it.
        self._poll_delay = 0.0
        self._poll_at: float | None = None
        self._stale_gen = machine.shared.stale_generation

    def close(self) -> None:
        """Release the lease of the last event returned."""
        if self._held is not None:
            self._reader.release(self._held)
            self._held = None

    @property
    def frontier(self) -> Time:
        """Every update with a time below this has been emitted (or was at/before ``as_of``)."""
        return self._frontier

    def __iter__(self) -> Iterator[ListenEvent]:
        while True:
            event = self.next(timeout_s=None)
            if event is not None:
                yield event

    @traced("Listen.next", "_machine.shard_id")
    def next(self, timeout_s: float | None = 1.0) -> ListenEvent | None:
        """The next event, waiting at most ``timeout_s`` (``None``: forever); None on timeout."""
        self.close()
        event = self._next(timeout_s)
        if event is not None:
            self._held = event.seqno
            self._frontier = event.upper
        return event

    def _next(self, timeout_s: float | None) -> ListenEvent | None:
        if self._pending:
            return self._pending.popleft()
        shared = self._machine.shared
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        state = self._machine.state()
        while state.upper <= self._queued_upto:
            now = time.monotonic()
            if self._poll_at is None:
                self._poll_at = now + self._next_poll_delay()
            gen = shared.stale_generation
            if gen != self._stale_gen or now >= self._poll_at:
                # Woken as stale (a push did not apply, PubSub (dis)connected) or
                # nothing woke us in time: read Consensus (the fallback poll).
                self._stale_gen = gen
                state = self._machine.fetch_latest()
                self._machine.metrics.incr(Count.LISTEN_POLLS)
                self._poll_at = time.monotonic() + self._next_poll_delay()
                continue
            if deadline is not None and now >= deadline:
                return None
            until = self._poll_at if deadline is None else min(self._poll_at, deadline)
            if shared.wait_for_seqno_after(state.seqno, until - now) is not None:
                # Newer, but maybe another incarnation's (a shard created again under the
                # name): state() hands out only this listen's, else raises ShardDropped.
                state = self._machine.state()
        self._poll_delay, self._poll_at = 0.0, None  # news: restart the backoff
        self._queue_events(state)
        return self._pending.popleft() if self._pending else None

    def _next_poll_delay(self) -> float:
        """Backoff between ``listen_poll_min_s`` and ``listen_poll_max_s``; while PubSub
        delivers this shard, ``listen_poll_pushed_s`` (pushes wake the listen instead)."""
        cfg = self._machine.config
        if self._machine.shared.push_healthy:
            self._poll_delay = cfg.listen_poll_pushed_s
        elif self._poll_delay <= 0:
            self._poll_delay = cfg.listen_poll_min_s
        else:
            self._poll_delay = min(self._poll_delay * 2, cfg.listen_poll_max_s)
        return self._poll_delay

    def _queue_events(self, state: ShardState) -> None:
        if all(b.upper <= self._queued_upto for b in state.trace):
            return
        # One lease per queued event; next() hands each over as it returns it.
        state = self._reader.lease_state(state)
        batches = [b for b in state.trace if b.upper > self._queued_upto]
        for _ in batches[1:]:
            self._reader.lease(state.seqno)
        for batch in batches:
            self._pending.append(self._event(state, batch))
            self._queued_upto = batch.upper

    def _event(self, state: ShardState, batch: Batch) -> ListenEvent:
        """The updates from what was queued up to the end of ``batch`` (the next batch)."""
        lower = self._queued_upto
        plan = plan_read(state, self._machine.blob.uri, lower=lower, upper=batch.upper)
        return ListenEvent(lower=lower, upper=batch.upper, seqno=state.seqno, parts=plan.parts)
