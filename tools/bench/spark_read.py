"""The Spark read benchmark: snapshot-read throughput of a shard through ``format("persist")``.

Run it as ``persist bench spark-read`` or ``python -m pyspark_persist.tools.bench.spark_read``
(``--size-mib`` default 1024, ``--quick`` for a smoke run, ``--json``). It generates
``--size-mib`` MiB (Arrow bytes) of rows ``(id int64, x float64, s 32-char string)``
once, writes them to two persist shards (Python API, ``arrow-rows`` parts as the Spark
sink stages them): *appended* (one commit) and *overwritten* (a commit, then the same rows
again as an atomic replace, so its state also references the retracted parts), and as
Parquet files (pyarrow, same part size, snappy); then in one Spark session
(``local[cores]``, or ``--master``, e.g. ``local-cluster[2,1,1024]``) writes the Parquet
copy's rows to a third shard the way a user does, ``df.write.format("persist")`` with
default options from ``cores`` tasks (*sink-written*), and times full scans
(``selectExpr("sum(id)", "sum(x)", "sum(length(s))")``, so every column is read) of:

- the first read of a fresh Spark session (a new process: JVM, Python workers and
  imports all cold) and the same read warm, for persist and, as the ceiling of what is
  Spark's own, for the no-I/O source below;
- each of the three shards read with default options first (what a user's read does), and
  beside it tuned: 1 partition per core (``minPartitions = cores``, huge
  ``splitSizeBytes``) and 2 per core (``minPartitions = 2 * cores``). The default read
  must be within 1.1x of the better tuned one's time;
- Spark's built-in Parquet reader over the Parquet copy (``maxPartitionBytes`` set so it
  also uses 2 partitions per core);
- the ceiling of Spark's Python Data Source API itself: a source that does no I/O and
  yields the same number of rows, already in memory as Arrow batches of persist's read
  schema, one partition per core. No Python source, persist included, can read faster
  than this; when it is below Spark's Parquet reader, so is every Python source.
- the same source yielding a distinct in-memory copy for every batch (``ceiling.py``'s
  in-memory peer): whether handing Spark distinct data costs more than the one repeated
  batch, and the peer persist's own code is also measured against.

The ratios to the peers are the default reads'. Each is run ``--repeat`` times after one
warm-up, in rounds of one scan of each reader (a
session's JVM keeps warming up over its first scans); the best time counts, and beside it the
least CPU seconds a scan cost (this process and everything it started: Spark's JVM and its
Python workers), which moves far less than wall time on a loaded machine. Targets printed
next to the ratios: persist (each shard, default options) at least 1.0x Spark's Parquet
reader and 0.9x the no-I/O source, the cold first read at most 1.5x the warm one. The
shards and files live in a temporary ``--workdir`` (removed afterwards unless given).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, csv, flag, json_value
from pyspark_persist.tools.bench.cpu import CpuMeter, own_cpu
from pyspark_persist.tools.bench.wide_read import WideReport, format_wide, run_wide

MiB = 1 << 20
PARQUET_TARGET = 1.0
"""persist must read at least this fast relative to Spark's Parquet reader."""
CEILING_TARGET = 0.9
"""... and at least this fast relative to the no-I/O Python source."""
COLD_TARGET = 1.5
"""The session's first read may take at most this many times the warm read."""
DEFAULT_TARGET = 1.1
"""A read with default options may take at most this many times the better tuned split's."""
CEILING = "python source, no I/O"
CEILING_AT_DEFAULT = "python source, no I/O, default's tasks"
"""The no-I/O source over as many tasks as persist's default split of the appended shard: what
Spark itself charges for that many tasks, beside the same source at one task per core."""
IN_MEMORY = "python source, in memory"
"""The timing of the API-ceiling peer (see ``ceiling.py``)."""
SHARD = "bench-spark-read"
OVERWRITTEN = "bench-spark-read-overwritten"
SINK_WRITTEN = "bench-spark-read-sink"
SCHEMA = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("s", pa.string())])
ROW_BYTES = 8 + 8 + 32 + 4  # Arrow bytes per row (string offsets included)


