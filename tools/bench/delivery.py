"""The delivery benchmark: a persist stream into PostgreSQL exactly once, beside Spark's writers.

Run it as ``persist bench delivery`` (or ``python -m pyspark_persist.tools.bench.delivery``;
``--quick`` for a smoke run, ``--json`` for machine-readable output). It needs the
PostgreSQL server at ``--url`` (default the test database, trust auth) and Spark's
PostgreSQL JDBC driver from Debian's ``libpostgresql-jdbc-java`` (``--jdbc-jar``, passed
with ``spark.jars``; nothing is downloaded). In one Spark session it measures, each figure
beside a peer of the same run:

- **bulk**: ``--size-mib`` MiB (Arrow bytes; 1 GiB) of rows ``(id int64, x float64, s
  32-char string)``, appended to a persist shard in ``--batch-mib`` appends, delivered
  into a fresh PostgreSQL table by ``foreachBatch(exactly_once(sinks.postgres(url,
  table)))`` (a ``Trigger.AvailableNow`` stream with ``maxBytesPerTrigger`` =
  ``--batch-mib``: the sink collects each micro-batch to the driver, so a stream bounds
  it), and by Spark's JDBC writer (``df.write.jdbc``, default options) from a batch read
  of the same shard into another fresh table of the same layout. Target: sinks.postgres
  at least 0.8x JDBC's throughput. Beside them, the time the sink's calls took of its
  query (the rest is Spark reading and handing the micro-batches over).
- **freshness**: ``rate-micro-batch`` (one row per micro-batch, every ``--trigger-ms``)
  -> persist sink; two queries tail the shard at once: persist source with a
  ``consumer`` -> ``foreachBatch(exactly_once(sinks.postgres))``, and persist source ->
  ``memory`` sink (the persist -> memory pipeline). Rows are stamped as in ``persist bench
  spark-freshness`` (the writer's micro-batch start), the memory pipeline's seen at its
  reader's micro-batch start, PostgreSQL's when the row is written in its transaction
  (``clock_timestamp()``, the moment before commit: the delivery itself counted, so the
  comparison is on the strict side); the reader's micro-batch start is printed beside.
  Target: PostgreSQL p50 at most 1.3x the memory pipeline's. A third query tails the
  shard in the same run, the ceiling peer: the same consumer query into a foreachBatch
  function that only collects the micro-batch (``df.toArrow()``: no token, no
  PostgreSQL), its rows delivered when that function returns. postgres/collect is what
  exactly_once and PostgreSQL add; collect/memory what foreachBatch and the collect
  themselves cost, which no sink collecting to the driver can beat.
- **consumer cost**: the same persist -> memory query twice at once on the same shard,
  one with ``.option("consumer", ...)``: the median ``latestOffset`` and ``walCommit``
  (where Spark calls the source's ``commit()``, which moves the consumer) from Spark's
  progress ``durationMs``. Target: the consumer adds at most 5 ms to each.

The freshness and consumer runs last ``--seconds`` each and count the micro-batches from
``--steady-seconds`` on. The machine's load average is printed at the start and end: read
the ratios, not the absolute figures, on a shared machine.
"""

from __future__ import annotations

import bisect
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag
from pyspark_persist.tools.bench.spark_freshness import (
    PHASES,
    Pipeline,
    _progress_at,
    _register,
    _run_steady,
    _start_reader,
    _store_options,
)
from pyspark_persist.tools.bench.spark_read import ROW_BYTES, SCHEMA, generate

if TYPE_CHECKING:
    import psycopg

