"""Shard helpers shared by the streaming-source tests (with and without Spark)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import DataFrame, SparkSession

from pyspark_persist import source
from pyspark_persist.state import PersistClient, Shard
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import SharedState, StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.maintenance import compact

SCHEMA = pa.schema([("id", pa.int64()), ("s", pa.string())])
Row = tuple[int, str]


def merge_all(shard: Shard) -> None:
    """Compact the whole trace into one batch (retrying past background compactions)."""
    for _ in range(20):
        trace = shard.state().trace
        if len(trace) <= 1:
            return
        compact(shard.machine, trace)
    raise AssertionError("the trace never merged into one batch")


def rows(ids: range | list[int], diff: int = 1) -> pa.Table:
    """Updates of ``SCHEMA``; 32-char strings, so 100+ rows make a Blob (not inline) part."""
    ids = list(ids)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "s": [f"v{i:031d}" for i in ids],
            "_diff": pa.array([diff] * len(ids), pa.int64()),
        }
    )


def run_available_now(
    spark: SparkSession,
    shard: Shard | str,
    checkpoint: Path,
    options: dict[str, str] | None = None,
    on_batch: Any = None,
    schema: str | None = None,
) -> list[list[Any]]:
    """Run the source with Trigger.AvailableNow; every micro-batch's rows, in order.

    ``schema``: the query's ``.schema(...)`` (default: the shard's, as Spark asks it)."""
    batches: dict[int, list[Any]] = {}

    def collect(df: DataFrame, batch_id: int) -> None:
        if on_batch is not None:
            on_batch(batch_id)  # runs after planning, before the tasks read
        batches[batch_id] = df.collect()

    name = shard if isinstance(shard, str) else shard.name
    reader = spark.readStream.format("persist")
    if schema is not None:
        reader = reader.schema(schema)
    for k, v in (options or {}).items():
        reader = reader.option(k, v)
    q = (
        reader.load(name)
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180), "query did not finish"
    finally:
        q.stop()
    return [batches[k] for k in sorted(batches)]


def error_of(fn: Any) -> str:
    """The text of the exception ``fn`` raises (Spark wraps Python errors; keep it all)."""
    with pytest.raises(Exception) as ei:  # noqa: B017 - Spark wraps in several types
        fn()
    return str(ei.value)


class LostPushes:
    """A PubSub transport that looks connected (the shard's pushes look healthy) but delivers
    no push: every commit of another process is one whose push was lost (a full send queue,
    a writer with PubSub off or on another server)."""

    def push(self, shard_id: str, seqno: int) -> None:
        """Sends nothing."""

    def subscribe(self, shard_id: str, shared: SharedState, consensus_uri: str) -> None:
        """Acknowledged at once, and never heard from again."""
        shared.set_push_healthy(self, True)

    def unsubscribe(self, shard_id: str) -> None:
        """Nothing to undo."""


PUBSUB = "127.0.0.1:6879"


def reader_with_lost_pushes(
    monkeypatch: pytest.MonkeyPatch, blob: str, consensus: str
) -> list[int]:
    """Make streaming reads of the location with ``pubsub`` set to :data:`PUBSUB` use a client
    of their own (their own cached state, as in another process) whose pushes look healthy
    but never arrive, on a clock the test moves; return that clock (epoch ms in a
    one-element list)."""

    clock = [time.time_ns() // 1_000_000]
    client = PersistClient(
        open_blob(blob),
        open_consensus(consensus),
        publisher=LostPushes(),
        cache=StateCache(),
        clock_ms=lambda: clock[0],
    )
    monkeypatch.setitem(source._clients, (blob, consensus, PUBSUB), client)
    return clock
