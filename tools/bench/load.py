"""Load run: many concurrent writers on ONE shard, against a real Consensus, for a while.

Why: every write to a shard is a compare-and-set on one Consensus key, so
concurrent writers contend; the question is whether every write still
commits (exactly once) and what throughput and commit latency contention
leaves. Run it as::

    python -m pyspark_persist.tools.bench.load --writers 16 --seconds 60 \\
        --consensus postgresql://postgres@127.0.0.1:5432/test --json

Each writer (a thread, or with ``--mode processes`` a spawned process with
one writer) loops: stage a small batch, ``compare_and_append`` it at the
upper it believes in with an explicit token, and on ``UpperMismatch`` retry
the same token at the upper it was told (store errors are retried too). A
write's latency runs from its first attempt to its acknowledgement. At the
end a fresh client reads the shard and checks every acknowledged write is
there exactly once ("every write eventually commits"). Reported: acked
writes, attempts, upper mismatches, errors, commits/s, rows/s, and latency
p50/p99/max.
"""

from __future__ import annotations

import collections
import multiprocessing
import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pyspark_persist.state import (
    AlreadyCommitted,
    Committed,
    PersistClient,
    PersistConfig,
    UpperMismatch,
)
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import Determinate, Indeterminate
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag

POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = pa.schema([("writer", pa.int64()), ("seq", pa.int64()), ("k", pa.int64())])
GIVE_UP_S = 120.0
"""A single write retrying for longer than this is reported as not committed."""
MODES = ("threads", "processes")


@dataclass(frozen=True)
class LoadOptions(Options):
    """How many writers, for how long, on which stores."""

    writers: int = flag(16, "concurrent writers", quick=4, positive=True)
    seconds: float = flag(60.0, "how long to write", quick=5.0, positive=True)
    consensus: str = flag(POSTGRES_URL, "Consensus URI")
    blob: str | None = flag(None, "Blob URI (default: a temporary file:// directory)")
    mode: str = flag("threads", "writers as threads or spawned processes", choices=MODES)
    rows_per_write: int = flag(10, "rows in each write", positive=True)


@dataclass(frozen=True)
class LatencyMs:
    """Write latency, first attempt to acknowledgement, in ms."""

    p50: float
    p99: float
    max: float


@dataclass(frozen=True)
class Report(Result):
    """What the writers did, and whether every acknowledged write is there exactly once."""

    mode: str
    writers: int
    seconds: float
    consensus: str
    rows_per_write: int
    acked_writes: int
    attempts: int
    upper_mismatches: int
    errors: int
    gave_up: int
    every_write_committed_exactly_once: bool
    commits_per_s: float
    rows_per_s: float
    latency_ms: LatencyMs
    per_writer_acked: list[int]
    cpus: int | None

    def exit_status(self) -> int:
        """1 if some acknowledged write is missing or doubled."""
        return 0 if self.every_write_committed_exactly_once else 1


@dataclass
class WriterStats:
    """What one writer did."""

    acked: int = 0
    attempts: int = 0
    mismatches: int = 0
    errors: int = 0
    gave_up: int = 0
    rows: int = 0
    latencies_s: list[float] = field(default_factory=list)


def write_for(
    client: PersistClient, shard_name: str, index: int, seconds: float, rows_per_write: int
) -> WriterStats:
    """One writer's loop (see the module doc); returns its statistics."""
    shard = client.open_shard(shard_name)
    writer = shard.writer(f"load-{index}")
    stats = WriterStats()
    deadline = time.monotonic() + seconds
    upper = writer.fetch_upper()
    seq = 0
    while time.monotonic() < deadline:
        seq += 1
        data = pa.table(
            {
                "writer": [index] * rows_per_write,
                "seq": [seq] * rows_per_write,
                "k": list(range(rows_per_write)),
            },
            schema=SCHEMA,
        )
        first = time.perf_counter()
        give_up = time.monotonic() + GIVE_UP_S
        while True:
            stats.attempts += 1
            try:
                res = writer.compare_and_append(data, upper, upper + 1, token=seq)
            except (Determinate, Indeterminate):
                stats.errors += 1
                if time.monotonic() > give_up:
                    stats.gave_up += 1
                    break
                try:
                    upper = writer.fetch_upper()
                except (Determinate, Indeterminate):
                    time.sleep(0.01)
                continue
            if isinstance(res, UpperMismatch):
                stats.mismatches += 1
                upper = res.current
                continue
            assert isinstance(res, Committed | AlreadyCommitted)
            upper = res.upper
            stats.acked += 1
            stats.rows += rows_per_write
            stats.latencies_s.append(time.perf_counter() - first)
            break
    return stats


