"""The wide-shard case of ``persist bench spark-read``: a query that needs 2 of 40 columns.

A shard of ``--wide-mib`` MiB (Arrow bytes) of 40 columns (20 long, 10 double, 10
32-char string) is written through the Spark sink, as users write, and the same rows
with Spark's Parquet writer. In the one Spark session the narrow case uses, it times:

- ``selectExpr("sum(l5)", "max(length(s7))")`` over persist read with the subset schema
  ``l5 long, s7 string`` (only those columns read, see docs/spark.md "Reading some
  columns"), beside Spark's Parquet reader, which prunes the same columns by itself;
- a full scan (every column summed) of the shard, beside the no-I/O Python source
  yielding as many rows of the same 40 columns from memory: Spark's Python Data Source
  API's own ceiling for those rows.

Both persist and Spark read at their default options (split sizes included).
Targets: the 2-column read at least 0.8x Parquet's pruned read, the full scan at
least 0.95x the no-I/O source.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

MiB = 1 << 20
LONGS, DOUBLES, STRINGS = 20, 10, 10
STRING_CHARS = 32
ROW_BYTES = LONGS * 8 + DOUBLES * 8 + STRINGS * (STRING_CHARS + 4)
"""Arrow bytes per row (string offsets included)."""
SCHEMA = pa.schema(
    [(f"l{k}", pa.int64()) for k in range(LONGS)]
    + [(f"d{k}", pa.float64()) for k in range(DOUBLES)]
    + [(f"s{k}", pa.string()) for k in range(STRINGS)]
)
LONG_RANGE = 1_000_000_007
"""The longs lie within +-this, so Spark's (ANSI, overflow-checked) sums of them fit."""
SHARD = "bench-spark-read-wide"
SUBSET_SCHEMA = "l5 long, s7 string"
SUBSET_QUERY = ("sum(l5)", "max(length(s7))")
FULL_QUERY = tuple(
    [f"sum(l{k})" for k in range(LONGS)]
    + [f"sum(d{k})" for k in range(DOUBLES)]
    + [f"sum(length(s{k}))" for k in range(STRINGS)]
)
SUBSET_TARGET = 0.8
"""persist's 2-column read must be at least this fast relative to Parquet's pruned read."""
FULL_TARGET = 0.95
"""persist's full scan must be at least this fast relative to the no-I/O source."""
PERSIST_SUBSET = "wide: persist, 2 of 40 columns (subset schema)"
PERSIST_SUBSET_PER_CORE = "wide: persist, 2 of 40 columns, 1 partition per core"
PARQUET_SUBSET = "wide: spark parquet, 2 of 40 columns (pruned)"
PERSIST_FULL = "wide: persist, full scan"
PERSIST_FULL_PER_CORE = "wide: persist, full scan, 1 partition per core"
CEILING_FULL = "wide: python source, no I/O, full scan"
CEILING_SUBSET = "wide: python source, no I/O, 2 columns"


def frame(spark: Any, rows: int, partitions: int) -> Any:
    """``rows`` rows of :data:`SCHEMA`, the same every time (seeded, by row id)."""
    exprs = (
        [f"xxhash64(id, {k}) % {LONG_RANGE} AS l{k}" for k in range(LONGS)]
        + [f"rand({k}) AS d{k}" for k in range(DOUBLES)]
        + [f"md5(cast(id * {STRINGS} + {k} AS string)) AS s{k}" for k in range(STRINGS)]
    )
    return spark.range(0, rows, 1, partitions).selectExpr(*exprs)


def batch(rows: int) -> pa.RecordBatch:
    """``rows`` rows of :data:`SCHEMA` as persist's reader hands them to Spark (with
    ``_time`` and ``_diff``): the no-I/O source's batch."""
    import numpy as np

    from pyspark_persist.schema import output_arrow_schema, read_schema

    rng = np.random.default_rng(7)
    columns: list[Any] = [rng.integers(0, LONG_RANGE, rows) for _ in range(LONGS)]
    columns += [rng.random(rows) for _ in range(DOUBLES)]
    hexes = np.char.zfill(np.char.mod("%x", rng.integers(0, 1 << 62, rows)), STRING_CHARS)
    columns += [pa.array(hexes.astype(object), pa.string())] * STRINGS
    ones = np.ones(rows, dtype=np.int64)
    table = pa.table([*columns, ones, ones], names=[*SCHEMA.names, "_time", "_diff"])
    target = output_arrow_schema(read_schema(SCHEMA))
    return table.cast(target).combine_chunks().to_batches()[0]


