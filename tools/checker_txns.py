"""The checker's ``txns`` piece: transactions across 2-5 shards under store faults, read in cuts.

Writers commit transactions (``client.txn``, :mod:`~pyspark_persist.state.txn_commit`)
over random subsets of ``TXN_SHARDS`` plain shards and one keyed shard, each
transaction's rows tagged with its id, while plain writers append to the
same shards and readers take cuts: the snapshot of every shard as of one
time ``t`` (a cut that meets a store fault is taken again). A commit whose
outcome is unknown (``Indeterminate``, or any store error) is resent, with
the same rows, writer id and token, until acknowledged.

A cut costs the same at the end of a long run as at its start. The shards'
contents stay small: each transaction also retracts, in the same commit, the
rows of its writer's transaction ``LIVE_TXNS`` before (in that one's shards,
so it touches 2-5 in all), and each plain append the oldest of its writer's
``PLAIN_LIVE`` in its shard. Their history stays small too: the shards have
a retention period (``TXN_RETENTION_MS``, on wall-clock times: since follows
the lowest reader hold alone), each cut reader holds since on every shard and
downgrades it once it is ``2 * CUT_WINDOW`` behind the newest time every
shard has, then cuts at or after it; a maintenance loop compacts (folding
times below since into since) and collects the shards under faults, on top of
the clients' own background maintenance. A cut below a shard's since cannot
be read (``InvalidFrontier``: a downgrade whose reply was lost landed); it is
counted (``txns_cuts_below_since``), not checked, and is no violation. Nor is
the check's cost tied to the history: per writer, the newest transaction a
cut shows fixes which of its transactions must show (:func:`check_cut`).

Checked (:func:`check_cut`, on every readable cut and on the final one with
faults off): a transaction shows in every shard it named or in none, each row
once (a resend applied twice shows diff 2 or two rows, a retraction applied
twice diff -1); an acknowledged transaction shows iff its time is at or
before ``t`` and it was not retracted by then (compaction moves a time below
since up to since, never past a cut at or after since, so this holds on
compacted shards too); the keyed shard holds for each key exactly the newest
committed transaction that upserted it. The final cut holds exactly the
acknowledged plain appends not retracted.

And the exact times (:meth:`TxnShards.verify`): a listen of every plain shard
follows it from time 0 throughout the run, holding its since just below its
frontier, so nothing it has not read is compacted and every event carries
the time its rows were written at. After the workload it reads on to the
final upper with faults off: each acknowledged transaction's rows were seen
at exactly its acknowledged time (one time, if acknowledged as already
committed) in exactly the shards it named, their retraction likewise at the
time of the transaction that retracts them, and no unplanned one was seen.

Built from :mod:`.checker`'s fault menu, which imports this module only
when it builds the piece (this module builds on the checker's shared
pieces); the piece's sabotage, ``txn_one_by_one``, is in the checker's menu.
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import dataclasses
import functools
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa

from pyspark_persist.state import DIFF, TIME, PersistClient, ReadHandle
from pyspark_persist.state.errors import (
    Determinate,
    Indeterminate,
    InvalidFrontier,
    InvalidUsage,
    PartNotFound,
    PersistError,
)
from pyspark_persist.state.read import Listen, ListenEvent

from .checker import FINISH_TIMEOUT_S, Context, FaultyClient, Piece, reliable_client

ReadT = TypeVar("ReadT")

TXN_SCHEMA = pa.schema([("txn", pa.int64()), ("row", pa.int64())])
"""A plain member's rows: the transaction id (negative: a plain append's) and a row number."""
TXN_KEYED_SCHEMA = pa.schema([("k", pa.int64()), ("txn", pa.int64())])
"""The keyed member's rows: key ``k`` holds the id of the last transaction that upserted it."""
TXN_SHARDS = 5
"""Plain shards of the piece (plus the keyed one): a transaction names 2-5 of all six."""
TXN_WRITERS = 3
PLAIN_WRITERS = 2
CUT_READERS = 3
KEYS_PER_WRITER = 3
"""Keys of the keyed shard each transaction writer owns (so its commit order is its keys')."""
ID_STRIDE = 1_000_000
"""Transaction ``n`` (from 1) of writer ``w`` is ``(w + 1) * ID_STRIDE + n`` (its *group* is
``w + 1``; the final transaction, 0, is group 0 alone); plain append ``m`` of plain writer
``p`` is ``-((p + 1) * ID_STRIDE + m)``."""
LIVE_TXNS = 3
"""Transactions of a writer whose rows stay: transaction ``n`` also retracts the plain rows of
``n - LIVE_TXNS`` (in that one's shards, in the same commit), so a shard's contents, and what a
cut reads and checks, stay this size while its history grows."""
PLAIN_LIVE = 3
"""Plain appends of a plain writer that stay in each shard: each further append to the shard
retracts its oldest there, in the same compare-and-append."""
KEYED = "keyed"
"""The keyed member's name in a :class:`TxnSpec` (its shard is ``<piece shard>-keyed``)."""
TXN_RETENTION_MS = 1
"""The shards' retention. Their times are the wall clock's milliseconds, so ``now - 1 ms`` is
past every hold: since follows the lowest reader hold (and ``upper - 1``) alone."""
CUT_WINDOW = 1000
"""How far (in times: milliseconds of commit time) below the newest time every shard has an
older cut may go, and a cut reader lets its since fall at most twice that far behind before
it downgrades it (a downgrade is a compare-and-set per shard: one every few cuts)."""


