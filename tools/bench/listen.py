"""The write->listen latency probe of ``persist bench core`` and ``persist bench pubsub``.

A writer appends one row at a time at random intervals; a listener in another thread
follows the shard with ``reader.listen`` and notes when each row reaches it. Per row it
gives two spans: *write->listen*, from just before the append to the listener holding the
row (the append included), and *commit->listen*, from the append returning. Whether the
listener is woken in-process, pushed by PubSub or left to poll Consensus is the callers'
choice of clients: the same client for both, separate clients with separate state caches
(as two processes would be), with or without a publisher.
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

from pyspark_persist.state import PersistClient


@dataclass(frozen=True)
class ListenSamples:
    """What the probe saw, in seconds per row the listener received."""

    write_s: tuple[float, ...]
    """From just before the append to the listener holding the row."""
    commit_s: tuple[float, ...]
    """From the append returning to the listener holding the row."""
    missed: int
    """Rows the listener did not receive within the timeout (in neither figure)."""


def _seen(received: dict[int, float], errors: list[BaseException], i: int) -> bool:
    return i in received or bool(errors)


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
    reader = (shard if listener is writer else listener.open_shard(name)).reader()
    listen = reader.listen(reader.latest_as_of())
    if settle is not None:
        settle(name)
    listen.next(timeout_s=0.2)
    received: dict[int, float] = {}
    errors: list[BaseException] = []
    cond = threading.Condition()
    stop = threading.Event()

    def follow() -> None:
        try:
            while not stop.is_set():
                event = listen.next(timeout_s=0.2)
                now = time.perf_counter()
                if event is None or not event.parts:
                    continue
                ids = reader.fetch(event.parts).column("id").to_pylist()
                with cond:
                    for i in ids:
                        received.setdefault(i, now)
                    cond.notify_all()
        except BaseException as e:  # noqa: BLE001 - raised in the writer's thread
            errors.append(e)
            with cond:
                cond.notify_all()

    thread = threading.Thread(target=follow, name="bench-listener", daemon=True)
    thread.start()
    before: dict[int, float] = {}
    after: dict[int, float] = {}
    try:
        for i in range(samples):
            time.sleep(rng.uniform(*gap_ms) / 1e3)
            table = row(i)
            before[i] = time.perf_counter()
            append(table)
            after[i] = time.perf_counter()
            with cond:
                cond.wait_for(partial(_seen, received, errors, i), timeout_s)
            if errors:
                raise errors[0]
    finally:
        stop.set()
        thread.join(timeout=5)
    seen = [i for i in before if i in received]
    return ListenSamples(
        write_s=tuple(received[i] - before[i] for i in seen),
        commit_s=tuple(received[i] - after[i] for i in seen),
        missed=samples - len(seen),
    )
