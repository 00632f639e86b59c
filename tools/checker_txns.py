"""The checker's ``txns`` piece: transactions across 2-5 shards under store faults, read in cuts.

Writers commit transactions (``client.txn``, :mod:`~pyspark_persist.state.txn_commit`)
over random subsets of ``TXN_SHARDS`` plain shards and one keyed shard, each
transaction's rows tagged with its id, while plain writers append to the
same shards and readers take cuts: the snapshot of every shard as of one
time ``t`` (a cut that meets a store fault is taken again). A commit whose
outcome is unknown (``Indeterminate``, or any store error) is resent, with
the same rows, writer id and token, until acknowledged.

Retention keeps every shard small, so a cut costs the same at the end of a
long run as at its start: the shards have a retention period (``TXN_RETENTION_MS``,
on wall-clock times: since follows the lowest reader hold alone), each cut
reader holds since on every shard and, before a cut, downgrades it to at
most ``CUT_WINDOW`` below the newest time every shard has, then cuts at or
after it; a maintenance loop compacts (folding times below since into since)
and collects the shards under faults, on top of the clients' own background
maintenance. A cut below a shard's since cannot be read (``InvalidFrontier``:
a downgrade whose reply was lost landed); it is counted
(``txns_cuts_below_since``), not checked, and is no violation.

Checked (:func:`check_cut`, on every readable cut and on the final one with
faults off): a transaction shows in every shard it named or in none, each row
once (a resend applied twice shows diff 2 or two rows); an acknowledged
transaction shows iff its time is at or before ``t`` (compaction moves a
time below since up to since, never past a cut at or after since, so this
holds on compacted shards too); the keyed shard holds for each key exactly
the newest visible transaction that upserted it. The final cut also holds
every acknowledged plain append.

And the exact times (:meth:`TxnShards.verify`): a listen of every plain shard
follows it from time 0 throughout the run, holding its since just below its
frontier, so nothing it has not read is compacted and every event carries
the time its rows were written at. After the workload it reads on to the
final upper with faults off: each acknowledged transaction was seen at
exactly its acknowledged time (one time, if acknowledged as already
committed) in exactly the shards it named, and no unplanned one was seen.

Built from :mod:`.checker`'s fault menu, which imports this module only
when it builds the piece (this module builds on the checker's shared
pieces); the piece's sabotage, ``txn_one_by_one``, is in the checker's menu.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

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

TXN_SCHEMA = pa.schema([("txn", pa.int64()), ("row", pa.int64())])
"""A plain member's rows: the transaction id (negative: a plain append's) and a row number."""
TXN_KEYED_SCHEMA = pa.schema([("k", pa.int64()), ("txn", pa.int64())])
"""The keyed member's rows: key ``k`` holds the id of the last transaction that upserted it."""
TXN_SHARDS = 5
"""Plain shards of the piece (plus the keyed one): a transaction names 2-5 of all six."""
TXN_WRITERS = 3
PLAIN_WRITERS = 2
CUT_READERS = 2
KEYS_PER_WRITER = 3
"""Keys of the keyed shard each transaction writer owns (so its commit order is its keys')."""
ID_STRIDE = 1_000_000
"""Transaction ``n`` of writer ``w`` is ``(w + 1) * ID_STRIDE + n``; plain append ``m`` of
plain writer ``p`` is ``-((p + 1) * ID_STRIDE + m)``."""
KEYED = "keyed"
"""The keyed member's name in a :class:`TxnSpec` (its shard is ``<piece shard>-keyed``)."""
TXN_RETENTION_MS = 1
"""The shards' retention. Their times are the wall clock's milliseconds, so ``now - 1 ms`` is
past every hold: since follows the lowest reader hold (and ``upper - 1``) alone."""
CUT_WINDOW = 200
"""How far (in times: milliseconds of commit time) below the newest time every shard has a
cut reader keeps its since, and an older cut may go: a handful of transactions back."""


@dataclass(frozen=True)
class TxnSpec:
    """What a transaction writes: rows per plain member, and the key it upserts (if the keyed
    shard is a member)."""

    txn: int
    rows: Mapping[str, int]
    key: int | None = None

    def members(self) -> frozenset[str]:
        """The plain members (the ones whose rows a cut counts)."""
        return frozenset(self.rows)


