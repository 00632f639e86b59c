"""A read of some columns is split by what it takes of each part, not by the parts' bytes.

``splitSizeBytes`` sizes tasks by bytes; a query naming 2 of 40 columns hands Spark a
small share of each part, so split by stored bytes it got as many tasks as a full scan,
each with little to do but start (measured: 9 tasks took twice the time of 2 on a 512 MiB
shard of 40 columns). These tests plan reads on the driver side, without Spark.
"""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pyspark_persist.batch_reader import PersistBatchReader
from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import CHECKSUM_SHARE, read_schema, read_share
from pyspark_persist.state import PersistClient, PersistConfig

WIDE = pa.schema(
    [(f"l{i}", pa.int64()) for i in range(20)]
    + [(f"d{i}", pa.float64()) for i in range(10)]
    + [(f"s{i}", pa.string()) for i in range(10)]
)


def test_a_full_read_costs_every_byte_and_a_subset_its_share() -> None:
    """Every column: 1.0; fewer columns cost less, never less than the checksum's share."""
    assert read_share(WIDE, WIDE.names) == 1.0
    two = read_share(WIDE, ["l5", "s7"])
    one = read_share(WIDE, ["l5"])
    none = read_share(WIDE, [])
    assert CHECKSUM_SHARE < none < one < two < 0.3
    assert read_share(WIDE, [f"s{i}" for i in range(10)]) > read_share(
        WIDE, [f"l{i}" for i in range(10)]
    )


def wide_rows(n: int, start: int) -> pa.Table:
    cols: dict[str, pa.Array] = {}
    for f in WIDE:
        if pa.types.is_string(f.type):
            cols[f.name] = pa.array([f"{f.name}-{i:028d}" for i in range(start, start + n)])
        else:
            cols[f.name] = pa.array(range(start, start + n), f.type)
    return pa.table(cols, schema=WIDE)


@pytest.fixture
def wide_shard() -> tuple[dict[str, str], int]:
    """A mem location holding a 40-column shard of 8 equal Blob parts, and a part's bytes."""
    tag = uuid.uuid4().hex
    base = {"blob": f"mem://{tag}", "consensus": f"mem://{tag}", "shard": f"w{tag[:12]}"}
    client = PersistClient.open(
        base["blob"], base["consensus"], config=PersistConfig(maintenance=False)
    )
    shard = client.open_shard(base["shard"], WIDE)
    writer = shard.writer()
    for k in range(8):
        writer.append(wide_rows(2000, k * 2000), token=k + 1)
    sizes = [p.size_bytes for b in shard.state().trace for p in b.parts]
    assert len(sizes) == 8 and all(p is not None for p in sizes)
    return base, max(sizes)


def tasks(base: dict[str, str], schema: StructType, **extra: str) -> int:
    """How many tasks a batch read of ``schema`` plans."""
    opts = PersistOptions.parse({**base, **extra}, "read")
    return len(PersistBatchReader(opts, schema).partitions())


def test_a_read_of_two_of_forty_columns_plans_fewer_tasks(
    wide_shard: tuple[dict[str, str], int],
) -> None:
    """Split at one part's bytes a full scan takes a task per part; the same read of 2 columns
    takes a power of two of tasks for about a fifth of those bytes."""
    base, part_bytes = wide_shard
    split = {"splitSizeBytes": str(part_bytes)}
    assert tasks(base, read_schema(WIDE), **split) == 8
    two = StructType([StructField("l5", LongType()), StructField("s7", StringType())])
    assert tasks(base, two, **split) == 2
    assert tasks(base, two, **split, minPartitions="4") == 4
