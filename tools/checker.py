"""A Jepsen-style randomized checker: does a shard ever lose or duplicate a committed update?

Materialize checks persist by running a workload over deliberately
unreliable Blob and Consensus and verifying the history it produced. This is
the same idea for pyspark-persist, runnable from CI for seconds and by hand
for as long as you like::

    python -m pyspark_persist.tools.checker --seconds 3600 --backend file-sqlite --processes 2
    python -m pyspark_persist.tools.checker --seed 1234 --seconds 30     # replay a seed
    python -m pyspark_persist.tools.checker --ops 100000 --seconds 1800 --progress 60

What runs, all at once, each piece on its own client (own state cache, own
seeded :class:`~pyspark_persist.state.unreliable.UnreliableBlob` and
:class:`~pyspark_persist.state.unreliable.UnreliableConsensus`: lost
replies, refused calls, timeouts, slowness). The core of every run:

- **writers** (:class:`WriterPiece` threads, and optionally
  :class:`ProcessWriter` processes), each a :class:`Writer`: it owns a writer
  id and appends numbered writes with ``compare_and_append`` and explicit
  tokens (token = write number), retrying errors and upper mismatches with
  the same token, so a lost reply resolves to ``AlreadyCommitted`` or a
  re-commit. Sometimes it *abandons* a write after an error and moves on, so
  unacknowledged writes exist too. Every row value is unique
  (``write_key * 1024 + k``) and a write's size is a function of its key, so
  exactness is checkable row by row. Each write also *retracts* (diff -1)
  the rows of the writer's oldest live write once it has ``LIVE_WRITES``:
  the shard's contents stay bounded while its history grows;
- **snapshot readers** (:class:`SnapshotReader`): snapshots at random
  recent ``as_of`` (at most ``SNAPSHOT_WINDOW`` below the upper), each after
  a downgrade of their since, so since keeps up with the upper;
- **one listen** from the start of the shard (:class:`Listener`): the
  reference history (:class:`History`). It records each write's time (and
  its retraction's), and its reader holds since just below its frontier
  (what a real consumer does).

The shard has a retention period (1 ms, on times that are write numbers):
since follows the lowest reader hold, and compaction folds everything
below it into the contents at since, so the shard stays small. So does the
model: :class:`History` answers "what did the shard hold at ``as_of``" from
the writes live now and the events after the readers' lowest since. A
check therefore costs the same at the hundred-thousandth operation as at
the first, and a run keeps its rate for as long as it runs.

And the fault menu (:data:`FAULTS`; ``--faults`` picks some, by default
all run), each a named :class:`Piece`:

- ``maintenance`` (:class:`Maintainer`): ``compact()`` (fan-in 2-4) of the
  main shard and ``gc()`` with the orphan sweep of every shard in a loop, on
  top of the clients' own background maintenance (small ``gc_interval``).
  Every lost compare-and-set reply of this client runs another compaction
  (concatenating part lists) into the window before the reply is reported:
  the race in which compaction once deleted a merge that had landed and been
  merged again;
- ``slow-writer`` (:class:`SlowWriter`): stages its parts in Blob, waits up
  to 3/4 of the orphan sweep's short grace (``GRACE_S``), then commits, so
  the sweep races it and commits meet ``StagedPartsExpired`` (then it
  stages again);
- ``replace`` (:class:`Replacer`): a writer and a reader on a second shard:
  every write replaces the shard's contents; snapshots at random ``as_of``
  must show exactly one write, never an older one than was acknowledged by
  then, and the state must hold only a few part references per replace;
- ``drop`` (:class:`DropRecreate`): a shard of its own with a writer and a
  listen, dropped (forced, as ``persist shards drop --force``) and created
  again under its name every 0.5-2 s while they run. A handle of a dropped
  incarnation (the writer tries its old one now and then) is never
  acknowledged again, a listen reads only its own incarnation's writes and
  ends with ShardDropped, and the last incarnation holds exactly its own
  acknowledged writes;
- ``resend`` (:class:`Resender`): two-phase writes without a token on a
  shard of its own, whose lost replies reach the caller; after Indeterminate
  the caller resends the same StagedBatch. Every landed write stays readable
  (no PartNotFound) and none lands twice;
- ``abort`` (:class:`SinkAborter`): the sink's protocol on a shard of its
  own: a commit whose attempt is held in flight (:class:`LateConsensus`),
  ``abandon_staged`` from another client (the sink's ``abort``), the held
  attempt reaching the store afterwards or not, the micro-batch replayed
  with its token. Reads never fail with PartNotFound; the batch lands once;
- ``short-grace`` (:class:`ShortGrace`): a writer on a short
  ``staged_part_grace_s`` (``SHORT_GRACE_S``, and the matching
  ``retry_timeout_s``) over a Consensus with outages
  (:class:`BlipConsensus`), while a sweeper runs the orphan sweep in a loop:
  no acknowledged commit references a swept part;
- ``pushes`` (:class:`PushedListen`): a writer and a listener with PubSub (an
  in-process server) whose transport drops pushes at random
  (:class:`DroppingPublisher`): the listen reads every commit in order,
  once, within ``PUSH_STALE_S`` of its acknowledgement;
- ``keyed`` (:class:`KeyedShard`): writers racing upserts and deletes of
  overlapping keys on a keyed shard, a snapshot reader and a listen of it:
  at most one row per key at every time, and each commit's change is the
  serial application of its write, in commit (SeqNo) order
  (:func:`check_keyed`);
- ``consumers`` (:class:`Consumers`): a named consumer of a shard of its own,
  taken back and forth by two holders (one getting its lost replies as
  Indeterminate), reset (forced) now and then, watched throughout: it moves
  back only by a reset, a fenced holder never moves it, since never passes
  its hold, and an acknowledged advance is what it holds;
- ``txns`` (:class:`~.checker_txns.TxnShards`, in its own module): writers
  committing transactions over 2-5 of six shards (one keyed, all with
  retention, kept small by retractions), resent with their token after any
  store error, plain appends to the same shards, and readers taking cuts at
  or after the since they hold: every readable cut shows each transaction in
  all its shards or none, once, and the keyed shard the newest committed
  upsert of each key; a listen held through the run sees each at its
  acknowledged time.

The resend, abort and short-grace pieces share :class:`ModelShard`: the
piece is its shard's one writer, so it knows exactly which writes landed and
checks leased snapshots against that.

What is checked (each failure is a *violation* with details):

- every acknowledged write appears exactly once, whole, at a time it was
  attempted at (its expected upper); an unacknowledged one appears whole or
  not at all, and only if one of its compare-and-sets had an indeterminate
  outcome; no row appears that no writer wrote; a retraction takes away a
  whole write, at the time of the write that asked for it, once;
- every snapshot equals the reference collection at its ``as_of``, with
  every diff +1 (no duplicates);
- the listen's collection at the end equals the final snapshot (read with
  faults off), events are contiguous, uppers only advance (per writer:
  commits strictly increase it; per client it never goes back);
- no *leased* read (snapshot or listen) fails with ``PartNotFound``: GC
  must not delete a part a reader leases; no compaction meets a missing part
  of batches still in state; every part the final state references exists;
- the final state satisfies its invariants (batches tile ``[0, upper)``);
- each fault piece's own checks (:meth:`Piece.verify`).

Adding a fault kind: write a :class:`Piece` (its loops, a reliable
:meth:`~Piece.setup`, a :meth:`~Piece.verify`; it gets clients, seeds, the
model and the recorder from the :class:`Context`, and adds any shard it
creates to ``ctx.shards`` for the maintenance piece to collect) and add it
to :data:`FAULTS`. A deliberate bug to prove it is caught is one
:class:`Sabotage` entry in :data:`SABOTAGE`: a ``patch`` that puts the bug
in, and the violation texts that show it (the CI test runs every entry and
expects one of its ``caught_by`` texts among the violations).

Reproducibility: the seed fixes every random choice (the fault sequence of
every store wrapper, write sizes, abandon decisions, as_of choices, pauses);
each piece's seed is a function of the run's seed and the piece's name.
Thread scheduling is the OS's, so a replay makes the same decisions but may
interleave them differently; the report prints the seed to replay with.

Exit status of :func:`main`: 0 with no violation, 1 otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import contextlib
import dataclasses
import functools
import json
import multiprocessing
import os
import queue
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from pyspark_persist.pubsub.grpc_client import GrpcPublisher
from pyspark_persist.state import (
    DIFF,
    TIME,
    AlreadyCommitted,
    AppendResult,
    Committed,
    ListenEvent,
    PersistClient,
    PersistConfig,
    ReadHandle,
    Shard,
    StagedBatch,
    UpperMismatch,
    WriteHandle,
)
from pyspark_persist.state import write as staged_writes
from pyspark_persist.state.blob import Blob, BlobMeta, BlobValue, open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import (
    CaSCommitted,
    CaSManyMismatch,
    CaSManyResult,
    CaSMismatch,
    CaSOp,
    CaSResult,
    Consensus,
    SeqNo,
    VersionedData,
    open_consensus,
)
from pyspark_persist.state.drop import drop_shard
from pyspark_persist.state.errors import (
    ConsumerFenced,
    CorruptData,
    Determinate,
    Indeterminate,
    InvalidFrontier,
    InvalidUsage,
    PartNotFound,
    PersistError,
    ShardDropped,
    ShardInUse,
    ShardNotFound,
    StagedPartsExpired,
    StoreUnavailable,
)
from pyspark_persist.state.logs import configure as configure_logs
from pyspark_persist.state.machine import DiffPublisher
from pyspark_persist.state.registry import blob_kind, consensus_kind
from pyspark_persist.state.staging import delete_staged
from pyspark_persist.state.state import ConsumerState, ShardState
from pyspark_persist.state.unreliable import (
    BLOB_OPS,
    FAULT_KINDS,
    Faults,
    UnreliableBlob,
    UnreliableConsensus,
)

SCHEMA = pa.schema([("v", pa.int64())])
ROWS_PER_KEY = 1024
"""Row values are ``write_key * ROWS_PER_KEY + k``: a row names its write."""
KEY_PER_WRITER = 10_000_000
"""Write keys are ``writer_index * KEY_PER_WRITER + write_number``."""
LIVE_WRITES = 3
"""Acknowledged writes a writer keeps in the shard: each further write retracts its oldest,
so the shard's contents (and every snapshot and check) stay this size while history grows."""
RETENTION_MS = 1
"""The main shard's retention. Its times are write numbers, far below the clock, so since
follows the lowest reader hold alone, and compaction folds what lies below it."""
SNAPSHOT_WINDOW = 40
"""Snapshot readers read at most this far (in times, about 20 writes) below the upper, and
keep their since at most twice that far behind: what a snapshot reads stays bounded."""
BACKENDS = ("mem", "file-sqlite", "file-postgres")
POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
MAX_DETAILS = 50
"""Violations listed in full; further ones are counted."""
FINISH_TIMEOUT_S = 60.0
"""How long writers may take to finish their last write, and the listen to catch up."""
SLOW_INDEX = 800
"""Writer index of the slow writer (stages, waits, commits), whose parts the sweep races."""
REPLACE_INDEX = 900
"""Writer index of the replacer, which replaces a second shard's contents with each write."""
DROP_INDEX, RESEND_INDEX, ABORT_INDEX, GRACE_INDEX, PUSH_INDEX = 910, 920, 930, 940, 950
CONSUMER_INDEX = 960
"""Writer indexes of the pieces on shards of their own (drop, resend, abort, short-grace,
pushes): their keys name them."""
LIVE_OPS = (
    "writes_acked",
    "writes_abandoned",
    "snapshots",
    "listen_events",
    "replace_snapshots",
    "replaces_acked",
    "drop_writes_acked",
    "drop_listen_events",
    "resend_writes_landed",
    "abort_writes_landed",
    "grace_writes_landed",
    "pushed_writes_acked",
    "keyed_writes_acked",
    "keyed_writes_abandoned",
    "keyed_snapshots",
    "keyed_listen_events",
    "txns_committed",
    "txns_plain_appends",
    "txns_cuts",
    "txns_listen_events",
)
"""The operations ``--ops`` and ``--progress`` count while a run goes, the report's
"operations done": every write, commit or append acknowledged (or abandoned), every snapshot
or cut read and every listen event read. What was verified is
:attr:`Report.operations_checked`, the report's "operations checked"; the two differ (see
there)."""


def write_size(key: int) -> int:
    """Rows of write ``key``: mostly tiny (inline in state), every fifth big (a Blob part)."""
    n = key % KEY_PER_WRITER
    return 600 if n % 5 == 4 else 1 + n % 3


def write_values(key: int) -> list[int]:
    """The unique row values of write ``key``."""
    return [key * ROWS_PER_KEY + k for k in range(write_size(key))]


def key_of(value: int) -> int:
    """The write a row value belongs to."""
    return value // ROWS_PER_KEY


def write_updates(key: int, retracts: int | None) -> pa.Table:
    """The updates of write ``key``: its rows inserted, and write ``retracts``'s rows retracted."""
    inserted = write_values(key)
    retracted = [] if retracts is None else write_values(retracts)
    return pa.table(
        {"v": inserted + retracted, DIFF: [1] * len(inserted) + [-1] * len(retracted)},
        schema=SCHEMA.append(pa.field(DIFF, pa.int64())),
    )


# --- fault-injecting stores that also remember indeterminate commits ---------------------------


class TrackingConsensus(UnreliableConsensus):
    """An UnreliableConsensus that counts, per thread, compare_and_sets with unknown outcome.

    Why: a write that was never acknowledged may appear only if one of its
    compare-and-sets had an indeterminate outcome. The error a writer finally
    sees does not say so (the machine retries an Indeterminate and may then
    time out on a StoreUnavailable), so the checker asks the store.
    """

    def __init__(self, inner: Consensus, faults: Faults, *, enabled: bool = True) -> None:
        super().__init__(inner, faults, enabled=enabled)
        self._local = threading.local()
        self.on_lost_reply: Callable[[], None] | None = None
        """Run after a compare-and-set whose reply is lost, before the caller hears of it:
        the maintenance client races another compaction into exactly that window."""

    def indeterminate_cas(self) -> int:
        """Compare-and-sets of the calling thread that raised Indeterminate so far."""
        return int(getattr(self._local, "n", 0))

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """The unreliable compare_and_set, counting Indeterminate outcomes of this thread."""
        try:
            return super().compare_and_set(key, expected, new)
        except Indeterminate:
            self._local.n = self.indeterminate_cas() + 1
            hook = self.on_lost_reply
            if hook is not None:
                hook()
            raise


class LossyBlob(UnreliableBlob):
    """Sabotage: a Blob that *claims* to store every third part but drops it (a lying store).

    Only used to prove the checker catches lost data; never a model of a real store.
    """

    def __init__(self, inner: Blob, faults: Faults, *, enabled: bool = True) -> None:
        super().__init__(inner, faults, enabled=enabled)
        self._n = 0
        self._lock = threading.Lock()
        self._dropped: dict[str, int] = {}

    def set(self, key: str, value: BlobValue) -> None:
        """Drop every third part write (silently), pass everything else on."""
        if "/part/" in key:
            with self._lock:
                self._n += 1
                drop = self._n % 3 == 0
                if drop:
                    self._dropped[key] = len(value)
            if drop:
                return
        super().set(key, value)

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """Lie consistently: a dropped part is reported stored (so commits check out)."""
        checked = list(keys)
        out = super().stat_many(checked)
        with self._lock:
            out.update({k: BlobMeta(k, self._dropped[k]) for k in checked if k in self._dropped})
        return out


# --- deliberate bugs the checker must catch ---------------------------------------------------


@contextlib.contextmanager
def old_compaction_cleanup() -> Iterator[None]:
    """Compaction's cleanup as it once was, patched in for the run's threads: a
    refused merge deletes its parts even after a lost reply (a writer's own cleanup keeps
    the real rule)."""
    from unittest import mock

    from pyspark_persist.state import maintenance

    def old_rule(machine: Any, parts: Sequence[Any], info: Any) -> list[Any]:
        return [p for p in parts if p.key is not None]

    with mock.patch.object(maintenance, "never_committed", old_rule):
        yield


@contextlib.contextmanager
def resend_deletes_landed() -> Iterator[None]:
    """A refused commit of a caller's StagedBatch gives its parts up as before issue 33: it
    deletes whatever its own call cannot have committed, which after a resend is every
    part, although the first send, whose reply was lost, landed them."""
    from unittest import mock

    def old_give_up(self: WriteHandle, parts: Sequence[Any], info: Any, staged_here: bool) -> None:
        machine = self._machine
        delete_staged(machine.blob, staged_writes.never_committed(machine, parts, info))

    with mock.patch.object(WriteHandle, "_give_up", old_give_up):
        yield


@contextlib.contextmanager
def stale_upsert() -> Iterator[None]:
    """An upsert that does not look again after an UpperMismatch: its retry plans against
    the rows it read before the race (it retracts a row another writer already replaced,
    and leaves that writer's row live)."""
    from unittest import mock

    from pyspark_persist.state import upsert

    real = upsert.catch_up

    def stale(known: Any, state: Any, read: Any) -> Any:
        if known is None:
            return real(known, state, read)
        return upsert.KnownRows(state.upper, known.found)

    with mock.patch.object(upsert, "catch_up", stale):
        yield


@contextlib.contextmanager
def abort_without_fence() -> Iterator[None]:
    """The sink's abort as before issue 33: delete what no state references *now*, without
    fencing off an attempt still in flight (which may land afterwards)."""
    from unittest import mock

    def old_abandon(machine: Any, parts: Sequence[Any]) -> list[Any]:
        doomed = staged_writes.unreferenced(machine, parts)
        delete_staged(machine.blob, doomed)
        return doomed

    with mock.patch.object(staged_writes, "abandon_staged", old_abandon):
        yield


@contextlib.contextmanager
def check_staged_once() -> Iterator[None]:
    """Staged parts checked on a commit's first attempt only, and a retry window past half
    the grace (which PersistConfig accepted before issue 33): a commit that retries
    through an outage lands after the sweep took its parts."""
    from unittest import mock

    checked: collections.OrderedDict[tuple[str | None, ...], None] = collections.OrderedDict()
    real = staged_writes.check_staged

    def first_attempt_only(machine: Any, parts: Sequence[Any]) -> None:
        # The same parts again: a retry of the same commit (each attempt may build its own
        # list of them, so the parts' keys tell, not the list).
        key = tuple(p.key for p in parts)
        if key in checked:
            return
        checked[key] = None
        while len(checked) > 1000:
            checked.popitem(last=False)
        real(machine, parts)

    base = short_grace_config

    def long_retries(c: PersistConfig) -> PersistConfig:
        config = base(c)
        object.__setattr__(config, "retry_timeout_s", 3 * SHORT_GRACE_S)
        return config

    with (
        mock.patch.object(staged_writes, "check_staged", first_attempt_only),
        mock.patch.object(sys.modules[__name__], "short_grace_config", long_retries),
    ):
        yield


