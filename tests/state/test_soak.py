"""Soak: a long-running writer and reader keep flat memory, file descriptors and connections.

A leak that costs a few KiB or one socket per write is invisible in a unit
test and fatal after a week. This runs a writer, a snapshot reader and a
listener in one process against file:// Blob and PostgreSQL Consensus (with
background compaction and GC) for ``PERSIST_SOAK_S`` seconds (default 20),
sampling RSS (``/proc/self/statm``), open fds (``/proc/self/fd``) and this
client's PostgreSQL connections (``pg_stat_activity`` by application name).
After a warm-up (the first quarter) nothing may keep growing beyond a
generous bound. Run longer with ``PERSIST_SOAK_S=3600 pytest tests/test_soak.py -s``.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig

SOAK_S = float(os.environ.get("PERSIST_SOAK_S", "20"))
RSS_GROWTH_MAX = 48 << 20
"""After warm-up RSS may grow this much (allocator noise, caches) but not per write."""
FD_GROWTH_MAX = 4
CONN_MAX = 8


def rss_bytes() -> int:
    """Resident set size of this process, from /proc (no psutil needed)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    """Open file descriptors of this process."""
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.slow
@pytest.mark.postgres
def test_soak_resources_stay_flat(postgres_url: str, tmp_path: Path) -> None:
    """RSS, fds and DB connections after warm-up stay within bounds; figures are printed."""
    app = f"persist-soak-{uuid.uuid4().hex[:8]}"
    uri = f"{postgres_url}?application_name={app}"

    def connections() -> int:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                "AND application_name = %s",
                ("test", app),
            ).fetchone()
            return int(row[0]) if row else 0

    config = PersistConfig(gc_interval=8, compaction_fan_in=4, heartbeat_interval_s=1.0)
    schema = pa.schema([("id", pa.int64()), ("s", pa.string())])
    samples: list[tuple[float, int, int, int]] = []
    with PersistClient.open(f"file://{tmp_path}/blob", uri, config=config) as client:
        shard = client.open_shard(f"soak-{uuid.uuid4().hex[:8]}", schema)
        writer = shard.writer("soak-writer")
        reader = shard.reader("soak-reader")
        writer.append(pa.table({"id": [0], "s": ["x"]}, schema=schema))
        listen = reader.listen(reader.latest_as_of())
        start = time.monotonic()
        next_sample = start
        n = 0
        rows = 0
        while time.monotonic() - start < SOAK_S:
            n += 1
            batch = 200 if n % 10 == 0 else 5
            writer.append(
                pa.table(
                    {"id": list(range(n * 1000, n * 1000 + batch)), "s": [f"row-{n}"] * batch},
                    schema=schema,
                )
            )
            rows += batch
            while (event := listen.next(timeout_s=0)) is not None:
                reader.fetch(event.parts)
            if n % 5 == 0:
                assert reader.snapshot_table().num_rows == rows + 1
                reader.downgrade_since(listen.frontier - 1)
            if time.monotonic() >= next_sample:
                samples.append((time.monotonic() - start, rss_bytes(), open_fds(), connections()))
                next_sample += max(SOAK_S / 20, 0.5)
        listen.close()
        samples.append((time.monotonic() - start, rss_bytes(), open_fds(), connections()))
        reader.close()
    warm = next(s for s in samples if s[0] >= SOAK_S / 4)
    end = samples[-1]
    mib = 1 << 20
    print(
        f"\nsoak {SOAK_S:.0f}s, {n} writes, {rows} rows: RSS start {samples[0][1] / mib:.1f} "
        f"MiB, after warm-up {warm[1] / mib:.1f} MiB, end {end[1] / mib:.1f} MiB; fds "
        f"{samples[0][2]} -> {warm[2]} -> {end[2]}; DB connections {samples[0][3]} -> "
        f"{warm[3]} -> {end[3]}"
    )
    assert end[1] - warm[1] < RSS_GROWTH_MAX, samples
    assert end[2] - warm[2] <= FD_GROWTH_MAX, samples
    assert max(s[3] for s in samples) <= CONN_MAX, samples
    assert end[3] - warm[3] <= 1, samples
    assert n > 50, "the soak barely ran"
