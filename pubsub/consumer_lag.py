"""Named consumers' lag as Prometheus gauges, on ``persist pubsub serve --metrics-port``.

With ``--consumer-lag``, the metrics endpoint also says, for every named
consumer of every shard at one location (``--blob``/``--consensus``), how far
it is behind the shard's upper: rows, bytes and times (milliseconds for
Spark-written shards), and whether a live query holds it. These gauges name
shards and consumers, unlike the server's own counters, so they are exported
only when asked.

Cheap by construction: a scrape computes the gauges from the shard states this
process caches (:func:`~pyspark_persist.state.consumers.consumer_lag` sums the
batch sizes in state, no Blob read). A cached state is read again from
Consensus (one indexed scan of the rows after its SeqNo) only when the server
saw a push of that shard past it, or when it is older than ``max_age_s`` (a
writer without PubSub pushes nothing); the list of shards is read again every
``max_age_s``. A location that cannot be read leaves the last gauges and logs
a warning: a scrape never fails for it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..state.client import PersistClient
from ..state.consumers import consumer_lag, is_held
from ..state.errors import PersistError, ShardNotFound
from ..state.state import ShardState
from .subscriptions import location_key, make_topic

log = logging.getLogger(__name__)

GAUGES: tuple[tuple[str, str], ...] = (
    ("persist_consumer_behind_rows", "Rows of the shard past the consumer's committed position."),
    ("persist_consumer_behind_bytes", "Bytes of the shard past the consumer's committed position."),
    (
        "persist_consumer_behind_times",
        "Times between the consumer's committed upper and the shard's upper (ms for Spark-written "
        "shards).",
    ),
    ("persist_consumer_held", "1 while a live query holds the consumer, else 0."),
)


class ConsumerLag:
    """The lag gauges of every named consumer at ``client``'s location (see the module doc).

    :meth:`pushed` is the PubSub server's hook (called on its event loop for
    every push: it only records the SeqNo); :meth:`render` runs on the
    metrics endpoint's thread at each scrape.
    """

    def __init__(
        self,
        client: PersistClient,
        *,
        max_age_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._max_age_s = max_age_s
        self._clock = clock
        location = location_key(client.consensus.uri)
        self._prefix = None if location is None else make_topic(location, "")
        self._lock = threading.Lock()
        self._pushed: dict[str, int] = {}
        self._read_at: dict[str, float] = {}
        self._states: dict[str, ShardState] = {}
        self._listed_at: float | None = None

    def pushed(self, topic: str, seqno: int) -> None:
        """The server received a push: ``topic`` reached ``seqno`` (only a hint to read
        Consensus at the next scrape)."""
        if self._prefix is not None and topic.startswith(self._prefix):
            shard = topic[len(self._prefix) :]
            with self._lock:
                if seqno > self._pushed.get(shard, 0):
                    self._pushed[shard] = seqno

    def states(self) -> dict[str, ShardState]:
        """Every shard's state, each read from Consensus only when stale (see the module doc)."""
        now = self._clock()
        if self._listed_at is None or now - self._listed_at >= self._max_age_s:
            names = set(self._client.list_shards())
            self._listed_at = now
            for gone in set(self._states) - names:
                self._states.pop(gone)
            for name in names - set(self._states):
                self._read(name)
        for name, state in list(self._states.items()):
            with self._lock:
                pushed = self._pushed.get(name, 0)
            if pushed > state.seqno or now - self._read_at[name] >= self._max_age_s:
                self._read(name)
                with self._lock:  # answered (a forged SeqNo must not cost a read per scrape)
                    if self._pushed.get(name) == pushed:
                        del self._pushed[name]
        return dict(self._states)

    def _read(self, name: str) -> None:
        """Read shard ``name``'s newest state; one dropped since it was listed is left out until
        it is listed again."""
        self._read_at[name] = self._clock()
        try:
            self._states[name] = self._client.machine(name).fetch_latest()
        except ShardNotFound:  # ShardDropped too
            self._states.pop(name, None)

    def render(self) -> str:
        """The gauges in Prometheus' text format (HELP and TYPE once per metric)."""
        try:
            states = self.states()
        except (PersistError, OSError) as e:
            log.warning("consumer lag: cannot read %s: %s", self._client.consensus.uri, e)
            states = dict(self._states)
        now_ms = int(time.time() * 1000)
        samples: dict[str, list[str]] = {name: [] for name, _ in GAUGES}
        for shard, state in sorted(states.items()):
            for consumer, c in sorted(state.consumers.items()):
                labels = f'{{shard="{_label(shard)}",consumer="{_label(consumer)}"}}'
                behind = consumer_lag(state, consumer)
                values = (behind.rows, behind.bytes, behind.times, int(is_held(state, c, now_ms)))
                for (name, _), value in zip(GAUGES, values, strict=True):
                    samples[name].append(f"{name}{labels} {value}")
        lines = []
        for name, help_text in GAUGES:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples[name]]
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A label value in the text format: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
