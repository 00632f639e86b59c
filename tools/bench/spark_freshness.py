"""The Spark freshness benchmark: how soon a row written by one streaming query is seen by another.

Run it as ``persist bench spark-freshness`` (or ``python -m
pyspark_persist.tools.bench.spark_freshness``; ``--quick`` for a smoke run,
``--json`` for machine-readable output). In one Spark session it runs, one
after the other and for the same time, two-query pipelines:

- **persist**: ``rate`` -> persist sink (query 1); persist source -> ``memory``
  sink (query 2);
- **upsert**: the same, the sink writing a keyed shard (``upsertKeys`` ``id``):
  every micro-batch an upsert, whose commit looks up the current rows of its
  keys before it retracts them (issue 35: its sink's ``addBatch`` within
  ``UPSERT_ADD_BATCH_TARGET`` of persist's appending one, its freshness within
  ``UPSERT_FRESHNESS_TARGET`` of theirs);
- **file**: ``rate`` -> Spark's Parquet file sink; file source -> ``memory``;
- **floor**: ``rate`` -> a Python streaming sink that discards its rows,
  beside a Python streaming source that reads nothing -> ``memory``
  (``ceiling.py``; one new row a second, the cadence the other readers see
  their writers commit at): what the micro-batches of Spark's Python Data Source API
  cost with no storage at all, phase by phase. (A Python sink's
  ``commitOffsets`` costs Spark about three times the file sink's, with nothing
  in it from the sink: measured beside persist's, not charged to it.)

Every pipeline writes the same rows: the rate source's ``value``, ``id = value %
KEY_SPACE`` (the upsert's key) and the stamp. At the rate source's
``--rows-per-second`` the keys repeat only after ``KEY_SPACE`` rows (2000 s
at 50 rows/s), so a default upsert run inserts new keys into a shard that
fills as it goes (the live keys at the steady window's start and end are
printed); ``--upsert-prefill N`` upserts keys ``0..N-1`` into the shard first,
so that (with N = KEY_SPACE) every write replaces a live row. ``--pipelines``
picks which pipelines run, in which order (each ratio needs both of its
pipelines). Before them an unmeasured persist pipeline runs for
``--warmup-seconds`` (15): without it the first measured pipeline pays for
warming Spark's JVM and Python workers up, and looked up to 1.3x slower than
the same pipeline run second (the upsert pipeline ran before and after the
append one, see docs/benchmarks.md).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, csv, flag

P50_TARGET = 0.7
P95_TARGET = 0.8
PHASES = ("addBatch", "latestOffset", "walCommit", "commitOffsets", "queryPlanning")
"""The micro-batch phases shown (Spark's ``durationMs`` keys)."""
UPSERT_ADD_BATCH_TARGET = 1.5
"""The upsert sink's ``addBatch`` median over persist's appending sink's, at most."""
UPSERT_FRESHNESS_TARGET = 1.2
"""The upsert pipeline's freshness (p50 and p95) over persist's append pipeline's, at most."""
KEY_SPACE = 100_000
"""The upsert pipeline's keys: ``id = value % KEY_SPACE``."""
KINDS = ("persist", "upsert", "file", "floor")
"""Every two-query pipeline, in the order they run (the upsert beside the append it is
compared with)."""
ALONE = ("persist", "file", "floor")
"""The readers run alone (the upsert pipeline's reader is persist's source)."""
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
    warmup_seconds: float = flag(
        15.0,
        "run time of an unmeasured persist pipeline before the measured ones (0: none)",
        quick=5.0,
    )
    pubsub: str = flag(
        "auto",
        "the persist pipeline's pubsub option: how its source hears of the sink's "
        "commits (off to poll Consensus)",
    )
    pipelines: tuple[str, ...] = flag(
        KINDS, "comma list of the pipelines to run, in that order", parse=csv, choices=KINDS
    )
    upsert_prefill: int = flag(
        0,
        f"keys 0..N-1 upserted into the upsert pipeline's shard before it starts ({KEY_SPACE}: "
        "every write replaces a live row)",
    )
    master: str = flag("local[2]", "Spark master")
    workdir: str | None = flag(None, "keep the stores here (default: a temporary directory)")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pipelines:
            raise ValueError(f"--pipelines is empty: name some of {', '.join(KINDS)}")
        if self.warmup_seconds < 0:
            raise ValueError("--warmup-seconds must be 0 (no warm-up) or more")
        if not 0 <= self.upsert_prefill <= KEY_SPACE:
            raise ValueError(
                f"--upsert-prefill {self.upsert_prefill} is outside the key space: give 0 to "
                f"{KEY_SPACE} (the keys are value % {KEY_SPACE})"
            )


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
    commit_ms: float = 0.0
    """persist's sinks only: the median time their driver commit took (``commit_s`` in the
    sink's metrics), the part of the sink's ``addBatch`` that is persist's own commit."""
    live_keys: tuple[int, int] = (0, 0)
    """The upsert pipeline only: the rows (one per key) its shard held as the steady window
    began and at the end."""


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
    upsert_prefill: int = 0
    upsert_add_batch_ratio: float = 0.0
    """The upsert sink's ``addBatch`` median over persist's appending sink's."""
    upsert_p50_ratio: float = 0.0
    upsert_p95_ratio: float = 0.0
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
    spark: Any,
    kind: str,
    seconds: float,
    steady: float,
    rate: int,
    workdir: str,
    pubsub: str,
    prefill: int = 0,
) -> Pipeline:
    """Run one pipeline (see the module doc) and measure it; ``prefill``: the upsert's
    keys upserted before it starts."""
    from pyspark.sql import functions as F

    tag = f"{kind}_{uuid.uuid4().hex[:8]}"
    base = os.path.join(workdir, tag)
    opts = _store_options(workdir, pubsub)
    events = (
        spark.readStream.format("rate")
        .option("rowsPerSecond", rate)
        .load()
        .select(
            F.col("value"),
            (F.col("value") % KEY_SPACE).alias("id"),
            F.unix_micros(F.current_timestamp()).alias("stamp_us"),
        )
    )
    writer = events.writeStream.option("checkpointLocation", f"{base}/sink-ckpt").trigger(
        processingTime="0 seconds"
    )
    if kind in ("persist", "upsert"):
        if kind == "upsert":
            _prefill(workdir, tag, prefill)
            writer = writer.option("upsertKeys", "id")
        sink = writer.format("persist").options(**opts).start(tag)
        while sink.lastProgress is None and sink.exception() is None:
            time.sleep(0.05)  # the shard exists after the first commit
        source = (
            spark.readStream.format("persist")
            .options(**opts)
            .option("metricsFile", f"{base}/source-metrics.jsonl")
            .load(tag)
        )
        if kind == "upsert":  # a replaced row's retraction is no new row
            source = source.where(F.col("_diff") > 0)
    elif kind == "file":
        sink = writer.format("parquet").option("path", f"{base}/data").start()
        source = spark.readStream.schema(events.schema).parquet(f"{base}/data")
    else:
        from pyspark_persist.tools.bench.ceiling import DISCARD

        sink = writer.format(DISCARD).start()
        source = _floor_source(spark)
    queries = {"sink": sink, "reader": _start_reader(source, base, tag)}
    live: list[int] = []

    def count_live() -> None:
        live.append(_live_keys(workdir, tag))

    at_steady = count_live if kind == "upsert" else None
    phases, steady_from = _run_steady(queries, f"{kind} pipeline", seconds, steady, at_steady)
    persisted = kind in ("persist", "upsert")
    waits = _waits(f"{base}/source-metrics.jsonl", steady_from) if persisted else {}
    measured = _measured(spark, kind, tag, steady_from, phases, waits)
    if persisted:
        measured.commit_ms = _commit_ms(f"{base}/sink-ckpt", steady_from)
    if kind == "upsert":
        measured.live_keys = (live[0] if live else 0, _live_keys(workdir, tag))
    return measured


