"""Updates of a one-column shard ``(k int64)`` and the multiset a snapshot of it stands for.

Shared by the state tests that reason about which keys survive a fault: they build updates
with explicit times and compare snapshots as multisets.
"""

from __future__ import annotations

import collections

import pyarrow as pa

from pyspark_persist.state import DIFF

SCHEMA = pa.schema([("k", pa.int64())])


def updates(keys: list[int], t: int) -> pa.Table:
    """One row per key at time ``t`` with diff +1."""
    n = len(keys)
    return pa.table(
        {
            "k": pa.array(keys, pa.int64()),
            "_time": pa.array([t] * n, pa.uint64()),
            DIFF: pa.array([1] * n, pa.int64()),
        }
    )


def counts(table: pa.Table) -> collections.Counter[int]:
    """The multiset a snapshot table stands for."""
    out: collections.Counter[int] = collections.Counter()
    for k, d in zip(table.column("k").to_pylist(), table.column(DIFF).to_pylist(), strict=True):
        out[k] += d
    return +out
