"""The Spark freshness benchmark: how soon a row written by one streaming query is seen by another.

Run it as ``persist bench spark-freshness`` (or ``python -m
pyspark_persist.tools.bench.spark_freshness``; ``--quick`` for a smoke run,
``--json`` for machine-readable output). In one Spark session it runs, one
after the other and for the same time, two-query pipelines:

- **persist**: ``rate`` -> persist sink (query 1); persist source -> ``memory``
  sink (query 2);
- **file**: ``rate`` -> Spark's Parquet file sink; file source -> ``memory``;
- **floor**: ``rate`` -> a Python streaming sink that discards its rows,
  beside a Python streaming source that reads nothing -> ``memory``
  (``ceiling.py``; one new row a second, the cadence the other readers see
  their writers commit at): what the micro-batches of Spark's Python Data Source API
  cost with no storage at all, phase by phase. (A Python sink's
  ``commitOffsets`` costs Spark about three times the file sink's, with nothing
  in it from the sink: measured beside persist's, not charged to it.)

Each row is stamped with the writer's micro-batch start (``current_timestamp()``
in query 1 is that micro-batch's time) and, when it shows up in query 2, with
the reader's micro-batch start; the freshness of a row is the difference.
Only rows written after both queries have run ``--steady-seconds`` (10) count
(steady state). Printed: p50 and p95 of each pipeline, persist's ratios to the
file pipeline (targets: p50 <= 0.7x, p95 <= 0.8x), the floor of any Python
sink's freshness (how long the discarding sink's micro-batch runs before it
could commit a row, beside the file pipeline's p50), and the median of each
micro-batch phase Spark reports (``durationMs``) for each query over the same
steady window: persist's beside the file pipeline's and the floor's.

Then each reader again, **alone**: its writer is a Python process outside
Spark that appends ``--rows-per-second`` rows once a second (the rate source's
cadence), stamped at the append, to a persist shard (persist's own writer,
PubSub as the pipeline's) or as a Parquet file renamed into the file source's
directory; the floor's source runs with no sink query at all. In the
pipelines persist's source starts its micro-batch the moment the sink
commits, so its ``walCommit`` and ``addBatch`` run on the same two cores as
the sink query's ``commitOffsets`` and next micro-batch, which a file source
(listing every 50 ms or so) and the floor's source mostly miss. Alone, each
reader's phases are its own cost: what persist's source adds to Spark's
fixed cost is read there, beside the floor's.
"""

from __future__ import annotations

import json
import os
import pkgutil
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag

P50_TARGET = 0.7
P95_TARGET = 0.8
PHASES = ("addBatch", "latestOffset", "walCommit", "commitOffsets", "queryPlanning")
"""The micro-batch phases shown (Spark's ``durationMs`` keys)."""
KINDS = ("persist", "file", "floor")
SINK_BEFORE_COMMIT = ("walCommit", "queryPlanning", "addBatch")
"""The phases of a sink's micro-batch that pass before its rows can be committed (the rows are
stamped at the micro-batch's start, and a sink commits at the end of ``addBatch``)."""
MIN_STEADY_BATCHES = 3
STRETCH = 6


@dataclass(frozen=True)
class FreshnessOptions(Options):
    """What to run."""

    seconds: float = flag(40.0, "run time of each pipeline", quick=14.0, positive=True)
    steady_seconds: float = flag(
        10.0, "rows written before both queries ran this long are dropped", quick=4.0
    )
    rows_per_second: int = flag(50, "rate of the writers' source", positive=True)
    pubsub: str = flag(
        "auto",
        "the persist pipeline's pubsub option: how its source hears of the sink's "
        "commits (off to poll Consensus)",
    )
    master: str = flag("local[2]", "Spark master")
    workdir: str | None = flag(None, "keep the stores here (default: a temporary directory)")


