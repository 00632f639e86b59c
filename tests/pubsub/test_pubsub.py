"""PubSub: pushed diffs between processes, and everything still exact when pushes misbehave.

Servers run on loopback with OS-assigned ports, started and stopped by the
tests; other processes are plain ``python`` subprocesses running a small
script, so "another process" really is one. Every wait is bounded.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist import pubsub
from pyspark_persist.pubsub import auto
from pyspark_persist.pubsub.grpc_client import GrpcPublisher
from pyspark_persist.pubsub.server import PubSubServer
from pyspark_persist.pubsub.subscriptions import BasePublisher
from pyspark_persist.state import Committed, PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.diff import encode, full_diff
from pyspark_persist.state.machine import DiffPublisher
from pyspark_persist.state.state import ShardState

SCHEMA = pa.schema([("id", pa.int64())])
NO_MAINT = PersistConfig(maintenance=False)


def row(i: int) -> pa.Table:
    return pa.table({"id": [i]}, schema=SCHEMA)


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


def applied_before_the_listen_reads(client: PersistClient, at_least: int) -> None:
    """Wait until ``client`` applied ``at_least`` pushes cleanly (one read may confirm
    several), before the test's listen reads what they announce: a listen that polled
    Consensus first (it does when a push is late, as on a loaded machine) would make them
    duplicates, and the test could not tell a working push from a late one."""
    wait_until(
        lambda: client.pubsub_metrics()["applied_cleanly"] >= at_least,
        what=f"{at_least} push(es) applied cleanly",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_client(
    uris: tuple[str, str], publisher: DiffPublisher | None, config: PersistConfig = NO_MAINT
) -> PersistClient:
    """A client with its own state cache: as far as state goes, another process."""
    return PersistClient(
        open_blob(uris[0]),
        open_consensus(uris[1]),
        config=config,
        publisher=publisher,
        cache=StateCache(),
    )


def state_bytes(state: ShardState | None) -> bytes:
    assert state is not None
    return encode(full_diff(state))


@pytest.fixture
def uris(tmp_path: Path) -> tuple[str, str]:
    return f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/consensus.db"


@pytest.fixture
def server() -> Iterator[PubSubServer]:
    srv = PubSubServer("127.0.0.1", 0).start()
    yield srv
    srv.stop()


def collect(listen: object, want: set[int], reader: object, timeout_s: float = 10.0) -> set[int]:
    """Ids seen by ``listen`` until ``want`` is covered or the timeout passes."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:  # at least one next(), so an empty ``want`` drains a pending catch-up read
        left = deadline - time.monotonic()
        ev = listen.next(timeout_s=max(0.0, min(0.5, left)))  # type: ignore[attr-defined]
        if ev is not None and ev.parts:
            seen.update(reader.fetch(ev.parts).column("id").to_pylist())  # type: ignore[attr-defined]
        if (want and want <= seen) or time.monotonic() >= deadline:
            return seen


# A reader (or mere holder) in another process. It counts every Consensus read.
CHILD = textwrap.dedent(
    """
    import json, sys, time
    from pyspark_persist import pubsub
    from pyspark_persist.state import Committed, PersistClient, PersistConfig
    from pyspark_persist.state.blob import open_blob
    from pyspark_persist.state.consensus import Consensus, open_consensus

    class Counting(Consensus):
        def __init__(self, inner):
            self.inner, self.reads = inner, 0
        @property
        def uri(self):
            return self.inner.uri
        def head(self, key):
            self.reads += 1
            return self.inner.head(key)
        def compare_and_set(self, key, expected, new):
            return self.inner.compare_and_set(key, expected, new)
        def scan(self, key, from_seqno, limit=None):
            self.reads += 1
            return self.inner.scan(key, from_seqno, limit)
        def truncate(self, key, seqno):
            return self.inner.truncate(key, seqno)
        def list_keys(self):
            self.reads += 1
            return self.inner.list_keys()

    blob, cons, spec, shard_name, n, mode = sys.argv[1:7]
    n = int(n)
    counting = Counting(open_consensus(cons))
    client = PersistClient(open_blob(blob), counting, publisher=pubsub.connect(spec, cons),
                           config=PersistConfig(maintenance=False))
    shard = client.open_shard(shard_name)
    reader = shard.reader()
    listen = reader.listen(reader.latest_as_of())
    deadline = time.monotonic() + 15
    while not shard.machine.shared.push_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    listen.next(timeout_s=0.2)  # the catch-up read after subscribing
    print("READY", shard.machine.shared.push_healthy, flush=True)
    if mode == "hold":
        while True:
            time.sleep(1)
    reads0 = counting.reads
    seen = set()
    deadline = time.monotonic() + 20
    while len(seen) < n and time.monotonic() < deadline:
        ev = listen.next(timeout_s=1.0)
        if ev is not None and ev.parts:
            seen.update(reader.fetch(ev.parts).column("id").to_pylist())
    print(json.dumps({"seen": sorted(seen), "reads": counting.reads - reads0,
                      "metrics": client.pubsub_metrics()}), flush=True)
    """
)


