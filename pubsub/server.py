"""The PubSub server: forwards each push (a shard's new SeqNo) to the other connections
subscribed to that shard.

One bidirectional gRPC stream per client process (``ProtoPersistPubSub.PubSub``).
The server keeps, per topic, the set of connections subscribed to it; a
``PushDiff`` goes to each of them except the sender, a ``Subscribe`` is
registered and then sent back as the acknowledgement (every push the server
receives after that is forwarded).

What is forwarded is a message the server builds from the push's topic,
SeqNo and timestamp alone: nothing else a client sends reaches another
client (an older client's diff bytes, field 3, are dropped here), so a
subscriber learns which shards commit and when, never a row.

Memory is bounded whatever the clients do. Each connection's outgoing queue
holds at most ``CONNECTION_QUEUE`` messages, each a few hundred bytes: a
subscriber that falls that far behind has its stream ended (it reconnects,
resubscribes and catches up from Consensus, which is cheaper than an
unbounded queue), and what was queued for it is freed at once. A message
may be at most ``MAX_MESSAGE_BYTES``. When a connection ends, freed memory
is handed back to the operating system.

Input is checked like every other entry point's: a message of no known
kind, a topic that is not ``<16 hex digits>/<valid shard name>`` (empty, or
a 1 MiB name) or a push for SeqNo 0 ends the stream with INVALID_ARGUMENT.

Run it with ``persist pubsub serve`` (or :func:`serve`); it binds
``127.0.0.1:6879`` unless told otherwise, and refuses a non-loopback
address unless ``allow_remote`` is set: pushes reveal shard names and when
they commit, so exposing them is a decision. For a remote server, give it a TLS
certificate and key (``tls_cert``/``tls_key``, PEM) and a shared ``token``
that every client must send as gRPC metadata ``x-persist-token``; a stream
without the right token is rejected (UNAUTHENTICATED) and counted in
``counters["rejected"]``. The token never appears in a log or an error.
Nothing a client pushes is trusted by the other clients: they only take it
as a hint to read Consensus (see :mod:`pyspark_persist.pubsub`).
It holds no durable state: killing it only makes readers fall back to polling until it is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hmac
import logging
import re
import signal
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc

from ..state import validate_shard_name
from ..state.errors import InvalidUsage
from . import persist_pubsub_pb2 as pb
from . import persist_pubsub_pb2_grpc as pb_grpc
from .addresses import is_loopback

if TYPE_CHECKING:
    from .consumer_lag import ConsumerLag

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 6879
TOKEN_METADATA = "x-persist-token"
"""The gRPC metadata key a client sends the shared token under."""
TOKEN_ENV = "PERSIST_PUBSUB_TOKEN"
"""Environment variable both ``serve`` and clients read the shared token from."""
CONNECTION_QUEUE = 4096
"""Messages waiting for one subscriber before its stream is ended as too slow."""
MAX_MESSAGE_BYTES = 4 << 20
"""The largest message a client may send (gRPC's default: what older clients that pushed
diffs were built for; a push of this version is a few hundred bytes)."""
KEEPALIVE_MIN_PING_INTERVAL_MS = 10_000
"""Pings closer together than this on an idle connection are strikes (gRPC then sends
GOAWAY ``too_many_pings``): the client's keepalive interval must not be shorter."""

SERVER_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", KEEPALIVE_MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_TOPIC_TAG = re.compile(r"^[0-9a-f]{16}$")


def check_topic(topic: str) -> str | None:
    """Why ``topic`` is not ``<16 hex digits>/<shard name>``, or None when it is."""
    tag, sep, shard = topic.partition("/")
    if not sep or not _TOPIC_TAG.match(tag):
        return "a topic is <16 hex digits>/<shard name>"
    try:
        validate_shard_name(shard)
    except InvalidUsage as e:
        return str(e)[:200]
    return None