def group_of(txn: int) -> int:
    """The writer group of a transaction id (see :data:`ID_STRIDE`)."""
    return txn // ID_STRIDE


def first_of(group: int) -> int:
    """The first transaction id of a writer group."""
    return group * ID_STRIDE + 1 if group else 0


@dataclass(frozen=True)
class TxnSpec:
    """What a transaction writes: rows per plain member, the key it upserts (if the keyed
    shard is a member) and the earlier transaction whose plain rows it retracts."""

    txn: int
    rows: Mapping[str, int]
    key: int | None = None
    retracts: TxnSpec | None = field(default=None, repr=False, compare=False)
    """Out of repr and comparisons: each spec retracts an earlier one, which retracts an
    earlier one, so following the chain would go as deep as the run is long."""

    def members(self) -> frozenset[str]:
        """The plain members it writes rows to (the ones whose rows a cut counts)."""
        return frozenset(self.rows)


@dataclass
class TxnBook:
    """What the writers said, shared with the readers: every transaction planned (before its
    first attempt), the time of every acknowledged one, and the plain appends that must stay.

    Checking a cut against it costs what the cut holds, not the run's history: per writer
    group the acknowledged ids in order, per key the ids that upsert it."""

    specs: dict[int, TxnSpec] = field(default_factory=dict)
    acked: dict[int, int | None] = field(default_factory=dict)
    acked_by_group: dict[int, list[int]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )
    upserters: dict[int, list[int]] = field(default_factory=lambda: collections.defaultdict(list))
    plain_live: set[int] = field(default_factory=set)
    """Acknowledged plain appends whose retraction was not (yet) acknowledged."""
    plain_acked: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def plan(self, spec: TxnSpec) -> None:
        """Record a transaction before its first attempt."""
        with self.lock:
            self.specs[spec.txn] = spec
            if spec.key is not None:
                self.upserters[spec.key].append(spec.txn)

    def ack(self, txn: int, at: int | None) -> None:
        """Record an acknowledged transaction (``at`` None: acknowledged as already
        committed, time unknown). A writer group's acknowledgements come in id order."""
        with self.lock:
            self.acked[txn] = at
            self.acked_by_group[group_of(txn)].append(txn)


