"""Transactions across shards: a one-row transaction's commit beside a one-row append, one run.

On one location (``file/sqlite`` by default: file Blob, SQLite Consensus, the embedded
default; or ``file/postgres``, ``mem/mem``) the same client times, interleaved round by round
so drift in the machine's load hits every figure alike: ``shard.writer().append`` of a one-row
table to one shard (one compare-and-set), and ``client.txn()`` appending one row to each of 2
and of 10 shards (stage each share, then one compare-and-set of every shard's key). Reported as
p50 and p95, and the same-run ratios of the transactions' p50 over the append's (issue 37's
targets: at most 2x for 2 shards, 4x for 10).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pyspark_persist.state import PersistClient
from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag
from pyspark_persist.tools.bench.core import POSTGRES_URL

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
TARGETS = {2: 2.0, 10: 4.0}
"""Issue 37: a transaction over N shards, p50 over a one-row append's p50, at most."""
WARMUP = 20
"""Untimed commits of each kind first (connections, caches, the first rollups)."""


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


@dataclass(frozen=True)
class TxnResult(Result):
    """The one-row append's timings and each transaction size's."""

    location: str
    append: Timing
    txns: dict[int, Timing]

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
        return TxnResult(
            options.location,
            Timing("append", samples["append"]),
            {n: Timing(f"txn{n}", samples[f"txn{n}"]) for n in options.sizes},
        )
    finally:
        client.close()
        shutil.rmtree(home, ignore_errors=True)


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
    return "\n".join(lines)


BENCHMARK = Benchmark("txn", TxnOptions, run, render, __doc__)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
