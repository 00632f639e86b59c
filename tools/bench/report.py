"""``persist bench all``: every benchmark in one run, written up as Markdown plus a PNG chart.

Run it as ``persist bench all`` or ``python -m pyspark_persist.tools.bench.report``
(``--out DIR``, ``--size-mib N``, ``--small-writes N``, ``--skip-spark``,
``--quick`` for a smoke run). In one process it runs, in order:

1. **Core** (:mod:`.core`): small-write latency on ``mem/mem``, ``file/sqlite``
   and ``file/postgres``; write and snapshot-read goodput on ``file/sqlite``
   next to raw pyarrow Parquet on the same rows; peak memory of a writer and
   a reader against persist's memory model.
2. **Delta Lake** (the ``deltalake`` package, delta-rs): the same generated
   Arrow rows appended with ``write_deltalake(..., mode="append")`` (one
   streaming commit, as persist commits one batch) and read back by scanning
   ``DeltaTable(path).to_pyarrow_dataset()``; one-row appends timed like
   persist's small writes.
3. **PubSub** (:mod:`.pubsub`): write-to-listen latency and idle Consensus
   reads with PubSub (gRPC, and LISTEN/NOTIFY on PostgreSQL) and without it.
4. **Maintenance** (:mod:`.maintenance`): many one-row writes with compaction
   and GC on and off.
5. **Spark** (``spark_write`` / ``spark_read`` / ``spark_freshness`` benchmarks,
   when installed): the persist sink and source next to Spark's built-in Parquet
   file sink and source, and two-query freshness in steady state.

Every figure in the report is measured in that run: nothing is hard-coded,
and a peer or section that could not run is reported as such. The outputs are
``report.md`` (also printed to stdout), ``report.png`` and ``report.json``
under ``--out``; progress goes to stderr, one line per step.

In the tables, *persist advantage* is how many times better persist does than
the peer on that row: persist / peer for goodput, peer / persist for
latency, time, bytes and counts (so above 1 always means persist is ahead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import gc
import importlib.util
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pyarrow as pa

from pyspark_persist.tools.bench import core, spark_freshness, spark_read, spark_write, step
from pyspark_persist.tools.bench import maintenance as maint
from pyspark_persist.tools.bench import pubsub as pubsub_bench
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, command_line, flag, setting

MiB = core.MiB

Progress = Callable[[str], None]

TITLES = {
    "core": "1. Core: small writes, throughput vs raw pyarrow, memory",
    "delta": "2. Delta Lake (deltalake / delta-rs) on the same Arrow data",
    "pubsub": "3. PubSub: write-to-listen latency, with and without push",
    "maintenance": "4. Maintenance: compaction and GC after many tiny writes",
    "spark": "5. Spark: persist sink and source vs Spark's Parquet file sink and source",
}
"""Every section of the report, in order, by key."""


# ---------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class ReportOptions(Options):
    """What ``persist bench all`` runs, and how big; ``--quick``: tiny sizes for a smoke run
    (well under a minute without Spark)."""

    out: str = flag("./bench-report", "directory for report.md, report.png, report.json")
    size_mib: int = flag(256, "Arrow MiB for throughput and memory", quick=8, positive=True)
    """Arrow MiB of generated rows for the throughput (persist, raw pyarrow, Delta) and memory."""
    small_writes: int = flag(300, "one-row writes timed per location", quick=30, positive=True)
    """One-row writes timed per location (persist) and for Delta."""
    warmup: int = setting(10, quick=3)
    repeats: int = flag(2, "throughput rounds, fastest kept", quick=1, positive=True)
    """Throughput rounds; each figure keeps its fastest."""
    part_mib: int = flag(64, "persist's part target size B in MiB", quick=2, positive=True)
    pubsub_samples: int = flag(40, "writes per PubSub mode", quick=8, positive=True)
    pubsub_gap_ms: tuple[float, float] = setting((20.0, 100.0), quick=(2.0, 10.0))
    pubsub_idle_seconds: float = setting(5.0, quick=1.0)
    pubsub_locations: tuple[str, ...] = setting(pubsub_bench.LOCATIONS, quick=("file/sqlite",))
    maintenance_writes: int = flag(
        2_000, "one-row writes per maintenance side", quick=200, positive=True
    )
    maintenance_keys: int = setting(200, quick=50)
    skip_spark: bool = flag(False, "do not run the Spark section")
    postgres_url: str = flag(core.POSTGRES_URL, "PostgreSQL consensus URL")
    workdir: str | None = flag(None, "directory for temporary files (default: the system's)")


# ---------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class Row:
    """One line of a section's table: persist's figure next to a peer's, both measured."""

    metric: str
    persist: float | None
    unit: str
    peer: str | None = None
    peer_value: float | None = None
    higher_is_better: bool = False
    target: str | None = None
    met: bool | None = None
    chart: str | None = None
    """``throughput`` or ``latency`` to plot this row in report.png, else None."""
    label: str | None = None
    """A short label for the chart."""
    note: str = ""

    @property
    def advantage(self) -> float | None:
        """How many times better persist does than the peer (>1: persist ahead), or None."""
        p, q = self.persist, self.peer_value
        if p is None or q is None or not (math.isfinite(p) and math.isfinite(q)):
            return None
        if self.higher_is_better:
            return p / q if q > 0 else None
        if p > 0:
            return q / p
        return math.inf if q > 0 else None


