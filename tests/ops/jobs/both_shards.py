"""What the cluster and Connect jobs share: both shards of a transaction streamed in one source."""

from __future__ import annotations

import os

from pyspark.sql import SparkSession


def stream_both(
    spark: SparkSession, shards: tuple[str, str], options: dict[str, str], workdir: str
) -> dict[str, list[int]]:
    """Stream ``shards`` in one source (option ``shards``) into a memory table with
    Trigger.AvailableNow; each shard's ids, as its ``_shard`` tag says, sorted."""
    query = (
        spark.readStream.format("persist")
        .options(**options)
        .option("shards", ",".join(shards))
        .load()
        .writeStream.format("memory")
        .queryName("both_shards")
        .option("checkpointLocation", os.path.join(workdir, "shards-checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    if not query.awaitTermination(300):
        raise SystemExit("the stream of both shards did not finish its availableNow run in 300 s")
    streamed: dict[str, list[int]] = {}
    for r in spark.sql("SELECT _shard, id FROM both_shards").collect():
        streamed.setdefault(r["_shard"], []).append(r["id"])
    return {name: sorted(ids) for name, ids in streamed.items()}