def subset_batch(rows: int) -> pa.RecordBatch:
    """``rows`` rows of the subset schema (``l5 long, s7 string``) as Spark takes them: the
    2-column no-I/O source's batch."""
    full = batch(rows)
    return pa.RecordBatch.from_arrays([full.column("l5"), full.column("s7")], names=["l5", "s7"])


@dataclass
class WideReport:
    """The wide shard's readers, by name, and the ratios the targets are judged on."""

    rows: int
    arrow_mib: float
    write_s: float
    """How long the Spark sink took to write the shard, to 0.01 s."""
    parquet_write_s: float
    """How long Spark's Parquet writer took to write the same rows, to 0.01 s."""
    timings: list[Any] = field(default_factory=list)

    def seconds(self, name: str) -> float:
        """The best wall seconds of reader ``name``."""
        return float(next(t.seconds for t in self.timings if t.name == name))

    def cpu_ratio(self, peer: str, mine: str) -> float | None:
        """The least CPU seconds a scan of ``peer`` cost over ``mine``'s (None off Linux):
        on a machine others load, steadier than the wall-time ratio."""
        cpu = {t.name: t.cpu_seconds for t in self.timings}
        a, b = cpu.get(peer), cpu.get(mine)
        return None if a is None or not b else float(a) / float(b)

    @property
    def subset_cpu_vs_parquet(self) -> float | None:
        """:attr:`subset_vs_parquet` in CPU seconds (Spark's JVM and Python workers)."""
        return self.cpu_ratio(PARQUET_SUBSET, PERSIST_SUBSET)

    @property
    def full_cpu_vs_ceiling(self) -> float | None:
        """:attr:`full_vs_ceiling` in CPU seconds."""
        return self.cpu_ratio(CEILING_FULL, PERSIST_FULL_PER_CORE)

    @property
    def subset_vs_parquet(self) -> float:
        """persist's 2-column read against Parquet's pruned read (above 1: faster)."""
        return self.seconds(PARQUET_SUBSET) / self.seconds(PERSIST_SUBSET)

    @property
    def subset_per_core_vs_parquet(self) -> float:
        """persist's 2-column read, 1 partition per core, against Parquet's pruned read."""
        return self.seconds(PARQUET_SUBSET) / self.seconds(PERSIST_SUBSET_PER_CORE)

    @property
    def subset_ceiling_vs_parquet(self) -> float:
        """The 2-column no-I/O source against Parquet's pruned read: the API's own limit."""
        return self.seconds(PARQUET_SUBSET) / self.seconds(CEILING_SUBSET)

    @property
    def full_vs_ceiling(self) -> float:
        """persist's full scan, 1 partition per core as the no-I/O source has, against it."""
        return self.seconds(CEILING_FULL) / self.seconds(PERSIST_FULL_PER_CORE)

    @property
    def full_default_vs_ceiling(self) -> float:
        """persist's full scan at the default splits against the no-I/O source."""
        return self.seconds(CEILING_FULL) / self.seconds(PERSIST_FULL)

    @property
    def subset_ok(self) -> bool:
        """:attr:`subset_vs_parquet` meets :data:`SUBSET_TARGET`."""
        return self.subset_vs_parquet >= SUBSET_TARGET

    @property
    def full_ok(self) -> bool:
        """:attr:`full_vs_ceiling` meets :data:`FULL_TARGET`."""
        return self.full_vs_ceiling >= FULL_TARGET


