"""Spark streams riding out infrastructure faults: no restart, every row exactly once.

A rate -> persist writer query and persist -> foreachBatch reader queries run on
PostgreSQL Consensus. Mid-stream:

- Consensus is taken away for 5 s (a loopback proxy in front of the shared
  PostgreSQL stops: connections reset and refused), then given back;
- the PubSub server is SIGKILLed, left dead, and restarted on the same port.

Both queries must still be running afterwards, with every row exactly once.
The PubSub test also measures freshness (commit to the reader's micro-batch,
per row): a reader whose PubSub server is dead, and one whose server never
started, against a reader with PubSub off, on the same rows in the same run.
"""

from __future__ import annotations

import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fault_proxy import FaultProxy
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

pytestmark = [pytest.mark.spark, pytest.mark.postgres]


class Tail:
    """A foreachBatch sink that records each row's value, commit time and arrival time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.rows: list[tuple[int, float, float, int]] = []
        """(value, commit time _time in s, seen at in s, _diff)"""

    def __call__(self, df: DataFrame, _batch_id: int) -> None:
        got = df.select("value", "_time", "_diff").collect()
        now = time.time()
        with self._lock:
            self.rows.extend((r.value, r._time / 1000.0, now, r._diff) for r in got)

    def values(self) -> list[int]:
        with self._lock:
            return sorted(v for v, _t, _s, d in self.rows for _ in range(d))

    def lags(self, since: float, until: float) -> dict[int, float]:
        """Value -> seconds from commit to arrival, for rows committed in ``[since, until)``."""
        with self._lock:
            return {v: seen - t for v, t, seen, _d in self.rows if since <= t < until}


def wait_for(
    cond: Callable[[], bool], what: str, queries: list[StreamingQuery], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        for q in queries:
            assert q.exception() is None, f"query failed: {q.exception()}"
            assert q.isActive, f"query {q.name} stopped"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def start_writer(
    spark: SparkSession, shard: str, options: dict[str, str], ckpt: Path
) -> StreamingQuery:
    return (
        spark.readStream.format("rate")
        .option("rowsPerSecond", 20)
        .load()
        .select("value")
        .writeStream.format("persist")
        .options(**options)
        .option("checkpointLocation", str(ckpt))
        .trigger(processingTime="250 milliseconds")
        .start(shard)
    )


def start_reader(
    spark: SparkSession, shard: str, options: dict[str, str], ckpt: Path, tail: Tail
) -> StreamingQuery:
    return (
        spark.readStream.format("persist")
        .options(**options)
        .load(shard)
        .writeStream.foreachBatch(tail)
        .option("checkpointLocation", str(ckpt))
        .start()
    )


def shard_values(options: dict[str, str], shard: str) -> list[int]:
    from pyspark_persist.state import PersistClient

    with PersistClient.open(options["blob"], options["consensus"]) as client:
        table = client.open_shard(shard).reader().snapshot_table()
    return sorted(
        v
        for v, d in zip(table["value"].to_pylist(), table["_diff"].to_pylist(), strict=True)
        for _ in range(d)
    )


def finish(
    writer: StreamingQuery,
    readers: dict[str, tuple[StreamingQuery, Tail]],
    options: dict[str, str],
    shard: str,
) -> list[int]:
    """Stop the writer, let every reader catch up with the shard, stop them; check exactly once."""
    queries = [writer, *(q for q, _ in readers.values())]
    for q in queries:
        assert q.exception() is None, f"query failed: {q.exception()}"
        assert q.isActive
    writer.stop()
    expected = shard_values(options, shard)
    assert expected == list(range(len(expected))), "the shard lost or doubled a row"
    try:
        for name, (q, tail) in readers.items():
            wait_for(lambda t=tail: len(t.values()) >= len(expected), f"reader {name}", [q], 120)
            assert tail.values() == expected, f"reader {name} saw rows more or less than once"
    finally:
        for q, _ in readers.values():
            q.stop()
    return expected


def test_streams_ride_out_a_consensus_outage(
    spark: SparkSession, postgres_url: str, tmp_path: Path
) -> None:
    """Consensus gone for 5 s mid-stream: the writer's commits and the reader's latestOffset
    retry until it is back; both queries keep running and every row arrives exactly once."""
    proxy = FaultProxy("127.0.0.1", 5432).start()
    try:
        table = f"faults_{uuid.uuid4().hex[:12]}"
        options = {
            "blob": f"file://{tmp_path}/blob",
            "consensus": f"postgresql://postgres@127.0.0.1:{proxy.port}/test?table={table}",
        }
        shard = f"outage-{uuid.uuid4().hex[:8]}"
        writer = start_writer(spark, shard, options, tmp_path / "w")
        wait_for(lambda: writer.lastProgress is not None, "the first commit", [writer], 120)
        tail = Tail()
        reader = start_reader(spark, shard, options, tmp_path / "r", tail)
        queries = [writer, reader]
        wait_for(lambda: len(tail.values()) >= 20, "the reader to see rows", queries, 120)

        proxy.stop()
        outage_started = time.monotonic()
        batches_before = writer.lastProgress["batchId"]
        time.sleep(5.0)  # the outage the issue asks for: Consensus gone for 5 s
        for q in queries:
            assert q.exception() is None and q.isActive, "a query died during the outage"
        proxy.start()
        print(f"\nconsensus outage: {time.monotonic() - outage_started:.1f} s")

        seen_before = len(tail.values())
        wait_for(
            lambda: writer.lastProgress["batchId"] >= batches_before + 4,
            "the writer to commit again",
            queries,
            120,
        )
        wait_for(
            lambda: len(tail.values()) > seen_before + 20, "the reader to resume", queries, 120
        )
        expected = finish(writer, {"r": (reader, tail)}, options, shard)
        print(f"rows written and read exactly once: {len(expected)}")
    finally:
        proxy.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def pubsub_server_cmd() -> Iterator[Callable[[], subprocess.Popen[bytes]]]:
    """Starts ``persist pubsub serve`` on one fixed port, as often as asked; kills them after."""
    port = _free_port()
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pyspark_persist", "pubsub", "serve", "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert b"serving on" in proc.stdout.readline()
        procs.append(proc)
        return proc

    start.port = port  # type: ignore[attr-defined]
    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=10)


WINDOW_ROWS = 20
"""Rows (one second of the writer's) every reader must see committed in a lag window."""


def test_streams_ride_out_a_dead_pubsub_server_as_fresh_as_polling(
    spark: SparkSession,
    postgres_url: str,
    tmp_path: Path,
    pubsub_server_cmd: Callable[[], subprocess.Popen[bytes]],
) -> None:
    """The PubSub server SIGKILLed mid-stream, later restarted: every query keeps running,
    every row exactly once, and a reader whose server is dead (or never started) is about
    as fresh as one with PubSub off: it polls Consensus at the polling cadence."""
    server = pubsub_server_cmd()
    address = f"127.0.0.1:{pubsub_server_cmd.port}"  # type: ignore[attr-defined]
    table = f"faults_{uuid.uuid4().hex[:12]}"
    base = {"blob": f"file://{tmp_path}/blob", "consensus": f"{postgres_url}?table={table}"}
    shard = f"pubsub-{uuid.uuid4().hex[:8]}"
    writer = start_writer(spark, shard, {**base, "pubsub": address}, tmp_path / "w")
    wait_for(lambda: writer.lastProgress is not None, "the first commit", [writer], 120)
    readers: dict[str, tuple[StreamingQuery, Tail]] = {}
    for name, pubsub in (
        ("pubsub", address),
        ("off", "off"),
        ("never-started", f"127.0.0.1:{_free_port()}"),
    ):
        tail = Tail()
        readers[name] = (
            start_reader(spark, shard, {**base, "pubsub": pubsub}, tmp_path / name, tail),
            tail,
        )
    queries = [writer, *(q for q, _ in readers.values())]
    tails = {name: t for name, (_q, t) in readers.items()}
    wait_for(
        lambda: all(len(t.values()) >= 20 for t in tails.values()), "every reader", queries, 180
    )

    def every_reader_saw_rows_since(since: float) -> bool:
        """Each reader has seen WINDOW_ROWS rows committed at ``since`` or later."""
        return all(len(t.lags(since, float("inf"))) >= WINDOW_ROWS for t in tails.values())

    # The healthy and restarted windows only need rows to measure: each ends as soon as every
    # reader has seen enough of them. The dead window has a fixed length, see below.
    healthy_from = time.time()
    wait_for(lambda: every_reader_saw_rows_since(healthy_from), "healthy-window rows", queries, 120)
    server.send_signal(signal.SIGKILL)
    server.wait(timeout=10)
    killed_at = time.time()
    # The server stays dead for three of the readers' pushed-poll periods (5 s): a reader
    # that kept polling at that cadence would show lags of seconds in this window.
    time.sleep(15.0)
    restarted_at = time.time()
    pubsub_server_cmd()
    wait_for(
        lambda: every_reader_saw_rows_since(restarted_at + 2.0),
        "restarted-window rows",
        queries,
        120,
    )
    ended_at = time.time()

    def median_lag(name: str, since: float, until: float) -> float:
        lags = tails[name].lags(since, until)
        assert lags, f"reader {name} saw nothing committed in the window"
        return statistics.median(lags.values())

    # Rows committed at least 1 s after the kill (the disconnect is noticed by then).
    dead = (killed_at + 1.0, restarted_at)
    expected = finish(writer, readers, {**base}, shard)
    figures = {
        (name, phase): median_lag(name, *window)
        for name in tails
        for phase, window in (
            ("healthy", (healthy_from, killed_at)),
            ("dead", dead),
            ("restarted", (restarted_at + 2.0, ended_at)),
        )
    }
    print(f"\nmedian commit-to-reader lag (s), {len(expected)} rows, each exactly once:")
    for (name, phase), lag in sorted(figures.items()):
        print(f"  {name:14s} {phase:10s} {lag:6.3f}")
    off = figures[("off", "dead")]
    for name in ("pubsub", "never-started"):
        ratio = figures[(name, "dead")] / off
        print(f"  {name} while the server is dead vs PubSub off: {ratio:.2f}x (target <= 1.2x)")
        # Generous on a shared 2-core box (target 1.2x); a cache served stale showed 10 s.
        assert figures[(name, "dead")] <= max(2.0 * off, off + 1.0), figures