@dataclass
class Section:
    """One section of the report (a table, or the reason it has none)."""

    key: str
    title: str
    blurb: str = ""
    rows: list[Row] = field(default_factory=list)
    status: str = "ok"
    """``ok``, ``not run`` (skipped or unavailable) or ``failed`` (raised)."""
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Report(Result):
    """Everything one ``persist bench all`` run measured."""

    options: ReportOptions
    machine: dict[str, Any]
    sections: list[Section] = field(default_factory=list)
    seconds: float = 0.0
    command: str = "persist bench all"
    raw: dict[str, Any] = field(default_factory=dict)
    """Each benchmark's own full results (JSON values), for report.json."""
    chart: str | None = None
    """The chart's file name beside report.md, if it was drawn."""

    def exit_status(self) -> int:
        """1 when a section failed (its reason is in the report)."""
        return 1 if any(s.status == "failed" for s in self.sections) else 0

    def to_json(self) -> dict[str, Any]:
        """The report as plain JSON values."""

        def section(s: Section) -> dict[str, Any]:
            d = dataclasses.asdict(s)
            for r, row in zip(d["rows"], s.rows, strict=True):
                r["advantage"] = _json_float(row.advantage)
                r["persist"] = _json_float(row.persist)
                r["peer_value"] = _json_float(row.peer_value)
            return d

        return {
            "options": dataclasses.asdict(self.options),
            "machine": self.machine,
            "sections": [section(s) for s in self.sections],
            "seconds": self.seconds,
            "command": self.command,
            "raw": self.raw,
        }


def _json_float(x: float | None) -> float | str | None:
    if x is None or math.isfinite(x):
        return x
    return "inf" if x > 0 else "-inf"


# ---------------------------------------------------------------------------
# Machine


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ram_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / (1 << 30)
    except (ValueError, OSError, AttributeError):
        return None