@dataclass
class TxnBook:
    """What the writers said, shared with the readers: every transaction planned (before its
    first attempt) and the time of every acknowledged one."""

    specs: dict[int, TxnSpec] = field(default_factory=dict)
    acked: dict[int, int | None] = field(default_factory=dict)
    plain_acked: set[int] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def view(self) -> tuple[dict[int, TxnSpec], dict[int, int | None], set[int]]:
        """Copies to check a cut against (taken after the cut was read)."""
        with self.lock:
            return dict(self.specs), dict(self.acked), set(self.plain_acked)


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
    (every write settled), where each acknowledged plain append must show too."""
    specs, acked, plain_acked = book.view()
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
    for txn, counts in seen.items():
        spec = specs.get(txn)
        if spec is None:
            out.append(f"{where}: transaction {txn} shows, but no writer planned it")
            continue
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
        at = acked.get(txn)
        if at is not None and at > t:
            out.append(f"{where}: transaction {txn} acknowledged at {at} shows before it")
    for txn, at in acked.items():
        if at is not None and at <= t and txn not in seen:
            out.append(f"{where}: transaction {txn} acknowledged at {at} is missing")
    if final:
        out += [
            f"{where}: acknowledged plain append {ident} is missing"
            for ident in sorted(plain_acked - plain_seen)
        ]
    out += _check_keyed(where, keyed, specs, frozenset(seen))
    return out


def _check_keyed(
    where: str, keyed: pa.Table, specs: Mapping[int, TxnSpec], visible: frozenset[int]
) -> list[str]:
    """Each key holds the newest visible transaction that upserted it (a writer's
    transactions commit in id order), once; a key none upserted is absent."""
    out: list[str] = []
    held: dict[int, int] = {}
    for k, txn, diff in zip(
        *(keyed.column(c).to_pylist() for c in ("k", "txn", DIFF)), strict=True
    ):
        if diff != 1 or k in held:
            out.append(f"{where}: keyed shard holds key {k} twice or with diff {diff}")
        held[k] = txn
    newest: dict[int, int] = {}
    for txn in visible:
        spec = specs.get(txn)
        if spec is not None and spec.key is not None:
            newest[spec.key] = max(newest.get(spec.key, txn), txn)
    for k in sorted(set(held) | set(newest)):
        if held.get(k) != newest.get(k):
            out.append(
                f"{where}: keyed shard holds key {k} = transaction {held.get(k)}, but the newest "
                f"visible transaction upserting it is {newest.get(k)} (half a transaction)"
            )
    return out


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
        """Commit transaction after transaction, each resent until acknowledged."""
        ctx = self.ctx
        rng = random.Random(ctx.seed_for(f"txns-writer-{w}"))
        fc = ctx.client(f"txns-writer-{w}")
        fc.enable()
        members = [*self.names, KEYED]
        n = 0
        while not ctx.stop.is_set():
            n += 1
            chosen = rng.sample(members, rng.randint(2, 5))
            plain = [m for m in chosen if m != KEYED] or [rng.choice(list(self.names))]
            spec = TxnSpec(
                (w + 1) * ID_STRIDE + n,
                {m: rng.randint(1, 3) for m in plain},
                w * KEYS_PER_WRITER + rng.randrange(KEYS_PER_WRITER) if KEYED in chosen else None,
            )
            with self.book.lock:
                self.book.specs[spec.txn] = spec
            at = self._commit_until_acked(fc.client, f"txns-w{w}", n, spec)
            if at is not False:
                with self.book.lock:
                    self.book.acked[spec.txn] = at

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
                for member, n in spec.rows.items():
                    t.append(
                        self.names[member],
                        pa.table({"txn": [spec.txn] * n, "row": list(range(n))}, schema=TXN_SCHEMA),
                    )
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
        """Plain appends (one row, a token each) to random members, each until acknowledged."""
        ctx = self.ctx
        rng = random.Random(ctx.seed_for(f"txns-plain-{p}"))
        fc = ctx.client(f"txns-plain-{p}")
        writers = {
            m: fc.client.open_shard(name).writer(f"txns-plain-{p}")
            for m, name in self.names.items()
        }
        fc.enable()
        m = 0
        while not ctx.stop.is_set():
            m += 1
            ident = (p + 1) * ID_STRIDE + m
            row = pa.table({"txn": [-ident], "row": [0]}, schema=TXN_SCHEMA)
            writer = writers[rng.choice(list(writers))]
            while True:
                try:
                    writer.append(row, token=m)
                    break
                except (Determinate, Indeterminate):
                    ctx.rec.op("txns_plain_errors")
            with self.book.lock:
                self.book.plain_acked.add(ident)
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
            try:
                latest = min(h.latest_as_of() for h in handles)
            except (Determinate, Indeterminate):
                rec.op("txns_cut_retries")
                continue
            t = self._cut_time(handles, latest, rng)
            if t is None:
                ctx.stop.wait(0.005)
                continue
            try:
                tables = {m: h.snapshot_table(t) for m, h in plain.items()}
                keyed_table = keyed.snapshot_table(t)
            except InvalidFrontier:
                # t is at most every shard's upper - 1 (read just before, and uppers only
                # advance), so some shard's since passed t: a downgrade of this reader whose
                # reply was lost landed. Not a readable cut, and no violation.
                rec.op("txns_cuts_below_since")
                continue
            except PartNotFound as e:
                rec.violation(f"txns: leased cut at {t} failed, a committed part is gone: {e}")
                continue
            except (Determinate, Indeterminate):
                rec.op("txns_cut_retries")
                continue
            rec.op("txns_cuts")
            for v in check_cut(t, tables, keyed_table, self.book):
                rec.violation(v)
            rec.op("txns_cuts_checked")
        for h in handles:
            with contextlib.suppress(PersistError):
                h.close()

    def _cut_time(self, handles: list[ReadHandle], latest: int, rng: random.Random) -> int | None:
        """Downgrade the since of every handle more than ``CUT_WINDOW`` behind ``latest`` to one
        random time at most that far behind, then the time of the next cut: ``latest``, or
        (3 in 10) a random older one at or after every handle's since (None: a since is past
        ``latest``, after a landed downgrade whose reply was lost)."""
        target = rng.randint(max(0, latest - CUT_WINDOW), latest)
        for h in handles:
            if h.since < latest - CUT_WINDOW:
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
        the final upper and each transaction's time and shards in it (see the module doc)."""
        ctx = self.ctx
        with reliable_client(ctx.loc) as client:
            # A last transaction over every shard brings them all to one upper, so the final
            # cut holds every write.
            last = TxnSpec(0, dict.fromkeys(self.names, 1), -1)
            with self.book.lock:
                self.book.specs[last.txn] = last
            at = self._commit_until_acked(client, "txns-final", 1, last)
            with self.book.lock:
                self.book.acked[last.txn] = at
            plain, keyed = self._readers(client, "txns-verify")
            t = min(h.latest_as_of() for h in [*plain.values(), keyed])
            tables = {m: h.snapshot_table(t) for m, h in plain.items()}
            for v in check_cut(t, tables, keyed.snapshot_table(t), self.book, final=True):
                ctx.rec.violation(v)
            specs, acked, plain_acked = self.book.view()
            ctx.rec.op("txns_plain_appends_checked", len(plain_acked))
        assert self.follower is not None, "setup registers the listen"
        if not self.follower.finish(t + 1):
            return
        ctx.rec.op("txns_commits_checked", len(acked))
        for v in self.follower.check(specs, acked):
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
            for txn, at in zip(
                table.column("txn").to_pylist(), table.column(TIME).to_pylist(), strict=True
            ):
                if txn >= 0:
                    self.times[txn].add(at)
                    self.shards[txn].add(m)
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

    def check(self, specs: Mapping[int, TxnSpec], acked: Mapping[int, int | None]) -> list[str]:
        """Each acknowledged transaction seen at its acknowledged time alone (at one time, if
        acknowledged as already committed) in exactly the shards it named; none unplanned."""
        out: list[str] = []
        for txn in sorted(set(self.times) - set(specs)):
            out.append(f"txns: the listen sees transaction {txn}, which no writer planned")
        for txn, at in acked.items():
            seen_at, seen_in = self.times.get(txn, set()), self.shards.get(txn, set())
            if seen_in != specs[txn].members():
                out.append(
                    f"txns: the listen sees transaction {txn} in {sorted(seen_in)}, it wrote "
                    f"{sorted(specs[txn].members())} (half a transaction)"
                )
            if (at is not None and seen_at != {at}) or len(seen_at) > 1:
                out.append(
                    f"txns: the listen sees transaction {txn} at {sorted(seen_at)}, acknowledged "
                    f"at {at}"
                )
        return out
