"""Upserts into a keyed shard against deltalake's (delta-rs) merge of the same rows, one run.

A keyed shard of ``--rows`` rows (file Blob, SQLite Consensus) and a Delta table of the same
rows on the same disk take the same upserts: ``--upsert-rows`` rows whose keys are existing
keys drawn at random (1% of a 1,000,000-row table by default), each a new value. Timed per
upsert, ``--rounds`` of them: persist's ``WriteHandle.upsert`` (the lookup of the current rows
and one compare_and_append) and Delta's ``merge`` (``when_matched_update_all``,
``when_not_matched_insert_all``), after one untimed warm-up upsert of each at each size
(persist's first upsert after a load reads the new parts' key columns into its cache). Then
the shard grows to ``--grow-to`` rows and the same upserts are timed again: what a 10x bigger
shard costs per upsert. Reported as same-run ratios: Delta's commit p50 over persist's (target
at least 5x), and persist's p50 at the grown size over the first (target at most 2x).

Last, the read after a history of upserts (issue 35): a fresh keyed shard of ``--rows`` rows
with a retention period of 1 ms (so since follows the clock: without a reader or a retention
since never moves and compaction can fold nothing) takes ``--history-rounds`` upserts of
``--upsert-rows`` random existing keys each, then compaction and GC run to completion. Its
full snapshot read (best of 7, taking turns with the other's) is set against the same live rows
written once into another fresh keyed shard and read the same way (target at least 0.8x that
read's speed), and the Blob bytes of its live parts against the written-once shard's (target
at most 2x).
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from pyspark_persist.state import PersistClient, Shard
from pyspark_persist.tools.bench import ratio_text, step
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("amount", pa.float64())])
LOAD_CHUNK = 500_000
"""Rows per upsert while loading (ids in order: each load upsert's key range is new)."""
SPEEDUP_TARGET = 5.0
GROWTH_TARGET = 2.0
HISTORY_READ_TARGET = 0.8
"""The upserted shard's read speed over the written-once shard's, at least."""
HISTORY_BYTES_TARGET = 2.0
"""The upserted shard's live part bytes over the written-once shard's, at most."""
READS = 7
"""Reads of each shard after the history, the two shards' alternating: on a shared machine a
burst of load then slows both (a compacted keyed shard reads in milliseconds)."""
HISTORY_RETENTION_MS = 1
"""The upserted shard's retention: since follows the clock, so compaction may fold every
retracted version (times are epoch milliseconds; since never passes ``upper - 1``)."""


@dataclass(frozen=True)
class UpsertOptions(Options):
    """How big the table is, how big each upsert, how many are timed."""

    rows: int = flag(
        1_000_000, "rows in the shard and the Delta table", quick=20_000, positive=True
    )
    upsert_rows: int = flag(10_000, "rows per upsert (existing keys)", quick=200, positive=True)
    rounds: int = flag(5, "upserts timed at each size", quick=3, positive=True)
    grow_to: int = flag(
        10_000_000, "rows the shard grows to for the growth figure (0: skip)", quick=60_000
    )
    seed: int = flag(1, "seed of the random keys")
    history_rounds: int = flag(
        100, "upserts before the read-after-history figure (0: skip)", quick=20
    )


@dataclass(frozen=True)
class HistoryFigures:
    """A shard read after ``rounds`` upserts and compaction, beside the same rows written once."""

    rounds: int
    live_rows: int
    upserted_read_s: list[float]
    once_read_s: list[float]
    upserted_bytes: int
    once_bytes: int
    upserted_batches: int
    upserted_parts: int
    settle_s: float

    @property
    def read_ratio(self) -> float:
        """The written-once read's best time over the upserted one's: the upserted shard's
        read speed as a fraction of the written-once shard's."""
        return min(self.once_read_s) / min(self.upserted_read_s)

    @property
    def bytes_ratio(self) -> float:
        """The upserted shard's live part bytes over the written-once shard's."""
        return self.upserted_bytes / self.once_bytes


@dataclass(frozen=True)
class UpsertResult(Result):
    """Per-upsert seconds of each system, and the grown shard's."""

    rows: int
    upsert_rows: int
    persist_s: list[float]
    delta_s: list[float]
    grown_rows: int
    grown_s: list[float]
    persist_load_s: float
    delta_load_s: float
    history: HistoryFigures | None

    @property
    def persist_p50_s(self) -> float:
        """persist's upsert commit p50."""
        return statistics.median(self.persist_s)

    @property
    def delta_p50_s(self) -> float:
        """Delta's merge p50."""
        return statistics.median(self.delta_s)

    @property
    def speedup(self) -> float:
        """Delta's p50 over persist's: how many times faster persist upserts."""
        return self.delta_p50_s / self.persist_p50_s

    @property
    def growth(self) -> float | None:
        """persist's p50 at ``grown_rows`` over its p50 at ``rows`` (None: not grown)."""
        return statistics.median(self.grown_s) / self.persist_p50_s if self.grown_s else None


def _rows(ids: np.ndarray, tag: str) -> pa.Table:
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([f"{tag}{i}" for i in ids.tolist()], pa.string()),
            "amount": pa.array(ids * 0.5 + len(tag), pa.float64()),
        },
        schema=SCHEMA,
    )