SHARDS = (
    ("persist", SHARD),
    ("persist sink-written", SINK_WRITTEN),
    ("persist overwritten", OVERWRITTEN),
)
"""The shards read, by the name their timings start with: appended through the Python API,
appended through the Spark sink, overwritten through the Python API."""
DEFAULT = "default"
TUNED = ("1/core", "2/core")
PER_CORE = {DEFAULT: None, "1/core": 1, "2/core": 2}
"""How each shard is read, by the name its timing ends with: default options, or
``minPartitions`` that many per core with a huge ``splitSizeBytes``."""
PERSIST_READS = tuple(
    (f"{label} {how}", shard, per_core)
    for label, shard in SHARDS
    for how, per_core in PER_CORE.items()
)
"""The persist reads timed, by name: the shard read and the partitions per core asked for
(``None``: default options)."""
PARQUET = "spark parquet"
"""The timing of Spark's Parquet reader."""
CASES = ("narrow", "wide")
"""The shards read: the 3-column one of every reader above, the 40-column one of wide_read.py."""


@dataclass(frozen=True)
class SparkReadOptions(Options):
    """What to run."""

    size_mib: int = flag(1024, "Arrow MiB of data to read", quick=16, positive=True)
    part_mib: int = flag(64, "part and Parquet file size in MiB", quick=2, positive=True)
    cores: int = flag(2, "Spark cores (local[cores] unless --master)", positive=True)
    master: str | None = flag(None, "Spark master, e.g. local-cluster[2,1,1024]")
    repeat: int = flag(2, "timed scans per reader", quick=1, positive=True)
    workdir: str | None = flag(None, "keep the data here (default: a temporary directory)")
    cases: tuple[str, ...] = flag(
        CASES,
        "which shards to read (comma list): narrow (3 columns, every reader above), wide "
        "(40 columns: 2 of them with a subset schema, and the full scan; see wide_read.py)",
        parse=csv,
        choices=CASES,
    )
    wide_mib: int = flag(512, "Arrow MiB of the wide shard", quick=16, positive=True)


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


def write_data(opts: SparkReadOptions, home: str, parquet_dir: str) -> tuple[int, int]:
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


SCAN = ("sum(id)", "sum(x)", "sum(length(s))")
"""The narrow shard's full scan: every column read."""


def _scan(df: Any, exprs: Sequence[str] = SCAN) -> Scan:
    """One scan: ``df.selectExpr(*exprs)`` collected, a new query each time (collecting one
    aggregate DataFrame again reuses its shuffle's output: the scan is skipped)."""
    with CpuMeter() as meter:
        started = time.perf_counter()
        df.selectExpr(*exprs).collect()
        seconds = time.perf_counter() - started
    spent = meter.split
    if spent is None:
        return Scan(seconds, None)
    return Scan(seconds, round(spent.total, 2), spent.workers)


def _scan_seconds(df: Any, repeat: int) -> tuple[Scan, Scan]:
    """(the first scan, the best of ``repeat`` after it: least wall time and least CPU)."""
    first = _scan(df)
    return first, _best([_scan(df) for _ in range(repeat)])


def _best_interleaved(
    dfs: Sequence[Any], repeat: int, exprs: Sequence[Sequence[str]] | None = None
) -> list[Scan]:
    """Each DataFrame's best of ``repeat`` scans (``exprs``: each one's query, default
    :data:`SCAN`), after one warm-up scan of each, the scans taken in rounds (one of each
    reader a round), every other round in reverse order.

    The JVM keeps compiling its hot paths over a session's first scans: timed one reader
    after the other, each reader ran faster than the one before it (in one 256 MiB run
    persist 1/core 170 MiB/s, 2/core 193, overwritten 235, Parquet 241, the no-I/O source
    244, in that order), which charged the first readers with the warm-up. In rounds of one
    order, a reader's place still told: on local-cluster[2,1,1024] (2026-11-27, a loaded
    machine) each shard's default read, first of its shard in every round, took 1.08-1.34x
    the time of its 2/core read, which planned the very same tasks.
    """
    step(f"spark-read: a warm-up scan of each of {len(dfs)} readers")
    queries = list(zip(dfs, exprs or [SCAN] * len(dfs), strict=True))
    for df, query in queries:
        _scan(df, query)
    rounds = []
    for n in range(repeat):
        step(f"spark-read: timed round {n + 1} of {repeat}")
        order = range(len(queries)) if n % 2 == 0 else range(len(queries) - 1, -1, -1)
        scans = {i: _scan(*queries[i]) for i in order}
        rounds.append([scans[i] for i in range(len(queries))])
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