def _process_main(
    blob: str, consensus: str, shard_name: str, index: int, seconds: float, rows: int, out: Any
) -> None:
    """A spawned writer process: one writer on its own client."""
    client = PersistClient(
        open_blob(blob), open_consensus(consensus), config=_config(), cache=StateCache()
    )
    try:
        out.put((index, write_for(client, shard_name, index, seconds, rows).__dict__))
    finally:
        client.close()


def _config() -> PersistConfig:
    # Writers never give up on contention themselves here: the loop retries.
    return PersistConfig(retry_timeout_s=30.0)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; 0 for no values."""
    if not sorted_values:
        return 0.0
    i = min(len(sorted_values) - 1, max(0, int(round(q * len(sorted_values) + 0.5)) - 1))
    return sorted_values[i]


def run(options: LoadOptions) -> Report:
    """Run the load and verify it (see the module doc)."""
    writers, seconds, mode = options.writers, options.seconds, options.mode
    consensus, blob, rows_per_write = options.consensus, options.blob, options.rows_per_write
    tmp = None
    if blob is None:
        tmp = tempfile.mkdtemp(prefix="persist-load-")
        blob = f"file://{tmp}/blob"
    shard_name = f"load-{uuid.uuid4().hex[:12]}"
    try:
        with PersistClient(
            open_blob(blob), open_consensus(consensus), config=_config(), cache=StateCache()
        ) as setup:
            setup.open_shard(shard_name, SCHEMA)
        stats: dict[int, WriterStats] = {}
        started = time.perf_counter()
        if mode == "threads":
            client = PersistClient(
                open_blob(blob), open_consensus(consensus), config=_config(), cache=StateCache()
            )

            def body(i: int) -> None:
                stats[i] = write_for(client, shard_name, i, seconds, rows_per_write)

            threads = [threading.Thread(target=body, args=(i,)) for i in range(writers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            client.close()
        else:
            ctx = multiprocessing.get_context("spawn")
            out = ctx.Queue()
            procs = [
                ctx.Process(
                    target=_process_main,
                    args=(blob, consensus, shard_name, i, seconds, rows_per_write, out),
                )
                for i in range(writers)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                i, d = out.get(timeout=seconds + GIVE_UP_S + 60)
                stats[i] = WriterStats(**d)
            for p in procs:
                p.join(timeout=30)
        wall = time.perf_counter() - started
        # Every acknowledged write is there exactly once.
        with PersistClient(open_blob(blob), open_consensus(consensus), cache=StateCache()) as check:
            table = check.open_shard(shard_name).reader().snapshot_table()
        counts = collections.Counter(
            zip(
                table.column("writer").to_pylist(),
                table.column("seq").to_pylist(),
                table.column("_diff").to_pylist(),
                strict=True,
            )
        )
        per_write: collections.Counter[tuple[int, int]] = collections.Counter()
        for (w, s, d), n in counts.items():
            per_write[(w, s)] += d * n
        acked = sum(s.acked for s in stats.values())
        exact = len(per_write) == acked and all(n == rows_per_write for n in per_write.values())
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    lat = sorted(x for s in stats.values() for x in s.latencies_s)
    return Report(
        mode=mode,
        writers=writers,
        seconds=round(wall, 2),
        consensus=check.consensus.uri,
        rows_per_write=rows_per_write,
        acked_writes=acked,
        attempts=sum(s.attempts for s in stats.values()),
        upper_mismatches=sum(s.mismatches for s in stats.values()),
        errors=sum(s.errors for s in stats.values()),
        gave_up=sum(s.gave_up for s in stats.values()),
        every_write_committed_exactly_once=exact and not any(s.gave_up for s in stats.values()),
        commits_per_s=round(acked / wall, 1),
        rows_per_s=round(acked * rows_per_write / wall, 1),
        latency_ms=LatencyMs(
            p50=round(percentile(lat, 0.50) * 1000, 2),
            p99=round(percentile(lat, 0.99) * 1000, 2),
            max=round((lat[-1] if lat else 0.0) * 1000, 2),
        ),
        per_writer_acked=[stats[i].acked for i in sorted(stats)],
        cpus=os.cpu_count(),
    )


def render(res: Report) -> str:
    """One line: the writes, their latency, and whether each is there exactly once."""
    lat = res.latency_ms
    return (
        f"{res.writers} {res.mode} writers, {res.seconds} s on {res.consensus}: "
        f"{res.acked_writes} writes acked ({res.attempts} attempts, "
        f"{res.upper_mismatches} upper mismatches, {res.errors} errors), "
        f"{res.commits_per_s} commits/s, {res.rows_per_s} rows/s, latency p50 "
        f"{lat.p50} ms p99 {lat.p99} ms max {lat.max} ms; exactly once: "
        f"{res.every_write_committed_exactly_once}"
    )


BENCHMARK = Benchmark("load", LoadOptions, run, render, __doc__)
"""``persist bench load``; its exit status is 1 if some acknowledged write is missing or
doubled."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
