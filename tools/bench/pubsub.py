"""The PubSub benchmark: write-to-listen latency and idle Consensus load, with and without push.

Run it as ``python -m pyspark_persist.tools.bench.pubsub`` (``--json`` for
machine-readable output, ``--quick`` for a smoke run). For each location
(``file/postgres``, ``file/sqlite``) and each mode, in the same run:

- **Write-to-listen latency**: a writer and a listener in separate clients
  with separate state caches (as two processes would be), each with its own
  publisher. The writer appends one row at random intervals; p50/p95 of the
  time from the append returning (the commit) to the listener receiving it
  (``commit->listen``), and from just before the append (``write->listen``,
  which adds the append itself).
- **Idle Consensus load**: 10 listeners (separate clients) waiting on a
  shard nobody writes; Consensus reads per second they make between them.

Modes: ``grpc`` (a :class:`~pyspark_persist.pubsub.server.PubSubServer` on
loopback started by the benchmark), ``pg-notify`` (LISTEN/NOTIFY, PostgreSQL
only) and ``polling`` (PubSub off). Targets: PubSub p50 commit->listen
<= 5 ms and >= 20x lower than polling; idle reads >= 20x fewer.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from pyspark_persist import pubsub
from pyspark_persist.pubsub.server import PubSubServer
from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.tools.bench import step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, csv, flag
from pyspark_persist.tools.bench.listen import probe_listen

POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
SCHEMA = pa.schema([("id", pa.int64())])
LOCATIONS = ("file/postgres", "file/sqlite")
IDLE_LISTENERS = 10
TARGET_P50_MS = 5.0
TARGET_RATIO = 20.0


@dataclass(frozen=True)
class PubSubOptions(Options):
    """What to run."""

    locations: tuple[str, ...] = flag(
        LOCATIONS, "comma list of locations", parse=csv, choices=LOCATIONS
    )
    samples: int = flag(60, "writes per mode", quick=15, positive=True)
    gap_min_ms: float = flag(50.0, "least gap between two writes, ms")
    gap_max_ms: float = flag(250.0, "most gap between two writes, ms")
    idle_seconds: float = flag(10.0, "how long the idle listeners wait", quick=2.0, positive=True)
    seed: int = flag(7, "seed of the random gaps")
    postgres_url: str = flag(POSTGRES_URL, "PostgreSQL consensus URL")


@dataclass
class ModeResult:
    """One location and mode."""

    location: str
    mode: str
    samples: int
    commit_p50_ms: float
    commit_p95_ms: float
    write_p50_ms: float
    write_p95_ms: float
    idle_reads_per_s: float
    missed: int


@dataclass(frozen=True)
class Verdict:
    """One PubSub mode against polling at its location, and whether the targets hold."""

    location: str
    mode: str
    p50_ok: bool
    latency_ratio: float
    """Polling's commit->listen p50 over this mode's."""
    latency_ratio_ok: bool
    idle_ratio: float
    """Polling's idle Consensus reads over this mode's."""
    idle_ratio_ok: bool


@dataclass
class Report(Result):
    """Every location and mode of one run."""

    options: PubSubOptions
    results: list[ModeResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def mode(self, location: str, mode: str) -> ModeResult | None:
        """The figures of ``mode`` at ``location``, if it ran."""
        return next((r for r in self.results if (r.location, r.mode) == (location, mode)), None)

    @property
    def verdicts(self) -> list[Verdict]:
        """Each PubSub mode beside polling at the same location."""
        out = []
        for r in self.results:
            base = self.mode(r.location, "polling")
            if r.mode == "polling" or base is None:
                continue
            lat = base.commit_p50_ms / r.commit_p50_ms if r.commit_p50_ms else float("inf")
            idle = (
                base.idle_reads_per_s / r.idle_reads_per_s if r.idle_reads_per_s else float("inf")
            )
            out.append(
                Verdict(
                    r.location,
                    r.mode,
                    r.commit_p50_ms <= TARGET_P50_MS,
                    lat,
                    lat >= TARGET_RATIO,
                    idle,
                    idle >= TARGET_RATIO,
                )
            )
        return out

    def to_json(self) -> dict[str, Any]:
        """The figures, the verdicts, the notes and what was run."""
        o = self.options
        return {
            "results": [asdict(r) for r in self.results],
            "verdicts": [asdict(v) for v in self.verdicts],
            "notes": self.notes,
            "config": {
                "samples": o.samples,
                "gap_ms": [o.gap_min_ms, o.gap_max_ms],
                "idle_seconds": o.idle_seconds,
                "idle_listeners": IDLE_LISTENERS,
                "cpus": os.cpu_count(),
            },
        }


def pubsub_client(uris: tuple[str, str], spec: str | None) -> PersistClient:
    """A client of ``uris`` as another process would hold it: a state cache of its own and
    its own publisher (``spec``, as :func:`pyspark_persist.pubsub.connect` takes it); no
    maintenance, so only the write and its push are timed."""
    cfg = PersistConfig(maintenance=False)
    return PersistClient(
        open_blob(uris[0]),
        open_consensus(uris[1]),
        config=cfg,
        publisher=pubsub.connect(spec, uris[1]),
        cache=StateCache(),
    )


def close_client(client: PersistClient) -> None:
    """Close a :func:`pubsub_client` and its publisher."""
    client.close()
    close = getattr(client.publisher, "close", None)
    if callable(close):
        close()


def wait_healthy(client: PersistClient, shard: str, spec: str | None) -> None:
    """Wait (up to 10 s) until ``client``'s publisher delivers pushes of ``shard``, so that
    nothing timed waits on PubSub connecting; at once when PubSub is off (``spec`` None)."""
    if spec is None:
        return
    shared = client.machine(shard).shared
    deadline = time.monotonic() + 10
    while not shared.push_healthy and time.monotonic() < deadline:
        time.sleep(0.01)


def _row(i: int) -> pa.Table:
    return pa.table({"id": [i]}, schema=SCHEMA)


def measure_latency(
    uris: tuple[str, str], spec: str | None, samples: int, gap_ms: tuple[float, float], seed: int
) -> tuple[Sequence[float], Sequence[float], int]:
    """(commit->listen seconds, write->listen seconds, missed) for one mode: writer and
    listener in separate clients, each with its own publisher (``spec``)."""
    wc, lc = pubsub_client(uris, spec), pubsub_client(uris, spec)

    def settle(name: str) -> None:
        wait_healthy(lc, name, spec)
        wait_healthy(wc, name, spec)

    try:
        seen = probe_listen(wc, lc, SCHEMA, _row, samples, gap_ms, seed=seed, settle=settle)
    finally:
        close_client(wc)
        close_client(lc)
    return seen.commit_s, seen.write_s, seen.missed


def measure_idle(uris: tuple[str, str], spec: str | None, seconds: float) -> float:
    """Consensus reads per second made by IDLE_LISTENERS listeners waiting on a quiet shard."""
    name = f"bench-idle-{uuid.uuid4().hex[:10]}"
    setup = pubsub_client(uris, None)
    setup.open_shard(name, SCHEMA).writer().append(pa.table({"id": [0]}, schema=SCHEMA))
    close_client(setup)
    clients = [pubsub_client(uris, spec) for _ in range(IDLE_LISTENERS)]
    stop = threading.Event()
    threads = []
    try:
        for c in clients:
            shard = c.open_shard(name)
            reader = shard.reader()
            listen = reader.listen(reader.latest_as_of())
            wait_healthy(c, name, spec)

            def loop(listen: Any = listen) -> None:
                while not stop.is_set():
                    listen.next(timeout_s=1.0)

            t = threading.Thread(target=loop, daemon=True, name="bench-idle-listener")
            t.start()
            threads.append(t)
        time.sleep(1.0)  # settle: catch-up reads after subscribing
        start = sum(c.metrics.snapshot()["consensus_fetches"] for c in clients)
        t0 = time.monotonic()
        time.sleep(seconds)
        reads = sum(c.metrics.snapshot()["consensus_fetches"] for c in clients) - start
        return reads / (time.monotonic() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=5)
        for c in clients:
            close_client(c)


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) * 1e3 if values else float("nan")


def run(options: PubSubOptions) -> Report:
    """Run every location and mode."""
    report = Report(options)
    tmp = tempfile.mkdtemp(prefix="persist-bench-pubsub-")
    server = PubSubServer("127.0.0.1", 0).start()
    try:
        for location in options.locations:
            if location == "file/postgres":
                try:
                    open_consensus(options.postgres_url).close()
                except Exception as e:  # noqa: BLE001 - skip with a note
                    report.notes.append(f"skipped file/postgres: {str(e).splitlines()[0]}")
                    continue
            modes: list[tuple[str, str | None]] = [("grpc", server.address)]
            if location == "file/postgres":
                modes.append(("pg-notify", "postgres"))
            modes.append(("polling", None))
            for mode, spec in modes:
                d = os.path.join(tmp, uuid.uuid4().hex[:8])
                os.makedirs(d)
                cons = (
                    options.postgres_url if location == "file/postgres" else f"sqlite:///{d}/c.db"
                )
                uris = (f"file://{d}/blob", cons)
                step(f"pubsub: {location} {mode}")
                commit, write, missed = measure_latency(
                    uris,
                    spec,
                    options.samples,
                    (options.gap_min_ms, options.gap_max_ms),
                    options.seed,
                )
                idle = measure_idle(uris, spec, options.idle_seconds)
                report.results.append(
                    ModeResult(
                        location,
                        mode,
                        len(commit),
                        _pct(commit, 50),
                        _pct(commit, 95),
                        _pct(write, 50),
                        _pct(write, 95),
                        idle,
                        missed,
                    )
                )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def render(report: Report) -> str:
    """The figures of every mode, then each PubSub mode's verdicts against polling."""
    o = report.options
    lines = [
        f"persist bench pubsub  ({os.cpu_count()} cpus; {o.samples} writes per mode, "
        f"{o.gap_min_ms:.0f}-{o.gap_max_ms:.0f} ms apart; "
        f"{IDLE_LISTENERS} idle listeners for {o.idle_seconds:.0f} s)",
        "",
    ]
    lines.append(
        f"  {'location':<14}{'mode':<11}{'commit->listen p50':>19}{'p95':>10}"
        f"{'write->listen p50':>19}{'p95':>10}{'idle reads/s':>14}"
    )
    for r in report.results:
        lines.append(
            f"  {r.location:<14}{r.mode:<11}{r.commit_p50_ms:>16.2f} ms"
            f"{r.commit_p95_ms:>7.2f} ms{r.write_p50_ms:>16.2f} ms"
            f"{r.write_p95_ms:>7.2f} ms"
            f"{r.idle_reads_per_s:>14.2f}" + (f"  ({r.missed} missed)" if r.missed else "")
        )
    lines.append("")
    for v in report.verdicts:
        lines.append(
            f"  {v.location} {v.mode}: p50 <= {TARGET_P50_MS:.0f} ms "
            f"{'ok' if v.p50_ok else 'MISSED'}; {v.latency_ratio:.1f}x lower than polling "
            f"{'ok' if v.latency_ratio_ok else 'MISSED'} (>= {TARGET_RATIO:.0f}x); idle reads "
            f"{v.idle_ratio:.1f}x fewer {'ok' if v.idle_ratio_ok else 'MISSED'}"
        )
    for n in report.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


BENCHMARK = Benchmark("pubsub", PubSubOptions, run, render, __doc__)
"""``persist bench pubsub``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
