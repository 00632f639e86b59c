"""Concurrent writers racing on one shard: linearizable appends, no loss, no duplicate.

Writers in threads (one client, or one client each with a private state
cache so they really race on Consensus) and in separate processes run a
compare_and_append retry loop at ``[upper, upper + 1)``. Whatever the
interleaving, the final snapshot must be exactly the union of the
acknowledged writes, every committed upper must be unique, each writer must
see the upper only move forward, and a concurrent listen must see exactly
the final contents, batch by batch.
"""

from __future__ import annotations

import collections
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

import pyarrow as pa
import pytest

from pyspark_persist.state import (
    Committed,
    ListenEvent,
    PersistClient,
    UpperMismatch,
    WriteHandle,
)
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus

SCHEMA = pa.schema([("v", pa.int64())])
THREADS = 6
WRITES_PER_THREAD = 15
ROWS_PER_WRITE = 3
PROCESSES = 3
THREADS_PER_PROCESS = 2
WRITES_PER_PROCESS_THREAD = 8
TIMEOUT_S = 60.0


class Ack(NamedTuple):
    """One acknowledged (Committed) write: who wrote it, where it landed, what it held."""

    writer: str
    upper: int
    seqno: int
    values: tuple[int, ...]


class WriterLog(NamedTuple):
    """What one writer thread saw: its acknowledgements and every upper it observed, in order."""

    writer: str
    acks: list[Ack]
    observed: list[int]


def payload(tag: int, i: int) -> list[int]:
    """Row values unique to write ``i`` of writer ``tag``."""
    return [tag * 1_000_000 + i * 100 + k for k in range(ROWS_PER_WRITE)]


def write_loop(writer: WriteHandle, tag: int, writes: int, name: str) -> WriterLog:
    """Append ``writes`` batches at ``[upper, upper + 1)``, retrying lost races at the new upper."""
    upper = writer.upper
    acks: list[Ack] = []
    observed: list[int] = []
    for i in range(writes):
        values = payload(tag, i)
        table = pa.table({"v": values}, schema=SCHEMA)
        while True:
            res = writer.compare_and_append(table, upper, upper + 1)
            if isinstance(res, Committed):
                observed.append(res.upper)
                acks.append(Ack(name, res.upper, res.seqno, tuple(values)))
                upper = res.upper
                break
            if isinstance(res, UpperMismatch):
                observed.append(res.current)
                upper = res.current
                continue
            raise AssertionError(f"writer {name} got {res!r} without ever failing")
    return WriterLog(name, acks, observed)


def run_threads(jobs: list[Callable[[], WriterLog]]) -> list[WriterLog]:
    """Run the jobs in threads released together by a barrier; re-raise any failure."""
    barrier = threading.Barrier(len(jobs))

    def start(job: Callable[[], WriterLog]) -> WriterLog:
        barrier.wait(timeout=TIMEOUT_S)
        return job()

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        futures = [pool.submit(start, job) for job in jobs]
        return [f.result(timeout=TIMEOUT_S) for f in futures]


def values_of(table: pa.Table) -> collections.Counter[int]:
    """The multiset of ``v`` a consolidated table denotes (each row counted ``_diff`` times)."""
    counts: collections.Counter[int] = collections.Counter()
    for v, d in zip(table.column("v").to_pylist(), table.column("_diff").to_pylist(), strict=True):
        counts[v] += d
    return counts


def check_history(
    logs: list[WriterLog], snapshot: pa.Table, *, base_upper: int, extra: Sequence[int] = ()
) -> None:
    """The snapshot is exactly the acknowledged writes; uppers unique, contiguous, monotone."""
    acks = [a for log in logs for a in log.acks]
    uppers = sorted(a.upper for a in acks)
    assert uppers == list(range(base_upper + 1, base_upper + 1 + len(acks))), (
        "committed uppers must be unique and tile the times written"
    )
    seqnos = [a.seqno for a in acks]
    assert len(set(seqnos)) == len(seqnos), "two commits claim the same SeqNo"
    for log in logs:
        assert all(a < b for a, b in zip(log.observed, log.observed[1:], strict=False)), (
            f"writer {log.writer} saw the upper go backwards or stall: {log.observed}"
        )
    expected = collections.Counter(v for a in acks for v in a.values)
    expected.update(extra)
    got = values_of(snapshot)
    assert set(got.values()) <= {1}, "a row appears more than once (a duplicated commit)"
    assert got == expected, "the snapshot differs from the union of acknowledged writes"


