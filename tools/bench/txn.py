"""Transactions across shards: a one-row transaction's commit beside a one-row append, one run.

On one location (``file/sqlite`` by default: file Blob, SQLite Consensus, the embedded
default; or ``file/postgres``, ``mem/mem``) the same client times, interleaved round by round
so drift in the machine's load hits every figure alike: ``shard.writer().append`` of a one-row
table to one shard (one compare-and-set), and ``client.txn()`` appending one row to each of 2
and of 10 shards (stage each share, then one compare-and-set of every shard's key). Reported as
p50 and p95, and the same-run ratios of the transactions' p50 over the append's (issue 37's
targets: at most 2x for 2 shards, 4x for 10).

Then freshness through PubSub (``--fresh-commits``; not on ``mem/mem``, which no other
process can reach): a :class:`~pyspark_persist.pubsub.server.PubSubServer` on loopback, a
writer and a reader in separate clients with separate state caches and publishers (as two
processes would be, the way ``persist bench pubsub`` times them), and the reader following
(a) a plain shard written by one-row appends and (b) a shard written by one-row
transactions over it and a second shard, round by round, alternating which goes first.
Each row is timed from its commit returning to the reader holding it: p50, p95, max of
each, and the ratios txn/plain at p50 and p95 (issue 37: at most 1.2x). The ceiling peer is
the PubSub round trip alone, interleaved with them: the writer's publisher pushing a SeqNo
to the reader's, with no Consensus read behind it.
"""

from __future__ import annotations

import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import pyarrow as pa

from pyspark_persist.pubsub.server import PubSubServer
from pyspark_persist.state import PersistClient, ShardState
from pyspark_persist.state.cache import SharedState
from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag
from pyspark_persist.tools.bench.core import POSTGRES_URL
from pyspark_persist.tools.bench.listen import Follower
from pyspark_persist.tools.bench.pubsub import close_client, pubsub_client, wait_healthy

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
TARGETS = {2: 2.0, 10: 4.0}
"""Issue 37: a transaction over N shards, p50 over a one-row append's p50, at most."""
WARMUP = 20
"""Untimed commits of each kind first (connections, caches, the first rollups)."""
FRESH_TARGET = 1.2
"""Issue 37: a transactional shard's freshness through PubSub, over a plain shard's, at most
(at p50 and at p95)."""
FRESH_WARMUP = 5
"""Untimed rounds of the freshness section first (the PubSub streams, the first reads)."""
FRESH_GAP_MS = (5.0, 20.0)
"""The random pause before each commit (and push) the freshness section times: the reader
is idle when it comes, as behind a real writer, rather than still reading the last one."""
SEEN_TIMEOUT_S = 10.0
"""A row the reader has not seen this long after its commit is counted missed."""


@dataclass(frozen=True)
class TxnOptions(Options):
    """How many commits are timed, of which transaction sizes, where."""

    commits: int = flag(500, "commits timed of each kind", quick=60, positive=True)
    shards: tuple[str, ...] = flag(
        ("2", "10"), "transaction sizes (shards per transaction), comma-separated"
    )
    location: str = flag(
        "file/sqlite",
        "blob/consensus kinds",
        choices=("file/sqlite", "file/postgres", "mem/mem"),
        parse=str,
    )
    postgres_url: str = flag(POSTGRES_URL, "PostgreSQL consensus URL (for file/postgres)")
    fresh_commits: int = flag(
        100, "freshness: commits of each kind a PubSub reader times (0: skip it)", quick=30
    )
    seed: int = flag(7, "seed of the freshness section's random pauses")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.fresh_commits < 0:
            raise ValueError("--fresh-commits must be 0 (no freshness section) or more")

    @property
    def sizes(self) -> list[int]:
        """``shards`` as numbers."""
        return [int(s) for s in self.shards]


@dataclass(frozen=True)
class Timing:
    """Seconds per commit of one kind."""

    name: str
    seconds: list[float]

    @property
    def p50_ms(self) -> float:
        """The median commit, in milliseconds."""
        return statistics.median(self.seconds) * 1e3

    @property
    def p95_ms(self) -> float:
        """The 95th percentile, in milliseconds."""
        return float(np.percentile(np.asarray(self.seconds), 95)) * 1e3

    @property
    def max_ms(self) -> float:
        """The slowest, in milliseconds."""
        return max(self.seconds) * 1e3


@dataclass(frozen=True)
class Freshness:
    """Commit returned -> reader holds the row, through PubSub, of each kind, one run."""

    plain: Timing
    """Rows appended to a plain shard."""
    txn: Timing
    """Rows committed by a transaction over the shard read and one more."""
    round_trip: Timing
    """The ceiling peer: a push from the writer's publisher reaching the reader's."""
    missed: int
    """Rows (of either kind) the reader had not seen :data:`SEEN_TIMEOUT_S` after commit."""

    @property
    def ratio_p50(self) -> float:
        """The transactional shard's p50 over the plain shard's."""
        return self.txn.p50_ms / self.plain.p50_ms

    @property
    def ratio_p95(self) -> float:
        """The transactional shard's p95 over the plain shard's."""
        return self.txn.p95_ms / self.plain.p95_ms


