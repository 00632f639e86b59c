"""The gRPC PubSub client: one stream to a server, connected lazily, reconnected with backoff.

A write never waits for it: :meth:`push` appends its push (topic and SeqNo)
to a bounded queue and returns; a background thread sends. When the queue
is full the push is dropped and counted (the readers learn of the commit by
polling Consensus), and a push that waited longer than ``max_push_age_s``
(the server was away) is dropped at send time, since it would only make
receivers read Consensus.

Subscriptions are sent on (re)connect and acknowledged by the server; a
shard's :attr:`SharedState.push_healthy` is set from the acknowledgement
until the stream breaks, which is what lets idle listens stop polling.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from . import persist_pubsub_pb2 as pb
from . import persist_pubsub_pb2_grpc as pb_grpc
from .metrics import PubSubCount
from .server import KEEPALIVE_MIN_PING_INTERVAL_MS
from .subscriptions import BasePublisher

log = logging.getLogger(__name__)

CHANNEL_OPTIONS = [
    # At least the server's KEEPALIVE_MIN_PING_INTERVAL_MS, or it answers GOAWAY too_many_pings.
    ("grpc.keepalive_time_ms", 2 * KEEPALIVE_MIN_PING_INTERVAL_MS),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 0),
]


class GrpcPublisher(BasePublisher):
    """A DiffPublisher that talks to a :class:`~pyspark_persist.pubsub.server.PubSubServer`.

    ``address`` is ``"host:port"`` or a callable returning one (or None when
    there is nothing to connect to yet), asked again before every attempt;
    ``auto`` mode passes its discovery here. ``tls`` connects with TLS,
    trusting ``tls_ca`` (PEM bytes; ``None``: the system roots); ``token`` is
    sent as the ``x-persist-token`` metadata the server checks. Neither is
    ever logged.
    """

    def __init__(
        self,
        address: str | Callable[[], str | None],
        consensus_uri: str | None = None,
        *,
        queue_max: int = 1024,
        max_push_age_s: float = 2.0,
        reconnect_min_s: float = 0.05,
        reconnect_max_s: float = 1.0,
        tls: bool = False,
        tls_ca: bytes | None = None,
        token: str | None = None,
    ) -> None:
        super().__init__(consensus_uri)
        self._credentials = (
            grpc.ssl_channel_credentials(root_certificates=tls_ca) if tls or tls_ca else None
        )
        self._metadata = (("x-persist-token", token),) if token else None
        self._address: Callable[[], str | None] = (
            (lambda: address) if isinstance(address, str) else address
        )
        self._queue_max = queue_max
        self._max_push_age_s = max_push_age_s
        self._reconnect_min_s = reconnect_min_s
        self._reconnect_max_s = reconnect_max_s
        self._cv = threading.Condition()
        self._control: collections.deque[pb.ProtoPubSubMessage] = collections.deque()
        self._pushes: collections.deque[tuple[float, pb.ProtoPubSubMessage]] = collections.deque()
        self._gen = 0
        self._connected = False
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    @property
    def connected(self) -> bool:
        """True while a stream is open and the server has acknowledged it."""
        return self._connected

    # -- hooks -----------------------------------------------------------------------

    def _on_push(self, topic: str, seqno: int, pushed_at_us: int) -> None:
        msg = pb.ProtoPubSubMessage(
            push_diff=pb.ProtoPushDiff(shard_id=topic, seqno=seqno, pushed_at_us=pushed_at_us)
        )
        with self._cv:
            if len(self._pushes) >= self._queue_max:
                self._metrics.incr(PubSubCount.PUSH_DROPPED)
                return
            self._pushes.append((time.monotonic(), msg))
            self._cv.notify()
        self._ensure_started()

    def _on_subscribe(self, topic: str) -> None:
        with self._cv:
            self._control.append(pb.ProtoPubSubMessage(subscribe=pb.ProtoSubscribe(shard=topic)))
            self._cv.notify()
        self._ensure_started()

    def _on_unsubscribe(self, topic: str) -> None:
        with self._cv:
            self._control.append(
                pb.ProtoPubSubMessage(unsubscribe=pb.ProtoUnsubscribe(shard=topic))
            )
            self._cv.notify()

    def close(self) -> None:
        """Close the stream and stop the background thread."""
        super().close()
        with self._cv:
            self._gen += 1
            self._cv.notify_all()
        self._wake.set()
        call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- the connection --------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._thread is not None or self._closed:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="persist-pubsub-grpc", daemon=True
                )
                self._thread.start()

    def _requests(self, gen: int) -> Iterator[pb.ProtoPubSubMessage]:
        """What this stream sends: control messages first, then pushes still worth sending."""
        while True:
            with self._cv:
                while (
                    not self._control and not self._pushes and self._gen == gen and not self._closed
                ):
                    self._cv.wait(1.0)
                if self._gen != gen or self._closed:
                    return
                if self._control:
                    msg = self._control.popleft()
                else:
                    enqueued, msg = self._pushes.popleft()
                    if time.monotonic() - enqueued > self._max_push_age_s:
                        self._metrics.incr(PubSubCount.PUSH_DROPPED)
                        continue
                    self._metrics.incr(PubSubCount.SENT)
            yield msg

    def _run(self) -> None:
        backoff = self._reconnect_min_s
        while not self._closed:
            ok = False
            try:
                address = self._address()
            except Exception as e:  # noqa: BLE001 - discovery failed: retry later
                log.debug("pubsub: finding the server failed: %s", e)
                address = None
            if address is not None:
                ok = self._stream(address)
            if self._closed:
                return
            backoff = self._reconnect_min_s if ok else min(backoff * 2, self._reconnect_max_s)
            self._wake.wait(random.uniform(backoff / 2, backoff))

    def _stream(self, address: str) -> bool:
        """Run one stream to ``address`` until it breaks; True if it was ever acknowledged."""
        acked = False
        with self._cv:
            self._gen += 1
            gen = self._gen
            self._control.clear()
            for topic in self.topics():
                self._control.append(
                    pb.ProtoPubSubMessage(subscribe=pb.ProtoSubscribe(shard=topic))
                )
        if self._credentials is None:
            channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            channel = grpc.secure_channel(address, self._credentials, options=CHANNEL_OPTIONS)
        try:
            stub = pb_grpc.ProtoPersistPubSubStub(channel)
            call = stub.PubSub(self._requests(gen), metadata=self._metadata)
            self._call = call
            if self._closed:
                call.cancel()
            for msg in call:
                kind = msg.WhichOneof("message")
                if kind == "push_diff":
                    d = msg.push_diff
                    self._deliver(d.shard_id, d.seqno, d.pushed_at_us)
                elif kind == "subscribe":
                    if not acked:
                        acked = True
                        self._connected = True
                        self._metrics.incr(PubSubCount.CONNECTS)
                        log.debug("pubsub: connected to %s", address)
                    self._set_healthy(msg.subscribe.shard, True)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            if code != grpc.StatusCode.CANCELLED:
                log.debug("pubsub: stream to %s broke: %s", address, code)
        except Exception as e:  # noqa: BLE001 - never let the transport thread die silently
            log.warning("pubsub: stream to %s failed: %s", address, e)
        finally:
            with self._cv:
                self._gen += 1
                self._cv.notify_all()
            self._call = None
            if self._connected:
                self._metrics.incr(PubSubCount.DISCONNECTS)
            self._connected = False
            self._set_healthy(None, False)
            channel.close()
        return acked
