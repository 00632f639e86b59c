"""Counters a user can read to see what PubSub did for a process."""

from __future__ import annotations

import collections
import enum
import threading
from dataclasses import dataclass, field

_LATENCY_SAMPLES = 1024


class PubSubCount(enum.Enum):
    """A counter of :class:`PubSubMetrics`: what :meth:`PubSubMetrics.incr` takes, so a
    misspelled counter is a type error (the value is the field it adds to)."""

    PUSHED = "pushed"
    PUSH_DROPPED = "push_dropped"
    SENT = "sent"
    RECEIVED = "received"
    APPLIED_CLEANLY = "applied_cleanly"
    UNCONFIRMED = "unconfirmed"
    DUPLICATES = "duplicates"
    NOT_SUBSCRIBED = "not_subscribed"
    CONNECTS = "connects"
    DISCONNECTS = "disconnects"


@dataclass
class PubSubMetrics:
    """What one publisher (one transport connection) pushed, received and applied.

    Read them with :meth:`snapshot` (or ``PersistClient.pubsub_metrics()``,
    which adds the client's ``fallback_polls``).
    """

    pushed: int = 0
    """Commits of this process announced (shard and SeqNo) to other processes."""
    push_dropped: int = 0
    """Pushes not sent: the send queue was full or they waited too long (server slow or gone).
    Receivers find those commits by their poll of Consensus (``listen_poll_pushed_s``,
    ``pubsubPollMs``)."""
    sent: int = 0
    """Pushes handed to the transport."""
    received: int = 0
    """Pushes that arrived for a subscribed shard."""
    applied_cleanly: int = 0
    """Received pushes past the cached SeqNo that Consensus confirmed: its rows were installed."""
    unconfirmed: int = 0
    """Received pushes past the cached SeqNo that Consensus did not hold (forged, or the read
    failed): ignored."""
    duplicates: int = 0
    """Received pushes already in the cached state (delivered twice, or seen in-process)."""
    not_subscribed: int = 0
    """Received pushes for a shard this process is not subscribed to (ignored)."""
    connects: int = 0
    """Times the transport connected (or reconnected)."""
    disconnects: int = 0
    """Times a live connection was lost."""
    _latency_ms: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES), repr=False
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def incr(self, count: PubSubCount, by: int = 1) -> None:
        """Add ``by`` to the counter ``count`` (thread-safe)."""
        with self._lock:
            setattr(self, count.value, getattr(self, count.value) + by)

    def record_latency(self, ms: float) -> None:
        """Record one push-to-apply latency (writer's wall clock to this process applying it)."""
        with self._lock:
            self._latency_ms.append(max(0.0, ms))

    def snapshot(self) -> dict[str, float]:
        """The counters, plus ``latency_p50_ms``/``latency_p95_ms`` over recent applies."""
        with self._lock:
            out: dict[str, float] = {k: v for k, v in vars(self).items() if not k.startswith("_")}
            lat = sorted(self._latency_ms)
        out["latency_samples"] = len(lat)
        out["latency_p50_ms"] = _pct(lat, 0.50)
        out["latency_p95_ms"] = _pct(lat, 0.95)
        return out


def _pct(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]
