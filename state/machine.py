"""The loop that applies pure commands to a shard: compute, compare-and-set, retry, publish.

:meth:`Machine.run` evaluates a command against the newest state this
process knows, encodes the diff, and compare-and-sets it at the next SeqNo.
A lost race re-reads the diffs it missed and evaluates the command again; an
unavailable store or an unknown outcome is retried (with jittered backoff)
for idempotent commands, whose re-evaluation against fresher state answers
whether the earlier attempt landed. After a success the new state goes into
the process's :class:`~pyspark_persist.state.cache.SharedState` (waking
in-process listeners) and its SeqNo is pushed, best effort, to PubSub.

A machine serves one *incarnation* of its shard: the one of the first state
it loads (``ShardState.incarnation``, minted when the shard was created).
Once the shard is dropped, every call raises :class:`ShardDropped`, even
after a shard of the same name was created again: a state of another
incarnation is never computed on nor handed out (it is still put in the
shared cache, for the machines that serve it). A drop leaves a tombstone
that the next shard of the name is created on, so that one's SeqNos are
past every SeqNo of the dropped one, and a compare-and-set computed on the
dropped shard can never land in it. ``PersistClient.open_shard`` gives a
fresh machine once the old one's shard is dropped.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from . import retry
from .blob import Blob
from .cache import SharedState
from .commands import Apply, Refuse, add_rollup
from .config import PersistConfig
from .consensus import CaSCommitted, Consensus, VersionedData
from .diff import encode
from .errors import Determinate, Indeterminate, ShardDropped, ShardNotFound
from .state import ShardState
from .versions import load_state, remember_head, write_rollup

log = logging.getLogger(__name__)

R = TypeVar("R")

_CONTENTION = retry.RetryPolicy(first_backoff_s=0.001, max_backoff_s=0.25)
"""Backoff between compare-and-set attempts: short, since a lost race is usually won next."""


class DiffPublisher(Protocol):
    """Where a commit is announced to other processes (implemented by pubsub).

    The seam between the shard and :mod:`pyspark_persist.pubsub` (which this
    package never imports): the client subscribes each shard's
    :class:`SharedState` when it first uses the shard, and the publisher
    tells it of commits in other processes with :meth:`SharedState.apply_pushed`.
    A push is the shard and the new SeqNo, nothing of the diff: a receiver
    reads the diff from Consensus anyway, and the transport (a server any
    local process may reach) never sees a row.
    """

    def push(self, shard_id: str, seqno: int) -> None:
        """Tell subscribers of ``shard_id`` that SeqNo ``seqno`` is committed; must never block
        or raise."""

    def subscribe(self, shard_id: str, shared: SharedState, consensus_uri: str) -> None:
        """Deliver pushes of ``shard_id`` (in ``consensus_uri``) into ``shared``; never raises."""

    def unsubscribe(self, shard_id: str) -> None:
        """Undo one :meth:`subscribe` of ``shard_id``; never raises."""


class NoopPublisher:
    """The publisher when PubSub is off: other processes learn of changes by polling."""

    def push(self, shard_id: str, seqno: int) -> None:
        """Tell nobody."""

    def subscribe(self, shard_id: str, shared: SharedState, consensus_uri: str) -> None:
        """Nothing to subscribe to."""

    def unsubscribe(self, shard_id: str) -> None:
        """Nothing to unsubscribe from."""


class Count(enum.Enum):
    """A counter of :class:`Metrics`: what :meth:`Metrics.incr` takes, so a misspelled
    counter is a type error (the value is the field it adds to)."""

    CONSENSUS_FETCHES = "consensus_fetches"
    CAS_ATTEMPTS = "cas_attempts"
    CAS_MISMATCHES = "cas_mismatches"
    CAS_RETRIES_AFTER_ERROR = "cas_retries_after_error"
    COMMITS = "commits"
    ROLLUPS_WRITTEN = "rollups_written"
    LISTEN_POLLS = "listen_polls"


@dataclass
class Metrics:
    """Counters a user (and the tests) can read to see what a client did."""

    consensus_fetches: int = 0
    cas_attempts: int = 0
    cas_mismatches: int = 0
    cas_retries_after_error: int = 0
    commits: int = 0
    rollups_written: int = 0
    listen_polls: int = 0
    """Consensus reads a waiting listen made because nothing woke it (the polling fallback)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def incr(self, count: Count, by: int = 1) -> None:
        """Add ``by`` to the counter ``count`` (thread-safe)."""
        with self._lock:
            setattr(self, count.value, getattr(self, count.value) + by)

    def snapshot(self) -> dict[str, int]:
        """The counters as a plain dict."""
        with self._lock:
            return {k: v for k, v in vars(self).items() if not k.startswith("_")}