def spawn_child(
    tmp_path: Path, uris: tuple[str, str], spec: str, shard: str, n: int, mode: str = "read"
) -> subprocess.Popen[str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen(
        [sys.executable, str(script), uris[0], uris[1], spec, shard, str(n), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # READY True
    if not line.startswith("READY"):
        proc.kill()
        raise AssertionError(f"child did not start: {line!r} {proc.stderr.read()}")  # type: ignore[union-attr]
    assert line.split()[1] == "True", "the child never got a subscription acknowledged"
    return proc


def child_result(proc: subprocess.Popen[str]) -> dict[str, object]:
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    result: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------


def test_reader_in_another_process_follows_writes_by_push_without_polling(
    tmp_path: Path, uris: tuple[str, str], server: PubSubServer
) -> None:
    """The reader learns of every write by push: one Consensus read per push to confirm it
    (fewer when one read confirms several), and not one poll."""
    writer_client = make_client(uris, pubsub.connect(server.address, uris[1]))
    shard = writer_client.open_shard("events", SCHEMA)
    shard.writer().append(row(-1))
    n = 10
    child = spawn_child(tmp_path, uris, server.address, "events", n)
    try:
        w = shard.writer()
        for i in range(n):
            w.append(row(i))
            time.sleep(0.05)
        result = child_result(child)
    finally:
        child.kill()
        writer_client.close()
    assert result["seen"] == list(range(n))
    metrics = result["metrics"]
    assert isinstance(metrics, dict)
    assert 1 <= metrics["applied_cleanly"] <= n
    assert result["reads"] == metrics["applied_cleanly"], result  # no poll at all
    assert writer_client.pubsub_metrics()["pushed"] >= n + 1


def test_server_killed_writes_go_on_readers_poll_then_push_resumes(
    uris: tuple[str, str],
) -> None:
    """Kill the server mid-stream: writes keep succeeding, the reader keeps up by polling,
    and picks pushes up again once the server is back on the same port."""
    port = free_port()
    cmd = [sys.executable, "-m", "pyspark_persist.pubsub", "serve", "--port", str(port)]

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        assert b"serving on" in proc.stdout.readline()
        return proc

    addr = f"127.0.0.1:{port}"
    srv = start()
    wc = make_client(uris, pubsub.connect(addr, uris[1]))
    rc = make_client(uris, pubsub.connect(addr, uris[1]))
    try:
        w = wc.open_shard("s", SCHEMA).writer()
        w.append(row(0))
        rshard = rc.open_shard("s")
        reader = rshard.reader()
        listen = reader.listen(reader.latest_as_of())
        shared = rshard.machine.shared
        wait_until(lambda: shared.push_healthy, what="the first subscription")
        for i in range(1, 4):
            w.append(row(i))
        applied_before_the_listen_reads(rc, 1)
        assert collect(listen, {1, 2, 3}, reader) == {1, 2, 3}

        srv.send_signal(signal.SIGKILL)
        srv.wait(timeout=10)
        wait_until(lambda: not shared.push_healthy, what="the reader to notice the server died")
        polls_before = rc.pubsub_metrics()["fallback_polls"]
        for i in range(4, 9):
            t0 = time.monotonic()
            w.append(row(i))
            # A write that waited for the dead server would sit out the client's reconnect
            # backoff and gRPC deadlines; the bound is loose so a loaded CI box cannot trip it.
            assert time.monotonic() - t0 < 10.0, "a write waited for the dead server"
        assert collect(listen, set(range(4, 9)), reader) == set(range(4, 9))
        assert rc.pubsub_metrics()["fallback_polls"] > polls_before

        srv = start()
        wait_until(lambda: shared.push_healthy, timeout_s=15, what="push to resume")
        wshared = wc.machine("s").shared
        wait_until(lambda: wshared.push_healthy, timeout_s=15, what="the writer to reconnect")
        collect(listen, set(), reader, timeout_s=0.3)  # the catch-up read after resubscribing
        applied = rc.pubsub_metrics()["applied_cleanly"]
        for i in range(9, 12):
            w.append(row(i))
        applied_before_the_listen_reads(rc, applied + 1)
        assert collect(listen, {9, 10, 11}, reader) == {9, 10, 11}
        assert rc.pubsub_metrics()["disconnects"] >= 1
    finally:
        srv.kill()
        srv.wait(timeout=10)
        wc.close()
        rc.close()
        for c in (wc, rc):
            c.publisher.close()  # type: ignore[attr-defined]


class Recorder:
    """A publisher that keeps what it is given (to replay it in any order)."""

    def __init__(self) -> None:
        self.pushes: list[tuple[str, int]] = []

    def push(self, shard_id: str, seqno: int) -> None:
        self.pushes.append((shard_id, seqno))

    def subscribe(self, shard_id: str, shared: object, consensus_uri: str) -> None:
        pass

    def unsubscribe(self, shard_id: str) -> None:
        pass


class Injector(BasePublisher):
    """A publisher whose 'transport' is the test calling ``inject``."""

    def _on_push(self, topic: str, seqno: int, pushed_at_us: int) -> None:
        pass

    def _on_subscribe(self, topic: str) -> None:
        self._set_healthy(topic, True)

    def _on_unsubscribe(self, topic: str) -> None:
        pass

    def inject(self, shard_id: str, seqno: int) -> None:
        with self._lock:
            topic = self._topic_of.get(shard_id, f"nobody/{shard_id}")
        self._deliver(topic, seqno)


def test_forged_replayed_and_reordered_pushes_change_nothing(uris: tuple[str, str]) -> None:
    """Pushes are hints: a forged SeqNo installs nothing, a reordered one makes the reader
    read Consensus, a replayed one is ignored; the state always equals Consensus's, and a
    writer in the process that received the forgeries commits at once."""
    recorder = Recorder()
    wc = make_client(uris, recorder)
    injector = Injector()
    rc = make_client(uris, injector, PersistConfig(maintenance=False, retry_timeout_s=5.0))
    try:
        wshard = wc.open_shard("a", SCHEMA)
        wc.open_shard("b", SCHEMA).writer().append(row(100))
        rshard = rc.open_shard("a")
        shared = rshard.machine.shared
        start = shared.state
        assert start is not None and shared.push_healthy

        # Forged: SeqNos past the head, which Consensus does not hold.
        injector.inject("a", start.seqno + 1)
        injector.inject("a", start.seqno + 10**9)
        injector.inject("a", 2**64 - 1)
        assert shared.state is start
        assert rc.pubsub_metrics()["unconfirmed"] == 3

        recorder.pushes.clear()
        w = wshard.writer()
        for i in range(4):
            w.append(row(i))
        seqnos = [n for s, n in recorder.pushes if s == "a"]
        assert seqnos == [start.seqno + k for k in range(1, 5)]
        # Reordered: the last push first. The reader reads Consensus and is exact at once.
        injector.inject("a", seqnos[-1])
        assert state_bytes(shared.state) == state_bytes(wshard.machine.shared.state)
        # Replayed, and forged over SeqNos already held: ignored.
        for n in seqnos:
            injector.inject("a", n)
        injector.inject("a", 1)
        assert state_bytes(shared.state) == state_bytes(wshard.machine.shared.state)
        # A push of another shard's topic changes nothing here.
        injector.inject("b", seqnos[-1] + 1)
        m = rc.pubsub_metrics()
        assert m["applied_cleanly"] == 1 and m["duplicates"] >= 4 and m["not_subscribed"] == 1

        # The receiving process writes and reads as if nothing had been pushed at all.
        current = shared.state
        assert current is not None
        injector.inject("a", current.seqno + 1)
        t0 = time.monotonic()
        assert isinstance(rshard.writer().append(row(50)), Committed)
        assert time.monotonic() - t0 < 5.0, "a forged push stalled the writer"
        reader = rshard.reader()
        assert sorted(reader.snapshot_table().column("id").to_pylist()) == [0, 1, 2, 3, 50]
        assert state_bytes(rshard.machine.fetch_latest()) == state_bytes(
            wshard.machine.fetch_latest()
        )
    finally:
        wc.close()
        rc.close()


def test_forged_pushes_through_the_server_leave_writers_and_readers_exact(
    uris: tuple[str, str], server: PubSubServer
) -> None:
    """Any local client may push to an open server: a stream of forged SeqNos (the next one,
    or far ahead) neither stalls a subscribed writer nor shows a reader anything Consensus
    does not hold."""
    import grpc

    from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
    from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc

    pub = pubsub.connect(server.address, uris[1])
    config = PersistConfig(maintenance=False, retry_timeout_s=5.0)
    client = make_client(uris, pub, config)
    try:
        shard = client.open_shard("f", SCHEMA)
        writer = shard.writer()
        writer.append(row(0))
        shared = shard.machine.shared
        wait_until(lambda: shared.push_healthy, what="subscription")
        topic = pub.topics()[0]  # type: ignore[attr-defined]
        for i in range(1, 4):
            state = shared.state
            assert state is not None
            msgs = [
                pb.ProtoPubSubMessage(push_diff=pb.ProtoPushDiff(shard_id=topic, seqno=n))
                for n in (state.seqno + 1, state.seqno + 10**9)
            ]
            want = server.counters["diffs_forwarded"] + 2
            with grpc.insecure_channel(server.address) as ch:
                for _ in pb_grpc.ProtoPersistPubSubStub(ch).PubSub(iter(msgs), timeout=5):
                    pass
            wait_until(lambda w=want: server.counters["diffs_forwarded"] >= w, what="forgery")
            t0 = time.monotonic()
            assert isinstance(writer.append(row(i)), Committed)
            assert time.monotonic() - t0 < 5.0, "a forged push stalled the writer"
        reader = shard.reader()
        assert sorted(reader.snapshot_table().column("id").to_pylist()) == [0, 1, 2, 3]
        assert client.pubsub_metrics()["unconfirmed"] >= 1
    finally:
        client.close()
        pub.close()  # type: ignore[attr-defined]


def test_same_process_handles_share_state_without_network_or_echo(
    uris: tuple[str, str], server: PubSubServer
) -> None:
    """Two handles in one process share one state: the reader wakes with no network hop and
    the writer's own diff never comes back to it."""
    pub = pubsub.connect(server.address, uris[1])
    client = make_client(uris, pub)
    try:
        shard = client.open_shard("local", SCHEMA)
        shard.writer().append(row(0))
        reader = shard.reader()
        listen = reader.listen(reader.latest_as_of())
        wait_until(lambda: shard.machine.shared.push_healthy, what="subscription")
        for i in range(1, 6):
            shard.writer().append(row(i))
        assert collect(listen, set(range(1, 6)), reader) == set(range(1, 6))
        time.sleep(0.2)
        m = client.pubsub_metrics()
        assert m["pushed"] >= 5
        assert m["received"] == 0 and m["duplicates"] == 0, m
        assert server.counters["diffs_forwarded"] == 0
    finally:
        client.close()
        pub.close()  # type: ignore[attr-defined]


def test_push_never_blocks_or_fails_writes_without_a_server(uris: tuple[str, str]) -> None:
    pub = GrpcPublisher(f"127.0.0.1:{free_port()}", uris[1], queue_max=4, max_push_age_s=0.2)
    client = make_client(uris, pub)
    try:
        w = client.open_shard("lonely", SCHEMA).writer()
        t0 = time.monotonic()
        for i in range(20):
            w.append(row(i))
        assert time.monotonic() - t0 < 10
        m = client.pubsub_metrics()
        assert m["pushed"] >= 20 and m["push_dropped"] >= 10 and m["connects"] == 0
        assert client.open_shard("lonely").reader().snapshot_table().num_rows == 20
    finally:
        client.close()
        pub.close()


def test_broken_server_messages_do_not_hurt(uris: tuple[str, str], server: PubSubServer) -> None:
    """A client pushing junk through the server to a subscribed reader: state stays exact."""
    import grpc

    from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
    from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc

    pub = pubsub.connect(server.address, uris[1])
    wc = make_client(uris, None)
    rc = make_client(uris, pub)
    try:
        w = wc.open_shard("j", SCHEMA).writer()
        w.append(row(0))
        rshard = rc.open_shard("j")
        shared = rshard.machine.shared
        wait_until(lambda: shared.push_healthy, what="subscription")
        topic = pub.topics()[0]  # type: ignore[attr-defined]
        seqno = shared.state.seqno  # type: ignore[union-attr]
        junk = [
            pb.ProtoPubSubMessage(push_diff=pb.ProtoPushDiff(shard_id=topic, seqno=seqno + k))
            for k in (1, 2, 0)
        ]
        with grpc.insecure_channel(server.address) as ch:
            stub = pb_grpc.ProtoPersistPubSubStub(ch)
            for _ in stub.PubSub(iter(junk), timeout=5):
                pass
            wait_until(lambda: server.counters["diffs_received"] >= 1, what="junk to arrive")
        time.sleep(0.2)
        assert shared.state is not None and shared.state.seqno == seqno
        w.append(row(1))
        reader = rshard.reader()
        assert collect(reader.listen(0), {0, 1}, reader) == {0, 1}
    finally:
        wc.close()
        rc.close()
        pub.close()  # type: ignore[attr-defined]


@pytest.mark.postgres
def test_postgres_listen_notify(postgres_url: str, tmp_path: Path) -> None:
    """LISTEN/NOTIFY carries pushes between clients: a shard's topic and SeqNo, no rows."""
    from pyspark_persist.pubsub import postgres

    uris = (f"file://{tmp_path}/blob", postgres_url)
    name = f"pg-{uuid.uuid4().hex[:12]}"
    wpub, rpub = pubsub.connect("postgres", postgres_url), pubsub.connect("auto", postgres_url)
    assert isinstance(rpub, postgres.PostgresPublisher)
    wc, rc = make_client(uris, wpub), make_client(uris, rpub)
    try:
        w = wc.open_shard(name, SCHEMA).writer()
        w.append(row(0))
        rshard = rc.open_shard(name)
        reader = rshard.reader()
        listen = reader.listen(reader.latest_as_of())
        wait_until(lambda: rshard.machine.shared.push_healthy, what="LISTEN")
        collect(listen, set(), reader, timeout_s=0.3)
        fetches = rc.metrics.snapshot()["consensus_fetches"]
        for i in range(1, 6):
            w.append(row(i))
        assert collect(listen, set(range(1, 6)), reader) == set(range(1, 6))
        # One read per notification, to confirm it; no polling.
        confirmed = rc.pubsub_metrics()["applied_cleanly"]
        assert 1 <= confirmed <= 5
        assert rc.metrics.snapshot()["consensus_fetches"] == fetches + confirmed
    finally:
        for c in (wc, rc):
            c.close()
            c.publisher.close()  # type: ignore[attr-defined]


def test_auto_mode_finds_the_server_and_takes_over(tmp_path: Path, uris: tuple[str, str]) -> None:
    """The first process serves and advertises; another connects; when the server dies the
    next process takes over, and pushes flow again."""
    wc = make_client(uris, None)
    w = wc.open_shard("auto", SCHEMA).writer()
    w.append(row(0))
    child = spawn_child(tmp_path, uris, "auto", "auto", 0, mode="hold")  # serves
    directory = str(tmp_path)
    try:
        discovery = auto.AutoDiscovery(directory, token=auto.location_token(directory))
        child_addr = discovery.read_address()
        assert child_addr is not None
        pub = pubsub.connect("auto", uris[1])
        rc = make_client(uris, pub)
        rshard = rc.open_shard("auto")
        shared = rshard.machine.shared
        wait_until(lambda: shared.push_healthy, what="connecting to the child's server")
        assert not discovery.serving()

        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        wait_until(lambda: discovery.serving(), timeout_s=15, what="taking over")
        wait_until(lambda: shared.push_healthy, timeout_s=15, what="reconnecting")
        assert discovery.read_address() != child_addr
        # A writer in yet another client of this location pushes through the new server.
        wpub = pubsub.connect("auto", uris[1])
        wc2 = make_client(uris, wpub)
        w2 = wc2.open_shard("auto").writer()
        reader = rshard.reader()
        listen = reader.listen(rshard.machine.state().upper - 1)
        collect(listen, set(), reader, timeout_s=0.3)
        applied = rc.pubsub_metrics()["applied_cleanly"]
        wait_until(lambda: wc2.open_shard("auto").machine.shared.push_healthy, what="writer")
        for i in range(1, 4):
            w2.append(row(i))
        applied_before_the_listen_reads(rc, applied + 1)
        assert collect(listen, {1, 2, 3}, reader) == {1, 2, 3}
        for c in (rc, wc2):
            c.close()
            c.publisher.close()  # type: ignore[attr-defined]
    finally:
        child.kill()
        auto.stop_serving(directory)
        wc.close()


def test_connect_specs(uris: tuple[str, str]) -> None:
    from pyspark_persist.state.errors import InvalidUsage
    from pyspark_persist.state.machine import NoopPublisher

    assert isinstance(pubsub.connect(None, uris[1]), NoopPublisher)
    assert isinstance(pubsub.connect("off", uris[1]), NoopPublisher)
    assert isinstance(pubsub.connect("auto", "mem://x"), NoopPublisher)
    g = pubsub.connect("127.0.0.1:6879", uris[1])
    assert isinstance(g, GrpcPublisher)
    for bad in ("nonsense", "host:notaport", "postgres"):
        with pytest.raises(InvalidUsage):
            pubsub.connect(bad, uris[1])


def _subscriber(address: str, topic: str) -> tuple[Iterator[object], Callable[[], None]]:
    """A raw stream subscribed to ``topic`` (any local process that knows it): its messages
    after the acknowledgement, and a function that ends it."""
    import threading

    import grpc

    from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
    from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc

    leave = threading.Event()

    def requests() -> Iterator[pb.ProtoPubSubMessage]:
        yield pb.ProtoPubSubMessage(subscribe=pb.ProtoSubscribe(shard=topic))
        leave.wait(30)

    channel = grpc.insecure_channel(address)
    call = pb_grpc.ProtoPersistPubSubStub(channel).PubSub(requests(), timeout=30)
    assert next(call).WhichOneof("message") == "subscribe"

    def end() -> None:
        leave.set()
        call.cancel()
        channel.close()

    return call, end


def test_push_carries_no_row_data(uris: tuple[str, str], server: PubSubServer) -> None:
    """A subscriber of a shard's topic, without any right to the data, learns only which
    SeqNo each commit reached: not a byte of the rows, though small writes keep their rows
    inline in the state diff. A reader still gets every row, from Consensus.

    Regression: each push carried the whole diff, inline row values included."""
    from pyspark_persist.pubsub.subscriptions import location_key, make_topic

    secret_schema = pa.schema([("id", pa.int64()), ("card", pa.string())])
    secret = "4111-1111-" + uuid.uuid4().hex
    location = location_key(uris[1])
    assert location is not None
    snoop, end = _subscriber(server.address, make_topic(location, "cards"))
    writer_pub = pubsub.connect(server.address, uris[1])
    reader_pub = pubsub.connect(server.address, uris[1])
    wc, rc = make_client(uris, writer_pub), make_client(uris, reader_pub)
    try:
        shard = wc.open_shard("cards", secret_schema)
        wait_until(lambda: shard.machine.shared.push_healthy, what="the writer's stream")
        rshard = rc.open_shard("cards")
        wait_until(lambda: rshard.machine.shared.push_healthy, what="the reader's stream")
        writer = shard.writer()
        for i in range(3):
            table = pa.table({"id": [i], "card": [f"{secret}-{i}"]}, schema=secret_schema)
            writer.append(table)
        head = shard.machine.shared.state.seqno  # type: ignore[union-attr]
        pushes = [next(snoop)]  # the shard's creation, then each write
        while pushes[-1].push_diff.seqno < head:  # type: ignore[attr-defined]
            pushes.append(next(snoop))
        seqnos = [m.push_diff.seqno for m in pushes]  # type: ignore[attr-defined]
        assert seqnos[-3:] == [head - 2, head - 1, head]
        for m in pushes:
            fields = {f.name for f, _ in m.push_diff.ListFields()}  # type: ignore[attr-defined]
            assert fields <= {"shard_id", "seqno", "pushed_at_us"}, fields
            wire = m.SerializeToString()  # type: ignore[attr-defined]
            assert secret.encode() not in wire and len(wire) < 128, wire
        assert server.counters["bytes_received"] < len(pushes) * 128
        wait_until(lambda: rshard.machine.shared.state.upper >= shard.upper, what="the push")  # type: ignore[union-attr]
        got = rshard.reader().snapshot_table().column("card").to_pylist()
        assert sorted(got) == [f"{secret}-{i}" for i in range(3)]
    finally:
        end()
        for c in (wc, rc):
            c.close()
            c.publisher.close()  # type: ignore[attr-defined]


def test_the_server_forwards_nothing_but_topic_and_seqno_of_an_older_client_s_push(
    server: PubSubServer,
) -> None:
    """A client of an older version still sends the diff (field 3 of a push): the server
    forwards the topic, SeqNo and timestamp of it and drops the rest."""
    import grpc

    from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
    from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc

    topic = "0123456789abcdef/old"
    diff = b"inline row: " + uuid.uuid4().hex.encode()
    push = pb.ProtoPushDiff(shard_id=topic, seqno=7, pushed_at_us=5).SerializeToString()
    push += b"\x1a" + bytes([len(diff)]) + diff  # field 3 (bytes), as older clients sent it
    old = pb.ProtoPubSubMessage.FromString(b"\x0a" + bytes([len(push)]) + push)
    assert diff in old.SerializeToString()
    snoop, end = _subscriber(server.address, topic)
    try:
        with grpc.insecure_channel(server.address) as ch:
            for _ in pb_grpc.ProtoPersistPubSubStub(ch).PubSub(iter([old]), timeout=10):
                pass
        got = next(snoop)
        assert (got.push_diff.shard_id, got.push_diff.seqno, got.push_diff.pushed_at_us) == (  # type: ignore[attr-defined]
            topic,
            7,
            5,
        )
        assert diff not in got.SerializeToString()  # type: ignore[attr-defined]
    finally:
        end()


def test_a_listen_finds_a_commit_whose_push_was_lost_by_its_poll(uris: tuple[str, str]) -> None:
    """While pushes look healthy a waiting listen still reads Consensus every
    ``listen_poll_pushed_s`` (5 s by default): a commit whose push was lost shows up then."""
    injector = Injector()  # acknowledges the subscription, delivers nothing unless told
    config = PersistConfig(maintenance=False, listen_poll_pushed_s=0.05)
    wc, rc = make_client(uris, None), make_client(uris, injector, config)
    try:
        w = wc.open_shard("lost", SCHEMA).writer()
        w.append(row(0))
        rshard = rc.open_shard("lost")
        assert rshard.machine.shared.push_healthy
        reader = rshard.reader()
        listen = reader.listen(reader.latest_as_of())
        w.append(row(1))  # its push never comes
        assert collect(listen, {1}, reader) == {1}
        assert rc.pubsub_metrics()["fallback_polls"] >= 1 and rc.pubsub_metrics()["received"] == 0
    finally:
        wc.close()
        rc.close()
