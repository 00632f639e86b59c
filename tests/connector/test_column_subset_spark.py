"""Reading some of a shard's columns through Spark: a ``.schema(...)`` subset or ``columns``.

Every read (batch, ``readChanges``, streams) returns the full read's rows
projected: with ``_diff`` each row's multiplicity as a full read has it, without
it each row repeated that many times; retractions consolidated as in a full
read. A column the shard lacks, or a type that differs, fails before any task.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from source_helpers import error_of, run_available_now

from pyspark_persist.state import PersistClient, Shard

pytestmark = pytest.mark.spark

WIDE = pa.schema([("id", pa.int64()), ("s", pa.string()), ("x", pa.float64())])


def updates(ids: range, diff: int = 1) -> pa.Table:
    """Updates of ``WIDE`` (32-char strings: 100+ rows make a Blob part, not inline)."""
    return pa.table(
        {
            "id": pa.array(list(ids), pa.int64()),
            "s": [f"v{i:031d}" for i in ids],
            "x": [i * 0.5 for i in ids],
            "_diff": pa.array([diff] * len(ids), pa.int64()),
        }
    )


def wide_shard() -> Shard:
    """Inserts, a retraction of some, and a second copy of others (multiplicity 2)."""
    shard = PersistClient.open().open_shard(f"cols-{uuid.uuid4().hex[:12]}", WIDE)
    for table in (updates(range(0, 200)), updates(range(0, 50), -1), updates(range(150, 200))):
        upper = shard.upper
        shard.writer().compare_and_append(table, upper, upper + 1)
    return shard


def projected(got: list[Any], names: list[str]) -> Counter[tuple[Any, ...]]:
    """The rows (Spark Rows) as a multiset of ``names``' values: each row counted ``_diff``
    times when the read returned ``_diff``, once otherwise (a bag read repeats it)."""
    out: Counter[tuple[Any, ...]] = Counter()
    for r in got:
        out[tuple(r[n] for n in names)] += r["_diff"] if "_diff" in r else 1
    return out


def test_a_subset_schema_or_columns_reads_the_full_reads_rows(spark: SparkSession) -> None:
    """Batch reads (consolidating retractions), readChanges, and their errors."""
    shard = wide_shard()

    def read() -> Any:
        """A new reader each time (a DataFrameReader keeps the schema it was given)."""
        return spark.read.format("persist")

    def changes() -> Any:
        return read().option("readChanges", "true")

    full = read().load(shard.name).collect()
    assert Counter(r["_diff"] for r in full) == Counter({1: 100, 2: 50})
    expected = projected(full, ["s", "id"])
    subset = read().schema("s string, id long, _diff long").load(shard.name)
    assert subset.columns == ["s", "id", "_diff"]
    assert projected(subset.collect(), ["s", "id"]) == expected
    # No _diff: the bag, each row as many times as its multiplicity.
    bag = read().schema("s string, id long").load(shard.name)
    assert bag.count() == 200 and projected(bag.collect(), ["s", "id"]) == expected
    by_option = read().option("columns", "s,id").load(shard.name)
    assert by_option.columns == ["s", "id", "_time", "_diff"]
    assert projected(by_option.collect(), ["s", "id"]) == expected
    assert {r["_time"] for r in by_option.collect()} == {2}
    got = changes().schema("x double, _time long, _diff long").load(shard.name).collect()
    assert Counter((r["_time"], r["_diff"]) for r in got) == Counter(
        {(0, 1): 200, (1, -1): 50, (2, 1): 50}
    )
    # Errors, before any task: a missing column, a type that differs, a retraction unshown.
    msg = error_of(lambda: read().schema("id long, ID2 long").load(shard.name).collect())
    assert (
        f"shard '{shard.name}' has no column(s) 'ID2'" in msg and "its columns are id, s, x" in msg
    )
    assert "did you mean 'id'?" in error_of(lambda: read().option("columns", "ID").load(shard.name))
    msg = error_of(lambda: read().schema("id string").load(shard.name).collect())
    assert "column 'id' of shard" in msg and "is bigint, but the schema says string" in msg
    msg = error_of(lambda: read().schema("id long, _diff int").load(shard.name).collect())
    assert "_diff is a long" in msg
    msg = error_of(lambda: changes().schema("id long").load(shard.name).collect())
    assert "hold retractions (_diff -1)" in msg and "add _diff (long) to the schema" in msg
    msg = error_of(
        lambda: read().schema("id long").option("columns", "s").load(shard.name).collect()
    )
    assert "option columns=s differ" in msg


def test_a_stream_reads_only_the_columns_of_its_schema(spark: SparkSession, tmp_path: Path) -> None:
    """A stream of an insert-only shard with a subset schema: only those columns, each row
    once; a column added later does not stop it (it is none of the query's)."""
    shard = PersistClient.open().open_shard(f"cols-{uuid.uuid4().hex[:12]}", WIDE)
    upper = shard.upper
    shard.writer().compare_and_append(updates(range(0, 300)), upper, upper + 1)
    got = run_available_now(spark, shard, tmp_path / "a", schema="x double, id long")
    rows = [r for b in got for r in b]
    assert rows and all(r.asDict().keys() == {"x", "id"} for r in rows)
    assert sorted(r["id"] for r in rows) == list(range(300))
    wider = updates(range(300, 310)).append_column("y", pa.array([7] * 10, pa.int64()))
    shard.writer().append(wider, merge_schema=True)
    again = run_available_now(spark, shard, tmp_path / "a", schema="x double, id long")
    assert sorted(r["id"] for b in again for r in b) == list(range(300, 310))
    got = run_available_now(spark, shard, tmp_path / "b", {"columns": "y,id"})
    rows = [r for b in got for r in b]
    assert all(r.asDict().keys() == {"y", "id", "_time", "_diff"} for r in rows)
    assert Counter(r["y"] for r in rows) == Counter({None: 300, 7: 10})
