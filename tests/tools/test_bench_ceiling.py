"""The Spark benchmarks' do-nothing peers really move the rows they are timed on.

A ceiling that read fewer rows than persist, or a sink that never saw its
input, would make the comparison meaningless; these check both in the shared
session.
"""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.streaming.datasource import ReadAllAvailable

from pyspark_persist.schema import read_schema
from pyspark_persist.tools.bench.ceiling import (
    DISCARD,
    NO_IO,
    DiscardSink,
    NoIOReader,
    NoIOStreamReader,
    NoIOStreamSource,
    no_io_source,
)
from pyspark_persist.tools.bench.spark_read import SCHEMA, read_batch


def test_no_io_source_yields_exactly_the_rows_asked_for(spark: SparkSession) -> None:
    """An odd row count over 3 tasks, in persist's read schema, all columns filled."""
    rows = 100_000 + 7  # not a multiple of the batch size: the last slice is cut
    spark.dataSource.register(no_io_source(read_schema(SCHEMA), rows, 3, read_batch))
    df = spark.read.format(NO_IO).load()
    assert df.rdd.getNumPartitions() == 3
    assert df.schema == read_schema(SCHEMA)
    (total,) = df.selectExpr("count(*)", "count(s)", "sum(_diff)").collect()
    assert tuple(total) == (rows, rows, rows)


def test_no_io_partitions_split_the_rows_evenly() -> None:
    """The shares differ by at most one row and add up to the total."""
    reader = NoIOReader(read_schema(SCHEMA), 10, 4, read_batch)
    assert [p.rows for p in reader.partitions()] == [3, 3, 2, 2]


def test_in_memory_source_yields_distinct_copies_of_the_no_io_rows() -> None:
    """The in-memory peer hands over as many rows as the no-I/O one, the same values, but
    every batch of a task in buffers of its own (the no-I/O source repeats one batch)."""
    rows = 3 * 65536 + 11
    schema = read_schema(SCHEMA)
    (part,) = NoIOReader(schema, rows, 1, read_batch, distinct=True).partitions()
    got = list(NoIOReader(schema, rows, 1, read_batch, distinct=True).read(part))
    same = list(NoIOReader(schema, rows, 1, read_batch).read(part))
    assert sum(b.num_rows for b in got) == sum(b.num_rows for b in same) == rows
    assert all(a.equals(b) for a, b in zip(got, same, strict=True))

    def data_address(batch: pa.RecordBatch) -> int:
        return int(batch.column(0).buffers()[1].address)

    assert len({data_address(b) for b in got}) == len(got)
    assert len({data_address(b) for b in same}) == 1


def test_discard_writer_drains_its_task_input() -> None:
    """A task's every batch is pulled from Spark (so the transfer is timed in full)."""
    from pyspark_persist.tools.bench.ceiling import DiscardWriter

    pulled = []

    def batches() -> object:
        for i in range(5):
            pulled.append(i)
            yield pa.record_batch({"id": list(range(i * 10, i * 10 + 10))})

    DiscardWriter().write(batches())  # type: ignore[arg-type]
    assert pulled == [0, 1, 2, 3, 4]


def test_discard_sink_runs_a_spark_write(spark: SparkSession) -> None:
    """``df.write.format(DISCARD)`` runs to the end in Spark."""
    spark.dataSource.register(DiscardSink)
    spark.range(0, 5000, numPartitions=2).write.format(DISCARD).mode("append").save()


def test_discard_sink_runs_spark_write_streams_like_the_bench_discard_stream_peer(
    spark: SparkSession, tmp_path: Path
) -> None:
    """The "discard stream" peer of ``persist bench spark-write`` (a file source, AvailableNow,
    into the discarding streaming sink) runs to the end and reads every input row."""
    spark.dataSource.register(DiscardSink)
    source = str(tmp_path / "source")
    df = spark.range(0, 5000, numPartitions=2).selectExpr("id", "id * 0.5 AS x")
    df.write.parquet(source)
    query = (
        spark.readStream.schema(df.schema)
        .parquet(source)
        .writeStream.format(DISCARD)
        .option("checkpointLocation", str(tmp_path / "ckpt"))
        .trigger(availableNow=True)
        .start("discard")
    )
    query.awaitTermination()
    assert query.exception() is None
    assert sum(p["numInputRows"] for p in query.recentProgress) == 5000


def test_no_io_stream_source_paced_offers_a_row_at_most_once_per_interval() -> None:
    """``everySeconds``: the first ask gets a new row, asks within the interval get none
    (the start back: no micro-batch), and one after it gets the next row."""
    reader = NoIOStreamSource(options={"everySeconds": "0.3"}).streamReader(NoIOStreamReader.SCHEMA)
    start = reader.initialOffset()
    first = reader.latestOffset(start, ReadAllAvailable())
    assert first == {"n": 1}
    assert reader.latestOffset(first, ReadAllAvailable()) == first
    time.sleep(0.35)
    assert reader.latestOffset(first, ReadAllAvailable()) == {"n": 2}
    unpaced = NoIOStreamSource(options={}).streamReader(NoIOStreamReader.SCHEMA)
    assert unpaced.latestOffset({"n": 5}, ReadAllAvailable()) == {"n": 6}
    assert unpaced.latestOffset({"n": 6}, ReadAllAvailable()) == {"n": 7}
