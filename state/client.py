"""The entry point: a client for one (Blob, Consensus) location and the shards in it."""

from __future__ import annotations

import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import replace as dc_replace

import pyarrow as pa

from . import commands, retry
from .blob import Blob, open_blob
from .cache import PROCESS_CACHE, StateCache
from .commands import CriticalSince, create_shard
from .config import PersistConfig
from .consensus import CaSCommitted, Consensus, VersionedData, open_consensus
from .consumer_client import ConsumerMethods
from .diff import TOMBSTONE, encode
from .errors import (
    Indeterminate,
    InvalidUsage,
    SchemaMismatch,
    ShardDropped,
    ShardExists,
    ShardNotFound,
)
from .history import Commit, Replay, history, replay
from .keyed import check_keys_match, validate_keys
from .machine import DiffPublisher, Machine, Metrics, NoopPublisher, RunInfo
from .maintenance import CompactionReport, GcReport, Maintenance
from .read import ReadHandle
from .retention import parse_retention, set_retention
from .schema import decode_schema, encode_schema, schema_mismatch_message, validate_schema
from .state import ShardState, Time
from .tracing import traced
from .txn_commit import Txn
from .write import WriteHandle

HOME_ENV = "PERSIST_HOME"
"""Environment variable naming the directory of the embedded default location."""

_SHARD_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,199}$")


def default_home() -> str:
    """The directory of the embedded default: ``$PERSIST_HOME`` or ``~/.pyspark-persist``."""
    return os.path.abspath(
        os.environ.get(HOME_ENV) or os.path.join(os.path.expanduser("~"), ".pyspark-persist")
    )


def default_blob_uri() -> str:
    """The embedded default Blob: files under :func:`default_home`."""
    return f"file://{default_home()}/blob"


def default_consensus_uri() -> str:
    """The embedded default Consensus: a SQLite database under :func:`default_home`."""
    return f"sqlite:///{default_home()}/consensus.db"


def validate_shard_name(name: str) -> str:
    """A shard name is its Blob prefix and Consensus key, so it may not contain '/' or '..'."""
    if not isinstance(name, str) or not _SHARD_RE.match(name) or ".." in name:
        raise InvalidUsage(
            f"invalid shard name {name!r}: use 1-200 letters, digits, '_', '-' or '.', "
            "starting with a letter or digit (no '/' and no '..')"
        )
    return name