def check_cut(
    t: int,
    plain: Mapping[str, pa.Table],
    keyed: pa.Table,
    book: TxnBook,
    *,
    final: bool = False,
) -> list[str]:
    """The violations of one cut: every shard's consolidated snapshot as of ``t`` (``plain``
    by member name, ``keyed`` the keyed shard's). ``final``: the cut after the workload
    (every write settled), where exactly the acknowledged plain appends not retracted show.

    A writer group commits one transaction after another, each retracting the one
    ``LIVE_TXNS`` before, so if ``z`` is the newest of its transactions in the cut, the cut
    must show exactly ``z - LIVE_TXNS + 1 .. z`` of it (those after its first id), each
    whole; every one acknowledged at or before ``t`` must be at most ``z``, and none shows
    that was acknowledged after ``t``. Read the book after the cut: a commit at or before
    ``t`` landed before the cut was read, so its acknowledgement, if any, is in the book."""
    out: list[str] = []
    where = f"txns: cut at {t}"
    plain_seen: set[int] = set()
    seen: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for shard, table in plain.items():
        rows: collections.Counter[tuple[int, int]] = collections.Counter()
        for txn, row, diff in zip(
            *(table.column(c).to_pylist() for c in ("txn", "row", DIFF)), strict=True
        ):
            if diff != 1:
                out.append(f"{where}: transaction {txn} row {row} in {shard} has diff {diff}")
            rows[(txn, row)] += diff
            if txn < 0:
                plain_seen.add(-txn)
            else:
                seen[txn][shard] += diff
        out += [
            f"{where}: row {key} in {shard} appears {n} times (applied twice)"
            for key, n in rows.items()
            if n > 1
        ]
    with book.lock:
        newest: dict[int, int] = {}
        for txn in seen:
            newest[group_of(txn)] = max(newest.get(group_of(txn), txn), txn)
        for txn, counts in seen.items():
            out += _check_shown(where, t, txn, counts, book)
        for group, z in newest.items():
            live = range(max(first_of(group), z - LIVE_TXNS + 1), z + 1)
            out += [
                f"{where}: transaction {txn} is missing, yet {z} of its writer shows (a "
                "transaction lost, or retracted early: half a transaction)"
                for txn in live
                if txn not in seen
            ]
            out += [
                f"{where}: transaction {txn} shows, yet {txn + LIVE_TXNS} of its writer, which "
                "retracts it, shows too (half a transaction)"
                for txn in seen
                if group_of(txn) == group and txn <= z - LIVE_TXNS
            ]
        for group, ids in book.acked_by_group.items():
            z = newest.get(group, first_of(group) - 1)
            for txn in reversed(ids):
                if txn <= z:
                    break
                at = book.acked[txn]
                if at is not None and at <= t:
                    out.append(f"{where}: transaction {txn} acknowledged at {at} is missing")
        out += _check_keyed(where, keyed, book, newest)
        if final:
            out += [
                f"{where}: acknowledged plain append {ident} is missing"
                for ident in sorted(book.plain_live - plain_seen)
            ]
            out += [
                f"{where}: plain append {ident} shows, but it was never acknowledged or its "
                "retraction was"
                for ident in sorted(plain_seen - book.plain_live)
            ]
    return out


def _check_shown(
    where: str, t: int, txn: int, counts: collections.Counter[str], book: TxnBook
) -> list[str]:
    """A transaction the cut shows: planned, in all its shards with all its rows, and not
    acknowledged after ``t`` (book locked)."""
    spec = book.specs.get(txn)
    if spec is None:
        return [f"{where}: transaction {txn} shows, but no writer planned it"]
    out: list[str] = []
    shown = frozenset(counts)
    if shown != spec.members():
        out.append(
            f"{where}: transaction {txn} shows in {sorted(shown)} but not in "
            f"{sorted(spec.members() - shown)} (half a transaction)"
            + (
                f"; not planned for {sorted(shown - spec.members())}"
                if shown - spec.members()
                else ""
            )
        )
    wrong = {s: n for s, n in counts.items() if n != spec.rows.get(s)}
    if wrong:
        out.append(f"{where}: transaction {txn} has rows {wrong}, wrote {dict(spec.rows)}")
    at = book.acked.get(txn)
    if at is not None and at > t:
        out.append(f"{where}: transaction {txn} acknowledged at {at} shows before it")
    return out