@dataclass
class Pipeline:
    """One pipeline's steady-state freshness (ms) and per-query phase medians (ms)."""

    kind: str
    samples: int
    p50_ms: float
    p95_ms: float
    max_ms: float
    phases_ms: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{"sink": {phase: median}, "reader": {...}}``."""
    waits: dict[str, float] = field(default_factory=dict)
    """persist's source only, from its ``metricsFile``: of the steady micro-batches
    (``batches``), how many ``latestOffset`` found after waiting for a PubSub commit notice
    (``waited``), and the median wait of those (``waited_ms_p50``)."""


@dataclass
class Report(Result):
    """Everything one run measured."""

    seconds: float
    steady_seconds: float
    rows_per_second: int
    pubsub: str
    pipelines: list[Pipeline] = field(default_factory=list)
    p50_ratio: float = 0.0
    p95_ratio: float = 0.0
    targets: dict[str, bool] = field(default_factory=dict)
    sink_floor_ms: float = 0.0
    """The discarding Python sink's ``walCommit`` + ``queryPlanning`` + ``addBatch`` medians:
    how long any Python sink's micro-batch runs before it could commit a row, so the least
    freshness a Python sink can give (``sink_floor_ratio``: over the file pipeline's p50)."""
    sink_floor_ratio: float = 0.0
    alone: list[Pipeline] = field(default_factory=list)
    """Each reader with its writer outside Spark (see the module doc): freshness from the
    append, and the ``reader`` phases."""

    def pipeline(self, kind: str) -> Pipeline:
        """The two-query pipeline ``kind`` (one of KINDS)."""
        found = next((p for p in self.pipelines if p.kind == kind), None)
        if found is None:
            raise KeyError(f"no pipeline {kind!r}: the run has {[p.kind for p in self.pipelines]}")
        return found


def _session(master: str) -> Any:
    from pyspark.sql import SparkSession

    # Spark's Python workers run this interpreter, so they import this pyspark_persist
    # (by default they run the first python3 on PATH, which may hold another copy).
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    spark = (
        SparkSession.builder.master(master)
        .appName("persist-bench-spark-freshness")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _register(spark: Any) -> None:
    if not any(m.name == "pyspark_persist" for m in pkgutil.iter_modules()):
        from pyspark_persist import DefaultSource  # an editable install: not auto-discovered

        spark.dataSource.register(DefaultSource)
    from pyspark_persist.tools.bench.ceiling import DiscardSink, NoIOStreamSource

    spark.dataSource.register(NoIOStreamSource)
    spark.dataSource.register(DiscardSink)


def _progress_at(progress: Any) -> float:
    """The wall-clock second a micro-batch started (its progress ``timestamp``)."""
    return datetime.fromisoformat(progress.timestamp.replace("Z", "+00:00")).timestamp()


def _phases(query: Any, since: float) -> dict[str, float]:
    """Median ms of each phase over the micro-batches that started at or after ``since``."""
    spans: dict[str, list[float]] = {}
    for progress in query.recentProgress:
        if _progress_at(progress) >= since:
            for phase, ms in progress.durationMs.items():
                spans.setdefault(phase, []).append(ms)
    return {phase: statistics.median(v) for phase, v in sorted(spans.items())}


def _stop(query: Any, wait_s: float = 5.0) -> None:
    """Stop a query between micro-batches when it can (an interrupted batch logs noise)."""
    deadline = time.monotonic() + wait_s
    while query.status.get("isTriggerActive") and time.monotonic() < deadline:
        time.sleep(0.005)
    query.stop()


def run_pipeline(
    spark: Any, kind: str, seconds: float, steady: float, rate: int, workdir: str, pubsub: str
) -> Pipeline:
    """Run one pipeline (see the module doc) and measure it."""
    from pyspark.sql import functions as F

    tag = f"{kind}_{uuid.uuid4().hex[:8]}"
    base = os.path.join(workdir, tag)
    opts = _store_options(workdir, pubsub)
    events = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rate)
        .load()
        .select(F.col("value"), F.unix_micros(F.current_timestamp()).alias("stamp_us"))
    )
    writer = events.writeStream.option("checkpointLocation", f"{base}/sink-ckpt").trigger(
        processingTime="0 seconds"
    )
    if kind == "persist":
        sink = writer.format("persist").options(**opts).start(tag)
        while sink.lastProgress is None and sink.exception() is None:
            time.sleep(0.05)  # the shard exists after the first commit
        source = (
            spark.readStream.format("persist")
            .options(**opts)
            .option("metricsFile", f"{base}/source-metrics.jsonl")
            .load(tag)
        )
    elif kind == "file":
        sink = writer.format("parquet").option("path", f"{base}/data").start()
        source = spark.readStream.schema(events.schema).parquet(f"{base}/data")
    else:
        from pyspark_persist.tools.bench.ceiling import DISCARD

        sink = writer.format(DISCARD).start()
        source = _floor_source(spark)
    queries = {"sink": sink, "reader": _start_reader(source, base, tag)}
    phases, steady_from = _run_steady(queries, f"{kind} pipeline", seconds, steady)
    waits = _waits(f"{base}/source-metrics.jsonl", steady_from) if kind == "persist" else {}
    return _measured(spark, kind, tag, steady_from, phases, waits)