def _load(shard: Shard, start: int, stop: int) -> None:
    writer = shard.writer()
    for lo in range(start, stop, LOAD_CHUNK):
        writer.upsert(_rows(np.arange(lo, min(stop, lo + LOAD_CHUNK)), "n"))


def _timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def _alternate_reads(*shards: Shard) -> list[list[float]]:
    """:data:`READS` full snapshot reads of each of ``shards``, taking turns: their seconds."""
    readers = [shard.reader() for shard in shards]
    seconds: list[list[float]] = [[] for _ in shards]
    for _ in range(READS):
        for reader, times in zip(readers, seconds, strict=True):
            times.append(_timed(reader.snapshot_table))
    for reader in readers:
        reader.close()
    return seconds


def _live_bytes(shard: Shard) -> tuple[int, int, int]:
    """The Blob bytes of ``shard``'s live parts, its batches and its parts."""
    parts = [p for b in shard.state().batches.values() for p in b.parts]
    return sum(p.size_bytes for p in parts), len(shard.state().batches), len(parts)


def _history(
    client: PersistClient, opts: UpsertOptions, rng: np.random.Generator
) -> HistoryFigures:
    """Upsert a fresh shard ``opts.history_rounds`` times, settle compaction and GC, and read
    it beside the same live rows written once."""
    # A since that never moves (no reader downgrading, no retention) lets compaction fold none
    # of the retracted versions: a retention period is what advances it on a shard nobody reads.
    shard = client.open_shard("history", SCHEMA, keys=["id"], retention_ms=HISTORY_RETENTION_MS)
    step(f"history: loading {opts.rows:,} rows into a fresh keyed shard")
    _load(shard, 0, opts.rows)
    writer = shard.writer()
    for r in range(opts.history_rounds):
        if r % 10 == 0:
            step(f"history: upsert round {r + 1}/{opts.history_rounds}")
        writer.upsert(_rows(rng.choice(opts.rows, opts.upsert_rows, replace=False), f"h{r}-"))
    step("history: waiting for compaction and GC to finish")
    started = time.perf_counter()
    client.maintenance.wait_idle(600)
    shard.gc()  # advances since to the retention bound, then compaction may fold past it
    shard.compact()
    shard.gc()  # frees the parts compaction replaced
    settle_s = time.perf_counter() - started
    upserted_bytes, batches, parts = _live_bytes(shard)
    with shard.reader() as reader:
        live = reader.snapshot_table()
    once = client.open_shard("history-once", SCHEMA, keys=["id"])
    step(f"history: writing the {live.num_rows:,} live rows once into a fresh keyed shard")
    once.writer().upsert(live.select(SCHEMA.names))
    client.maintenance.wait_idle(600)
    once_bytes = _live_bytes(once)[0]
    step("history: reading the upserted shard and the written-once one, taking turns")
    upserted_s, once_s = _alternate_reads(shard, once)
    return HistoryFigures(
        opts.history_rounds,
        live.num_rows,
        upserted_s,
        once_s,
        upserted_bytes,
        once_bytes,
        batches,
        parts,
        settle_s,
    )