def machine_info() -> dict[str, Any]:
    """The machine and software this run was taken on (nothing here imports Spark)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "ram_gib": _ram_gib(),
        "load_avg_at_start": list(load) if load else None,
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "pyspark": _version("pyspark"),
        "deltalake": _version("deltalake"),
        "matplotlib": _version("matplotlib"),
    }


# ---------------------------------------------------------------------------
# Helpers


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _goodput_row(
    metric: str,
    persist_mib_s: float,
    peer: str,
    peer_mib_s: float | None,
    *,
    min_ratio: float | None = None,
    label: str | None = None,
    note: str = "",
) -> Row:
    row = Row(
        metric,
        persist_mib_s,
        "MiB/s",
        peer,
        peer_mib_s,
        higher_is_better=True,
        chart="throughput",
        label=label,
        note=note,
    )
    if min_ratio is not None:
        adv = row.advantage
        row = dataclasses.replace(
            row, target=f"ratio >= {min_ratio:g}", met=None if adv is None else adv >= min_ratio
        )
    return row


def _core_config(opts: ReportOptions) -> core.BenchConfig:
    return core.BenchConfig(
        locations=("mem/mem", "file/sqlite", "file/postgres"),
        phases=("latency", "throughput", "memory"),
        writes=opts.small_writes,
        warmup=opts.warmup,
        size_mib=opts.size_mib,
        s3_size_mib=0,
        throughput_locations=("file/sqlite",),
        part_mib=opts.part_mib,
        repeats=opts.repeats,
        postgres_url=opts.postgres_url,
        workdir=opts.workdir,
    )


# ---------------------------------------------------------------------------
# 1. Core


def run_core_section(
    opts: ReportOptions, say: Progress
) -> tuple[Section, core.CoreReport | None, dict[str, Any]]:
    """Small-write latency, throughput vs raw pyarrow and peak memory (the core benchmark)."""
    cfg = _core_config(opts)
    sec = Section(
        "core",
        TITLES["core"],
        f"{opts.small_writes} one-row `append`s per location after {opts.warmup} warm-up; "
        f"{opts.size_mib} MiB of generated Arrow rows (60 B/row) staged with one BatchBuilder "
        f"(B = {opts.part_mib} MiB parts, N = {cfg.outstanding_parts}) and committed, then "
        "streamed back by a fresh client, on file/sqlite; raw pyarrow = `pq.ParquetWriter` "
        "(snappy, one fsync) and `ParquetFile.iter_batches` on the same rows; "
        f"best of {opts.repeats} interleaved round(s). Memory: spawned child processes.",
    )
    rep = core.run_core(cfg, lambda m: say(f"core: {m}"))
    sec.notes.extend(rep.notes)
    for lat in rep.latency:
        target = lat.target_p50_ms
        sec.rows.append(
            Row(
                f"small write p50, {lat.location}",
                lat.p50_ms,
                "ms",
                target=None if target is None else f"<= {target:g} ms",
                met=lat.meets_target,
            )
        )
        sec.rows.append(Row(f"small write p95, {lat.location}", lat.p95_ms, "ms"))
    for t in rep.throughput:
        sec.rows.append(
            _goodput_row(
                f"write goodput, {t.location} ({t.parts} parts)",
                t.persist_write_mib_s,
                "raw pyarrow Parquet",
                t.raw_write_mib_s,
                min_ratio=core.RATIO_TARGET,
                label="write goodput (bulk, one commit)",
            )
        )
        sec.rows.append(
            _goodput_row(
                f"snapshot-read goodput, {t.location}",
                t.persist_read_mib_s,
                "raw pyarrow Parquet",
                t.raw_read_mib_s,
                min_ratio=core.RATIO_TARGET,
                label="read goodput (full snapshot)",
            )
        )
        sec.rows.append(
            Row(
                "stored bytes (encoded parts)",
                t.encoded_mib,
                "MiB",
                "raw pyarrow Parquet file",
                t.raw_file_mib,
            )
        )
    for m in rep.memory:
        peak = max(m.arrow_pool_peak_mib, m.rss_growth_mib)
        sec.rows.append(
            Row(
                f"peak memory, {m.role} ({m.arrow_mib:.0f} MiB of rows)",
                peak,
                "MiB",
                f"model bound {m.bound_formula}",
                m.bound_mib,
                target="<= bound",
                met=m.within,
                note=f"arrow pool {m.arrow_pool_peak_mib:.0f} MiB, RSS growth "
                f"{m.rss_growth_mib:.0f} MiB",
            )
        )
    return sec, rep, rep.to_json()


# ---------------------------------------------------------------------------
# 2. Delta Lake


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def _delta_batches(pool: core.ChunkPool, rows: int) -> Iterator[pa.RecordBatch]:
    for chunk in pool.iter_rows(rows):
        yield from chunk.to_batches()


def measure_delta_throughput(
    size_mib: int, cfg: core.BenchConfig, workdir: str, repeats: int
) -> dict[str, float]:
    """Append ``size_mib`` of the core benchmark's rows to a Delta table and scan them back.

    The rows are the same as the core throughput phase's (same pool, seed and
    chunking). The write is one ``write_deltalake(mode="append")`` of a
    streaming RecordBatchReader (one commit, snappy); the read opens a fresh
    ``DeltaTable`` and streams every batch of its pyarrow dataset. Best of
    ``repeats``.
    """
    from deltalake import DeltaTable, WriterProperties, write_deltalake

    total_rows = core.rows_for(size_mib * MiB)
    pool = core.ChunkPool(cfg.pool_chunks, min(cfg.chunk_rows, total_rows), cfg.seed)
    props = WriterProperties(compression="SNAPPY")
    best: dict[str, float] = {}
    stored = 0
    for _ in range(max(1, repeats)):
        path = os.path.join(workdir, f"delta-{uuid.uuid4().hex[:8]}")
        try:
            gc.collect()
            t0 = time.perf_counter()
            reader = pa.RecordBatchReader.from_batches(
                core.ROW_SCHEMA, _delta_batches(pool, total_rows)
            )
            write_deltalake(path, reader, mode="append", writer_properties=props)
            best["write_s"] = min(time.perf_counter() - t0, best.get("write_s", math.inf))
            stored = _dir_bytes(path)
            gc.collect()
            t0 = time.perf_counter()
            rows = 0
            for batch in DeltaTable(path).to_pyarrow_dataset().to_batches():
                rows += batch.num_rows
            best["read_s"] = min(time.perf_counter() - t0, best.get("read_s", math.inf))
            if rows != total_rows:
                raise RuntimeError(f"Delta scan returned {rows} rows, wrote {total_rows}")
        finally:
            shutil.rmtree(path, ignore_errors=True)
    arrow_mib = total_rows * core.ROW_BYTES / MiB
    return {
        "arrow_mib": arrow_mib,
        "rows": float(total_rows),
        "write_s": best["write_s"],
        "read_s": best["read_s"],
        "write_mib_s": arrow_mib / best["write_s"],
        "read_mib_s": arrow_mib / best["read_s"],
        "stored_mib": stored / MiB,
    }


def measure_delta_small_appends(writes: int, warmup: int, workdir: str) -> dict[str, float]:
    """Time ``write_deltalake(table, one_row, mode="append")`` ``writes`` times (one commit each).

    The table handle is reused between appends (as a long-lived writer would),
    so each append does not replay the log from scratch.
    """
    import numpy as np
    from deltalake import DeltaTable, write_deltalake

    path = os.path.join(workdir, f"delta-small-{uuid.uuid4().hex[:8]}")
    try:
        rows = [
            pa.table({"id": [i], "name": [f"row-{i}"]}, schema=core.SMALL_SCHEMA)
            for i in range(warmup + writes + 1)
        ]
        write_deltalake(path, rows[0], mode="append")
        table = DeltaTable(path)
        for t in rows[1 : warmup + 1]:
            write_deltalake(table, t, mode="append")
        samples: list[float] = []
        for t in rows[warmup + 1 :]:
            t0 = time.perf_counter()
            write_deltalake(table, t, mode="append")
            samples.append(time.perf_counter() - t0)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    arr = np.asarray(samples) * 1e3
    return {
        "writes": float(writes),
        "p50_ms": float(np.percentile(arr, 50)),
        "p95_ms": float(np.percentile(arr, 95)),
    }


def run_delta_section(
    opts: ReportOptions, core_report: core.CoreReport | None, say: Progress
) -> tuple[Section, dict[str, Any]]:
    """The core benchmark's rows and small writes, with ``deltalake`` (delta-rs) as the peer."""
    sec = Section(
        "delta",
        TITLES["delta"],
        f"{opts.size_mib} MiB of the core section's rows (same generator, seed and chunks) "
        'appended by `write_deltalake(path, reader, mode="append")` as one streaming '
        "commit (snappy), then scanned back with a fresh `DeltaTable(path)."
        "to_pyarrow_dataset()`; best of "
        f"{opts.repeats} round(s). Small appends: {opts.small_writes} one-row "
        '`write_deltalake(..., mode="append")` (one commit each) on the local file system, '
        "next to persist's one-row `append` on file/sqlite from section 1.",
    )
    if importlib.util.find_spec("deltalake") is None:
        sec.status, sec.reason = "not run", "the `deltalake` package is not installed"
        return sec, {}
    if core_report is None:
        sec.status, sec.reason = "not run", "the core section did not run, nothing to compare"
        return sec, {}
    cfg = _core_config(opts)
    workdir = tempfile.mkdtemp(prefix="persist-bench-delta-", dir=opts.workdir)
    try:
        say(f"delta: append + scan ({opts.size_mib} MiB)")
        tput = measure_delta_throughput(opts.size_mib, cfg, workdir, opts.repeats)
        say(f"delta: {opts.small_writes} one-row appends")
        small = measure_delta_small_appends(opts.small_writes, opts.warmup, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    t = next((x for x in core_report.throughput if x.location == "file/sqlite"), None)
    if t is not None:
        sec.rows.append(
            _goodput_row(
                "write goodput, file/sqlite vs local Delta table",
                t.persist_write_mib_s,
                "Delta append",
                tput["write_mib_s"],
                label="write goodput (bulk, one commit)",
            )
        )
        sec.rows.append(
            _goodput_row(
                "read goodput (full scan)",
                t.persist_read_mib_s,
                "Delta scan",
                tput["read_mib_s"],
                label="read goodput (full snapshot)",
            )
        )
        sec.rows.append(
            Row("stored bytes", t.encoded_mib, "MiB", "Delta table directory", tput["stored_mib"])
        )
    else:
        sec.notes.append("persist's file/sqlite throughput was not measured; Delta figures only")
        sec.rows.append(
            Row(
                "Delta append goodput (no persist figure)",
                None,
                "MiB/s",
                "Delta append",
                tput["write_mib_s"],
            )
        )
    lat = next((x for x in core_report.latency if x.location == "file/sqlite"), None)
    persist_p50 = lat.p50_ms if lat else None
    persist_p95 = lat.p95_ms if lat else None
    sec.rows.append(
        Row(
            "one-row append p50",
            persist_p50,
            "ms",
            "Delta one-row append",
            small["p50_ms"],
            chart="latency",
            label="one-row append p50",
        )
    )
    sec.rows.append(
        Row("one-row append p95", persist_p95, "ms", "Delta one-row append", small["p95_ms"])
    )
    return sec, {"throughput": tput, "small_appends": small}


# ---------------------------------------------------------------------------
# 3. PubSub


def run_pubsub_section(opts: ReportOptions, say: Progress) -> tuple[Section, dict[str, Any]]:
    """Write-to-listen latency and idle Consensus reads with and without PubSub."""
    lo, hi = opts.pubsub_gap_ms
    sec = Section(
        "pubsub",
        TITLES["pubsub"],
        f"Writer and listener in separate clients with separate state caches; {opts.pubsub_samples}"
        f" one-row appends {lo:g}-{hi:g} ms apart per mode. commit->listen = from the append "
        "returning to the listener holding the row; write->listen adds the append. Idle: "
        f"{pubsub_bench.IDLE_LISTENERS} listeners on a quiet shard for "
        f"{opts.pubsub_idle_seconds:g} s. Peer = the same persist with PubSub off (polling).",
    )
    options = pubsub_bench.PubSubOptions(
        locations=opts.pubsub_locations,
        samples=opts.pubsub_samples,
        gap_min_ms=lo,
        gap_max_ms=hi,
        idle_seconds=opts.pubsub_idle_seconds,
        postgres_url=opts.postgres_url,
    )
    say(f"pubsub: {', '.join(opts.pubsub_locations)} (grpc, pg-notify, polling)")
    result = pubsub_bench.run(options)
    sec.notes.extend(result.notes)
    for loc in opts.pubsub_locations:
        base = result.mode(loc, "polling")
        if base is None:
            continue
        for mode in ("grpc", "pg-notify"):
            r = result.mode(loc, mode)
            if r is None:
                continue
            row = Row(
                f"commit->listen p50, {loc}, {mode}",
                r.commit_p50_ms,
                "ms",
                "polling (PubSub off)",
                base.commit_p50_ms,
                chart="latency",
                label=f"commit->listen p50, {loc}, {mode}",
            )
            adv = row.advantage
            met = (
                r.commit_p50_ms <= pubsub_bench.TARGET_P50_MS
                and adv is not None
                and adv >= pubsub_bench.TARGET_RATIO
            )
            sec.rows.append(
                dataclasses.replace(
                    row,
                    met=met,
                    target=f"<= {pubsub_bench.TARGET_P50_MS:g} ms and >= "
                    f"{pubsub_bench.TARGET_RATIO:g}x",
                )
            )
            sec.rows.append(
                Row(
                    f"commit->listen p95, {loc}, {mode}",
                    r.commit_p95_ms,
                    "ms",
                    "polling (PubSub off)",
                    base.commit_p95_ms,
                )
            )
            sec.rows.append(
                Row(
                    f"write->listen p50, {loc}, {mode}",
                    r.write_p50_ms,
                    "ms",
                    "polling (PubSub off)",
                    base.write_p50_ms,
                )
            )
            idle = Row(
                f"idle Consensus reads/s, {loc}, {mode}",
                r.idle_reads_per_s,
                "reads/s",
                "polling (PubSub off)",
                base.idle_reads_per_s,
            )
            adv = idle.advantage
            sec.rows.append(
                dataclasses.replace(
                    idle,
                    target=f">= {pubsub_bench.TARGET_RATIO:g}x fewer",
                    met=None if adv is None else adv >= pubsub_bench.TARGET_RATIO,
                )
            )
            missed = r.missed + base.missed
            if missed:
                sec.notes.append(
                    f"{loc}: {missed} write(s) never reached a listener in 10 s "
                    "(left out of the percentiles)"
                )
    return sec, result.to_json()


# ---------------------------------------------------------------------------
# 4. Maintenance


def run_maintenance_section(opts: ReportOptions, say: Progress) -> tuple[Section, dict[str, Any]]:
    """Many one-row writes with compaction and GC on and off (the maintenance benchmark)."""
    mopts = maint.MaintenanceOptions(
        writes=opts.maintenance_writes, keys=opts.maintenance_keys, workdir=opts.workdir
    )
    sec = Section(
        "maintenance",
        TITLES["maintenance"],
        f"{mopts.writes:,} one-row writes over {mopts.keys} keys (every 13th a retraction), "
        f"since downgraded every {mopts.downgrade_every} writes, on file/sqlite, once with "
        "maintenance on and once off (the peer). Snapshot read = median of "
        f"{mopts.reads} `snapshot_table()`.",
    )
    say(f"maintenance: {mopts.writes} writes, on and off")
    rep = maint.run(mopts, lambda m: say(f"maintenance: {m}"))
    on, off = rep.on, rep.off
    read = Row(
        "snapshot read (median)",
        on.read_median_s * 1e3,
        "ms",
        "maintenance off",
        off.read_median_s * 1e3,
        chart="latency",
        label="snapshot read, tiny writes",
    )
    sec.rows.append(
        dataclasses.replace(read, target=f">= {maint.READ_TARGET:g}x faster", met=rep.read_ok)
    )
    sec.rows.append(
        Row(
            "Blob bytes (maintenance on)",
            on.blob_bytes / 1024,
            "KiB",
            "consolidated Parquet of the snapshot",
            on.consolidated_bytes / 1024,
            target=f"<= {maint.STORAGE_TARGET:g}x consolidated",
            met=rep.storage_ok,
        )
    )
    sec.rows.append(
        Row("Blob bytes", on.blob_bytes / 1024, "KiB", "maintenance off", off.blob_bytes / 1024)
    )
    sec.rows.append(Row("live parts", float(on.parts), "", "maintenance off", float(off.parts)))
    sec.rows.append(
        Row("Blob objects", float(on.blob_objects), "", "maintenance off", float(off.blob_objects))
    )
    sec.rows.append(
        Row(
            "write time (incl. waiting for maintenance)",
            on.write_s,
            "s",
            "maintenance off",
            off.write_s,
        )
    )
    if not rep.exact:
        sec.notes.append("the final snapshots with maintenance on and off DIFFER")
    return sec, rep.to_json()


# ---------------------------------------------------------------------------
# 5. Spark


def spark_write_rows(result: spark_write.Report) -> list[Row]:
    """persist's Spark write next to Spark Parquet's, and the discarding sink for scale."""
    persist = result.figures("persist append")
    parquet = result.figures("parquet append")
    ratio = persist.mib_per_s / parquet.mib_per_s
    return [
        Row(
            f"Spark job writing {result.size_mib:.0f} MiB ({persist.rows:,} rows)",
            persist.mib_per_s,
            "MiB/s",
            "Spark Parquet writer, mode append",
            parquet.mib_per_s,
            higher_is_better=True,
            target="ratio >= 1.0",
            met=ratio >= 1.0,
            chart="throughput",
            label="Spark write",
        ),
        Row(
            "(scale) the same write into a Python sink that discards the rows",
            result.figures("discard").mib_per_s,
            "MiB/s",
            "Spark Parquet writer, mode append",
            parquet.mib_per_s,
            higher_is_better=True,
            note="not persist: the most any Python Data Source sink reaches on this machine",
        ),
    ]


def spark_freshness_rows(result: spark_freshness.Report) -> list[Row]:
    """persist's two-query freshness next to the file pipeline's, and any Python sink's floor."""
    persist, files = result.pipeline("persist"), result.pipeline("file")
    rows = [
        Row(
            f"two-query freshness {q}, steady state (rate -> sink; a query tailing it)",
            mine,
            "ms",
            "Spark file sink -> file source",
            theirs,
            target=f"<= {target}x file pipeline",
            met=mine <= target * theirs,
            chart="latency" if q == "p50" else None,
            label="Spark freshness p50",
        )
        for q, mine, theirs, target in (
            ("p50", persist.p50_ms, files.p50_ms, spark_freshness.P50_TARGET),
            ("p95", persist.p95_ms, files.p95_ms, spark_freshness.P95_TARGET),
        )
    ]
    rows.append(
        Row(
            "(scale) the earliest any Python sink commits a row after its micro-batch starts",
            result.sink_floor_ms,
            "ms",
            "Spark file sink -> file source",
            files.p50_ms,
            note="not persist: a discarding sink's walCommit + queryPlanning + addBatch",
        )
    )
    return rows


def spark_read_rows(result: spark_read.Report) -> list[Row]:
    """persist's Spark scans at default options next to Spark Parquet's, the better tuned
    split beside the default, and the no-I/O source for scale."""
    default, sink = result.appended, result.sink_written
    tuned = result.tuned("persist")
    parquet = result.timing(spark_read.PARQUET)
    return [
        Row(
            f"Spark snapshot read, default options ({default.partitions} tasks)",
            default.mib_per_s,
            "MiB/s",
            "Spark Parquet reader",
            parquet.mib_per_s,
            higher_is_better=True,
            target="ratio >= 1.0",
            met=default.mib_per_s >= parquet.mib_per_s,
            chart="throughput",
            label="Spark read",
        ),
        Row(
            f"Spark snapshot read of a shard the Spark sink wrote, default options "
            f"({sink.partitions} tasks)",
            sink.mib_per_s,
            "MiB/s",
            "Spark Parquet reader",
            parquet.mib_per_s,
            higher_is_better=True,
            target="ratio >= 1.0",
            met=sink.mib_per_s >= parquet.mib_per_s,
        ),
        Row(
            "Spark snapshot read, default options against the better tuned split",
            default.mib_per_s,
            "MiB/s",
            f"persist, {tuned.name.split()[-1]} ({tuned.partitions} tasks)",
            tuned.mib_per_s,
            higher_is_better=True,
            target=f"default within {spark_read.DEFAULT_TARGET}x",
            met=result.default_over_tuned("persist") <= spark_read.DEFAULT_TARGET,
        ),
        Row(
            "(scale) the same scan of a Python source that does no I/O",
            result.timing(spark_read.CEILING).mib_per_s,
            "MiB/s",
            "Spark Parquet reader",
            parquet.mib_per_s,
            higher_is_better=True,
            note="not persist: the most any Python Data Source reader reaches on this machine",
        ),
    ]


@dataclass(frozen=True)
class SparkRun:
    """A Spark benchmark as this report runs it: its options from the report's, and the
    rows its result gives."""

    benchmark: Benchmark[Any, Any]
    options: Callable[[ReportOptions], Options]
    rows: Callable[[Any], list[Row]]


SPARK_RUNS = (
    SparkRun(
        spark_write.BENCHMARK,
        # spark_freshness measures what spark_write's latency pipelines would, in steady state.
        lambda o: spark_write.SparkWriteOptions.make(
            o.quick, skip_latency=True, **({} if o.quick else {"size_mib": float(o.size_mib)})
        ),
        spark_write_rows,
    ),
    SparkRun(
        spark_read.BENCHMARK,
        lambda o: spark_read.SparkReadOptions.make(
            o.quick, **({} if o.quick else {"size_mib": o.size_mib})
        ),
        spark_read_rows,
    ),
    SparkRun(
        spark_freshness.BENCHMARK,
        # The report's rows are persist's append against files: the upsert pipeline is
        # spark-freshness's own (issue 35), left out to keep the section's run time.
        lambda o: spark_freshness.FreshnessOptions.make(
            o.quick, pipelines=("persist", "file", "floor")
        ),
        spark_freshness_rows,
    ),
)
"""The Spark benchmarks, in the order the section runs them."""


def _mib(options: Options) -> str:
    """`` at N MiB`` for options with a size, else nothing."""
    size = getattr(options, "size_mib", None)
    return "" if size is None else f" at {size:g} MiB"


def run_spark_section(opts: ReportOptions, say: Progress) -> tuple[Section, dict[str, Any]]:
    """The Spark sink and source next to Spark's Parquet file sink and source."""
    runs = [(r, r.options(opts)) for r in SPARK_RUNS]
    sec = Section(
        "spark",
        TITLES["spark"],
        "The Spark benchmarks ("
        + ", ".join(f"`{r.benchmark.name}`{_mib(o)}" for r, o in runs)
        + "), run in this process; peer = Spark's built-in Parquet file sink / file source on "
        "the same rows in the same run.",
    )
    if opts.skip_spark:
        sec.status, sec.reason = "not run", "`--skip-spark` was given"
        return sec, {}
    if importlib.util.find_spec("pyspark") is None:
        sec.status, sec.reason = "not run", "pyspark is not installed"
        return sec, {}
    raw: dict[str, Any] = {}
    for spark_run, options in runs:
        name = spark_run.benchmark.name
        say(f"spark: {name}{_mib(options)}")
        try:
            result = spark_run.benchmark.run(options)
        except Exception as e:  # noqa: BLE001 - reported in the section, the run goes on
            sec.notes.append(f"{name} failed: {_first_line(e)}")
            continue
        raw[name] = result.to_json()
        sec.notes.append(f"ran `{command_line(spark_run.benchmark.prog, options)}`")
        sec.rows.extend(spark_run.rows(result))
    if not raw:
        sec.status, sec.reason, sec.notes = "failed", "; ".join(sec.notes), []
    return sec, raw


# ---------------------------------------------------------------------------
# Driver


def _guarded(
    key: str, fn: Callable[[], tuple[Section, dict[str, Any]]], say: Progress
) -> tuple[Section, dict[str, Any]]:
    t0 = time.perf_counter()
    try:
        sec, raw = fn()
    except Exception as e:  # noqa: BLE001 - one section failing must not lose the others
        say(f"{key}: FAILED ({_first_line(e)})")
        sec, raw = Section(key, TITLES[key], status="failed", reason=_first_line(e)), {}
    sec.seconds = time.perf_counter() - t0
    say(f"{key}: done in {sec.seconds:.1f} s ({sec.status})")
    return sec, raw


def run_all(opts: ReportOptions, say: Progress = step) -> Report:
    """Run every section in this process and return what was measured."""
    started = time.perf_counter()
    report = Report(opts, machine_info(), command=command_line(BENCHMARK.prog, opts))
    holder: dict[str, core.CoreReport | None] = {"core": None}

    def core_fn() -> tuple[Section, dict[str, Any]]:
        sec, rep, raw = run_core_section(opts, say)
        holder["core"] = rep
        return sec, raw

    steps: list[tuple[str, Callable[[], tuple[Section, dict[str, Any]]]]] = [
        ("core", core_fn),
        ("delta", lambda: run_delta_section(opts, holder["core"], say)),
        ("pubsub", lambda: run_pubsub_section(opts, say)),
        ("maintenance", lambda: run_maintenance_section(opts, say)),
        ("spark", lambda: run_spark_section(opts, say)),
    ]
    for key, fn in steps:
        say(f"{key}: starting")
        sec, raw = _guarded(key, fn, say)
        report.sections.append(sec)
        if raw:
            report.raw[key] = raw
        gc.collect()
    report.seconds = time.perf_counter() - started
    return report


# ---------------------------------------------------------------------------
# Markdown


def _num(x: float) -> str:
    """A figure for people; an int (a median of Spark's whole-ms phases) reads as a float."""
    x = float(x)
    if not math.isfinite(x):
        return "inf"
    a = abs(x)
    if x.is_integer() and a < 1e7:
        return f"{int(x):,}"
    if a >= 100:
        return f"{x:,.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"


def _fig(x: float | None, unit: str) -> str:
    if x is None:
        return "n/a"
    return f"{_num(x)} {unit}".strip()


def _adv(x: float | None) -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else f"{x:.2f}x")