class _Conn:
    """One client stream: its outgoing queue (bounded in messages) and its topics."""

    __slots__ = ("queue", "queued_bytes", "topics", "peer", "ended", "error")

    def __init__(self, peer: str) -> None:
        self.queue: asyncio.Queue[tuple[pb.ProtoPubSubMessage, int] | None] = asyncio.Queue(
            CONNECTION_QUEUE
        )
        self.queued_bytes = 0
        self.topics: set[str] = set()
        self.peer = peer
        self.ended = False
        self.error: tuple[grpc.StatusCode, str] | None = None

    def offer(self, msg: pb.ProtoPubSubMessage, size: int = 0) -> bool:
        """Queue ``msg`` (``size`` bytes); if that overflows, end the stream at once (the
        client catches up from Consensus) and free what was queued. False if dropped."""
        if self.ended:
            return False
        if self.queue.full():
            self.end(drop_queued=True)
            return False
        self.queue.put_nowait((msg, size))
        self.queued_bytes += size
        return True

    async def next(self) -> pb.ProtoPubSubMessage | None:
        """The next message to send, or None once the stream is over."""
        item = await self.queue.get()
        if item is None:
            return None
        msg, size = item
        self.queued_bytes -= size
        return msg

    def fail(self, code: grpc.StatusCode, details: str) -> None:
        """End the stream with ``code`` (nothing more is sent)."""
        if self.error is None:
            self.error = (code, details)
        self.end(drop_queued=True)

    def end(self, *, drop_queued: bool = False) -> None:
        """Finish the stream after what is already queued, or at once with ``drop_queued``."""
        if self.ended:
            return
        self.ended = True
        if drop_queued:
            while not self.queue.empty():
                self.queue.get_nowait()
            self.queued_bytes = 0
        self.queue.put_nowait(None)


class _Servicer(pb_grpc.ProtoPersistPubSubServicer):
    def __init__(self, server: PubSubServer) -> None:
        self._server = server
        self._subs: dict[str, set[_Conn]] = {}
        self.conns: set[_Conn] = set()
        """Every open stream (their queues are the server's ``queued_bytes``)."""

    def queued_bytes(self) -> int:
        """Bytes of messages waiting in every stream's queue now (callable from any thread)."""
        return sum(conn.queued_bytes for conn in list(self.conns))

    def topics(self) -> int:
        """Topics with at least one subscriber now."""
        return len(self._subs)

    async def PubSub(  # noqa: N802 - the gRPC method name
        self, request_iterator: AsyncIterator[pb.ProtoPubSubMessage], context: Any
    ) -> AsyncIterator[pb.ProtoPubSubMessage]:
        if not self._server.authorized(context.invocation_metadata()):
            self._server.counters["rejected"] += 1
            log.warning(
                "pubsub server: rejected a stream from %s: missing or wrong token", context.peer()
            )
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "persist pubsub: missing or wrong token"
            )
            return
        conn = _Conn(str(context.peer()))
        self.conns.add(conn)
        self._server.counters["connections"] += 1
        self._server.counters["connections_total"] += 1
        reader = asyncio.ensure_future(self._read(request_iterator, conn))
        try:
            while True:
                msg = await conn.next()
                if msg is None:
                    break
                yield msg
        finally:
            reader.cancel()
            for topic in conn.topics:
                subs = self._subs.get(topic)
                if subs is not None:
                    subs.discard(conn)
                    if not subs:
                        del self._subs[topic]
            conn.topics.clear()
            self.conns.discard(conn)
            self._server.counters["connections"] -= 1
            self._server.connection_ended()
        if conn.error is not None:
            self._server.counters["invalid"] += 1
            log.warning("pubsub server: ended the stream from %s: %s", conn.peer, conn.error[1])
            await context.abort(*conn.error)

    async def _read(
        self, request_iterator: AsyncIterator[pb.ProtoPubSubMessage], conn: _Conn
    ) -> None:
        try:
            async for msg in request_iterator:
                problem = self._handle(msg, conn)
                if problem is not None:
                    conn.fail(grpc.StatusCode.INVALID_ARGUMENT, f"persist pubsub: {problem}")
                    return
        except (asyncio.CancelledError, grpc.RpcError):
            pass
        except Exception as e:  # noqa: BLE001 - one broken client must not stop the server
            log.warning("pubsub server: stream from %s failed: %s", conn.peer, e)
        finally:
            conn.end()

    def _handle(self, msg: pb.ProtoPubSubMessage, conn: _Conn) -> str | None:
        """Act on one message from ``conn``; return what is wrong with it, if anything."""
        counters = self._server.counters
        kind = msg.WhichOneof("message")
        if kind == "push_diff":
            push = msg.push_diff
            problem = check_topic(push.shard_id)
            if problem is not None:
                return f"push_diff: {problem}"
            if push.seqno < 1:
                return "push_diff: seqno must be at least 1"
            counters["diffs_received"] += 1
            counters["bytes_received"] += msg.ByteSize()
            if self._server.on_push is not None:
                self._server.on_push(push.shard_id, push.seqno)
            # Forward only what a receiver needs, whatever else the sender put in the message.
            forwarded = pb.ProtoPubSubMessage(
                push_diff=pb.ProtoPushDiff(
                    shard_id=push.shard_id, seqno=push.seqno, pushed_at_us=push.pushed_at_us
                )
            )
            size = forwarded.ByteSize()
            for other in self._subs.get(push.shard_id, ()):
                if other is not conn:
                    if other.offer(forwarded, size):
                        counters["diffs_forwarded"] += 1
                        counters["bytes_forwarded"] += size
                    else:
                        counters["slow_subscribers_dropped"] += 1
            return None
        if kind == "subscribe":
            topic = msg.subscribe.shard
            problem = check_topic(topic)
            if problem is not None:
                return f"subscribe: {problem}"
            self._subs.setdefault(topic, set()).add(conn)
            conn.topics.add(topic)
            conn.offer(msg)  # the acknowledgement
            return None
        if kind == "unsubscribe":
            topic = msg.unsubscribe.shard
            conn.topics.discard(topic)
            subs = self._subs.get(topic)
            if subs is not None:
                subs.discard(conn)
                if not subs:
                    del self._subs[topic]
            return None
        return "a message must be one of push_diff, subscribe or unsubscribe"


