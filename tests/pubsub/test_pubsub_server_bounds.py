"""The PubSub server under clients that misbehave: it stays small, says what is wrong, and
keeps idle clients connected.

- A subscriber that never reads has its stream ended once a bounded number of
  messages waits for it; an older client's large pushes (which carried the diff) are
  forwarded without it, so they cannot grow the server; memory comes back when the
  connections end.
- Malformed messages, empty and huge shard names end the stream with INVALID_ARGUMENT.
- The client's keepalive respects the server's ping policy: an idle client is not
  sent GOAWAY ``too_many_pings``.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pyspark_persist.pubsub import grpc_client
from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc
from pyspark_persist.pubsub import server as server_module
from pyspark_persist.pubsub.grpc_client import GrpcPublisher
from pyspark_persist.pubsub.server import PubSubServer
from pyspark_persist.state.cache import SharedState

TOPIC = "0123456789abcdef/shard"
MiB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def push(seqno: int, topic: str = TOPIC) -> pb.ProtoPubSubMessage:
    return pb.ProtoPubSubMessage(push_diff=pb.ProtoPushDiff(shard_id=topic, seqno=seqno))


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def older_push(seqno: int, size: int) -> pb.ProtoPubSubMessage:
    """A push as an older client sent it: with ``size`` bytes of diff in field 3."""
    body = push(seqno).push_diff.SerializeToString() + b"\x1a" + _varint(size) + b"d" * size
    return pb.ProtoPubSubMessage.FromString(b"\x0a" + _varint(len(body)) + body)


def subscribe(topic: str = TOPIC) -> pb.ProtoPubSubMessage:
    return pb.ProtoPubSubMessage(subscribe=pb.ProtoSubscribe(shard=topic))


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``python -m pyspark_persist.pubsub serve`` in a child process (its RSS is measured)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyspark_persist.pubsub", "serve", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert b"serving on" in proc.stdout.readline()
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_subscriber_that_never_reads_cannot_grow_the_server(
    server_process: tuple[subprocess.Popen[bytes], str],
) -> None:
    """300 pushes of 1 MiB (an older client's, diff included) to a topic whose subscriber
    never reads: the server queues only their SeqNos, stays small, and gives memory back."""
    proc, address = server_process
    time.sleep(0.5)  # let the server finish starting before the baseline
    baseline = rss_mib(proc.pid)
    stop = threading.Event()

    def requests() -> Iterator[pb.ProtoPubSubMessage]:
        yield subscribe()
        stop.wait(60)

    sub_channel = grpc.insecure_channel(address)
    slow = pb_grpc.ProtoPersistPubSubStub(sub_channel).PubSub(requests())
    assert next(slow).WhichOneof("message") == "subscribe"  # acknowledged; never read again
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ProtoPersistPubSubStub(ch)
        for _ in stub.PubSub((older_push(i, MiB) for i in range(1, 301)), timeout=120):
            pass
    time.sleep(0.5)
    during = rss_mib(proc.pid)
    stop.set()
    slow.cancel()
    sub_channel.close()
    time.sleep(1.0)
    after = rss_mib(proc.pid)
    print(
        f"\npubsub server RSS: baseline {baseline:.0f} MiB, after 300 x 1 MiB to a stalled "
        f"subscriber {during:.0f} MiB (+{during - baseline:.0f}), after it left {after:.0f} MiB "
        f"(+{after - baseline:.0f})"
    )
    assert during - baseline < 150, "the server queued the pushes for a subscriber that never reads"
    assert after - baseline < 64, "the server kept the memory after the connections ended"


def test_a_subscriber_that_never_reads_has_a_bounded_queue() -> None:
    """A connection queues at most CONNECTION_QUEUE messages: the next one ends its stream
    (the subscriber reconnects and catches up from Consensus) and frees what was queued."""
    conn = server_module._Conn("peer")
    for i in range(1, server_module.CONNECTION_QUEUE + 1):
        assert conn.offer(push(i), 30)
    assert conn.queued_bytes == 30 * server_module.CONNECTION_QUEUE
    assert not conn.offer(push(server_module.CONNECTION_QUEUE + 1), 30)
    assert conn.ended and conn.queued_bytes == 0


def raw_status(address: str, messages: list[pb.ProtoPubSubMessage]) -> Any:
    """The status a stream of ``messages`` ends with (OK when it ends cleanly)."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.ProtoPersistPubSubStub(ch)
        try:
            for _ in stub.PubSub(iter(messages), timeout=10):
                pass
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize(
    "messages",
    [
        [pb.ProtoPubSubMessage()],
        [subscribe("")],
        [subscribe("0123456789abcdef/" + "x" * MiB)],
        [subscribe("0123456789abcdef/")],
        [subscribe("not-a-topic")],
        [subscribe("0123456789abcdef/../etc")],
        [push(1, topic="")],
        [push(0)],
        [subscribe(), pb.ProtoPubSubMessage()],
    ],
    ids=[
        "no-kind",
        "empty-shard",
        "1MiB-shard",
        "no-shard",
        "no-tag",
        "dotdot",
        "push-empty-topic",
        "push-seqno-0",
        "late-junk",
    ],
)
def test_bad_input_is_invalid_argument(messages: list[pb.ProtoPubSubMessage]) -> None:
    server = PubSubServer("127.0.0.1", 0).start()
    try:
        assert raw_status(server.address, messages) == grpc.StatusCode.INVALID_ARGUMENT
        assert server.counters["invalid"] == 1
        assert raw_status(server.address, [subscribe()]) == grpc.StatusCode.OK
    finally:
        server.stop()


def _scaled(options: list[tuple[str, Any]], factor: int) -> list[tuple[str, Any]]:
    """The same gRPC options with every millisecond interval divided by ``factor``."""
    return [(k, v // factor if k.endswith("_ms") else v) for k, v in options]


def test_idle_clients_are_not_sent_goaway_for_pinging(monkeypatch: pytest.MonkeyPatch) -> None:
    """The product's client and server keepalive settings, ten times faster: an idle client
    pings as often as it is configured to and the server accepts it (no GOAWAY, no reconnect)."""
    monkeypatch.setattr(server_module, "SERVER_OPTIONS", _scaled(server_module.SERVER_OPTIONS, 10))
    monkeypatch.setattr(grpc_client, "CHANNEL_OPTIONS", _scaled(grpc_client.CHANNEL_OPTIONS, 10))
    server = PubSubServer("127.0.0.1", 0).start()
    location = "sqlite:////nonexistent/pyspark-persist-keepalive.db"
    pub = GrpcPublisher(server.address, location)
    try:
        pub.subscribe("idle", SharedState("idle"), location)
        deadline = time.monotonic() + 10
        while not pub.connected:
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.02)
        time.sleep(9.0)  # several keepalive intervals with nothing to send
        metrics = pub.metrics()
        assert pub.connected and metrics["disconnects"] == 0, metrics
    finally:
        pub.close()
        server.stop()
