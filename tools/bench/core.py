"""The core benchmark of persist: latency, throughput against raw pyarrow, and peak memory.

Run it as ``persist bench core`` (``--quick`` for a smoke run, ``--json`` for
machine-readable output). It measures, on this machine and in this run:

- **Small-write latency**: ``shard.writer().append(one-row table)`` repeated,
  p50/p95/p99, on every location (``mem/mem``, ``file/sqlite``,
  ``file/postgres``, ``s3/postgres`` with S3 served by an in-process moto).
  A one-row append is one compare-and-set, so beside it, in the same run, are
  its floors: that compare-and-set alone through persist's Consensus (a row
  of the append's size), and the same conditional ``INSERT`` sent through the
  database's own driver (``sqlite3`` with persist's WAL + ``synchronous=FULL``
  + ``BEGIN IMMEDIATE``; ``psycopg`` in autocommit), no persist and no
  SQLAlchemy: no append can commit faster than the driver floor.
- **Write-to-listen latency**: from just before an append to a listener
  receiving the event holding that row. The headline figure uses a listener
  in a *separate client with its own state cache*, so it learns of writes
  only by polling Consensus (as another process would without PubSub). The
  same-client figure (in-process wake-up) is reported on its own row.
- **Throughput**: write goodput (Arrow bytes of user rows / wall time of
  staging with a :class:`~pyspark_persist.state.BatchBuilder` and
  committing) and snapshot-read goodput (streaming every part), each next to
  raw pyarrow Parquet doing the same work on the same rows in the same run
  (``pq.ParquetWriter``, snappy, then one ``fsync`` since persist's parts are
  durable; ``ParquetFile.iter_batches`` to read), and their ratio.
- **Peak memory** of a writer staging, and of a reader fetching, the whole
  data set, each in a spawned child process measuring its own Arrow pool peak
  and RSS growth, next to persist's memory model: a writer holds at most
  ``B * (2N + 1)`` bytes and a reader about ``3B`` (``B`` the part target
  size, ``N`` the parts in flight), whatever the shard size.

Rows are generated in chunks with numpy (an int64 id, an int64 value, a
float64 and a 32-character string: 60 Arrow bytes a row). The throughput
phase generates a bounded pool of distinct chunks before the clock starts and
cycles it with fresh ids, so both persist and the raw peer are timed without
the generator and memory stays bounded; the memory children generate every
chunk afresh, holding one chunk at a time. Nothing here imports Spark.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pyspark_persist.state import Committed, PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import (
    CaSCommitted,
    Consensus,
    VersionedData,
    open_consensus,
)
from pyspark_persist.tools.bench import step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, csv, flag, setting
from pyspark_persist.tools.bench.listen import probe_listen

MiB = 1 << 20

LOCATIONS = ("mem/mem", "file/sqlite", "file/postgres", "s3/postgres")
"""Every (Blob, Consensus) pair the benchmark knows, in report order."""
PHASES = ("latency", "listen", "throughput", "memory")
"""Every phase of the benchmark, in the order it runs them."""

POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
S3_BUCKET = "persist-bench"

SMALL_WRITE_TARGET_P50_MS = {"mem/mem": 0.3, "file/sqlite": 0.8, "file/postgres": 1.0}
"""Issue 15's targets for small-write p50 latency, per location (others have none)."""
RATIO_TARGET = 0.7
"""Persist's write and snapshot-read goodput should be at least this fraction of raw pyarrow."""

ROW_SCHEMA = pa.schema(
    [("id", pa.int64()), ("value", pa.int64()), ("score", pa.float64()), ("tag", pa.string())]
)
"""The generated rows: 8 + 8 + 8 + (32 + 4 offset) = 60 Arrow bytes each."""
ROW_BYTES = 60
TAG_CHARS = 32

SMALL_SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
"""The rows of the latency phases: one small row per write."""


# ---------------------------------------------------------------------------
# Configuration and results