@contextlib.contextmanager
def incarnation_ignored() -> Iterator[None]:
    """A machine that computes on whatever state Consensus holds under the name, as before
    issue 33: a handle or listen of a dropped shard goes on in the one created again."""
    from unittest import mock

    from pyspark_persist.state.machine import Machine

    def any_incarnation(self: Any, state: Any) -> Any:
        if self._incarnation is None:
            self._incarnation = state.incarnation
        return state

    with mock.patch.object(Machine, "_own", any_incarnation):
        yield


@contextlib.contextmanager
def pushes_trusted() -> Iterator[None]:
    """A listen that trusts PubSub while it looks healthy and never polls Consensus then:
    a commit whose push was lost stays hidden until the next push."""
    from unittest import mock

    from pyspark_persist.state.read import Listen

    real = Listen._next_poll_delay

    def never_while_pushed(self: Any) -> float:
        return 3600.0 if self._machine.shared.push_healthy else float(real(self))

    with mock.patch.object(Listen, "_next_poll_delay", never_while_pushed):
        yield


@contextlib.contextmanager
def upsert_without_retraction() -> Iterator[None]:
    """An upsert that inserts a key's new row but forgets to retract its current one."""
    from unittest import mock

    from pyspark_persist.state import keyed, upsert

    real = keyed.plan_upsert

    def no_retraction(*args: Any, **kwargs: Any) -> Any:
        updates, took = real(*args, **kwargs)
        return updates.filter(pa.compute.greater(updates.column(DIFF), 0)), took

    with mock.patch.object(upsert, "plan_upsert", no_retraction):
        yield


@contextlib.contextmanager
def consumer_holds_ignored() -> Iterator[None]:
    """Since computed from the readers' holds alone, as before named consumers: retention and
    compaction pass what a consumer has not consumed."""
    from unittest import mock

    from pyspark_persist.state import commands, retention

    with (
        mock.patch.object(commands, "consumer_holds", lambda consumers: []),
        mock.patch.object(retention, "consumer_holds", lambda consumers: []),
    ):
        yield


@contextlib.contextmanager
def consumer_fence_ignored() -> Iterator[None]:
    """An advance that does not compare its epoch: a fenced holder moves the consumer on."""
    from unittest import mock

    from pyspark_persist.state import consumers

    real = consumers.advance_consumer

    def unfenced(state: Any, *, name: str, epoch: int, **kwargs: Any) -> Any:
        current = state.consumers.get(name)
        return real(state, name=name, epoch=current.epoch if current else epoch, **kwargs)

    with mock.patch.object(consumers, "advance_consumer", unfenced):
        yield


def _one_by_one(self: UnreliableConsensus, ops: Sequence[CaSOp]) -> CaSManyResult:
    """compare_and_set_many as single-key compare-and-sets, one participant after another:
    a lost race or a fault after the first leaves the transaction in some shards only."""
    for key, expected, new in ops:
        res = self.compare_and_set(key, expected, new)
        if isinstance(res, CaSMismatch):
            return CaSManyMismatch({key: res.current})
    return CaSCommitted()


@contextlib.contextmanager
def txn_one_by_one() -> Iterator[None]:
    """A transaction commits its participants one by one with single-key compare-and-sets, as
    before ``Consensus.compare_and_set_many`` (the ``txns`` piece must see half of one)."""
    from unittest import mock

    with mock.patch.object(UnreliableConsensus, "compare_and_set_many", _one_by_one):
        yield


def _lost_replies_reach_caller(config: PersistConfig) -> PersistConfig:
    """The writers' config under ``fresh_tokens``: every lost reply reaches the (buggy) caller."""
    return dataclasses.replace(config, retry_timeout_s=1e-9)


@dataclass(frozen=True)
class Sabotage:
    """A deliberate bug the checker must detect (``--sabotage NAME``), and how it shows.

    The hooks apply to the writers' clients (``blob``, ``writer_config``,
    ``fresh_tokens``) or to the whole run (``patch``, a context manager around
    it); a new fault kind's bug usually needs ``patch`` alone.
    """

    doc: str
    caught_by: tuple[str, ...]
    """Violation texts (case-insensitive substrings), one of which a run must report."""
    blob: type[UnreliableBlob] = UnreliableBlob
    """The Blob wrapper of the writers' clients."""
    writer_config: Callable[[PersistConfig], PersistConfig] | None = None
    """Changes to the writers' config."""
    fresh_tokens: bool = False
    """Writers take a new token for every retry (the bug idempotency tokens prevent)."""
    patch: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
    """Patched in for the whole run (threads share the process, so all of them see it)."""
    seconds: float = 8.0
    """A run this long (on mem, 3 writers) catches it: the CI test's budget per seed. Its
    runs end at the first violation (most bugs here show within 3 s on a quiet machine), so
    the budget is the room a loaded machine needs, paid only by a seed that misses."""
    attempts: int = 3
    """Seeds the CI test tries before it calls the bug missed. Every bug here meets its fault
    by thread timing, and CI's load (two lanes of tests, Spark's JVMs) can starve one short
    run of the moment (``resend_deletes_landed`` missed seed 303 once in a CI run, caught by
    all of 303-306 on a quiet machine); the test stops at the first seed that catches it, so
    spare seeds cost nothing while the checker works."""
    faults: tuple[str, ...] | None = None
    """The fault kinds (:data:`FAULTS`) a run needs to show it (None: all). The CI test runs
    only these: with every piece sharing two cores, the one that meets the bug gets too few
    turns in a short run to meet it reliably."""


SABOTAGE: dict[str, Sabotage] = {
    "fresh_tokens": Sabotage(
        "a writer that takes a new token per retry: duplicates after a lost reply",
        # A write applied twice inserts its rows and retracts its predecessor's twice.
        caught_by=("diff 2", "diff -1", "emitted twice", "retracted twice"),
        writer_config=_lost_replies_reach_caller,
        fresh_tokens=True,
    ),
    "lossy_blob": Sabotage(
        "a Blob that loses acknowledged parts",
        caught_by=("missing from blob",),
        blob=LossyBlob,
    ),
    # The old cleanup loses data only when a lost reply of the maintenance client's merge
    # meets the racing merge: by thread timing, about five in six 15 s runs of the maintenance
    # piece alone show it (seeds 303-308: all but 303), so it gets six seeds and must be
    # caught by one. With every piece running, the others' threads starve the two merges:
    # since the txns piece runs cut readers and maintenance of its own, six in six missed.
    "delete_after_unknown": Sabotage(
        "compaction's cleanup as it once was: a refused merge deletes its parts "
        "even after a lost reply, when the merge may have landed and been merged again",
        caught_by=("missing from blob",),
        patch=old_compaction_cleanup,
        seconds=15.0,
        attempts=6,
        faults=("maintenance",),
    ),
    "resend_deletes_landed": Sabotage(
        "a refused resend of a StagedBatch deletes its staged parts, which the landed first "
        "attempt references",
        caught_by=("resend: leased snapshot failed", "resend: final", "missing from blob"),
        patch=resend_deletes_landed,
        faults=("resend",),
    ),
    "abort_without_fence": Sabotage(
        "the sink's abort deletes staged parts no state references yet, while a commit "
        "attempt is still in flight and lands afterwards",
        caught_by=("abort: leased snapshot failed", "abort: final", "missing from blob"),
        patch=abort_without_fence,
        faults=("abort",),
    ),
    "check_staged_once": Sabotage(
        "a commit checks its staged parts on the first attempt only and retries past half "
        "the grace, so it lands after the orphan sweep took them",
        caught_by=("grace: leased snapshot failed", "grace: final", "missing from blob"),
        patch=check_staged_once,
        faults=("short-grace",),
        # Shown only by the final verification, so its runs take their whole budget; its
        # piece commits a few times a second, and 6 s lets one commit outlast an outage.
        seconds=6.0,
    ),
    "incarnation_ignored": Sabotage(
        "handles and listens of a dropped shard carry on in the shard created again under its name",
        caught_by=("drop:",),
        patch=incarnation_ignored,
        faults=("drop",),
    ),
    "pushes_trusted": Sabotage(
        "a listen trusts PubSub while it looks healthy and never polls: a lost push hides a "
        "commit until the next push",
        caught_by=("pushed listen:",),
        patch=pushes_trusted,
        faults=("pushes",),
        # Shown only by the final verification (the hidden commit), so a run takes its budget.
        seconds=6.0,
    ),
    "stale_upsert": Sabotage(
        "an upsert that retries after an UpperMismatch without looking up its keys' rows "
        "again: it plans against the state before the race",
        caught_by=("serial application", "two live rows", "multiplicity", "holds key"),
        patch=stale_upsert,
        faults=("keyed",),
    ),
    "upsert_without_retraction": Sabotage(
        "an upsert that inserts a key's new row without retracting its current one",
        caught_by=("two live rows", "holds key", "serial application"),
        patch=upsert_without_retraction,
        faults=("keyed",),
    ),
    "consumer_holds_ignored": Sabotage(
        "since computed without the named consumers' holds: retention passes what a consumer "
        "has not consumed",
        caught_by=("consumers: the shard's since",),
        patch=consumer_holds_ignored,
        faults=("consumers",),
    ),
    # Caught by each of seeds 303-310 in 4 s on a quiet machine, but missed by 303 once in a
    # loaded CI run (the fenced holder's advance never met the newer holder's): four seeds.
    "consumer_fence_ignored": Sabotage(
        "an advance that ignores its epoch: a fenced holder moves the consumer",
        caught_by=("a fenced holder advanced", "moved back", "is not what the consumer holds"),
        patch=consumer_fence_ignored,
        faults=("consumers",),
        attempts=4,
    ),
    "txn_one_by_one": Sabotage(
        "a transaction commits its participants one by one with single-key compare-and-sets "
        "instead of compare_and_set_many: a lost race or fault after the first leaves it in "
        "some shards only",
        caught_by=("half a transaction", "refused on resend"),
        patch=txn_one_by_one,
        faults=("txns",),
    ),
}
"""Deliberate bugs the checker must detect, by ``--sabotage`` name."""


# --- where, and through which faults ----------------------------------------------------------


@dataclass(frozen=True)
class Location:
    """Where the shard lives: URIs, plus a directory to remove afterwards."""

    blob_uri: str
    consensus_uri: str
    cleanup: str | None = None


def make_location(backend: str, root: str | None = None) -> Location:
    """A fresh location of ``backend`` (``mem``, ``file-sqlite``, ``file-postgres``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}")
    tag = uuid.uuid4().hex
    if backend == "mem":
        return Location(f"mem://check-{tag}", f"mem://check-{tag}")
    directory = tempfile.mkdtemp(prefix="persist-check-", dir=root)
    blob = f"file://{directory}/blob"
    if backend == "file-sqlite":
        return Location(blob, f"sqlite:///{directory}/consensus.db", directory)
    return Location(blob, os.environ.get("PERSIST_CHECK_POSTGRES", POSTGRES_URL), directory)


def reliable_client(loc: Location) -> PersistClient:
    """A client without faults, on its own cache (setup and the final verification)."""
    return PersistClient(
        open_blob(loc.blob_uri), open_consensus(loc.consensus_uri), cache=StateCache()
    )


StoreFaults = tuple[Faults, Faults]
"""(Blob faults, Consensus faults) of one client."""


def default_faults(seed: int, *, reader: bool = False) -> StoreFaults:
    """(blob, consensus) faults of one client: frequent enough to hit every retry path.

    A reader's snapshot fetches every part, so its Blob faults are rarer: at the writers'
    rate a snapshot of 30 parts would almost never succeed and little would be checked.
    """
    b = 0.004 if reader else 0.03
    return (
        Faults(seed=seed, fail_before=b, fail_after=b, timeout=b / 3, slow=0.02, slow_s=0.002),
        Faults(
            seed=seed + 1, fail_before=0.05, fail_after=0.05, timeout=0.02, slow=0.05, slow_s=0.002
        ),
    )


GRACE_S = 4.0
"""The orphan sweep's grace: short, so the sweep really races slow writers and compactions
(commits refuse parts past half of it: StagedPartsExpired, then the writer stages again)."""


def worker_config(rng: random.Random) -> PersistConfig:
    """Knobs that make compaction, GC, rollups, sweeps and retries happen constantly."""
    return PersistConfig(
        part_target_bytes=16 * 1024,
        compaction_fan_in=rng.randint(2, 4),
        gc_interval=2,
        rollup_interval=8,
        # Half the clients hand every store error straight to the caller, so caller-level
        # retries with the same token are exercised, not only the machine's own.
        retry_timeout_s=rng.choice((1e-9, 0.3)),
        heartbeat_interval_s=0.2,
        reader_lease_s=120.0,
        staged_part_grace_s=GRACE_S,
        listen_poll_max_s=0.02,
    )


class FaultyClient:
    """A client on its own cache over fault-injecting wrappers of a location's stores.

    ``faults`` replaces :func:`default_faults` (of ``seed`` and ``reader``).
    """

    def __init__(
        self,
        loc: Location,
        seed: int,
        config: PersistConfig,
        sabotage: Sabotage | None = None,
        *,
        reader: bool = False,
        faults: StoreFaults | None = None,
        consensus: type[TrackingConsensus] | None = None,
        publisher: DiffPublisher | None = None,
    ) -> None:
        blob_faults, cons_faults = faults or default_faults(seed, reader=reader)
        blob_cls = UnreliableBlob if sabotage is None else sabotage.blob
        if sabotage is not None and sabotage.writer_config is not None:
            config = sabotage.writer_config(config)
        self.blob = blob_cls(open_blob(loc.blob_uri), blob_faults, enabled=False)
        self.consensus = (consensus or TrackingConsensus)(
            open_consensus(loc.consensus_uri), cons_faults, enabled=False
        )
        self.client = PersistClient(
            self.blob, self.consensus, config=config, cache=StateCache(), publisher=publisher
        )

    def enable(self, on: bool = True) -> None:
        """Switch faults on or off (off for setup and the final verification)."""
        self.blob.enabled = on
        self.consensus.enabled = on

    def faults(self) -> collections.Counter[str]:
        """Faults injected so far, by kind."""
        out: collections.Counter[str] = collections.Counter()
        for kind in FAULT_KINDS:
            out[kind] += self.blob.injected[kind] + self.consensus.injected[kind]
        return out

    def close(self) -> None:
        """Close the client (and with it the stores)."""
        with contextlib.suppress(Exception):
            self.client.close()


# --- what the pieces record -------------------------------------------------------------------


@dataclass
class WriteRecord:
    """What one writer learned about one write (JSON-able, to cross a process Queue)."""

    key: int
    retracts: int | None = None
    """The earlier write of the same writer whose rows this write retracts (None: none)."""
    acked: bool = False
    landed_at: int | None = None
    """The time it landed at when a Committed said so (None: acked by AlreadyCommitted)."""
    candidates: list[int] = field(default_factory=list)
    """Every expected upper it was attempted at: the only times it may have landed at."""
    errors: int = 0
    indeterminate: bool = False
    """Some compare-and-set of it had an unknown outcome: it may have landed unacknowledged."""


@dataclass
class Report:
    """The outcome of one checker run; see :meth:`render`."""

    seed: int
    backend: str
    duration_s: float = 0.0
    ops: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    violations: list[str] = field(default_factory=list)
    violation_count: int = 0
    final_upper: int = 0
    sabotage: str | None = None

    @property
    def ok(self) -> bool:
        """No violation found."""
        return self.violation_count == 0

    @property
    def operations_checked(self) -> int:
        """Writes verified plus snapshots compared plus listen events checked (the main
        shard's and the fault pieces'; keyed and txns: commits too; txns: cuts, and plain
        appends, each found in the final cut or retracted by an acknowledged append).

        Not the operations done (:meth:`live_ops`), which counts each operation once as it
        completes: the resend, abort and short-grace pieces' writes are done but checked
        only through their snapshots; a main-shard write the listen has not passed is done
        but not checked (``writes_unchecked``); a transaction acknowledged as already
        committed is checked but not done (``txns_already_committed``).
        """
        return (
            self.ops["writes_checked"]
            + self.ops["snapshots_checked"]
            + self.ops["listen_events"]
            + self.ops["replace_writes_checked"]
            + self.ops["replace_snapshots_checked"]
            + self.ops["drop_writes_checked"]
            + self.ops["drop_listen_events"]
            + self.ops["resend_snapshots_checked"]
            + self.ops["abort_snapshots_checked"]
            + self.ops["grace_snapshots_checked"]
            + self.ops["pushed_writes_checked"]
            + self.ops["keyed_writes_checked"]
            + self.ops["keyed_commits_checked"]
            + self.ops["keyed_snapshots_checked"]
            + self.ops["txns_commits_checked"]
            + self.ops["txns_cuts_checked"]
            + self.ops["txns_listen_events"]
            + self.ops["txns_plain_appends_checked"]
        )

    def live_ops(self) -> int:
        """Operations done so far (see :data:`LIVE_OPS`)."""
        return sum(self.ops[k] for k in LIVE_OPS)

    def render(self) -> str:
        """The human-readable report: seed, ops by kind, faults by kind, violations."""
        rate = self.operations_checked / self.duration_s if self.duration_s else 0.0
        lines = [
            f"persist checker: seed={self.seed} backend={self.backend} "
            f"duration={self.duration_s:.1f}s final_upper={self.final_upper}"
            + (f" sabotage={self.sabotage}" if self.sabotage else ""),
            f"operations done: {self.live_ops()} (acknowledged or abandoned writes, commits "
            "and appends; snapshots and cuts read; listen events read: what --ops counts)",
            f"operations checked: {self.operations_checked} ({rate:.1f}/s; writes, commits and "
            "appends verified after the run, snapshots and cuts each compared, listen events "
            "each checked)",
            "operations:",
            *(f"  {k:<28} {v}" for k, v in sorted(self.ops.items())),
            f"faults injected: {sum(self.faults.values())}",
            *(f"  {k:<28} {v}" for k, v in sorted(self.faults.items())),
            f"violations: {self.violation_count}",
            *(f"  - {v}" for v in self.violations),
        ]
        if self.violation_count > len(self.violations):
            lines.append(f"  ... and {self.violation_count - len(self.violations)} more")
        lines.append(
            f"replay with: python -m pyspark_persist.tools.checker --seed {self.seed} "
            f"--backend {self.backend}"
        )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able values."""
        return {
            "seed": self.seed,
            "backend": self.backend,
            "duration_s": round(self.duration_s, 3),
            "operations_done": self.live_ops(),
            "operations_checked": self.operations_checked,
            "ops": dict(self.ops),
            "faults": dict(self.faults),
            "faults_injected": sum(self.faults.values()),
            "violation_count": self.violation_count,
            "violations": self.violations,
            "final_upper": self.final_upper,
        }


