"""One shared copy of each shard's state per process, and a way to wait for it to change.

Every handle to a shard inside one Python process (writers, readers, the
Spark driver's lease holder, a listen) reads and updates the same
:class:`SharedState`, so a write made by one handle is seen by every other
at once, with no network hop, and a waiting listen wakes immediately. PubSub
tells the same object when another process committed, and it then reads
Consensus (a push is a hint, never trusted on its own); polling Consensus is
the fallback that feeds it when nothing else does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from . import retry
from .state import ShardState


class SharedState:
    """The newest known state of one shard in this process. Only ever moves forward."""

    def __init__(self, shard_id: str) -> None:
        self.shard_id = shard_id
        self._state: ShardState | None = None
        self._cond = threading.Condition()
        self._stale_gen = 0
        self._push_sources: set[int] = set()
        self._read_consensus: Callable[[], ShardState] | None = None

    @property
    def state(self) -> ShardState | None:
        """The newest state this process knows of (``None`` before the first load)."""
        return self._state

    def update(self, state: ShardState) -> bool:
        """Install ``state`` if it is newer than the cached one; wake waiters. True if installed."""
        with self._cond:
            if self._state is not None and state.seqno <= self._state.seqno:
                return False
            self._state = state
            self._cond.notify_all()
            return True

    def replace(self, state: ShardState) -> None:
        """Install ``state`` even if it is not newer: the cached one proved not Consensus's."""
        with self._cond:
            self._state = state
            self._stale_gen += 1
            self._cond.notify_all()

    def forget(self) -> None:
        """Drop the cached state: the shard was dropped, so the next read finds it gone (a
        recreated shard starts again at SeqNo 1, which :meth:`update` would refuse)."""
        with self._cond:
            self._state = None
            self._stale_gen += 1
            self._cond.notify_all()

    def wait_for_seqno_after(self, seqno: int, timeout_s: float) -> ShardState | None:
        """Block until the cached state is newer than ``seqno`` or the timeout passes.

        Also returns ``None`` early when the state is marked stale meanwhile
        (see :meth:`mark_stale`), so the caller reads Consensus now.
        """
        deadline = time.monotonic() + timeout_s
        with self._cond:
            gen = self._stale_gen
            while self._state is None or self._state.seqno <= seqno:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stale_gen != gen:
                    return None
                self._cond.wait(remaining)
            return self._state

    # --- PubSub seam: fed by pyspark_persist.pubsub, read by Listen -------------------

    @property
    def stale_generation(self) -> int:
        """Bumped whenever Consensus may hold news this cache cannot get from a push."""
        return self._stale_gen

    @property
    def push_healthy(self) -> bool:
        """True while some PubSub transport is connected and subscribed to this shard.

        Listens then poll Consensus only every ``listen_poll_pushed_s``, and a Spark
        source only every ``pubsubPollMs``: a push may be lost, so neither trusts it longer.
        """
        return bool(self._push_sources)

    def mark_stale(self) -> None:
        """Tell waiting listens to read Consensus now (a push was missed or did not apply)."""
        with self._cond:
            self._stale_gen += 1
            self._cond.notify_all()

    def set_push_healthy(self, source: object, healthy: bool) -> None:
        """Record whether ``source`` (a PubSub transport) currently delivers this shard's diffs.

        Any change marks the state stale: on connecting, a listen catches up
        on what was committed before the subscription; on losing the
        connection, it falls back to fast polling at once.
        """
        with self._cond:
            before = bool(self._push_sources)
            if healthy:
                self._push_sources.add(id(source))
            else:
                self._push_sources.discard(id(source))
            if bool(self._push_sources) != before or healthy:
                self._stale_gen += 1
                self._cond.notify_all()

    def confirm_pushes_with(self, read_consensus: Callable[[], ShardState]) -> None:
        """Give this state the way to check a pushed diff: ``read_consensus`` reads the rows
        this process has not seen and installs them (``Machine.fetch_latest``)."""
        self._read_consensus = read_consensus

    def apply_pushed(self, seqno: int) -> bool:
        """Take another process's push (its commit reached ``seqno``) as a hint; True iff
        Consensus confirmed it.

        Nothing received over PubSub is trusted on its own: a forged,
        replayed or reordered push must not change what a writer or reader
        decides. So a push whose SeqNo is past the cached one makes this
        process read Consensus now (one indexed scan of the rows after the
        cached SeqNo, without retrying), and what Consensus holds is
        installed, however many rows that is. The push counts as confirmed
        when Consensus has reached its SeqNo. Old and duplicate pushes (and any
        push before the state is first loaded) are ignored; a read that fails
        marks the state stale, so waiting listens poll Consensus themselves.
        """
        cached = self._state
        read_consensus = self._read_consensus
        if cached is None or seqno <= cached.seqno:
            return False
        if read_consensus is None:
            self.mark_stale()
            return False
        try:
            with retry.deadline_in(0.0):
                state = read_consensus()
        except Exception:  # noqa: BLE001 - a push must never break the cache
            self.mark_stale()
            return False
        return state.seqno >= seqno


class StateCache:
    """The process-wide registry of :class:`SharedState`, keyed by Consensus location and shard."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shards: dict[tuple[str, str], SharedState] = {}

    def get(self, location: str, shard_id: str) -> SharedState:
        """The shared state of ``shard_id`` at ``location``, created empty on first use."""
        with self._lock:
            key = (location, shard_id)
            shared = self._shards.get(key)
            if shared is None:
                shared = self._shards[key] = SharedState(shard_id)
            return shared


PROCESS_CACHE = StateCache()
"""The one cache every client in this process uses unless given its own."""