def _session(master: str) -> Any:
    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter, so they import this pyspark_persist
    # (by default they run the first python3 on PATH, which may hold another copy).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master(master)
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


def _location(home: str) -> dict[str, str]:
    return {"blob": f"file://{home}/blob", "consensus": f"sqlite:///{home}/consensus.db"}


def _persist_df(spark: Any, home: str, shard: str, partitions: int | None) -> Any:
    """A read of ``shard``: default options (``partitions`` None), or ``partitions`` tasks."""
    tuned = {} if partitions is None else {"minPartitions": str(partitions), "splitSizeBytes": "1t"}
    return spark.read.format("persist").options(**_location(home), **tuned).load(shard)


def write_through_sink(spark: Any, home: str, parquet_dir: str, cores: int) -> None:
    """The Parquet copy's rows appended to SINK_WRITTEN as a user's job does: ``df.write`` with
    default options, from ``cores`` tasks (each stages its own parts and remainder)."""
    df = spark.read.parquet(parquet_dir).coalesce(cores)
    df.write.format("persist").options(**_location(home)).mode("append").save(SINK_WRITTEN)


def _no_io_df(
    spark: Any,
    rows: int,
    cores: int,
    distinct: bool = False,
    schema: pa.Schema = SCHEMA,
    make_batch: Callable[[int], pa.RecordBatch] = read_batch,
    name: str | None = None,
) -> Any:
    """The no-I/O (or with ``distinct`` the in-memory) source of ``rows`` rows of ``schema``
    read as persist reads it, ``make_batch``'s batches, over ``cores`` tasks (see
    ``ceiling.py``; ``name``: register it under a name of its own)."""
    from pyspark_persist.schema import read_schema
    from pyspark_persist.tools.bench.ceiling import no_io_source

    source = no_io_source(read_schema(schema), rows, cores, make_batch, distinct, name)
    spark.dataSource.register(source)
    return spark.read.format(source.name()).load()


COLD_SOURCES = ("persist", "no-io")


def cold_probe(source: str, workdir: str, master: str, cores: int, rows: int) -> dict[str, Any]:
    """In this (fresh) process: a new session's first scan of ``source``, then its best warm
    scan (the appended shard in ``workdir`` read with default options, or the no-I/O source
    one partition per core)."""
    spark = _session(master)
    try:
        if source == "persist":
            df = _persist_df(spark, os.path.join(workdir, "persist"), SHARD, None)
        else:
            df = _no_io_df(spark, rows, cores)
        first, warm = _scan_seconds(df, 2)
        partitions = df.rdd.getNumPartitions()
        return {"first": asdict(first), "warm": asdict(warm), "partitions": partitions}
    finally:
        spark.stop()