class Recorder:
    """Thread-safe collection of ops, faults and violations during a run."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self._lock = threading.Lock()

    def op(self, kind: str, n: int = 1) -> None:
        """Count ``n`` operations of ``kind``."""
        with self._lock:
            self.report.ops[kind] += n

    def ops(self, counts: dict[str, int]) -> None:
        """Count operations by kind (a writer process's)."""
        with self._lock:
            self.report.ops.update(counts)

    def faults(self, counts: dict[str, int]) -> None:
        """Count injected faults by kind (a writer process's clients')."""
        with self._lock:
            self.report.faults.update(counts)

    def violation(self, text: str) -> None:
        """Record a violation (the first MAX_DETAILS in full)."""
        with self._lock:
            self.report.violation_count += 1
            if len(self.report.violations) < MAX_DETAILS:
                self.report.violations.append(text)


# --- a writer, shared by threads and processes ------------------------------------------------

Outcome = Callable[[WriteRecord], bool | None]
"""Whether an unacknowledged write landed (None: not known yet); see :meth:`History.landed`."""


class Writer:
    """Appends numbered writes to a shard until stopped; returns what it learned of each.

    Retries with the same token (the token is the write number) until the
    write is acknowledged, except that after an error it is abandoned with
    probability ``abandon_p``. Each write retracts the rows of the writer's
    oldest live write once ``LIVE_WRITES`` are live. A write it abandoned
    after an unknown outcome may or may not have landed: until ``outcome``
    (the reference history) says which, neither it nor the write it meant to
    retract is retracted by another (a writer without ``outcome``, in a
    process, never does). With ``fresh_tokens`` (sabotage) every retry
    takes a new token, the bug idempotency tokens exist to prevent. With
    ``slow_stage_s`` each attempt stages its parts first and commits them up
    to that many seconds later: a slow writer the orphan sweep races.
    """

    def __init__(
        self,
        fc: FaultyClient,
        shard_name: str,
        index: int,
        seed: int,
        rec: Recorder,
        *,
        outcome: Outcome | None = None,
        fresh_tokens: bool = False,
        abandon_p: float = 0.15,
        slow_stage_s: float = 0.0,
    ) -> None:
        self.fc = fc
        self.name = f"writer-{index}"
        self.index = index
        self.rng = random.Random(seed)
        self.rec = rec
        self.outcome = outcome
        self.fresh_tokens = fresh_tokens
        self.abandon_p = abandon_p
        self.slow_stage_s = slow_stage_s
        self.handle = fc.client.open_shard(shard_name).writer(self.name)
        self.records: list[WriteRecord] = []
        self.live: collections.deque[int] = collections.deque()
        """Its acknowledged writes still in the shard, oldest first: what it may retract."""
        self.unsettled: list[WriteRecord] = []
        """Writes abandoned after an unknown outcome, until ``outcome`` tells."""
        self.upper = 0
        self.token = 0
        self.last_committed = -1
        self.last_seen = 0

    def run(self, stopped: Callable[[], bool]) -> list[WriteRecord]:
        """Write until ``stopped``; every write's record, acknowledged or not."""
        self.fc.enable()
        self.upper = self.last_seen = _retry(self.handle.fetch_upper, hard_s=FINISH_TIMEOUT_S)
        number = 0
        while not stopped():
            number += 1
            self.token += 1
            self._settle()
            retracts = self.live.popleft() if len(self.live) >= LIVE_WRITES else None
            record = WriteRecord(self.index * KEY_PER_WRITER + number, retracts)
            self.records.append(record)
            before = self.fc.consensus.indeterminate_cas()
            self._write(record, stopped)
            record.indeterminate = self.fc.consensus.indeterminate_cas() > before
            self._after(record)
            if self.rng.random() < 0.1:
                time.sleep(self.rng.uniform(0, 0.01))
        return self.records

    def _settle(self) -> None:
        """Learn the fate of abandoned writes of unknown outcome the history has passed."""
        if self.outcome is None:
            return
        still = []
        for record in self.unsettled:
            landed = self.outcome(record)
            if landed is None:
                still.append(record)
                continue
            self.rec.op("unknown_writes_settled")
            if landed:
                self.live.append(record.key)
            elif record.retracts is not None:
                self.live.appendleft(record.retracts)
        self.unsettled = still

    def _after(self, record: WriteRecord) -> None:
        """What the write's outcome means for what this writer may retract next."""
        if record.acked:
            self.rec.op("writes_acked")
            self.live.append(record.key)
        elif record.indeterminate:
            self.unsettled.append(record)
        elif record.retracts is not None:  # it surely did not land: its retraction neither
            self.live.appendleft(record.retracts)

    def _write(self, record: WriteRecord, stopped: Callable[[], bool]) -> None:
        """Attempt ``record``'s write until acknowledged, abandoned, or the run ends."""
        op, violation, rng = self.rec.op, self.rec.violation, self.rng
        data = write_updates(record.key, record.retracts)
        finish_by: float | None = None
        while True:
            if stopped():
                finish_by = finish_by or time.monotonic() + FINISH_TIMEOUT_S / 2
                if time.monotonic() > finish_by:
                    op("writes_unfinished_at_stop")
                    return
            upper = self.upper
            new_upper = upper + rng.randint(1, 3)
            record.candidates.append(upper)
            op("write_attempts")
            try:
                res = self._attempt(data, upper, new_upper, stopped)
            except (Determinate, Indeterminate) as e:
                record.errors += 1
                op("write_errors_" + type(e).__name__)
                with contextlib.suppress(PersistError):
                    self.upper = self.handle.fetch_upper()
                if self.fresh_tokens:
                    self.token += 1
                if rng.random() < self.abandon_p:
                    op("writes_abandoned")
                    return
                continue
            seen = res.current if isinstance(res, UpperMismatch) else res.upper
            if seen < self.last_seen:
                violation(f"{self.name}: upper went back from {self.last_seen} to {seen} ({res})")
            self.last_seen = max(self.last_seen, seen)
            if isinstance(res, UpperMismatch):
                op("upper_mismatches")
                if res.current == upper:
                    violation(f"{self.name}: UpperMismatch reports the expected upper {upper}")
                self.upper = res.current
                continue
            if isinstance(res, Committed):
                op("commits")
                if res.upper != new_upper:
                    violation(f"{self.name}: Committed upper {res.upper}, asked {new_upper}")
                if res.upper <= self.last_committed:
                    violation(
                        f"{self.name}: commit upper {res.upper} did not advance past "
                        f"{self.last_committed}"
                    )
                self.last_committed = res.upper
                record.landed_at = upper
            else:
                assert isinstance(res, AlreadyCommitted)
                op("already_committed")
                if res.token < self.token:
                    violation(
                        f"{self.name}: AlreadyCommitted token {res.token} < asked {self.token}"
                    )
            record.acked = True
            self.upper = res.upper
            return

    def _attempt(
        self, data: pa.Table, upper: int, new_upper: int, stopped: Callable[[], bool]
    ) -> Committed | UpperMismatch | AlreadyCommitted:
        """One compare-and-append of ``data`` at ``upper``; if slow, staged first and committed
        later (at once when the run has stopped: its last write need not wait)."""
        if not self.slow_stage_s:
            return self.handle.compare_and_append(data, upper, new_upper, token=self.token)
        builder = self.handle.builder()
        builder.add(data)
        staged = builder.finish()
        pause_until = time.monotonic() + self.rng.uniform(0, self.slow_stage_s)
        while not stopped() and time.monotonic() < pause_until:
            time.sleep(min(0.05, max(0.0, pause_until - time.monotonic())))
        return self.handle.compare_and_append_batches(
            [staged], upper, new_upper, token=self.token, ts_rewrite=upper
        )


def _retry(fn: Callable[[], Any], hard_s: float) -> Any:
    """Call ``fn`` until it does not raise a store error (setup under faults)."""
    deadline = time.monotonic() + hard_s
    while True:
        try:
            return fn()
        except (Determinate, Indeterminate):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _process_writer(
    loc: Location,
    shard_name: str,
    index: int,
    seed: int,
    cap_s: float,
    sabotage: str | None,
    stop: Any,
    out: Any,
) -> None:
    """A spawned writer process: write until ``stop`` is set (or ``cap_s``), then report
    its records, ops, faults and violations on ``out``."""
    sab = None if sabotage is None else SABOTAGE[sabotage]
    fc = FaultyClient(loc, seed, worker_config(random.Random(seed)), sab)
    report = Report(seed=seed, backend="")
    deadline = time.monotonic() + cap_s
    try:
        writer = Writer(
            fc,
            shard_name,
            index,
            seed,
            Recorder(report),
            fresh_tokens=sab is not None and sab.fresh_tokens,
        )
        records = writer.run(lambda: stop.is_set() or time.monotonic() > deadline)
        fc.enable(False)
        out.put(
            {
                "records": [vars(r) for r in records],
                "ops": dict(report.ops),
                "faults": dict(fc.faults()),
                "violations": report.violations,
            }
        )
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        fc.close()


# --- the reference history, from the listen ---------------------------------------------------


class History:
    """The reference: what the listen saw, and the collection it implies at recent times.

    The listen is the one witness of every write, including those retracted and
    compacted away since. What a check costs is bounded by the shard's contents,
    not its history: it keeps one insert time and one retraction time per write
    (for the final verification), the writes live at the frontier, and the
    events after the *floor*, the lowest time a snapshot may still be compared
    at (each snapshot reader holds its since with :meth:`hold`; a pending
    snapshot holds its own time). The collection at ``as_of`` is the live
    writes with the events after ``as_of`` undone: O(live writes + events
    after as_of) per check.
    """

    def __init__(self, rec: Recorder) -> None:
        self._rec = rec
        self._lock = threading.Lock()
        self.time_of: dict[int, int] = {}
        """Each write the listen saw: the time it landed at."""
        self.retracted_at: dict[int, int] = {}
        """Each retracted write: the time of its retraction."""
        self.live: set[int] = set()
        """The writes in the collection at ``frontier - 1``."""
        self.frontier = 1
        self._events: collections.deque[tuple[int, int, int]] = collections.deque()
        """(time, write, +1 inserted | -1 retracted) after the floor, in time order."""
        self._floors: dict[str, int] = {}
        self._pending: list[tuple[int, frozenset[int], str]] = []

    def hold(self, who: str, since: int) -> None:
        """``who`` compares no snapshot before ``since`` any more (register before reading)."""
        with self._lock:
            self._floors[who] = since

    def release(self, who: str) -> None:
        """``who`` compares no more snapshots."""
        with self._lock:
            self._floors.pop(who, None)

    def landed(self, record: WriteRecord) -> bool | None:
        """Whether ``record``'s write landed, once the listen has passed every time it was
        attempted at (None before)."""
        with self._lock:
            if record.candidates and max(record.candidates) >= self.frontier:
                return None
            return record.key in self.time_of

    def add_event(self, lower: int, upper: int, table: pa.Table) -> None:
        """Check one listen event's updates and add them to the history."""
        if lower != self.frontier or upper <= lower:
            self._rec.violation(
                f"listen: event [{lower}, {upper}) does not follow frontier {self.frontier}"
            )
        changes = event_changes(lower, upper, table, self._rec)
        with self._lock:
            for t, sign, key in changes:
                self._apply(t, sign, key)
            self.frontier = max(self.frontier, upper)
            self._trim()  # before the due snapshots leave the pending list: they hold the floor
            due = [p for p in self._pending if p[0] < self.frontier]
            self._pending = [p for p in self._pending if p[0] >= self.frontier]
        for as_of, keys, who in due:
            self._compare(as_of, keys, who)

    def skip(self, upper: int) -> None:
        """Move the frontier past an event that could not be read (a violation already)."""
        with self._lock:
            self.frontier = max(self.frontier, upper)

    def _apply(self, t: int, sign: int, key: int) -> None:
        """Add one write's insertion (``sign`` 1) or retraction (-1) at ``t`` (lock held)."""
        rec = self._rec
        if sign > 0:
            if key in self.time_of:
                rec.violation(
                    f"listen: write {key} emitted twice (times {self.time_of[key]} and {t})"
                )
                return
            self.time_of[key] = t
            self.live.add(key)
        else:
            if key in self.retracted_at:
                rec.violation(
                    f"listen: write {key} retracted twice (times {self.retracted_at[key]} and {t})"
                )
                return
            if key not in self.live:
                rec.violation(f"listen: write {key} retracted at time {t} but not in the shard")
                return
            self.retracted_at[key] = t
            self.live.discard(key)
            self._rec.op("retractions")
        self._events.append((t, key, sign))

    def _trim(self) -> None:
        """Forget the events no snapshot can still need: those at or below the floor."""
        floor = min([*self._floors.values(), *(p[0] for p in self._pending), self.frontier - 1])
        while self._events and self._events[0][0] <= floor:
            self._events.popleft()

    def expected_at(self, as_of: int) -> frozenset[int]:
        """The writes the collection holds at ``as_of`` (below the frontier, above the floor)."""
        with self._lock:
            keys = set(self.live)
            for t, key, sign in reversed(self._events):
                if t <= as_of:
                    break
                if sign > 0:
                    keys.discard(key)
                else:
                    keys.add(key)
            return frozenset(keys)

    def add_snapshot(self, as_of: int, keys: frozenset[int], who: str) -> None:
        """Compare a snapshot now if the history covers ``as_of``, else when it does."""
        with self._lock:
            if as_of >= self.frontier:
                self._pending.append((as_of, keys, who))
                return
            if as_of < self._floors.get(who, 0):
                self._rec.violation(
                    f"checker: {who} compares a snapshot at {as_of}, below its hold "
                    f"{self._floors[who]} (the history may have forgotten what it needs)"
                )
                return
        self._compare(as_of, keys, who)

    def flush(self) -> int:
        """Compare pending snapshots the history now covers; return how many stay unchecked."""
        with self._lock:
            due = [p for p in self._pending if p[0] < self.frontier]
            self._pending = [p for p in self._pending if p[0] >= self.frontier]
            left = len(self._pending)
        for as_of, keys, who in due:
            self._compare(as_of, keys, who)
        return left

    def _compare(self, as_of: int, keys: frozenset[int], who: str) -> None:
        expected = self.expected_at(as_of)
        self._rec.op("snapshots_checked")
        if keys != expected:
            missing = sorted(expected - keys)
            extra = sorted(keys - expected)
            self._rec.violation(
                f"{who}: snapshot as_of {as_of} differs from the reference: missing writes "
                f"{missing[:10]}{'...' if len(missing) > 10 else ''} ({len(missing)}), extra "
                f"{extra[:10]}{'...' if len(extra) > 10 else ''} ({len(extra)})"
            )


def event_changes(
    lower: int, upper: int, table: pa.Table, rec: Recorder
) -> list[tuple[int, int, int]]:
    """The writes a listen event inserts and retracts: (time, +1 or -1, write), in time order.

    Each must be whole (every row of the write), at one time inside the event;
    every row's diffs at a time sum to 1, -1 or 0 (0: nothing to record).
    """
    sums: collections.Counter[tuple[int, int]] = collections.Counter()
    for v, t, d in zip(
        table.column("v").to_pylist(),
        table.column(TIME).to_pylist(),
        table.column(DIFF).to_pylist(),
        strict=True,
    ):
        sums[(v, t)] += d
    rows: collections.Counter[tuple[int, int, int]] = collections.Counter()
    for (v, t), d in sums.items():
        if d not in (0, 1, -1):
            rec.violation(
                f"listen: row {v} (write {key_of(v)}) has diff {d} at time {t} in event "
                f"[{lower}, {upper})"
            )
        if d != 0:
            rows[(key_of(v), t, 1 if d > 0 else -1)] += 1
    times: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    for (key, t, sign), n in rows.items():
        what = "write" if sign > 0 else "retraction of write"
        if n != write_size(key):
            rec.violation(
                f"listen: {what} {key} appears partially ({n} of {write_size(key)} rows) "
                f"at time {t}"
            )
        if not lower <= t < upper:
            rec.violation(f"listen: {what} {key} at time {t} outside event [{lower}, {upper})")
        times[(key, sign)].append(t)
    changes = []
    for (key, sign), ts in times.items():
        if len(ts) != 1:
            what = "write" if sign > 0 else "retraction of write"
            rec.violation(f"listen: {what} {key} appears at several times {sorted(ts)}")
        changes.append((min(ts), sign, key))
    return sorted(changes)


def snapshot_keys(table: pa.Table, who: str, as_of: int, rec: Recorder) -> frozenset[int]:
    """The writes a consolidated snapshot holds; each row must be there once, whole."""
    per_key: collections.Counter[int] = collections.Counter()
    for v, d in zip(table.column("v").to_pylist(), table.column(DIFF).to_pylist(), strict=True):
        if d != 1:
            rec.violation(
                f"{who}: snapshot as_of {as_of} holds row {v} (write {key_of(v)}) with diff {d}"
            )
        per_key[key_of(v)] += 1
    for key, n in per_key.items():
        if n != write_size(key):
            rec.violation(
                f"{who}: snapshot as_of {as_of} holds write {key} partially "
                f"({n} of {write_size(key)} rows)"
            )
    return frozenset(per_key)


# --- what the pieces of a run share -----------------------------------------------------------


@dataclass
class Context:
    """What every piece of a run shares: where it runs, its seed, the reference history, the
    recorder, the sabotage in force, and when to stop. Pieces get their clients and seeds
    here, so a new piece needs nothing else."""

    loc: Location
    shard_name: str
    """The main shard: writers, snapshot readers, the listener and maintenance use it."""
    seed: int
    rec: Recorder
    history: History
    duration_s: float = 0.0
    sabotage_name: str | None = None
    stop: threading.Event = field(default_factory=threading.Event)
    clients: list[FaultyClient] = field(default_factory=list)
    records: list[WriteRecord] = field(default_factory=list)
    """Every writer's records of the main shard (verified after the workload)."""
    shards: list[str] = field(default_factory=list)
    """Every shard of the run, the main one first: a piece's setup adds the ones it
    creates, and the maintenance piece collects the garbage of all of them."""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def sabotage(self) -> Sabotage | None:
        """The deliberate bug in force, if any."""
        return None if self.sabotage_name is None else SABOTAGE[self.sabotage_name]

    def seed_for(self, name: str) -> int:
        """The seed of whatever is called ``name`` in this run: a function of the run's seed
        and the name alone, so adding a piece changes no other piece's choices."""
        return random.Random(f"{self.seed}/{name}").randrange(1 << 31)

    def client(
        self,
        name: str,
        *,
        reader: bool = False,
        sabotaged: bool = False,
        config: Callable[[PersistConfig], PersistConfig] | None = None,
        faults: Callable[[StoreFaults], StoreFaults] | None = None,
        consensus: type[TrackingConsensus] | None = None,
        publisher: DiffPublisher | None = None,
        loc: Location | None = None,
    ) -> FaultyClient:
        """A new client with faults (off until it calls ``enable``) seeded by ``name``; its
        faults are counted in the report and it is closed after the run. ``sabotaged``: it
        gets the sabotage's writer hooks. ``config`` changes its :func:`worker_config`,
        ``faults`` its :func:`default_faults`; ``consensus`` is its Consensus wrapper,
        ``publisher`` its PubSub transport, ``loc`` a location of the piece's own."""
        seed = self.seed_for(name)
        cfg = worker_config(random.Random(seed))
        if config is not None:
            cfg = config(cfg)
        store_faults = default_faults(seed, reader=reader)
        if faults is not None:
            store_faults = faults(store_faults)
        fc = FaultyClient(
            loc or self.loc,
            seed,
            cfg,
            self.sabotage if sabotaged else None,
            reader=reader,
            faults=store_faults,
            consensus=consensus,
            publisher=publisher,
        )
        with self._lock:
            self.clients.append(fc)
        return fc

    def add_records(self, records: Iterable[WriteRecord]) -> None:
        """Hand a writer's records to the final verification."""
        with self._lock:
            self.records.extend(records)


class Piece:
    """One named part of a run: loops that each run in a thread until ``ctx.stop``, a setup
    before any loop starts (no faults yet) and its own checks after the workload.

    A loop that raises is a violation naming it. Subclasses override what they need: most
    only :meth:`run` (the one loop) and perhaps :meth:`verify`.
    """

    def __init__(self, ctx: Context, name: str) -> None:
        self.ctx = ctx
        self.name = name

    def setup(self) -> None:
        """Reliable setup before any loop of any piece starts (create a shard, say)."""

    def loops(self) -> dict[str, Callable[[], None]]:
        """The piece's loops by thread name: by default :meth:`run`, under its name."""
        return {self.name: self.run}

    def run(self) -> None:
        """The piece's loop (when it has one): work until ``self.ctx.stop`` is set."""
        raise NotImplementedError(f"{type(self).__name__} has no loop: override run or loops")

    def verify(self) -> None:
        """Checks of its own after the workload: faults off, the listen caught up."""


# --- the core: writers, snapshot readers, the listener ----------------------------------------


class WriterPiece(Piece):
    """A writer thread on the main shard (see :class:`Writer`); the history settles its
    writes of unknown outcome."""

    slow_stage_s = 0.0

    def __init__(self, ctx: Context, index: int, name: str | None = None) -> None:
        super().__init__(ctx, name or f"writer-{index}")
        self.index = index

    def client(self) -> FaultyClient:
        """This writer's client (the sabotage's writer hooks apply)."""
        return self.ctx.client(self.name, sabotaged=True)

    def run(self) -> None:
        """Write until the run stops; hand the records over."""
        ctx = self.ctx
        writer = Writer(
            self.client(),
            ctx.shard_name,
            self.index,
            ctx.seed_for(self.name),
            ctx.rec,
            outcome=ctx.history.landed,
            fresh_tokens=ctx.sabotage is not None and ctx.sabotage.fresh_tokens,
            slow_stage_s=self.slow_stage_s,
        )
        try:
            writer.run(ctx.stop.is_set)
        finally:
            ctx.add_records(writer.records)


class ProcessWriter(Piece):
    """A writer in a spawned process, on the main shard, until the run stops.

    It has no reference history to settle writes of unknown outcome: those
    (and what they meant to retract) stay in the shard for good, a few per
    process and minute.
    """

    def __init__(self, ctx: Context, index: int) -> None:
        super().__init__(ctx, f"process-writer-{index}")
        self.index = index
        mp = multiprocessing.get_context("spawn")
        self._stop = mp.Event()
        self._out = mp.Queue()
        self._process = mp.Process(
            target=_process_writer,
            args=(
                ctx.loc,
                ctx.shard_name,
                index,
                ctx.seed_for(self.name),
                ctx.duration_s + FINISH_TIMEOUT_S,
                ctx.sabotage_name,
                self._stop,
                self._out,
            ),
            name=f"check-{self.name}",
        )

    def run(self) -> None:
        """Start the process, stop it with the run, and take in what it reports."""
        rec = self.ctx.rec
        self._process.start()
        try:
            self.ctx.stop.wait()
            self._stop.set()
            try:
                res = self._out.get(timeout=FINISH_TIMEOUT_S + 60)
            except queue.Empty:
                rec.violation(f"writer process {self.index} reported nothing (crashed or hung)")
                return
        finally:
            self._process.join(timeout=10)
            if self._process.is_alive():
                self._process.kill()
        if "error" in res:
            rec.violation(f"writer process {self.index} failed: {res['error']}")
            return
        self.ctx.add_records(WriteRecord(**r) for r in res["records"])
        rec.ops(res["ops"])
        rec.faults(res["faults"])
        for v in res["violations"]:
            rec.violation(f"process {self.index}: {v}")
        rec.op("writer_processes")


def recent_as_of(reader: ReadHandle, latest: int, rng: random.Random, rec: Recorder) -> int | None:
    """Downgrade ``reader``'s since to a random time at most two windows below ``latest``,
    then pick a random as_of at most a window below it and at or after the since the reader
    now has (None: that since is past ``latest``).

    The since comes after the downgrade: it may be past the one asked for (an earlier
    downgrade whose reply was lost landed), and no read may go below it.
    """
    lo = reader.since
    if lo < latest:
        with contextlib.suppress(Determinate, Indeterminate):
            reader.downgrade_since(rng.randint(max(lo, latest - 2 * SNAPSHOT_WINDOW), latest))
            rec.op("since_downgrades")
    lo = reader.since
    if lo > latest:
        return None
    return rng.randint(max(lo, latest - SNAPSHOT_WINDOW), latest)


class SnapshotReader(Piece):
    """Snapshots of the main shard at random recent times, each compared with the history.

    Before each read it downgrades its since (and its hold on the history) to
    a random recent time, then reads at or after it: since, and with it what a
    snapshot reads, keeps up with the upper even while reads fail or are slow.
    """

    def __init__(self, ctx: Context, index: int) -> None:
        super().__init__(ctx, f"reader-{index}")
        ctx.history.hold(self.name, 0)

    def run(self) -> None:
        """Take snapshots until the run stops."""
        ctx, rec, who = self.ctx, self.ctx.rec, self.name
        fc = ctx.client(who, reader=True)
        r = random.Random(ctx.seed_for(who))
        reader = fc.client.open_shard(ctx.shard_name).reader(who)
        fc.enable()
        last_upper = 0
        while not ctx.stop.is_set():
            try:
                latest = reader.latest_as_of()
            except (Determinate, Indeterminate):
                rec.op("snapshot_errors")
                continue
            if latest + 1 < last_upper:
                rec.violation(f"{who}: upper went back from {last_upper} to {latest + 1}")
            last_upper = max(last_upper, latest + 1)
            as_of = recent_as_of(reader, latest, r, rec)
            ctx.history.hold(who, reader.since)
            if as_of is None:
                time.sleep(0.005)
                continue
            table = self._snapshot(reader, as_of)
            if table is not None:
                rec.op("snapshots")
                ctx.history.add_snapshot(as_of, snapshot_keys(table, who, as_of, rec), who)
            time.sleep(r.uniform(0, 0.02))
        ctx.history.release(who)
        with contextlib.suppress(PersistError):
            reader.close()

    def _snapshot(self, reader: ReadHandle, as_of: int) -> pa.Table | None:
        """The snapshot at ``as_of``; None after an error (counted, or a violation)."""
        rec, who = self.ctx.rec, self.name
        try:
            return reader.snapshot_table(as_of)
        except PartNotFound as e:
            rec.violation(f"{who}: leased snapshot as_of {as_of} failed: {e}")
        except CorruptData as e:
            rec.violation(f"{who}: snapshot as_of {as_of} read corrupt data: {e}")
        except (Determinate, Indeterminate):
            rec.op("snapshot_errors")
        except InvalidFrontier:
            # A downgrade whose reply was lost landed: the hold in state is ahead of
            # reader.since, which only a returned downgrade moves. Not a data error.
            rec.op("snapshots_behind_a_landed_downgrade")
        return None


class Listener:
    """The source of the reference history: one listen from time 0, checked event by event.

    Not a :class:`Piece`: it is what the pieces are checked against, and it
    reads on after the workload, until the final upper. Its reader registers
    when it is built, before any other reader (its hold keeps since at 0
    until it listens: a reader downgrading first could move since past 0),
    and holds since just below its frontier, as a real consumer does.
    """

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.fc = ctx.client("listener", reader=True)
        self.reader = self.fc.client.open_shard(ctx.shard_name).reader("listener")
        self.listen = self.reader.listen(0)
        self.final_upper: int | None = None
        self.done = threading.Event()
        """Set once the listen reached the final upper."""
        self.thread = threading.Thread(
            target=guarded(ctx.rec, "listen", self.run), name="check-listen"
        )

    def finish(self, final_upper: int) -> None:
        """Read on up to ``final_upper`` (the workload has stopped), then stop."""
        self.final_upper = final_upper
        self.thread.join(timeout=FINISH_TIMEOUT_S + 10)

    def run(self) -> None:
        """Follow the shard, adding each event to the history, until the final upper."""
        ctx, rec, history, reader = self.ctx, self.ctx.rec, self.ctx.history, self.reader
        self.fc.enable()
        r = random.Random(ctx.seed_for("listener"))
        deadline: float | None = None
        while True:
            if self.final_upper is not None:
                if history.frontier >= self.final_upper:
                    self.done.set()
                    break
                deadline = deadline or time.monotonic() + FINISH_TIMEOUT_S
                if time.monotonic() > deadline:
                    rec.violation(
                        f"listen: stuck at frontier {history.frontier}, final upper "
                        f"{self.final_upper}"
                    )
                    break
            try:
                event = self.listen.next(timeout_s=0.1)
            except (Determinate, Indeterminate):
                rec.op("listen_errors")
                continue
            if event is None:
                continue
            table = self._fetch(event)
            if table is None:
                history.skip(event.upper)
                continue
            rec.op("listen_events")
            history.add_event(event.lower, event.upper, table)
            if r.random() < 0.3 and history.frontier > 1:
                with contextlib.suppress(Determinate, Indeterminate):
                    reader.downgrade_since(history.frontier - 1)
        self.listen.close()
        with contextlib.suppress(PersistError):
            reader.close()

    def _fetch(self, event: ListenEvent) -> pa.Table | None:
        """The event's updates, retrying store errors; None (a violation) if a part is gone."""
        while True:
            try:
                return self.reader.fetch(event.parts)
            except PartNotFound as e:
                self.ctx.rec.violation(
                    f"listen: leased event [{event.lower}, {event.upper}) failed: {e}"
                )
                return None
            except (Determinate, Indeterminate):
                self.ctx.rec.op("listen_errors")


# --- the fault menu ---------------------------------------------------------------------------


def _reads_and_deletes_never_fail(faults: StoreFaults) -> StoreFaults:
    """Faults on every Blob operation but get and delete (and on every Consensus one)."""
    blob, consensus = faults
    return dataclasses.replace(blob, ops=BLOB_OPS - {"get", "delete"}), consensus


class Maintainer(Piece):
    """Compaction of the main shard and GC (with the orphan sweep) of every shard of the
    run in a loop, and a second compactor racing into the window of every lost
    compare-and-set reply of this client: it merges the merge that may just have landed
    (concatenating part lists, so state keeps its parts).

    It is what keeps the shards small, so its Blob never fails a read or a delete (every
    other client's does; its writes, listings and Consensus calls still fail). A
    compaction reads every part of its batches and a GC pass deletes the garbage of every
    diff since Consensus was last truncated, all of it again, each ending at the first
    failure: under every client's faults neither finishes once the shard or its garbage
    outgrows a few dozen parts, and from then on both only grow, and with them every
    commit's own compaction (writers stall) and every GC pass.
    """

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "maintenance")

    def run(self) -> None:
        """Compact or collect, pausing a little between, until the run stops."""
        ctx, rec = self.ctx, self.ctx.rec
        # Retrying (not failing at once) after a lost reply is what reaches compaction's
        # cleanup after an unknown outcome.
        fc = ctx.client(
            self.name,
            config=lambda c: dataclasses.replace(c, retry_timeout_s=1.5),
            faults=_reads_and_deletes_never_fail,
        )
        racer = ctx.client(  # its faults stay off
            f"{self.name}-racer",
            config=lambda c: dataclasses.replace(c, compaction_memory_bytes=1, compaction_fan_in=2),
        )
        r = random.Random(ctx.seed_for(self.name))
        shard = fc.client.open_shard(ctx.shard_name)
        racer_shard = racer.client.open_shard(ctx.shard_name)
        collected = {name: fc.client.open_shard(name) for name in ctx.shards}

        def race() -> None:
            if ctx.stop.is_set():
                return
            try:
                racer_shard.compact()
                rec.op("compactions_raced_into_lost_replies")
            except PersistError:
                rec.op("maintenance_errors")

        fc.consensus.on_lost_reply = race
        fc.enable()
        while not ctx.stop.is_set():
            try:
                if r.random() < 0.6:
                    rec.op("compactions", len(shard.compact()))
                else:
                    collected[r.choice(ctx.shards)].gc()  # with the orphan sweep
                    rec.op("gcs")
            except PartNotFound as e:
                # A compaction that lost its race to GC says so (applied=False); a missing
                # part of batches still in state is lost data.
                rec.violation(f"maintenance: compaction found a committed part missing: {e}")
            except PersistError as e:
                rec.op("maintenance_errors_" + type(e).__name__)
            ctx.stop.wait(r.uniform(0.01, 0.1))
        fc.consensus.on_lost_reply = None


