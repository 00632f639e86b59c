"""Shard helpers shared by the streaming-source tests (with and without Spark)."""

from __future__ import annotations

import pyarrow as pa

from pyspark_persist.state import Shard
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
