"""One shared copy of each shard's state per process, and a way to wait for it to change.

Every handle to a shard inside one Python process (writers, readers, the
Spark driver's lease holder, a listen) reads and updates the same
:class:`SharedState`, so a write made by one handle is seen by every other
at once, with no network hop, and a waiting listen wakes immediately. PubSub
feeds the same object with diffs from other processes; polling Consensus
is the fallback that feeds it when nothing else does.
"""

from __future__ import annotations

import threading
import time

from pyspark_persist.state.state import ShardState


class SharedState:
    """The newest known state of one shard in this process. Only ever moves forward."""

    def __init__(self, shard_id: str) -> None:
        self.shard_id = shard_id
        self._state: ShardState | None = None
        self._cond = threading.Condition()

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

    def wait_for_seqno_after(self, seqno: int, timeout_s: float) -> ShardState | None:
        """Block until the cached state is newer than ``seqno`` or the timeout passes."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._state is None or self._state.seqno <= seqno:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return self._state


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
