"""Reading a shard: snapshots as of a time, and listens that follow new batches.

- :meth:`ReadHandle.snapshot` names the parts that reconstruct the
  collection at ``as_of`` (``since <= as_of < upper``) as
  :class:`~pyspark_persist.state.parts.LeasedPart` values any process can
  fetch; :meth:`ReadHandle.snapshot_table` fetches and consolidates them.
- :meth:`ReadHandle.listen` yields every batch committed after ``as_of``, in
  time order, as :class:`ListenEvent` values (parts plus the new upper);
  a batch without parts is pure progress.
- :meth:`ReadHandle.subscribe` is a snapshot followed by a listen.

Waiting is push-first: an in-process write (or a PubSub diff) wakes a
waiting listen at once; otherwise it polls Consensus with backoff between
``listen_poll_min_s`` and ``listen_poll_max_s``.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark_persist.state.blob import Blob
from pyspark_persist.state.errors import InvalidFrontier
from pyspark_persist.state.machine import Machine
from pyspark_persist.state.parts import (
    LeasedPart,
    consolidate,
    data_schema,
    decode_part,
    fetch_part_bytes,
    shape_updates,
)
from pyspark_persist.state.state import Batch, ShardState, Time


@dataclass(frozen=True)
class Snapshot:
    """The parts that make up the shard as of ``as_of``, read from state ``seqno``."""

    shard_id: str
    as_of: Time
    seqno: int
    parts: tuple[LeasedPart, ...]

    @property
    def size_bytes(self) -> int:
        """Encoded bytes to fetch."""
        return sum(p.part.size_bytes for p in self.parts)

    @property
    def rows(self) -> int:
        """Updates stored in the parts (an upper bound on the rows a read yields)."""
        return sum(p.part.rows for p in self.parts)


@dataclass(frozen=True)
class ListenEvent:
    """Updates with times in ``[lower, upper)``, read from state ``seqno``; then upper is final."""

    lower: Time
    upper: Time
    seqno: int
    parts: tuple[LeasedPart, ...]


def iter_parts(
    blob: Blob, parts: Sequence[LeasedPart], batch_rows: int = 65536
) -> Iterator[pa.Table]:
    """Yield the shaped updates of ``parts`` in slices, fetching the next part meanwhile.

    Holds the bytes of at most two parts plus one decoded slice: about
    ``3 * part_target_bytes`` whatever the number of parts.
    """
    if not parts:
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="persist-fetch") as pool:
        fut = pool.submit(fetch_part_bytes, blob, parts[0].part, parts[0].shard_id)
        for i, leased in enumerate(parts):
            data = fut.result()
            if i + 1 < len(parts):
                nxt = parts[i + 1]
                fut = pool.submit(fetch_part_bytes, blob, nxt.part, nxt.shard_id)
            if leased.part.inline is not None:
                yield shape_updates(decode_part(leased.part, data, leased.shard_id), leased)
                continue
            pf = pq.ParquetFile(pa.BufferReader(data))
            for rb in pf.iter_batches(batch_size=batch_rows):
                yield shape_updates(rb, leased)
            del data, pf


class ReadHandle:
    """Snapshots and listens of one shard. Cheap; make one per reading activity."""

    def __init__(self, machine: Machine, schema: pa.Schema) -> None:
        self._machine = machine
        self.schema = schema

    @property
    def shard_id(self) -> str:
        """The shard this handle reads."""
        return self._machine.shard_id

    def latest_as_of(self) -> Time:
        """The newest time a snapshot can be read at now (``upper - 1``); fetches state."""
        state = self._machine.fetch_latest()
        if state.upper == 0:
            raise InvalidFrontier(
                f"shard {self.shard_id!r} has no complete time yet (upper is 0): write to it first"
            )
        return state.upper - 1

    def snapshot(self, as_of: Time | None = None) -> Snapshot:
        """The parts that reconstruct the shard at ``as_of`` (default: the latest complete time)."""
        if as_of is None:
            as_of = self.latest_as_of()
        state = self._machine.state()
        if as_of >= state.upper:
            state = self._machine.fetch_latest()
        _check_as_of(state, as_of)
        parts = tuple(
            LeasedPart(
                shard_id=state.shard_id,
                blob_uri=self._machine.blob.uri,
                part=p,
                lower=0,
                upper=as_of + 1,
                as_of=as_of,
                seqno=state.seqno,
            )
            for batch in state.trace
            if batch.lower <= as_of
            for p in batch.parts
            if p.effective_min_time <= as_of
        )
        return Snapshot(self.shard_id, as_of, state.seqno, parts)

    def iter_snapshot(self, as_of: Time | None = None) -> Iterator[pa.Table]:
        """Stream the snapshot's updates (not consolidated across parts), part by part."""
        snap = self.snapshot(as_of)
        yield from iter_parts(self._machine.blob, snap.parts, self._machine.config.read_batch_rows)

    def snapshot_table(self, as_of: Time | None = None) -> pa.Table:
        """The shard at ``as_of`` as one consolidated table (row columns, ``_time``, ``_diff``)."""
        snap = self.snapshot(as_of)
        tables = list(iter_parts(self._machine.blob, snap.parts))
        table = pa.concat_tables(tables) if tables else data_schema(self.schema).empty_table()
        return consolidate(table, self.schema.names)

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
        return Listen(self._machine, as_of)

    def subscribe(self, as_of: Time | None = None) -> Iterator[ListenEvent]:
        """A snapshot at ``as_of`` as one event, then every later batch: the full history."""
        snap = self.snapshot(as_of)
        yield ListenEvent(lower=0, upper=snap.as_of + 1, seqno=snap.seqno, parts=snap.parts)
        yield from self.listen(snap.as_of)

    def fetch(self, parts: Sequence[LeasedPart]) -> pa.Table:
        """Fetch leased parts (from a snapshot or listen event) into one table, unconsolidated."""
        tables = list(iter_parts(self._machine.blob, parts))
        return pa.concat_tables(tables) if tables else data_schema(self.schema).empty_table()


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
    """An iterator of :class:`ListenEvent` for updates after ``as_of``, in time order."""

    def __init__(self, machine: Machine, as_of: Time) -> None:
        self._machine = machine
        self.as_of = as_of
        self._frontier = as_of + 1
        self._pending: collections.deque[ListenEvent] = collections.deque()

    @property
    def frontier(self) -> Time:
        """Every update with a time below this has been emitted (or was at/before ``as_of``)."""
        return self._frontier

    def __iter__(self) -> Iterator[ListenEvent]:
        while True:
            event = self.next(timeout_s=None)
            if event is not None:
                yield event

    def next(self, timeout_s: float | None = 1.0) -> ListenEvent | None:
        """The next event, waiting at most ``timeout_s`` (``None``: forever); None on timeout."""
        if self._pending:
            return self._pending.popleft()
        cfg = self._machine.config
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        delay = cfg.listen_poll_min_s
        state = self._machine.state()
        while state.upper <= self._frontier:
            wait = delay if deadline is None else min(delay, deadline - time.monotonic())
            if wait <= 0:
                return None
            woke = self._machine.shared.wait_for_seqno_after(state.seqno, wait)
            if woke is None:
                state = self._machine.fetch_latest()
                delay = min(delay * 2, cfg.listen_poll_max_s)
            else:
                state = woke
        self._queue_events(state)
        return self._pending.popleft() if self._pending else None

    def _queue_events(self, state: ShardState) -> None:
        for batch in state.trace:
            if batch.upper <= self._frontier:
                continue
            self._pending.append(self._event(state, batch))
            self._frontier = batch.upper

    def _event(self, state: ShardState, batch: Batch) -> ListenEvent:
        lower = self._frontier
        parts = tuple(
            LeasedPart(
                shard_id=state.shard_id,
                blob_uri=self._machine.blob.uri,
                part=p,
                lower=lower,
                upper=batch.upper,
                as_of=None,
                seqno=state.seqno,
            )
            for p in batch.parts
            if p.effective_max_time >= lower
        )
        return ListenEvent(lower=lower, upper=batch.upper, seqno=state.seqno, parts=parts)
