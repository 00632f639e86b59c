"""``persist pubsub serve --metrics-port``: Prometheus' text format over HTTP on loopback, and
the counters move as clients connect, push and leave.

The server runs as the command an operator starts; the test scrapes it the way Prometheus
does (``GET /metrics``) and drives it with raw gRPC streams, so each step's effect is known
before the next scrape (a pusher's stream ends only after the server handled every push).
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc
from pyspark_persist.pubsub.prometheus import CONTENT_TYPE, METRICS, MetricsEndpoint
from pyspark_persist.pubsub.server import PubSubServer
from pyspark_persist.state.errors import InvalidUsage

SAMPLE = re.compile(r"^(?P<name>[a-z_]+) (?P<value>\d+)$")


def push(topic: str, seqno: int) -> pb.ProtoPubSubMessage:
    return pb.ProtoPubSubMessage(push_diff=pb.ProtoPushDiff(shard_id=topic, seqno=seqno))


def subscribe(topic: str) -> pb.ProtoPubSubMessage:
    return pb.ProtoPubSubMessage(subscribe=pb.ProtoSubscribe(shard=topic))


def scrape(url: str) -> dict[str, int]:
    """One scrape: every sample, after checking the format's HELP and TYPE lines."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers["Content-Type"] == CONTENT_TYPE
        text = response.read().decode()
    samples: dict[str, int] = {}
    lines = text.splitlines()
    for i in range(0, len(lines), 3):
        help_line, type_line, sample = lines[i : i + 3]
        match = SAMPLE.match(sample)
        assert match is not None, sample
        name = match["name"]
        assert help_line.startswith(f"# HELP {name} ")
        assert type_line in (f"# TYPE {name} counter", f"# TYPE {name} gauge")
        assert type_line.endswith("counter") == name.endswith("_total")
        samples[name] = int(match["value"])
    return samples


@pytest.fixture
def served() -> Iterator[tuple[str, str]]:
    """``persist pubsub serve --port 0 --metrics-port 0``: (gRPC address, metrics URL)."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "pyspark_persist.tools.cli"),
            *("pubsub", "serve", "--port", "0", "--metrics-port", "0"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    serving = proc.stdout.readline()
    metrics = proc.stdout.readline()
    try:
        assert "serving on 127.0.0.1:" in serving, serving
        assert "metrics on http://127.0.0.1:" in metrics, metrics
        yield serving.split("serving on ")[1].split()[0], metrics.split("metrics on ")[1].strip()
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    assert stderr == "", "scrapes and clients are not logged"


def test_metrics_move_with_connections_and_pushes(
    served: tuple[str, str],
) -> None:
    address, url = served
    before = scrape(url)
    assert set(before) == {name for name, _, _, _ in METRICS}
    assert all(value == 0 for value in before.values()), before

    # A subscriber that reads, a subscriber that never does, and a pusher of 3 pushes.
    fast_topic, slow_topic = "0123456789abcdef/fast", "0123456789abcdef/slow"
    leave = threading.Event()

    def listening(topic: str) -> Iterator[pb.ProtoPubSubMessage]:
        yield subscribe(topic)
        leave.wait(60)

    with grpc.insecure_channel(address) as sub_channel, grpc.insecure_channel(address) as slow_ch:
        fast = pb_grpc.ProtoPersistPubSubStub(sub_channel).PubSub(listening(fast_topic))
        assert next(fast).WhichOneof("message") == "subscribe"
        slow = pb_grpc.ProtoPersistPubSubStub(slow_ch).PubSub(listening(slow_topic))
        assert next(slow).WhichOneof("message") == "subscribe"  # and never read again
        with grpc.insecure_channel(address) as ch:
            pusher = pb_grpc.ProtoPersistPubSubStub(ch)
            pushes = [push(fast_topic, i) for i in (1, 2, 3)]
            list(pusher.PubSub(iter(pushes), timeout=30))
        assert [next(fast).push_diff.seqno for _ in range(3)] == [1, 2, 3]
        pushed_bytes = sum(m.ByteSize() for m in pushes)
        during = scrape(url)
        assert during["persist_pubsub_connections"] == 2  # the pusher has gone
        assert during["persist_pubsub_connections_total"] == 3
        assert during["persist_pubsub_topics"] == 2
        assert during["persist_pubsub_diffs_received_total"] == 3
        assert during["persist_pubsub_diff_bytes_received_total"] == pushed_bytes
        assert during["persist_pubsub_diffs_forwarded_total"] == 3
        assert during["persist_pubsub_diff_bytes_forwarded_total"] == pushed_bytes
        assert during["persist_pubsub_slow_subscribers_dropped_total"] == 0
        # (A subscriber is dropped once CONNECTION_QUEUE pushes wait for it beyond what
        # gRPC's windows hold: test_pubsub_server_bounds checks that bound.)
        leave.set()
        fast.cancel()
        slow.cancel()


def test_the_endpoint_stays_on_loopback_unless_allowed() -> None:
    server = PubSubServer("127.0.0.1", 0)
    with pytest.raises(InvalidUsage, match="--metrics-host 127.0.0.1"):
        MetricsEndpoint(server, "0.0.0.0", 0)
    endpoint = MetricsEndpoint(server, "127.0.0.1", 0).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(endpoint.url.replace("/metrics", "/"), timeout=10)
        assert e.value.code == 404
        assert scrape(endpoint.url)["persist_pubsub_connections"] == 0  # before it serves
    finally:
        endpoint.stop()


def test_every_pubsub_counter_has_a_count() -> None:
    """``PubSubCount`` names each public counter of ``PubSubMetrics`` exactly once, and
    ``incr`` adds to that counter only (no I/O)."""
    from dataclasses import fields

    from pyspark_persist.pubsub.metrics import PubSubCount, PubSubMetrics

    counters = [f.name for f in fields(PubSubMetrics) if not f.name.startswith("_")]
    assert sorted(c.value for c in PubSubCount) == sorted(counters)
    metrics = PubSubMetrics()
    metrics.incr(PubSubCount.APPLIED_CLEANLY, 2)
    snapshot = metrics.snapshot()
    assert snapshot["applied_cleanly"] == 2
    assert sum(snapshot[c] for c in counters) == 2