@dataclass(frozen=True)
class BenchConfig(Options):
    """What to run and how big. The defaults are the issue's full benchmark."""

    locations: tuple[str, ...] = flag(
        LOCATIONS, "comma list of locations", parse=csv, choices=LOCATIONS
    )
    phases: tuple[str, ...] = flag(PHASES, "comma list of phases", parse=csv, choices=PHASES)
    writes: int = flag(500, "small writes timed per location", quick=100, positive=True)
    """Small writes timed per location (after ``warmup`` untimed ones)."""
    warmup: int = setting(20, quick=5)
    listen_samples: int = flag(200, "writes per listen measurement", quick=30, positive=True)
    """Writes a listener must see, per location and listener kind."""
    listen_gap_ms: float = flag(20.0, "max random gap between listen writes")
    """The writer sleeps a uniformly random 0..gap between listen samples."""
    size_mib: int = flag(1024, "Arrow MiB for throughput and memory", quick=64, positive=True)
    """Arrow MiB of generated rows for the throughput and memory phases."""
    s3_size_mib: int = flag(256, "Arrow MiB for s3/postgres throughput, 0 skips", quick=32)
    """Arrow MiB for the s3/postgres throughput run (moto is slow; 0 skips it)."""
    throughput_locations: tuple[str, ...] = ("file/sqlite", "s3/postgres")
    part_mib: int = flag(64, "B, the part target size in MiB", positive=True)
    """B, persist's part target size."""
    outstanding_parts: int = flag(2, "N, parts in flight per writer", positive=True)
    """N, parts a batch builder encodes and uploads at once."""
    chunk_rows: int = 1 << 18
    """Rows per generated chunk in the throughput phase (15 MiB; also the raw row groups)."""
    memory_chunk_rows: int = 1 << 16
    """Rows per generated chunk in the memory-phase writer child (3.75 MiB)."""
    pool_chunks: int = 4
    """Distinct pre-generated chunks the throughput phase cycles through."""
    repeats: int = flag(2, "throughput rounds, fastest kept", quick=1, positive=True)
    """Interleaved rounds of the throughput phase; each figure keeps its fastest round."""
    postgres_url: str = flag(POSTGRES_URL, "PostgreSQL consensus URL")
    workdir: str | None = flag(None, "directory for temporary files (default: the system's)")
    """Where temporary files go (default: the system temp dir)."""
    seed: int = 7

    @property
    def persist_config(self) -> PersistConfig:
        """The client config every benchmark client uses."""
        return PersistConfig(
            part_target_bytes=self.part_mib * MiB, max_outstanding_parts=self.outstanding_parts
        )


@dataclass(frozen=True)
class LatencyResult:
    """Small-write latency at one location."""

    location: str
    writes: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    target_p50_ms: float | None
    """The issue's target for p50 here, or None."""
    cas_p50_ms: float | None = None
    """p50 of the append's compare-and-set alone, through persist's Consensus."""
    driver_p50_ms: float | None = None
    """p50 of the same conditional INSERT through the database driver itself (None for mem)."""

    @property
    def meets_target(self) -> bool | None:
        """Whether p50 meets the target (None without one)."""
        return None if self.target_p50_ms is None else self.p50_ms <= self.target_p50_ms


@dataclass(frozen=True)
class ListenLatencyResult:
    """Write-to-listen latency at one location for one kind of listener."""

    location: str
    listener: str
    """``polling`` (separate client, learns by polling Consensus) or ``same-client``."""
    samples: int
    p50_ms: float
    p95_ms: float
    missed: int
    """Writes the listener did not report within the timeout (excluded from the figures)."""


@dataclass(frozen=True)
class ThroughputResult:
    """Write and snapshot-read goodput of persist and of raw pyarrow, on the same rows."""

    location: str
    arrow_mib: float
    rows: int
    parts: int
    encoded_mib: float
    persist_write_s: float
    raw_write_s: float
    persist_read_s: float
    raw_read_s: float
    raw_file_mib: float

    @property
    def persist_write_mib_s(self) -> float:
        """Persist's write goodput."""
        return self.arrow_mib / self.persist_write_s

    @property
    def raw_write_mib_s(self) -> float:
        """Raw pyarrow's write goodput."""
        return self.arrow_mib / self.raw_write_s

    @property
    def write_ratio(self) -> float:
        """Persist's write goodput over raw pyarrow's."""
        return self.raw_write_s / self.persist_write_s

    @property
    def persist_read_mib_s(self) -> float:
        """Persist's snapshot-read goodput."""
        return self.arrow_mib / self.persist_read_s

    @property
    def raw_read_mib_s(self) -> float:
        """Raw pyarrow's read goodput."""
        return self.arrow_mib / self.raw_read_s

    @property
    def read_ratio(self) -> float:
        """Persist's read goodput over raw pyarrow's."""
        return self.raw_read_s / self.persist_read_s


@dataclass(frozen=True)
class MemoryResult:
    """The peak memory of one child process against persist's memory model."""

    role: str
    """``writer`` (staging and committing) or ``reader`` (snapshot fetch)."""
    arrow_mib: float
    rows: int
    seconds: float
    arrow_pool_peak_mib: float
    rss_growth_mib: float
    bound_mib: float
    bound_formula: str
    generator_chunk_mib: float
    """Arrow MiB of one generated chunk, held by the writer child's generator (0 for reader)."""

    @property
    def within(self) -> bool:
        """Both peaks are within the model's bound."""
        return max(self.arrow_pool_peak_mib, self.rss_growth_mib) <= self.bound_mib


@dataclass
class CoreReport(Result):
    """Everything one benchmark run measured."""

    config: BenchConfig
    machine: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    latency: list[LatencyResult] = field(default_factory=list)
    listen: list[ListenLatencyResult] = field(default_factory=list)
    throughput: list[ThroughputResult] = field(default_factory=list)
    memory: list[MemoryResult] = field(default_factory=list)
    seconds: float = 0.0


# ---------------------------------------------------------------------------
# Generated data


