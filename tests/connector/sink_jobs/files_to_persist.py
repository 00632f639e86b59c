"""Child job of the sink kill test: a file-source stream into persist, run by ``spark-submit``.

Usage: ``spark-submit files_to_persist.py INPUT_DIR CHECKPOINT SHARD``; an INPUT_DIR of
``persist:NAME`` reads shard NAME instead, one persist part per micro-batch (a capped
snapshot, for the source's kill test).

Reads JSON files (``{"id": long, "payload": string}``) one file per micro-batch
with ``trigger(availableNow=True)`` (so the job exits once every file is
written) and writes them to ``SHARD`` with a fixed checkpoint.

Test hooks, so the parent can kill the job at a chosen moment: the sink is
the real ``PersistDataSource`` wrapped by a subclass registered under the name
``persist_hooked`` whose writer appends a phase marker line
(``<phase> <batchId or pid> <unix time>``) to ``$SINK_TEST_MARKERS`` and
sleeps ``$SINK_TEST_SLEEP_S`` seconds at each phase: ``stage`` (inside a
task, before staging its rows), ``staged`` (inside the task, its parts
uploaded, before it returns its commit message), ``precommit`` (driver, staged but not committed)
and ``postcommit`` (driver, committed but before Spark records the batch in
its commit log, so a kill here makes Spark replay the batch). A run that is to be
killed in a phase names in ``$SINK_TEST_HOLD`` the hook that ends that phase, which
after its sleep holds until the kill, so a parent slow to see the marker on a loaded
machine still kills inside the phase and never past it. The hooks only add sleeps,
holds and markers around the real ``write``/``commit`` calls.
"""

from __future__ import annotations

import os
import pkgutil
import sys
import time
from collections.abc import Iterator
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.datasource import WriterCommitMessage
from pyspark.sql.types import StructType

from pyspark_persist.source import PersistDataSource
from pyspark_persist.writer import PersistStreamWriter


def _mark(phase: str, ident: object) -> None:
    path = os.environ.get("SINK_TEST_MARKERS")
    if path:
        with open(path, "a") as f:
            f.write(f"{phase} {ident} {time.time():.3f}\n")
            f.flush()
            os.fsync(f.fileno())
    time.sleep(float(os.environ.get("SINK_TEST_SLEEP_S", "0")))
    if os.environ.get("SINK_TEST_HOLD") == phase:
        time.sleep(HOLD_S)


HOLD_S = 600.0
"""How long a held hook waits for its kill: bounded, so a job whose parent died ends."""


class HookedStreamWriter(PersistStreamWriter):
    """The real stream writer with a marker and a sleep at each phase."""

    def write(self, iterator: Iterator[Any]) -> Any:
        """Mark and sleep before and after staging as the real sink does."""
        _mark("stage", os.getpid())
        message = super().write(iterator)
        _mark("staged", os.getpid())
        return message

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Mark and sleep around the real exactly-once commit."""
        _mark("precommit", batchId)
        super().commit(messages, batchId)
        _mark("postcommit", batchId)


class HookedSource(PersistDataSource):
    """``format("persist_hooked")``: persist with the hooked stream writer."""

    @classmethod
    def name(cls) -> str:
        """A name of its own: a static ``persist`` registration cannot be overridden."""
        return "persist_hooked"

    def streamWriter(self, schema: StructType, overwrite: bool) -> HookedStreamWriter:
        """The hooked writer (same options and checks as the real one)."""
        from pyspark_persist.options import PersistOptions

        return HookedStreamWriter(
            PersistOptions.parse(self.options, "stream_write"), schema, overwrite
        )


def main(argv: list[str]) -> int:
    """Run the stream to completion."""
    input_dir, checkpoint, shard = argv
    spark = SparkSession.builder.appName("sink-kill-child").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    if not any(m.name == "pyspark_persist" for m in pkgutil.iter_modules()):
        from pyspark_persist import DefaultSource

        spark.dataSource.register(DefaultSource)
    spark.dataSource.register(HookedSource)
    if input_dir.startswith("persist:"):  # a capped persist snapshot instead of files
        source = (
            spark.readStream.format("persist")
            .option("maxFilesPerTrigger", 1)
            .load(input_dir.removeprefix("persist:"))
            .drop("_time")  # the sink stamps its own times; _diff carries over
        )
    else:
        source = (
            spark.readStream.schema("id long, payload string")
            .option("maxFilesPerTrigger", 1)
            .json(input_dir)
        )
    q = (
        source.writeStream.format("persist_hooked")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start(shard)
    )
    q.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
