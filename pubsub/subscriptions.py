"""What every transport shares: topics, the subscribed shards, and confirming what arrives.

A *topic* names one shard in one Consensus: ``"<location tag>/<shard>"``,
the tag a hash of the normalised Consensus URI (password removed, SQLite
path made absolute), because shard names are only unique within one
Consensus. ``mem://`` locations live in one process, where the shared state
cache already does everything, so PubSub ignores them.

:class:`BasePublisher` implements the
:class:`~pyspark_persist.state.machine.DiffPublisher` seam (push, subscribe,
unsubscribe) on top of three transport hooks, and turns what a transport
receives into :meth:`SharedState.apply_pushed` calls (each a hint that makes
the shard read Consensus), counting as it goes. A push is a topic and a
SeqNo: nothing of the diff (let alone a row) is ever handed to a transport.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time

from ..state import consensus_kind
from ..state.cache import SharedState
from .metrics import PubSubCount, PubSubMetrics

log = logging.getLogger(__name__)


def location_key(consensus_uri: str) -> str | None:
    """The normalised Consensus location of ``consensus_uri``; None for ``mem://`` (in-process)."""
    kind = consensus_kind(consensus_uri)
    if kind == "mem":
        return None
    try:
        from sqlalchemy.engine import make_url

        url = make_url(consensus_uri)
    except Exception:  # noqa: BLE001 - not a SQL URL: use it as it is
        return consensus_uri
    query = {k: v for k, v in url.query.items() if k != "password"}
    if kind == "sqlite":
        return f"sqlite:///{os.path.abspath(url.database or '')}?{sorted(query.items())}"
    host = url.host or ""
    return f"postgresql://{url.username or ''}@{host}:{url.port or 5432}/{url.database or ''}" + (
        f"?{sorted(query.items())}" if query else ""
    )


def make_topic(location: str, shard_id: str) -> str:
    """The topic of ``shard_id`` at ``location`` (see the module doc)."""
    tag = hashlib.sha256(location.encode("utf-8")).hexdigest()[:16]
    return f"{tag}/{shard_id}"


def now_us() -> int:
    """Wall-clock microseconds (comparable across processes on one host)."""
    return time.time_ns() // 1000


class BasePublisher:
    """A DiffPublisher over some transport; subclasses implement the ``_on_*`` hooks.

    Thread-safe. Nothing here blocks on the transport or raises into persist.
    """

    def __init__(self, consensus_uri: str | None = None) -> None:
        self._metrics = PubSubMetrics()
        self._lock = threading.RLock()
        self._default_location = None if consensus_uri is None else location_key(consensus_uri)
        self._topic_of: dict[str, str] = {}
        self._refs: dict[str, int] = {}
        self._subs: dict[str, list[SharedState]] = {}
        self._healthy: set[str] = set()
        self._closed = False

    # -- the DiffPublisher seam ------------------------------------------------------

    def push(self, shard_id: str, seqno: int) -> None:
        """Tell the other processes holding ``shard_id`` that SeqNo ``seqno`` is committed;
        never blocks or raises."""
        try:
            with self._lock:
                topic = self._topic_of.get(shard_id)
            if topic is None and self._default_location is not None:
                topic = make_topic(self._default_location, shard_id)
            if topic is None or self._closed:
                return
            self._metrics.incr(PubSubCount.PUSHED)
            self._on_push(topic, seqno, now_us())
        except Exception as e:  # noqa: BLE001 - PubSub must never fail a write
            log.debug("pubsub: push of %s failed: %s", shard_id, e)

    def subscribe(self, shard_id: str, shared: SharedState, consensus_uri: str) -> None:
        """Feed diffs of ``shard_id`` into ``shared`` from now on; never raises."""
        try:
            location = location_key(consensus_uri)
            if location is None or self._closed:
                return
            topic = make_topic(location, shard_id)
            with self._lock:
                self._topic_of[shard_id] = topic
                first = topic not in self._refs
                self._refs[topic] = self._refs.get(topic, 0) + 1
                subs = self._subs.setdefault(topic, [])
                if not any(s is shared for s in subs):
                    subs.append(shared)
                healthy = topic in self._healthy
            if first:
                self._on_subscribe(topic)
            elif healthy:
                shared.set_push_healthy(self, True)
        except Exception as e:  # noqa: BLE001 - polling still works without it
            log.debug("pubsub: subscribe to %s failed: %s", shard_id, e)

    def unsubscribe(self, shard_id: str) -> None:
        """Undo one :meth:`subscribe`; the last one stops delivery of that shard."""
        try:
            with self._lock:
                topic = self._topic_of.get(shard_id)
                if topic is None or topic not in self._refs:
                    return
                self._refs[topic] -= 1
                if self._refs[topic] > 0:
                    return
                del self._refs[topic], self._topic_of[shard_id]
                subs = self._subs.pop(topic, [])
                self._healthy.discard(topic)
            for shared in subs:
                shared.set_push_healthy(self, False)
            self._on_unsubscribe(topic)
        except Exception as e:  # noqa: BLE001
            log.debug("pubsub: unsubscribe from %s failed: %s", shard_id, e)

    def metrics(self) -> dict[str, float]:
        """This publisher's counters (see :class:`PubSubMetrics`)."""
        return self._metrics.snapshot()

    def close(self) -> None:
        """Stop the transport; subscribed shards fall back to polling."""
        self._closed = True
        self._set_healthy(None, False)

    def topics(self) -> list[str]:
        """The topics currently subscribed."""
        with self._lock:
            return list(self._refs)

    # -- transport hooks -------------------------------------------------------------

    def _on_push(self, topic: str, seqno: int, pushed_at_us: int) -> None:
        raise NotImplementedError

    def _on_subscribe(self, topic: str) -> None:
        raise NotImplementedError

    def _on_unsubscribe(self, topic: str) -> None:
        raise NotImplementedError

    # -- what transports call --------------------------------------------------------

    def _deliver(self, topic: str, seqno: int, pushed_at_us: int = 0) -> None:
        """Hand a received push (``topic`` reached ``seqno``) to every state subscribed to it."""
        with self._lock:
            subs = list(self._subs.get(topic, ()))
        if not subs:
            self._metrics.incr(PubSubCount.NOT_SUBSCRIBED)
            return
        self._metrics.incr(PubSubCount.RECEIVED)
        for shared in subs:
            cached = shared.state
            if cached is None:
                continue  # not loaded yet: the first read goes to Consensus anyway
            if seqno <= cached.seqno:
                self._metrics.incr(PubSubCount.DUPLICATES)
            elif shared.apply_pushed(seqno):
                self._metrics.incr(PubSubCount.APPLIED_CLEANLY)
                if pushed_at_us:
                    self._metrics.record_latency((now_us() - pushed_at_us) / 1000.0)
            else:
                self._metrics.incr(PubSubCount.UNCONFIRMED)

    def _set_healthy(self, topic: str | None, healthy: bool) -> None:
        """Mark ``topic`` (None: every topic) as delivered by this transport, or not."""
        with self._lock:
            topics = list(self._refs) if topic is None else [topic]
            topics = [t for t in topics if t in self._refs or not healthy]
            subs = [s for t in topics for s in self._subs.get(t, ())]
            if healthy:
                self._healthy.update(topics)
            else:
                self._healthy.difference_update(topics)
        for shared in subs:
            shared.set_push_healthy(self, healthy)
