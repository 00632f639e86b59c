"""Named consumers end to end in Spark (issue 36): few queries, one shared session.

``test_consumers_unit.py`` checks the same rules without a JVM; these check
what only Spark decides: when it calls ``commit`` (so when the position
moves), what a query whose checkpoint was deleted gets, and how a fenced
query fails.
"""

from __future__ import annotations

import json
import shutil
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from source_helpers import SCHEMA, rows, run_available_now

from pyspark_persist.offsets import Offset, offset_json
from pyspark_persist.state import PersistClient, Shard

pytestmark = pytest.mark.spark


def new_shard(batches: int) -> Shard:
    """A fresh shard at the default location holding ``batches`` writes of 100 rows."""
    shard = PersistClient.open().open_shard(f"cons-{uuid.uuid4().hex[:12]}", SCHEMA)
    write(shard, range(batches))
    return shard


def write(shard: Shard, batches: range) -> None:
    """Write 100 rows per ``k`` in ``batches`` (ids k*100..), each at its own time."""
    writer = shard.writer()
    for k in batches:
        upper = shard.upper
        writer.compare_and_append(rows(range(k * 100, (k + 1) * 100)), upper, upper + 1)


def batch_ends(checkpoint: Path, shard: Shard) -> list[str]:
    """Each micro-batch's end offset of the source, as Spark's offset log holds it."""
    logs = sorted((checkpoint / "offsets").glob("[0-9]*"), key=lambda p: int(p.name))
    ends = [json.loads(p.read_text().splitlines()[-1]) for p in logs]
    return [offset_json(Offset.from_dict(e, shard.name)) for e in ends]


def ids(batch: list[Any]) -> Counter[int]:
    """The ids of a micro-batch's rows, with their diffs."""
    return Counter({r["id"]: r["_diff"] for r in batch})


def test_the_position_moves_at_commit_and_a_lost_checkpoint_resumes_from_it(
    spark: SparkSession, tmp_path: Path
) -> None:
    shard = new_shard(3)
    opts = {"consumer": "to-pg", "maxRowsPerTrigger": "100"}
    seen: list[str] = []  # the consumer's position while each micro-batch runs

    def record(batch_id: int) -> None:
        seen.append(shard.consumers()["to-pg"].position)

    first = run_available_now(spark, shard, tmp_path / "cp1", opts, on_batch=record)
    ends = batch_ends(tmp_path / "cp1", shard)
    assert len(first) == len(ends) == 3
    # Spark commits micro-batch k to the source as it starts k + 1: never before.
    assert seen == ["", ends[0], ends[1]]
    assert shard.consumers()["to-pg"].position == ends[1]

    shutil.rmtree(tmp_path / "cp1")
    write(shard, range(3, 5))
    second = run_available_now(spark, shard, tmp_path / "cp2", opts)
    # The micro-batch Spark never committed is replayed as planned: the same range and rows
    # (what exactly_once's token skips); then only what is new.
    assert batch_ends(tmp_path / "cp2", shard)[0] == ends[2]
    assert ids(second[0]) == ids(first[2])
    delivered = [r for b in first + second[1:] for r in b]
    assert Counter(r["id"] for r in delivered) == Counter(range(500))  # none twice, none lost


def test_the_older_of_two_queries_with_one_consumer_fails_naming_both(
    spark: SparkSession, tmp_path: Path
) -> None:
    shard = new_shard(1)
    ran = {"older": threading.Event(), "newer": threading.Event()}

    def start(name: str) -> Any:
        def mark(df: DataFrame, batch_id: int) -> None:
            df.count()
            ran[name].set()

        return (
            spark.readStream.format("persist")
            .option("consumer", "shared")
            .load(shard.name)
            .writeStream.foreachBatch(mark)
            .option("checkpointLocation", str(tmp_path / name))
            .trigger(processingTime="200 milliseconds")
            .start()
        )

    older = start("older")
    try:
        assert ran["older"].wait(120)
        older_holder = shard.consumers()["shared"].holder
        newer = start("newer")
        try:
            assert ran["newer"].wait(120)
            newer_holder = shard.consumers()["shared"].holder
            assert newer_holder != older_holder
            write(shard, range(1, 2))
            with pytest.raises(Exception) as failed:  # noqa: B017 - Spark wraps the error
                older.awaitTermination(60)
            message = str(failed.value)
            assert "ConsumerFenced" in message or "is fenced" in message
            assert older_holder in message and newer_holder in message
            assert newer.isActive
        finally:
            newer.stop()
    finally:
        older.stop()