def run(opts: UpsertOptions) -> UpsertResult:
    """Load both tables, time the upserts, grow the shard, time them again."""
    from deltalake import DeltaTable, write_deltalake

    root = tempfile.mkdtemp(prefix="persist-bench-upsert-")
    rng = np.random.default_rng(opts.seed)
    try:
        client = PersistClient.open(f"file://{root}/blob", f"sqlite:///{root}/consensus.db")
        shard = client.open_shard("upsert", SCHEMA, keys=["id"])
        step(f"loading {opts.rows:,} rows into a keyed shard and a Delta table")
        persist_load = _timed(lambda: _load(shard, 0, opts.rows))
        client.maintenance.wait_idle()
        delta_path = f"{root}/delta"
        delta_load = _timed(lambda: write_deltalake(delta_path, _rows(np.arange(opts.rows), "n")))
        batches = [
            _rows(rng.choice(opts.rows, opts.upsert_rows, replace=False), f"u{r}-")
            for r in range(opts.rounds + 1)
        ]
        writer = shard.writer()
        persist_s, delta_s = [], []
        for r, batch in enumerate(batches):
            if r == 0:  # the warm-up, untimed: each system's first upsert after the load
                writer.upsert(batch)
                DeltaTable(delta_path).merge(
                    source=batch, predicate="t.id = s.id", source_alias="s", target_alias="t"
                ).when_matched_update_all().when_not_matched_insert_all().execute()
                continue
            step(f"upsert {r}/{opts.rounds}: persist, then Delta merge")
            persist_s.append(_timed(lambda b=batch: writer.upsert(b)))  # type: ignore[misc]
            table = DeltaTable(delta_path)
            delta_s.append(
                _timed(
                    lambda b=batch, t=table: (
                        t.merge(  # type: ignore[misc]
                            source=b, predicate="t.id = s.id", source_alias="s", target_alias="t"
                        )
                        .when_matched_update_all()
                        .when_not_matched_insert_all()
                        .execute()
                    )
                )
            )
        grown_s: list[float] = []
        if opts.grow_to > opts.rows:
            step(f"growing the shard to {opts.grow_to:,} rows")
            _load(shard, opts.rows, opts.grow_to)
            client.maintenance.wait_idle()
            for r in range(opts.rounds + 1):
                keys = rng.choice(opts.grow_to, opts.upsert_rows, replace=False)
                rows = _rows(keys, f"g{r}-")
                elapsed = _timed(lambda b=rows: writer.upsert(b))  # type: ignore[misc]
                if r:  # the first (the warm-up, reading the new parts' keys) is not counted
                    grown_s.append(elapsed)
        history = _history(client, opts, rng) if opts.history_rounds else None
        client.close()
        return UpsertResult(
            opts.rows,
            opts.upsert_rows,
            persist_s,
            delta_s,
            max(opts.grow_to, opts.rows) if grown_s else opts.rows,
            grown_s,
            persist_load,
            delta_load,
            history,
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


def render(r: UpsertResult) -> str:
    """The figures as people read them, with the targets."""
    met = "met" if r.speedup >= SPEEDUP_TARGET else "NOT met"
    lines = [
        f"upsert {r.upsert_rows:,} rows (existing keys, random) into {r.rows:,} rows, "
        "file/sqlite, one run",
        f"  persist upsert p50  {r.persist_p50_s * 1000:8.1f} ms   "
        f"(each: {', '.join(f'{s * 1000:.0f}' for s in r.persist_s)} ms)",
        f"  delta merge p50     {r.delta_p50_s * 1000:8.1f} ms   "
        f"(each: {', '.join(f'{s * 1000:.0f}' for s in r.delta_s)} ms)",
        f"  persist is {ratio_text(r.speedup, SPEEDUP_TARGET)} faster "
        f"(target >= {SPEEDUP_TARGET:g}x: {met})",
        f"  load: persist {r.persist_load_s:.1f} s, delta {r.delta_load_s:.1f} s",
    ]
    if r.growth is not None:
        ok = "met" if r.growth <= GROWTH_TARGET else "NOT met"
        lines.append(
            f"  grown to {r.grown_rows:,} rows: p50 {statistics.median(r.grown_s) * 1000:.1f} ms, "
            f"{ratio_text(r.growth, GROWTH_TARGET)} the first (target <= {GROWTH_TARGET:g}x: {ok})"
        )
    h = r.history
    if h is not None:
        read_ok = "met" if h.read_ratio >= HISTORY_READ_TARGET else "NOT met"
        bytes_ok = "met" if h.bytes_ratio <= HISTORY_BYTES_TARGET else "NOT met"
        lines += [
            f"  after {h.rounds} upserts of {r.upsert_rows:,} rows, compaction and GC settled "
            f"({h.settle_s:.1f} s): {h.live_rows:,} live rows in {h.upserted_batches} batches, "
            f"{h.upserted_parts} parts",
            f"    read (best of {READS}): {min(h.upserted_read_s) * 1000:.0f} ms, written once "
            f"{min(h.once_read_s) * 1000:.0f} ms: {ratio_text(h.read_ratio, HISTORY_READ_TARGET)} "
            f"its speed (target >= {HISTORY_READ_TARGET:g}x: {read_ok})",
            f"    live part bytes: {h.upserted_bytes / 1e6:.1f} MB, written once "
            f"{h.once_bytes / 1e6:.1f} MB: {ratio_text(h.bytes_ratio, HISTORY_BYTES_TARGET)} "
            f"(target <= {HISTORY_BYTES_TARGET:g}x: {bytes_ok})",
        ]
    return "\n".join(lines)


BENCHMARK = Benchmark("upsert", UpsertOptions, run, render, __doc__)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