class SlowWriter(WriterPiece):
    """A writer that stages every part in Blob, waits up to 3/4 of the orphan sweep's grace,
    then commits: the sweep races it (commits meet StagedPartsExpired, then it stages
    again)."""

    slow_stage_s = GRACE_S * 0.75

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, SLOW_INDEX, "slow-writer")

    def client(self) -> FaultyClient:
        """Every part in Blob, where sweeps reach."""
        return self.ctx.client(
            self.name,
            sabotaged=True,
            config=lambda c: dataclasses.replace(c, inline_write_max_bytes=1),
        )


class Replacer(Piece):
    """A second shard whose every write replaces its contents, and a reader of it.

    Each snapshot must show exactly the newest replace at its time: a write
    that was not acknowledged only if its outcome was unknown; never a mix,
    never an older write than one acknowledged at or before its time. The
    final state must hold a few references per replace (it once doubled them
    with each).
    """

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "replace")
        self.shard_name = ctx.shard_name + "-replaced"
        self.acks: list[tuple[int, int | None, bool, bool]] = []
        """Per replace write: (key, landed time if a Committed said, acked, indeterminate)."""
        self.seen: list[tuple[int, int | None]] = []
        """Per replace snapshot: (as_of, the one write it shows, or None)."""

    def setup(self) -> None:
        """Create the shard (with the main shard's retention, so its reader's since keeps it
        small) and an empty batch [0, 1), so every snapshot has a time."""
        with reliable_client(self.ctx.loc) as setup:
            shard = setup.open_shard(self.shard_name, SCHEMA, retention_ms=RETENTION_MS)
            shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)
        self.ctx.shards.append(self.shard_name)

    def loops(self) -> dict[str, Callable[[], None]]:
        """The replacing writer and its reader."""
        return {"replacer": self.write, "replace-reader": self.read}

    def write(self) -> None:
        """Replace the shard's contents with each write until the run stops."""
        ctx, rec = self.ctx, self.ctx.rec
        fc = ctx.client("replacer")
        r = random.Random(ctx.seed_for("replacer"))
        writer = fc.client.open_shard(self.shard_name).writer("replacer")
        fc.enable()
        upper = _retry(writer.fetch_upper, hard_s=FINISH_TIMEOUT_S)
        number = 0
        while not ctx.stop.is_set():
            number += 1
            key = REPLACE_INDEX * KEY_PER_WRITER + number
            data = pa.table({"v": write_values(key)}, schema=SCHEMA)
            before = fc.consensus.indeterminate_cas()
            landed: int | None = None
            acked = False
            while not ctx.stop.is_set():
                rec.op("replace_attempts")
                try:
                    builder = writer.builder()
                    builder.add(data)
                    staged = builder.finish()
                    res = writer.compare_and_append_batches(
                        [staged], upper, upper + 1, token=number, ts_rewrite=upper, replace=True
                    )
                except (Determinate, Indeterminate) as e:
                    rec.op("replace_errors_" + type(e).__name__)
                    with contextlib.suppress(PersistError):
                        upper = writer.fetch_upper()
                    if r.random() < 0.15:
                        break
                    continue
                if isinstance(res, UpperMismatch):
                    upper = res.current
                    continue
                if isinstance(res, Committed):
                    landed = upper
                acked = True
                upper = res.upper
                break
            self.acks.append((key, landed, acked, fc.consensus.indeterminate_cas() > before))
            rec.op("replaces_acked" if acked else "replaces_abandoned")

    def read(self) -> None:
        """Snapshot the shard at random times until the run stops; each shows one write."""
        ctx, rec = self.ctx, self.ctx.rec
        fc = ctx.client("replace-reader", reader=True)
        r = random.Random(ctx.seed_for("replace-reader"))
        reader = fc.client.open_shard(self.shard_name).reader("replace-reader")
        fc.enable()
        while not ctx.stop.is_set():
            try:
                latest = reader.latest_as_of()
                as_of = recent_as_of(reader, latest, r, rec)
                if as_of is None:
                    continue
                table = reader.snapshot_table(as_of)
            except PartNotFound as e:
                rec.violation(f"replace-reader: leased snapshot failed: {e}")
                continue
            except (Determinate, Indeterminate, InvalidFrontier):
                rec.op("replace_snapshot_errors")
                continue
            keys = snapshot_keys(table, "replace-reader", as_of, rec)
            if len(keys) > 1:
                rec.violation(
                    f"replace-reader: snapshot as_of {as_of} mixes replaced writes {sorted(keys)}"
                )
            self.seen.append((as_of, max(keys) if keys else None))
            rec.op("replace_snapshots")
            time.sleep(r.uniform(0, 0.01))
        with contextlib.suppress(PersistError):
            reader.close()

    def verify(self) -> None:
        """Each snapshot showed the newest replace at its time; the final state is small."""
        rec = self.ctx.rec
        rec.op("replace_writes_checked", len(self.acks))
        rec.op("replace_snapshots_checked", len(self.seen))
        landed = sorted((t, key) for key, t, acked, _ in self.acks if acked and t is not None)
        times = [t for t, _ in landed]
        for as_of, key in self.seen:
            i = bisect.bisect_right(times, as_of)
            if i and (key is None or key < landed[i - 1][1]):
                rec.violation(
                    f"replace-reader: snapshot as_of {as_of} shows write {key}, older than write "
                    f"{landed[i - 1][1]} acknowledged at time {landed[i - 1][0]}"
                )
        shown = [key for _, key in sorted(self.seen) if key is not None]
        if any(b < a for a, b in zip(shown, shown[1:], strict=False)):
            rec.violation("replace-reader: a later as_of showed an older replaced write")
        with reliable_client(self.ctx.loc) as check:
            shard = check.open_shard(self.shard_name)
            with shard.reader("final-replace-check") as reader:
                state = shard.state()
                final = snapshot_keys(reader.snapshot_table(state.upper - 1), "final", 0, rec)
        acked = [key for key, _, ok, _ in self.acks if ok]
        maybe = {key for key, _, ok, unknown in self.acks if not ok and unknown}
        if acked and (len(final) != 1 or (max(final) != max(acked) and max(final) not in maybe)):
            rec.violation(
                f"replaced shard ends with writes {sorted(final)}, last acked {max(acked)}"
            )
        refs = sum(len(b.parts) for b in state.batches.values())
        if refs > 3 * len(self.acks) + 16:
            rec.violation(
                f"replaced shard holds {refs} part references after {len(self.acks)} replaces"
            )


