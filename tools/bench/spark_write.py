"""The Spark benchmark of the persist sink: throughput next to Parquet, latency next to files.

Run it as ``persist bench spark-write`` (or ``python -m
pyspark_persist.tools.bench.spark_write``; ``--quick`` for a smoke run,
``--json`` for machine-readable output). In one Spark application
(``local[*]`` unless ``--master``) and one run it measures:

- **Write throughput**: a DataFrame of ``--size-mib`` (default 1 GiB) of
  rows ``(id int64, x double, s 32-char string)``, generated with
  ``spark.range`` and expressions and cached (materialized before any clock
  starts, so every writer sees the same data), written by
  ``df.write.format("persist")`` in ``append`` and in ``overwrite`` mode, by
  Spark's built-in Parquet writer (``df.write.parquet``, in both modes), and by the ceiling
  of Spark's Python Data Source API: a sink that receives the same rows and
  discards them (``ceiling.py``; no Python sink can write faster). Then a
  streaming append: a file source over the Parquet copy, ``Trigger.AvailableNow``,
  into the persist sink, into Spark's Parquet file sink, and into the discarding
  sink's streaming form (the ceiling of a Python streaming sink: its micro-batch
  commits cost what any Python sink's do). The writers run
  in turn, ROUNDS times, each Python sink after an untimed write of a few rows
  through the same path (Spark reaps Python workers idle for a minute: see
  WARM_UP_ROWS), and each writer's best round counts. Rows/s and MiB/s of each
  (MiB = the rows' Arrow bytes, 52 a row), the least CPU seconds a round cost
  (Spark's JVM and Python workers; steadier than wall time on a loaded machine)
  and the ratios.
  Target: each persist mode >= 1.0x its Parquet peer in the same mode (append
  into what earlier rounds wrote, overwrite, and for the streaming append the
  file sink, each streaming writer starting from an empty shard or directory).
  ``--arrow-batch-rows N`` sets ``spark.sql.execution.arrow.maxRecordsPerBatch``
  for the run: Spark hands every Python sink (persist's and the discarding one)
  N-row Arrow batches instead of its default 10,000; at 65,536, persist's
  stored batch, persist stores them as they come instead of copying them
  together (see docs/spark.md, "Bulk writes"). ``--lift-arrow-byte-cap`` sets
  ``spark.sql.execution.arrow.maxBytesPerBatch`` to 2147483647, the one value at
  which Spark stops measuring the Arrow batch it is building after every row (at
  its default, 64 MiB, that measuring took a third of the JVM's task-thread
  samples in a JFR profile of a Python sink's write): every Python sink gets
  its rows faster, Parquet's writer is unaffected.
- **A user's first write**: those rounds are warm, a user's one-off job is not. For the
  discarding sink and then persist, each in a new interpreter and Spark session: its first
  write of the same rows (for persist into a new shard), when Spark's Python workers start
  and import pyspark and the sink, then the next write, and persist's first over the
  discarding sink's first beside the warm ratio (``--skip-first-write`` to leave it out).
- **Write-to-visible latency** of a streaming pipeline: a rate-limited
  ``rate`` source -> sink -> source of the same format -> ``foreachBatch`` on
  the driver, which records ``now - the row's creation time`` (the rate
  source's ``timestamp``, carried in the row) for every row it sees. Built
  once on persist (persist sink -> persist source) and once on Spark's file
  sink and file source (Parquet), run one after the other for the same
  time; p50/p95 of each after a warm-up, and their ratio. Target: persist p50
  <= 0.5x the file pipeline. Beside them, the floor of any such pipeline: the
  rate source straight into ``foreachBatch`` (one query, no sink or source
  between), and for every query the median of each micro-batch phase Spark
  reports (``durationMs``: offset log, planning, the batch, commit log).

Stores live in a fresh work directory (``--workdir`` to keep them): persist
on ``file://`` Blob + ``sqlite://`` Consensus there, Parquet files beside.
"""

from __future__ import annotations

import json
import os
import pkgutil
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pyspark_persist.state.config import PersistConfig
from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag
from pyspark_persist.tools.bench.cpu import CpuMeter, own_cpu