MiB = 1 << 20
BULK_TARGET = 0.8
"""sinks.postgres's bulk throughput over Spark's JDBC writer's, at least."""
FRESHNESS_TARGET = 1.3
"""PostgreSQL delivery's freshness p50 over the persist -> memory pipeline's, at most."""
CONSUMER_TARGET_MS = 5.0
"""What a consumer may add to a micro-batch's latestOffset and walCommit medians."""
CONSUMER_PHASES = ("latestOffset", "walCommit")
START_ATTEMPTS = 3
SLOW_WORKER = "failed to connect back"
"""Spark's error when a query's Python process took more than 10 s to start."""
POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
JDBC_JAR = "/usr/share/java/postgresql.jar"
SINK = "sinks.postgres"
JDBC = "spark jdbc"
FRESHNESS = (
    "memory",
    "postgres",
    "collect",
    "memory seen",
    "postgres seen",
    "collect seen",
    "postgres written",
)
"""The freshness figures: each pipeline's rows to delivery (the end of the reader's
``addBatch``) and to the reader's micro-batch start (``seen``), and PostgreSQL's to their
write in its transaction (``clock_timestamp()``, a check on the first). ``collect`` is
the ceiling peer (foreachBatch collecting with ``df.toArrow()``, nothing else)."""
COLUMNS = "id bigint, x double precision, s text"
"""The bulk tables' layout, both writers': what each would create from SCHEMA."""


@dataclass(frozen=True)
class DeliveryOptions(Options):
    """What to run."""

    size_mib: int = flag(1024, "bulk: MiB of rows (Arrow bytes) each writer delivers", quick=16)
    batch_mib: int = flag(
        64,
        "bulk: the shard's appends and the sink query's maxBytesPerTrigger, MiB",
        quick=4,
        positive=True,
    )
    seconds: float = flag(
        40.0, "freshness and consumer cost: run time of each", quick=12.0, positive=True
    )
    steady_seconds: float = flag(
        10.0, "micro-batches that started before this are dropped", quick=4.0
    )
    trigger_ms: int = flag(500, "freshness: the rate writer's trigger interval", positive=True)
    url: str = flag(POSTGRES_URL, "the PostgreSQL database delivered into (libpq URL)")
    jdbc_jar: str = flag(JDBC_JAR, "PostgreSQL's JDBC driver (Debian libpostgresql-jdbc-java)")
    master: str = flag("local[2]", "Spark master")
    workdir: str | None = flag(None, "keep the stores here (default: a temporary directory)")


@dataclass
class Bulk:
    """One writer's delivery of the bulk rows."""

    writer: str
    rows: int
    mib: float
    seconds: float
    in_writer_seconds: float | None = None
    """sinks.postgres only: the seconds spent in the sink's calls (collect, COPY, commit)."""

    @property
    def mib_per_s(self) -> float:
        """Arrow MiB delivered a second."""
        return round(self.mib / self.seconds, 2)

    @property
    def rows_per_s(self) -> float:
        """Rows delivered a second."""
        return round(self.rows / self.seconds)


@dataclass
class DeliveryReport(Result):
    """Everything one run measured."""

    size_mib: int
    batch_mib: int
    seconds: float
    steady_seconds: float
    trigger_ms: int
    load_before: tuple[float, float, float] = (0.0, 0.0, 0.0)
    load_after: tuple[float, float, float] = (0.0, 0.0, 0.0)
    bulk: list[Bulk] = field(default_factory=list)
    bulk_ratio: float = 0.0
    """sinks.postgres's MiB/s over JDBC's."""
    freshness: list[Pipeline] = field(default_factory=list)
    """One per FRESHNESS kind (see :meth:`pipeline`)."""
    postgres_calls_ms: dict[str, float] = field(default_factory=dict)
    """Steady medians: ``foreach_batch``, the whole function foreachBatch calls
    (``exactly_once``'s plan walk and the sink), and ``sink``, sinks.postgres's call in it
    (collect, COPY, commit)."""
    freshness_ratio: float = 0.0
    """PostgreSQL's p50 over the memory pipeline's, both to delivery."""
    over_collect_ratio: float = 0.0
    """PostgreSQL's p50 over the ceiling peer's (foreachBatch + ``df.toArrow()``)."""
    collect_ratio: float = 0.0
    """The ceiling peer's p50 over the memory pipeline's: foreachBatch's and the collect's
    own cost, beside the target."""
    seen_ratio: float = 0.0
    """The same, both to the reader's micro-batch start (``persist bench spark-freshness``'s
    measure, which leaves the reader's own micro-batch out)."""
    consumer_phases: dict[str, dict[str, float]] = field(default_factory=dict)
    """``{"without": {phase: median ms}, "with": {...}}``: the reader query's phases."""
    consumer_added_ms: dict[str, float] = field(default_factory=dict)
    """Per phase of CONSUMER_PHASES: with minus without."""
    targets: dict[str, bool] = field(default_factory=dict)

    def pipeline(self, kind: str) -> Pipeline:
        """The freshness of ``kind``, one of FRESHNESS."""
        found = next((p for p in self.freshness if p.kind == kind), None)
        if found is None:
            raise KeyError(f"no pipeline {kind!r}: the run has {[p.kind for p in self.freshness]}")
        return found

    def bulk_of(self, writer: str) -> Bulk:
        """The bulk figures of ``writer`` (SINK or JDBC)."""
        found = next((b for b in self.bulk if b.writer == writer), None)
        if found is None:
            raise KeyError(
                f"no bulk writer {writer!r}: the run has {[b.writer for b in self.bulk]}"
            )
        return found