# --- pieces on shards of their own: one writer, an exact model --------------------------------


def stage(handle: WriteHandle, data: pa.Table) -> StagedBatch:
    """``data`` staged as one batch (retrying store errors: staging under faults)."""

    def once() -> StagedBatch:
        builder = handle.builder()
        builder.add(data)
        return builder.finish()

    return _retry(once, hard_s=FINISH_TIMEOUT_S)  # type: ignore[no-any-return]


class ModelShard(Piece):
    """A shard of the piece's own with one writer, so the piece knows exactly which writes
    landed: each write inserts a numbered write and retracts the oldest of ``LIVE_WRITES``
    (:func:`write_updates`), and every few writes a leased snapshot at the upper must hold
    exactly the live ones, readable (no PartNotFound). Subclasses write one write in
    :meth:`write` (returning whether it landed) on clients from :meth:`clients`."""

    index = 0
    """Writer index of the piece's writes (their keys name it)."""

    def __init__(self, ctx: Context, name: str) -> None:
        super().__init__(ctx, name)
        self.shard_name = f"{ctx.shard_name}-{name}"
        self.live: collections.deque[int] = collections.deque()
        self.unknown = False
        """The last write's outcome stayed unknown (the run stopped): the model is inexact."""
        self.rng = random.Random(ctx.seed_for(name))

    def setup(self) -> None:
        """The shard, with retention (the reader's since keeps it small) and [0, 1)."""
        with reliable_client(self.ctx.loc) as setup:
            shard = setup.open_shard(self.shard_name, SCHEMA, retention_ms=RETENTION_MS)
            shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)
        self.ctx.shards.append(self.shard_name)

    def clients(self) -> tuple[FaultyClient, WriteHandle]:
        """The writer's client and handle (parts in Blob, where deletes reach)."""
        fc = self.ctx.client(
            self.name, config=lambda c: dataclasses.replace(c, inline_write_max_bytes=1)
        )
        return fc, fc.client.open_shard(self.shard_name).writer(self.name)

    def write(self, handle: WriteHandle, number: int, data: pa.Table) -> bool | None:
        """Write ``data`` as write ``number``; whether it landed (None: unknown, run over)."""
        raise NotImplementedError

    def run(self) -> None:
        """Write, check a snapshot now and then, until the run stops."""
        ctx, rec = self.ctx, self.ctx.rec
        fc, handle = self.clients()
        reader_fc = ctx.client(f"{self.name}-reader", reader=True)
        reader = reader_fc.client.open_shard(self.shard_name).reader(self.name)
        fc.enable()
        reader_fc.enable()
        number = 0
        while not ctx.stop.is_set():
            number += 1
            key = self.index * KEY_PER_WRITER + number
            retracts = self.live[0] if len(self.live) >= LIVE_WRITES else None
            landed = self.write(handle, number, write_updates(key, retracts))
            if landed is None:
                self.unknown = True
                break
            if landed:
                rec.op(f"{self.name}_writes_landed")
                self.live.append(key)
                if retracts is not None:
                    self.live.popleft()
            if self.rng.random() < 0.3:
                self.check(reader)
            ctx.stop.wait(self.rng.uniform(0.0, 0.05))
        with contextlib.suppress(PersistError):
            reader.close()

    def check(self, reader: ReadHandle) -> None:
        """A leased snapshot at the upper holds exactly the live writes."""
        rec, who = self.ctx.rec, self.name
        try:
            latest = reader.latest_as_of()
            if reader.since < latest:
                reader.downgrade_since(latest)
            table = reader.snapshot_table(latest)
        except PartNotFound as e:
            rec.violation(f"{who}: leased snapshot failed, a landed write's part is gone: {e}")
            return
        except (Determinate, Indeterminate, InvalidFrontier):
            rec.op(f"{who}_snapshot_errors")
            return
        keys = snapshot_keys(table, who, latest, rec)
        rec.op(f"{who}_snapshots_checked")
        if keys != set(self.live):
            rec.violation(
                f"{who}: snapshot at {latest} holds writes {sorted(keys)}, the writer landed "
                f"{sorted(self.live)}"
            )

    def verify(self) -> None:
        """The final state's parts all exist and it holds exactly the live writes."""
        rec, who = self.ctx.rec, self.name
        with reliable_client(self.ctx.loc) as check:
            shard = check.open_shard(self.shard_name)
            with shard.reader("final-check") as reader:
                state = shard.state()
                for b in state.batches.values():
                    for part in b.parts:
                        if part.key is not None and check.blob.get(part.key) is None:
                            rec.violation(
                                f"{who}: final state references part {part.key}, missing from Blob"
                            )
                try:
                    final = snapshot_keys(reader.snapshot_table(state.upper - 1), who, 0, rec)
                except PartNotFound as e:
                    rec.violation(f"{who}: final snapshot failed: {e}")
                    return
        if not self.unknown and final != set(self.live):
            rec.violation(
                f"{who}: the shard ends with writes {sorted(final)}, the writer landed "
                f"{sorted(self.live)}"
            )


class Resender(ModelShard):
    """Two-phase writes without a token (stage a StagedBatch, then
    ``compare_and_append_batches``) whose client hands every lost reply to the caller as
    Indeterminate; the caller resends the *same* StagedBatch at the same upper until the
    answer is determinate. Being the shard's one writer, an UpperMismatch after an unknown
    outcome means the first attempt landed: that refusal must not delete the landed
    write's parts (issue 33 item 1), and nothing may land twice."""

    index = RESEND_INDEX

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "resend")

    def clients(self) -> tuple[FaultyClient, WriteHandle]:
        """Lost replies reach the caller (the machine does not retry them)."""
        fc = self.ctx.client(
            self.name,
            config=lambda c: dataclasses.replace(c, inline_write_max_bytes=1, retry_timeout_s=1e-9),
        )
        return fc, fc.client.open_shard(self.shard_name).writer(self.name)

    def write(self, handle: WriteHandle, number: int, data: pa.Table) -> bool | None:
        """Stage once, commit, resend the same batch after any error; landed or not."""
        rec, violation = self.ctx.rec, self.ctx.rec.violation
        staged = stage(handle, data)
        upper = _retry(handle.fetch_upper, hard_s=FINISH_TIMEOUT_S)
        uncertain = False
        give_up = time.monotonic() + FINISH_TIMEOUT_S
        while time.monotonic() < give_up:
            try:
                res = handle.compare_and_append_batches(
                    [staged], upper, upper + 1, ts_rewrite=upper
                )
            except Indeterminate:
                uncertain = True
                rec.op("resend_after_indeterminate")
                continue
            except StagedPartsExpired:
                staged = stage(handle, data)  # the upper is still ours: nothing landed
                continue
            except Determinate:
                rec.op("resend_after_error")
                continue
            if isinstance(res, Committed):
                return True
            assert isinstance(res, UpperMismatch)  # no token: never AlreadyCommitted
            if not uncertain or res.current != upper + 1:
                violation(
                    f"resend: write {number} refused at upper {upper} (now {res.current}), "
                    "though only a lost reply of its own could have moved the upper"
                )
            rec.op("resends_found_landed")
            return True
        return None


class LateConsensus(TrackingConsensus):
    """A Consensus that can hold one compare-and-set of a thread in flight: the caller hears
    Indeterminate at once, and the attempt reaches the store only when :meth:`land` is
    called (a slow store, a retry on another connection), or never."""

    def __init__(self, inner: Consensus, faults: Faults, *, enabled: bool = True) -> None:
        super().__init__(inner, faults, enabled=enabled)
        self.hold_thread: int | None = None
        self.held: tuple[str, SeqNo | None, VersionedData] | None = None

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """Hold the armed thread's next attempt; pass everything else on."""
        if self.hold_thread != threading.get_ident():
            return super().compare_and_set(key, expected, new)
        self.hold_thread = None
        self.held = (key, expected, new)
        raise Indeterminate(f"compare-and-set of {key!r} at SeqNo {new.seqno} still in flight")

    def land(self) -> bool:
        """The held attempt reaches the store now; whether it landed."""
        held, self.held = self.held, None
        assert held is not None
        return isinstance(self.inner.compare_and_set(*held), CaSCommitted)


class SinkAborter(ModelShard):
    """The sink's protocol under a commit of unknown outcome that lands late: a micro-batch
    (token = batch number) is staged and committed; when the commit fails (often with its
    attempt held in flight), ``abort`` runs on another client, as Spark runs it in another
    worker (:func:`~pyspark_persist.state.write.abandon_staged`, what the sink's abort
    calls); then the held attempt may reach the store, and the micro-batch is replayed
    (staged again, the same token). Reads must never fail with PartNotFound and the
    micro-batch lands whole, once (issue 33 item 2)."""

    index = ABORT_INDEX

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "abort")

    def clients(self) -> tuple[FaultyClient, WriteHandle]:
        """The committer: attempts held in flight, lost replies reach the caller."""
        fc = self.ctx.client(
            self.name,
            config=lambda c: dataclasses.replace(c, inline_write_max_bytes=1, retry_timeout_s=1e-9),
            consensus=LateConsensus,
        )
        aborter = self.ctx.client(f"{self.name}-worker")
        self.abort_shard = aborter.client.open_shard(self.shard_name)
        aborter.enable()
        self.held = fc.consensus
        return fc, fc.client.open_shard(self.shard_name).writer("sink-query")

    def write(self, handle: WriteHandle, number: int, data: pa.Table) -> bool | None:
        """Commit the micro-batch; abort and replay until it is committed or acknowledged."""
        rec = self.ctx.rec
        consensus = self.held
        assert isinstance(consensus, LateConsensus)
        hold = self.rng.random() < 0.5
        give_up = time.monotonic() + FINISH_TIMEOUT_S
        while time.monotonic() < give_up:
            staged = stage(handle, data)
            upper = _retry(handle.fetch_upper, hard_s=FINISH_TIMEOUT_S)
            if hold:
                consensus.hold_thread = threading.get_ident()
                hold = False
            try:
                res: AppendResult = handle.compare_and_append_batches(
                    [staged], upper, upper + 1, token=number, ts_rewrite=upper
                )
            except (Determinate, Indeterminate):
                rec.op("abort_aborts")
                with contextlib.suppress(PersistError):
                    staged_writes.abandon_staged(self.abort_shard.machine, staged.parts)
                if consensus.held is not None and self.rng.random() < 0.7:
                    with contextlib.suppress(PersistError):
                        rec.op("abort_late_landings" if consensus.land() else "abort_fenced_off")
                consensus.held = None
                continue  # Spark replays the micro-batch
            finally:
                consensus.hold_thread = None
            if isinstance(res, Committed | AlreadyCommitted):
                rec.op("abort_batches_committed")
                return True
        return None


BLIP_P = 0.3
"""Chance that a compare-and-set of the short-grace writer starts a store outage."""


class BlipConsensus(TrackingConsensus):
    """A Consensus with outages: now and then a compare-and-set starts one, and every
    compare-and-set of the outage (about one grace long) is refused (StoreUnavailable),
    so a commit retries while its staged parts age past the orphan sweep's grace."""

    def __init__(self, inner: Consensus, faults: Faults, *, enabled: bool = True) -> None:
        super().__init__(inner, faults, enabled=enabled)
        self._rng = random.Random(faults.seed)
        self._until = 0.0

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """Refused during an outage; sometimes the start of one."""
        if self.enabled:
            now = time.monotonic()
            if now >= self._until and self._rng.random() < BLIP_P:
                self._until = now + self._rng.uniform(0.6, 1.2) * SHORT_GRACE_S
            if now < self._until:
                self.injected["fail_before"] += 1
                raise StoreUnavailable(f"injected outage: compare-and-set of {key!r} refused")
        return super().compare_and_set(key, expected, new)


SHORT_GRACE_S = 1.2
"""The short-grace piece's ``staged_part_grace_s``: commits meet sweeps within seconds. A
commit lands within half of it after its last check of its parts, or the sweep may take
them first: shorter, and a loaded machine's stalls (a slow SQLite compare-and-set) would
break that promise, which only holds for a grace far longer than any stall."""


def short_grace_config(c: PersistConfig) -> PersistConfig:
    """The short-grace piece's knobs: the short grace, the longest retry window the config
    allows with it, every part in Blob."""
    return dataclasses.replace(
        c,
        staged_part_grace_s=SHORT_GRACE_S,
        retry_timeout_s=SHORT_GRACE_S * 0.45,
        inline_write_max_bytes=1,
    )


class ShortGrace(ModelShard):
    """A writer on a short ``staged_part_grace_s`` (and the matching ``retry_timeout_s``)
    over a Consensus with outages, while a sweeper runs GC's orphan sweep on its shard in a
    loop: each write is staged, held back up to half the grace, and committed with its
    token, retried (same token) through outages and StagedPartsExpired (staged again). No
    acknowledged commit may reference a swept part (issue 33 item 3)."""

    index = GRACE_INDEX

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "grace")

    def loops(self) -> dict[str, Callable[[], None]]:
        """The writer and the sweeper."""
        return {self.name: self.run, f"{self.name}-sweeper": self.sweep}

    def clients(self) -> tuple[FaultyClient, WriteHandle]:
        """The short grace, over a Consensus with outages."""
        fc = self.ctx.client(
            self.name, config=lambda c: short_grace_config(c), consensus=BlipConsensus
        )
        return fc, fc.client.open_shard(self.shard_name).writer(self.name)

    def write(self, handle: WriteHandle, number: int, data: pa.Table) -> bool | None:
        """Stage, wait, commit with the write's token until acknowledged."""
        rec, ctx = self.ctx.rec, self.ctx
        give_up = time.monotonic() + FINISH_TIMEOUT_S
        staged = stage(handle, data)
        ctx.stop.wait(self.rng.uniform(0.3, 0.45) * SHORT_GRACE_S)
        while time.monotonic() < give_up:
            upper = _retry(handle.fetch_upper, hard_s=FINISH_TIMEOUT_S)
            try:
                res = handle.compare_and_append_batches(
                    [staged],
                    upper,
                    upper + 1,
                    token=number,
                    ts_rewrite=upper,
                    delete_on_mismatch=False,
                )
            except StagedPartsExpired:
                rec.op("grace_parts_expired")
                staged = stage(handle, data)
                continue
            except (Determinate, Indeterminate):
                rec.op("grace_commit_errors")
                ctx.stop.wait(0.02)  # through an outage, not around it
                continue
            if isinstance(res, Committed | AlreadyCommitted):
                return True
        return None

    def sweep(self) -> None:
        """GC with the orphan sweep of the piece's shard, on the short grace, in a loop."""
        ctx = self.ctx
        fc = ctx.client(
            f"{self.name}-sweeper",
            config=lambda c: short_grace_config(c),
            faults=_reads_and_deletes_never_fail,
        )
        shard = fc.client.open_shard(self.shard_name)
        fc.enable()
        while not ctx.stop.wait(0.05):
            try:
                ctx.rec.op("grace_orphans_swept", shard.gc().orphans_deleted)
            except PersistError as e:
                ctx.rec.op("maintenance_errors_" + type(e).__name__)


def fetch_retrying(reader: ReadHandle, event: ListenEvent, rec: Recorder, errors: str) -> pa.Table:
    """The updates of a listen event, retrying store errors (counted as ``errors``): the
    listen has moved past the event, so giving up would lose it."""
    while True:
        try:
            return reader.fetch(event.parts)
        except (Determinate, Indeterminate):
            rec.op(errors)


# --- drop and re-create under load ------------------------------------------------------------


@dataclass
class DropWrite:
    """One write to the dropped-and-created-again shard: the incarnation of the handle that
    attempted it, and what that handle heard."""

    key: int
    incarnation: str
    acked: bool = False
    indeterminate: bool = False


KEYED_SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
"""The keyed piece's shard: key ``k``, value ``v`` (unique per row: it names its write)."""
KEYED_KEYS = 12
"""Keys 0..11 are shared by every keyed writer (they race on them); key ``-(i + 1)`` is
keyed writer ``i``'s own marker key."""
KEYED_WRITERS = 3
KEYED_INDEX = 700
"""The write ids of keyed writer ``i`` start at ``(KEYED_INDEX + i) * KEY_PER_WRITER``."""
ROW_SLOTS = 16
"""Row ``j`` of write ``w`` has value ``w * ROW_SLOTS + j``; the marker row is the last slot."""


@dataclass
class KeyedWrite:
    """One upsert (``rows``: key -> value, None deletes) or delete of a keyed writer, and what
    its writer learned of it.

    Every upsert also upserts its writer's marker key with ``marker`` (a fresh value), so the
    time it landed at is where that value appears; a delete follows only an acknowledged upsert
    of its writer and deletes its marker (``marker`` is then that upsert's), so the time it
    landed at is where the marker disappears with no new one. Either way the write's token
    leaves a row the listen sees, which settles a write of unknown outcome.
    """

    writer: int
    token: int
    delete: bool
    rows: dict[int, int | None]
    marker: int
    acked: bool = False
    indeterminate: bool = False


