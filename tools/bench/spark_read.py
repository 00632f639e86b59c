"""The Spark read benchmark: snapshot-read throughput of a shard through ``format("persist")``.

Run it as ``persist bench spark-read`` or ``python -m pyspark_persist.tools.bench.spark_read``
(``--size-mib`` default 1024, ``--quick`` for a smoke run, ``--json``). It generates
``--size-mib`` MiB (Arrow bytes) of rows ``(id int64, x float64, s 32-char string)``
once, writes them to a persist shard (Python API, one BatchBuilder commit) and as
Parquet files (pyarrow, same part size and compression), then in one local Spark session
(``local[cores]``) times full scans (``selectExpr("sum(id)", "sum(x)", "sum(length(s))")``,
so every column is read) of:

- persist with 1 partition per core (``minPartitions = cores``, huge ``splitSizeBytes``);
- persist with 2 partitions per core (``minPartitions = 2 * cores``);
- Spark's built-in Parquet reader over the Parquet copy (``maxPartitionBytes`` set so it
  also uses 2 partitions per core);
- the ceiling of Spark's Python Data Source API itself: a source that does no I/O and
  yields the same number of rows, already in memory as Arrow batches of persist's read
  schema, one partition per core. No Python source, persist included, can read faster
  than this; when it is below Spark's Parquet reader, so is every Python source.

Each is run ``--repeat`` times after one warm-up; the best time counts. Targets printed
next to the ratios: the 2-way split at least 1.7x the 1-way, persist (its better
split) at least 1.0x Spark's Parquet reader. The shard and files live in a temporary
``--workdir`` (removed afterwards unless given).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MiB = 1 << 20
SPLIT_TARGET = 1.7
"""2 partitions per core must read at least this many times faster than 1 per core."""
PARQUET_TARGET = 1.0
"""persist must read at least this fast relative to Spark's Parquet reader."""
CEILING = "python source, no I/O"
"""The timing of the API-ceiling peer (see ``ceiling.py``)."""
SHARD = "bench-spark-read"
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


def generate(rows: int, start: int) -> pa.Table:
    """``rows`` rows of SCHEMA with ids from ``start``: random floats, 32-char strings."""
    rng = np.random.default_rng(start)
    ids = np.arange(start, start + rows, dtype=np.int64)
    hexes = rng.integers(0, 1 << 62, size=rows, dtype=np.int64)
    s = pa.array(np.char.zfill(np.char.mod("%x", hexes), 32).astype(object), pa.string())
    return pa.table({"id": ids, "x": rng.random(rows), "s": s}, schema=SCHEMA)


