"""Reader leases are in effect before parts are handed out, and heartbeats outlive maintenance.

- A snapshot planned from a state older than the SeqNo hold a heartbeat has
  just recorded would hand out parts GC may delete: the lease must be taken
  on a state at or after that hold (issue 13 item 3a).
- Heartbeats run on their own thread: a maintenance step that takes longer
  than a lease never lets a live reader expire (issue 13 item 3b).

Both interleavings are forced with explicit hooks, never with sleeps.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import uuid
from typing import Any
from unittest import mock

import pytest
from key_helpers import SCHEMA, counts, updates

from pyspark_persist.state import PersistClient, PersistConfig, ReadHandle
from pyspark_persist.state import maintenance as maintenance_module
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.maintenance_policy import CompactRequest
from pyspark_persist.state.state import ShardState


def client_on(tag: str, config: PersistConfig) -> PersistClient:
    """A mem client with its own state cache: it sees other clients only through Consensus."""
    return PersistClient(
        open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"), config=config, cache=StateCache()
    )


CONFIG = PersistConfig(compaction_fan_in=2, inline_write_max_bytes=1, maintenance=False)


@pytest.mark.parametrize("how", ["snapshot", "listen"])
def test_gc_in_the_lease_window_cannot_delete_handed_out_parts(
    how: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A heartbeat records a newer SeqNo hold between the planner's state read and its lease.

    The hook runs, at that moment, what other processes may do: write,
    compact, and (after this reader's heartbeat moved its hold on) GC. The
    old code leased the older state and handed out parts GC had just
    deleted, so the fetch failed with PartNotFound.
    """
    tag = uuid.uuid4().hex
    mine, other = client_on(tag, CONFIG), client_on(tag, CONFIG)
    try:
        shard = mine.open_shard("window", SCHEMA)
        writer = shard.writer()
        for t in range(2):
            writer.compare_and_append(updates([t], t), t, t + 1)
        reader = shard.reader()
        listen = reader.listen(0) if how == "listen" else None
        machine = shard.machine
        real_state = machine.state
        armed = [True]

        def state_then_interleave() -> ShardState:
            state = real_state()
            if armed[0]:
                armed[0] = False
                theirs = other.open_shard("window", SCHEMA)
                theirs.writer().compare_and_append(updates([2], 2), 2, 3)
                assert any(r.applied for r in theirs.compact())
                machine.fetch_latest()
                reader.heartbeat()  # the hold moves to the newest state this process knows
                assert theirs.gc().parts_deleted > 0
            return state

        monkeypatch.setattr(machine, "state", state_then_interleave)
        if listen is None:
            got = counts(reader.snapshot_table(1))
            assert got == collections.Counter({0: 1, 1: 1})
        else:
            event = listen.next(timeout_s=None)
            assert event is not None
            got = counts(reader.fetch(event.parts))
            assert got == collections.Counter({1: 1}) or got == collections.Counter({1: 1, 2: 1})
        assert not armed[0], "the hook never ran"
    finally:
        mine.close()
        other.close()


def test_long_maintenance_does_not_starve_heartbeats() -> None:
    """A compaction held (by a hook) for many heartbeat intervals: the reader keeps its lease."""
    tag = uuid.uuid4().hex
    config = PersistConfig(heartbeat_interval_s=0.01, reader_lease_s=60.0, maintenance=True)
    client = client_on(tag, config)
    release = threading.Event()
    holding = threading.Event()
    beats = threading.Semaphore(0)
    stack = contextlib.ExitStack()
    try:
        shard = client.open_shard("starve", SCHEMA)
        maintenance = client.maintenance
        real_run_request = maintenance_module.run_request

        def held_run_request(*args: Any, **kwargs: Any) -> Any:
            holding.set()
            release.wait(60)
            return real_run_request(*args, **kwargs)

        held = mock.patch.object(maintenance_module, "run_request", held_run_request)
        stack.enter_context(held)  # the one runner of queued requests: the thread is held
        maintenance._submit(shard.machine, CompactRequest())
        assert holding.wait(30), "maintenance never started"
        reader = shard.reader()
        real_heartbeat = reader.heartbeat

        def counted_heartbeat() -> None:
            real_heartbeat()
            beats.release()

        reader.heartbeat = counted_heartbeat  # type: ignore[method-assign]
        before = shard.state().leased_readers[reader.reader_id].last_heartbeat_ms
        # Three heartbeats while the maintenance thread is still held.
        assert all(beats.acquire(timeout=30) for _ in range(3)), "heartbeats waited for maintenance"
        assert holding.is_set() and not release.is_set()
        after = shard.machine.fetch_latest().leased_readers[reader.reader_id]
        assert after.last_heartbeat_ms >= before
        release.set()
        assert maintenance.wait_idle(30)
        reader.close()
    finally:
        release.set()
        client.close()
        stack.close()


def test_a_lease_registered_elsewhere_is_heartbeat_by_reader_id_until_it_is_gone() -> None:
    """A process holding no ReadHandle (a task of a Spark batch read) extends the lease its
    planner registered through Shard.heartbeat_reader: the reader's heartbeat time and SeqNo
    hold move in the shared state. Once the reader is gone (closed, or expired) the heartbeat
    answers False and brings nothing back."""
    tag = uuid.uuid4().hex
    planner, task = client_on(tag, CONFIG), client_on(tag, CONFIG)
    try:
        shard = planner.open_shard("beat", SCHEMA)
        shard.writer().compare_and_append(updates([1], 0), 0, 1)
        reader = ReadHandle(shard.machine)  # as a batch read's planner: no heartbeat thread
        seqno = shard.state().seqno
        remote = task.open_shard("beat", create=False)
        later = reader_state(shard, reader.reader_id).last_heartbeat_ms + 60_000
        assert remote.heartbeat_reader(reader.reader_id, seqno=seqno, now_ms=later)
        held = reader_state(shard, reader.reader_id)
        assert (held.last_heartbeat_ms, held.seqno) == (later, seqno)
        reader.close()
        assert not remote.heartbeat_reader(reader.reader_id, seqno=seqno, now_ms=later + 1)
        assert reader.reader_id not in shard.state().leased_readers
    finally:
        planner.close()
        task.close()


def reader_state(shard: Any, reader_id: str) -> Any:
    """The leased reader's entry in the shard's newest state."""
    return shard.state().leased_readers[reader_id]
