"""``persist pubsub serve --metrics-port N --consumer-lag``: each named consumer's lag as a gauge.

Checked twice: :class:`ConsumerLag` alone under a fake clock (a scrape reads Consensus again
only after a push of the shard or once its state is ``max_age_s`` old, so scrapes stay
cheap), and the command an operator starts, scraped while a writer with PubSub commits.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.offsets import LISTEN, Offset, offset_json
from pyspark_persist.pubsub.consumer_lag import ConsumerLag
from pyspark_persist.pubsub.subscriptions import location_key, make_topic
from pyspark_persist.state import PersistClient, PersistConfig

SHARD = "events"
SAMPLE = re.compile(
    r'^(?P<name>[a-z_]+)\{shard="(?P<shard>[^"]+)",consumer="(?P<c>[^"]+)"\} (\d+)$'
)


GRPC_SHUTDOWN = (
    "Task was destroyed but it is pending!",
    "task: <Task pending name='rpc_task'",
    "Traceback (most recent call last):",
    'File "src/python/grpcio/grpc/_cython/_cygrpc/aio/server.pyx.pxi"',
    "GeneratorExit",
)
"""The lines of gRPC's asyncio shutdown report (see the end of the serve test)."""


def gauges(text: str) -> dict[tuple[str, str, str], int]:
    """(metric, shard, consumer) -> value, after checking each metric's HELP and TYPE lines."""
    out: dict[tuple[str, str, str], int] = {}
    typed: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:]
            if name.startswith("persist_consumer_"):
                assert kind == "gauge", line
                typed.add(name)
        elif line and not line.startswith("#"):
            match = SAMPLE.match(line)
            if match is None:
                continue  # the server's own counters
            assert match["name"] in typed, line
            out[(match["name"], match["shard"], match["c"])] = int(match.group(4))
    return out


def lag(text: str, metric: str, consumer: str = "to-pg") -> int:
    return gauges(text)[(f"persist_consumer_{metric}", SHARD, consumer)]


@pytest.fixture
def location(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Shard ``events``: 3 commits of 2 rows at times [0,10), [10,20), [20,30); consumer
    ``to-pg`` committed up to 10, ``idle`` never committed, held by no live query."""
    uris = (f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/consensus.db")
    client = PersistClient.open(*uris, config=PersistConfig(maintenance=False))
    shard = client.open_shard(SHARD, pa.schema([("id", pa.int64())]))
    writer = shard.writer("w")
    for i in range(3):
        writer.compare_and_append(pa.table({"id": [i, -i]}), i * 10, i * 10 + 10, token=i + 1)
    held = shard.acquire_consumer("to-pg", "query A")
    position = offset_json(Offset(SHARD, 1, 10, LISTEN))
    shard.advance_consumer("to-pg", held.epoch, position=position, upper=10, since=9)
    shard.acquire_consumer("idle", "query B", reader_id="a-reader-long-gone")
    client.close()
    yield uris


def _append(uris: tuple[str, str], lower: int, pubsub: str | None = None) -> None:
    """Three more rows at ``[lower, lower + 10)``, pushed to ``pubsub`` when given."""
    from pyspark_persist.pubsub import open_client

    client = open_client(*uris, pubsub=pubsub, config=PersistConfig(maintenance=False))
    try:
        writer = client.open_shard(SHARD, create=False).writer("w")
        writer.compare_and_append(pa.table({"id": [7, 8, 9]}), lower, lower + 10, token=lower)
    finally:
        client.close()


def test_gauges_come_from_cached_state_read_again_after_a_push_or_max_age(
    location: tuple[str, str],
) -> None:
    now = [0.0]
    client = PersistClient.open(*location, config=PersistConfig(maintenance=False))
    try:
        exporter = ConsumerLag(client, max_age_s=30, clock=lambda: now[0])
        first = exporter.render()
        assert (lag(first, "behind_rows"), lag(first, "behind_times")) == (4, 20)
        assert lag(first, "behind_bytes") > 0 and lag(first, "held") == 1
        assert (lag(first, "behind_rows", "idle"), lag(first, "held", "idle")) == (6, 0)

        _append(location, 30)  # by a writer without PubSub: no push
        assert exporter.render() == first  # the cached state, not Consensus
        topic = make_topic(location_key(location[1]) or "", SHARD)
        exporter.pushed(make_topic("another-location", SHARD), 99)  # not this location's
        assert exporter.render() == first
        exporter.pushed(topic, 99)  # a push past the cached SeqNo: read Consensus
        pushed = exporter.render()
        assert (lag(pushed, "behind_rows"), lag(pushed, "behind_times")) == (7, 30)

        # That SeqNo was never reached (a forged push): it cost one read, not one per scrape.

        _append(location, 40)
        now[0] = 29.0
        assert lag(exporter.render(), "behind_rows") == 7
        now[0] = 31.0  # older than max_age_s: read again without a push
        assert lag(exporter.render(), "behind_rows") == 10
    finally:
        client.close()


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_serve_exports_the_lag_and_follows_pushes(location: tuple[str, str]) -> None:
    blob, consensus = location
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "pyspark_persist.tools.cli"),
            *("--blob", blob, "--consensus", consensus),
            *("pubsub", "serve", "--port", "0", "--metrics-port", "0", "--consumer-lag"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    serving, metrics = proc.stdout.readline(), proc.stdout.readline()
    try:
        assert f"with the consumers' lag of {consensus}" in metrics, (serving, metrics)
        address = serving.split("serving on ")[1].split()[0]
        url = metrics.split("metrics on ")[1].split()[0]
        text = _scrape(url)
        assert "persist_pubsub_connections 0" in text  # the server's counters are still there
        assert lag(text, "behind_rows") == 4
        _append(location, 30, pubsub=address)  # pushes its commit to the server
        deadline = time.monotonic() + 10
        while lag(_scrape(url), "behind_rows") != 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lag(_scrape(url), "behind_rows") == 7
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    # gRPC's asyncio server may report the writer's ended stream as a task still pending when
    # it is terminated right after (plain `pubsub serve` does too): that, and nothing else.
    assert all(line.strip().startswith(GRPC_SHUTDOWN) for line in stderr.splitlines()), stderr