def _run_cold_probe(
    source: str, workdir: str, master: str, cores: int, rows: int
) -> dict[str, Any]:
    """:func:`cold_probe` in a new interpreter, so nothing of this session is warm."""
    call = (
        "import json; from pyspark_persist.tools.bench.spark_read import cold_probe; "
        f"print(json.dumps(cold_probe({source!r}, {workdir!r}, {master!r}, {cores}, {rows})))"
    )
    out = subprocess.run([sys.executable, "-c", call], check=True, capture_output=True, text=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@dataclass
class Report(Result):
    """Every reader's best scan, by name, and the ratios the targets are judged on."""

    options: SparkReadOptions
    rows: int
    arrow_mib: float
    """The rows' Arrow MiB, to 0.1."""
    write_s: float
    """How long writing the data (shards and Parquet files) took, to 0.01 s."""
    timings: list[Timing] = field(default_factory=list)
    master: str | None = None
    """The Spark master the reads ran on."""
    sink_write_s: float | None = None
    """How long the Spark sink took to write the sink-written shard, to 0.01 s."""
    wide: WideReport | None = None
    """The wide shard's readers (``--cases wide``)."""

    def to_json(self) -> dict[str, Any]:
        """Fields and derived figures; without the narrow case, only the wide one's."""
        if "narrow" in self.options.cases:
            return super().to_json()
        return {"options": json_value(self.options), "wide": json_value(self.wide)}

    def timing(self, name: str) -> Timing:
        """The reader ``name``'s timing (see :data:`PERSIST_READS`)."""
        found = next((t for t in self.timings if t.name == name), None)
        if found is None:
            raise KeyError(f"no timing {name!r}: the run has {[t.name for t in self.timings]}")
        return found

    def tuned(self, label: str) -> Timing:
        """The better tuned split of the shard ``label`` (see :data:`SHARDS`)."""
        return min((self.timing(f"{label} {how}") for how in TUNED), key=lambda t: t.seconds)

    def default_over_tuned(self, label: str) -> float:
        """How many times the better tuned split's time the shard ``label``'s default read
        took (at most :data:`DEFAULT_TARGET`)."""
        return self.timing(f"{label} {DEFAULT}").seconds / self.tuned(label).seconds

    @property
    def default_ok(self) -> bool:
        """Every shard's default read meets :data:`DEFAULT_TARGET`."""
        return all(self.default_over_tuned(label) <= DEFAULT_TARGET for label, _ in SHARDS)

    @property
    def appended(self) -> Timing:
        """The appended shard read with default options."""
        return self.timing(f"persist {DEFAULT}")

    @property
    def sink_written(self) -> Timing:
        """The shard the Spark sink wrote, read with default options."""
        return self.timing(f"persist sink-written {DEFAULT}")

    @property
    def overwritten(self) -> Timing:
        """The overwritten shard read with default options."""
        return self.timing(f"persist overwritten {DEFAULT}")

    def _over(self, peer: str, mine: Timing) -> float:
        """How many times faster ``mine`` scanned than ``peer``."""
        return self.timing(peer).seconds / mine.seconds

    @property
    def split_speedup(self) -> float:
        """The appended shard read 2 partitions per core, against 1."""
        return self.timing("persist 1/core").seconds / self.timing("persist 2/core").seconds

    @property
    def spark_task_cost(self) -> float:
        """The no-I/O source's time at the default's task count over its time at one task per
        core: the part of :meth:`default_over_tuned` that is Spark's, not persist's."""
        return self.timing(CEILING_AT_DEFAULT).seconds / self.timing(CEILING).seconds

    @property
    def persist_vs_parquet(self) -> float:
        """The appended shard against Spark's Parquet reader."""
        return self._over(PARQUET, self.appended)

    @property
    def sink_written_vs_parquet(self) -> float:
        """The sink-written shard against Spark's Parquet reader."""
        return self._over(PARQUET, self.sink_written)

    @property
    def overwritten_vs_parquet(self) -> float:
        """The overwritten shard against Spark's Parquet reader."""
        return self._over(PARQUET, self.overwritten)

    @property
    def parquet_target(self) -> float:
        """The least both may be."""
        return PARQUET_TARGET

    @property
    def parquet_ok(self) -> bool:
        """Every shard's default read meets :data:`PARQUET_TARGET`."""
        shards = (
            self.persist_vs_parquet,
            self.sink_written_vs_parquet,
            self.overwritten_vs_parquet,
        )
        return min(shards) >= PARQUET_TARGET

    @property
    def ceiling_vs_parquet(self) -> float:
        """The no-I/O Python source against Spark's Parquet reader: the API's own limit."""
        return self._over(PARQUET, self.timing(CEILING))

    @property
    def persist_vs_ceiling(self) -> float:
        """The appended shard against the no-I/O Python source."""
        return self._over(CEILING, self.appended)

    @property
    def sink_written_vs_ceiling(self) -> float:
        """The sink-written shard against the no-I/O Python source."""
        return self._over(CEILING, self.sink_written)

    @property
    def overwritten_vs_ceiling(self) -> float:
        """The overwritten shard against the no-I/O Python source."""
        return self._over(CEILING, self.overwritten)

    @property
    def ceiling_target(self) -> float:
        """The least both may be."""
        return CEILING_TARGET

    @property
    def ceiling_ok(self) -> bool:
        """Every shard's default read meets :data:`CEILING_TARGET`."""
        shards = (
            self.persist_vs_ceiling,
            self.sink_written_vs_ceiling,
            self.overwritten_vs_ceiling,
        )
        return min(shards) >= CEILING_TARGET

    @property
    def cold_vs_warm(self) -> float:
        """A fresh session's first persist read over its warm one."""
        cold = self.timing(_cold_name("persist", True))
        return cold.seconds / self.timing(_cold_name("persist", False)).seconds

    @property
    def ceiling_cold_vs_warm(self) -> float:
        """The same for the no-I/O source: what is Spark's own."""
        cold = self.timing(_cold_name(CEILING, True))
        return cold.seconds / self.timing(_cold_name(CEILING, False)).seconds

    @property
    def cold_vs_ceiling_cold(self) -> float:
        """persist's first read over the no-I/O source's."""
        cold = self.timing(_cold_name("persist", True))
        return cold.seconds / self.timing(_cold_name(CEILING, True)).seconds

    @property
    def cold_target(self) -> float:
        """The most :attr:`cold_vs_warm` may be."""
        return COLD_TARGET

    @property
    def cold_ok(self) -> bool:
        """:attr:`cold_vs_warm` meets :data:`COLD_TARGET`."""
        return self.cold_vs_warm <= COLD_TARGET

    @property
    def own_cpu(self) -> dict[str, dict[str, float] | None]:
        """persist's own code's CPU in a scan, beside the no-I/O source's."""
        ceiling = self.timing(CEILING)
        return {
            "appended": _own_cpu(self.appended, ceiling),
            "overwritten": _own_cpu(self.overwritten, ceiling),
        }

    @property
    def in_memory_vs_ceiling(self) -> float:
        """The in-memory source against the no-I/O one."""
        return self._over(CEILING, self.timing(IN_MEMORY))

    @property
    def persist_vs_in_memory(self) -> float:
        """The appended shard against the in-memory source."""
        return self._over(IN_MEMORY, self.appended)

    @property
    def overwritten_vs_in_memory(self) -> float:
        """The overwritten shard against the in-memory source."""
        return self._over(IN_MEMORY, self.overwritten)

    @property
    def own_cpu_vs_in_memory(self) -> dict[str, dict[str, float] | None]:
        """persist's own code's CPU in a scan, beside the in-memory source's."""
        in_memory = self.timing(IN_MEMORY)
        return {
            "appended": _own_cpu(self.appended, in_memory),
            "overwritten": _own_cpu(self.overwritten, in_memory),
        }


def run(opts: SparkReadOptions) -> Report:
    """Generate, write, then time each reader of each case asked for."""
    workdir = opts.workdir or tempfile.mkdtemp(prefix="persist-bench-spark-read-")
    home = os.path.join(workdir, "persist")
    parquet_dir = os.path.join(workdir, "parquet")
    os.makedirs(home, exist_ok=True)
    os.environ["PERSIST_HOME"] = home  # Spark's Python workers inherit the location
    narrow = "narrow" in opts.cases
    try:
        master = opts.master or f"local[{opts.cores}]"
        report = Report(opts, 0, 0.0, 0.0, master=master)
        if narrow:
            t0 = time.perf_counter()
            step(f"spark-read: writing {opts.size_mib} MiB of rows to two shards and Parquet files")
            report.rows, nbytes = write_data(opts, home, parquet_dir)
            report.arrow_mib = round(nbytes / MiB, 1)
            report.write_s = round(time.perf_counter() - t0, 2)
        step(f"spark-read: starting Spark ({master})")
        spark = _session(master)
        try:
            if "wide" in opts.cases:
                report.wide = run_wide(spark, home, workdir, opts.wide_mib, opts.cores, opts.repeat)
            if narrow:
                step(f"spark-read: writing the rows through the Spark sink from {opts.cores} tasks")
                t0 = time.perf_counter()
                write_through_sink(spark, home, parquet_dir, opts.cores)
                report.sink_write_s = round(time.perf_counter() - t0, 2)
                _time_narrow(spark, opts, home, parquet_dir, report, nbytes / MiB)
        finally:
            spark.stop()
        if narrow:
            _time_cold(opts, workdir, master, report, nbytes / MiB)
    finally:
        if opts.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def _time_narrow(
    spark: Any, opts: SparkReadOptions, home: str, parquet_dir: str, report: Report, mib: float
) -> None:
    """Time every reader of the narrow shards in ``spark``, into ``report``."""
    readers = {
        name: _persist_df(spark, home, shard, per_core and per_core * opts.cores)
        for name, shard, per_core in PERSIST_READS
    }
    files_bytes = sum(
        os.path.getsize(os.path.join(parquet_dir, f)) for f in os.listdir(parquet_dir)
    )
    spark.conf.set(
        "spark.sql.files.maxPartitionBytes",
        str(max(1 << 20, files_bytes // (2 * opts.cores) + 1)),
    )
    readers[PARQUET] = spark.read.parquet(parquet_dir)
    readers[CEILING] = _no_io_df(spark, report.rows, opts.cores)
    default_tasks = readers[f"persist {DEFAULT}"].rdd.getNumPartitions()
    readers[CEILING_AT_DEFAULT] = _no_io_df(
        spark, report.rows, default_tasks, name="persist-bench-no-io-default-tasks"
    )
    readers[IN_MEMORY] = _no_io_df(spark, report.rows, opts.cores, distinct=True)
    scans = _best_interleaved(list(readers.values()), opts.repeat)
    report.timings.extend(
        _timing(name, df, scan, mib)
        for (name, df), scan in zip(readers.items(), scans, strict=True)
    )


def _time_cold(
    opts: SparkReadOptions, workdir: str, master: str, report: Report, mib: float
) -> None:
    """The first read of a fresh Spark session, persist's and the no-I/O source's."""
    for source, label in zip(COLD_SOURCES, ("persist", CEILING), strict=True):
        step(f"spark-read: the first read of a fresh Spark session, {label}")
        probe = _run_cold_probe(source, workdir, master, opts.cores, report.rows)
        for when in ("first", "warm"):
            scan = Scan(**probe[when])
            report.timings.append(
                Timing(
                    _cold_name(label, when == "first"),
                    probe["partitions"],
                    scan.seconds,
                    mib / scan.seconds,
                    scan.cpu_seconds,
                    scan.worker_cpu_seconds,
                )
            )


def _cold_name(label: str, first: bool) -> str:
    """The timing of a fresh session's first (or best warm) read of ``label``."""
    return f"{label} {'cold' if first else 'warm'}, new session"


def _own_cpu(persist: Timing, ceiling: Timing) -> dict[str, float] | None:
    """What persist's own code cost in a scan (:func:`own_cpu` beside the no-I/O source: the
    rest of persist's is fetching, checking and decoding parts)."""
    own = own_cpu(persist.worker_cpu_seconds, ceiling.worker_cpu_seconds, persist.cpu_seconds)
    return None if own is None else {"seconds": own[0], "share": own[1]}


def format_report(report: Report) -> str:
    """The report as text for people."""
    wide = [] if report.wide is None else format_wide(report.wide, report.options.cores)
    if "narrow" not in report.options.cases:
        return "\n".join(wide)
    lines = [
        f"persist Spark snapshot read: {report.rows:,} rows, {report.arrow_mib} MiB "
        f"(Arrow), {report.master}, {report.options.cores} cores; data written in "
        f"{report.write_s} s (through the Spark sink: {report.sink_write_s} s)",
    ]
    for t in report.timings:
        lines.append(
            f"  {t.name:<42} {t.partitions:>3} partitions  {t.seconds:8.2f} s  "
            f"{t.mib_per_s:8.1f} MiB/s  "
            + ("" if t.cpu_seconds is None else f"{t.cpu_seconds:7.2f} CPU s")
            + (
                ""
                if t.worker_cpu_seconds is None
                else f" ({t.worker_cpu_seconds:.2f} in Python workers)"
            )
        )

    def verdict(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    lines.append(
        "  default options' time / the better tuned split's: "
        + ", ".join(
            f"{label.removeprefix('persist').strip() or 'appended'} "
            f"{report.default_over_tuned(label):.2f}x ({report.tuned(label).name.split()[-1]})"
            for label, _ in SHARDS
        )
        + f" (target <= {DEFAULT_TARGET}x: {verdict(report.default_ok)})"
    )
    lines.append(
        f"  Spark's own cost of the default's "
        f"{report.timing(CEILING_AT_DEFAULT).partitions} tasks (the no-I/O source at that many "
        f"/ at one per core): {report.spark_task_cost:.2f}x"
    )
    lines.append(
        f"  persist (default options) / Spark Parquet: appended "
        f"{ratio_text(report.persist_vs_parquet, PARQUET_TARGET)}, sink-written "
        f"{ratio_text(report.sink_written_vs_parquet, PARQUET_TARGET)}, overwritten "
        f"{ratio_text(report.overwritten_vs_parquet, PARQUET_TARGET)} "
        f"(target >= {PARQUET_TARGET}x: "
        f"{verdict(report.parquet_ok)})"
    )
    lines.append(
        f"  persist (default options) / no-I/O Python source: appended "
        f"{ratio_text(report.persist_vs_ceiling, CEILING_TARGET)}, sink-written "
        f"{ratio_text(report.sink_written_vs_ceiling, CEILING_TARGET)}, overwritten "
        f"{ratio_text(report.overwritten_vs_ceiling, CEILING_TARGET)} "
        f"(target >= {CEILING_TARGET}x: "
        f"{verdict(report.ceiling_ok)}); that source / Spark Parquet: "
        f"{report.ceiling_vs_parquet:.2f}x"
    )
    lines.append(
        f"  cold first read / warm: {ratio_text(report.cold_vs_warm, COLD_TARGET)} "
        f"(target <= {COLD_TARGET}x: "
        f"{verdict(report.cold_ok)}); the no-I/O source's own: "
        f"{report.ceiling_cold_vs_warm:.2f}x; persist cold / no-I/O cold: "
        f"{report.cold_vs_ceiling_cold:.2f}x; 2-way split / 1-way: "
        f"{report.split_speedup:.2f}x"
    )
    lines.append(
        f"  persist / in-memory Python source (distinct batches, no I/O): appended "
        f"{report.persist_vs_in_memory:.2f}x, overwritten "
        f"{report.overwritten_vs_in_memory:.2f}x; that source / the no-I/O one: "
        f"{report.in_memory_vs_ceiling:.2f}x"
    )
    for own, peer in ((report.own_cpu, "no-I/O"), (report.own_cpu_vs_in_memory, "in-memory")):
        appended, overwritten = own["appended"], own["overwritten"]
        if appended and overwritten:
            lines.append(
                f"  persist's own code (its Python workers' CPU beyond the {peer} source's): "
                + ", ".join(
                    f"{kind} {cpu['seconds']:.2f} s = {100 * cpu['share']:.1f}% of its scan's CPU"
                    for kind, cpu in (("appended", appended), ("overwritten", overwritten))
                )
            )
    return "\n".join(lines + wide)


BENCHMARK = Benchmark("spark-read", SparkReadOptions, run, format_report, __doc__)
"""``persist bench spark-read``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
