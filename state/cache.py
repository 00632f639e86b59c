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

from .consensus import VersionedData
from .diff import decode
from .state import ShardState


class SharedState:
    """The newest known state of one shard in this process. Only ever moves forward."""

    def __init__(self, shard_id: str) -> None:
        self.shard_id = shard_id
        self._state: ShardState | None = None
        self._cond = threading.Condition()
        self._stale_gen = 0
        self._push_sources: set[int] = set()

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

        Listens then poll Consensus only every ``listen_poll_pushed_s``.
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

    def apply_pushed(self, row: VersionedData) -> bool:
        """Apply a diff pushed by another process; True iff it was installed.

        Installed only when ``row.seqno`` follows the cached SeqNo exactly.
        Duplicates and old diffs (and any diff before the state is first
        loaded) are ignored; a gap, or a diff that does not decode or apply,
        marks the state stale so waiting listens read Consensus now.
        """
        for _ in range(3):  # re-check if another path installed a state meanwhile
            cached = self._state
            if cached is None or row.seqno <= cached.seqno:
                return False
            if row.seqno != cached.seqno + 1:
                break
            try:
                diff = decode(row.data, where=f"pushed diff {self.shard_id!r} SeqNo {row.seqno}")
                if diff.shard_id != self.shard_id or diff.to_seqno != row.seqno:
                    break
                new_state = cached.apply(diff)
            except Exception:  # noqa: BLE001 - a bad push must never break the cache
                break
            with self._cond:
                if self._state is cached:
                    self._state = new_state
                    self._cond.notify_all()
                    return True
        self.mark_stale()
        return False


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