class PubSubServer:
    """A PubSub server on ``host:port`` (``port=0``: any free port), run on its own thread.

    Example::

        server = PubSubServer("127.0.0.1", 0).start()
        print(server.address)          # e.g. "127.0.0.1:41235"
        ...
        server.stop()
    """

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        *,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
        token: str | None = None,
        allow_remote: bool = False,
    ) -> None:
        if not allow_remote and not is_loopback(host):
            raise InvalidUsage(
                f"refusing to serve persist PubSub on non-loopback address {host!r}: pass "
                "allow_remote=True (--allow-remote), ideally with TLS and a token"
            )
        if (tls_cert is None) != (tls_key is None):
            raise InvalidUsage(
                "persist PubSub TLS needs both a certificate and its key: pass tls_cert and "
                "tls_key (--tls-cert and --tls-key), or neither"
            )
        self.host = host
        self.port = port
        self._tls = None if tls_cert is None else (tls_key, tls_cert)
        self._token = token.encode() if token else None
        self.counters: dict[str, int] = {
            "rejected": 0,
            "connections": 0,
            "connections_total": 0,
            "diffs_received": 0,
            "bytes_received": 0,
            "diffs_forwarded": 0,
            "bytes_forwarded": 0,
            "slow_subscribers_dropped": 0,
            "invalid": 0,
        }
        self._servicer: _Servicer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._grace_s = 0.0
        self._trims = 0
        self.on_push: Callable[[str, int], None] | None = None
        """Told every push's topic and SeqNo, on the server's event loop (it must not block):
        how ``--consumer-lag`` learns which shards to read again."""

    def authorized(self, metadata: Any) -> bool:
        """Whether a stream's metadata carries the token (always, when none is required)."""
        if self._token is None:
            return True
        for key, value in metadata or ():
            if key == TOKEN_METADATA:
                got = value.encode() if isinstance(value, str) else bytes(value)
                return hmac.compare_digest(got, self._token)
        return False

    def metrics(self) -> dict[str, int]:
        """The counters, plus the ``queued_bytes`` and ``topics`` gauges, read now (from any
        thread: what ``persist pubsub serve --metrics-port`` serves)."""
        servicer = self._servicer
        return {
            **self.counters,
            "queued_bytes": servicer.queued_bytes() if servicer is not None else 0,
            "topics": servicer.topics() if servicer is not None else 0,
        }

    def connection_ended(self) -> None:
        """Hand memory freed by an ended connection back to the OS (once nothing is queued)."""
        if self.counters["connections"] == 0 or self._trims % 16 == 0:
            release_freed_memory()
        self._trims += 1

    @property
    def address(self) -> str:
        """``host:port`` as bound (the real port when 0 was asked for)."""
        return f"{self.host}:{self.port}"

    def start(self) -> PubSubServer:
        """Bind and start serving on a daemon thread; raise OSError if the address is taken."""
        self._thread = threading.Thread(target=self._run, name="persist-pubsub-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self, grace_s: float = 0.0) -> None:
        """Stop serving: live streams end, their clients fall back to polling and retry."""
        self._grace_s = grace_s
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stopping.set)
        if self._thread is not None:
            self._thread.join(timeout=5 + grace_s)

    def wait(self) -> None:
        """Block until the server stops."""
        if self._thread is not None:
            while self._thread.is_alive():
                self._thread.join(timeout=0.5)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as e:  # noqa: BLE001 - reported to start()
            if not self._ready.is_set():
                self._error = e
            else:
                log.warning("pubsub server stopped: %s", e)
        finally:
            self._ready.set()
            loop.close()

    async def _main(self) -> None:
        self._stopping = asyncio.Event()
        server = grpc.aio.server(options=SERVER_OPTIONS)
        self._servicer = _Servicer(self)
        pb_grpc.add_ProtoPersistPubSubServicer_to_server(self._servicer, server)
        try:
            address = f"{self.host}:{self.port}"
            if self._tls is None:
                port = server.add_insecure_port(address)
            else:
                creds = grpc.ssl_server_credentials([self._tls])
                port = server.add_secure_port(address, creds)
        except RuntimeError as e:
            raise OSError(
                f"cannot serve persist PubSub on {self.host}:{self.port}: {e} (is the port in "
                "use? pick another with --port)"
            ) from None
        if port == 0:
            raise OSError(
                f"cannot serve persist PubSub on {self.host}:{self.port}: the address is in use "
                "or not local; pick another with --port"
            )
        self.port = port
        await server.start()
        self._ready.set()
        await self._stopping.wait()
        await server.stop(self._grace_s)