class DropRecreate(Piece):
    """A shard of its own with a writer and a listen, dropped (as ``persist shards drop
    --force`` does: its listen holds it) and created again under the same name every second
    or so while they run. The writer and the listen each reopen the shard when theirs is
    dropped, and the writer keeps trying its dropped handle now and then.

    Checked: a handle of a dropped incarnation is never acknowledged again (it gets
    ShardDropped); a listen reads only rows its incarnation's handles wrote, each once and
    whole, and ends with ShardDropped once its incarnation is dropped; the incarnation at
    the end holds exactly its own acknowledged writes (and, of the others its handles
    tried, at most those of unknown outcome) (issue 33 items 4, 5)."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "drop")
        self.shard_name = f"{ctx.shard_name}-dropped"
        self.writes: dict[int, DropWrite] = {}
        """Every write attempted, by key, registered before its first attempt."""
        self.dropped_at: dict[str, float] = {}
        """Each dropped incarnation: when its drop finished (monotonic)."""
        self._lock = threading.Lock()

    def setup(self) -> None:
        """The first incarnation."""
        self._create()

    def _create(self) -> None:
        """Create the shard under its name, with an empty batch [0, 1) to listen from."""
        with reliable_client(self.ctx.loc) as setup:
            shard = setup.open_shard(self.shard_name, SCHEMA, retention_ms=RETENTION_MS)
            shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)

    def loops(self) -> dict[str, Callable[[], None]]:
        """The dropper, the writer and the listener."""
        return {"dropper": self.drop, "drop-writer": self.write, "drop-listener": self.listen}

    def drop(self) -> None:
        """Drop the shard (forced: the listen holds it) and create it again, every 0.5-2 s."""
        ctx = self.ctx
        r = random.Random(ctx.seed_for("dropper"))
        while not ctx.stop.wait(r.uniform(0.5, 2.0)):
            with reliable_client(ctx.loc) as c:
                old = c.open_shard(self.shard_name).machine.incarnation
                assert old is not None
                try:
                    drop_shard(
                        c.consensus,
                        c.blob,
                        self.shard_name,
                        now_ms=time.time_ns() // 1_000_000,
                        force=True,
                    )
                except ShardInUse:
                    # The writer landed a commit before each of the drop's fencing attempts
                    # (a loaded machine): nothing was dropped, as the error says; try again.
                    ctx.rec.op("drops_contended")
                    continue
            with self._lock:
                self.dropped_at[old] = time.monotonic()
            self._create()
            ctx.rec.op("drops")

    def _open(self, fc: FaultyClient) -> tuple[WriteHandle, str] | None:
        """A writer on the shard of the name now, and its incarnation (None: the run ended)."""
        while not self.ctx.stop.is_set():
            try:
                shard = fc.client.open_shard(self.shard_name)
                handle = shard.writer("drop-writer")
                handle.fetch_upper()
                incarnation = shard.machine.incarnation
                assert incarnation is not None
                return handle, incarnation
            except (ShardNotFound, Determinate, Indeterminate):  # between drop and creation
                self.ctx.stop.wait(0.01)
        return None

    def _append(self, fc: FaultyClient, handle: WriteHandle, write: DropWrite) -> None:
        """Attempt ``write`` (its key is its token) until acknowledged, at most 20 times;
        ShardDropped passes through."""
        data = write_updates(write.key, None)
        before = fc.consensus.indeterminate_cas()
        try:
            upper: int | None = None
            for _ in range(20):
                try:
                    if upper is None:
                        upper = handle.fetch_upper()
                    res = handle.compare_and_append(data, upper, upper + 1, token=write.key)
                except (Determinate, Indeterminate):
                    upper = None
                    continue
                if isinstance(res, UpperMismatch):
                    upper = res.current
                    continue
                write.acked = True
                return
        finally:
            write.indeterminate = fc.consensus.indeterminate_cas() > before

    def write(self) -> None:
        """Write to the shard of the name; reopen when it is dropped; try the dropped
        handle again now and then."""
        ctx, rec = self.ctx, self.ctx.rec
        fc = ctx.client("drop-writer")
        r = random.Random(ctx.seed_for("drop-writer"))
        fc.enable()
        opened = self._open(fc)
        dead: tuple[WriteHandle, str] | None = None
        number = 0
        while opened is not None and not ctx.stop.is_set():
            number += 1
            probe = dead is not None and r.random() < 0.2
            handle, incarnation = dead if probe and dead is not None else opened
            write = DropWrite(DROP_INDEX * KEY_PER_WRITER + number, incarnation)
            with self._lock:
                self.writes[write.key] = write
            started = time.monotonic()
            try:
                self._append(fc, handle, write)
            except ShardDropped:
                rec.op("drop_handles_refused")
                if not probe:
                    dead = opened
                    opened = self._open(fc)
                continue
            if write.acked:
                rec.op("drop_writes_acked")
                dropped = self.dropped_at.get(incarnation)
                if dropped is not None and dropped < started:
                    rec.violation(
                        f"drop: write {write.key} acknowledged to a handle of incarnation "
                        f"{incarnation[:8]}, dropped {started - dropped:.2f}s before it was "
                        "attempted (it committed into the shard created again)"
                    )
            ctx.stop.wait(r.uniform(0.0, 0.03))

    def listen(self) -> None:
        """Listen to each incarnation from its start until ShardDropped ends the listen."""
        ctx, rec = self.ctx, self.ctx.rec
        fc = ctx.client("drop-listener", reader=True)
        fc.enable()
        seen: set[int] = set()
        while not ctx.stop.is_set():
            try:
                shard = fc.client.open_shard(self.shard_name)
                reader = shard.reader("drop-listener")
                since = reader.since  # a writer may have moved it (retention) before we came
                listen = reader.listen(since)
            except (ShardNotFound, Determinate, Indeterminate, InvalidFrontier):
                ctx.stop.wait(0.01)
                continue
            incarnation = shard.machine.incarnation
            assert incarnation is not None
            try:
                self._follow(reader, listen, incarnation, since + 1, seen)
                rec.op("drop_listens_ended_by_stop")
            except ShardDropped:
                rec.op("drop_listens_ended_by_drop")
            finally:
                listen.close()
                with contextlib.suppress(PersistError):
                    reader.close()

    def _follow(
        self, reader: ReadHandle, listen: Any, incarnation: str, frontier: int, seen: set[int]
    ) -> None:
        """Check each event of ``incarnation``'s listen from ``frontier`` until the run stops
        (or ShardDropped); the listen of a dropped incarnation must end within
        ``FINISH_TIMEOUT_S / 4``."""
        ctx, rec = self.ctx, self.ctx.rec
        while not ctx.stop.is_set():
            dropped = self.dropped_at.get(incarnation)
            if dropped is not None and time.monotonic() - dropped > FINISH_TIMEOUT_S / 4:
                rec.violation(
                    f"drop: the listen of incarnation {incarnation[:8]} goes on "
                    f"{time.monotonic() - dropped:.0f}s after its drop, without ShardDropped"
                )
                return
            try:
                event = listen.next(timeout_s=0.1)
                if event is None:
                    continue
                table = fetch_retrying(reader, event, rec, "drop_listen_errors")
            except (Determinate, Indeterminate):
                rec.op("drop_listen_errors")
                continue
            except PartNotFound as e:
                rec.violation(f"drop: the listen of incarnation {incarnation[:8]} lost a part: {e}")
                return
            if event.lower != frontier:
                rec.violation(
                    f"drop: listen event [{event.lower}, {event.upper}) of incarnation "
                    f"{incarnation[:8]} does not follow frontier {frontier}"
                )
            frontier = event.upper
            rec.op("drop_listen_events")
            for _, sign, key in event_changes(event.lower, event.upper, table, rec):
                write = self.writes.get(key)
                owner = None if write is None else write.incarnation
                if sign < 0 or owner != incarnation:
                    rec.violation(
                        f"drop: the listen of incarnation {incarnation[:8]} read write {key}, "
                        f"written by a handle of incarnation {(owner or 'none')[:8]}"
                    )
                elif key in seen:
                    rec.violation(f"drop: write {key} emitted twice")
                seen.add(key)

    def verify(self) -> None:
        """The incarnation at the end holds exactly its own acknowledged writes."""
        rec = self.ctx.rec
        with reliable_client(self.ctx.loc) as check:
            shard = check.open_shard(self.shard_name)
            incarnation = shard.machine.incarnation
            with shard.reader("final-check") as reader:
                upper = shard.state().upper
                final = snapshot_keys(reader.snapshot_table(upper - 1), "drop", 0, rec)
        rec.op("drop_writes_checked", len(self.writes))
        own = {k for k, w in self.writes.items() if w.incarnation == incarnation}
        acked = {k for k in own if self.writes[k].acked}
        maybe = {k for k in own if self.writes[k].indeterminate}
        foreign = sorted(k for k in final if k not in own)
        if foreign:
            rec.violation(
                f"drop: the shard's last incarnation holds writes {foreign[:10]} of handles of "
                "other incarnations"
            )
        if acked - final or final - acked - maybe - set(foreign):
            rec.violation(
                f"drop: the shard's last incarnation holds {len(final)} writes: acknowledged "
                f"ones missing {sorted(acked - final)[:10]}, unacknowledged ones there "
                f"{sorted(final - acked - maybe - set(foreign))[:10]}"
            )


# --- dropped PubSub pushes --------------------------------------------------------------------

PUSH_POLL_S = 0.2
"""The pushed listener's ``listen_poll_pushed_s``: how often it reads Consensus although
pushes look healthy."""
PUSH_STALE_S = 1.5
"""How long after its acknowledgement the pushed listener must have seen a commit: a poll
interval, and slack for a loaded machine."""
PUSH_IDLE_S = 2.0
"""The pushed writer's pause after each burst: longer than the staleness bound, so a lost
push shows as a stale listen unless the listener polls."""
PUSH_DROP_P = 0.6
"""Chance that the pushed listener's transport drops a push it received."""


class PushedListen(Piece):
    """A writer and a listener of a shard of its own, on clients with PubSub (an in-process
    server, as in tests/pubsub), whose listener's transport drops pushes at random. The
    writer writes in bursts with pauses longer than the staleness bound. Every
    acknowledged commit must reach the listen within ``PUSH_STALE_S`` (a lost push delays
    it only until the listen's own poll, ``listen_poll_pushed_s``), at the time it
    committed at, in order, exactly once (issue 33 item 6, in the core).

    PubSub topics name a Consensus location, and ``mem://`` has none (one process), so on
    the mem backend the piece's shard lives in a SQLite Consensus of its own."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "pushes")
        self.shard_name = f"{ctx.shard_name}-pushed"
        self.acked: list[tuple[int, int, float]] = []
        """(write, time it landed at, when it was acknowledged: monotonic)."""
        self.seen: dict[int, tuple[int, float]] = {}
        """Each write the listen read: (time, when: monotonic)."""
        self.dropped = 0
        self.writer_done = threading.Event()
        self.directory: str | None = None
        self.loc = ctx.loc
        self.server: Any = None

    def setup(self) -> None:
        """The server, the location, the shard with an empty batch [0, 1)."""
        from pyspark_persist.pubsub.server import PubSubServer

        if consensus_kind(self.ctx.loc.consensus_uri) == "mem":
            self.directory = tempfile.mkdtemp(prefix="persist-check-pushes-")
            self.loc = Location(self.ctx.loc.blob_uri, f"sqlite:///{self.directory}/consensus.db")
        self.server = PubSubServer("127.0.0.1", 0).start()
        with reliable_client(self.loc) as setup:
            shard = setup.open_shard(self.shard_name, SCHEMA, retention_ms=RETENTION_MS)
            shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)
        # The listen registers before any write: retention would move since past 0.
        self.publisher = DroppingPublisher(
            self.server.address, self.loc.consensus_uri, self.ctx.seed_for("pushed-listener")
        )
        self.listener = self.ctx.client(
            "pushed-listener",
            reader=True,
            config=lambda c: dataclasses.replace(
                # No heartbeat or downgrade reads Consensus on the side: the listen's own
                # polls are what bounds its staleness.
                c,
                listen_poll_pushed_s=PUSH_POLL_S,
                heartbeat_interval_s=60.0,
            ),
            publisher=self.publisher,
            loc=self.loc,
        )
        self.reader = self.listener.client.open_shard(self.shard_name).reader("pushed-listener")
        self.listen_from_0 = self.reader.listen(0)

    def loops(self) -> dict[str, Callable[[], None]]:
        """The pushing writer and the listener."""
        return {"pushed-writer": self.write, "pushed-listener": self.listen}

    def write(self) -> None:
        """Bursts of one to three writes (same token until acknowledged), then a pause."""
        from pyspark_persist.pubsub.grpc_client import GrpcPublisher

        ctx, rec = self.ctx, self.ctx.rec
        publisher = GrpcPublisher(self.server.address, self.loc.consensus_uri)
        fc = ctx.client("pushed-writer", publisher=publisher, loc=self.loc)
        r = random.Random(ctx.seed_for("pushed-writer"))
        writer = fc.client.open_shard(self.shard_name).writer("pushed-writer")
        try:
            fc.enable()
            upper = _retry(writer.fetch_upper, hard_s=FINISH_TIMEOUT_S)
            number = 0
            while not ctx.stop.is_set():
                for _ in range(r.randint(1, 3)):
                    number += 1
                    key = PUSH_INDEX * KEY_PER_WRITER + number
                    landed, upper = append_until_acked(writer, key, number, upper)
                    self.acked.append((key, landed, time.monotonic()))
                    rec.op("pushed_writes_acked")
                    ctx.stop.wait(r.uniform(0.01, 0.1))
                ctx.stop.wait(PUSH_IDLE_S)
        finally:
            publisher.close()  # before the server stops
            self.writer_done.set()

    def listen(self) -> None:
        """Listen through a transport that drops pushes; record when each write was read."""
        ctx, rec = self.ctx, self.ctx.rec
        reader, listen, publisher = self.reader, self.listen_from_0, self.publisher
        self.listener.enable()
        frontier = 1
        finish_by: float | None = None
        while True:
            if ctx.stop.is_set():
                if finish_by is None:  # the writer's last write may be acknowledged later
                    self.writer_done.wait(FINISH_TIMEOUT_S)
                    finish_by = time.monotonic() + PUSH_STALE_S + PUSH_IDLE_S
                if len(self.seen) >= len(self.acked) or time.monotonic() > finish_by:
                    break
            try:
                event = listen.next(timeout_s=0.05)
                if event is None:
                    continue
                table = fetch_retrying(reader, event, rec, "pushed_listen_errors")
            except (Determinate, Indeterminate):
                rec.op("pushed_listen_errors")
                continue
            now = time.monotonic()
            if event.lower != frontier:
                rec.violation(
                    f"pushed listen: event [{event.lower}, {event.upper}) does not follow "
                    f"frontier {frontier}"
                )
            frontier = event.upper
            for t, sign, key in event_changes(event.lower, event.upper, table, rec):
                if sign < 0 or key in self.seen:
                    rec.violation(f"pushed listen: write {key} emitted twice or retracted")
                self.seen[key] = (t, now)
        self.dropped = publisher.dropped
        listen.close()
        with contextlib.suppress(PersistError):
            reader.close()
        publisher.close()

    def verify(self) -> None:
        """Every acknowledged write read once, at its time, in order, within the bound."""
        try:
            self._check()
        finally:
            self.close()

    def _check(self) -> None:
        """See :meth:`verify`."""
        rec = self.ctx.rec
        rec.op("pushes_dropped", self.dropped)
        rec.op("pushed_writes_checked", len(self.acked))
        last_time = 0
        for key, landed, acked_at in self.acked:
            got = self.seen.get(key)
            if got is None:
                rec.violation(f"pushed listen: acknowledged write {key} never read")
                continue
            t, seen_at = got
            if landed >= 0 and t != landed:
                rec.violation(f"pushed listen: write {key} committed at {landed}, read at {t}")
            if t < last_time:
                rec.violation(f"pushed listen: write {key} at {t} read after time {last_time}")
            last_time = t
            if seen_at - acked_at > PUSH_STALE_S:
                rec.violation(
                    f"pushed listen: write {key} read {seen_at - acked_at:.2f}s after its "
                    f"commit (bound {PUSH_STALE_S}s): a lost push hid it"
                )
        extra = set(self.seen) - {key for key, _, _ in self.acked}
        if extra:
            rec.op("pushed_unacked_writes_read", len(extra))

    def close(self) -> None:
        """Stop the server; remove the piece's own location."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
            self.directory = None


def append_until_acked(writer: WriteHandle, key: int, token: int, upper: int) -> tuple[int, int]:
    """Append write ``key`` with ``token`` until acknowledged (so exactly once); the time it
    landed at (-1: acknowledged as already committed) and the upper after it."""
    while True:
        try:
            res = writer.compare_and_append(write_updates(key, None), upper, upper + 1, token=token)
        except (Determinate, Indeterminate):
            with contextlib.suppress(Determinate, Indeterminate):
                upper = writer.fetch_upper()
            continue
        if isinstance(res, UpperMismatch):
            upper = res.current
            continue
        return (upper if isinstance(res, Committed) else -1), res.upper


class DroppingPublisher(GrpcPublisher):
    """A gRPC PubSub transport that drops each push it receives with ``PUSH_DROP_P``, as a
    full queue, a restarted server or a writer on another server would."""

    def __init__(self, address: str, consensus_uri: str, seed: int) -> None:
        super().__init__(address, consensus_uri)
        self._rng = random.Random(seed)
        self.dropped = 0

    def _deliver(self, topic: str, seqno: int, pushed_at_us: int = 0) -> None:
        """Deliver the push, or drop it."""
        if self._rng.random() < PUSH_DROP_P:
            self.dropped += 1
            return
        super()._deliver(topic, seqno, pushed_at_us)