def _check_keyed(
    where: str, keyed: pa.Table, book: TxnBook, newest: Mapping[int, int]
) -> list[str]:
    """Each key holds, once, the newest transaction that upserted it among those committed
    by the cut's time: its writer's transactions up to the newest it shows (a writer
    commits in id order and owns its keys); a key none of those upserted is absent."""
    out: list[str] = []
    held: dict[int, int] = {}
    for k, txn, diff in zip(
        *(keyed.column(c).to_pylist() for c in ("k", "txn", DIFF)), strict=True
    ):
        if diff != 1 or k in held:
            out.append(f"{where}: keyed shard holds key {k} twice or with diff {diff}")
        held[k] = txn
    for k in sorted(set(held) | set(book.upserters)):
        ids = book.upserters.get(k, [])
        expected: int | None = None
        if ids:
            z = newest.get(group_of(ids[0]))
            i = -1 if z is None else bisect.bisect_right(ids, z) - 1
            expected = ids[i] if i >= 0 else None
        if held.get(k) != expected:
            out.append(
                f"{where}: keyed shard holds key {k} = transaction {held.get(k)}, but the newest "
                f"committed transaction upserting it is {expected} (half a transaction)"
            )
    return out


def _plain_shares(spec: TxnSpec) -> dict[str, pa.Table]:
    """A transaction's updates per plain shard: its rows (``row`` 0.., diff +1) and the
    retraction (diff -1) of the rows of the transaction it retracts."""
    rows: dict[str, list[tuple[int, int, int]]] = collections.defaultdict(list)
    for member, n in spec.rows.items():
        rows[member] += [(spec.txn, row, 1) for row in range(n)]
    if spec.retracts is not None:
        for member, n in spec.retracts.rows.items():
            rows[member] += [(spec.retracts.txn, row, -1) for row in range(n)]
    return {
        member: pa.table(
            {"txn": [r[0] for r in rs], "row": [r[1] for r in rs], DIFF: [r[2] for r in rs]},
            schema=TXN_SCHEMA.append(pa.field(DIFF, pa.int64())),
        )
        for member, rs in rows.items()
    }