MiB = 1 << 20
ROW_BYTES = 8 + 8 + 32 + 4
"""Arrow bytes of one row: int64, float64, 32 bytes of string and its int32 offset."""
THROUGHPUT_TARGET = 1.0
ROUNDS = 3
"""Interleaved rounds of the writers; each writer's best round counts."""
PEERS = {
    "persist append": "parquet append",
    "persist overwrite": "parquet",
    "persist stream": "parquet stream",
}
"""Each persist write mode and the Spark writer it is compared with: the same mode.

An append keeps what earlier rounds wrote (persist's shard, Parquet's directory) and an
overwrite replaces it, as each writer's mode does. It matters beyond fairness on this kind
of virtual machine: a byte written to a file costs the kernel a page of page cache, and a
page the guest never touched before costs several times one an overwrite just freed (a sink
profile put the copy into fresh pages at 45% of its Python workers' CPU at 1 GiB)."""
LATENCY_TARGET = 0.5
WARM_UP_ROWS = 4
"""Rows per partition of the untimed write each Python sink makes just before its timed one.

Spark reaps a Python worker idle for a minute, and a 1 GiB round of the eight writers takes
longer: each timed write then forked its planner, task and committer workers anew, and the
CPU of their start-up (pyspark's imports, the sink's) fell in its window. In one 1 GiB run the
discarding sink's workers spent 2.46 CPU s of which its tasks' own threads took 1.0, and
persist's append, first of its round, 1.4 s more than its overwrite. Warmed by a few rows
through the same path, every timed write measures the steady state the rounds are meant to.
"""
ARROW_BATCH_ROWS_CONF = "spark.sql.execution.arrow.maxRecordsPerBatch"
ARROW_BYTE_CAP_CONF = "spark.sql.execution.arrow.maxBytesPerBatch"
NO_ARROW_BYTE_CAP = 2147483647
"""The value of ARROW_BYTE_CAP_CONF at which Spark skips its byte check (Java's
``Integer.MAX_VALUE`` exactly: at any other value it measures the batch after every row)."""
DEFAULT_BATCH_ROWS = PersistConfig.read_batch_rows


@dataclass(frozen=True)
class SparkWriteOptions(Options):
    """What to run."""

    size_mib: float = flag(
        1024.0, "DataFrame size for the throughput phase", quick=64.0, positive=True
    )
    master: str = flag("local[*]", "Spark master")
    partitions: int | None = flag(
        None, "partitions of the DataFrame (default: Spark's default parallelism)", positive=True
    )
    rows_per_second: int = flag(20, "rate of the latency pipelines' source", positive=True)
    latency_seconds: float = flag(
        40.0, "run time of each latency pipeline", quick=15.0, positive=True
    )
    warmup_seconds: float = flag(8.0, "samples of the first seconds are dropped", quick=5.0)
    arrow_batch_rows: int | None = flag(
        None,
        "rows per Arrow batch Spark hands a Python sink "
        f"({ARROW_BATCH_ROWS_CONF}; default Spark's, 10000). At "
        f"{DEFAULT_BATCH_ROWS}, persist's stored batch, persist's parts take Spark's batches "
        "as they come. Parquet's writer does not use Arrow: only the Python sinks see it",
        positive=True,
    )
    lift_arrow_byte_cap: bool = flag(
        False,
        f"set {ARROW_BYTE_CAP_CONF} to {NO_ARROW_BYTE_CAP}, so Spark stops measuring "
        "each Arrow batch for a Python sink after every row (see docs/spark.md, Bulk writes)",
    )
    skip_first_write: bool = flag(
        False, "skip the first writes of a new session (two more Spark sessions)"
    )
    skip_latency: bool = flag(False, "throughput only")
    skip_throughput: bool = flag(False, "latency only")
    workdir: str | None = flag(
        None, "directory for the stores (default: a temp dir, removed after)"
    )


