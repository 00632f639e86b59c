"""PubSub over PostgreSQL LISTEN/NOTIFY: push freshness where Consensus already is PostgreSQL.

Every commit is announced with ``NOTIFY`` on one channel per Consensus table
(``persist_<table>``). The payload is one line, and nothing of the diff::

    <sender id> <topic> <seqno> <pushed-at µs>

A subscriber reads the new rows from Consensus at once (still no polling
while idle). Every session of the database may LISTEN on any channel, so a
payload must not reveal more than a shard's name and SeqNo (which any
session that can read the Consensus table sees anyway). Each publisher has
two connections of its own: one
sends the queued notifications (writes never wait for it) and one listens on
a background thread. A process ignores its own notifications (its shared
state already has them), and every process ignores shards it does not hold.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
import time
import uuid

import psycopg
from psycopg import sql

from .metrics import PubSubCount
from .subscriptions import BasePublisher

log = logging.getLogger(__name__)


def pg_target(consensus_uri: str) -> tuple[str, str]:
    """The psycopg conninfo and the NOTIFY channel of a ``postgresql://`` Consensus URI."""
    from sqlalchemy.engine import make_url

    url = make_url(consensus_uri)
    table = str(url.query.get("table", "consensus"))
    url = url.difference_update_query(["table"]).set(drivername="postgresql")
    conninfo = url.render_as_string(hide_password=False)
    if "connect_timeout" not in url.query:
        conninfo += ("&" if "?" in conninfo else "?") + "connect_timeout=5"
    return conninfo, f"persist_{table}"[:63]


class PostgresPublisher(BasePublisher):
    """A DiffPublisher over LISTEN/NOTIFY on the Consensus database itself."""

    def __init__(
        self,
        consensus_uri: str,
        *,
        queue_max: int = 1024,
        max_push_age_s: float = 2.0,
        reconnect_min_s: float = 0.05,
        reconnect_max_s: float = 1.0,
    ) -> None:
        super().__init__(consensus_uri)
        self._conninfo, self._channel = pg_target(consensus_uri)
        self._sender_id = uuid.uuid4().hex[:12]
        self._queue_max = queue_max
        self._max_push_age_s = max_push_age_s
        self._reconnect_min_s = reconnect_min_s
        self._reconnect_max_s = reconnect_max_s
        self._cv = threading.Condition()
        self._outbox: collections.deque[tuple[float, str]] = collections.deque()
        self._listening = False
        self._threads: list[threading.Thread] = []
        self._wake = threading.Event()
        self._listen_conn: psycopg.Connection | None = None

    @property
    def channel(self) -> str:
        """The NOTIFY channel (one per Consensus table)."""
        return self._channel

    # -- hooks -----------------------------------------------------------------------

    def _on_push(self, topic: str, seqno: int, pushed_at_us: int) -> None:
        payload = f"{self._sender_id} {topic} {seqno} {pushed_at_us}"
        with self._cv:
            if len(self._outbox) >= self._queue_max:
                self._metrics.incr(PubSubCount.PUSH_DROPPED)
                return
            self._outbox.append((time.monotonic(), payload))
            self._cv.notify()
        self._ensure_started()

    def _on_subscribe(self, topic: str) -> None:
        self._ensure_started()
        if self._listening:
            self._set_healthy(topic, True)

    def _on_unsubscribe(self, topic: str) -> None:
        """Nothing to tell the database: the channel carries every shard; we filter."""

    def close(self) -> None:
        """Stop both threads and close their connections."""
        super().close()
        with self._cv:
            self._cv.notify_all()
        self._wake.set()
        conn = self._listen_conn
        if conn is not None:
            try:
                conn.cancel_safe()
            except Exception:  # noqa: BLE001
                pass
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)

    # -- threads ---------------------------------------------------------------------

    def _ensure_started(self) -> None:
        if self._threads or self._closed:
            return
        with self._lock:
            if not self._threads:
                for target, name in ((self._send_loop, "send"), (self._listen_loop, "listen")):
                    t = threading.Thread(
                        target=target, name=f"persist-pubsub-pg-{name}", daemon=True
                    )
                    t.start()
                    self._threads.append(t)

    def _retry(self, backoff: float) -> float:
        self._wake.wait(random.uniform(backoff / 2, backoff))
        return min(backoff * 2, self._reconnect_max_s)

    def _send_loop(self) -> None:
        backoff = self._reconnect_min_s
        while not self._closed:
            try:
                with psycopg.connect(self._conninfo, autocommit=True) as conn:
                    backoff = self._reconnect_min_s
                    while not self._closed:
                        with self._cv:
                            while not self._outbox and not self._closed:
                                self._cv.wait(1.0)
                            if self._closed:
                                return
                            enqueued, payload = self._outbox[0]
                        if time.monotonic() - enqueued > self._max_push_age_s:
                            self._metrics.incr(PubSubCount.PUSH_DROPPED)
                        else:
                            conn.execute("SELECT pg_notify(%s, %s)", (self._channel, payload))
                            self._metrics.incr(PubSubCount.SENT)
                        with self._cv:
                            self._outbox.popleft()
            except Exception as e:  # noqa: BLE001 - the database is away: retry, writes go on
                log.debug("pubsub postgres: notify connection failed: %s", e)
            if not self._closed:
                backoff = self._retry(backoff)

    def _listen_loop(self) -> None:
        backoff = self._reconnect_min_s
        while not self._closed:
            try:
                with psycopg.connect(self._conninfo, autocommit=True) as conn:
                    self._listen_conn = conn
                    conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
                    self._listening = True
                    self._metrics.incr(PubSubCount.CONNECTS)
                    self._set_healthy(None, True)
                    backoff = self._reconnect_min_s
                    while not self._closed:
                        for note in conn.notifies(timeout=1.0):
                            self._handle(note.payload)
                            if self._closed:
                                break
            except Exception as e:  # noqa: BLE001 - the database is away: poll, retry
                if not self._closed:
                    log.debug("pubsub postgres: listen connection failed: %s", e)
            finally:
                self._listen_conn = None
                if self._listening:
                    self._metrics.incr(PubSubCount.DISCONNECTS)
                self._listening = False
                self._set_healthy(None, False)
            if not self._closed:
                backoff = self._retry(backoff)

    def _handle(self, payload: str) -> None:
        try:
            parts = payload.split(" ")
            sender, topic, seqno, pushed_at = parts[0], parts[1], int(parts[2]), int(parts[3])
            if sender == self._sender_id:
                return
            self._deliver(topic, seqno, pushed_at)
        except Exception as e:  # noqa: BLE001 - a malformed notification is ignored
            log.debug("pubsub postgres: ignoring notification %.80r: %s", payload, e)