def run_wide(spark: Any, home: str, workdir: str, mib: int, cores: int, repeat: int) -> WideReport:
    """Write the wide shard (Spark sink) and its Parquet copy, then time the four readers in
    rounds (see ``spark_read._best_interleaved``)."""
    from pyspark_persist.tools.bench import step
    from pyspark_persist.tools.bench.spark_read import Scan, Timing, _best_interleaved, _no_io_df

    rows = mib * MiB // ROW_BYTES
    spark.conf.unset("spark.sql.files.maxPartitionBytes")  # Spark's default, as users read
    location = {"blob": f"file://{home}/blob", "consensus": f"sqlite:///{home}/consensus.db"}
    parquet_dir = os.path.join(workdir, "wide-parquet")
    step(f"spark-read: writing the wide shard ({mib} MiB, 40 columns) through the Spark sink")
    df = frame(spark, rows, cores)
    started = time.perf_counter()
    df.write.format("persist").options(**location).mode("append").save(SHARD)
    write_s = time.perf_counter() - started
    step("spark-read: writing the same rows with Spark's Parquet writer")
    started = time.perf_counter()
    df.write.mode("overwrite").parquet(parquet_dir)
    parquet_write_s = time.perf_counter() - started
    report = WideReport(
        rows, round(rows * ROW_BYTES / MiB, 1), round(write_s, 2), round(parquet_write_s, 2)
    )

    def persist(schema: str | None = None, **options: str) -> Any:
        reader = spark.read.format("persist").options(**location, **options)
        return (reader if schema is None else reader.schema(schema)).load(SHARD)

    from pyspark.sql.types import StructType

    from pyspark_persist.tools.bench.ceiling import NO_IO, no_io_source

    subset = StructType.fromDDL(SUBSET_SCHEMA)
    assert isinstance(subset, StructType)
    subset_name = f"{NO_IO}-subset"
    spark.dataSource.register(no_io_source(subset, rows, cores, subset_batch, name=subset_name))
    subset_no_io = spark.read.format(subset_name).load()
    per_core = {"minPartitions": str(cores), "splitSizeBytes": "1t"}
    sources = {
        PERSIST_SUBSET: (persist(SUBSET_SCHEMA), SUBSET_QUERY),
        PERSIST_SUBSET_PER_CORE: (persist(SUBSET_SCHEMA, **per_core), SUBSET_QUERY),
        PARQUET_SUBSET: (spark.read.parquet(parquet_dir), SUBSET_QUERY),
        CEILING_SUBSET: (subset_no_io, SUBSET_QUERY),
        PERSIST_FULL: (persist(), FULL_QUERY),
        PERSIST_FULL_PER_CORE: (persist(**per_core), FULL_QUERY),
        CEILING_FULL: (_no_io_df(spark, rows, cores, schema=SCHEMA, make_batch=batch), FULL_QUERY),
    }
    scans: list[Scan] = _best_interleaved(
        [source for source, _ in sources.values()],
        repeat,
        [query for _, query in sources.values()],
    )
    for (name, (source, _)), scan in zip(sources.items(), scans, strict=True):
        report.timings.append(
            Timing(
                name,
                source.rdd.getNumPartitions(),
                scan.seconds,
                report.arrow_mib / scan.seconds,
                scan.cpu_seconds,
                scan.worker_cpu_seconds,
            )
        )
    return report


def format_wide(report: WideReport, cores: int) -> list[str]:
    """The wide case's lines of the printout."""
    lines = [
        f"persist Spark read of a wide shard: {report.rows:,} rows of 40 columns, "
        f"{report.arrow_mib} MiB (Arrow), {cores} cores; written through the Spark sink in "
        f"{report.write_s} s (Spark's Parquet writer: {report.parquet_write_s} s)"
    ]
    for t in report.timings:
        lines.append(
            f"  {t.name:<48} {t.partitions:>3} partitions  {t.seconds:8.2f} s  "
            + ("" if t.cpu_seconds is None else f"{t.cpu_seconds:7.2f} CPU s")
            + ("" if t.worker_cpu_seconds is None else f" ({t.worker_cpu_seconds:.2f} workers)")
        )
    lines.append(
        f"  2 of 40 columns, persist / Spark Parquet pruned: {report.subset_vs_parquet:.2f}x "
        f"(target >= {SUBSET_TARGET}x: {'ok' if report.subset_ok else 'MISSED'}); 1 partition "
        f"per core: {report.subset_per_core_vs_parquet:.2f}x; the 2-column no-I/O source / "
        f"Spark Parquet pruned: {report.subset_ceiling_vs_parquet:.2f}x"
    )
    lines.append(
        f"  full scan, persist / no-I/O Python source (1 partition per core each): "
        f"{report.full_vs_ceiling:.2f}x (target >= {FULL_TARGET}x: "
        f"{'ok' if report.full_ok else 'MISSED'}); at persist's default splits: "
        f"{report.full_default_vs_ceiling:.2f}x"
    )
    subset_cpu, full_cpu = report.subset_cpu_vs_parquet, report.full_cpu_vs_ceiling
    if subset_cpu is not None and full_cpu is not None:
        lines.append(
            f"  the same in CPU seconds: 2 of 40 columns / Parquet pruned {subset_cpu:.2f}x; "
            f"full scan / no-I/O source {full_cpu:.2f}x"
        )
    return lines
