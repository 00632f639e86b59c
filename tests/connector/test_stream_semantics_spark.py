"""What Delta and Kafka users expect of ``format("persist")``, end to end in Spark (issue 17).

One Spark test per point of the issue, on the embedded default location
(which Spark's workers share through ``PERSIST_HOME``), in one file so they
share the session and its warm Python workers. ``test_stream_semantics_unit.py``
checks the same rules without a JVM.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql import SparkSession
from source_helpers import SCHEMA, Row, error_of, rows, run_available_now

from pyspark_persist.state import PersistClient, Shard

pytestmark = pytest.mark.spark

DAY = 86_400_000
NOV_20 = 1795132800000  # 2026-11-20T00:00:00Z in epoch milliseconds


def new_shard() -> Shard:
    """A fresh shard at the default location (what Spark's workers open)."""
    return PersistClient.open().open_shard(f"sem-{uuid.uuid4().hex[:12]}", SCHEMA)


def write_at(shard: Shard, table: pa.Table, t: int) -> int:
    """Commit ``table`` at time ``t`` (the upper first jumps to ``t``); returns ``t``."""
    writer = shard.writer()
    if shard.upper < t:
        writer.compare_and_append(SCHEMA.empty_table(), shard.upper, t)
    writer.compare_and_append(table, t, t + 1)
    return t


def consolidated(updates: list[Any]) -> Counter[Row]:
    """Sum diffs per row (Spark Rows or dicts), drop zeros."""
    c: Counter[Row] = Counter()
    for u in updates:
        c[(u["id"], u["s"])] += u["_diff"]
    return Counter({k: v for k, v in c.items() if v})


def test_times_as_iso_text_and_dates_with_deltas_names(spark: SparkSession, tmp_path: Path) -> None:
    """Item 2: timestampAsOf/asOf/startingAsOf take ISO-8601 and dates; out of range names
    both frontiers."""
    shard = new_shard()
    write_at(shard, rows(range(0, 50)), NOV_20)
    write_at(shard, rows(range(0, 20), diff=-1), NOV_20 + DAY)

    def read() -> Any:  # a DataFrameReader keeps its options: a fresh one per read
        return spark.read.format("persist")

    at_20 = read().option("timestampAsOf", "2026-11-20T12:00:00Z").load(shard.name).collect()
    assert consolidated(at_20) == consolidated(rows(range(0, 50)).to_pylist())
    assert {r["_time"] for r in at_20} == {NOV_20 + DAY // 2}
    at_21 = read().option("asOf", "2026-11-21").load(shard.name).collect()
    assert consolidated(at_21) == consolidated(rows(range(20, 50)).to_pylist())
    msg = error_of(lambda: read().option("asOf", "2026-11-25").load(shard.name).collect())
    assert "asOf 1795564800000 (2026-11-25T00:00:00.000Z) is at or past the upper" in msg
    assert f"[since, upper) = [0, {NOV_20 + DAY + 1})" in msg
    assert "timestampAsOf='soon' is not a time" in error_of(
        lambda: read().option("timestampAsOf", "soon").load(shard.name).collect()
    )
    batches = run_available_now(spark, shard, tmp_path / "cp", {"startingAsOf": "2026-11-20"})
    assert consolidated(batches[0]) == consolidated(rows(range(0, 50)).to_pylist())
    later = [r for b in batches[1:] for r in b]
    assert consolidated(later) == consolidated(rows(range(0, 20), diff=-1).to_pylist())
    old = new_shard()  # no Spark reader holds its since back
    write_at(old, rows(range(0, 50)), NOV_20)
    write_at(old, rows(range(0, 20), diff=-1), NOV_20 + DAY)
    with old.reader() as r:
        r.downgrade_since(NOV_20 + DAY)
    msg = error_of(lambda: read().option("asOf", "2026-11-20").load(old.name).collect())
    assert "asOf 1795132800000 (2026-11-20T00:00:00.000Z) is before the since" in msg
    assert f"[since, upper) = [{NOV_20 + DAY}, {NOV_20 + DAY + 1})" in msg


def test_peer_option_names_get_the_persist_option_in_their_spelling(spark: SparkSession) -> None:
    """Item 9: Kafka's and Delta's names, as Spark hands them over (lower-cased), are named in
    their documented spelling with the persist option that does the job."""
    shard = new_shard()
    write_at(shard, rows(range(3)), 0)
    msg = error_of(
        lambda: (
            spark.readStream.format("persist")
            .option("startingOffsets", "earliest")
            .load(shard.name)
        )
    )
    assert "startingOffsets is Kafka's option: use startingPosition (earliest/latest)" in msg
    msg = error_of(
        lambda: (
            spark.readStream.format("persist").option("maxOffsetsPerTrigger", "5").load(shard.name)
        )
    )
    assert "maxOffsetsPerTrigger is Kafka's option: use maxRowsPerTrigger" in msg
    msg = error_of(
        lambda: spark.read.format("persist").option("versionAsOf", "0").load(shard.name).collect()
    )
    assert "versionAsOf is Delta's option" in msg
    msg = error_of(
        lambda: (
            spark.read.format("persist").option("splitSizeByte", "1m").load(shard.name).collect()
        )
    )
    assert "splitsizebyte: did you mean splitSizeBytes?" in msg and "lower-cased" in msg


def test_starting_timestamp_or_version_streams_changes_without_the_snapshot(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Item 3: startingTimestamp (a date) and startingVersion (a SeqNo) stream the changes from
    there on, with their own times, never the snapshot."""
    shard = new_shard()
    write_at(shard, rows(range(0, 50)), NOV_20)
    write_at(shard, rows(range(50, 80)), NOV_20 + DAY)
    nov_21_seqno = shard.state().seqno
    write_at(shard, rows(range(0, 10), diff=-1), NOV_20 + 2 * DAY)
    want = Counter(
        (r["id"], r["s"], r["_time"], r["_diff"])
        for t, table in (
            (NOV_20 + DAY, rows(range(50, 80))),
            (NOV_20 + 2 * DAY, rows(range(10), -1)),
        )
        for r in table.append_column(
            "_time", pa.array([t] * table.num_rows, pa.int64())
        ).to_pylist()
    )
    for name, option in (
        ("ts", {"startingTimestamp": "2026-11-21T00:00:00Z"}),
        ("version", {"startingVersion": str(nov_21_seqno)}),
    ):
        got = [r for b in run_available_now(spark, shard, tmp_path / name, option) for r in b]
        assert Counter((r["id"], r["s"], r["_time"], r["_diff"]) for r in got) == want, name


def test_batch_change_feed_between_two_times_or_versions(spark: SparkSession) -> None:
    """Item 7: readChangeFeed with a start and end (times or versions) returns each update in the
    range with its own _time and _diff, an insert and its retraction both; below since: an
    error naming both frontiers."""
    shard = new_shard()
    write_at(shard, rows(range(0, 50)), NOV_20)
    write_at(shard, rows(range(50, 80)), NOV_20 + DAY)
    nov_21_seqno = shard.state().seqno
    write_at(shard, rows(range(50, 60), diff=-1), NOV_20 + 2 * DAY)

    def feed(**options: str) -> Counter[tuple[int, int, int]]:
        df = spark.read.format("persist").options(readChangeFeed="true", **options)
        return Counter((r["id"], r["_time"], r["_diff"]) for r in df.load(shard.name).collect())

    nov21 = Counter((i, NOV_20 + DAY, 1) for i in range(50, 80))
    nov22 = Counter((i, NOV_20 + 2 * DAY, -1) for i in range(50, 60))
    assert feed(startingTimestamp="2026-11-21") == nov21 + nov22
    assert feed(startingTimestamp="2026-11-21", endingTimestamp="2026-11-21") == nov21
    assert feed(startingVersion=str(nov_21_seqno), endingVersion=str(nov_21_seqno)) == nov21
    # The batch reads above hold since for their lease: another shard shows the error.
    shard = new_shard()
    write_at(shard, rows(range(0, 50)), NOV_20)
    write_at(shard, rows(range(50, 60), diff=-1), NOV_20 + 2 * DAY)
    with shard.reader() as r:
        r.downgrade_since(NOV_20 + DAY)
    msg = error_of(lambda: feed(startingTimestamp="2026-11-20"))
    assert "readChangeFeed: the range" in msg and "reaches before the since" in msg
    assert f"[since, upper) = [{NOV_20 + DAY}, {NOV_20 + 2 * DAY + 1})" in msg


def test_history_is_a_dataframe_of_commits(spark: SparkSession) -> None:
    """Item 5: option("history", "true") reads the shard's commits (Delta's DESCRIBE HISTORY)
    after Spark writes: one append per batch write, the overwrite, with rows and writer."""
    shard = new_shard()
    df = spark.createDataFrame([(i, f"v{i}") for i in range(20)], "id long, s string")
    df.write.format("persist").mode("append").save(shard.name)
    df.limit(5).write.format("persist").mode("overwrite").save(shard.name)
    history = spark.read.format("persist").option("history", "true").load(shard.name)
    assert history.columns[:4] == ["seqno", "operation", "committed_ms", "writer_id"]
    rows = history.where("operation != 'create'").orderBy("seqno").collect()
    assert [(r["operation"], r["rows_added"], r["rows_retracted"]) for r in rows] == [
        ("append", 20, 0),
        ("overwrite", 5, 20),
    ]
    assert all(r["writer_id"] and r["committed_ms"] > 0 for r in rows)


def test_capped_snapshot_is_cut_and_lag_shows_in_progress_and_the_metrics_file(
    spark: SparkSession, tmp_path: Path
) -> None:
    """Items 1 and 8: maxFilesPerTrigger cuts the first snapshot into micro-batches;
    progress.sources[].latestOffset carries behind (rows, bytes, parts, times left after each
    micro-batch); metricsFile gets one line per micro-batch."""
    import json

    shard = new_shard()
    for k in range(3):
        write_at(shard, rows(range(k * 100, k * 100 + 100)), NOV_20 + k * DAY)
    path = tmp_path / "source-metrics.jsonl"
    q = (
        spark.readStream.format("persist")
        .options(maxFilesPerTrigger="1", metricsFile=str(path))
        .load(shard.name)
        .writeStream.format("noop")
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert q.awaitTermination(180), "query did not finish"
        progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
    finally:
        q.stop()
    latest = [json.loads(p["sources"][0]["latestOffset"]) for p in progress]
    ends = [json.loads(p["sources"][0]["endOffset"]) for p in progress]
    assert [p["numInputRows"] for p in progress] == [100, 100, 100]  # the snapshot, cut in 3
    assert [e["phase"] for e in ends] == ["snapshot", "snapshot", "listen"]
    assert [e["as_of"] for e in ends[:2]] == [NOV_20 + 2 * DAY] * 2
    assert [x["behind"]["rows"] for x in latest] == [200, 100, 0]
    assert latest[-1]["behind"] == {"rows": 0, "bytes": 0, "parts": 0, "times": 0}
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [x["planned_rows"] for x in lines] == [100, 100, 100]
    assert [x["behind"]["rows"] for x in lines] == [200, 100, 0]


def test_retention_write_option_sets_the_shards_period(spark: SparkSession) -> None:
    """Item 4: ``retention`` on a write sets the shard's retention period (on creation, and
    when changed later); a bad period is refused before anything is written."""
    name = f"ret-{uuid.uuid4().hex[:12]}"
    df = spark.createDataFrame(rows(range(0, 5)).select(["id", "s"]).to_pandas())
    msg = error_of(
        lambda: df.write.format("persist").option("retention", "7 days").mode("append").save(name)
    )
    assert "option retention '7 days' is not a duration" in msg and "7d" in msg
    client = PersistClient.open()
    assert name not in client.list_shards()
    df.write.format("persist").option("retention", "7d").mode("append").save(name)
    shard = client.open_shard(name)
    assert shard.retention_ms == 7 * DAY
    df.write.format("persist").option("retention", "12h").mode("append").save(name)
    assert shard.retention_ms == DAY // 2
    df.write.format("persist").mode("append").save(name)  # not given: left as it is
    assert shard.retention_ms == DAY // 2
    assert consolidated(spark.read.format("persist").load(name).collect()) == Counter(
        {(r["id"], r["s"]): 3 for r in rows(range(0, 5)).to_pylist()}
    )