@dataclass
class RunInfo:
    """What one :meth:`Machine.run` saw besides its result: the attempts whose outcome is unknown.

    A caller that cleans up after a refused command (compaction deleting its
    merged parts, a writer deleting its staged parts) must not when an attempt
    had a lost reply: that attempt may have committed, and a later state may
    still reference what it wrote (see :func:`~pyspark_persist.state.write.never_committed`).
    """

    indeterminate_seqnos: list[int] = field(default_factory=list)
    """The SeqNos of compare-and-set attempts whose reply was lost."""

    @property
    def uncertain(self) -> bool:
        """True when some attempt may have committed although the result says otherwise."""
        return bool(self.indeterminate_seqnos)


class Machine:
    """Applies commands to one shard of one client. Thread-safe; share it freely."""

    def __init__(
        self,
        shard_id: str,
        blob: Blob,
        consensus: Consensus,
        shared: SharedState,
        config: PersistConfig,
        metrics: Metrics,
        publisher: DiffPublisher,
        clock_ms: Callable[[], int],
        on_commit: Callable[[Machine, ShardState, ShardState], None] | None = None,
    ) -> None:
        self.shard_id = shard_id
        self.blob = blob
        self.consensus = consensus
        self.shared = shared
        self.config = config
        self.metrics = metrics
        self.publisher = publisher
        self.clock_ms = clock_ms
        self.on_commit = on_commit
        self._cas_lock = threading.RLock()  # reentrant: a commit may write a rollup via run()
        self.after_run: Callable[[Machine], None] | None = None
        """Called after each run, outside the lock (compaction backpressure)."""
        self._incarnation: str | None = None
        self._bind_lock = threading.Lock()

    @property
    def incarnation(self) -> str | None:
        """The incarnation this machine serves (``None`` until it first loads a state)."""
        return self._incarnation

    def state(self) -> ShardState:
        """The newest state of this machine's incarnation this process knows of, loading it on
        first use (or when the cache holds another incarnation's: Consensus decides)."""
        state = self.shared.state
        if state is not None and self._incarnation in (None, state.incarnation):
            return self._own(state)
        return self.fetch_latest()

    def fetch_latest(self) -> ShardState:
        """Read the diffs this process has not seen from Consensus (a poll) and install them.

        ShardDropped when this machine's incarnation is gone (dropped, being
        dropped, or replaced by a shard created again under its name).
        """
        try:
            state = self.refresh()
        except ShardNotFound as e:
            if self._incarnation is None or isinstance(e, ShardDropped):
                raise
            raise self._dropped() from e
        return self._own(state)

    def refresh(self) -> ShardState:
        """Install Consensus's newest state of the shard in the shared cache, whatever its
        incarnation, and return it: how PubSub pushes are confirmed (they serve every
        machine of the shard in this process). ShardNotFound when there is none."""
        self.metrics.incr(Count.CONSENSUS_FETCHES)
        cached = self.shared.state
        with retry.deadline_in(self.config.retry_timeout_s):
            state = load_state(self.shard_id, self.consensus, self.blob, cached)
        if state is None:
            if cached is not None:
                self.shared.forget()  # dropped: a shard created again under the name is new
            raise self._not_found()
        if cached is not None and state is not cached and state.seqno <= cached.seqno:
            # Not newer, yet not the cached state: Consensus no longer continues the cached
            # history (a shard dropped and created again before drops left a tombstone, or
            # with SeqNos restarted by an older version), and what it holds now wins.
            self.shared.replace(state)
            return state
        self.shared.update(state)
        newest = self.shared.state
        return newest if newest is not None and newest.incarnation == state.incarnation else state

    def reload(self) -> ShardState:
        """Read the whole state from Consensus, ignoring (and replacing) what this process held.

        For when the cached state proved wrong: a compare-and-set mismatch
        reported a head that is not ahead of it, which Consensus alone never does.
        """
        self.metrics.incr(Count.CONSENSUS_FETCHES)
        try:
            with retry.deadline_in(self.config.retry_timeout_s):
                state = load_state(self.shard_id, self.consensus, self.blob, None)
        except ShardNotFound as e:
            if self._incarnation is None:
                raise
            raise self._dropped() from e
        if state is None:
            self.shared.forget()  # dropped (see refresh)
            raise self._not_found() if self._incarnation is None else self._dropped()
        self.shared.replace(state)
        return self._own(state)

    def _own(self, state: ShardState) -> ShardState:
        """``state``, if it is of this machine's incarnation (binding an unbound machine to
        it); ShardDropped if it is another's."""
        if self._incarnation is None:
            with self._bind_lock:
                if self._incarnation is None:
                    self._incarnation = state.incarnation
        if state.incarnation != self._incarnation:
            raise self._dropped()
        return state

    def _not_found(self) -> ShardNotFound:
        return ShardNotFound(
            f"shard {self.shard_id!r} does not exist in consensus {self.consensus.uri}: "
            "create it (open_shard with a schema and create=True) or check the name and URIs"
        )

    def _dropped(self) -> ShardDropped:
        return ShardDropped(
            f"shard {self.shard_id!r} in consensus {self.consensus.uri} was dropped (persist "
            "shards drop) after this handle, reader, listen or query opened it; it never reads "
            "from or writes to a shard created again under that name. Open the shard again "
            "(open_shard) to use the shard of that name now; restart a streaming query that "
            "read it with a new checkpointLocation"
        )

    def run(
        self,
        cmd: Callable[[ShardState], Apply[R] | Refuse[R]],
        *,
        idempotent: bool = True,
        info: RunInfo | None = None,
    ) -> R:
        """Apply ``cmd`` until it is refused or its diff is committed; return its result.

        A non-idempotent command whose compare-and-set outcome is unknown
        re-raises :class:`Indeterminate` rather than risk applying twice.
        ``info``, when given, collects the attempts whose outcome was unknown.
        Threads of one process take turns (a lock per machine): racing each
        other through Consensus would only turn into mismatches and refetches,
        while other processes still race through compare-and-set as usual.
        """
        with self._cas_lock:
            result = self._run(cmd, idempotent, info if info is not None else RunInfo())
        if self.after_run is not None:
            self.after_run(self)
        return result

    def _run(
        self, cmd: Callable[[ShardState], Apply[R] | Refuse[R]], idempotent: bool, info: RunInfo
    ) -> R:
        try:
            return self._attempt(cmd, idempotent, info)
        except Determinate as e:
            if not info.uncertain:
                raise
            # An earlier attempt may have landed: a "surely did not happen" error would lie.
            raise Indeterminate(
                f"shard {self.shard_id!r}: the outcome is unknown: the compare-and-set to SeqNo "
                f"{info.indeterminate_seqnos[0]} lost its reply and may have landed, and finding "
                f"out failed: {e}. Retry with the same idempotency token to learn whether it did"
            ) from e

    def _attempt(
        self, cmd: Callable[[ShardState], Apply[R] | Refuse[R]], idempotent: bool, info: RunInfo
    ) -> R:
        """The compare-and-set loop of :meth:`run`; notes each lost reply in ``info``."""
        with retry.deadline_in(self.config.retry_timeout_s) as deadline:
            backoff = retry.Backoff(_CONTENTION)
            state = self.state()
            mismatches = 0
            while True:
                outcome = cmd(state)
                if not isinstance(outcome, Apply):
                    return outcome.result
                new_state = state.apply(outcome.diff)
                row = VersionedData(new_state.seqno, encode(outcome.diff))
                self.metrics.incr(Count.CAS_ATTEMPTS)
                try:
                    res = self.consensus.compare_and_set(self.shard_id, state.seqno, row)
                except (Indeterminate, Determinate) as e:
                    if isinstance(e, Indeterminate):
                        info.indeterminate_seqnos.append(row.seqno)
                        if not idempotent:
                            raise
                    if isinstance(e, Determinate) and not retry.is_transient(e):
                        raise
                    if time.monotonic() > deadline:
                        raise
                    self.metrics.incr(Count.CAS_RETRIES_AFTER_ERROR)
                    log.debug("shard %s: compare-and-set failed (%s); retrying", self.shard_id, e)
                    backoff.sleep(deadline)
                    state = self.refetch()
                    continue
                if isinstance(res, CaSCommitted):
                    self.install(state, new_state, row)
                    return outcome.result
                self.metrics.incr(Count.CAS_MISMATCHES)
                mismatches += 1
                if mismatches > 2:
                    backoff.sleep(deadline)
                if res.current is None or res.current <= state.seqno:
                    # Consensus is not ahead of what we held: our state was never its.
                    log.warning(
                        "shard %s: the state held at SeqNo %s is not Consensus's (head %s); "
                        "reloading it",
                        self.shard_id,
                        state.seqno,
                        res.current,
                    )
                    state = retry.call(
                        self.reload,
                        store=self._store,
                        what=f"reloading shard {self.shard_id!r}",
                        transient=retry.is_transient,
                    )
                else:
                    state = self.refetch()

    def install(self, before: ShardState, after: ShardState, row: VersionedData) -> None:
        """Make a commit of this process known: ``row`` took the shard from ``before`` to
        ``after``. :meth:`announce` it, then :meth:`follow_up`; what :meth:`run` does after
        each commit."""
        self.announce(after, row)
        self.follow_up(before, after)

    def announce(self, after: ShardState, row: VersionedData) -> None:
        """Tell readers of a commit (``row``, taking the shard to ``after``): into the shared
        cache (waking listeners) and pushed to PubSub. A transaction across shards
        (:mod:`.txn_commit`) announces every participant before any :meth:`follow_up`, so a
        reader of its last shard does not wait on the others' rollups."""
        self.metrics.incr(Count.COMMITS)
        self.shared.update(remember_head(after, row))
        self.publisher.push(self.shard_id, row.seqno)

    def follow_up(self, before: ShardState, after: ShardState) -> None:
        """The work a commit from ``before`` to ``after`` leaves once announced: a rollup when
        due, and maintenance told."""
        self._maybe_rollup(after)
        if self.on_commit is not None:
            self.on_commit(self, after, before)

    def refetch(self) -> ShardState:
        """:meth:`fetch_latest`, retrying unavailable stores until the command's deadline."""
        return retry.call(
            self.fetch_latest,
            store=self._store,
            what=f"reading shard {self.shard_id!r}",
            transient=retry.is_transient,
        )

    @property
    def _store(self) -> str:
        return f"consensus {self.consensus.uri}"

    def _maybe_rollup(self, state: ShardState) -> None:
        """Write a rollup when the chain of diffs since the last one is long enough."""
        last = max(state.rollups, default=0)
        if state.seqno - last < self.config.rollup_interval:
            return
        try:
            key = write_rollup(self.blob, state)
            self.metrics.incr(Count.ROLLUPS_WRITTEN)
            self.run(lambda s: add_rollup(s, seqno=state.seqno, key=key))
        except Exception as e:  # noqa: BLE001 - a missed rollup is retried by the next commit
            log.warning("shard %s: rollup at SeqNo %s failed: %s", self.shard_id, state.seqno, e)