def _met(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "**no**")


def section_markdown(sec: Section) -> list[str]:
    """One section: header, what was run, its table (or why there is none), notes."""
    out = [f"## {sec.title}", ""]
    if sec.blurb:
        out += [sec.blurb, ""]
    if sec.status != "ok":
        out += [f"**{sec.status}**: {sec.reason}", ""]
        return out
    if sec.rows:
        out.append("| metric | persist | peer | peer figure | persist advantage | target | met? |")
        out.append("|---|---:|---|---:|---:|---|:---:|")
        for r in sec.rows:
            metric = r.metric + (f" ({r.note})" if r.note else "")
            out.append(
                f"| {metric} | {_fig(r.persist, r.unit)} | {r.peer or '-'} | "
                f"{_fig(r.peer_value, r.unit) if r.peer else '-'} | {_adv(r.advantage)} | "
                f"{r.target or '-'} | {_met(r.met)} |"
            )
        out.append("")
    else:
        out += ["(no figures)", ""]
    for n in sec.notes:
        out.append(f"- note: {n}")
    if sec.notes:
        out.append("")
    out += [f"_{sec.seconds:.1f} s_", ""]
    return out


def machine_line(m: dict[str, Any]) -> str:
    """The one-line description of where and when the report was taken."""
    ram = f"{m['ram_gib']:.1f} GiB RAM" if m.get("ram_gib") else "RAM unknown"
    load = m.get("load_avg_at_start")
    load_s = f"; load average at start {load[0]:.2f}" if load else ""
    return (
        f"Taken {m['date']} on {m['cpus']} CPUs ({m['cpu']}), {ram}, {m['platform']}; "
        f"Python {m['python']}, pyarrow {m['pyarrow']}, pyspark {m['pyspark']}, "
        f"deltalake {m['deltalake']}{load_s}."
    )