def _session(master: str, jar: str) -> Any:
    """A session with the JDBC driver on the driver's and executors' class path."""
    from pyspark.sql import SparkSession

    if not os.path.exists(jar):
        raise FileNotFoundError(
            f"no PostgreSQL JDBC driver at {jar}: install Debian's libpostgresql-jdbc-java "
            "(apt-get install libpostgresql-jdbc-java), or pass --jdbc-jar"
        )
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # workers import this checkout
    spark = (
        SparkSession.builder.master(master)
        .appName("persist-bench-delivery")
        .config("spark.jars", jar)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.sql.adaptive.enabled", "false")
        .config("spark.driver.memory", "3g")
        .config("spark.sql.streaming.numRecentProgressUpdates", "1000")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _connect(url: str) -> psycopg.Connection:
    import psycopg

    return psycopg.connect(url, autocommit=True)


def _jdbc(url: str) -> tuple[str, dict[str, str]]:
    """A libpq URL as Spark's JDBC URL and connection properties."""
    parts = urlsplit(url)
    props = {"driver": "org.postgresql.Driver", "user": parts.username or "postgres"}
    if parts.password:
        props["password"] = parts.password
    host = f"{parts.hostname or '127.0.0.1'}:{parts.port or 5432}"
    return f"jdbc:postgresql://{host}{parts.path or '/postgres'}", props


def _fresh_table(url: str, name: str, columns: str) -> None:
    with _connect(url) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")
        conn.execute(f"CREATE TABLE {name} ({columns})")


def _drop_tables(url: str, names: list[str]) -> None:
    from pyspark_persist.sinks import TOKENS_TABLE

    with _connect(url) as conn:
        for name in names:
            conn.execute(f"DROP TABLE IF EXISTS {name}")
        if conn.execute("SELECT to_regclass(%s)", (TOKENS_TABLE,)).fetchone() not in (
            None,
            (None,),
        ):
            conn.execute(f"DELETE FROM {TOKENS_TABLE} WHERE target = ANY(%s)", (names,))


def _count(url: str, table: str) -> int:
    with _connect(url) as conn:
        row = conn.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(row[0]) if row else 0


def write_bulk_shard(workdir: str, shard: str, size_mib: int, batch_mib: int) -> int:
    """Append ``size_mib`` MiB of rows to ``shard`` in appends of ``batch_mib`` MiB; the rows
    written. Maintenance is off: compaction would merge the appends into one batch, and a
    micro-batch holds whole batches, so ``maxBytesPerTrigger`` could not cut the snapshot
    (the sink's first micro-batch, collected to the driver, ran a 3 GiB JVM out of memory)."""
    from pyspark_persist.state import PersistClient, PersistConfig

    opts = _store_options(workdir, "off")
    config = PersistConfig(maintenance=False)
    client = PersistClient.open(opts["blob"], opts["consensus"], config=config)
    try:
        writer = client.open_shard(shard, SCHEMA, create=True).writer()
        total = size_mib * MiB // ROW_BYTES
        chunk = max(1, batch_mib * MiB // ROW_BYTES)
        for start in range(0, total, chunk):
            writer.append(generate(min(chunk, total - start), start))
    finally:
        client.close()
    return total


def _timed(
    fn: Callable[[Any, Any], Any], calls: list[tuple[float, float]]
) -> Callable[[Any, Any], Any]:
    """``fn`` recording each call's (wall-clock start, seconds) in ``calls``."""

    def call(df: Any, arg: Any) -> Any:
        start, t0 = time.time(), time.perf_counter()
        try:
            return fn(df, arg)
        finally:
            calls.append((start, time.perf_counter() - t0))

    return call


def _median_ms(calls: list[tuple[float, float]], since: float) -> float:
    """The median ms of the calls that started at or after ``since``."""
    kept = [s for start, s in calls if start >= since]
    return round(statistics.median(kept) * 1000, 1) if kept else 0.0


def run_bulk(spark: Any, opts: DeliveryOptions, workdir: str, tag: str) -> list[Bulk]:
    """Deliver the bulk shard with each writer (see the module doc)."""
    from pyspark_persist import exactly_once, sinks

    shard = f"bulk_{tag}"
    step(f"delivery: appending {opts.size_mib} MiB to shard {shard}")
    rows = write_bulk_shard(workdir, shard, opts.size_mib, opts.batch_mib)
    mib = rows * ROW_BYTES / MiB
    store = _store_options(workdir, "off")
    jdbc_table, sink_table = f"bench_jdbc_{tag}", f"bench_sink_{tag}"
    results = []
    try:
        _fresh_table(opts.url, jdbc_table, COLUMNS)
        step(f"delivery: {mib:.0f} MiB through Spark's JDBC writer")
        url, props = _jdbc(opts.url)
        df = spark.read.format("persist").options(**store).load(shard).select("id", "x", "s")
        t0 = time.perf_counter()
        df.write.jdbc(url, jdbc_table, mode="append", properties=props)
        results.append(Bulk(JDBC, rows, mib, time.perf_counter() - t0))

        _fresh_table(opts.url, sink_table, COLUMNS)
        step(f"delivery: {mib:.0f} MiB through foreachBatch(exactly_once(sinks.postgres))")
        sink = sinks.postgres(opts.url, sink_table, create=False)
        spent: list[tuple[float, float]] = []
        stream = (
            spark.readStream.format("persist")
            .options(**store)
            .option("maxBytesPerTrigger", f"{opts.batch_mib}m")
            .load(shard)
            .select("id", "x", "s", "_diff")
        )
        t0 = time.perf_counter()
        query = (
            stream.writeStream.foreachBatch(exactly_once(_timed(sink, spent)))
            .option("checkpointLocation", os.path.join(workdir, f"{shard}-ckpt"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        seconds = time.perf_counter() - t0
        sink.close()
        if query.exception() is not None:
            raise RuntimeError(f"the sinks.postgres query failed: {query.exception()}")
        results.append(Bulk(SINK, rows, mib, seconds, round(sum(s for _, s in spent), 2)))
        for b in results:
            step(f"delivery: {b.writer}: {b.mib:.0f} MiB in {b.seconds:.1f} s, {b.mib_per_s} MiB/s")
        for b, table in zip(results, (jdbc_table, sink_table), strict=True):
            landed = _count(opts.url, table)
            if landed != rows:
                raise RuntimeError(f"{b.writer} delivered {landed} rows of {rows} into {table}")
    finally:
        _drop_tables(opts.url, [jdbc_table, sink_table])
    return results


def _writer_query(spark: Any, store: dict[str, str], shard: str, base: str, trigger_ms: int) -> Any:
    """``rate-micro-batch`` (one row a micro-batch) stamped at its micro-batch start ->
    persist sink; returned once the shard exists (after its first commit)."""
    from pyspark.sql import functions as F

    events = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", 1)
        .load()
        .select(F.col("value"), F.unix_micros(F.current_timestamp()).alias("stamp_us"))
    )
    return _start(
        lambda: (
            events.writeStream.format("persist")
            .options(**store)
            .option("checkpointLocation", f"{base}/sink-ckpt")
            .trigger(processingTime=f"{trigger_ms} milliseconds")
            .start(shard)
        ),
        "the rate -> persist query",
    )


def _start(start: Callable[[], Any], what: str) -> Any:
    """The query ``start()`` starts, once its first micro-batch ran.

    The queries of a pipeline start one by one, and a query is started again (up to
    START_ATTEMPTS times) when its source's or sink's Python process did not connect back
    to Spark in time: Spark waits 10 s (fixed), which a loaded machine missed for queries
    starting at once and, now and then, for one alone.
    """
    for attempt in range(1, START_ATTEMPTS + 1):
        error: Any
        try:
            query = start()
        except Exception as e:  # noqa: BLE001 - Spark's errors carry the worker's in their text
            error = e
        else:
            while query.lastProgress is None and query.exception() is None:
                time.sleep(0.05)
            error = query.exception()
            if error is None:
                return query
        if SLOW_WORKER not in str(error) or attempt == START_ATTEMPTS:
            raise RuntimeError(f"{what} failed: {error}")
        step(f"delivery: {what}: {SLOW_WORKER} (a loaded machine); starting it again")
    raise AssertionError("unreachable")


def _stop_all(queries: dict[str, Any]) -> None:
    """Stop every query of a pipeline that failed to start."""
    for query in queries.values():
        if query.isActive:
            query.stop()


def _source(spark: Any, store: dict[str, str], shard: str, consumer: str | None) -> Any:
    reader = spark.readStream.format("persist").options(**store)
    if consumer is not None:
        reader = reader.option("consumer", consumer)
    return reader.load(shard)


def _delivery_ends(query: Any) -> tuple[list[float], list[float]]:
    """Each micro-batch of ``query`` as (starts, ends of ``addBatch``), wall-clock seconds, by
    start: a sink's rows are delivered when its ``addBatch`` returns (the memory sink's
    visible, foreachBatch's function returned after PostgreSQL's commit), which is the
    micro-batch's ``triggerExecution`` less its ``commitOffsets`` (Spark's log, after)."""
    spans = sorted(
        (
            _progress_at(p),
            _progress_at(p)
            + (p.durationMs.get("triggerExecution", 0) - p.durationMs.get("commitOffsets", 0))
            / 1000,
        )
        for p in query.recentProgress
    )
    return [a for a, _ in spans], [b for _, b in spans]


def _pipeline(kind: str, ms: list[float], phases: dict[str, float]) -> Pipeline:
    """A pipeline's figures from its rows' freshness ``ms``."""
    if not ms:
        raise RuntimeError(f"{kind}: no row written in steady state was delivered")
    ms = sorted(ms)
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    return Pipeline(
        kind,
        len(ms),
        round(statistics.median(ms), 1),
        round(p95, 1),
        round(ms[-1], 1),
        {"reader": phases},
    )


def _freshness(
    kind: str, rows: list[tuple[int, int]], query: Any, phases: dict[str, float]
) -> tuple[Pipeline, Pipeline]:
    """(stamp -> delivered, stamp -> the reader's micro-batch start) of ``rows``, each
    ``(stamp_us, seen_us)``: ``seen_us`` is its micro-batch's ``current_timestamp()``, taken
    as the micro-batch plans (at or just after its progress start, to the ms)."""
    starts, ends = _delivery_ends(query)
    delivered, seen = [], []
    for stamp_us, seen_us in rows:
        i = bisect.bisect_right(starts, seen_us / 1e6 + 0.001) - 1
        if i >= 0:
            delivered.append(ends[i] * 1000 - stamp_us / 1000)
            seen.append((seen_us - stamp_us) / 1000)
    return _pipeline(kind, delivered, phases), _pipeline(f"{kind} seen", seen, phases)


def run_freshness(
    spark: Any, opts: DeliveryOptions, workdir: str, tag: str
) -> tuple[list[Pipeline], dict[str, float]]:
    """rate -> persist, tailed at once by a consumer into PostgreSQL, by a consumer into a
    foreachBatch function that only collects (the ceiling peer) and by a memory sink:
    FRESHNESS (each pipeline to delivery and to its micro-batch start, and PostgreSQL's
    rows to their write), and the median ms of the foreachBatch function's calls and of
    the sink's in them."""
    from pyspark.sql import functions as F

    from pyspark_persist import exactly_once, sinks

    shard, table = f"fresh_{tag}", f"bench_fresh_{tag}"
    base = os.path.join(workdir, shard)
    store = _store_options(workdir, "auto")
    _fresh_table(
        opts.url,
        table,
        "value bigint, stamp_us bigint, seen_us bigint, delivered_us bigint NOT NULL "
        "DEFAULT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
    )
    sink = sinks.postgres(opts.url, table, create=False)
    batches: list[tuple[float, float]] = []
    writes: list[tuple[float, float]] = []
    collected: list[tuple[int, int]] = []

    def collect(df: Any, _batch_id: int) -> None:
        """The ceiling peer: the micro-batch collected as the sink does, nothing else."""
        rows = df.toArrow()
        collected.extend(
            zip(
                rows.column("stamp_us").to_pylist(), rows.column("seen_us").to_pylist(), strict=True
            )
        )

    try:
        queries: dict[str, Any] = {}
        try:
            queries["sink"] = _writer_query(spark, store, shard, base, opts.trigger_ms)
            to_pg = _source(spark, store, shard, f"to-pg-{tag}").select(
                "value", "stamp_us", F.unix_micros(F.current_timestamp()).alias("seen_us"), "_diff"
            )
            queries["postgres"] = _start(
                lambda: (
                    to_pg.writeStream.foreachBatch(
                        _timed(exactly_once(_timed(sink, writes)), batches)
                    )
                    .option("checkpointLocation", f"{base}/pg-ckpt")
                    .start()
                ),
                "the persist -> sinks.postgres query",
            )
            to_collect = _source(spark, store, shard, f"to-collect-{tag}").select(
                "value", "stamp_us", F.unix_micros(F.current_timestamp()).alias("seen_us"), "_diff"
            )
            queries["collect"] = _start(
                lambda: (
                    to_collect.writeStream.foreachBatch(collect)
                    .option("checkpointLocation", f"{base}/collect-ckpt")
                    .start()
                ),
                "the persist -> foreachBatch(toArrow) query",
            )
            queries["reader"] = _start(
                lambda: _start_reader(
                    _source(spark, store, shard, None), f"{base}/memory", f"memory_{tag}"
                ),
                "the persist -> memory query",
            )
        except BaseException:
            _stop_all(queries)
            raise
        phases, since = _run_steady(
            queries, "the freshness pipelines", opts.seconds, opts.steady_seconds
        )
        view = f"memory_{tag}"
        in_memory = spark.sql(
            f"SELECT stamp_us, seen_us FROM {view} WHERE stamp_us >= {int(since * 1e6)}"
        ).collect()
        spark.catalog.dropTempView(view)
        memory = _freshness(
            "memory",
            [(r.stamp_us, r.seen_us) for r in in_memory],
            queries["reader"],
            phases["reader"],
        )
        with _connect(opts.url) as conn:
            in_pg = conn.execute(
                f"SELECT stamp_us, seen_us, delivered_us FROM {table} WHERE stamp_us >= %s",
                (int(since * 1e6),),
            ).fetchall()
        postgres = _freshness(
            "postgres", [(r[0], r[1]) for r in in_pg], queries["postgres"], phases["postgres"]
        )
        ceiling = _freshness(
            "collect",
            [(stamp, seen) for stamp, seen in collected if stamp >= int(since * 1e6)],
            queries["collect"],
            phases["collect"],
        )
        written = _pipeline(
            "postgres written", [(r[2] - r[0]) / 1000 for r in in_pg], phases["postgres"]
        )
        calls = {"foreach_batch": _median_ms(batches, since), "sink": _median_ms(writes, since)}
    finally:
        sink.close()
        _drop_tables(opts.url, [table])
    return [*memory, *postgres, *ceiling, written], calls


def run_consumer_cost(
    spark: Any, opts: DeliveryOptions, workdir: str, tag: str
) -> dict[str, dict[str, float]]:
    """rate -> persist, tailed at once by two persist -> memory queries, one a consumer:
    each one's phase medians (``{"without": ..., "with": ...}``)."""
    shard = f"consumer_{tag}"
    base = os.path.join(workdir, shard)
    store = _store_options(workdir, "auto")
    queries: dict[str, Any] = {}
    try:
        queries["sink"] = _writer_query(spark, store, shard, base, opts.trigger_ms)
        for which, consumer in (("without", None), ("with", f"to-memory-{tag}")):

            def start_reader(which: str = which, consumer: str | None = consumer) -> Any:
                source = _source(spark, store, shard, consumer)
                return _start_reader(source, f"{base}/{which}", f"{which}_{tag}")

            queries[which] = _start(start_reader, f"the persist -> memory query {which} a consumer")
    except BaseException:
        _stop_all(queries)
        raise
    phases, _ = _run_steady(queries, "the consumer-cost queries", opts.seconds, opts.steady_seconds)
    for which in ("without", "with"):
        spark.catalog.dropTempView(f"{which}_{tag}")
    return {which: phases[which] for which in ("without", "with")}


def run(options: DeliveryOptions, spark: Any = None) -> DeliveryReport:
    """Run every part as ``options`` says; in ``spark`` if given (it must have the JDBC driver
    on its class path; then left running)."""
    workdir = options.workdir or tempfile.mkdtemp(prefix="persist-bench-delivery-")
    os.makedirs(workdir, exist_ok=True)
    _connect(options.url).close()  # unreachable: fail before starting Spark
    report = DeliveryReport(
        options.size_mib,
        options.batch_mib,
        options.seconds,
        options.steady_seconds,
        options.trigger_ms,
        load_before=os.getloadavg(),
    )
    own = spark is None
    session = _session(options.master, options.jdbc_jar) if own else spark
    _register(session)
    tag = uuid.uuid4().hex[:8]
    try:
        report.bulk = run_bulk(session, options, workdir, tag)
        step(f"delivery: freshness, persist -> PostgreSQL beside memory ({options.seconds:g} s)")
        report.freshness, report.postgres_calls_ms = run_freshness(session, options, workdir, tag)
        step(f"delivery: consumer cost, persist -> memory with and without ({options.seconds:g} s)")
        report.consumer_phases = run_consumer_cost(session, options, workdir, tag)
    finally:
        if own:
            session.stop()
        if options.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    report.load_after = os.getloadavg()
    report.bulk_ratio = round(report.bulk_of(SINK).mib_per_s / report.bulk_of(JDBC).mib_per_s, 3)
    report.targets["bulk"] = report.bulk_ratio >= BULK_TARGET
    memory, postgres = report.pipeline("memory"), report.pipeline("postgres")
    report.freshness_ratio = round(postgres.p50_ms / memory.p50_ms, 3)
    report.seen_ratio = round(
        report.pipeline("postgres seen").p50_ms / report.pipeline("memory seen").p50_ms, 3
    )
    report.targets["freshness"] = report.freshness_ratio <= FRESHNESS_TARGET
    collect = report.pipeline("collect")
    report.over_collect_ratio = round(postgres.p50_ms / collect.p50_ms, 3)
    report.collect_ratio = round(collect.p50_ms / memory.p50_ms, 3)
    for phase in CONSUMER_PHASES:
        added = report.consumer_phases["with"].get(phase, 0.0) - report.consumer_phases[
            "without"
        ].get(phase, 0.0)
        report.consumer_added_ms[phase] = round(added, 1)
        report.targets[f"consumer {phase}"] = added <= CONSUMER_TARGET_MS
    return report


def _ok(met: bool) -> str:
    return "ok" if met else "MISSED"


def render(report: DeliveryReport) -> str:
    """The report as tables for people."""
    load = "/".join(f"{x:.1f}" for x in report.load_before)
    after = "/".join(f"{x:.1f}" for x in report.load_after)
    jdbc, sink = report.bulk_of(JDBC), report.bulk_of(SINK)
    lines = [
        f"persist bench delivery: {report.size_mib} MiB bulk in {report.batch_mib} MiB "
        f"micro-batches; freshness and consumer cost {report.seconds:g} s each, steady after "
        f"{report.steady_seconds:g} s; load average {load} before, {after} after",
        "",
        "Bulk delivery of one shard into a fresh PostgreSQL table:",
        f"  {'writer':<48}{'rows':>10}{'MiB':>7}{'s':>8}{'MiB/s':>8}{'rows/s':>10}",
    ]
    names = {
        JDBC: "batch read -> df.write.jdbc",
        SINK: "stream -> foreachBatch(exactly_once(sinks.postgres))",
    }
    for b in (jdbc, sink):
        lines.append(
            f"  {names[b.writer]:<48}{b.rows:>10}{b.mib:>7.0f}{b.seconds:>8.1f}"
            f"{b.mib_per_s:>8.1f}{b.rows_per_s:>10.0f}"
        )
    lines.append(
        f"  sinks.postgres/jdbc: {ratio_text(report.bulk_ratio, BULK_TARGET)} (target >= "
        f"{BULK_TARGET}x: {_ok(report.targets['bulk'])}); the sink's calls took "
        f"{sink.in_writer_seconds:.1f} s of its query's {sink.seconds:.1f} s"
    )
    lines += [
        "",
        "Freshness (writer's micro-batch start -> delivered), one row per micro-batch, ms:",
        f"  {'pipeline':<52}{'samples':>8}{'p50':>8}{'p95':>8}{'max':>8}",
    ]
    names = {
        "memory": "persist -> memory (addBatch returned)",
        "postgres": "persist -> consumer -> sinks.postgres (committed)",
        "memory seen": "persist -> memory, reader's micro-batch start",
        "postgres seen": "persist -> postgres, reader's micro-batch start",
        "collect": "persist -> consumer -> foreachBatch(toArrow)",
        "collect seen": "persist -> toArrow, reader's micro-batch start",
        "postgres written": "persist -> postgres, row written in its transaction",
    }
    for kind in FRESHNESS:
        p = report.pipeline(kind)
        lines.append(
            f"  {names[kind]:<52}{p.samples:>8}{p.p50_ms:>8.0f}{p.p95_ms:>8.0f}{p.max_ms:>8.0f}"
        )
    lines.append(
        f"  postgres/memory p50: {ratio_text(report.freshness_ratio, FRESHNESS_TARGET)} (target "
        f"<= {FRESHNESS_TARGET}x: {_ok(report.targets['freshness'])}); at the micro-batch "
        f"start {report.seen_ratio:.2f}x"
    )
    lines.append(
        f"  ceiling peer (foreachBatch + toArrow only): postgres/collect p50 "
        f"{report.over_collect_ratio:.2f}x, collect/memory p50 {report.collect_ratio:.2f}x"
    )
    pg_phases = report.pipeline("postgres").phases_ms["reader"]
    mem_phases = report.pipeline("memory").phases_ms["reader"]
    collect_phases = report.pipeline("collect").phases_ms["reader"]
    lines.append(f"  median ms per phase: {'postgres':>10}{'collect':>9}{'memory':>8}")
    for phase in PHASES:
        if phase in pg_phases or phase in mem_phases or phase in collect_phases:
            lines.append(
                f"    {phase:<19}{pg_phases.get(phase, 0):>10.0f}"
                f"{collect_phases.get(phase, 0):>9.0f}{mem_phases.get(phase, 0):>8.0f}"
            )
    calls = report.postgres_calls_ms
    lines.append(
        f"  of postgres's addBatch: the foreachBatch function {calls['foreach_batch']:.0f} ms, "
        f"in it sinks.postgres {calls['sink']:.0f} ms (collect, COPY, commit)"
    )
    lines += [
        "",
        "Consumer cost: persist -> memory, two queries at once on one shard, median ms:",
        f"  {'phase':<16}{'without':>9}{'with':>9}{'added':>9}",
    ]
    for phase in CONSUMER_PHASES:
        without = report.consumer_phases["without"].get(phase, 0.0)
        with_ = report.consumer_phases["with"].get(phase, 0.0)
        added = report.consumer_added_ms[phase]
        lines.append(
            f"  {phase:<16}{without:>9.1f}{with_:>9.1f}{added:>+9.1f}  (target <= "
            f"{CONSUMER_TARGET_MS:g} ms: {_ok(report.targets[f'consumer {phase}'])})"
        )
    return "\n".join(lines)


BENCHMARK = Benchmark("delivery", DeliveryOptions, run, render, __doc__)
"""``persist bench delivery``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
