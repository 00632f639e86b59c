"""The checker's ``txns`` piece: transactions across 2-5 shards under store faults, read in cuts.

Writers commit transactions (``client.txn``, :mod:`~pyspark_persist.state.txn_commit`)
over random subsets of ``TXN_SHARDS`` plain shards and one keyed shard, each
transaction's rows tagged with its id, while plain writers append to the
same shards and readers take cuts: the snapshot of every shard as of one
time ``t`` (a cut that meets a store fault is taken again). A commit whose
outcome is unknown (``Indeterminate``, or any store error) is resent, with
the same rows, writer id and token, until acknowledged.

Checked (:func:`check_cut`, on every cut and on the final one with faults
off): a transaction shows in every shard it named or in none, each row once
(a resend applied twice shows diff 2 or two rows), all at one time, the
time its commit acknowledged; an acknowledged transaction at or before
``t`` shows; the keyed shard holds for each key exactly the newest visible
transaction that upserted it. After the workload a listen of every shard
from 0 must see each transaction's rows at one time, the same in every
shard (:meth:`TxnShards.verify`).

Built from :mod:`.checker`'s fault menu, which imports this module only
when it builds the piece (this module builds on the checker's shared
pieces); the piece's sabotage, ``txn_one_by_one``, is in the checker's menu.
"""

from __future__ import annotations

import collections
import functools
import random
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import pyarrow as pa

from pyspark_persist.state import DIFF, TIME, PersistClient, ReadHandle
from pyspark_persist.state.errors import Determinate, Indeterminate, InvalidUsage

from .checker import Context, Piece, Recorder, reliable_client

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

    def setup(self) -> None:
        """The plain shards, each with [0, 1) written, and the keyed one with an empty upsert
        (so every member has a time to read at)."""
        with reliable_client(self.ctx.loc) as setup:
            for name in self.names.values():
                shard = setup.open_shard(name, TXN_SCHEMA)
                shard.writer("setup").compare_and_append(TXN_SCHEMA.empty_table(), 0, 1, token=1)
            keyed = setup.open_shard(self.keyed_name, TXN_KEYED_SCHEMA, keys=["k"])
            keyed.writer("setup").upsert(TXN_KEYED_SCHEMA.empty_table(), token=1)
        self.ctx.shards.extend([*self.names.values(), self.keyed_name])

    def loops(self) -> dict[str, Callable[[], None]]:
        """Transaction writers, plain writers and cut readers."""
        out: dict[str, Callable[[], None]] = {}
        for w in range(TXN_WRITERS):
            out[f"txns-writer-{w}"] = functools.partial(self.commit_loop, w)
        for p in range(PLAIN_WRITERS):
            out[f"txns-plain-{p}"] = functools.partial(self.plain_loop, p)
        for r in range(CUT_READERS):
            out[f"txns-cuts-{r}"] = functools.partial(self.cut_loop, r)
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
        """Take cuts at the newest time every shard has (or an older one) and check them."""
        ctx = self.ctx
        rng = random.Random(ctx.seed_for(f"txns-cuts-{r}"))
        fc = ctx.client(f"txns-cuts-{r}", reader=True)
        plain, keyed = self._readers(fc.client, f"txns-cuts-{r}")
        fc.enable()
        while not ctx.stop.is_set():
            try:
                t = min(h.latest_as_of() for h in [*plain.values(), keyed])
                if rng.random() < 0.3:
                    t = max(0, t - rng.randint(0, 50))
                tables = {m: h.snapshot_table(t) for m, h in plain.items()}
                keyed_table = keyed.snapshot_table(t)
            except (Determinate, Indeterminate):
                ctx.rec.op("txns_cut_retries")
                continue
            ctx.rec.op("txns_cuts")
            for v in check_cut(t, tables, keyed_table, self.book):
                ctx.rec.violation(v)
            ctx.rec.op("txns_cuts_checked")

    def verify(self) -> None:
        """Faults off: the final cut (every transaction settled), and a listen of each shard
        from 0 that sees each transaction's rows at one time, the same in every shard."""
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
            _, acked, _ = self.book.view()
            ctx.rec.op("txns_commits_checked", len(acked))
            times: dict[int, set[int]] = collections.defaultdict(set)
            for h in plain.values():
                for txn, at in _listen_all(h, t + 1, ctx.rec):
                    times[txn].add(at)
            for txn, seen_at in times.items():
                if acked.get(txn) is not None and seen_at != {acked[txn]}:
                    ctx.rec.violation(
                        f"txns: listens see transaction {txn} at {sorted(seen_at)}, acknowledged "
                        f"at {acked[txn]}"
                    )
                elif len(seen_at) > 1:
                    ctx.rec.violation(
                        f"txns: listens see transaction {txn} at several times {sorted(seen_at)}"
                    )


def _listen_all(reader: ReadHandle, upper: int, rec: Recorder) -> Iterator[tuple[int, int]]:
    """(transaction id, time) of every transaction row a listen from 0 reads up to ``upper``."""
    listen = reader.listen(0)
    try:
        frontier = 0
        while frontier < upper:
            event = listen.next(timeout_s=1.0)
            if event is None:
                continue
            frontier = event.upper
            table = reader.fetch(event.parts)
            rec.op("txns_listen_events")
            for txn, at in zip(
                table.column("txn").to_pylist(), table.column(TIME).to_pylist(), strict=True
            ):
                if txn >= 0:
                    yield txn, at
    finally:
        listen.close()
