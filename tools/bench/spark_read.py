"""The Spark read benchmark: snapshot-read throughput of a shard through ``format("persist")``.

Run it as ``persist bench spark-read`` or ``python -m pyspark_persist.tools.bench.spark_read``
(``--size-mib`` default 1024, ``--quick`` for a smoke run, ``--json``). It generates
``--size-mib`` MiB (Arrow bytes) of rows ``(id int64, x float64, s 32-char string)``
once, writes them to two persist shards (Python API, ``arrow-rows`` parts as the Spark
sink stages them): *appended* (one commit) and *overwritten* (a commit, then the same rows
again as an atomic replace, so its state also references the retracted parts), and as
Parquet files (pyarrow, same part size, snappy); then in one local Spark session
(``local[cores]``) times full scans (``selectExpr("sum(id)", "sum(x)", "sum(length(s))")``,
so every column is read) of:

- the first read of a fresh Spark session (a new process: JVM, Python workers and
  imports all cold) and the same read warm, for persist and, as the ceiling of what is
  Spark's own, for the no-I/O source below;
- the appended shard with 1 partition per core (``minPartitions = cores``, huge
  ``splitSizeBytes``) and with 2 per core (``minPartitions = 2 * cores``);
- the overwritten shard, with 1 and with 2 partitions per core (its best counts, as the
  appended shard's does: a split that suits one suits both);
- Spark's built-in Parquet reader over the Parquet copy (``maxPartitionBytes`` set so it
  also uses 2 partitions per core);
- the ceiling of Spark's Python Data Source API itself: a source that does no I/O and
  yields the same number of rows, already in memory as Arrow batches of persist's read
  schema, one partition per core. No Python source, persist included, can read faster
  than this; when it is below Spark's Parquet reader, so is every Python source.
- the same source yielding a distinct in-memory copy for every batch (``ceiling.py``'s
  in-memory peer): whether handing Spark distinct data costs more than the one repeated
  batch, and the peer persist's own code is also measured against.

Each is run ``--repeat`` times after one warm-up, in rounds of one scan of each reader (a
session's JVM keeps warming up over its first scans); the best time counts, and beside it the
least CPU seconds a scan cost (this process and everything it started: Spark's JVM and its
Python workers), which moves far less than wall time on a loaded machine. Targets printed
next to the ratios: persist (appended and overwritten) at least 1.0x Spark's Parquet
reader and 0.9x the no-I/O source, the cold first read at most 1.5x the warm one. The
shards and files live in a temporary ``--workdir`` (removed afterwards unless given).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.cpu import CpuMeter, own_cpu

MiB = 1 << 20
PARQUET_TARGET = 1.0
"""persist must read at least this fast relative to Spark's Parquet reader."""
CEILING_TARGET = 0.9
"""... and at least this fast relative to the no-I/O Python source."""
COLD_TARGET = 1.5
"""The session's first read may take at most this many times the warm read."""
CEILING = "python source, no I/O"
IN_MEMORY = "python source, in memory"
"""The timing of the API-ceiling peer (see ``ceiling.py``)."""
SHARD = "bench-spark-read"
OVERWRITTEN = "bench-spark-read-overwritten"
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("s", pa.string())])
ROW_BYTES = 8 + 8 + 32 + 4  # Arrow bytes per row (string offsets included)


@dataclass(frozen=True)
class Options:
    """What to run."""

    size_mib: int = 1024
    part_mib: int = 64
    cores: int = 2
    repeat: int = 2
    workdir: str | None = None


@dataclass(frozen=True)
class Timing:
    """One reader's best full scan."""

    name: str
    partitions: int
    seconds: float
    mib_per_s: float
    cpu_seconds: float | None = None
    """The least CPU a scan cost (Spark's JVM and Python workers); None off Linux."""
    worker_cpu_seconds: float | None = None
    """The least CPU Spark's Python workers spent in a scan, where a Python source's own code
    runs (beside pyspark's transfer to the JVM); None off Linux."""


@dataclass(frozen=True)
class Scan:
    """One full scan: wall seconds and the CPU seconds it cost (None off Linux)."""

    seconds: float
    cpu_seconds: float | None
    worker_cpu_seconds: float | None = None


def generate(rows: int, start: int) -> pa.Table:
    """``rows`` rows of SCHEMA with ids from ``start``: random floats, 32-char strings."""
    rng = np.random.default_rng(start)
    ids = np.arange(start, start + rows, dtype=np.int64)
    hexes = rng.integers(0, 1 << 62, size=rows, dtype=np.int64)
    s = pa.array(np.char.zfill(np.char.mod("%x", hexes), 32).astype(object), pa.string())
    return pa.table({"id": ids, "x": rng.random(rows), "s": s}, schema=SCHEMA)