class TxnShards(Piece):
    """The ``txns`` piece; see the module doc."""

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx, "txns")
        base = f"{ctx.shard_name}-txn"
        self.names = {f"s{i}": f"{base}-{i}" for i in range(TXN_SHARDS)}
        self.keyed_name = f"{base}-keyed"
        self.book = TxnBook()
        self.follower: TxnFollower | None = None

    def setup(self) -> None:
        """The shards, with retention, the plain ones with [0, 1) written and the keyed one
        with an empty upsert (so every member has a time to read at); then the listen of
        every plain shard, registered before any write (since stays at 0 until it moves
        its hold)."""
        with reliable_client(self.ctx.loc) as setup:
            for name in self.names.values():
                shard = setup.open_shard(name, TXN_SCHEMA, retention_ms=TXN_RETENTION_MS)
                shard.writer("setup").compare_and_append(TXN_SCHEMA.empty_table(), 0, 1, token=1)
            keyed = setup.open_shard(
                self.keyed_name, TXN_KEYED_SCHEMA, keys=["k"], retention_ms=TXN_RETENTION_MS
            )
            keyed.writer("setup").upsert(TXN_KEYED_SCHEMA.empty_table(), token=1)
        self.ctx.shards.extend([*self.names.values(), self.keyed_name])
        self.follower = TxnFollower(self.ctx, self.names)

    def loops(self) -> dict[str, Callable[[], None]]:
        """Transaction writers, plain writers, cut readers, the listen and maintenance."""
        out: dict[str, Callable[[], None]] = {}
        for w in range(TXN_WRITERS):
            out[f"txns-writer-{w}"] = functools.partial(self.commit_loop, w)
        for p in range(PLAIN_WRITERS):
            out[f"txns-plain-{p}"] = functools.partial(self.plain_loop, p)
        for r in range(CUT_READERS):
            out[f"txns-cuts-{r}"] = functools.partial(self.cut_loop, r)
        assert self.follower is not None, "setup registers the listen"
        out["txns-listen"] = self.follower.run
        out["txns-maintenance"] = self.maintenance_loop
        return out

    def commit_loop(self, w: int) -> None:
        """Commit transaction after transaction, each resent until acknowledged: rows in 1-5
        plain shards and perhaps a key of the keyed one, and the retraction of the rows of
        the transaction ``LIVE_TXNS`` before (in its shards too: 2-5 shards in all)."""
        ctx = self.ctx
        rng = random.Random(ctx.seed_for(f"txns-writer-{w}"))
        fc = ctx.client(f"txns-writer-{w}")
        fc.enable()
        members = [*self.names, KEYED]
        planned: collections.deque[TxnSpec] = collections.deque()
        n = 0
        while not ctx.stop.is_set():
            n += 1
            chosen = rng.sample(members, rng.randint(2, 5))
            plain = [m for m in chosen if m != KEYED]
            retracts = planned.popleft() if len(planned) == LIVE_TXNS else None
            touched = set(plain) | (retracts.members() if retracts else set())
            keyed = KEYED in chosen and len(touched) < 5
            spec = TxnSpec(
                (w + 1) * ID_STRIDE + n,
                {m: rng.randint(1, 3) for m in plain},
                w * KEYS_PER_WRITER + rng.randrange(KEYS_PER_WRITER) if keyed else None,
                retracts,
            )
            planned.append(spec)
            self.book.plan(spec)
            at = self._commit_until_acked(fc.client, f"txns-w{w}", n, spec)
            if at is not False:
                self.book.ack(spec.txn, at)

    def _commit_until_acked(
        self, client: PersistClient, writer_id: str, token: int, spec: TxnSpec
    ) -> int | None | bool:
        """Commit ``spec`` as a new transaction each attempt with the same writer id and
        token; its time (None: acknowledged as already committed, time unknown), or False
        when the commit was refused (a violation)."""
        rec = self.ctx.rec
        resend = False
        while True:
            t = client.txn(writer_id=writer_id, token=token)
            try:
                for member, updates in _plain_shares(spec).items():
                    t.append(self.names[member], updates)
                if spec.key is not None:
                    t.upsert(
                        self.keyed_name,
                        pa.table({"k": [spec.key], "txn": [spec.txn]}, schema=TXN_KEYED_SCHEMA),
                    )
                at = t.commit()
            except InvalidUsage as e:
                rec.violation(f"txns: transaction {spec.txn} refused on resend: {e}")
                return False
            except (Determinate, Indeterminate) as e:
                rec.op(f"txns_commit_errors_{type(e).__name__}")
                resend = True
                continue
            rec.op("txns_already_committed" if t.already_committed else "txns_committed")
            if resend:
                rec.op("txns_resent_and_acked")
            return at

    def plain_loop(self, p: int) -> None:
        """Plain appends (one row, a token each) to random members, each until acknowledged;
        once a member holds ``PLAIN_LIVE`` of this writer's, each append there also retracts
        the oldest."""
        ctx = self.ctx
        rng = random.Random(ctx.seed_for(f"txns-plain-{p}"))
        fc = ctx.client(f"txns-plain-{p}")
        writers = {
            m: fc.client.open_shard(name).writer(f"txns-plain-{p}")
            for m, name in self.names.items()
        }
        live: dict[str, collections.deque[int]] = {m: collections.deque() for m in writers}
        fc.enable()
        m = 0
        while not ctx.stop.is_set():
            m += 1
            ident = (p + 1) * ID_STRIDE + m
            member = rng.choice(list(writers))
            old = live[member][0] if len(live[member]) == PLAIN_LIVE else None
            updates = pa.table(
                {
                    "txn": [-ident] + ([] if old is None else [-old]),
                    "row": [0] * (1 if old is None else 2),
                    DIFF: [1] + ([] if old is None else [-1]),
                },
                schema=TXN_SCHEMA.append(pa.field(DIFF, pa.int64())),
            )
            while True:
                try:
                    writers[member].append(updates, token=m)
                    break
                except (Determinate, Indeterminate):
                    ctx.rec.op("txns_plain_errors")
            live[member].append(ident)
            with self.book.lock:
                self.book.plain_live.add(ident)
                self.book.plain_acked += 1
                if old is not None:
                    live[member].popleft()
                    self.book.plain_live.discard(old)
            ctx.rec.op("txns_plain_appends")
            ctx.stop.wait(rng.uniform(0.0, 0.01))

    def _readers(
        self, client: PersistClient, name: str
    ) -> tuple[dict[str, ReadHandle], ReadHandle]:
        plain = {m: client.open_shard(s).reader(name) for m, s in self.names.items()}
        return plain, client.open_shard(self.keyed_name).reader(name)

    def cut_loop(self, r: int) -> None:
        """Take cuts at the newest time every shard has (or a little older, never below this
        reader's since) and check them, keeping this reader's since close behind."""
        ctx, rec = self.ctx, self.ctx.rec
        rng = random.Random(ctx.seed_for(f"txns-cuts-{r}"))
        fc = ctx.client(f"txns-cuts-{r}", reader=True)
        plain, keyed = self._readers(fc.client, f"txns-cuts-{r}")
        handles = [*plain.values(), keyed]
        fc.enable()
        while not ctx.stop.is_set():
            latest = min(self._retrying(h.latest_as_of) for h in handles)
            t = self._cut_time(handles, latest, rng)
            if t is None:
                ctx.stop.wait(0.005)
                continue
            try:
                tables = {
                    m: self._retrying(functools.partial(h.snapshot_table, t))
                    for m, h in plain.items()
                }
                keyed_table = self._retrying(functools.partial(keyed.snapshot_table, t))
            except InvalidFrontier:
                # t is at most every shard's upper - 1 (read just before, and uppers only
                # advance), so some shard's since passed t: a downgrade of this reader whose
                # reply was lost landed. Not a readable cut, and no violation.
                rec.op("txns_cuts_below_since")
                continue
            except PartNotFound as e:
                rec.violation(f"txns: leased cut at {t} failed, a committed part is gone: {e}")
                continue
            rec.op("txns_cuts")
            for v in check_cut(t, tables, keyed_table, self.book):
                rec.violation(v)
            rec.op("txns_cuts_checked")
        for h in handles:
            with contextlib.suppress(PersistError):
                h.close()

    def _retrying(self, read: Callable[[], ReadT]) -> ReadT:
        """``read`` (one shard's part of a cut), again after each store error: the cut keeps
        its time, which this reader's since holds readable, so one fault costs one read."""
        while True:
            try:
                return read()
            except (Determinate, Indeterminate):
                self.ctx.rec.op("txns_cut_retries")

    def _cut_time(self, handles: list[ReadHandle], latest: int, rng: random.Random) -> int | None:
        """Downgrade the since of every handle more than ``2 * CUT_WINDOW`` behind ``latest`` to
        one random time at most ``CUT_WINDOW`` behind, then the time of the next cut: ``latest``, or
        (3 in 10) a random older one at or after every handle's since (None: a since is past
        ``latest``, after a landed downgrade whose reply was lost)."""
        target = rng.randint(max(0, latest - CUT_WINDOW), latest)
        for h in handles:
            if h.since < latest - 2 * CUT_WINDOW:
                with contextlib.suppress(Determinate, Indeterminate):
                    h.downgrade_since(target)
                    self.ctx.rec.op("txns_since_downgrades")
        lo = max(h.since for h in handles)
        if lo > latest:
            return None
        return latest if rng.random() >= 0.3 else rng.randint(max(lo, latest - CUT_WINDOW), latest)

    def maintenance_loop(self) -> None:
        """Compaction (which folds times below since into since) and GC with the orphan sweep
        (which moves since by the retention first) of a random shard of the piece, under
        faults, pausing a little between: on top of the clients' background maintenance."""
        ctx, rec = self.ctx, self.ctx.rec
        fc = ctx.client(
            "txns-maintenance", config=lambda c: dataclasses.replace(c, retry_timeout_s=1.5)
        )
        rng = random.Random(ctx.seed_for("txns-maintenance"))
        shards = [fc.client.open_shard(n) for n in [*self.names.values(), self.keyed_name]]
        fc.enable()
        while not ctx.stop.is_set():
            shard = rng.choice(shards)
            try:
                if rng.random() < 0.6:
                    rec.op("txns_compactions", len(shard.compact()))
                else:
                    shard.gc()
                    rec.op("txns_gcs")
            except PartNotFound as e:
                rec.violation(f"txns: compaction found a committed part missing: {e}")
            except PersistError as e:
                rec.op("txns_maintenance_errors_" + type(e).__name__)
            ctx.stop.wait(rng.uniform(0.02, 0.2))

    def verify(self) -> None:
        """Faults off: the final cut (every transaction settled), then the listen read on to
        the final upper and each transaction's times and shards in it (see the module doc)."""
        ctx = self.ctx
        with reliable_client(ctx.loc) as client:
            # A last transaction over every plain shard and the keyed one brings them all to
            # one upper, so the final cut holds every write.
            last = TxnSpec(0, dict.fromkeys(self.names, 1), -1)
            self.book.plan(last)
            at = self._commit_until_acked(client, "txns-final", 1, last)
            if at is not False:
                self.book.ack(last.txn, at)
            plain, keyed = self._readers(client, "txns-verify")
            t = min(h.latest_as_of() for h in [*plain.values(), keyed])
            tables = {m: h.snapshot_table(t) for m, h in plain.items()}
            for v in check_cut(t, tables, keyed.snapshot_table(t), self.book, final=True):
                ctx.rec.violation(v)
        ctx.rec.op("txns_plain_appends_checked", self.book.plain_acked)
        assert self.follower is not None, "setup registers the listen"
        if not self.follower.finish(t + 1):
            return
        ctx.rec.op("txns_commits_checked", len(self.book.acked))
        for v in self.follower.check(self.book):
            ctx.rec.violation(v)