def generate_chunk(rng: np.random.Generator, start_id: int, rows: int) -> pa.Table:
    """``rows`` generated rows of :data:`ROW_SCHEMA` with ids from ``start_id`` (no Python loop)."""
    ids = np.arange(start_id, start_id + rows, dtype=np.int64)
    values = rng.integers(0, 1_000_000, rows, dtype=np.int64)
    scores = rng.random(rows)
    chars = rng.integers(0, 26, rows * TAG_CHARS, dtype=np.uint8)
    chars += ord("a")
    offsets = np.arange(0, (rows + 1) * TAG_CHARS, TAG_CHARS, dtype=np.int32)
    tags = pa.StringArray.from_buffers(rows, pa.py_buffer(offsets), pa.py_buffer(chars))
    return pa.Table.from_arrays(
        [pa.array(ids), pa.array(values), pa.array(scores), tags], schema=ROW_SCHEMA
    )


def rows_for(size_bytes: int) -> int:
    """Rows of :data:`ROW_SCHEMA` that make ``size_bytes`` Arrow bytes."""
    return max(1, size_bytes // ROW_BYTES)


def iter_generated(total_rows: int, chunk_rows: int, seed: int) -> Iterator[pa.Table]:
    """Generate ``total_rows`` rows chunk by chunk, each afresh: holds one chunk at a time."""
    rng = np.random.default_rng(seed)
    start = 0
    while start < total_rows:
        n = min(chunk_rows, total_rows - start)
        yield generate_chunk(rng, start, n)
        start += n


class ChunkPool:
    """A few pre-generated chunks, cycled with fresh ids: data without the generator's cost."""

    def __init__(self, chunks: int, chunk_rows: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.chunk_rows = chunk_rows
        self._chunks = [generate_chunk(rng, 0, chunk_rows) for _ in range(max(1, chunks))]

    def iter_rows(self, total_rows: int) -> Iterator[pa.Table]:
        """Yield ``total_rows`` rows in chunks, ids ``0..total_rows-1``."""
        start = 0
        i = 0
        while start < total_rows:
            n = min(self.chunk_rows, total_rows - start)
            chunk = self._chunks[i % len(self._chunks)].slice(0, n)
            ids = pa.array(np.arange(start, start + n, dtype=np.int64))
            yield chunk.set_column(0, "id", ids)
            start += n
            i += 1


# ---------------------------------------------------------------------------
# Locations


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class Locations:
    """The stores of one run: a temp dir, PostgreSQL, and an in-process moto S3 server.

    A context manager; leaving it stops moto and deletes the temp dir.
    """

    def __init__(self, config: BenchConfig) -> None:
        self._config = config
        self.notes: list[str] = []
        self._tmp: str | None = None
        self._moto: Any = None
        self._s3_endpoint: str | None = None
        self._saved_env: dict[str, str | None] = {}
        self._postgres_error: str | None = None
        self._postgres_checked = False

    def __enter__(self) -> Locations:
        if self._config.workdir is not None:  # --workdir D: create D, as a user expects
            os.makedirs(self._config.workdir, exist_ok=True)
        self._tmp = tempfile.mkdtemp(prefix="persist-bench-", dir=self._config.workdir)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._moto is not None:
            with contextlib.suppress(Exception):
                self._moto.stop()
            self._moto = None
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)

    @property
    def tmp(self) -> str:
        """The run's temporary directory."""
        assert self._tmp is not None, "use Locations as a context manager"
        return self._tmp

    def uris(self, location: str) -> tuple[str, str] | None:
        """A fresh ``(blob_uri, consensus_uri)`` for ``location``, or None if it is unreachable.

        The first time a location is unreachable a one-line note is recorded.
        """
        tag = uuid.uuid4().hex[:12]
        if location == "mem/mem":
            return f"mem://bench-{tag}", f"mem://bench-{tag}"
        if location == "file/sqlite":
            d = os.path.join(self.tmp, tag)
            os.makedirs(d)
            return f"file://{d}/blob", f"sqlite:///{d}/consensus.db"
        if location == "file/postgres":
            if not self._postgres_ok(location):
                return None
            d = os.path.join(self.tmp, tag)
            os.makedirs(d)
            return f"file://{d}/blob", self._config.postgres_url
        if location == "s3/postgres":
            if not self._postgres_ok(location):
                return None
            endpoint = self._s3()
            if endpoint is None:
                return None
            return (
                f"s3://{S3_BUCKET}/{tag}?endpoint_url={endpoint}&region=us-east-1",
                self._config.postgres_url,
            )
        raise ValueError(f"unknown location {location!r}: use one of {', '.join(LOCATIONS)}")

    def _postgres_ok(self, location: str) -> bool:
        if not self._postgres_checked:
            self._postgres_checked = True
            try:
                c = open_consensus(self._config.postgres_url)
                try:
                    c.head("persist-bench-probe")
                finally:
                    c.close()
            except Exception as e:  # noqa: BLE001 - any failure means: skip, with a note
                self._postgres_error = _first_line(e)
        if self._postgres_error is not None:
            self.notes.append(
                f"skipped {location}: PostgreSQL at {self._config.postgres_url} is unreachable "
                f"({self._postgres_error})"
            )
            return False
        return True

    def _s3(self) -> str | None:
        if self._s3_endpoint is not None:
            return self._s3_endpoint
        if self._moto == "failed":
            self.notes.append("skipped s3/postgres: the moto S3 server could not start")
            return None
        try:
            import boto3
            from moto.server import ThreadedMotoServer

            env = {
                "AWS_ACCESS_KEY_ID": "bench",
                "AWS_SECRET_ACCESS_KEY": "bench",
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            for name, value in env.items():
                self._saved_env.setdefault(name, os.environ.get(name))
                os.environ[name] = value
            import logging

            logging.getLogger("werkzeug").setLevel(logging.ERROR)
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            self._moto = server
            host, port = server.get_host_and_port()
            endpoint = f"http://{host}:{port}"
            boto3.session.Session().client(
                "s3", endpoint_url=endpoint, region_name="us-east-1"
            ).create_bucket(Bucket=S3_BUCKET)
        except Exception as e:  # noqa: BLE001 - any failure means: skip, with a note
            if self._moto is not None:
                with contextlib.suppress(Exception):
                    self._moto.stop()
            self._moto = "failed"
            self.notes.append(f"skipped s3/postgres: moto S3 server unavailable ({_first_line(e)})")
            return None
        self._s3_endpoint = endpoint
        return endpoint


def open_client(uris: tuple[str, str], config: PersistConfig | None = None) -> PersistClient:
    """A client on ``uris`` with its own state cache (no in-process sharing with other clients)."""
    return PersistClient(
        open_blob(uris[0]), open_consensus(uris[1]), config=config, cache=StateCache()
    )


def _shard_name(kind: str) -> str:
    return f"bench-{kind}-{uuid.uuid4().hex[:12]}"


def _percentile_ms(samples: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q)) * 1e3


# ---------------------------------------------------------------------------
# Phases


def _small_row(i: int) -> pa.Table:
    """The one row of the ``i``-th small write."""
    return pa.table({"id": [i], "name": [f"row-{i}"]}, schema=SMALL_SCHEMA)


def measure_small_writes(
    location: str, uris: tuple[str, str], writes: int, warmup: int = 20
) -> LatencyResult:
    """Time ``writer.append`` of a one-row table ``writes`` times on a fresh shard."""
    with open_client(uris) as client:
        shard = client.open_shard(_shard_name("small"), SMALL_SCHEMA)
        writer = shard.writer()
        rows = [_small_row(i) for i in range(warmup + writes)]
        for t in rows[:warmup]:
            writer.append(t)
        samples: list[float] = []
        for t in rows[warmup:]:
            t0 = time.perf_counter()
            writer.append(t)
            samples.append(time.perf_counter() - t0)
        head = client.consensus.head(shard.machine.shard_id)
        row_bytes = len(head.data) if head is not None else 512
        cas = _cas_floor(client.consensus, writes, warmup, row_bytes)
    driver = _driver_floor(uris[1], writes, warmup, row_bytes)
    return LatencyResult(
        location=location,
        writes=writes,
        p50_ms=_percentile_ms(samples, 50),
        p95_ms=_percentile_ms(samples, 95),
        p99_ms=_percentile_ms(samples, 99),
        target_p50_ms=SMALL_WRITE_TARGET_P50_MS.get(location),
        cas_p50_ms=_percentile_ms(cas, 50),
        driver_p50_ms=None if driver is None else _percentile_ms(driver, 50),
    )


def _cas_floor(consensus: Consensus, writes: int, warmup: int, row_bytes: int) -> list[float]:
    """Seconds of each of ``writes`` compare-and-sets of ``row_bytes`` on a fresh key."""
    key = _shard_name("cas-floor")
    data = os.urandom(row_bytes)
    samples: list[float] = []
    for seqno in range(1, warmup + writes + 1):
        t0 = time.perf_counter()
        res = consensus.compare_and_set(
            key, None if seqno == 1 else seqno - 1, VersionedData(seqno, data)
        )
        if seqno > warmup:
            samples.append(time.perf_counter() - t0)
        assert isinstance(res, CaSCommitted), res
    return samples


_FLOOR_TABLE = "persist_bench_driver_floor"
_FLOOR_INSERT = (
    f"INSERT INTO {_FLOOR_TABLE} (shard, sequence_number, data) SELECT {{p}}, {{p}}, {{p}} "
    f"WHERE (SELECT max(sequence_number) FROM {_FLOOR_TABLE} WHERE shard = {{p}}) = {{p}}"
)
"""persist's compare-and-set statement, written for the driver (``{p}`` its placeholder)."""


def _driver_floor(
    consensus_uri: str, writes: int, warmup: int, row_bytes: int
) -> list[float] | None:
    """Seconds of each conditional INSERT through the database driver alone, or None for mem."""
    key, data = "floor", os.urandom(row_bytes)
    create = (
        f"CREATE TABLE {_FLOOR_TABLE} (shard TEXT NOT NULL, sequence_number BIGINT NOT NULL, "
        "data {blob} NOT NULL, PRIMARY KEY (shard, sequence_number))"
    )
    samples: list[float] = []
    if consensus_uri.startswith("sqlite:///"):
        import sqlite3

        path = consensus_uri.removeprefix("sqlite:///") + "-driver-floor"
        conn = sqlite3.connect(path, isolation_level=None)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            conn.execute(create.format(blob="BLOB"))
            conn.execute(f"INSERT INTO {_FLOOR_TABLE} VALUES (?, 0, ?)", (key, data))
            stmt = _FLOOR_INSERT.format(p="?")
            for seqno in range(1, warmup + writes + 1):
                t0 = time.perf_counter()
                conn.execute("BEGIN IMMEDIATE")
                conn.execute(stmt, (key, seqno, data, key, seqno - 1))
                conn.execute("COMMIT")
                if seqno > warmup:
                    samples.append(time.perf_counter() - t0)
        finally:
            conn.close()
        return samples
    if consensus_uri.startswith("postgres"):
        import psycopg

        with psycopg.connect(consensus_uri, autocommit=True) as pg:
            pg.execute(f"DROP TABLE IF EXISTS {_FLOOR_TABLE}")
            pg.execute(create.format(blob="BYTEA"))
            try:
                pg.execute(f"INSERT INTO {_FLOOR_TABLE} VALUES (%s, 0, %s)", (key, data))
                stmt = _FLOOR_INSERT.format(p="%s")
                for seqno in range(1, warmup + writes + 1):
                    t0 = time.perf_counter()
                    pg.execute(stmt, (key, seqno, data, key, seqno - 1))
                    if seqno > warmup:
                        samples.append(time.perf_counter() - t0)
            finally:
                pg.execute(f"DROP TABLE {_FLOOR_TABLE}")
        return samples
    return None


def measure_listen_latency(
    location: str,
    uris: tuple[str, str],
    samples: int,
    *,
    same_client: bool,
    gap_ms: float = 20.0,
    seed: int = 7,
) -> ListenLatencyResult:
    """Time from just before an append to a listener (another thread) receiving its event
    (:func:`~pyspark_persist.tools.bench.listen.probe_listen`).

    With ``same_client`` False the listener is a separate client with its own
    state cache, so it can only learn of the write by polling Consensus.
    """
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(open_client(uris))
        listener = client if same_client else stack.enter_context(open_client(uris))
        seen = probe_listen(
            client, listener, SMALL_SCHEMA, _small_row, samples, (0.0, gap_ms), seed=seed
        )
    if not seen.write_s:
        raise RuntimeError(f"the listener at {location} saw none of {samples} writes")
    return ListenLatencyResult(
        location=location,
        listener="same-client" if same_client else "polling",
        samples=len(seen.write_s),
        p50_ms=_percentile_ms(seen.write_s, 50),
        p95_ms=_percentile_ms(seen.write_s, 95),
        missed=seen.missed,
    )


def _raw_write(pool: ChunkPool, total_rows: int, path: str) -> float:
    """Seconds for pyarrow to write the rows to ``path`` (snappy) and fsync it once."""
    gc.collect()
    t0 = time.perf_counter()
    with pq.ParquetWriter(path, ROW_SCHEMA, compression="snappy") as pw:
        for chunk in pool.iter_rows(total_rows):
            pw.write_table(chunk)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def _raw_read(path: str, total_rows: int, batch_rows: int) -> float:
    """Seconds for pyarrow to stream every batch of ``path``."""
    gc.collect()
    t0 = time.perf_counter()
    rows = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        rows += batch.num_rows
    seconds = time.perf_counter() - t0
    if rows != total_rows:
        raise RuntimeError(f"raw read returned {rows} rows, wrote {total_rows}")
    return seconds


def _persist_write(
    client: PersistClient, pool: ChunkPool, total_rows: int
) -> tuple[str, float, int, int]:
    """Stage the rows into a fresh shard and commit them: (shard, seconds, parts, bytes)."""
    shard = client.open_shard(_shard_name("bulk"), ROW_SCHEMA)
    writer = shard.writer()
    gc.collect()
    t0 = time.perf_counter()
    builder = writer.builder()
    try:
        for chunk in pool.iter_rows(total_rows):
            builder.add(chunk)
        staged = builder.finish()
    except BaseException:
        builder.abort()
        raise
    upper = writer.upper
    result = writer.compare_and_append_batches([staged], upper, upper + 1, ts_rewrite=upper)
    seconds = time.perf_counter() - t0
    if not isinstance(result, Committed):
        raise RuntimeError(f"bulk commit to {shard.name} was not committed: {result!r}")
    return shard.name, seconds, len(staged.parts), staged.size_bytes


def _persist_read(
    uris: tuple[str, str], config: PersistConfig, shard: str, total_rows: int
) -> float:
    """Seconds to stream a snapshot of ``shard`` from a fresh client that never saw the write."""
    with open_client(uris, config) as client:
        reader = client.open_shard(shard).reader()
        gc.collect()
        t0 = time.perf_counter()
        rows = 0
        for table in reader.iter_snapshot():
            rows += table.num_rows
        seconds = time.perf_counter() - t0
    if rows != total_rows:
        raise RuntimeError(f"persist snapshot of {shard} returned {rows} rows, wrote {total_rows}")
    return seconds


def measure_throughput(
    location: str,
    uris: tuple[str, str],
    size_mib: int,
    config: BenchConfig,
    raw_dir: str,
) -> ThroughputResult:
    """Write then snapshot-read ``size_mib`` of generated rows with persist and with raw pyarrow.

    Both get the same chunks (pre-generated before the clock starts). Persist
    stages with one BatchBuilder and commits with compare_and_append_batches;
    the raw peer writes the chunks with ``pq.ParquetWriter`` (snappy) and
    fsyncs once. Reads stream every batch: persist via ``iter_snapshot``, raw
    via ``ParquetFile.iter_batches``. The four steps run interleaved
    ``config.repeats`` times and each keeps its fastest round, so a burst of
    load from other processes does not land on one side only.
    """
    total_rows = rows_for(size_mib * MiB)
    arrow_mib = total_rows * ROW_BYTES / MiB
    pool = ChunkPool(config.pool_chunks, min(config.chunk_rows, total_rows), config.seed)
    pcfg = config.persist_config
    best: dict[str, float] = {}

    def keep(name: str, seconds: float) -> None:
        best[name] = min(seconds, best.get(name, seconds))

    raw_file_mib = 0.0
    parts = encoded = 0
    with open_client(uris, pcfg) as client:
        for _ in range(max(1, config.repeats)):
            raw_path = os.path.join(raw_dir, f"raw-{uuid.uuid4().hex[:8]}.parquet")
            try:
                keep("raw_write", _raw_write(pool, total_rows, raw_path))
                raw_file_mib = os.path.getsize(raw_path) / MiB
                shard, seconds, parts, encoded = _persist_write(client, pool, total_rows)
                keep("persist_write", seconds)
                keep("persist_read", _persist_read(uris, pcfg, shard, total_rows))
                keep("raw_read", _raw_read(raw_path, total_rows, pcfg.read_batch_rows))
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(raw_path)
    return ThroughputResult(
        location=location,
        arrow_mib=arrow_mib,
        rows=total_rows,
        parts=parts,
        encoded_mib=encoded / MiB,
        persist_write_s=best["persist_write"],
        raw_write_s=best["raw_write"],
        persist_read_s=best["persist_read"],
        raw_read_s=best["raw_read"],
        raw_file_mib=raw_file_mib,
    )


# -- peak memory, in spawned children ---------------------------------------


def _status_kib(field_name: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` in bytes (None off Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_peak_rss() -> int:
    """Reset this process's RSS high-water mark where Linux allows it; return the current RSS.

    ``ru_maxrss`` survives ``execve``, so a spawned child would report its
    parent's peak at fork time; ``VmHWM`` belongs to the child's own address
    space, and writing ``5`` to ``/proc/self/clear_refs`` resets it to now.
    """
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    rss = _status_kib("VmRSS")
    if rss is None:
        return _peak_rss_bytes()
    return rss


def _peak_rss_bytes() -> int:
    """This process's peak RSS: ``VmHWM`` on Linux, else ``ru_maxrss``."""
    hwm = _status_kib("VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def _writer_child(
    uris: tuple[str, str],
    shard: str,
    rows: int,
    chunk_rows: int,
    part_bytes: int,
    n: int,
    seed: int,
) -> dict[str, float]:
    """In a spawned child: generate ``rows`` chunk by chunk, stage them, commit. Peaks out."""
    config = PersistConfig(part_target_bytes=part_bytes, max_outstanding_parts=n)
    with open_client(uris, config) as client:
        writer = client.open_shard(shard, ROW_SCHEMA).writer()
        gc.collect()
        base_rss = _reset_peak_rss()
        t0 = time.perf_counter()
        builder = writer.builder()
        for chunk in iter_generated(rows, chunk_rows, seed):
            builder.add(chunk)
            del chunk
        staged = builder.finish()
        upper = writer.upper
        writer.compare_and_append_batches([staged], upper, upper + 1, ts_rewrite=upper)
        seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "rows": float(rows),
        "arrow_pool_peak": float(pa.default_memory_pool().max_memory() or 0),
        "rss_growth": float(max(0, _peak_rss_bytes() - base_rss)),
    }


def _reader_child(uris: tuple[str, str], shard: str, part_bytes: int) -> dict[str, float]:
    """In a spawned child: stream the whole snapshot of ``shard``. Peaks out."""
    config = PersistConfig(part_target_bytes=part_bytes)
    with open_client(uris, config) as client:
        reader = client.open_shard(shard).reader()
        snap = reader.snapshot()
        gc.collect()
        base_rss = _reset_peak_rss()
        t0 = time.perf_counter()
        rows = 0
        for table in reader.iter_snapshot(snap.as_of):
            rows += table.num_rows
            del table
        seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "rows": float(rows),
        "arrow_pool_peak": float(pa.default_memory_pool().max_memory() or 0),
        "rss_growth": float(max(0, _peak_rss_bytes() - base_rss)),
    }


def _in_child(fn: Callable[..., dict[str, float]], *args: Any) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(fn, args)  # type: ignore[no-any-return]


def measure_memory(uris: tuple[str, str], config: BenchConfig) -> list[MemoryResult]:
    """Peak memory of a writer child staging ``size_mib`` and a reader child fetching it back."""
    rows = rows_for(config.size_mib * MiB)
    arrow_mib = rows * ROW_BYTES / MiB
    b = config.part_mib * MiB
    n = config.outstanding_parts
    shard = _shard_name("memory")
    with open_client(uris) as client:
        client.create_shard(shard, ROW_SCHEMA)
    chunk_rows = min(config.memory_chunk_rows, rows)
    w = _in_child(_writer_child, uris, shard, rows, chunk_rows, b, n, config.seed)
    r = _in_child(_reader_child, uris, shard, b)
    if int(r["rows"]) != rows:
        raise RuntimeError(f"memory reader child read {int(r['rows'])} rows, wrote {rows}")
    return [
        MemoryResult(
            role="writer",
            arrow_mib=arrow_mib,
            rows=rows,
            seconds=w["seconds"],
            arrow_pool_peak_mib=w["arrow_pool_peak"] / MiB,
            rss_growth_mib=w["rss_growth"] / MiB,
            bound_mib=b * (2 * n + 1) / MiB,
            bound_formula=f"B*(2N+1) = {config.part_mib}*{2 * n + 1}",
            generator_chunk_mib=chunk_rows * ROW_BYTES / MiB,
        ),
        MemoryResult(
            role="reader",
            arrow_mib=arrow_mib,
            rows=rows,
            seconds=r["seconds"],
            arrow_pool_peak_mib=r["arrow_pool_peak"] / MiB,
            rss_growth_mib=r["rss_growth"] / MiB,
            bound_mib=3 * b / MiB,
            bound_formula=f"3B = 3*{config.part_mib}",
            generator_chunk_mib=0.0,
        ),
    ]


# ---------------------------------------------------------------------------
# Driver and report


def _machine_info(config: BenchConfig) -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "pyarrow": pa.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "arrow_memory_pool": pa.default_memory_pool().backend_name,
    }


def run_core(config: BenchConfig, progress: Callable[[str], None] | None = None) -> CoreReport:
    """Run every phase of ``config`` and return what was measured."""
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    report = CoreReport(config=config, machine=_machine_info(config))
    with Locations(config) as locs:
        reachable: dict[str, bool] = {}

        def uris(location: str) -> tuple[str, str] | None:
            if reachable.get(location) is False:
                return None
            u = locs.uris(location)
            reachable[location] = u is not None
            return u

        if "latency" in config.phases:
            for loc in config.locations:
                u = uris(loc)
                if u is not None:
                    say(f"small writes: {loc}")
                    report.latency.append(
                        measure_small_writes(loc, u, config.writes, config.warmup)
                    )
        if "listen" in config.phases:
            for loc in config.locations:
                for same in (False, True):
                    u = uris(loc)
                    if u is not None:
                        say(f"write-to-listen ({'same client' if same else 'polling'}): {loc}")
                        report.listen.append(
                            measure_listen_latency(
                                loc,
                                u,
                                config.listen_samples,
                                same_client=same,
                                gap_ms=config.listen_gap_ms,
                                seed=config.seed,
                            )
                        )
        if "throughput" in config.phases:
            for loc in config.throughput_locations:
                size = config.s3_size_mib if loc.startswith("s3/") else config.size_mib
                if size <= 0 or loc not in config.locations:
                    continue
                u = uris(loc)
                if u is not None:
                    say(f"throughput ({size} MiB): {loc}")
                    report.throughput.append(measure_throughput(loc, u, size, config, locs.tmp))
                    gc.collect()
        if "memory" in config.phases:
            u = uris("file/sqlite")
            if u is not None:
                say(f"peak memory ({config.size_mib} MiB, child processes): file/sqlite")
                report.memory.extend(measure_memory(u, config))
        report.notes.extend(dict.fromkeys(locs.notes))
    report.seconds = time.perf_counter() - started
    return report


def _verdict(ok: bool | None) -> str:
    return "" if ok is None else ("ok" if ok else "MISSED")


def format_report(report: CoreReport) -> str:
    """The report as a readable table."""
    cfg = report.config
    m = report.machine
    out: list[str] = []
    out.append(
        f"persist bench core  (python {m['python']}, pyarrow {m['pyarrow']}, {m['cpus']} cpus; "
        f"B = {cfg.part_mib} MiB part target, N = {cfg.outstanding_parts} parts in flight)"
    )
    for note in report.notes:
        out.append(f"note: {note}")
    if report.latency:
        out.append("")
        out.append(
            f"Small-write latency: append(one-row table), {cfg.writes} writes after "
            f"{cfg.warmup} warm-up"
        )
        out.append(
            f"  {'location':<14}{'p50':>10}{'p95':>10}{'p99':>10}   {'target p50':<20}"
            f"{'CaS alone':>10}{'driver':>10}"
        )
        for r in report.latency:
            target = (
                f"<= {r.target_p50_ms:g} ms {_verdict(r.meets_target)}"
                if r.target_p50_ms is not None
                else "-"
            )
            floors = "".join(
                f"{'-':>10}" if v is None else f"{v:>7.3f} ms"
                for v in (r.cas_p50_ms, r.driver_p50_ms)
            )
            out.append(
                f"  {r.location:<14}{r.p50_ms:>7.3f} ms{r.p95_ms:>7.3f} ms{r.p99_ms:>7.3f} ms"
                f"   {target:<20}{floors}"
            )
        out.append(
            "  (floors, p50 in the same run: the append's compare-and-set alone through "
            "persist's Consensus, and the same conditional INSERT through the database driver)"
        )
    if report.listen:
        out.append("")
        out.append(
            f"Write-to-listen latency: {cfg.listen_samples} appends, random gap "
            f"0-{cfg.listen_gap_ms:g} ms, listener in another thread"
        )
        out.append(f"  {'location':<14}{'listener':<48}{'p50':>10}{'p95':>10}")
        for lr in report.listen:
            kind = (
                "separate client, polling Consensus"
                if lr.listener == "polling"
                else "same client, in-process wake-up"
            )
            missed = f"  ({lr.missed} missed)" if lr.missed else ""
            out.append(
                f"  {lr.location:<14}{kind:<48}{lr.p50_ms:>7.2f} ms{lr.p95_ms:>7.2f} ms{missed}"
            )
    if report.throughput:
        out.append("")
        out.append(
            "Throughput: goodput = Arrow MiB of user rows / wall seconds; raw = pyarrow Parquet "
            f"(snappy) on the same rows, same run; best of {cfg.repeats} interleaved rounds"
        )
        out.append(
            f"  {'location':<14}{'MiB':>6}{'parts':>6}  {'persist write':>14}{'raw write':>12}"
            f"{'ratio':>8}  {'persist read':>14}{'raw read':>12}{'ratio':>8}"
        )
        for t in report.throughput:
            out.append(
                f"  {t.location:<14}{t.arrow_mib:>6.0f}{t.parts:>6}  "
                f"{t.persist_write_mib_s:>8.1f} MiB/s{t.raw_write_mib_s:>6.1f} MiB/s"
                f"{t.write_ratio:>6.2f}x {_verdict(t.write_ratio >= RATIO_TARGET):<6}"
                f"{t.persist_read_mib_s:>8.1f} MiB/s{t.raw_read_mib_s:>6.1f} MiB/s"
                f"{t.read_ratio:>6.2f}x {_verdict(t.read_ratio >= RATIO_TARGET)}"
            )
        out.append(
            f"  (targets: ratios >= {RATIO_TARGET}; encoded parts "
            + ", ".join(
                f"{t.location} {t.encoded_mib:.0f} MiB vs raw file {t.raw_file_mib:.0f} MiB"
                for t in report.throughput
            )
            + ")"
        )
    if report.memory:
        out.append("")
        out.append(
            f"Peak memory: child processes on file/sqlite, {report.memory[0].arrow_mib:.0f} MiB "
            "of rows (RSS growth = peak RSS - RSS after imports and client setup)"
        )
        out.append(f"  {'role':<34}{'arrow pool peak':>16}{'RSS growth':>12}{'model bound':>26}")
        for mr in report.memory:
            role = (
                f"writer staging+commit ({mr.seconds:.1f} s)"
                if mr.role == "writer"
                else f"reader snapshot fetch ({mr.seconds:.1f} s)"
            )
            out.append(
                f"  {role:<34}{mr.arrow_pool_peak_mib:>12.0f} MiB{mr.rss_growth_mib:>8.0f} MiB"
                f"{mr.bound_formula:>18} = {mr.bound_mib:.0f} MiB  "
                f"{'within' if mr.within else 'OVER'}"
            )
        gen = [mr for mr in report.memory if mr.generator_chunk_mib]
        if gen:
            out.append(
                f"  (the writer's peaks include its generator's chunk, "
                f"{gen[0].generator_chunk_mib:.2f} MiB)"
            )
    out.append("")
    out.append(f"total {report.seconds:.1f} s")
    return "\n".join(out)


BENCHMARK = Benchmark(
    "core", BenchConfig, lambda config: run_core(config, step), format_report, __doc__
)
"""``persist bench core``."""

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
