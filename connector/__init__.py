"""pyspark_persist: Materialize's persist as a Spark source and sink (``format("persist")``).

The story
---------
A *shard* is a durable changelog: updates ``(row, time, diff)`` in
immutable *parts* in Blob, and a small versioned state in Consensus that
names them, with two frontiers: ``upper`` (times before it are final) and
``since`` (times before it were compacted). The shard itself lives in
:mod:`pyspark_persist.state`; this package is the Spark data source over it,
and only that.

A *write* is two-phase, as in persist. Each task of a job or micro-batch
stages its rows as parts in Blob (``writer.py``, invisible so far) and hands
their names to the driver; the driver's ``commit`` makes all of them visible
in one compare-and-append at a fresh time, carrying the micro-batch id as an
idempotency token, so a replay after a crash is applied once. Overwrite and
complete mode retract the old contents in the same commit, by reference.

A *read* is planned on the driver and executed on executors. The driver
registers a leased reader (so GC keeps what it plans), asks
:func:`~pyspark_persist.state.planning.plan_read` which parts answer the
read (the collection at ``asOf``, a ``readChanges`` range, or one
micro-batch between two stream offsets, capped by ``maxBytesPerTrigger``
and friends) and ships the parts, split by size, as input partitions; each
task fetches its parts from Blob and streams them as Arrow
(``batch_reader.py``, ``stream_reader.py``). A streaming offset is a time
(an upper, computed by the pure functions of ``offsets.py``), so a restarted
query re-reads exactly the same updates. A stream with ``.option("consumer",
NAME)`` also keeps its position in Consensus (``consumers``), so a query that
lost its checkpoint resumes there and replays the same ranges.

Three helpers for ``foreachBatch`` go beyond one shard and one sink:
``exactly_once(fn)`` tells ``fn`` a token naming the micro-batch's range of the
shard, which ``sinks.postgres`` stores with its output in one PostgreSQL
transaction (``batch_tokens.py``, ``sinks.py``); ``txn(spark, ...)`` stages
DataFrames into several shards on the executors and commits them all at one
time with one compare-and-set (``spark_txn.py``).

``DefaultSource`` (here) is the data source named ``persist``. Spark finds
it by importing every top-level ``pyspark_*`` module, so this module stays
cheap and side-effect free: ``DefaultSource`` is resolved on first access,
and importing ``pyspark_persist.state`` never imports Spark. Sibling
packages: :mod:`pyspark_persist.pubsub` pushes state diffs between
processes; :mod:`pyspark_persist.tools` holds the CLI, checker and
benchmarks, which use this package and are never used by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark_persist import sinks
    from pyspark_persist.batch_tokens import exactly_once
    from pyspark_persist.source import PersistDataSource as DefaultSource
    from pyspark_persist.spark_txn import txn

__all__ = ["DefaultSource", "exactly_once", "sinks", "txn"]


def __getattr__(name: str) -> Any:
    """The public names, each imported on first use (Spark imports this module on start-up)."""
    if name == "DefaultSource":
        from pyspark_persist.source import PersistDataSource

        return PersistDataSource
    if name == "txn":
        from pyspark_persist.spark_txn import txn

        return txn
    if name == "exactly_once":
        from pyspark_persist.batch_tokens import exactly_once

        return exactly_once
    if name == "sinks":
        import importlib

        return importlib.import_module("pyspark_persist.sinks")
    raise AttributeError(f"module 'pyspark_persist' has no attribute {name!r}")