class TxnFollower:
    """A listen of every plain shard from time 0, through the run and on to the final upper.

    Its readers register when it is built (in the piece's setup, before any write) and each
    holds since just below its listen's frontier, as a real consumer does: what it has not
    read is never compacted, so every event carries the exact time its rows were written at.
    It records, per transaction, the times and shards it saw the transaction's rows at.
    """

    def __init__(self, ctx: Context, names: Mapping[str, str]) -> None:
        self.ctx = ctx
        self.fc: FaultyClient = ctx.client("txns-listen", reader=True)
        self.readers = {
            m: self.fc.client.open_shard(name).reader("txns-listen") for m, name in names.items()
        }
        self.listens: dict[str, Listen] = {m: h.listen(h.since) for m, h in self.readers.items()}
        self.times: dict[int, set[int]] = collections.defaultdict(set)
        self.shards: dict[int, set[str]] = collections.defaultdict(set)
        self.retracted_at: dict[int, set[int]] = collections.defaultdict(set)
        self.retracted_in: dict[int, set[str]] = collections.defaultdict(set)
        self.rng = random.Random(ctx.seed_for("txns-listen"))

    def run(self) -> None:
        """Follow every shard, round after round, until the run stops (faults on)."""
        self.fc.enable()
        while not self.ctx.stop.is_set():
            if not self._round():
                self.ctx.stop.wait(0.01)

    def _round(self) -> bool:
        """Take the next event of each listen that has one; whether any had."""
        rec, progressed = self.ctx.rec, False
        for m, listen in self.listens.items():
            try:
                event = listen.next(timeout_s=0.0)
            except (Determinate, Indeterminate):
                rec.op("txns_listen_errors")
                continue
            if event is None:
                continue
            progressed = True
            reader = self.readers[m]
            table = self._fetch(reader, m, event)
            if table is None:
                continue
            rec.op("txns_listen_events")
            for txn, at, diff in zip(
                *(table.column(c).to_pylist() for c in ("txn", TIME, DIFF)), strict=True
            ):
                if txn >= 0 and diff > 0:
                    self.times[txn].add(at)
                    self.shards[txn].add(m)
                elif txn >= 0:
                    self.retracted_at[txn].add(at)
                    self.retracted_in[txn].add(m)
            if self.rng.random() < 0.3 and listen.frontier > 1:
                with contextlib.suppress(Determinate, Indeterminate):
                    reader.downgrade_since(listen.frontier - 1)
        return progressed

    def _fetch(self, reader: ReadHandle, member: str, event: ListenEvent) -> pa.Table | None:
        """An event's updates, retrying store errors; None (a violation) if a part is gone."""
        while True:
            try:
                return reader.fetch(event.parts)
            except PartNotFound as e:
                self.ctx.rec.violation(
                    f"txns: leased listen event [{event.lower}, {event.upper}) of {member} "
                    f"failed: {e}"
                )
                return None
            except (Determinate, Indeterminate):
                self.ctx.rec.op("txns_listen_errors")

    def finish(self, upper: int) -> bool:
        """Read on (faults off by now) until every listen reached ``upper``, then close;
        whether they all did (a violation names a listen that got stuck)."""
        deadline = time.monotonic() + FINISH_TIMEOUT_S
        while min(listen.frontier for listen in self.listens.values()) < upper:
            if time.monotonic() > deadline:
                stuck = {m: ls.frontier for m, ls in self.listens.items() if ls.frontier < upper}
                self.ctx.rec.violation(f"txns: listens stuck at {stuck}, final upper {upper}")
                return False
            if not self._round():
                time.sleep(0.01)
        for m, listen in self.listens.items():
            listen.close()
            with contextlib.suppress(PersistError):
                self.readers[m].close()
        return True

    def check(self, book: TxnBook) -> list[str]:
        """Each acknowledged transaction's rows seen at its acknowledged time alone (at one
        time, if acknowledged as already committed) in exactly the shards it named, and their
        retraction likewise at the time of the transaction that retracts them (if that one
        was acknowledged; never otherwise); no unplanned transaction seen."""
        out: list[str] = []
        for txn in sorted((set(self.times) | set(self.retracted_at)) - set(book.specs)):
            out.append(f"txns: the listen sees transaction {txn}, which no writer planned")
        retractor = {s.retracts.txn: s.txn for s in book.specs.values() if s.retracts}
        for txn, at in book.acked.items():
            members = book.specs[txn].members()
            out += _seen_once(
                f"transaction {txn}", self.times.get(txn), self.shards.get(txn), at, members
            )
            r = retractor.get(txn)
            if r is not None and r in book.acked:
                out += _seen_once(
                    f"the retraction of transaction {txn} (by {r})",
                    self.retracted_at.get(txn),
                    self.retracted_in.get(txn),
                    book.acked[r],
                    members,
                )
            elif txn in self.retracted_at:
                out.append(
                    f"txns: the listen sees transaction {txn} retracted at "
                    f"{sorted(self.retracted_at[txn])}, but no acknowledged one retracts it"
                )
        return out


def _seen_once(
    what: str,
    seen_at: set[int] | None,
    seen_in: set[str] | None,
    at: int | None,
    members: frozenset[str],
) -> list[str]:
    """``what`` was seen by the listen in exactly ``members``, at ``at`` alone (at one time,
    when ``at`` is None: acknowledged as already committed)."""
    seen_at, seen_in = seen_at or set(), seen_in or set()
    out: list[str] = []
    if seen_in != members:
        out.append(
            f"txns: the listen sees {what} in {sorted(seen_in)}, it was written to "
            f"{sorted(members)} (half a transaction)"
        )
    if (at is not None and seen_at != {at}) or len(seen_at) != 1:
        out.append(f"txns: the listen sees {what} at {sorted(seen_at)}, acknowledged at {at}")
    return out