UPSERT_SCHEMA = (("value", "int64"), ("id", "int64"), ("stamp_us", "int64"))
"""The columns every pipeline writes, as the persist sink stores them (Spark's ``bigint``)."""


def _client(location: str) -> Any:
    """A persist client of the stores under ``location`` (no PubSub: one-off looks)."""
    from pyspark_persist.state.client import PersistClient

    opts = _store_options(location, "off")
    return PersistClient.open(opts["blob"], opts["consensus"])


def _prefill(location: str, shard: str, keys: int) -> None:
    """Create the keyed shard ``shard`` holding keys ``0..keys-1`` (value = id, stamp 0, so
    no steady-state freshness sample), as one upsert; nothing when ``keys`` is 0."""
    if not keys:
        return
    import pyarrow as pa

    schema = pa.schema([pa.field(name, typ) for name, typ in UPSERT_SCHEMA])
    ids = pa.array(range(keys), pa.int64())
    rows = pa.table([ids, ids, pa.array([0] * keys, pa.int64())], schema=schema)
    with _client(location) as client:
        client.open_shard(shard, schema, keys=["id"]).writer().upsert(rows)


def _live_keys(location: str, shard: str) -> int:
    """The rows the keyed shard holds now (one per live key). Counted as the steady window
    begins, and at the end: the shard's since follows its reader, so the past is not there
    to count later."""
    with _client(location) as client:
        reader = client.open_shard(shard).reader()
        try:
            return int(reader.snapshot_table().num_rows)
        finally:
            reader.close()


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
    queries: dict[str, Any],
    what: str,
    seconds: float,
    steady: float,
    at_steady: Callable[[], None] | None = None,
) -> tuple[dict[str, dict[str, float]], float]:
    """Let ``queries`` run ``seconds``, stop them, and return each one's phase medians over
    the micro-batches from ``steady`` seconds in, and when that steady window began.
    ``at_steady`` is called once, as the steady window begins.

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
            if at_steady is not None and time.time() >= steady_from:
                at_steady()
                at_steady = None
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


def _commit_ms(checkpoint: str, since: float) -> float:
    """The median ``commit_s`` (in ms) of the persist sink's micro-batches committed after
    ``since`` (their uppers are wall-clock ms)."""
    from pyspark_persist.writer import read_sink_metrics

    spans = [m["commit_s"] for m in read_sink_metrics(checkpoint) if m["upper"] >= since * 1000]
    return round(statistics.median(spans) * 1000, 1) if spans else 0.0


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
    report = Report(
        seconds,
        steady,
        options.rows_per_second,
        options.pubsub,
        upsert_prefill=options.upsert_prefill,
    )
    kinds = list(dict.fromkeys(options.pipelines))  # in the order given, each once
    try:
        if options.warmup_seconds > 0:
            warm = options.warmup_seconds
            step(f"spark-freshness: warming up, a persist pipeline not measured ({warm:.0f} s)")
            run_pipeline(
                session, "persist", warm, 0.0, options.rows_per_second, workdir, options.pubsub
            )
        for kind in kinds:
            step(f"spark-freshness: the {kind} pipeline, two queries ({seconds:.0f} s)")
            report.pipelines.append(
                run_pipeline(
                    session,
                    kind,
                    seconds,
                    steady,
                    options.rows_per_second,
                    workdir,
                    options.pubsub,
                    options.upsert_prefill,
                )
            )
        for kind in (k for k in ALONE if k in kinds):
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
    _compare(report, set(kinds))
    return report


def _compare(report: Report, kinds: set[str]) -> None:
    """The ratios and targets of the pipelines that ran (each needs both of its pipelines)."""
    by = {p.kind: p for p in report.pipelines}
    if {"persist", "upsert"} <= kinds:
        append, upsert = by["persist"], by["upsert"]
        added = append.phases_ms["sink"]["addBatch"]
        report.upsert_add_batch_ratio = round(upsert.phases_ms["sink"]["addBatch"] / added, 3)
        report.upsert_p50_ratio = round(upsert.p50_ms / append.p50_ms, 3)
        report.upsert_p95_ratio = round(upsert.p95_ms / append.p95_ms, 3)
        report.targets["upsert addBatch"] = report.upsert_add_batch_ratio <= UPSERT_ADD_BATCH_TARGET
        report.targets["upsert p50"] = report.upsert_p50_ratio <= UPSERT_FRESHNESS_TARGET
        report.targets["upsert p95"] = report.upsert_p95_ratio <= UPSERT_FRESHNESS_TARGET
    if "file" not in kinds:
        return
    files = by["file"]
    if "floor" in kinds:
        floor_sink = by["floor"].phases_ms.get("sink", {})
        report.sink_floor_ms = sum(floor_sink.get(p, 0.0) for p in SINK_BEFORE_COMMIT)
        report.sink_floor_ratio = round(report.sink_floor_ms / files.p50_ms, 3)
    if "persist" not in kinds:
        return
    persist = by["persist"]
    report.p50_ratio = round(persist.p50_ms / files.p50_ms, 3)
    report.p95_ratio = round(persist.p95_ms / files.p95_ms, 3)
    report.targets["p50"] = report.p50_ratio <= P50_TARGET
    report.targets["p95"] = report.p95_ratio <= P95_TARGET
    for query in ("sink", "reader"):
        for phase in PHASES:
            mine = persist.phases_ms.get(query, {}).get(phase)
            theirs = files.phases_ms.get(query, {}).get(phase)
            if mine is not None and theirs is not None and phase != "queryPlanning":
                report.targets[f"{query} {phase}"] = mine <= theirs


NAMES = {
    "persist": "rate -> persist sink -> persist source",
    "upsert": "rate -> persist upsert -> persist source",
    "file": "rate -> file sink -> file source",
}
"""The stamped pipelines' names in the freshness table."""