def _floor_source(spark: Any) -> Any:
    """The floor's reader input: the no-I/O source, a new row a second, stamped 0."""
    from pyspark.sql import functions as F

    from pyspark_persist.tools.bench.ceiling import NO_IO_STREAM

    source = spark.readStream.format(NO_IO_STREAM).option("everySeconds", 1).load()
    return source.withColumn("stamp_us", F.lit(0))


def _start_reader(source: Any, base: str, tag: str) -> Any:
    """The reader query: ``source``'s stamps beside its micro-batch start, into the memory
    table ``tag``."""
    from pyspark.sql import functions as F

    return (
        source.select(F.col("stamp_us"), F.unix_micros(F.current_timestamp()).alias("seen_us"))
        .writeStream.option("checkpointLocation", f"{base}/read-ckpt")
        .format("memory")
        .queryName(tag)
        .start()
    )


def _run_steady(
    queries: dict[str, Any], what: str, seconds: float, steady: float
) -> tuple[dict[str, dict[str, float]], float]:
    """Let ``queries`` run ``seconds``, stop them, and return each one's phase medians over
    the micro-batches from ``steady`` seconds in, and when that steady window began.

    A loaded machine is slow: the run is stretched, up to STRETCH times, until every query
    ran MIN_STEADY_BATCHES steady micro-batches, rather than reported empty.
    """
    started = time.time()
    steady_from = started + steady

    def enough() -> bool:
        return all(
            sum(_progress_at(p) >= steady_from for p in q.recentProgress) >= MIN_STEADY_BATCHES
            for q in queries.values()
        )

    try:
        while time.time() - started < seconds or (
            not enough() and time.time() - started < STRETCH * seconds
        ):
            for q in queries.values():
                if q.exception() is not None:
                    raise RuntimeError(f"{what} failed: {q.exception()}")
            time.sleep(0.25)
        return {name: _phases(q, steady_from) for name, q in queries.items()}, steady_from
    finally:
        for q in queries.values():
            _stop(q)


def _measured(
    spark: Any,
    kind: str,
    view: str,
    since: float,
    phases: dict[str, dict[str, float]],
    waits: dict[str, float],
) -> Pipeline:
    """A pipeline's figures from the rows its reader put in the memory table ``view`` (then
    dropped): those stamped at or after ``since``. The floor's rows carry no stamp, so only
    its phases count."""
    if kind == "floor":
        spark.catalog.dropTempView(view)
        return Pipeline(kind, 0, 0.0, 0.0, 0.0, phases)
    rows = spark.sql(
        f"SELECT (seen_us - stamp_us) / 1000.0 AS ms FROM {view} "
        f"WHERE stamp_us >= {int(since * 1e6)} ORDER BY ms"
    ).collect()
    spark.catalog.dropTempView(view)
    kept = [float(r.ms) for r in rows]  # Spark's quotient is a decimal
    if not kept:
        raise RuntimeError(f"{kind} ({view}): no row written in steady state was seen")
    return Pipeline(
        kind,
        len(kept),
        round(statistics.median(kept), 1),
        round(kept[min(len(kept) - 1, int(0.95 * len(kept)))], 1),
        round(kept[-1], 1),
        phases,
        waits,
    )


ALONE_SHARD = "alone"
"""The shard a persist reader reads alone (see :func:`write_outside_spark`)."""
READY = ".writer-ready"
"""The file :func:`write_outside_spark` creates in its location once its first rows are in."""


def _store_options(location: str, pubsub: str) -> dict[str, str]:
    """Where a persist pipeline's stores are, under ``location``."""
    return {
        "blob": f"file://{os.path.abspath(location)}/blob",
        "consensus": f"sqlite:///{os.path.abspath(location)}/consensus.db",
        "pubsub": pubsub,
    }