def write_data(opts: Options, home: str, parquet_dir: str) -> tuple[int, int]:
    """Write the same rows to both shards and to Parquet files; (rows, Arrow bytes)."""
    from pyspark_persist.state import ARROW_ROWS, BatchBuilder, PersistClient, PersistConfig

    config = PersistConfig(part_target_bytes=opts.part_mib * MiB, maintenance=False)
    client = PersistClient.open(
        f"file://{home}/blob", f"sqlite:///{home}/consensus.db", config=config
    )
    shards = [client.open_shard(name, SCHEMA) for name in (SHARD, OVERWRITTEN)]
    builders = [
        BatchBuilder(
            client.blob,
            shard.machine.shard_id,
            SCHEMA,
            config,
            allow_inline=False,
            part_format=ARROW_ROWS,
        )
        for shard in (shards[0], shards[1], shards[1])
    ]
    total_rows = opts.size_mib * MiB // ROW_BYTES
    chunk = max(1, min(total_rows, opts.part_mib * MiB // ROW_BYTES))
    os.makedirs(parquet_dir, exist_ok=True)
    done, nbytes, file_no = 0, 0, 0
    while done < total_rows:
        n = min(chunk, total_rows - done)
        table = generate(n, done)
        for builder in builders:
            builder.add(table)
        pq.write_table(
            table, os.path.join(parquet_dir, f"part-{file_no:05d}.parquet"), compression="snappy"
        )
        done += n
        nbytes += table.nbytes
        file_no += 1
    appended, first, second = (b.finish() for b in builders)
    shards[0].writer().compare_and_append_batches([appended], 0, 1, ts_rewrite=0)
    writer = shards[1].writer()
    writer.compare_and_append_batches([first], 0, 1, ts_rewrite=0)
    writer.compare_and_append_batches([second], 1, 2, ts_rewrite=1, replace=True)
    client.close()
    return total_rows, nbytes


def read_batch(rows: int) -> pa.RecordBatch:
    """``rows`` rows exactly as persist's reader hands them to Spark (the no-I/O peer's batch)."""
    from pyspark_persist.schema import output_arrow_schema, read_schema

    table = generate(rows, 0)
    table = table.append_column("_time", pa.repeat(pa.scalar(1, pa.int64()), rows))
    table = table.append_column("_diff", pa.repeat(pa.scalar(1, pa.int64()), rows))
    return table.cast(output_arrow_schema(read_schema(SCHEMA))).combine_chunks().to_batches()[0]


def _scan(df: Any) -> Scan:
    """One full scan, every column read."""
    with CpuMeter() as meter:
        started = time.perf_counter()
        df.selectExpr("sum(id)", "sum(x)", "sum(length(s))").collect()
        seconds = time.perf_counter() - started
    spent = meter.split
    if spent is None:
        return Scan(seconds, None)
    return Scan(seconds, round(spent.total, 2), spent.workers)


def _scan_seconds(df: Any, repeat: int) -> tuple[Scan, Scan]:
    """(the first scan, the best of ``repeat`` after it: least wall time and least CPU)."""
    first = _scan(df)
    return first, _best([_scan(df) for _ in range(repeat)])


def _best_interleaved(dfs: Sequence[Any], repeat: int) -> list[Scan]:
    """Each DataFrame's best of ``repeat`` scans, after one warm-up scan of each, the scans
    taken in rounds (one of each reader a round).

    The JVM keeps compiling its hot paths over a session's first scans: timed one reader
    after the other, each reader ran faster than the one before it (in one 256 MiB run
    persist 1/core 170 MiB/s, 2/core 193, overwritten 235, Parquet 241, the no-I/O source
    244, in that order), which charged the first readers with the warm-up.
    """
    step(f"spark-read: a warm-up scan of each of {len(dfs)} readers")
    for df in dfs:
        _scan(df)
    rounds = []
    for n in range(repeat):
        step(f"spark-read: timed round {n + 1} of {repeat}")
        rounds.append([_scan(df) for df in dfs])
    return [_best(list(scans)) for scans in zip(*rounds, strict=True)]


def _best(scans: list[Scan]) -> Scan:
    """The least wall time and the least CPU of ``scans``."""
    cpus = [s.cpu_seconds for s in scans if s.cpu_seconds is not None]
    workers = [s.worker_cpu_seconds for s in scans if s.worker_cpu_seconds is not None]
    return Scan(
        min(s.seconds for s in scans),
        min(cpus) if cpus else None,
        min(workers) if workers else None,
    )


def _timing(name: str, df: Any, scan: Scan, mib: float) -> Timing:
    return Timing(
        name,
        df.rdd.getNumPartitions(),
        scan.seconds,
        mib / scan.seconds,
        scan.cpu_seconds,
        scan.worker_cpu_seconds,
    )


def _session(cores: int) -> Any:
    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter, so they import this pyspark_persist
    # (by default they run the first python3 on PATH, which may hold another copy).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(f"local[{cores}]")
        .appName("persist-bench-spark-read")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    from pyspark_persist import DefaultSource

    spark.dataSource.register(DefaultSource)
    return spark


def _persist_df(spark: Any, home: str, shard: str, partitions: int) -> Any:
    return (
        spark.read.format("persist")
        .option("blob", f"file://{home}/blob")
        .option("consensus", f"sqlite:///{home}/consensus.db")
        .option("minPartitions", str(partitions))
        .option("splitSizeBytes", "1t")
        .load(shard)
    )


def _no_io_df(spark: Any, rows: int, cores: int, distinct: bool = False) -> Any:
    from pyspark_persist.schema import read_schema
    from pyspark_persist.tools.bench.ceiling import IN_MEMORY as IN_MEMORY_SOURCE
    from pyspark_persist.tools.bench.ceiling import NO_IO, no_io_source

    source = no_io_source(read_schema(SCHEMA), rows, cores, read_batch, distinct)
    spark.dataSource.register(source)
    return spark.read.format(IN_MEMORY_SOURCE if distinct else NO_IO).load()


COLD_SOURCES = ("persist", "no-io")


def cold_probe(source: str, workdir: str, cores: int, rows: int) -> dict[str, Any]:
    """In this (fresh) process: a new session's first scan of ``source``, then its best warm
    scan (the appended shard in ``workdir`` read 1 partition per core, or the no-I/O source)."""
    spark = _session(cores)
    try:
        if source == "persist":
            df = _persist_df(spark, os.path.join(workdir, "persist"), SHARD, cores)
        else:
            df = _no_io_df(spark, rows, cores)
        first, warm = _scan_seconds(df, 2)
        return {"first": asdict(first), "warm": asdict(warm), "partitions": cores}
    finally:
        spark.stop()


def _run_cold_probe(source: str, workdir: str, cores: int, rows: int) -> dict[str, Any]:
    """:func:`cold_probe` in a new interpreter, so nothing of this session is warm."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyspark_persist.tools.bench.spark_read",
            "--cold-probe",
            source,
            "--workdir",
            workdir,
            "--cores",
            str(cores),
            "--probe-rows",
            str(rows),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(opts: Options) -> dict[str, Any]:
    """Generate, write, then time each reader; the report as a dict."""
    workdir = opts.workdir or tempfile.mkdtemp(prefix="persist-bench-spark-read-")
    home = os.path.join(workdir, "persist")
    parquet_dir = os.path.join(workdir, "parquet")
    os.makedirs(home, exist_ok=True)
    os.environ["PERSIST_HOME"] = home  # Spark's Python workers inherit the location
    try:
        t0 = time.perf_counter()
        step(f"spark-read: writing {opts.size_mib} MiB of rows to two shards and Parquet files")
        nrows, nbytes = write_data(opts, home, parquet_dir)
        write_s = time.perf_counter() - t0
        step(f"spark-read: starting Spark (local[{opts.cores}])")
        spark = _session(opts.cores)
        try:
            mib = nbytes / MiB
            readers = {
                name: _persist_df(spark, home, shard, per_core * opts.cores)
                for name, shard, per_core in (
                    ("persist 1/core", SHARD, 1),
                    ("persist 2/core", SHARD, 2),
                    ("persist overwritten 1/core", OVERWRITTEN, 1),
                    ("persist overwritten 2/core", OVERWRITTEN, 2),
                )
            }
            files_bytes = sum(
                os.path.getsize(os.path.join(parquet_dir, f)) for f in os.listdir(parquet_dir)
            )
            spark.conf.set(
                "spark.sql.files.maxPartitionBytes",
                str(max(1 << 20, files_bytes // (2 * opts.cores) + 1)),
            )
            readers["spark parquet"] = spark.read.parquet(parquet_dir)
            readers[CEILING] = _no_io_df(spark, nrows, opts.cores)
            readers[IN_MEMORY] = _no_io_df(spark, nrows, opts.cores, distinct=True)
            scans = _best_interleaved(list(readers.values()), opts.repeat)
            timings = [
                _timing(name, df, scan, mib)
                for (name, df), scan in zip(readers.items(), scans, strict=True)
            ]
        finally:
            spark.stop()
        for source, label in zip(COLD_SOURCES, ("persist", CEILING), strict=True):
            step(f"spark-read: the first read of a fresh Spark session, {label}")
            probe = _run_cold_probe(source, workdir, opts.cores, nrows)
            for when in ("first", "warm"):
                scan = Scan(**probe[when])
                timings.append(
                    Timing(
                        f"{label} {'cold' if when == 'first' else 'warm'}, new session",
                        probe["partitions"],
                        scan.seconds,
                        mib / scan.seconds,
                        scan.cpu_seconds,
                        scan.worker_cpu_seconds,
                    )
                )
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    one, two, over_one, over_two, parquet, ceiling, in_memory, *cold_probes = timings
    cold, warm, ceiling_cold, ceiling_warm = cold_probes
    appended = min(one.seconds, two.seconds)
    over = over_one if over_one.seconds <= over_two.seconds else over_two
    vs_parquet = parquet.seconds / appended
    over_vs_parquet = parquet.seconds / over.seconds
    vs_ceiling = ceiling.seconds / appended
    over_vs_ceiling = ceiling.seconds / over.seconds
    cold_ratio = cold.seconds / warm.seconds
    ceiling_cold_ratio = ceiling_cold.seconds / ceiling_warm.seconds
    best = one if one.seconds <= two.seconds else two
    return {
        "options": asdict(opts),
        "rows": nrows,
        "arrow_mib": round(mib, 1),
        "write_s": round(write_s, 2),
        "timings": [asdict(t) for t in timings],
        "split_speedup": round(one.seconds / two.seconds, 3),
        "persist_vs_parquet": round(vs_parquet, 3),
        "overwritten_vs_parquet": round(over_vs_parquet, 3),
        "parquet_target": PARQUET_TARGET,
        "parquet_ok": min(vs_parquet, over_vs_parquet) >= PARQUET_TARGET,
        "ceiling_vs_parquet": round(parquet.seconds / ceiling.seconds, 3),
        "persist_vs_ceiling": round(vs_ceiling, 3),
        "overwritten_vs_ceiling": round(over_vs_ceiling, 3),
        "ceiling_target": CEILING_TARGET,
        "ceiling_ok": min(vs_ceiling, over_vs_ceiling) >= CEILING_TARGET,
        "cold_vs_warm": round(cold_ratio, 3),
        "ceiling_cold_vs_warm": round(ceiling_cold_ratio, 3),
        "cold_vs_ceiling_cold": round(cold.seconds / ceiling_cold.seconds, 3),
        "cold_target": COLD_TARGET,
        "cold_ok": cold_ratio <= COLD_TARGET,
        "own_cpu": {"appended": _own_cpu(best, ceiling), "overwritten": _own_cpu(over, ceiling)},
        "in_memory_vs_ceiling": round(ceiling.seconds / in_memory.seconds, 3),
        "persist_vs_in_memory": round(in_memory.seconds / appended, 3),
        "overwritten_vs_in_memory": round(in_memory.seconds / over.seconds, 3),
        "own_cpu_vs_in_memory": {
            "appended": _own_cpu(best, in_memory),
            "overwritten": _own_cpu(over, in_memory),
        },
    }


def _own_cpu(persist: Timing, ceiling: Timing) -> dict[str, float] | None:
    """What persist's own code cost in a scan (:func:`own_cpu` beside the no-I/O source: the
    rest of persist's is fetching, checking and decoding parts)."""
    own = own_cpu(persist.worker_cpu_seconds, ceiling.worker_cpu_seconds, persist.cpu_seconds)
    return None if own is None else {"seconds": own[0], "share": own[1]}


def format_report(report: dict[str, Any]) -> str:
    """The report as text for people."""
    lines = [
        f"persist Spark snapshot read: {report['rows']:,} rows, {report['arrow_mib']} MiB "
        f"(Arrow), {report['options']['cores']} cores; data written in {report['write_s']} s",
    ]
    for t in report["timings"]:
        lines.append(
            f"  {t['name']:<42} {t['partitions']:>3} partitions  {t['seconds']:8.2f} s  "
            f"{t['mib_per_s']:8.1f} MiB/s  "
            + ("" if t.get("cpu_seconds") is None else f"{t['cpu_seconds']:7.2f} CPU s")
            + (
                ""
                if t.get("worker_cpu_seconds") is None
                else f" ({t['worker_cpu_seconds']:.2f} in Python workers)"
            )
        )

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    lines.append(
        f"  persist / Spark Parquet: appended "
        f"{ratio_text(report['persist_vs_parquet'], PARQUET_TARGET)}, overwritten "
        f"{ratio_text(report['overwritten_vs_parquet'], PARQUET_TARGET)} "
        f"(target >= {PARQUET_TARGET}x: "
        f"{verdict(report['parquet_ok'])})"
    )
    lines.append(
        f"  persist / no-I/O Python source: appended "
        f"{ratio_text(report['persist_vs_ceiling'], CEILING_TARGET)}, overwritten "
        f"{ratio_text(report['overwritten_vs_ceiling'], CEILING_TARGET)} "
        f"(target >= {CEILING_TARGET}x: "
        f"{verdict(report['ceiling_ok'])}); that source / Spark Parquet: "
        f"{report['ceiling_vs_parquet']:.2f}x"
    )
    lines.append(
        f"  cold first read / warm: {ratio_text(report['cold_vs_warm'], COLD_TARGET)} "
        f"(target <= {COLD_TARGET}x: "
        f"{verdict(report['cold_ok'])}); the no-I/O source's own: "
        f"{report['ceiling_cold_vs_warm']:.2f}x; persist cold / no-I/O cold: "
        f"{report['cold_vs_ceiling_cold']:.2f}x; 2-way split / 1-way: "
        f"{report['split_speedup']:.2f}x"
    )
    if "persist_vs_in_memory" in report:
        lines.append(
            f"  persist / in-memory Python source (distinct batches, no I/O): appended "
            f"{report['persist_vs_in_memory']:.2f}x, overwritten "
            f"{report['overwritten_vs_in_memory']:.2f}x; that source / the no-I/O one: "
            f"{report['in_memory_vs_ceiling']:.2f}x"
        )
    for key, peer in (("own_cpu", "no-I/O"), ("own_cpu_vs_in_memory", "in-memory")):
        own = report.get(key) or {}
        if own.get("appended") and own.get("overwritten"):
            lines.append(
                f"  persist's own code (its Python workers' CPU beyond the {peer} source's): "
                + ", ".join(
                    f"{kind} {own[kind]['seconds']:.2f} s = {100 * own[kind]['share']:.1f}% "
                    "of its scan's CPU"
                    for kind in ("appended", "overwritten")
                )
            )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's flags."""
    parser.add_argument(
        "--size-mib",
        type=int,
        default=None,
        help="Arrow MiB of data to read (default 1024; 16 with --quick)",
    )
    parser.add_argument(
        "--part-mib",
        type=int,
        default=None,
        help="part and Parquet file size in MiB (default 64; 2 with --quick)",
    )
    parser.add_argument("--cores", type=int, default=2, help="Spark local cores (default 2)")
    parser.add_argument("--repeat", type=int, default=None, help="timed scans per reader")
    parser.add_argument("--workdir", default=None, help="keep the data here")
    parser.add_argument("--quick", action="store_true", help="a small smoke run")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--cold-probe", choices=COLD_SOURCES, help=argparse.SUPPRESS)
    parser.add_argument("--probe-rows", type=int, default=0, help=argparse.SUPPRESS)


def options_from_args(ns: argparse.Namespace) -> Options:
    """Options from parsed flags (``--quick`` first, explicit flags override it)."""
    quick = bool(ns.quick)
    return Options(
        size_mib=ns.size_mib or (16 if quick else 1024),
        part_mib=ns.part_mib or (2 if quick else 64),
        cores=ns.cores,
        repeat=ns.repeat or (1 if quick else 2),
        workdir=ns.workdir,
    )


def run_from_args(ns: argparse.Namespace) -> int:
    """Run with parsed flags and print the report; 0 on success."""
    if ns.cold_probe:  # the fresh-session child of run(): one JSON line
        print(json.dumps(cold_probe(ns.cold_probe, ns.workdir, ns.cores, ns.probe_rows)))
        return 0
    report = run(options_from_args(ns))
    print(json.dumps(report, indent=2) if ns.json else format_report(report))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pyspark_persist.tools.bench.spark_read [--quick] [--json] [flags]``."""
    parser = argparse.ArgumentParser(
        prog="persist bench spark-read",
        description="Snapshot-read throughput through Spark, 1 and 2 partitions per core, "
        "next to Spark's Parquet reader.",
    )
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