@dataclass(frozen=True)
class TxnResult(Result):
    """The one-row append's timings and each transaction size's."""

    location: str
    append: Timing
    txns: dict[int, Timing]
    freshness: Freshness | None
    """``None`` when skipped (``--fresh-commits 0``, or ``mem/mem``)."""

    def ratio(self, size: int) -> float:
        """A transaction over ``size`` shards: its p50 over the append's."""
        return self.txns[size].p50_ms / self.append.p50_ms


def _uris(options: TxnOptions, home: str) -> tuple[str, str]:
    tag = uuid.uuid4().hex
    if options.location == "mem/mem":
        return f"mem://{tag}", f"mem://{tag}"
    if options.location == "file/postgres":
        return f"file://{home}/blob", options.postgres_url
    return f"file://{home}/blob", f"sqlite:///{home}/consensus.db"


def run(options: TxnOptions) -> TxnResult:
    """Time the append and each transaction size, round-robin, on one client."""
    home = tempfile.mkdtemp(prefix="persist-bench-txn-")
    # The default config (maintenance on), as persist bench core's small writes run.
    client = PersistClient.open(*_uris(options, home))
    try:
        single = client.open_shard(f"append-{uuid.uuid4().hex[:8]}", SCHEMA).writer()
        groups = {
            n: [
                client.open_shard(f"t{n}-{i}-{uuid.uuid4().hex[:8]}", SCHEMA).name for i in range(n)
            ]
            for n in options.sizes
        }
        row = pa.table({"id": [1], "name": ["one row"]}, schema=SCHEMA)

        def append() -> None:
            single.append(row)

        def txn(names: list[str]) -> Callable[[], None]:
            def commit() -> None:
                with client.txn() as t:
                    for name in names:
                        t.append(name, row)

            return commit

        kinds: dict[str, Callable[[], None]] = {"append": append}
        kinds.update({f"txn{n}": txn(names) for n, names in groups.items()})
        samples: dict[str, list[float]] = {k: [] for k in kinds}
        step(f"{WARMUP} untimed commits of each kind, then {options.commits} timed")
        for i in range(WARMUP + options.commits):
            for name, fn in kinds.items():
                start = time.perf_counter()
                fn()
                if i >= WARMUP:
                    samples[name].append(time.perf_counter() - start)
        fresh = None
        if options.fresh_commits and options.location != "mem/mem":
            step(f"freshness: {options.fresh_commits} commits of each kind to a PubSub reader")
            fresh = measure_freshness(_uris(options, home), options.fresh_commits, options.seed)
        return TxnResult(
            options.location,
            Timing("append", samples["append"]),
            {n: Timing(f"txn{n}", samples[f"txn{n}"]) for n in options.sizes},
            fresh,
        )
    finally:
        client.close()
        shutil.rmtree(home, ignore_errors=True)


class _PushStamps(SharedState):
    """A reader's shared state of a shard that only notes when each push reached it: no
    Consensus read behind it, so what it times is the PubSub round trip alone."""

    def __init__(self, shard_id: str, state: ShardState) -> None:
        super().__init__(shard_id)
        self.update(state)
        self._arrived: dict[int, float] = {}
        self._cond = threading.Condition()

    def apply_pushed(self, seqno: int) -> bool:
        """Note when the push of ``seqno`` arrived; take it as confirmed."""
        with self._cond:
            self._arrived.setdefault(seqno, time.perf_counter())
            self._cond.notify_all()
        return True

    def wait(self, seqno: int, timeout_s: float) -> float | None:
        """When the push of ``seqno`` arrived, waiting up to ``timeout_s`` for it."""
        with self._cond:
            self._cond.wait_for(lambda: seqno in self._arrived, timeout_s)
            return self._arrived.get(seqno)


def _wait_until(check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)


