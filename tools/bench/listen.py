"""The write->listen latency probe of ``persist bench core``, ``pubsub`` and ``txn``.

A writer appends one row at a time at random intervals; a listener in another thread
follows the shard with ``reader.listen`` and notes when each row reaches it. Per row it
gives two spans: *write->listen*, from just before the append to the listener holding the
row (the append included), and *commit->listen*, from the append returning. Whether the
listener is woken in-process, pushed by PubSub or left to poll Consensus is the callers'
choice of clients: the same client for both, separate clients with separate state caches
(as two processes would be), with or without a publisher.

:func:`probe_listen` writes by one-row appends; :class:`Follower`, the listener's half of
it, serves callers that commit their rows another way (``persist bench txn`` times rows
committed by transactions beside rows appended, one follower per shard).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import pyarrow as pa

from pyspark_persist.state import PersistClient, Shard


@dataclass(frozen=True)
class ListenSamples:
    """What the probe saw, in seconds per row the listener received."""

    write_s: tuple[float, ...]
    """From just before the append to the listener holding the row."""
    commit_s: tuple[float, ...]
    """From the append returning to the listener holding the row."""
    missed: int
    """Rows the listener did not receive within the timeout (in neither figure)."""


class Follower:
    """A listen on one shard, followed in a thread of its own: when each row (by its ``id``)
    first reached it, by ``time.perf_counter``.

    Opened from the shard's newest time, so only what is written after counts. ``settle``
    runs once the listen is open, before anything is timed (to wait for PubSub to connect);
    then one catch-up ``next`` absorbs what subscribing woke. An error in the listener is
    raised by the next :meth:`wait`.
    """

    def __init__(self, shard: Shard, settle: Callable[[], None] | None = None) -> None:
        self._reader = shard.reader()
        self._listen = self._reader.listen(self._reader.latest_as_of())
        if settle is not None:
            settle()
        self._listen.next(timeout_s=0.2)
        self._received: dict[int, float] = {}
        self._errors: list[BaseException] = []
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="bench-listener", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        try:
            while not self._stop.is_set():
                event = self._listen.next(timeout_s=0.2)
                now = time.perf_counter()
                if event is None or not event.parts:
                    continue
                ids = self._reader.fetch(event.parts).column("id").to_pylist()
                with self._cond:
                    for i in ids:
                        self._received.setdefault(i, now)
                    self._cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the writer's thread
            self._errors.append(e)
            with self._cond:
                self._cond.notify_all()

    def _seen(self, i: int) -> bool:
        return i in self._received or bool(self._errors)

    def wait(self, i: int, timeout_s: float) -> float | None:
        """When row ``i`` reached the listen, waiting up to ``timeout_s`` for it; ``None``
        when it did not come in time. Raises the listener's error, if it failed."""
        with self._cond:
            self._cond.wait_for(partial(self._seen, i), timeout_s)
        if self._errors:
            raise self._errors[0]
        return self._received.get(i)

    def close(self) -> None:
        """Stop following (the listen's thread ends within its next poll)."""
        self._stop.set()
        self._thread.join(timeout=5)


def probe_listen(
    writer: PersistClient,
    listener: PersistClient,
    schema: pa.Schema,
    row: Callable[[int], pa.Table],
    samples: int,
    gap_ms: tuple[float, float],
    *,
    seed: int = 7,
    settle: Callable[[str], None] | None = None,
    timeout_s: float = 10.0,
) -> ListenSamples:
    """Append ``row(i)`` for ``i`` in ``range(samples)`` to a fresh shard of ``schema``
    through ``writer``, a uniformly random ``gap_ms`` apart, and time each row's arrival at a
    listen opened through ``listener`` (``writer`` itself for an in-process listener).

    ``row(i)`` must hold the one row whose ``id`` column is ``i``. ``settle(shard name)``
    runs once the listen is open, before anything is timed (to wait for PubSub to connect);
    then one catch-up ``next`` absorbs what subscribing woke. A row not seen within
    ``timeout_s`` is missed; an error in the listener is raised here.
    """
    rng = random.Random(seed)
    name = f"bench-listen-{uuid.uuid4().hex[:12]}"
    shard = writer.open_shard(name, schema)
    append = shard.writer().append
    append(row(-1))
    follower = Follower(
        shard if listener is writer else listener.open_shard(name),
        None if settle is None else partial(settle, name),
    )
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    received: dict[int, float] = {}
    try:
        for i in range(samples):
            time.sleep(rng.uniform(*gap_ms) / 1e3)
            table = row(i)
            before[i] = time.perf_counter()
            append(table)
            after[i] = time.perf_counter()
            seen = follower.wait(i, timeout_s)
            if seen is not None:
                received[i] = seen
    finally:
        follower.close()
    return ListenSamples(
        write_s=tuple(received[i] - before[i] for i in received),
        commit_s=tuple(received[i] - after[i] for i in received),
        missed=samples - len(received),
    )