def to_markdown(report: Report) -> str:
    """The whole report as Markdown."""
    o = report.options
    out = [
        "# persist benchmark report",
        "",
        f"**Machine:** {machine_line(report.machine)}",
        "",
        f"Command: `{report.command}` ({o.size_mib} MiB of rows, {o.small_writes} small writes, "
        f"{o.pubsub_samples} PubSub samples per mode, {o.maintenance_writes:,} maintenance "
        f"writes); total {report.seconds:.0f} s. Every figure was measured in this run, "
        "persist and peers alike. *persist advantage* = persist / peer for goodput (MiB/s), "
        "peer / persist for latency, time, bytes and counts: above 1 means persist is ahead.",
        "",
    ]
    if report.chart:
        out += [f"![throughput and latency, persist vs peers]({report.chart})", ""]
    for sec in report.sections:
        out += section_markdown(sec)
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------------------
# Chart


def chart_groups(report: Report, kind: str) -> dict[str, list[tuple[str, float]]]:
    """The bars of one chart panel: per label, persist's figure then every peer's, in order.

    Rows of different sections sharing a label (e.g. write goodput against raw
    pyarrow and against Delta) share a group, so persist appears once next to
    all its peers.
    """
    groups: dict[str, list[tuple[str, float]]] = {}
    for sec in report.sections:
        for r in sec.rows:
            if r.chart != kind or r.persist is None:
                continue
            bars = groups.setdefault(r.label or r.metric, [])
            if not any(name == "persist" and value == r.persist for name, value in bars):
                bars.append(("persist" if not bars else f"persist ({sec.key})", r.persist))
            if r.peer and r.peer_value is not None and math.isfinite(r.peer_value):
                bars.append((r.peer, r.peer_value))
    return groups