def write_data(opts: Options, home: str, parquet_dir: str) -> tuple[int, int]:
    """Write the same rows to the shard and to Parquet files; (rows, Arrow bytes)."""
    from pyspark_persist.state import PersistClient, PersistConfig

    config = PersistConfig(part_target_bytes=opts.part_mib * MiB, maintenance=False)
    client = PersistClient.open(
        f"file://{home}/blob", f"sqlite:///{home}/consensus.db", config=config
    )
    shard = client.open_shard(SHARD, SCHEMA)
    writer = shard.writer()
    builder = writer.builder()
    total_rows = opts.size_mib * MiB // ROW_BYTES
    chunk = max(1, min(total_rows, opts.part_mib * MiB // ROW_BYTES))
    os.makedirs(parquet_dir, exist_ok=True)
    done, nbytes, file_no = 0, 0, 0
    while done < total_rows:
        n = min(chunk, total_rows - done)
        table = generate(n, done)
        builder.add(table)
        pq.write_table(
            table, os.path.join(parquet_dir, f"part-{file_no:05d}.parquet"), compression="snappy"
        )
        done += n
        nbytes += table.nbytes
        file_no += 1
    staged = builder.finish()
    writer.compare_and_append_batches([staged], 0, 1, ts_rewrite=0)
    client.close()
    return total_rows, nbytes


def read_batch(rows: int) -> pa.RecordBatch:
    """``rows`` rows exactly as persist's reader hands them to Spark (the no-I/O peer's batch)."""
    from pyspark_persist.schema import output_arrow_schema, read_schema

    table = generate(rows, 0)
    table = table.append_column("_time", pa.repeat(pa.scalar(1, pa.int64()), rows))
    table = table.append_column("_diff", pa.repeat(pa.scalar(1, pa.int64()), rows))
    return table.cast(output_arrow_schema(read_schema(SCHEMA))).combine_chunks().to_batches()[0]


def _scan_seconds(df: Any, repeat: int) -> float:
    """Best of ``repeat`` full scans (after a warm-up), every column read."""
    df.selectExpr("sum(id)", "sum(x)", "sum(length(s))").collect()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        df.selectExpr("sum(id)", "sum(x)", "sum(length(s))").collect()
        best = min(best, time.perf_counter() - t0)
    return best


def run(opts: Options) -> dict[str, Any]:
    """Generate, write, then time each reader; the report as a dict."""
    workdir = opts.workdir or tempfile.mkdtemp(prefix="persist-bench-spark-read-")
    home = os.path.join(workdir, "persist")
    parquet_dir = os.path.join(workdir, "parquet")
    os.makedirs(home, exist_ok=True)
    os.environ["PERSIST_HOME"] = home  # Spark's Python workers inherit the location
    try:
        t0 = time.perf_counter()
        nrows, nbytes = write_data(opts, home, parquet_dir)
        write_s = time.perf_counter() - t0
        from pyspark.sql import SparkSession

        spark = (
            SparkSession.builder.master(f"local[{opts.cores}]")
            .appName("persist-bench-spark-read")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.adaptive.enabled", "false")
            .config("spark.driver.memory", "2g")
            .getOrCreate()
        )
        spark.sparkContext.setLogLevel("ERROR")
        try:
            from pyspark_persist import DefaultSource

            spark.dataSource.register(DefaultSource)
            timings = []
            mib = nbytes / MiB
            for per_core in (1, 2):
                n = per_core * opts.cores
                df = (
                    spark.read.format("persist")
                    .option("blob", f"file://{home}/blob")
                    .option("consensus", f"sqlite:///{home}/consensus.db")
                    .option("minPartitions", str(n))
                    .option("splitSizeBytes", "1t")
                    .load(SHARD)
                )
                parts = df.rdd.getNumPartitions()
                s = _scan_seconds(df, opts.repeat)
                timings.append(Timing(f"persist {per_core}/core", parts, s, mib / s))
            files_bytes = sum(
                os.path.getsize(os.path.join(parquet_dir, f)) for f in os.listdir(parquet_dir)
            )
            spark.conf.set(
                "spark.sql.files.maxPartitionBytes",
                str(max(1 << 20, files_bytes // (2 * opts.cores) + 1)),
            )
            pdf = spark.read.parquet(parquet_dir)
            s = _scan_seconds(pdf, opts.repeat)
            timings.append(Timing("spark parquet", pdf.rdd.getNumPartitions(), s, mib / s))
            from pyspark_persist.schema import read_schema
            from pyspark_persist.tools.bench.ceiling import NO_IO, no_io_source

            spark.dataSource.register(
                no_io_source(read_schema(SCHEMA), nrows, opts.cores, read_batch)
            )
            ndf = spark.read.format(NO_IO).load()
            s = _scan_seconds(ndf, opts.repeat)
            timings.append(Timing(CEILING, ndf.rdd.getNumPartitions(), s, mib / s))
        finally:
            spark.stop()
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    one, two, parquet, ceiling = timings
    split = one.seconds / two.seconds
    vs_parquet = parquet.seconds / min(one.seconds, two.seconds)
    ceiling_vs_parquet = parquet.seconds / ceiling.seconds
    return {
        "options": asdict(opts),
        "rows": nrows,
        "arrow_mib": round(mib, 1),
        "write_s": round(write_s, 2),
        "timings": [asdict(t) for t in timings],
        "split_speedup": round(split, 3),
        "split_target": SPLIT_TARGET,
        "split_ok": split >= SPLIT_TARGET,
        "persist_vs_parquet": round(vs_parquet, 3),
        "parquet_target": PARQUET_TARGET,
        "parquet_ok": vs_parquet >= PARQUET_TARGET,
        "ceiling_vs_parquet": round(ceiling_vs_parquet, 3),
        "persist_vs_ceiling": round(ceiling.seconds / min(one.seconds, two.seconds), 3),
    }


def format_report(report: dict[str, Any]) -> str:
    """The report as text for people."""
    lines = [
        f"persist Spark snapshot read: {report['rows']:,} rows, {report['arrow_mib']} MiB "
        f"(Arrow), {report['options']['cores']} cores; data written in {report['write_s']} s",
    ]
    for t in report["timings"]:
        lines.append(
            f"  {t['name']:<22} {t['partitions']:>3} partitions  {t['seconds']:8.2f} s  "
            f"{t['mib_per_s']:8.1f} MiB/s"
        )
    lines.append(
        f"  2-way split / 1-way: {report['split_speedup']:.2f}x "
        f"(target >= {SPLIT_TARGET}x: {'ok' if report['split_ok'] else 'MISSED'})"
    )
    lines.append(
        f"  persist / Spark Parquet: {report['persist_vs_parquet']:.2f}x "
        f"(target >= {PARQUET_TARGET}x: {'ok' if report['parquet_ok'] else 'MISSED'})"
    )
    lines.append(
        f"  Python Data Source ceiling (no I/O) / Spark Parquet: "
        f"{report['ceiling_vs_parquet']:.2f}x; persist / that ceiling: "
        f"{report['persist_vs_ceiling']:.2f}x"
    )
    if report["options"]["cores"] <= 2:
        lines.append(
            "  (with 1 partition per core every core is already busy: a 2-way split can add "
            "overlap, not cores)"
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