def fresh_client(location: tuple[str, str]) -> PersistClient:
    """A client with its own state cache: it shares nothing in-process with other clients."""
    blob_uri, consensus_uri = location
    return PersistClient(open_blob(blob_uri), open_consensus(consensus_uri), cache=StateCache())


@pytest.fixture
def own_clients(location: tuple[str, str]) -> Iterator[list[PersistClient]]:
    """THREADS clients on the test's location, each with a private state cache."""
    clients = [fresh_client(location) for _ in range(THREADS)]
    yield clients
    for c in clients:
        c.close()


def test_threads_one_client(client: PersistClient, shard_name: str) -> None:
    """Writers sharing one client (one state cache) never lose or duplicate a commit."""
    shard = client.open_shard(shard_name, SCHEMA)
    writers = [shard.writer() for _ in range(THREADS)]
    logs = run_threads(
        [
            (lambda w=w, t=t: write_loop(w, t, WRITES_PER_THREAD, f"t{t}"))
            for t, w in enumerate(writers)
        ]
    )
    check_history(logs, shard.reader().snapshot_table(), base_upper=0)
    assert shard.upper == THREADS * WRITES_PER_THREAD
    shard.state().check_invariants()


def test_threads_own_clients(
    client: PersistClient, own_clients: list[PersistClient], shard_name: str
) -> None:
    """Writers with separate clients and caches race on Consensus itself; still exactly once."""
    client.open_shard(shard_name, SCHEMA)
    writers = [c.open_shard(shard_name, SCHEMA).writer() for c in own_clients]
    logs = run_threads(
        [
            (lambda w=w, t=t: write_loop(w, t, WRITES_PER_THREAD, f"c{t}"))
            for t, w in enumerate(writers)
        ]
    )
    check_history(logs, client.open_shard(shard_name).reader().snapshot_table(), base_upper=0)
    assert client.open_shard(shard_name).upper == THREADS * WRITES_PER_THREAD
    mismatches = sum(c.metrics.cas_mismatches for c in own_clients)
    assert mismatches > 0 or THREADS == 1, "separate clients should have lost some CaS races"


def _process_main(
    blob_uri: str, consensus_uri: str, shard_name: str, proc: int, queue: Any
) -> None:
    """Child process: open the URIs itself, run THREADS_PER_PROCESS writers, report the logs."""
    try:
        client = PersistClient.open(blob_uri, consensus_uri)
        try:
            shard = client.open_shard(shard_name, SCHEMA)
            writers = [shard.writer() for _ in range(THREADS_PER_PROCESS)]
            logs = run_threads(
                [
                    (
                        lambda w=w, t=t: write_loop(
                            w, 10 * (proc + 1) + t, WRITES_PER_PROCESS_THREAD, f"p{proc}t{t}"
                        )
                    )
                    for t, w in enumerate(writers)
                ]
            )
        finally:
            client.close()
        queue.put(("ok", [(log.writer, list(log.acks), list(log.observed)) for log in logs]))
    except BaseException as e:  # noqa: BLE001 - report every failure to the parent
        queue.put(("error", f"{type(e).__name__}: {e}"))


@pytest.mark.slow
def test_processes(client: PersistClient, location: tuple[str, str], shard_name: str) -> None:
    """Writers in several processes (2 threads each) append exactly once through shared stores."""
    blob_uri, consensus_uri = location
    if blob_uri.startswith("mem://"):
        pytest.skip("mem:// stores are private to one process")
    client.open_shard(shard_name, SCHEMA)
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_process_main, args=(blob_uri, consensus_uri, shard_name, p, queue))
        for p in range(PROCESSES)
    ]
    for p in procs:
        p.start()
    try:
        results = [queue.get(timeout=TIMEOUT_S) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=TIMEOUT_S)
            if p.is_alive():
                p.kill()
    errors = [r[1] for r in results if r[0] != "ok"]
    assert not errors, errors
    logs = [
        WriterLog(name, [Ack(*a) for a in acks], observed)
        for _, proc_logs in results
        for name, acks, observed in proc_logs
    ]
    assert len(logs) == PROCESSES * THREADS_PER_PROCESS
    shard = client.open_shard(shard_name)
    check_history(logs, shard.reader().snapshot_table(), base_upper=0)
    assert shard.upper == PROCESSES * THREADS_PER_PROCESS * WRITES_PER_PROCESS_THREAD