def write_chart(report: Report, path: str) -> None:
    """A PNG: goodput (MiB/s) and p50 latency (ms, log scale), persist next to each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("throughput", "goodput, MiB/s (higher is better)", False),
        ("latency", "p50 latency, ms (lower is better, log scale)", True),
    )
    palette = ["#dd8452", "#55a868", "#8172b3", "#c44e52", "#937860", "#da8bc3", "#8c8c8c"]
    colors: dict[str, str] = {}
    fig, axes = plt.subplots(1, 2, figsize=(15, 7))
    for ax, (kind, title, log) in zip(axes, panels, strict=True):
        ax.set_title(title)
        groups = chart_groups(report, kind)
        if not groups:
            ax.text(0.5, 0.5, "nothing measured", ha="center", va="center")
            ax.set_axis_off()
            continue
        y = 0.0
        ticks: list[float] = []
        floor = 1e-3 if log else 0.0
        for bars in groups.values():
            ys = [y + i * 0.8 for i in range(len(bars))]
            for yy, (name, value) in zip(ys, bars, strict=True):
                color = (
                    "#2b6cb0"
                    if name.startswith("persist")
                    else colors.setdefault(name, palette[len(colors) % len(palette)])
                )
                ax.barh(yy, max(value, floor), 0.7, color=color)
                ax.text(max(value, floor), yy, f" {name}: {_num(value)}", va="center", fontsize=7)
            ticks.append(sum(ys) / len(ys))
            y = ys[-1] + 1.6
        ax.set_yticks(ticks, list(groups), fontsize=8)
        ax.invert_yaxis()
        if log:
            ax.set_xscale("log")
        ax.margins(x=0.45)
    m = report.machine
    fig.suptitle(
        f"persist bench all, {m['date']}: {m['cpus']} CPUs, "
        f"{(m.get('ram_gib') or 0):.0f} GiB RAM, pyarrow {m['pyarrow']}, "
        f"deltalake {m['deltalake']}, pyspark {m['pyspark']} (blue: persist)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------
# The benchmark


def run(opts: ReportOptions) -> Report:
    """Run every section and write report.md, report.png and report.json under ``opts.out``."""
    os.makedirs(opts.out, exist_ok=True)
    report = run_all(opts)
    chart = os.path.join(opts.out, "report.png")
    try:
        write_chart(report, chart)
        report.chart = "report.png"
    except ImportError as e:
        step(f"chart: not written ({_first_line(e)}; install matplotlib)")
    with open(os.path.join(opts.out, "report.md"), "w") as f:
        f.write(to_markdown(report))
    with open(os.path.join(opts.out, "report.json"), "w") as f:
        json.dump(report.to_json(), f, indent=2, default=str)
    step(f"wrote {os.path.join(opts.out, 'report.md')}" + (f" and {chart}" if report.chart else ""))
    return report


BENCHMARK = Benchmark("all", ReportOptions, run, to_markdown, __doc__)
"""``persist bench all``: its output is report.md, and its exit status is 1 when a section
failed."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