class KeyedShard(Piece):
    """Keyed writers racing upserts and deletes of overlapping keys on a keyed shard of its
    own, a snapshot reader of it, and a listen of it (the reference history).

    The writers' clients have the store faults: a lost reply makes an upsert
    ``Indeterminate``; a writer retries with the same token (``AlreadyCommitted``
    when it landed) or abandons the write. Checked (issue 35, "linearizable"):

    - at most one row per key, with multiplicity 1, in every snapshot (at the
      reader's held times) and after every time of the listen;
    - every acknowledged write landed, an unacknowledged one only after an
      unknown outcome, each at its own time;
    - the shard's change at each commit time is exactly the serial
      application of that commit's write to the state the writes before it
      (in commit order, i.e. SeqNo order: each commit's time is past the
      previous upper) left, and each snapshot equals that state at its as_of.
    """

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "keyed")
        self.shard_name = ctx.shard_name + "-keyed"
        self.writes: list[KeyedWrite] = []
        self.snapshots: list[tuple[int, dict[int, int]]] = []
        self.changes: dict[int, collections.Counter[tuple[int, int]]] = collections.defaultdict(
            collections.Counter
        )
        """The listen's updates, summed per time: time -> (key, value) -> diff."""
        self.frontier = 1
        """How far the listen has read: it follows the times after 0 (an upsert's time is the
        clock's, so none lands at 0)."""
        self._lock = threading.Lock()

    def setup(self) -> None:
        """Create the keyed shard and register the listen's reader before any other (its hold
        keeps since at 0 until it listens)."""
        with reliable_client(self.ctx.loc) as setup:
            setup.open_shard(self.shard_name, KEYED_SCHEMA, keys=["k"])
        self.ctx.shards.append(self.shard_name)
        self.listen_client = self.ctx.client("keyed-listener", reader=True)
        self.listen_reader = self.listen_client.client.open_shard(self.shard_name).reader(
            "keyed-listener"
        )
        self.listen = self.listen_reader.listen(0)

    def loops(self) -> dict[str, Callable[[], None]]:
        """The keyed writers, the snapshot reader and the listen."""
        out: dict[str, Callable[[], None]] = {
            f"keyed-writer-{i}": functools.partial(self.write, i) for i in range(KEYED_WRITERS)
        }
        out["keyed-reader"] = self.read
        out["keyed-listener"] = self.follow
        return out

    def write(self, index: int) -> None:
        """Upsert and delete random shared keys until the run stops, retrying with the same
        token or abandoning after an error."""
        ctx, rec = self.ctx, self.ctx.rec
        name = f"keyed-writer-{index}"
        fc = ctx.client(name)
        r = random.Random(ctx.seed_for(name))
        writer = fc.client.open_shard(self.shard_name).writer(name)
        fc.enable()
        base = (KEYED_INDEX + index) * KEY_PER_WRITER
        marker_key = -(index + 1)
        last: KeyedWrite | None = None
        token = 0
        while not ctx.stop.is_set():
            token += 1
            shared = r.sample(range(KEYED_KEYS), r.randint(1, 4))
            if last is not None and last.acked and not last.delete and r.random() < 0.25:
                w = KeyedWrite(index, token, True, dict.fromkeys(shared), last.marker)
                w.rows[marker_key] = None
                data = pa.table({"k": list(w.rows)}, schema=pa.schema([KEYED_SCHEMA.field("k")]))
            else:
                value = (base + token) * ROW_SLOTS
                rows: dict[int, int | None] = {
                    k: None if r.random() < 0.25 else value + j for j, k in enumerate(shared)
                }
                w = KeyedWrite(index, token, False, rows, value + ROW_SLOTS - 1)
                w.rows[marker_key] = w.marker
                data = pa.table(
                    {
                        "k": list(w.rows),
                        "v": [0 if v is None else v for v in w.rows.values()],
                        "del": [v is None for v in w.rows.values()],
                    }
                )
            before = fc.consensus.indeterminate_cas()
            w.acked = self._commit(writer, w, data, r)
            w.indeterminate = fc.consensus.indeterminate_cas() > before
            rec.op("keyed_writes_acked" if w.acked else "keyed_writes_abandoned")
            with self._lock:
                self.writes.append(w)
            last = w
            if r.random() < 0.1:
                time.sleep(r.uniform(0, 0.01))

    def _commit(self, writer: Any, w: KeyedWrite, data: pa.Table, r: random.Random) -> bool:
        """Send ``w`` until acknowledged (True), abandoned after an error or stopped (False)."""
        rec = self.ctx.rec
        finish_by = time.monotonic() + FINISH_TIMEOUT_S / 2
        while not (self.ctx.stop.is_set() and time.monotonic() > finish_by):
            rec.op("keyed_attempts")
            try:
                if w.delete:
                    res = writer.delete(data, token=w.token)
                else:
                    res = writer.upsert(data, token=w.token, delete_column="del")
            except (Determinate, Indeterminate) as e:
                rec.op("keyed_errors_" + type(e).__name__)
                if r.random() < 0.15:
                    return False
                continue
            rec.op("keyed_" + type(res).__name__)
            return True
        return False

    def read(self) -> None:
        """Snapshot the keyed shard at random held times: one row per key, each diff 1."""
        ctx, rec = self.ctx, self.ctx.rec
        fc = ctx.client("keyed-reader", reader=True)
        r = random.Random(ctx.seed_for("keyed-reader"))
        reader = fc.client.open_shard(self.shard_name).reader("keyed-reader")
        fc.enable()
        while not ctx.stop.is_set():
            try:
                latest = reader.latest_as_of()
                as_of = recent_as_of(reader, latest, r, rec) if latest >= 0 else None
                if as_of is None:
                    time.sleep(0.005)
                    continue
                table = reader.snapshot_table(as_of)
            except PartNotFound as e:
                rec.violation(f"keyed-reader: leased snapshot failed: {e}")
                continue
            except (Determinate, Indeterminate, InvalidFrontier) as e:
                # InvalidFrontier: no write landed yet, or a lost downgrade reply landed.
                rec.op("keyed_snapshot_errors_" + type(e).__name__)
                time.sleep(0.005)
                continue
            rows: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
            for k, v, d in zip(
                *(table.column(c).to_pylist() for c in ("k", "v", DIFF)), strict=True
            ):
                rows[k].append((v, d))
            for k, kept in rows.items():
                if len(kept) > 1 or kept[0][1] != 1:
                    rec.violation(
                        f"keyed-reader: snapshot as_of {as_of} holds key {k} as (value, diff) "
                        f"{kept}: one row with diff 1 expected"
                    )
            seen = {k: kept[-1][0] for k, kept in rows.items()}
            with self._lock:
                self.snapshots.append((as_of, seen))
            rec.op("keyed_snapshots")
            time.sleep(r.uniform(0, 0.01))
        with contextlib.suppress(PersistError):
            reader.close()

    def follow(self) -> None:
        """Listen until the run stops (verify reads on to the final upper)."""
        self.listen_client.enable()
        r = random.Random(self.ctx.seed_for("keyed-listener"))
        while not self.ctx.stop.is_set():
            if self._next(0.1) and r.random() < 0.3 and self.frontier > 1:
                with contextlib.suppress(Determinate, Indeterminate):
                    self.listen_reader.downgrade_since(self.frontier - 1)

    def _next(self, timeout_s: float) -> bool:
        """Take in the listen's next event (False: none, or a store error before it came).

        Once ``next`` handed out an event the listen is past it, so a failed fetch of its
        parts is retried: dropping the event would lose its updates and read as a listen
        that skipped times."""
        rec = self.ctx.rec
        try:
            event = self.listen.next(timeout_s=timeout_s)
            if event is None:
                return False
            table = fetch_retrying(self.listen_reader, event, rec, "keyed_listen_errors")
        except PartNotFound as e:
            rec.violation(f"keyed-listener: leased listen failed: {e}")
            return False
        except (Determinate, Indeterminate):
            rec.op("keyed_listen_errors")
            return False
        if event.lower != self.frontier:
            rec.violation(
                f"keyed-listener: event [{event.lower}, {event.upper}) after {self.frontier}"
            )
        for k, v, t, d in zip(
            *(table.column(c).to_pylist() for c in ("k", "v", TIME, DIFF)), strict=True
        ):
            if not event.lower <= t < event.upper:
                rec.violation(
                    f"keyed-listener: update at {t} outside [{event.lower}, {event.upper})"
                )
            self.changes[t][(k, v)] += d
        self.frontier = event.upper
        rec.op("keyed_listen_events")
        return True

    def verify(self) -> None:
        """Read the listen to the final upper, then check the writes against it."""
        with reliable_client(self.ctx.loc) as check:
            final_upper = check.open_shard(self.shard_name).state().upper
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while self.frontier < final_upper and time.monotonic() < deadline:
            self._next(0.5)
        if self.frontier < final_upper:
            self.ctx.rec.violation(
                f"keyed-listener: stuck at {self.frontier}, final upper {final_upper}"
            )
            return
        self.listen.close()
        with contextlib.suppress(PersistError):
            self.listen_reader.close()
        check_keyed(self.writes, self.changes, self.snapshots, self.ctx.rec)


def check_keyed(
    writes: Sequence[KeyedWrite],
    changes: dict[int, collections.Counter[tuple[int, int]]],
    snapshots: Sequence[tuple[int, dict[int, int]]],
    rec: Recorder,
) -> None:
    """The keyed writes against the listen's updates (``changes``: time -> (key, value) ->
    diff) and the snapshots; see :class:`KeyedShard`."""
    net = {t: {kv: d for kv, d in c.items() if d} for t, c in changes.items()}
    net = {t: c for t, c in net.items() if c}
    inserted: dict[int, list[int]] = collections.defaultdict(list)
    removed: dict[int, int] = {}
    for t, c in net.items():
        for (k, v), d in c.items():
            if k < 0 and d > 0:
                inserted[v].append(t)
            elif k < 0 and d < 0:
                removed[v] = t
    by_time: dict[int, KeyedWrite] = {}
    for w in writes:
        rec.op("keyed_writes_checked")
        at: int | None
        if not w.delete:
            times = inserted.get(w.marker, [])
            if len(times) > 1:
                rec.violation(f"keyed: write {w} landed at several times {times}")
            at = times[0] if times else None
        else:
            at = removed.get(w.marker)
            own = -(w.writer + 1)
            if at is not None and any(k == own and d > 0 for (k, _), d in net[at].items()):
                at = None  # the writer's next upsert replaced the marker: the delete did not land
        if at is None:
            if w.acked:
                rec.violation(f"keyed: acknowledged write is lost: {w}")
            continue
        if not w.acked and not w.indeterminate:
            rec.violation(f"keyed: write failed determinately yet landed at {at}: {w}")
        if not w.acked:
            rec.op("keyed_unacked_writes_that_landed")
        if at in by_time:
            rec.violation(f"keyed: writes {by_time[at]} and {w} both landed at time {at}")
        by_time[at] = w
    for t in sorted(set(net) - set(by_time))[:MAX_DETAILS]:
        rec.violation(f"keyed: the shard changed at time {t} ({net[t]}) where no write landed")
    # The serial model, in commit order, against the shard's change at each commit time; and
    # the shard's collection after every time: one row per key, each with multiplicity 1.
    live: collections.Counter[tuple[int, int]] = collections.Counter()
    model: dict[int, int] = {}
    states: list[tuple[int, dict[int, int]]] = [(-1, {})]
    for t in sorted(set(net) | set(by_time)):
        got = net.get(t, {})
        for kv, d in got.items():
            live[kv] += d
            if live[kv] not in (0, 1):
                rec.violation(f"keyed: row {kv} has multiplicity {live[kv]} at time {t}")
            if not live[kv]:
                del live[kv]
        per_key = collections.Counter(key for key, _ in live)
        for key in {key for key, _ in got}:
            if per_key[key] > 1:
                rows = sorted(kv for kv in live if kv[0] == key)
                rec.violation(f"keyed: two live rows of key {key} at time {t}: {rows}")
        write = by_time.get(t)
        if write is None:
            continue
        want: collections.Counter[tuple[int, int]] = collections.Counter()
        for key, value in write.rows.items():
            cur = model.get(key)
            if cur == value:
                continue
            if cur is not None:
                want[(key, cur)] -= 1
                del model[key]
            if value is not None:
                want[(key, value)] += 1
                model[key] = value
        if dict(want) != got:
            rec.violation(
                f"keyed: at time {t} the shard changed by {sorted(got.items())}, the serial "
                f"application of write {write} gives {sorted(want.items())}"
            )
        states.append((t, model))
        rec.op("keyed_commits_checked")
        # Go on from what the shard holds, so one wrong commit is reported once.
        model = dict(live.keys())  # (key, value) pairs: one per key, else reported above
    times = [t for t, _ in states]
    for as_of, seen in snapshots:
        want_state = states[bisect.bisect_right(times, as_of) - 1][1]
        rec.op("keyed_snapshots_checked")
        if seen != want_state:
            rec.violation(
                f"keyed: snapshot as_of {as_of} holds {sorted(seen.items())}, the serial "
                f"application of the writes up to it gives {sorted(want_state.items())}"
            )


CONSUMER_NAME = "c"
"""The one named consumer of the ``consumers`` piece's shard."""


class Consumers(Piece):
    """A named consumer (``state/consumers.py``) of a shard of its own, taken back and forth by
    two holders, each advancing it (with the next micro-batch's plan) a few times before the
    other acquires it and fences it, and reset (forced) now and then, while a writer moves
    the upper and the clients' maintenance moves since by the shard's retention. Store faults
    on every client; holder ``b``'s lost replies reach it as Indeterminate, and it retries
    the same advance until the answer is known, as the Spark source's commit does.

    Checked: the position never moves back except by a reset (a watcher reads the consumer
    over and over); a holder never advances once another holder's acquire (or a reset) was
    acknowledged before its advance began; since never passes an unexpired consumer's
    hold; an acknowledged advance (after Indeterminate too) is what the consumer holds
    until its holder moves it again or is fenced: position and plan, nothing lost.
    """

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "consumers")
        self.shard_name = f"{ctx.shard_name}-consumers"
        self._lock = threading.Lock()
        self.fences: list[tuple[int, float]] = []
        """(epoch, monotonic time acknowledged) of every acquire and reset."""
        self.resets: list[tuple[float, int]] = []
        """(monotonic time attempted, upper) of every reset attempted."""

    def setup(self) -> None:
        """The shard, with retention (since follows the consumer's hold) and [0, 1)."""
        with reliable_client(self.ctx.loc) as setup:
            shard = setup.open_shard(self.shard_name, SCHEMA, retention_ms=RETENTION_MS)
            shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)
        self.ctx.shards.append(self.shard_name)

    def loops(self) -> dict[str, Callable[[], None]]:
        """The writer, the two holders, the resetter and the watcher."""
        return {
            "consumers-writer": self.write,
            "consumers-a": functools.partial(self.hold, "a", lost_replies=False),
            "consumers-b": functools.partial(self.hold, "b", lost_replies=True),
            "consumers-reset": self.reset,
            "consumers-watch": self.watch,
        }

    def write(self) -> None:
        """Move the upper: one write at a time, each acknowledged once."""
        ctx = self.ctx
        fc = ctx.client("consumers-writer")
        writer = fc.client.open_shard(self.shard_name).writer("consumers-writer")
        fc.enable()
        upper, number = 1, 0
        while not ctx.stop.is_set():
            number += 1
            _, upper = append_until_acked(
                writer, CONSUMER_INDEX * KEY_PER_WRITER + number, number, upper
            )
            ctx.rec.op("consumers_writes")
            ctx.stop.wait(random.uniform(0.005, 0.03))

    def _fenced_before(self, epoch: int, started: float) -> int | None:
        """A newer epoch acknowledged before ``started`` (None: none): whoever advances at
        ``epoch`` from then on is fenced."""
        with self._lock:
            newer = [e for e, at in self.fences if e > epoch and at < started]
        return max(newer) if newer else None

    def hold(self, name: str, *, lost_replies: bool) -> None:
        """Acquire the consumer, advance it a few times, pause; again until the run stops."""
        ctx, rec = self.ctx, self.ctx.rec
        rng = random.Random(ctx.seed_for(f"consumers-{name}"))
        config = (lambda c: dataclasses.replace(c, retry_timeout_s=1e-9)) if lost_replies else None
        fc = ctx.client(f"consumers-{name}", config=config)
        shard = fc.client.open_shard(self.shard_name)
        holder = f"holder {name}"
        fc.enable()
        with reliable_client(ctx.loc) as check_client:
            check = check_client.open_shard(self.shard_name)
            while not ctx.stop.is_set():
                try:
                    acquired = shard.acquire_consumer(CONSUMER_NAME, holder)
                except (Determinate, Indeterminate):
                    rec.op("consumers_acquire_errors")
                    continue
                with self._lock:
                    self.fences.append((acquired.epoch, time.monotonic()))
                rec.op("consumers_acquired")
                for _ in range(rng.randint(1, 8)):
                    if ctx.stop.is_set() or not self._advance(
                        shard, check, holder, acquired.epoch, rng
                    ):
                        break
                    ctx.stop.wait(rng.uniform(0.0, 0.02))
                ctx.stop.wait(rng.uniform(0.0, 0.1))

    def _advance(
        self, shard: Shard, check: Shard, holder: str, epoch: int, rng: random.Random
    ) -> bool:
        """One advance at ``epoch`` to a time up to the upper, planning the next; False once
        fenced. Checks the advance was allowed and that it stuck."""
        rec = self.ctx.rec
        started = time.monotonic()
        # Mostly the state this client last saw, as a source's commit does: a holder fenced
        # since then learns it only from the advance's refusal.
        try:
            state = shard.machine.fetch_latest() if rng.random() < 0.3 else shard.machine.state()
        except (Determinate, Indeterminate):
            return True
        current = state.consumers.get(CONSUMER_NAME)
        if current is None or current.epoch != epoch:
            rec.op("consumers_fenced_seen")
            return False
        upper = rng.randint(current.upper, max(current.upper, state.upper))
        position = json.dumps({"upper": upper, "by": holder, "epoch": epoch})
        plan = (position, json.dumps({"upper": state.upper, "by": holder, "epoch": epoch}))
        uncertain = False
        give_up = time.monotonic() + FINISH_TIMEOUT_S
        while True:
            if time.monotonic() > give_up:
                return False
            try:
                shard.advance_consumer(
                    CONSUMER_NAME,
                    epoch,
                    position=position,
                    upper=upper,
                    since=max(upper - 1, 0),
                    holder=holder,
                    plan=plan,
                )
                break
            except Indeterminate:
                uncertain = True
                rec.op("consumers_advance_indeterminate")
            except Determinate:
                rec.op("consumers_advance_errors")
            except ConsumerFenced:
                rec.op("consumers_fenced")
                return False
        rec.op("consumers_advances")
        # An advance to the position the client's cached state already shows is answered
        # from that state without a compare-and-set (it moves nothing, fenced or not).
        newer = self._fenced_before(epoch, started) if position != current.position else None
        if newer is not None:
            rec.violation(
                f"consumers: {holder} advanced consumer {CONSUMER_NAME!r} at epoch {epoch}, "
                f"though epoch {newer} was acknowledged before the advance began (a fenced "
                "holder advanced)"
            )
        now = check.machine.fetch_latest().consumers.get(CONSUMER_NAME)
        if now is not None and now.epoch == epoch:
            # (A plan with the same start already there is kept as it was: Spark replays it.)
            if now.position != position or all(start != position for start, _ in now.planned):
                after = " after Indeterminate" if uncertain else ""
                rec.violation(
                    f"consumers: {holder}'s acknowledged advance{after} to {position} (planning "
                    f"{plan[1]}) is not what the consumer holds at the same epoch: position "
                    f"{now.position}, planned {now.planned}"
                )
        return True

    def reset(self) -> None:
        """Now and then, a forced reset to a time from since + 1 up to the upper."""
        ctx, rec = self.ctx, self.ctx.rec
        rng = random.Random(ctx.seed_for("consumers-reset"))
        fc = ctx.client("consumers-reset")
        shard = fc.client.open_shard(self.shard_name)
        fc.enable()
        while not ctx.stop.wait(rng.uniform(0.1, 0.4)):
            try:
                state = shard.machine.fetch_latest()
            except (Determinate, Indeterminate):
                continue
            if CONSUMER_NAME not in state.consumers or state.upper <= state.since + 1:
                continue
            upper = rng.randint(state.since + 1, state.upper)
            with self._lock:
                self.resets.append((time.monotonic(), upper))
            position = json.dumps({"upper": upper, "reset": True})
            try:
                done = shard.reset_consumer(
                    CONSUMER_NAME, position=position, upper=upper, since=upper - 1, force=True
                )
            except InvalidFrontier:
                rec.op("consumers_resets_past_since")  # since moved on meanwhile
                continue
            except (Determinate, Indeterminate):
                rec.op("consumers_reset_errors")
                continue
            with self._lock:
                self.fences.append((done.epoch, time.monotonic()))
            rec.op("consumers_resets")

    def watch(self) -> None:
        """Read the consumer over and over: it never moves back but by a reset, and since never
        passes its hold."""
        ctx = self.ctx
        with reliable_client(ctx.loc) as client:
            shard = client.open_shard(self.shard_name)
            previous: ConsumerState | None = None
            while not ctx.stop.wait(0.005):
                began = time.monotonic()
                state = shard.machine.fetch_latest()
                current = state.consumers.get(CONSUMER_NAME)
                if current is None:
                    continue
                self._check_since(state, current)
                if previous is not None and current.upper < previous.upper:
                    with self._lock:
                        reset = any(at < began and u <= current.upper for at, u in self.resets)
                    if not reset:
                        ctx.rec.violation(
                            f"consumers: consumer {CONSUMER_NAME!r} moved back from upper "
                            f"{previous.upper} (epoch {previous.epoch}) to {current.upper} "
                            f"(epoch {current.epoch}) with no reset to there"
                        )
                ctx.rec.op("consumers_watched")
                previous = current

    def _check_since(self, state: ShardState, consumer: ConsumerState) -> None:
        if not consumer.expired and state.since > consumer.since:
            self.ctx.rec.violation(
                f"consumers: the shard's since {state.since} passed consumer "
                f"{CONSUMER_NAME!r}'s hold {consumer.since} (SeqNo {state.seqno})"
            )

    def verify(self) -> None:
        """The final state keeps the consumer's hold."""
        with reliable_client(self.ctx.loc) as client:
            state = client.open_shard(self.shard_name).machine.fetch_latest()
        consumer = state.consumers.get(CONSUMER_NAME)
        if consumer is not None:
            self._check_since(state, consumer)