class PersistClient:
    """Opens shards stored in one Blob and one Consensus. Thread-safe.

    Example::

        client = PersistClient.open()                       # the embedded default
        shard = client.open_shard("events", pa.schema([("id", pa.int64())]))
        shard.writer().append(pa.table({"id": [1, 2, 3]}))
        print(shard.reader().snapshot_table())
    """

    def __init__(
        self,
        blob: Blob,
        consensus: Consensus,
        *,
        config: PersistConfig | None = None,
        publisher: DiffPublisher | None = None,
        cache: StateCache | None = None,
        clock_ms: Callable[[], int] | None = None,
    ) -> None:
        self.blob = blob
        self.consensus = consensus
        self.config = config or PersistConfig()
        self.publisher: DiffPublisher = publisher or NoopPublisher()
        self.metrics = Metrics()
        self._cache = cache or PROCESS_CACHE
        self._clock_ms = clock_ms or (lambda: time.time_ns() // 1_000_000)
        self._machines: dict[str, Machine] = {}
        self._lock = threading.Lock()
        self.maintenance = Maintenance(self.config)
        # Private in-memory stores all share the URI "mem://"; key their cache by object.
        uri = consensus.uri
        self._location = f"{uri}@{id(consensus)}" if uri.rstrip("/") == "mem:" else uri

    @classmethod
    def open(
        cls,
        blob: str | None = None,
        consensus: str | None = None,
        *,
        config: PersistConfig | None = None,
        publisher: DiffPublisher | None = None,
    ) -> PersistClient:
        """Open a client from two URIs; either defaults to the embedded default location."""
        return cls(
            open_blob(blob or default_blob_uri()),
            open_consensus(consensus or default_consensus_uri()),
            config=config,
            publisher=publisher,
        )

    def machine(self, shard_id: str) -> Machine:
        """The (one per client) machine applying commands to ``shard_id``: the one serving the
        incarnation this client last opened (see :meth:`open_shard`)."""
        validate_shard_name(shard_id)
        with self._lock:
            m = self._machines.get(shard_id)
            if m is None:
                m = self._machines[shard_id] = self._new_machine(shard_id)
                m.shared.confirm_pushes_with(m.refresh)
                self.publisher.subscribe(shard_id, m.shared, self.consensus.uri)
            return m

    def _new_machine(self, shard_id: str) -> Machine:
        """A machine of ``shard_id`` bound to no incarnation yet."""
        m = Machine(
            shard_id,
            self.blob,
            self.consensus,
            self._cache.get(self._location, shard_id),
            self.config,
            self.metrics,
            self.publisher,
            self._clock_ms,
            self.maintenance.after_commit,
        )
        m.after_run = self.maintenance.backpressure
        return m

    def _replace_machine(self, dropped: Machine) -> Machine:
        """A fresh machine of ``dropped``'s shard in its place: the handles of the dropped
        incarnation keep the old one (and its ShardDropped); new ones get this."""
        with self._lock:
            m = self._machines.get(dropped.shard_id)
            if m is dropped or m is None:
                m = self._machines[dropped.shard_id] = self._new_machine(dropped.shard_id)
            return m

    def _fetch(self, name: str) -> tuple[Machine, ShardState]:
        """The machine of shard ``name`` and its newest state; ShardNotFound if there is none
        (then :meth:`machine` is the one to create it with).

        A machine whose incarnation was dropped is replaced first, so opening a
        shard after a drop finds the shard of that name now, or none.
        """
        machine = self.machine(name)
        try:
            return machine, machine.fetch_latest()
        except ShardDropped:
            machine = self._replace_machine(machine)
        return machine, machine.fetch_latest()

    @traced("PersistClient.open_shard", lambda _self, name, *_a, **_k: name)
    def open_shard(
        self,
        name: str,
        schema: pa.Schema | None = None,
        *,
        create: bool = True,
        retention_ms: int | str | None = None,
        keys: Sequence[str] | None = None,
    ) -> Shard:
        """Open shard ``name``, creating it with ``schema`` if it is new and ``create`` is set.

        With a schema, an existing shard must have exactly that schema
        (SchemaMismatch otherwise). Without one, the shard must exist.
        ``retention_ms`` (milliseconds, or a duration such as ``"7d"``; 0: none)
        sets the shard's retention period (see state/retention.py), on an
        existing shard too; ``None`` leaves it as it is. ``keys`` (key column
        names) creates a keyed shard, whose every write is an upsert (see
        state/keyed.py); an existing shard must have exactly those keys
        (KeysMismatch otherwise); ``None`` opens a shard with whatever keys it has.
        """
        validate_shard_name(name)
        user_schema = None if schema is None else validate_schema(schema)
        if keys is not None and user_schema is not None:
            keys = validate_keys(user_schema, keys, name)
        retention_ms = None if retention_ms is None else parse_retention(retention_ms)
        try:
            machine, state = self._fetch(name)
        except ShardNotFound:
            if user_schema is None or not create:
                raise ShardNotFound(
                    f"shard {name!r} does not exist in consensus {self.consensus.uri}: "
                    + (
                        "pass a schema to create it"
                        if user_schema is None
                        else "open it with create=True to create it"
                    )
                ) from None
            machine = self.machine(name)
            state, _ = self._create(machine, user_schema, retention_ms or 0, tuple(keys or ()))
        shard = Shard(self, machine)
        if user_schema is not None and not user_schema.equals(shard.schema):
            raise SchemaMismatch(schema_mismatch_message(name, shard.schema, user_schema))
        check_keys_match(name, state.keys, keys)
        if retention_ms is not None and state.retention_ms != retention_ms:
            shard.set_retention(retention_ms)
        return shard

    @traced("PersistClient.create_shard", lambda _self, name, *_a, **_k: name)
    def create_shard(
        self,
        name: str,
        schema: pa.Schema,
        *,
        retention_ms: int | str | None = None,
        keys: Sequence[str] | None = None,
    ) -> Shard:
        """Create a new shard (keyed by ``keys``, if given); ShardExists if the name is taken
        (by anyone but this call: a creation whose reply was lost and that is found landed is
        this call's)."""
        validate_shard_name(name)
        user_schema = validate_schema(schema)
        key_columns = () if keys is None else validate_keys(user_schema, keys, name)
        retention = 0 if retention_ms is None else parse_retention(retention_ms)
        try:
            self._fetch(name)
        except ShardNotFound:
            machine = self.machine(name)
            _, created = self._create(machine, user_schema, retention, key_columns)
            if created:
                return Shard(self, machine)
        raise ShardExists(
            f"shard {name!r} already exists in consensus {self.consensus.uri}: open it with "
            "open_shard, or choose another name"
        )

    def _create(
        self,
        machine: Machine,
        schema: pa.Schema,
        retention_ms: int = 0,
        keys: tuple[str, ...] = (),
    ) -> tuple[ShardState, bool]:
        """Create ``machine``'s shard (on the tombstone of a dropped one of its name, if any);
        return its state and whether this call created it (else a racing creator did).

        The shard gets a fresh incarnation id. A compare-and-set whose reply is lost,
        or a store that is briefly unavailable, is retried until ``retry_timeout_s``:
        each attempt first looks at the head, so one whose predecessor landed finds
        the shard (with this call's incarnation id) and stops.
        """
        name = machine.shard_id
        incarnation = uuid.uuid4().hex
        encoded = encode_schema(schema)
        now_ms = self._clock_ms()

        def attempt() -> None:
            head = self.consensus.head(name)
            if head is not None and head.data != TOMBSTONE:
                return  # created (by an earlier attempt, or a racing creator), or being dropped
            expected = None if head is None else head.seqno
            diff = create_shard(
                name,
                encoded,
                now_ms,
                incarnation=incarnation,
                retention_ms=retention_ms,
                after_seqno=expected or 0,
                keys=keys,
            )
            row = VersionedData(diff.to_seqno, encode(diff))
            res = self.consensus.compare_and_set(name, expected, row)
            if isinstance(res, CaSCommitted):
                self.publisher.push(name, row.seqno)
            # Else a racing creator won: its shard exists now.

        retry.call(
            attempt,
            store=f"consensus {self.consensus.uri}",
            what=f"creating shard {name!r}",
            transient=lambda e: isinstance(e, Indeterminate) or retry.is_transient(e),
            policy=dc_replace(retry.DEFAULT_POLICY, deadline_s=self.config.retry_timeout_s),
        )
        state = machine.fetch_latest()
        return state, state.incarnation == incarnation

    def txn(self, writer_id: str | None = None, token: int | None = None) -> Txn:
        """A transaction across shards of this client: every shard it writes changes at one
        time, or none does (see :mod:`.txn_commit`). Use it as a context manager (a clean
        exit commits; an exception commits nothing) or call :meth:`Txn.commit`."""
        return Txn(self, writer_id, token)

    def list_shards(self) -> list[str]:
        """The names of every shard in this Consensus (a dropped shard's tombstone is none)."""
        names = []
        for key in self.consensus.list_keys():
            head = self.consensus.head(key)
            if head is not None and head.data != TOMBSTONE:
                names.append(key)
        return sorted(names)

    def pubsub_metrics(self) -> dict[str, float]:
        """PubSub counters of this client's publisher plus its listens' fallback polls."""
        read = getattr(self.publisher, "metrics", None)
        out: dict[str, float] = dict(read()) if callable(read) else {}
        out["fallback_polls"] = self.metrics.snapshot()["listen_polls"]
        return out

    def close(self) -> None:
        """Unsubscribe from PubSub and close the Blob and Consensus connections."""
        with self._lock:
            shard_ids = list(self._machines)
        for shard_id in shard_ids:
            self.publisher.unsubscribe(shard_id)
        self.maintenance.close()
        self.blob.close()
        self.consensus.close()

    def __enter__(self) -> PersistClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Shard(ConsumerMethods):
    """A handle to one shard: its schema, frontiers, factories for writers and readers, and its
    named consumers (the methods of :class:`~.consumer_client.ConsumerMethods`)."""

    def __init__(self, client: PersistClient, machine: Machine) -> None:
        self.client = client
        self.machine = machine

    @property
    def schema(self) -> pa.Schema:
        """The shard's row columns as this process last saw them (a merge-schema write adds
        columns; :meth:`state` reads the newest)."""
        return decode_schema(self.machine.state().schema)

    @property
    def name(self) -> str:
        """The shard's name (its id in Blob and Consensus)."""
        return self.machine.shard_id

    @property
    def keys(self) -> tuple[str, ...]:
        """The key columns of a keyed shard (fixed at creation); ``()`` for an unkeyed one."""
        return self.machine.state().keys

    @traced("Shard.state", "name")
    def state(self) -> ShardState:
        """The shard's newest state, read from Consensus now."""
        return self.machine.fetch_latest()

    @property
    def upper(self) -> Time:
        """Every time before the upper is final (read from Consensus now)."""
        return self.state().upper

    @property
    def since(self) -> Time:
        """Reads must be at or after the since (read from Consensus now)."""
        return self.state().since

    def writer(self, writer_id: str | None = None) -> WriteHandle:
        """A writer. Commits given ``token=`` are idempotent under ``writer_id`` across handles
        and restarts; commits without one are not (see :class:`WriteHandle`)."""
        return WriteHandle(self.machine, writer_id)

    @traced("Shard.reader", "name")
    def reader(self, reader_id: str | None = None) -> ReadHandle:
        """A leased reader for snapshots, listens and subscribes (heartbeated in the background)."""
        return ReadHandle(self.machine, self.client.maintenance, reader_id)

    @traced("Shard.critical_reader", "name")
    def critical_reader(self, reader_id: str, opaque: int = 0) -> CriticalReader:
        """A since hold that never expires, moved only with its fencing token."""
        return CriticalReader(self.machine, reader_id, opaque)

    @traced("Shard.history", "name")
    def history(self) -> list[Commit]:
        """Every commit still described by Consensus, oldest first (see state/history.py)."""
        return history(self.replay())

    def replay(self) -> Replay:
        """Every state Consensus still describes, from the oldest kept (its rollup) to the
        newest, read now (retrying store blips for up to ``retry_timeout_s``): what
        :func:`~.history.state_at` finds a SeqNo's state in."""
        with retry.deadline_in(self.machine.config.retry_timeout_s):
            return replay(self.name, self.machine.consensus, self.machine.blob)

    def heartbeat_reader(self, reader_id: str, *, seqno: int, now_ms: int) -> bool:
        """Extend the lease of leased reader ``reader_id`` to ``now_ms``, holding SeqNo
        ``seqno``; False when it had already expired (its holds are gone: stop reading).

        For a process reading under a lease another process registered (the
        tasks of a Spark batch read, planned on the driver), which holds no
        :class:`ReadHandle` of its own.
        """
        held = self.machine.run(
            lambda s: commands.heartbeat_leased_reader(
                s, reader_id=reader_id, now_ms=now_ms, seqno=seqno
            )
        )
        return held is not None

    @traced("Shard.compact", "name")
    def compact(self) -> list[CompactionReport]:
        """Run compaction now until the policy asks for nothing more.

        Unlike background compaction, it folds everything since has passed at once when
        any of it holds retractions (see :func:`~.retention.expired_run`): an upserted
        shard left idle after it reads like its live rows written once."""
        return self.client.maintenance.compact_now(self.machine)

    @property
    def retention_ms(self) -> int:
        """The shard's retention period in milliseconds, 0 for none (read from Consensus now)."""
        return self.state().retention_ms

    @traced("Shard.set_retention", "name")
    def set_retention(self, retention: int | str) -> int:
        """Set the retention period (ms, or ``"7d"``, ``"12h"``...; 0: none); returns it in ms.

        Maintenance then keeps since at most that far behind the clock, never
        past a reader's hold; a longer period cannot bring back what since
        already passed.
        """
        ms = parse_retention(retention)
        return self.machine.run(lambda s: set_retention(s, retention_ms=ms))

    @traced("Shard.gc", "name")
    def gc(self) -> GcReport:
        """Run GC now: expire stale readers, delete garbage, truncate Consensus, sweep orphans."""
        return self.client.maintenance.gc_now(self.machine)


class CriticalReader:
    """A since hold that never expires (persist's critical since handle).

    Whoever holds the newest ``opaque`` token may move it; a handle with an
    older token is fenced out. Use it for a since that must survive any
    process crash (e.g. a controller that decides what may be compacted).
    """

    def __init__(self, machine: Machine, reader_id: str, opaque: int) -> None:
        self._machine = machine
        self.reader_id = reader_id
        state = machine.run(
            lambda s: commands.register_critical_reader(s, reader_id=reader_id, opaque=opaque)
        )
        self.since = state.since
        self.opaque = state.opaque

    @traced("CriticalReader.compare_and_downgrade_since", "_machine.shard_id")
    def compare_and_downgrade_since(
        self, expected_opaque: int, new_opaque: int, new_since: Time
    ) -> CriticalSince:
        """Move the hold to ``new_since`` iff the stored token is ``expected_opaque``.

        A retry after a lost reply finds the token already moved; when state
        holds exactly this call's ``new_opaque`` and ``new_since`` then, the
        first attempt landed and the answer is ``ok``, not fenced.
        """
        info = RunInfo()
        result = self._machine.run(
            lambda s: commands.compare_and_downgrade_since(
                s,
                reader_id=self.reader_id,
                expected_opaque=expected_opaque,
                new_opaque=new_opaque,
                new_since=new_since,
            ),
            info=info,
        )
        current = result.current
        if not result.ok and info.uncertain and expected_opaque != new_opaque:
            if current.opaque == new_opaque and current.since >= new_since:
                result = CriticalSince(ok=True, current=current)
        self.since, self.opaque = current.since, current.opaque
        return result
