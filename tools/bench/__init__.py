"""Benchmarks of persist, one module each, all through one interface (:mod:`.api`).

:data:`BENCHMARKS` is the one table of them: the ``persist bench`` subcommands are built
from it, and ``persist bench all`` (:mod:`.report`) runs the others. Each module holds a
``BENCHMARK`` (:class:`~pyspark_persist.tools.bench.api.Benchmark`); this package imports
none of them, so listing them costs nothing.
"""

import sys
from typing import NamedTuple


class Entry(NamedTuple):
    """A benchmark in :data:`BENCHMARKS`."""

    module: str
    """Its module under ``pyspark_persist.tools.bench``, which defines ``BENCHMARK``."""
    summary: str
    """One line for ``persist bench --help``."""


BENCHMARKS: dict[str, Entry] = {
    "core": Entry("core", "small-write and listen latency, throughput vs raw pyarrow, peak memory"),
    "maintenance": Entry("maintenance", "compaction and GC: storage and read speed-up"),
    "pubsub": Entry("pubsub", "write-to-listen latency and Consensus load with and without PubSub"),
    "spark-read": Entry("spark_read", "Spark batch and streaming reads of a shard"),
    "spark-write": Entry("spark_write", "the Spark sink's throughput and commit latency"),
    "spark-freshness": Entry(
        "spark_freshness",
        "two streaming queries: sink -> source freshness and per-phase costs beside files",
    ),
    "load": Entry("load", "many writers and readers at once"),
    "upsert": Entry("upsert", "keyed-shard upserts against deltalake's merge; growth to 10x"),
    "delivery": Entry(
        "delivery",
        "a persist stream into PostgreSQL: bulk vs Spark's JDBC writer, freshness, consumer cost",
    ),
    "txn": Entry("txn", "a one-row transaction over 2 and 10 shards beside a one-row append"),
    "all": Entry("report", "every benchmark, one report"),
}
"""``persist bench NAME`` -> where its ``BENCHMARK`` is, and what it measures."""


def step(msg: str) -> None:
    """One step of a long benchmark, as a line on stderr (stdout carries only its report,
    which ``--json`` keeps parseable)."""
    print(f"... {msg}", file=sys.stderr, flush=True)


def ratio_text(value: float, target: float) -> str:
    """``value`` as a ratio beside ``target``: two decimals, or three where two would round
    it onto the target and hide which side it is on (0.997 printed "1.00x NOT met")."""
    shown = f"{value:.2f}"
    if float(shown) == target and value != target:
        shown = f"{value:.3f}"
    return f"{shown}x"
