"""The maintenance benchmark: what compaction and GC buy after many tiny writes.

Run it as ``persist bench maintenance`` (``--writes N``, ``--json``). In one
run it performs the same workload twice on file Blob + SQLite Consensus, in
two separate directories: once with maintenance on (the default
:class:`~pyspark_persist.state.PersistConfig`) and once with it off
(``PersistConfig(maintenance=False)``). The workload is ``--writes`` one-row
appends (keys ``i % --keys``, every 13th write retracting the previous key)
with a reader that downgrades its since to the newest time every
``--downgrade-every`` writes, as a streaming consumer would.

Then, for each, it measures (never assumes):

- live batches and parts in state (parts split into inline and Blob);
- Blob objects and bytes under the shard's prefix, Consensus rows and bytes;
- the consolidated data size: Parquet bytes (pyarrow, snappy, to a buffer)
  of the final consolidated snapshot table;
- the storage ratio: Blob bytes / consolidated size (and, for context, the
  same with Consensus bytes added);
- snapshot-read time: the median of ``--reads`` ``reader.snapshot_table()``.

Targets printed next to the figures: snapshot reads at least 10x faster with
maintenance on than off, and storage (maintenance on) within 2x of the
consolidated size. Nothing here imports Spark.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pyspark_persist.state import DIFF, TIME, Committed, PersistClient, PersistConfig
from pyspark_persist.tools.bench import step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag

SCHEMA = pa.schema([("k", pa.int64())])
READ_TARGET = 10.0
"""Snapshot reads with maintenance on must be at least this many times faster than off."""
STORAGE_TARGET = 2.0
"""Blob bytes with maintenance on must be within this factor of the consolidated size."""
SHARD = "bench-maintenance"


@dataclass(frozen=True)
class MaintenanceOptions(Options):
    """What to run."""

    writes: int = flag(10_000, "one-row writes per side", quick=200, positive=True)
    keys: int = flag(500, "distinct keys written round-robin", quick=50, positive=True)
    downgrade_every: int = flag(10, "writes between since downgrades", positive=True)
    reads: int = flag(5, "snapshot reads timed per side", positive=True)
    workdir: str | None = flag(None, "directory for temporary files (default: the system's)")


@dataclass(frozen=True)
class Figures:
    """One side (maintenance on or off) of the comparison, all measured."""

    maintenance: bool
    write_s: float
    batches: int
    parts: int
    inline_parts: int
    blob_objects: int
    blob_bytes: int
    consensus_rows: int
    consensus_bytes: int
    snapshot_rows: int
    consolidated_bytes: int
    read_median_s: float
    read_samples_s: tuple[float, ...]

    @property
    def storage_ratio(self) -> float:
        """Blob bytes / consolidated Parquet bytes of the final snapshot."""
        return self.blob_bytes / max(self.consolidated_bytes, 1)

    @property
    def total_ratio(self) -> float:
        """(Blob + Consensus bytes) / consolidated Parquet bytes."""
        return (self.blob_bytes + self.consensus_bytes) / max(self.consolidated_bytes, 1)


@dataclass(frozen=True)
class Report(Result):
    """Both sides and the verdicts."""

    options: MaintenanceOptions
    on: Figures
    off: Figures
    exact: bool

    @property
    def read_speedup(self) -> float:
        """Snapshot-read time off / on."""
        return self.off.read_median_s / max(self.on.read_median_s, 1e-9)

    @property
    def read_ok(self) -> bool:
        """Whether the snapshot-read target holds."""
        return self.read_speedup >= READ_TARGET

    @property
    def storage_ok(self) -> bool:
        """Whether the storage target holds (maintenance on)."""
        return self.on.storage_ratio <= STORAGE_TARGET

    def to_json(self) -> dict[str, Any]:
        """Everything, as plain JSON values."""

        def side(f: Figures) -> dict[str, Any]:
            d = asdict(f)
            d["read_samples_s"] = list(f.read_samples_s)
            d["storage_ratio"] = f.storage_ratio
            d["total_ratio"] = f.total_ratio
            return d

        return {
            "options": asdict(self.options),
            "on": side(self.on),
            "off": side(self.off),
            "snapshots_equal": self.exact,
            "read_speedup": self.read_speedup,
            "targets": {
                "read_speedup_min": READ_TARGET,
                "read_ok": self.read_ok,
                "storage_ratio_max": STORAGE_TARGET,
                "storage_ok": self.storage_ok,
            },
        }


def consolidated_parquet_bytes(table: pa.Table) -> int:
    """Parquet bytes (snappy, pyarrow defaults) of ``table``, sorted by key, written to a buffer.

    Sorting first makes the figure independent of the order a snapshot happens to return.
    """
    table = table.sort_by([(name, "ascending") for name in table.column_names])
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="snappy")
    return int(sink.getvalue().size)


def run_side(
    root: str, maintenance: bool, opts: MaintenanceOptions, progress: Callable[[str], None]
) -> tuple[Figures, pa.Table]:
    """Run the workload on a fresh file/sqlite location and measure it."""
    config = PersistConfig(maintenance=maintenance)
    client = PersistClient.open(
        f"file://{root}/blob", f"sqlite:///{root}/consensus.db", config=config
    )
    try:
        shard = client.open_shard(SHARD, SCHEMA)
        writer = shard.writer()
        reader = shard.reader()
        data_schema = pa.schema([("k", pa.int64()), (TIME, pa.uint64()), (DIFF, pa.int64())])
        start = time.perf_counter()
        for i in range(opts.writes):
            if i % 13 == 12:
                key, diff = (i - 1) % opts.keys, -1
            else:
                key, diff = i % opts.keys, 1
            table = pa.table(
                {"k": [key], TIME: pa.array([i], pa.uint64()), DIFF: [diff]}, schema=data_schema
            )
            res = writer.compare_and_append(table, i, i + 1)
            if not isinstance(res, Committed):
                raise RuntimeError(f"write {i} did not commit: {res}")
            if (i + 1) % opts.downgrade_every == 0:
                reader.downgrade_since(i)
            if (i + 1) % 2_000 == 0:
                progress(f"maintenance {'on' if maintenance else 'off'}: {i + 1} writes")
        client.maintenance.wait_idle(120)
        write_s = time.perf_counter() - start

        state = shard.state()
        parts = [p for b in state.batches.values() for p in b.parts]
        metas = list(client.blob.list_keys(f"{SHARD}/"))
        rows = client.consensus.scan(SHARD, 0)
        samples = []
        snapshot = None
        for _ in range(opts.reads):
            t0 = time.perf_counter()
            snapshot = reader.snapshot_table()
            samples.append(time.perf_counter() - t0)
        assert snapshot is not None
        reader.close()
        figures = Figures(
            maintenance=maintenance,
            write_s=write_s,
            batches=len(state.batches),
            parts=len(parts),
            inline_parts=sum(1 for p in parts if p.inline is not None),
            blob_objects=len(metas),
            blob_bytes=sum(m.size_bytes for m in metas),
            consensus_rows=len(rows),
            consensus_bytes=sum(len(r.data) for r in rows),
            snapshot_rows=snapshot.num_rows,
            consolidated_bytes=consolidated_parquet_bytes(snapshot),
            read_median_s=statistics.median(samples),
            read_samples_s=tuple(samples),
        )
        return figures, snapshot
    finally:
        client.maintenance.wait_idle(60)
        client.close()


def _canonical(table: pa.Table) -> list[tuple[Any, ...]]:
    return sorted(zip(table.column("k").to_pylist(), table.column(DIFF).to_pylist(), strict=True))


def run(opts: MaintenanceOptions, progress: Callable[[str], None] = step) -> Report:
    """Run both sides in fresh directories (removed afterwards) and compare them."""
    if opts.workdir is not None:  # --workdir D: create D, as a user expects
        os.makedirs(opts.workdir, exist_ok=True)
    root = tempfile.mkdtemp(prefix="persist-bench-maint-", dir=opts.workdir)
    try:
        on, snap_on = run_side(f"{root}/on", True, opts, progress)
        off, snap_off = run_side(f"{root}/off", False, opts, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return Report(opts, on, off, _canonical(snap_on) == _canonical(snap_off))


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def format_report(r: Report) -> str:
    """The comparison as a plain-text table."""

    def row(name: str, on: str, off: str, note: str = "") -> str:
        return f"{name:<34}{on:>16}{off:>16}  {note}"

    def kib(n: int) -> str:
        return f"{n / 1024:,.1f} KiB"

    on, off = r.on, r.off
    lines = [
        f"persist maintenance benchmark: {r.options.writes:,} one-row writes, "
        f"{r.options.keys} keys, since downgraded every {r.options.downgrade_every} writes, "
        "file/sqlite",
        row("", "maintenance on", "maintenance off"),
        row("write time", f"{on.write_s:.1f} s", f"{off.write_s:.1f} s"),
        row("live batches", f"{on.batches:,}", f"{off.batches:,}"),
        row(
            "live parts (inline)",
            f"{on.parts:,} ({on.inline_parts:,})",
            f"{off.parts:,} ({off.inline_parts:,})",
        ),
        row("Blob objects", f"{on.blob_objects:,}", f"{off.blob_objects:,}"),
        row("Blob bytes", kib(on.blob_bytes), kib(off.blob_bytes)),
        row("Consensus rows", f"{on.consensus_rows:,}", f"{off.consensus_rows:,}"),
        row("Consensus bytes", kib(on.consensus_bytes), kib(off.consensus_bytes)),
        row("snapshot rows (consolidated)", f"{on.snapshot_rows:,}", f"{off.snapshot_rows:,}"),
        row("consolidated Parquet size", kib(on.consolidated_bytes), kib(off.consolidated_bytes)),
        row(
            "storage ratio (Blob / consolidated)",
            f"{on.storage_ratio:.2f}x",
            f"{off.storage_ratio:.2f}x",
            f"target on <= {STORAGE_TARGET:g}x: {_verdict(r.storage_ok)}",
        ),
        row("  with Consensus bytes", f"{on.total_ratio:.2f}x", f"{off.total_ratio:.2f}x"),
        row(
            f"snapshot read (median of {r.options.reads})",
            f"{on.read_median_s * 1e3:.1f} ms",
            f"{off.read_median_s * 1e3:.1f} ms",
        ),
        row(
            "snapshot read speedup (off / on)",
            f"{r.read_speedup:.1f}x",
            "",
            f"target >= {READ_TARGET:g}x: {_verdict(r.read_ok)}",
        ),
        row("final snapshots equal", str(r.exact), ""),
    ]
    return "\n".join(lines)


BENCHMARK = Benchmark("maintenance", MaintenanceOptions, run, format_report, __doc__)
"""``persist bench maintenance``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