@dataclass
class WriteFigures:
    """One writer's throughput."""

    writer: str
    rows: int
    seconds: float
    rows_per_s: float
    mib_per_s: float
    cpu_seconds: float | None = None
    """The least CPU one write cost (this process, Spark's JVM and its Python workers), which
    a loaded machine moves far less than wall time; None off Linux."""
    worker_cpu_seconds: float | None = None
    """The least CPU Spark's Python workers spent in one write: where a Python sink's tasks
    run (persist's staging beside pyspark's transfer from the JVM); None off Linux."""


@dataclass
class LatencyFigures:
    """One pipeline's write-to-visible latency, in milliseconds."""

    pipeline: str
    samples: int
    p50_ms: float
    p95_ms: float
    max_ms: float
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per query ("sink", "reader"): the median ms of each micro-batch phase Spark reports."""


@dataclass
class Report(Result):
    """Everything one run measured, plus whether each target was met."""

    size_mib: float
    partitions: int
    master: str
    arrow_batch_rows: int | None = None
    """``--arrow-batch-rows``: the run's Arrow batch size into Python sinks (None: Spark's)."""
    arrow_byte_cap_lifted: bool = False
    """``--lift-arrow-byte-cap``: Spark did not measure each Arrow batch row by row."""
    write: list[WriteFigures] = field(default_factory=list)
    first_write: list[WriteFigures] = field(default_factory=list)
    """Per Python sink (FIRST_WRITERS), a new session's first write (``<sink> first``) and
    the next one in that session (``<sink> next``): see :func:`first_write_probe`."""
    first_write_ratio: float | None = None
    """persist's first write's rows/s over the discarding sink's first write's."""
    latency: list[LatencyFigures] = field(default_factory=list)
    write_ratio: float = 0.0
    """The worst of ``mode_ratios``."""
    mode_ratios: dict[str, float] = field(default_factory=dict)
    """Each persist write mode's rows/s over its peer's (see PEERS)."""
    ceiling_write_ratio: float = 0.0
    """The discarding Python sink's throughput over Parquet's: the API's own limit."""
    ceiling_stream_ratio: float = 0.0
    """The discarding Python streaming sink's over Parquet's file sink: the streaming limit."""
    own_cpu: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Per persist mode: (seconds, share of its write's CPU) that persist's own code cost,
    its Python workers' CPU beyond the discarding sink's (both pay pyspark's transfer)."""
    latency_ratio: float = 0.0
    floor_latency_ratio: float = 0.0
    """The one-hop floor's p50 over the file pipeline's."""
    targets: dict[str, bool] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def figures(self, writer: str) -> WriteFigures:
        """The throughput of ``writer`` (a key of PEERS or a value, ``discard``...)."""
        every = self.write + self.first_write
        found = next((w for w in every if w.writer == writer), None)
        if found is None:
            raise KeyError(f"no writer {writer!r}: the run has {[w.writer for w in every]}")
        return found


def _session(master: str, arrow_batch_rows: int | None = None, lift_byte_cap: bool = False) -> Any:
    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter, so they import this pyspark_persist
    # (by default they run the first python3 on PATH, which may hold another copy).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    spark = (
        SparkSession.builder.master(master)
        .appName("persist-bench-spark-write")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")  # the benchmark says what it runs
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "false")
        .config("spark.driver.memory", "4g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    if arrow_batch_rows is not None:
        spark.conf.set(ARROW_BATCH_ROWS_CONF, str(arrow_batch_rows))
    if lift_byte_cap:
        spark.conf.set(ARROW_BYTE_CAP_CONF, str(NO_ARROW_BYTE_CAP))
    if not any(m.name == "pyspark_persist" for m in pkgutil.iter_modules()):
        from pyspark_persist import DefaultSource  # an editable install: not auto-discovered

        spark.dataSource.register(DefaultSource)
    from pyspark_persist.tools.bench.ceiling import DiscardSink

    spark.dataSource.register(DiscardSink)
    return spark


def _cached_rows(spark: Any, size_mib: float, partitions: int | None) -> tuple[int, int, Any]:
    """(rows, partitions, the cached DataFrame of ``size_mib`` of rows), materialized so no
    clock started after this pays for generating them."""
    from pyspark.sql import functions as F

    rows = max(int(size_mib * MiB / ROW_BYTES), 1)
    parts = partitions or spark.sparkContext.defaultParallelism
    df = (
        spark.range(0, rows, numPartitions=parts)
        .select(
            F.col("id"),
            (F.col("id") * F.lit(0.5)).alias("x"),
            F.md5(F.col("id").cast("string")).alias("s"),
        )
        .cache()
    )
    assert df.count() == rows
    return rows, parts, df


def _figures(name: str, rows: int, seconds: float, cpu: Any) -> WriteFigures:
    """One timed write as figures (``cpu``: its CpuMeter split, None off Linux)."""
    return WriteFigures(
        name,
        rows,
        round(seconds, 3),
        round(rows / seconds, 1),
        round(rows * ROW_BYTES / MiB / seconds, 2),
        None if cpu is None else round(cpu.total, 2),
        None if cpu is None else round(cpu.workers, 2),
    )


FIRST_WRITERS = ("discard", "persist append")
"""The Python sinks whose first write in a new session is timed, in that order."""


def first_write_probe(
    writer: str,
    workdir: str,
    master: str,
    size_mib: float,
    partitions: int | None,
    arrow_batch_rows: int | None = None,
    lift_byte_cap: bool = False,
) -> list[WriteFigures]:
    """In this (fresh) process: a user's first write, then the next one, as a user's job does.

    The first Python write of a Spark application starts Spark's Python worker daemon, its
    task workers and the driver's planner worker (which builds the writer and runs its
    commit), and each imports pyspark and the sink's module; a persist write into a new shard
    also creates the shard. The rounds of :func:`_throughput` warm all of that up before
    their clocks start, which a user's one-off job never does: this is the figure for it. The
    second write, into the same shard (or sink), is the same session warm.
    """
    spark = _session(master, arrow_batch_rows, lift_byte_cap)
    try:
        rows, _, df = _cached_rows(spark, size_mib, partitions)
        from pyspark_persist.tools.bench.ceiling import DISCARD

        opts = {
            "blob": f"file://{os.path.abspath(workdir)}/blob",
            "consensus": f"sqlite:///{os.path.abspath(workdir)}/consensus.db",
        }
        shard = f"first-{uuid.uuid4().hex[:8]}"
        out = []
        for when in ("first", "next"):
            with CpuMeter() as meter:
                started = time.perf_counter()
                if writer == "discard":
                    df.write.format(DISCARD).mode("append").save()
                else:
                    df.write.format("persist").options(**opts).mode("append").save(shard)
                seconds = time.perf_counter() - started
            out.append(_figures(f"{writer} {when}", rows, seconds, meter.split))
        return out
    finally:
        spark.stop()


def _run_first_write_probe(
    writer: str, workdir: str, options: SparkWriteOptions
) -> list[WriteFigures]:
    """:func:`first_write_probe` in a new interpreter, so nothing of this run is warm."""
    args = (
        writer,
        workdir,
        options.master,
        options.size_mib,
        options.partitions,
        options.arrow_batch_rows,
        options.lift_arrow_byte_cap,
    )
    call = (
        "import json, dataclasses; "
        "from pyspark_persist.tools.bench.spark_write import first_write_probe; "
        f"print(json.dumps([dataclasses.asdict(f) for f in first_write_probe(*{args!r})]))"
    )
    out = subprocess.run([sys.executable, "-c", call], check=True, capture_output=True, text=True)
    return [WriteFigures(**f) for f in json.loads(out.stdout.strip().splitlines()[-1])]


def _throughput(
    spark: Any, size_mib: float, partitions: int | None, opts: dict[str, str], workdir: str
) -> list[WriteFigures]:
    rows, parts, df = _cached_rows(spark, size_mib, partitions)
    out: list[WriteFigures] = []

    from pyspark_persist.tools.bench.ceiling import DISCARD

    tag = uuid.uuid4().hex[:8]
    path = os.path.join(workdir, "parquet-write")
    append_path = os.path.join(workdir, "parquet-append")
    source_dir = os.path.join(workdir, "stream-source")
    df.write.parquet(source_dir)  # the streaming writers' input, written once
    stream_schema = df.schema
    # A few rows in every partition: what a writer's untimed warm-up writes (see WARM_UP_ROWS).
    tiny = df.limit(WARM_UP_ROWS * parts).repartition(parts).cache()
    tiny.count()
    tiny_dir = os.path.join(workdir, "warm-up-source")
    tiny.write.parquet(tiny_dir)

    def stream(fmt: str, sink_opts: dict[str, str], target: str, source: str = source_dir) -> None:
        ckpt = os.path.join(workdir, f"ckpt-{uuid.uuid4().hex[:8]}")
        query = (
            spark.readStream.schema(stream_schema)
            .parquet(source)
            .writeStream.format(fmt)
            .options(**sink_opts)
            .option("checkpointLocation", ckpt)
            .trigger(availableNow=True)
            .start(target)
        )
        query.awaitTermination()
        shutil.rmtree(ckpt, ignore_errors=True)

    stream_out = os.path.join(workdir, "parquet-stream")
    rounds = iter(range(ROUNDS))
    stream_shard = ""

    def empty_parquet_stream() -> None:
        shutil.rmtree(stream_out, ignore_errors=True)

    def empty_persist_stream() -> None:
        # Into a new shard each round, the last round's dropped first, as the Parquet stream
        # writes into an emptied directory.
        nonlocal stream_shard
        n = next(rounds)
        if n:
            _drop_shard(opts, stream_shard)
        stream_shard = f"stream-{tag}-{n}"

    writers = {
        "persist append": lambda: (
            df.write.format("persist").options(**opts).mode("append").save(f"append-{tag}")
        ),
        "persist overwrite": lambda: (
            df.write.format("persist").options(**opts).mode("overwrite").save(f"over-{tag}")
        ),
        "parquet": lambda: df.write.mode("overwrite").parquet(path),
        "parquet append": lambda: df.write.mode("append").parquet(append_path),
        "discard": lambda: df.write.format(DISCARD).mode("append").save(),
        "persist stream": lambda: stream("persist", opts, stream_shard),
        "parquet stream": lambda: stream("parquet", {}, stream_out),
        "discard stream": lambda: stream(DISCARD, {}, "discard"),
    }
    warm = f"warm-{tag}"
    warm_ups = {
        "persist append": lambda: (
            tiny.write.format("persist").options(**opts).mode("append").save(warm)
        ),
        "persist overwrite": lambda: (
            tiny.write.format("persist").options(**opts).mode("overwrite").save(warm)
        ),
        "discard": lambda: tiny.write.format(DISCARD).mode("append").save(),
        "persist stream": lambda: stream("persist", opts, f"{warm}-stream", tiny_dir),
        "discard stream": lambda: stream(DISCARD, {}, "discard", tiny_dir),
    }
    """See WARM_UP_ROWS: run before each timed write of a Python sink, untimed."""
    emptied_first = {"persist stream": empty_persist_stream, "parquet stream": empty_parquet_stream}
    """Run before the clock starts: emptying what the last round wrote is no part of a write
    (a shard's drop, timed with persist's stream, cost it more than the Parquet rmtree)."""
    best = dict.fromkeys(writers, float("inf"))
    least_cpu: dict[str, float] = {}
    least_worker_cpu: dict[str, float] = {}
    for n in range(ROUNDS):  # interleaved, so a slow spell of the machine hits every writer
        step(f"spark-write: round {n + 1} of {ROUNDS}: {', '.join(writers)}")
        for name, write in writers.items():
            if name in emptied_first:
                emptied_first[name]()
            if name in warm_ups:
                warm_ups[name]()
            with CpuMeter() as meter:
                started = time.perf_counter()
                write()
                best[name] = min(best[name], time.perf_counter() - started)
            spent = meter.split
            if spent is not None:
                least_cpu[name] = min(least_cpu.get(name, float("inf")), spent.total)
                least_worker_cpu[name] = min(
                    least_worker_cpu.get(name, float("inf")), spent.workers
                )
    for name, secs in best.items():
        figures = _figures(name, rows, secs, None)
        if name in least_cpu:
            figures.cpu_seconds = round(least_cpu[name], 2)
            figures.worker_cpu_seconds = round(least_worker_cpu[name], 2)
        out.append(figures)
    df.unpersist()
    tiny.unpersist()
    return out


def _drop_shard(opts: dict[str, str], name: str) -> None:
    """Drop shard ``name``: its Blob files and Consensus rows."""
    from pyspark_persist.state import PersistClient
    from pyspark_persist.state.drop import drop_shard

    client = PersistClient.open(opts["blob"], opts["consensus"])
    try:
        drop_shard(client.consensus, client.blob, name, now_ms=time.time_ns() // 1_000_000)
    finally:
        client.close()


def _stop_between_batches(query: Any, wait_s: float = 5.0) -> None:
    """Stop a query once its current micro-batch is done (interrupting a ``foreachBatch``
    callback mid-call makes Spark print a long stack trace), or after ``wait_s``."""
    deadline = time.monotonic() + wait_s
    while query.status.get("isTriggerActive") and time.monotonic() < deadline:
        time.sleep(0.005)
    query.stop()


def _phases(query: Any) -> dict[str, float]:
    """Median ms of each micro-batch phase over the query's recent progress (first 3 skipped)."""
    spans: dict[str, list[float]] = {}
    for progress in query.recentProgress[3:]:
        for phase, ms in progress.durationMs.items():
            spans.setdefault(phase, []).append(ms)
    return {phase: statistics.median(v) for phase, v in sorted(spans.items())}


def _latency(
    spark: Any,
    kind: str,
    rate: int,
    seconds: float,
    warmup: float,
    opts: dict[str, str],
    workdir: str,
) -> LatencyFigures:
    """Run rate -> {persist|parquet} sink -> same-format source -> foreachBatch; latencies.

    ``kind == "floor"`` runs the rate source straight into ``foreachBatch``.
    """
    from pyspark.sql import functions as F

    tag = f"{kind}-{uuid.uuid4().hex[:8]}"
    events = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rate)
        .load()
        .select(F.col("value"), F.unix_micros(F.col("timestamp")).alias("created_us"))
    )
    base = os.path.join(workdir, tag)
    samples: list[tuple[float, float]] = []  # (seen at, latency ms)
    lock = threading.Lock()

    def record(batch: Any, _batch_id: int) -> None:
        now_us = time.time_ns() // 1000
        created = [r.created_us for r in batch.select("created_us").collect()]
        with lock:
            samples.extend((now_us / 1e6, (now_us - c) / 1000.0) for c in created)

    sink: Any = None
    if kind == "floor":
        source = events
    elif kind == "persist":
        sink = (
            events.writeStream.format("persist")
            .options(**opts)
            .option("checkpointLocation", f"{base}/sink-ckpt")
            .start(tag)
        )
        while sink.lastProgress is None:  # the shard exists after the first commit
            time.sleep(0.05)
        source = spark.readStream.format("persist").options(**opts).load(tag)
    else:
        data = f"{base}/data"
        sink = (
            events.writeStream.format("parquet")
            .option("path", data)
            .option("checkpointLocation", f"{base}/sink-ckpt")
            .start()
        )
        source = spark.readStream.schema(events.schema).parquet(data)
    reader = (
        source.select("created_us")
        .writeStream.foreachBatch(record)
        .option("checkpointLocation", f"{base}/read-ckpt")
        .start()
    )
    queries = {"reader": reader} if sink is None else {"sink": sink, "reader": reader}
    started = time.time()
    try:
        while time.time() - started < seconds:
            for q in queries.values():
                if q.exception() is not None:
                    raise RuntimeError(f"{kind} pipeline failed: {q.exception()}")
            time.sleep(0.25)
        phases = {name: _phases(q) for name, q in queries.items()}
    finally:
        for q in queries.values():
            _stop_between_batches(q)
    with lock:
        kept = sorted(ms for at, ms in samples if at - started >= warmup)
    if not kept:
        raise RuntimeError(f"{kind} pipeline: no rows became visible after the warm-up")
    return LatencyFigures(
        pipeline="rate -> foreachBatch (floor)"
        if kind == "floor"
        else f"rate -> {kind} sink -> {kind} source",
        samples=len(kept),
        p50_ms=round(statistics.median(kept), 1),
        p95_ms=round(kept[min(len(kept) - 1, int(0.95 * len(kept)))], 1),
        max_ms=round(kept[-1], 1),
        phases_ms=phases,
    )


def run(options: SparkWriteOptions) -> Report:
    """Run the benchmark with ``options``."""
    size, lat_s, warmup = options.size_mib, options.latency_seconds, options.warmup_seconds
    workdir = options.workdir or tempfile.mkdtemp(prefix="persist-bench-spark-")
    os.makedirs(workdir, exist_ok=True)
    opts = {
        "blob": f"file://{os.path.abspath(workdir)}/blob",
        "consensus": f"sqlite:///{os.path.abspath(workdir)}/consensus.db",
    }
    spark = _session(options.master, options.arrow_batch_rows, options.lift_arrow_byte_cap)
    parts = options.partitions or spark.sparkContext.defaultParallelism
    report = Report(
        size_mib=size,
        partitions=parts,
        master=options.master,
        arrow_batch_rows=options.arrow_batch_rows,
        arrow_byte_cap_lifted=options.lift_arrow_byte_cap,
    )
    try:
        if not options.skip_throughput:
            step(f"spark-write: caching {size:.0f} MiB of rows, then writing it per writer")
            report.write = _throughput(spark, size, options.partitions, opts, workdir)
            by = {w.writer: w for w in report.write}
            for mode, peer in PEERS.items():
                report.mode_ratios[mode] = round(by[mode].rows_per_s / by[peer].rows_per_s, 3)
            report.write_ratio = min(report.mode_ratios.values())
            report.ceiling_write_ratio = round(
                by["discard"].rows_per_s / by["parquet"].rows_per_s, 3
            )
            report.ceiling_stream_ratio = round(
                by["discard stream"].rows_per_s / by["parquet stream"].rows_per_s, 3
            )
            report.targets["write_throughput_vs_parquet"] = report.write_ratio >= THROUGHPUT_TARGET
            report.own_cpu = _own_cpu(by)
        if not options.skip_throughput and not options.skip_first_write:
            for writer in FIRST_WRITERS:
                step(f"spark-write: {writer}, the first write of a new session, then the next")
                report.first_write += _run_first_write_probe(writer, workdir, options)
            report.first_write_ratio = round(
                report.figures("persist append first").rows_per_s
                / report.figures("discard first").rows_per_s,
                3,
            )
        if not options.skip_latency:
            for kind in ("persist", "parquet", "floor"):
                step(f"spark-write: latency, the {kind} pipeline ({lat_s:.0f} s)")
                report.latency.append(
                    _latency(spark, kind, options.rows_per_second, lat_s, warmup, opts, workdir)
                )
            persist, files, floor = report.latency
            report.latency_ratio = round(persist.p50_ms / files.p50_ms, 3)
            report.floor_latency_ratio = round(floor.p50_ms / files.p50_ms, 3)
            report.targets["latency_p50_vs_file_pipeline"] = report.latency_ratio <= LATENCY_TARGET
        if options.quick:
            report.notes.append("quick run: sizes too small for the targets to mean much")
    finally:
        spark.stop()
        if options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def _own_cpu(by: dict[str, WriteFigures]) -> dict[str, tuple[float, float]]:
    """Each persist mode's :func:`own_cpu` beside the discarding sink of the same kind (batch
    or streaming)."""
    out: dict[str, tuple[float, float]] = {}
    for mode in PEERS:
        ceiling = by["discard stream" if "stream" in mode else "discard"]
        mine = by[mode]
        own = own_cpu(mine.worker_cpu_seconds, ceiling.worker_cpu_seconds, mine.cpu_seconds)
        if own is not None:
            out[mode] = own
    return out


def _over_discard(report: Report) -> float:
    """The warmed rounds' persist append rows/s over the discarding sink's."""
    return report.figures("persist append").rows_per_s / report.figures("discard").rows_per_s


def _write_table(writes: list[WriteFigures], width: int) -> list[str]:
    """A header and a row per writer (names padded to ``width``): rows, seconds, rate, CPU."""
    lines = [
        f"  {'writer':<{width}}{'rows':>10}{'seconds':>9}{'rows/s':>12}{'MiB/s':>8}{'CPU s':>8}"
        f"{'workers':>9}"
    ]
    for w in writes:
        cpu = "" if w.cpu_seconds is None else f"{w.cpu_seconds:>8.2f}"
        if w.worker_cpu_seconds is not None:
            cpu += f"{w.worker_cpu_seconds:>9.2f}"
        lines.append(
            f"  {w.writer:<{width}}{w.rows:>10}{w.seconds:>9.2f}"
            f"{w.rows_per_s:>12,.0f}{w.mib_per_s:>8.1f}{cpu}"
        )
    return lines


def render(report: Report) -> str:
    """The report as a human-readable table."""
    batches = (
        "Spark's default Arrow batches"
        if report.arrow_batch_rows is None
        else f"{report.arrow_batch_rows:,}-row Arrow batches"
    )
    if report.arrow_byte_cap_lifted:
        batches += " not measured row by row"
    lines = [
        f"persist bench spark-write ({report.master}, {report.partitions} partitions, "
        f"{batches} into Python sinks)"
    ]
    if report.write:
        lines.append(f"\nWrite throughput, {report.size_mib:g} MiB cached DataFrame:")
        lines += _write_table(report.write, 19)
        for mode, ratio in report.mode_ratios.items():
            ok = ratio >= THROUGHPUT_TARGET
            lines.append(
                f"  {mode} / {PEERS[mode]} = {ratio_text(ratio, THROUGHPUT_TARGET)} "
                f"(target >= {THROUGHPUT_TARGET}x: {'met' if ok else 'NOT met'})"
            )
        lines.append(
            f"  discard/parquet = {report.ceiling_write_ratio:.2f}x (the most any "
            "Python sink reaches here)"
        )
        lines.append(
            f"  discard stream/parquet stream = {report.ceiling_stream_ratio:.2f}x (the most "
            "any Python streaming sink reaches here)"
        )
        if report.own_cpu:
            lines.append(
                "  persist's own code (its Python workers' CPU beyond the discarding sink's): "
                + ", ".join(
                    f"{mode.removeprefix('persist ')} {sec:.2f} s = {100 * share:.1f}%"
                    for mode, (sec, share) in report.own_cpu.items()
                )
                + " of its write's CPU"
            )
    if report.first_write:
        lines.append(
            "\nA user's first write (a new session: Python workers start, persist creates "
            "the shard), then the next:"
        )
        lines += _write_table(report.first_write, 21)
        if report.first_write_ratio is not None:
            lines.append(
                f"  persist append first / discard first = {report.first_write_ratio:.2f}x "
                "(steady state above: persist append / discard = "
                f"{_over_discard(report):.2f}x)"
            )
    if report.latency:
        lines.append("\nWrite-to-visible latency (ms):")
        lines.append(f"  {'pipeline':<42}{'samples':>8}{'p50':>9}{'p95':>9}{'max':>9}")
        for lat in report.latency:
            lines.append(
                f"  {lat.pipeline:<42}{lat.samples:>8}{lat.p50_ms:>9.0f}"
                f"{lat.p95_ms:>9.0f}{lat.max_ms:>9.0f}"
            )
        ok = report.targets["latency_p50_vs_file_pipeline"]
        lines.append(
            f"  persist/file p50 = {ratio_text(report.latency_ratio, LATENCY_TARGET)} "
            f"(target <= {LATENCY_TARGET}x: {'met' if ok else 'NOT met'})"
        )
        lines.append(
            f"  floor/file p50 = {report.floor_latency_ratio:.2f}x (no pipeline that "
            "starts at the rate source is faster)"
        )
        lines.append("  median ms per micro-batch phase:")
        for lat in report.latency:
            for query, phases in lat.phases_ms.items():
                shown = ", ".join(f"{k} {v:.0f}" for k, v in phases.items() if v)
                lines.append(f"    {lat.pipeline.split()[2]:<14}{query:<8}{shown}")
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


BENCHMARK = Benchmark("spark-write", SparkWriteOptions, run, render, __doc__)
"""``persist bench spark-write``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