class SeenBatch(NamedTuple):
    """One listen event and the updates it carried."""

    lower: int
    upper: int
    values: list[int]
    times: list[int]
    diffs: list[int]


@pytest.mark.parametrize("listener", ["shared-cache", "own-cache"])
def test_listen_during_concurrent_writes(
    client: PersistClient,
    own_clients: list[PersistClient],
    location: tuple[str, str],
    shard_name: str,
    listener: str,
) -> None:
    """A listen racing the writers sees every batch once, in order, summing to the snapshot."""
    shard = client.open_shard(shard_name, SCHEMA)
    seed = [-1, -2]
    assert isinstance(
        shard.writer().compare_and_append(pa.table({"v": seed}, schema=SCHEMA), 0, 1), Committed
    )
    if listener == "shared-cache":
        reader = shard.reader()
    else:
        reader = own_clients[-1].open_shard(shard_name).reader()
    listen = reader.listen(0)
    done = threading.Event()
    final_upper: list[int] = []
    seen: list[SeenBatch] = []
    listen_error: list[BaseException] = []

    def listen_loop() -> None:
        deadline = time.monotonic() + TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                # Track progress by the events returned (Listen.frontier runs ahead of
                # them: see test_listen_frontier_counts_only_returned_events).
                if done.is_set() and seen and seen[-1].upper >= final_upper[0]:
                    return
                ev: ListenEvent | None = listen.next(timeout_s=0.2)
                if ev is None:
                    continue
                t = reader.fetch(ev.parts)
                seen.append(
                    SeenBatch(
                        ev.lower,
                        ev.upper,
                        t.column("v").to_pylist(),
                        t.column("_time").to_pylist(),
                        t.column("_diff").to_pylist(),
                    )
                )
            raise AssertionError("listen did not reach the final upper in time")
        except BaseException as e:  # noqa: BLE001 - surfaced by the test thread
            listen_error.append(e)

    thread = threading.Thread(target=listen_loop, name="listener")
    thread.start()
    writers = [c.open_shard(shard_name, SCHEMA).writer() for c in own_clients[: THREADS // 2]]
    writers += [shard.writer() for _ in range(THREADS - len(writers))]
    try:
        logs = run_threads(
            [
                (lambda w=w, t=t: write_loop(w, t + 1, WRITES_PER_THREAD, f"w{t}"))
                for t, w in enumerate(writers)
            ]
        )
    finally:
        final_upper.append(shard.upper)
        done.set()
        thread.join(timeout=TIMEOUT_S)
    assert not listen_error, listen_error
    snapshot = shard.reader().snapshot_table()
    check_history(logs, snapshot, base_upper=1, extra=seed)

    uppers = [b.upper for b in seen]
    assert all(a < b for a, b in zip(uppers, uppers[1:], strict=False)), uppers
    assert uppers[-1] == final_upper[0] == 1 + THREADS * WRITES_PER_THREAD
    lower = 1
    for b in seen:
        assert b.lower == lower, "listen events must tile the times after as_of"
        assert all(b.lower <= t < b.upper for t in b.times), "an update outside its event"
        lower = b.upper
    listened: collections.Counter[int] = collections.Counter()
    for b in seen:
        for v, d in zip(b.values, b.diffs, strict=True):
            listened[v] += d
    listened.update(seed)
    assert +listened == values_of(snapshot), "listen contents differ from the final snapshot"
    by_time = collections.defaultdict(list)
    for b in seen:
        for v, t in zip(b.values, b.times, strict=True):
            by_time[t].append(v)
    for log in logs:
        for a in log.acks:
            assert sorted(by_time[a.upper - 1]) == sorted(a.values), (
                f"the write acknowledged at upper {a.upper} is not what the listen saw there"
            )


def test_listen_frontier_counts_only_returned_events(
    client: PersistClient, shard_name: str
) -> None:
    """Listen.frontier promises: every update below it has been emitted to the caller."""
    shard = client.open_shard(shard_name, SCHEMA)
    writer = shard.writer()
    for t in range(4):
        writer.compare_and_append(pa.table({"v": [t]}, schema=SCHEMA), t, t + 1)
    listen = shard.reader().listen(0)
    ev = listen.next(timeout_s=1.0)
    assert ev is not None and (ev.lower, ev.upper) == (1, 2)
    assert listen.frontier == ev.upper