def measure_freshness(uris: tuple[str, str], commits: int, seed: int) -> Freshness:
    """Time rows from commit to a PubSub reader: appended to a plain shard, committed by
    2-shard transactions to another, and a bare push, interleaved round by round."""
    server = PubSubServer("127.0.0.1", 0).start()
    writer, reader = pubsub_client(uris, server.address), pubsub_client(uris, server.address)
    followers: list[Follower] = []
    try:
        tag = uuid.uuid4().hex[:8]
        plain, data, other, echo = (f"fresh-{k}-{tag}" for k in ("plain", "txn", "other", "push"))
        for name in (plain, data, other, echo):
            writer.open_shard(name, SCHEMA)
        plain_writer = writer.open_shard(plain).writer()

        def append(row: pa.Table) -> None:
            plain_writer.append(row)

        def txn(row: pa.Table) -> None:
            # The shard read last: its commit is announced after the other participant's.
            with writer.txn() as t:
                t.append(other, row)
                t.append(data, row)

        def row(i: int) -> pa.Table:
            return pa.table({"id": [i], "name": ["one row"]}, schema=SCHEMA)

        shards = {"plain": (plain, append), "txn": (data, txn)}
        following = {}
        for kind, (name, commit) in shards.items():
            commit(row(-1))  # a listen starts from a complete time
            wait_healthy(writer, name, server.address)
            following[kind] = Follower(
                reader.open_shard(name), partial(wait_healthy, reader, name, server.address)
            )
            followers.append(following[kind])
        echo_state = writer.machine(echo).state()
        stamps = _PushStamps(echo, echo_state)
        reader.publisher.subscribe(echo, stamps, reader.consensus.uri)
        _wait_until(lambda: stamps.push_healthy, 10.0)

        rng = random.Random(seed)
        seen: dict[str, list[float]] = {"plain": [], "txn": [], "push": []}
        missed = 0
        kinds = [*shards, "push"]
        for i in range(FRESH_WARMUP + commits):
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                time.sleep(rng.uniform(*FRESH_GAP_MS) / 1e3)
                if kind == "push":
                    seqno = echo_state.seqno + 1 + i
                    writer.publisher.push(echo, seqno)
                    sent = time.perf_counter()
                    arrived = stamps.wait(seqno, SEEN_TIMEOUT_S)
                else:
                    shards[kind][1](row(i))
                    sent = time.perf_counter()
                    arrived = following[kind].wait(i, SEEN_TIMEOUT_S)
                if i < FRESH_WARMUP:
                    continue
                if arrived is None:
                    missed += kind != "push"
                    continue
                seen[kind].append(arrived - sent)
        for kind, times in seen.items():
            if not times:
                raise RuntimeError(
                    f"freshness: the reader saw none of {commits} {kind} commits within "
                    f"{SEEN_TIMEOUT_S:g} s each: is PubSub or the listen broken?"
                )
        return Freshness(
            Timing("plain", seen["plain"]),
            Timing("txn", seen["txn"]),
            Timing("push", seen["push"]),
            missed,
        )
    finally:
        for follower in followers:
            follower.close()
        close_client(writer)
        close_client(reader)
        server.stop()


def render(r: TxnResult) -> str:
    """The figures and the same-run ratios against issue 37's targets."""
    lines = [
        f"one-row commits on {r.location}, one run, interleaved",
        f"  append to 1 shard        p50 {r.append.p50_ms:6.2f} ms  p95 {r.append.p95_ms:6.2f} ms",
    ]
    for n, t in r.txns.items():
        ratio = r.ratio(n)
        target = TARGETS.get(n)
        verdict = ""
        if target is not None:
            met = "met" if ratio <= target else "NOT met"
            verdict = f" (target <= {target:g}x: {met})"
        lines.append(
            f"  txn over {n:>2} shards      p50 {t.p50_ms:6.2f} ms  p95 {t.p95_ms:6.2f} ms  "
            f"{ratio_text(ratio, target or 0.0)} the append{verdict}"
        )
    if r.freshness is not None:
        lines += ["", *_render_freshness(r.location, r.freshness)]
    elif r.location == "mem/mem":
        lines.append(
            "freshness through PubSub: not timed on mem/mem (no other process can reach "
            "it: use --location file/sqlite)"
        )
    return "\n".join(lines)


def _fresh_row(label: str, t: Timing) -> str:
    return f"  {label:<40} p50 {t.p50_ms:6.2f} ms  p95 {t.p95_ms:6.2f} ms  max {t.max_ms:7.2f} ms"


def _fresh_verdict(ratio: float) -> str:
    met = "ok" if ratio <= FRESH_TARGET else "missed"
    return f"{ratio_text(ratio, FRESH_TARGET)} (target <= {FRESH_TARGET:g}x: {met})"


def _render_freshness(location: str, f: Freshness) -> list[str]:
    """The freshness section: each kind's figures, then txn/plain against the 1.2x target."""
    lines = [
        f"freshness through PubSub on {location} (gRPC on loopback; writer and reader in "
        f"separate clients), {len(f.plain.seconds)} rows of each kind, interleaved",
        "  commit returned -> reader holds the row",
        _fresh_row("plain shard, one-row appends", f.plain),
        _fresh_row("txn shard, one-row 2-shard transactions", f.txn),
        _fresh_row("ceiling: PubSub round trip alone", f.round_trip),
        f"  txn/plain  p50 {_fresh_verdict(f.ratio_p50)}  p95 {_fresh_verdict(f.ratio_p95)}",
    ]
    if f.missed:
        lines.append(f"  {f.missed} rows not seen within {SEEN_TIMEOUT_S:g} s (left out above)")
    return lines


BENCHMARK = Benchmark("txn", TxnOptions, run, render, __doc__)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