def write_outside_spark(
    kind: str, location: str, seconds: float, rows_per_second: int, pubsub: str = "auto"
) -> int:
    """Append ``rows_per_second`` rows once a second for ``seconds``, each stamped with its
    append's start (``stamp_us``), to the persist shard ``ALONE_SHARD`` under ``location``
    (``kind`` "persist") or as a Parquet file renamed into the directory ``location``
    ("file"); create ``READY`` there after the first. The rows written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema([pa.field("value", pa.int64()), pa.field("stamp_us", pa.int64())])
    append: Any
    if kind == "persist":
        from pyspark_persist.options import PersistOptions
        from pyspark_persist.source import client_for

        opts = PersistOptions.parse(
            {"shard": ALONE_SHARD, **_store_options(location, pubsub)}, "write"
        )
        append = client_for(opts).open_shard(ALONE_SHARD, schema, create=True).writer().append
    elif kind == "file":

        def append(table: pa.Table) -> None:
            name = f"part-{written:012d}.parquet"
            pq.write_table(table, os.path.join(location, f".{name}.tmp"))
            os.rename(os.path.join(location, f".{name}.tmp"), os.path.join(location, name))

    else:
        raise ValueError(f"no writer outside Spark for {kind!r}: persist or file")
    written = 0
    end = time.time() + seconds
    while True:
        started = time.time()
        stamp = int(started * 1e6)
        values = list(range(written, written + rows_per_second))
        append(pa.table({"value": values, "stamp_us": [stamp] * rows_per_second}, schema=schema))
        if not written:
            open(os.path.join(location, READY), "w").close()
        written += rows_per_second
        if started + 1.0 >= end:
            return written
        time.sleep(max(0.0, started + 1.0 - time.time()))


def run_alone(
    spark: Any, kind: str, seconds: float, steady: float, rate: int, workdir: str, pubsub: str
) -> Pipeline:
    """One reader alone (see the module doc), its writer a child process; measured as the
    pipelines are, from the append's stamp to the reader's micro-batch start."""
    import subprocess

    tag = f"alone_{kind}_{uuid.uuid4().hex[:8]}"
    base = os.path.join(workdir, tag)
    location = base if kind == "persist" else os.path.join(base, "data")
    os.makedirs(location)
    writer = None
    if kind in ("persist", "file"):
        call = (
            "from pyspark_persist.tools.bench.spark_freshness import write_outside_spark; "
            f"write_outside_spark({kind!r}, {location!r}, {seconds + steady:g}, {rate}, "
            f"{pubsub!r})"
        )
        errors = os.path.join(base, "writer.err")
        with open(errors, "wb") as err:  # the child writes to its own copy of the descriptor
            writer = subprocess.Popen([sys.executable, "-c", call], stderr=err)
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(location, READY)):
            if writer.poll() is not None or time.monotonic() > deadline:
                writer.kill()
                writer.wait()
                with open(errors, "rb") as err:
                    tail = err.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"{kind} writer outside Spark did not start: {tail}")
            time.sleep(0.05)
    try:
        if kind == "persist":
            source = spark.readStream.format("persist").options(**_store_options(base, pubsub))
            source = source.load(ALONE_SHARD)
        elif kind == "file":
            source = spark.readStream.schema("value long, stamp_us long").parquet(location)
        else:
            source = _floor_source(spark)
        what = f"{kind} reader alone"
        phases, steady_from = _run_steady(
            {"reader": _start_reader(source, base, tag)}, what, seconds, steady
        )
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
    return _measured(spark, kind, tag, steady_from, phases, {})


def _waits(metrics_file: str, since: float) -> dict[str, float]:
    """How persist's source waited in latestOffset (see ``Pipeline.waits``) in the micro-batches
    ending after ``since`` (their end offsets are times in ms: the sink writes wall-clock ms)."""
    try:
        with open(metrics_file, encoding="utf-8") as f:
            lines = [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return {}
    steady = [x for x in lines if x["end"]["upper"] >= since * 1000]
    waited = [x["waited_ms"] for x in steady if x.get("waited_ms", 0) > 0]
    return {
        "batches": len(steady),
        "waited": len(waited),
        "waited_ms_p50": round(statistics.median(waited), 1) if waited else 0.0,
    }


def run(options: FreshnessOptions, spark: Any = None) -> Report:
    """Run every pipeline as ``options`` says; in ``spark`` if given (then left running)."""
    seconds, steady = options.seconds, options.steady_seconds
    workdir = options.workdir or tempfile.mkdtemp(prefix="persist-bench-freshness-")
    os.makedirs(workdir, exist_ok=True)
    own = spark is None
    session = _session(options.master) if own else spark
    _register(session)
    report = Report(seconds, steady, options.rows_per_second, options.pubsub)
    try:
        for kind in KINDS:
            step(f"spark-freshness: the {kind} pipeline, two queries ({seconds:.0f} s)")
            report.pipelines.append(
                run_pipeline(
                    session, kind, seconds, steady, options.rows_per_second, workdir, options.pubsub
                )
            )
        for kind in KINDS:
            step(f"spark-freshness: the {kind} reader alone ({seconds:.0f} s)")
            report.alone.append(
                run_alone(
                    session, kind, seconds, steady, options.rows_per_second, workdir, options.pubsub
                )
            )
    finally:
        if own:
            session.stop()
        if options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    persist, files = report.pipelines[0], report.pipelines[1]
    report.p50_ratio = round(persist.p50_ms / files.p50_ms, 3)
    report.p95_ratio = round(persist.p95_ms / files.p95_ms, 3)
    floor_sink = report.pipelines[2].phases_ms.get("sink", {})
    report.sink_floor_ms = sum(floor_sink.get(p, 0.0) for p in SINK_BEFORE_COMMIT)
    report.sink_floor_ratio = round(report.sink_floor_ms / files.p50_ms, 3)
    report.targets["p50"] = report.p50_ratio <= P50_TARGET
    report.targets["p95"] = report.p95_ratio <= P95_TARGET
    for query in ("sink", "reader"):
        for phase in PHASES:
            mine = persist.phases_ms.get(query, {}).get(phase)
            theirs = files.phases_ms.get(query, {}).get(phase)
            if mine is not None and theirs is not None and phase != "queryPlanning":
                report.targets[f"{query} {phase}"] = mine <= theirs
    return report


def render(report: Report) -> str:
    """The report as tables for people."""
    by = {p.kind: p for p in report.pipelines}
    lines = [
        f"persist bench spark-freshness: {report.rows_per_second} rows/s, "
        f"{report.seconds:g} s per pipeline, steady state after {report.steady_seconds:g} s, "
        f"persist pubsub={report.pubsub}",
        "",
        "Freshness (writer's micro-batch start -> reader's), ms:",
        f"  {'pipeline':<40}{'samples':>8}{'p50':>8}{'p95':>8}{'max':>8}",
    ]
    names = {
        "persist": "rate -> persist sink -> persist source",
        "file": "rate -> file sink -> file source",
    }
    for kind, name in names.items():
        p = by[kind]
        lines.append(f"  {name:<40}{p.samples:>8}{p.p50_ms:>8.0f}{p.p95_ms:>8.0f}{p.max_ms:>8.0f}")

    def verdict(key: str) -> str:
        return "met" if report.targets[key] else "NOT met"

    lines.append(
        f"  persist/file: p50 {ratio_text(report.p50_ratio, P50_TARGET)} (target <= "
        f"{P50_TARGET}x: {verdict('p50')}), p95 {ratio_text(report.p95_ratio, P95_TARGET)} "
        f"(target <= {P95_TARGET}x: "
        f"{verdict('p95')})"
    )
    lines.append(
        f"  the floor of any Python sink: the discarding sink's "
        f"{' + '.join(SINK_BEFORE_COMMIT)} = {report.sink_floor_ms:.0f} ms before it could "
        f"commit a row, {report.sink_floor_ratio:.2f}x the file pipeline's p50"
    )
    lines.append("")
    lines.append("Median ms per micro-batch phase (steady state):")
    lines.append(f"  {'query':<8}{'phase':<15}{'persist':>9}{'file':>9}{'floor':>9}  persist<=file")
    for query in ("sink", "reader"):
        for phase in PHASES:
            cells = [by[k].phases_ms.get(query, {}).get(phase) for k in KINDS]
            if all(c is None for c in cells):
                continue
            shown = "".join(f"{'-' if c is None else f'{c:.0f}':>9}" for c in cells)
            key = f"{query} {phase}"
            mark = "" if key not in report.targets else ("yes" if report.targets[key] else "NO")
            lines.append(f"  {query:<8}{phase:<15}{shown}  {mark}")
    lines.append(
        "  (floor: rate -> a Python streaming sink that discards, as the sink; a no-I/O "
        "Python source -> memory, as the reader)"
    )
    waits = by["persist"].waits
    if waits:
        lines.append(
            f"  persist reader latestOffset: {waits['waited']:.0f} of {waits['batches']:.0f} "
            "micro-batches found their commit by waiting for its PubSub notice (waited_ms "
            f"median {waits['waited_ms_p50']:.1f})"
        )
    if report.alone:
        alone = {p.kind: p for p in report.alone}
        lines += [
            "",
            f"Each reader alone: its writer a Python process outside Spark, "
            f"{report.rows_per_second} rows once a second; no sink query on the cores. "
            "Median ms:",
            f"  {'reader phase':<23}{'persist':>9}{'file':>9}{'floor':>9}",
        ]
        for phase in PHASES:
            cells = [alone[k].phases_ms.get("reader", {}).get(phase) for k in KINDS]
            shown = "".join(f"{'-' if c is None else f'{c:.0f}':>9}" for c in cells)
            lines.append(f"  {phase:<23}{shown}")
        fresh = "".join(
            f"{f'{alone[k].p50_ms:.0f}/{alone[k].p95_ms:.0f}' if alone[k].samples else '-':>9}"
            for k in KINDS
        )
        lines.append(f"  {'append -> seen p50/p95':<23}{fresh}")
    return "\n".join(lines)


BENCHMARK = Benchmark("spark-freshness", FreshnessOptions, run, render, __doc__)
"""``persist bench spark-freshness``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