def release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the OS (``malloc_trim``); elsewhere a no-op.

    Diffs are large, short-lived buffers: without this, a server that once
    queued hundreds of MiB for a slow subscriber keeps that much resident
    after the subscriber is gone.
    """
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM: Any = None


def serve(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token: str | None = None,
    allow_remote: bool = False,
    metrics_host: str = DEFAULT_HOST,
    metrics_port: int | None = None,
    consumer_lag: tuple[str, str] | None = None,
) -> int:
    """Run a PubSub server in the foreground until SIGINT/SIGTERM (the ``persist pubsub serve``
    command); ``tls_cert``/``tls_key`` are PEM file paths; with ``metrics_port`` (0: any free
    port), its Prometheus metrics are served on ``http://metrics_host:port/metrics``. Returns
    the exit status. ``consumer_lag``: the (Blob, Consensus) URIs whose named consumers' lag
    the metrics endpoint exports too (:mod:`.consumer_lag`)."""
    from . import read_tls_pair
    from .prometheus import MetricsEndpoint

    if consumer_lag is not None and metrics_port is None:
        raise InvalidUsage(
            "--consumer-lag exports the lag on the metrics endpoint: give --metrics-port too"
        )
    cert, key = read_tls_pair(tls_cert, tls_key)
    server = PubSubServer(
        host, port, tls_cert=cert, tls_key=key, token=token, allow_remote=allow_remote
    )
    endpoint = None
    lag = None if consumer_lag is None else _consumer_lag(*consumer_lag)
    if lag is not None:
        server.on_push = lag.pushed
    if metrics_port is not None:  # checked (loopback) before the server binds
        endpoint = MetricsEndpoint(
            server,
            metrics_host,
            metrics_port,
            allow_remote=allow_remote,
            extra=None if lag is None else lag.render,
        )
    server.start()
    if endpoint is not None:
        try:
            endpoint.start()
        except OSError:
            server.stop()
            raise
    extras = (" with TLS" if cert else "") + (" requiring a token" if token else "")
    print(f"persist pubsub: serving on {server.address}{extras} (Ctrl-C to stop)", flush=True)
    if endpoint is not None:
        lagging = f" (with the consumers' lag of {consumer_lag[1]})" if consumer_lag else ""
        print(f"persist pubsub: metrics on {endpoint.url}{lagging}", flush=True)
    done = threading.Event()

    def _stop(*_: object) -> None:
        done.set()

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread
            previous[sig] = signal.signal(sig, _stop)
    try:
        while not done.wait(0.5):
            if server._thread is not None and not server._thread.is_alive():
                break
    finally:
        if endpoint is not None:
            endpoint.stop()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _consumer_lag(blob_uri: str, consensus_uri: str) -> ConsumerLag:
    """The lag gauges of the consumers at ``blob_uri``/``consensus_uri``, read by a client of
    its own (no background maintenance, no PubSub: the server's pushes reach it directly)."""
    from ..state.client import PersistClient
    from ..state.config import PersistConfig
    from .consumer_lag import ConsumerLag

    client = PersistClient.open(blob_uri, consensus_uri, config=PersistConfig(maintenance=False))
    return ConsumerLag(client)