def render(report: Report) -> str:
    """The report as tables for people."""
    by = {p.kind: p for p in report.pipelines}
    kinds = [k for k in KINDS if k in by]
    prefill = f", upsert prefill {report.upsert_prefill} keys" if report.upsert_prefill else ""
    lines = [
        f"persist bench spark-freshness: {report.rows_per_second} rows/s, "
        f"{report.seconds:g} s per pipeline, steady state after {report.steady_seconds:g} s, "
        f"persist pubsub={report.pubsub}{prefill}",
        "",
        "Freshness (writer's micro-batch start -> reader's), ms:",
        f"  {'pipeline':<42}{'samples':>8}{'p50':>8}{'p95':>8}{'max':>8}",
    ]
    for kind, name in NAMES.items():
        if kind in by:
            p = by[kind]
            lines.append(
                f"  {name:<42}{p.samples:>8}{p.p50_ms:>8.0f}{p.p95_ms:>8.0f}{p.max_ms:>8.0f}"
            )

    def verdict(key: str) -> str:
        return "met" if report.targets[key] else "NOT met"

    if "p50" in report.targets:
        lines.append(
            f"  persist/file: p50 {ratio_text(report.p50_ratio, P50_TARGET)} (target <= "
            f"{P50_TARGET}x: {verdict('p50')}), p95 {ratio_text(report.p95_ratio, P95_TARGET)} "
            f"(target <= {P95_TARGET}x: {verdict('p95')})"
        )
    if "upsert p50" in report.targets:
        target = UPSERT_FRESHNESS_TARGET
        lines.append(
            f"  upsert/persist append: p50 {ratio_text(report.upsert_p50_ratio, target)} "
            f"(target <= {target}x: {verdict('upsert p50')}), p95 "
            f"{ratio_text(report.upsert_p95_ratio, target)} (target <= {target}x: "
            f"{verdict('upsert p95')})"
        )
    if {"file", "floor"} <= set(by):
        lines.append(
            f"  the floor of any Python sink: the discarding sink's "
            f"{' + '.join(SINK_BEFORE_COMMIT)} = {report.sink_floor_ms:.0f} ms before it could "
            f"commit a row, {report.sink_floor_ratio:.2f}x the file pipeline's p50"
        )
    lines.append("")
    lines.append("Median ms per micro-batch phase (steady state):")
    lines.append(
        f"  {'query':<8}{'phase':<15}" + "".join(f"{k:>9}" for k in kinds) + "  persist<=file"
    )
    for query in ("sink", "reader"):
        for phase in PHASES:
            cells = [by[k].phases_ms.get(query, {}).get(phase) for k in kinds]
            if all(c is None for c in cells):
                continue
            shown = "".join(f"{'-' if c is None else f'{c:.0f}':>9}" for c in cells)
            key = f"{query} {phase}"
            mark = "" if key not in report.targets else ("yes" if report.targets[key] else "NO")
            lines.append(f"  {query:<8}{phase:<15}{shown}  {mark}")
    commits = [f"{by[k].commit_ms:.0f}" if k in ("persist", "upsert") else "-" for k in kinds]
    if any(c != "-" for c in commits):
        lines.append(f"  {'sink':<8}{'(its commit)':<15}" + "".join(f"{c:>9}" for c in commits))
    if "floor" in by:
        lines.append(
            "  (floor: rate -> a Python streaming sink that discards, as the sink; a no-I/O "
            "Python source -> memory, as the reader)"
        )
    if "upsert addBatch" in report.targets:
        target = UPSERT_ADD_BATCH_TARGET
        start, end = by["upsert"].live_keys
        lines.append(
            f"  upsert/persist append: sink addBatch "
            f"{ratio_text(report.upsert_add_batch_ratio, target)} (target <= {target}x: "
            f"{verdict('upsert addBatch')}); the keyed shard held {start} live keys at the "
            f"steady window's start, {end} at the end (key space {KEY_SPACE})"
        )
    for kind in ("persist", "upsert"):
        waits = by[kind].waits if kind in by else {}
        if waits:
            lines.append(
                f"  {kind} reader latestOffset: {waits['waited']:.0f} of "
                f"{waits['batches']:.0f} micro-batches found their commit by waiting for its "
                f"PubSub notice (waited_ms median {waits['waited_ms_p50']:.1f})"
            )
    if report.alone:
        alone = {p.kind: p for p in report.alone}
        shown_alone = [k for k in ALONE if k in alone]
        lines += [
            "",
            f"Each reader alone: its writer a Python process outside Spark, "
            f"{report.rows_per_second} rows once a second; no sink query on the cores. "
            "Median ms:",
            f"  {'reader phase':<23}" + "".join(f"{k:>9}" for k in shown_alone),
        ]
        for phase in PHASES:
            cells = [alone[k].phases_ms.get("reader", {}).get(phase) for k in shown_alone]
            shown = "".join(f"{'-' if c is None else f'{c:.0f}':>9}" for c in cells)
            lines.append(f"  {phase:<23}{shown}")
        fresh = "".join(
            f"{f'{alone[k].p50_ms:.0f}/{alone[k].p95_ms:.0f}' if alone[k].samples else '-':>9}"
            for k in shown_alone
        )
        lines.append(f"  {'append -> seen p50/p95':<23}{fresh}")
    return "\n".join(lines)


BENCHMARK = Benchmark("spark-freshness", FreshnessOptions, run, render, __doc__)
"""``persist bench spark-freshness``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