def txn_shards(ctx: Context) -> Piece:
    """The ``txns`` piece (:class:`~.checker_txns.TxnShards`). Its module builds on this one,
    so it is imported here, when the piece is built, not when this module loads."""
    from pyspark_persist.tools.checker_txns import TxnShards

    return TxnShards(ctx)


FAULTS: dict[str, Callable[[Context], Piece]] = {
    "maintenance": Maintainer,
    "slow-writer": SlowWriter,
    "replace": Replacer,
    "drop": DropRecreate,
    "resend": Resender,
    "abort": SinkAborter,
    "short-grace": ShortGrace,
    "pushes": PushedListen,
    "keyed": KeyedShard,
    "consumers": Consumers,
    "txns": txn_shards,
}
"""The fault menu: each entry builds one named piece of the run (``--faults`` picks)."""


# --- the run ------------------------------------------------------------------------------------


def guarded(rec: Recorder, name: str, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` with a crash turned into a violation naming ``name`` (a crashed loop fails the
    run)."""

    def body() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - a crashed worker is a failed run
            rec.op("worker_crashes")
            rec.violation(f"{name} crashed: {type(e).__name__}: {e}")

    return body


def run(
    seed: int | None = None,
    duration_s: float = 10.0,
    writers: int = 4,
    processes: int = 0,
    backend: str = "mem",
    *,
    readers: int = 2,
    sabotage: str | None = None,
    root: str | None = None,
    location: Location | None = None,
    target_ops: int | None = None,
    faults: Sequence[str] | None = None,
    progress_s: float | None = None,
    stop_at_violation: bool = False,
) -> Report:
    """Run the workload for ``duration_s`` and verify its history; see the module doc.

    ``location`` runs it there instead of a fresh ``backend`` location.
    ``target_ops`` ends the workload early once about that many operations
    (acknowledged or abandoned writes, snapshots, listen events, replaces)
    are done; ``duration_s`` stays the cap. ``faults`` names the fault
    pieces to run (default: all of :data:`FAULTS`). ``progress_s`` prints
    the operations done and their rate on stderr that often.
    ``stop_at_violation`` ends the workload at the first violation seen while
    it runs (the verification still runs): a hunt for a bug, or a sabotage
    run, need not wait out the budget once it has shown.
    """
    if seed is None:
        seed = random.SystemRandom().randrange(1 << 31)
    if sabotage is not None and sabotage not in SABOTAGE:
        raise ValueError(f"unknown sabotage {sabotage!r}: use one of {', '.join(SABOTAGE)}")
    fault_names = list(FAULTS) if faults is None else list(faults)
    unknown = [f for f in fault_names if f not in FAULTS]
    if unknown:
        raise ValueError(f"unknown fault kinds {unknown}: use some of {', '.join(FAULTS)}")
    if processes and backend == "mem" and location is None:
        raise ValueError(
            "writer processes need a shared location: use file-sqlite or file-postgres, not mem"
        )
    where = backend if location is None else f"{location.blob_uri} + {location.consensus_uri}"
    report = Report(seed=seed, backend=where, sabotage=sabotage)
    rec = Recorder(report)
    loc = location or make_location(backend, root)
    ctx = Context(
        loc,
        f"check-{seed}-{uuid.uuid4().hex[:8]}",
        seed,
        rec,
        History(rec),
        duration_s=duration_s,
        sabotage_name=sabotage,
    )
    ctx.shards.append(ctx.shard_name)
    started = time.monotonic()
    try:
        with ctx.sabotage.patch() if ctx.sabotage else contextlib.nullcontext():
            pieces: list[Piece] = [WriterPiece(ctx, i) for i in range(writers)]
            pieces += [ProcessWriter(ctx, writers + i) for i in range(processes)]
            pieces += [SnapshotReader(ctx, i) for i in range(readers)]
            pieces += [FAULTS[name](ctx) for name in fault_names]
            _run(ctx, pieces, duration_s, target_ops, progress_s, stop_at_violation)
    finally:
        for fc in ctx.clients:
            report.faults.update(fc.faults())
            fc.close()
        if loc.cleanup:
            shutil.rmtree(loc.cleanup, ignore_errors=True)
    report.duration_s = time.monotonic() - started
    return report


def _run(
    ctx: Context,
    pieces: Sequence[Piece],
    duration_s: float,
    target_ops: int | None,
    progress_s: float | None,
    stop_at_violation: bool,
) -> None:
    """Set up, run the pieces and the listener until the budget is spent, then verify."""
    # Setup, reliable: the shard with its retention, and an empty batch [0, 1) so a listen
    # from 0 sees every write.
    with reliable_client(ctx.loc) as setup:
        shard = setup.open_shard(ctx.shard_name, SCHEMA, retention_ms=RETENTION_MS)
        shard.writer("setup").compare_and_append(SCHEMA.empty_table(), 0, 1, token=1)
    listener = Listener(ctx)
    for piece in pieces:
        piece.setup()
    threads = [
        threading.Thread(target=guarded(ctx.rec, name, body), name=f"check-{name}")
        for piece in pieces
        for name, body in piece.loops().items()
    ]
    listener.thread.start()
    for t in threads:
        t.start()
    _wait(ctx, duration_s, target_ops, progress_s, stop_at_violation)
    ctx.stop.set()
    deadline = time.monotonic() + FINISH_TIMEOUT_S + 70
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            ctx.rec.violation(f"{t.name} did not finish")

    # Verification, faults off. The clients' background maintenance keeps compacting and
    # collecting, so the final state is read under a lease, like any other read.
    for fc in ctx.clients:
        fc.enable(False)
    for fc in ctx.clients:
        fc.client.maintenance.wait_idle(10)
    _verify_shard(ctx, listener)
    _verify_writes(ctx, listener.done.is_set())
    for piece in pieces:
        guarded(ctx.rec, f"{piece.name} verification", piece.verify)()


def _wait(
    ctx: Context,
    duration_s: float,
    target_ops: int | None,
    progress_s: float | None,
    stop_at_violation: bool,
) -> None:
    """Wait out the workload: ``duration_s``, or until ``target_ops`` operations are done, or
    (``stop_at_violation``) until a violation shows; every ``progress_s`` print how many and
    how fast."""
    report = ctx.rec.report
    started = time.monotonic()
    ends = started + duration_s
    shown_at, shown_ops = started, 0
    tick = 0.05 if stop_at_violation else 1.0
    while not ctx.stop.wait(max(0.0, min(tick, ends - time.monotonic()))):
        now, done = time.monotonic(), report.live_ops()
        if progress_s and now - shown_at >= progress_s:
            print(
                f"[check] {now - started:.0f}s: {done} operations, "
                f"{(done - shown_ops) / (now - shown_at):.1f}/s in the last {now - shown_at:.0f}s,"
                f" upper {ctx.history.frontier}, {report.violation_count} violations",
                file=sys.stderr,
                flush=True,
            )
            shown_at, shown_ops = now, done
        if now >= ends or (target_ops is not None and done >= target_ops):
            return
        if stop_at_violation and report.violation_count:
            return


def _verify_shard(ctx: Context, listener: Listener) -> None:
    """The final state and snapshot, read reliably, against the history (once the listen has
    read up to the final upper)."""
    rec, history = ctx.rec, ctx.history
    with reliable_client(ctx.loc) as check:
        shard = check.open_shard(ctx.shard_name)
        final_reader = shard.reader("final-check")
        state = shard.state()
        rec.report.final_upper = state.upper
        listener.finish(state.upper)
        try:
            state.check_invariants()
        except CorruptData as e:
            rec.violation(f"final state breaks an invariant: {e}")
        for b in state.batches.values():
            for part in b.parts:
                if part.key is not None and check.blob.get(part.key) is None:
                    rec.violation(f"final state references part {part.key}, missing from Blob")
        try:
            final = final_reader.snapshot_table(state.upper - 1)
            final_keys = snapshot_keys(final, "final", state.upper - 1, rec)
        except PersistError as e:
            rec.violation(f"final snapshot failed: {type(e).__name__}: {e}")
            final_keys = frozenset()
        final_reader.close()
    left = history.flush()
    if left:
        rec.op("snapshots_unchecked", left)
    if listener.done.is_set() and history.live != final_keys:
        rec.violation(
            f"listen output differs from the final snapshot: only listened "
            f"{sorted(history.live - final_keys)[:10]}, only in snapshot "
            f"{sorted(final_keys - history.live)[:10]}"
        )


def _verify_writes(ctx: Context, listen_done: bool) -> None:
    """Every write against the history: acknowledged ones landed once, at a time they were
    attempted at, with their retraction; others only after an unknown outcome; and nothing
    landed or was retracted that no writer asked for.

    A write the listen has not passed every attempt of (it stopped early: a violation of
    its own) is left unchecked.
    """
    rec, history = ctx.rec, ctx.history
    time_of, retracted_at = history.time_of, history.retracted_at
    attempted: set[int] = set()
    by_time: dict[int, WriteRecord] = {}
    for w in ctx.records:
        attempted.add(w.key)
        landed = time_of.get(w.key)
        if landed is not None:
            by_time[landed] = w
        if not listen_done and w.candidates and max(w.candidates) >= history.frontier:
            rec.op("writes_unchecked")
            continue
        rec.op("writes_checked")
        if w.acked and landed is None:
            rec.violation(f"acknowledged write {w.key} is lost ({w})")
        elif not w.acked and landed is not None and not w.indeterminate:
            rec.violation(f"write {w.key} failed determinately yet appears ({w})")
        elif not w.acked and landed is not None:
            rec.op("unacked_writes_that_landed")
        if landed is None:
            continue
        if landed not in w.candidates:
            rec.violation(f"write {w.key} landed at time {landed}, never attempted there ({w})")
        elif w.landed_at is not None and landed != w.landed_at:
            rec.violation(f"write {w.key} committed at {w.landed_at} but is at time {landed}")
        if w.retracts is not None and retracted_at.get(w.retracts) != landed:
            rec.violation(
                f"write {w.key} landed at time {landed} but its retraction of write "
                f"{w.retracts} is at {retracted_at.get(w.retracts)}"
            )
    for key in sorted(set(time_of) - attempted)[:MAX_DETAILS]:
        rec.violation(f"write {key} appears but no writer attempted it")
    for key, t in sorted(retracted_at.items()):
        by = by_time.get(t)
        if by is not None and by.retracts != key:
            rec.violation(f"write {key} retracted at time {t}, where write {by.key} landed")
        elif by is None and key in attempted:
            rec.violation(f"write {key} retracted at time {t}, where no write landed")


DESCRIPTION = (
    "Check that persist never loses or duplicates a committed update: for --seconds, writers "
    "(threads, and --processes) that also retract their older writes, snapshot readers, a "
    "listener and the --faults pieces (compaction and GC, a slow writer, replaces, drops under "
    "load, resends after Indeterminate, aborts with a commit in flight, a short grace under "
    "outages, lost PubSub pushes) run at once against Blob and Consensus wrappers that inject "
    "faults (lost replies, refused calls, timeouts, slowness); then every acknowledged write "
    "must appear exactly once, every snapshot must equal the reference history at its time, "
    "uppers must only advance and no leased read may hit a deleted part; on a keyed shard, "
    "racing upserts and deletes must leave one row per key and the serial application of "
    "the writes in commit order; transactions over several shards must show whole or not at "
    "all in every cut. The location is a "
    "fresh --backend one, or the one --blob and --consensus name (the check's shard, "
    "check-SEED-..., is left there). Exit status 1 on any violation; --seed replays a run."
)
BACKEND_NAMES = {"mem-mem": "mem", **{b: b for b in BACKENDS}}
"""What ``--backend`` accepts: every backend, and ``mem-mem`` (Blob-Consensus, as the
benchmarks name locations) for ``mem``."""


def fault_list(text: str) -> list[str]:
    """``--faults``: comma-separated names from :data:`FAULTS`, or ``none``."""
    if text.strip().lower() == "none":
        return []
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown fault kinds {', '.join(unknown)}: use some of {', '.join(FAULTS)} "
            "(comma-separated), or none"
        )
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``persist check`` to ``parser``."""
    parser.description = DESCRIPTION
    parser.add_argument("--seed", type=int, default=None, help="replay this seed")
    parser.add_argument("--seconds", type=float, default=30.0, help="workload duration")
    parser.add_argument(
        "--ops",
        type=int,
        default=None,
        help="end the workload once about this many operations are done (--seconds stays the cap)",
    )
    parser.add_argument("--writers", type=int, default=4, help="writer threads")
    parser.add_argument("--processes", type=int, default=0, help="writer processes (spawned)")
    parser.add_argument("--readers", type=int, default=2, help="snapshot reader threads")
    parser.add_argument(
        "--faults",
        type=fault_list,
        default=None,
        metavar="KIND,...",
        help=f"the fault kinds to run (default all: {','.join(FAULTS)}; or none)",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(BACKEND_NAMES),
        default=None,
        help="a fresh location of this kind (default mem; mem-mem is the same)",
    )
    parser.add_argument("--blob", metavar="URI", default=None, help="run on this Blob instead")
    parser.add_argument(
        "--consensus", metavar="URI", default=None, help="run on this Consensus instead"
    )
    parser.add_argument(
        "--sabotage",
        choices=list(SABOTAGE),
        default=None,
        help="inject a deliberate bug (to see the checker catch it)",
    )
    parser.add_argument(
        "--stop-at-violation",
        action="store_true",
        help="end the workload at the first violation it shows (verification still runs)",
    )
    parser.add_argument(
        "--progress",
        type=float,
        default=None,
        metavar="SECONDS",
        help="print the operations done and their rate on stderr this often",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--log-level",
        default="ERROR",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        type=str.upper,
        help="persist's own logging, as key=value lines on stderr (it logs every retried "
        "fault at INFO)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the checker, print the report, exit 1 on any violation."""
    parser = argparse.ArgumentParser(prog="python -m pyspark_persist.tools.checker")
    add_arguments(parser)
    return run_from_args(parser.parse_args(argv))


def given_location(ns: argparse.Namespace) -> Location | None:
    """The location ``--blob`` and ``--consensus`` name (both or neither), checked by the
    registry every entry point uses; None for a fresh ``--backend`` location."""
    if ns.blob is None and ns.consensus is None:
        return None
    if ns.blob is None or ns.consensus is None or ns.backend is not None:
        raise InvalidUsage(
            "persist check: give --blob and --consensus together (a location of yours), or "
            "--backend alone (a fresh one)"
        )
    if ns.processes and "mem" in (blob_kind(ns.blob), consensus_kind(ns.consensus)):
        raise InvalidUsage(
            "writer processes need a shared location: --blob and --consensus must not be mem://"
        )
    return Location(ns.blob, ns.consensus)


def run_from_args(ns: argparse.Namespace) -> int:
    """Run the checker with parsed flags; exit status 1 on any violation."""
    location = given_location(ns)
    configure_logs(ns.log_level)  # persist's records only, as key=value lines (state/logs.py)
    report = run(
        ns.seed,
        ns.seconds,
        ns.writers,
        ns.processes,
        BACKEND_NAMES[ns.backend or "mem"],
        readers=ns.readers,
        sabotage=ns.sabotage,
        location=location,
        target_ops=ns.ops,
        faults=ns.faults,
        progress_s=ns.progress,
        stop_at_violation=ns.stop_at_violation,
    )
    if ns.json:
        import json

        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.render())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
