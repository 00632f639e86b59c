"""Smoke test of ``persist bench spark-freshness``: short pipelines in the shared session.

No timed assertions: whether persist is fresher than files is read off the
benchmark's printout on a quiet machine. This checks that each pipeline really
moved rows from its writer to its reader and that every figure is reported.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from pyspark.sql import SparkSession

from pyspark_persist.state.client import PersistClient
from pyspark_persist.tools.bench import ratio_text
from pyspark_persist.tools.bench.spark_freshness import (
    ALONE_SHARD,
    KEY_SPACE,
    PHASES,
    READY,
    FreshnessOptions,
    render,
    run,
    run_alone,
    write_outside_spark,
)

APPEND_KINDS = ("persist", "file", "floor")
"""The pipelines of the first test: every one but the upsert (tested on its own)."""


def test_freshness_quick_reports_every_pipeline(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """persist and file pipelines see steady-state rows; every query reports its phases; the
    run says on stderr which pipeline it is timing, as it goes."""
    options = FreshnessOptions.make(
        quick=True,
        seconds=5.0,
        steady_seconds=2.0,
        workdir=str(tmp_path),
        pipelines=APPEND_KINDS,
        warmup_seconds=0.0,
    )
    report = run(options, spark)
    by = {p.kind: p for p in report.pipelines}
    assert set(by) == set(APPEND_KINDS)
    for kind in ("persist", "file"):
        p = by[kind]
        assert p.samples > 0, kind
        assert 0 <= p.p50_ms <= p.p95_ms <= p.max_ms, kind
    for p in report.pipelines:
        for query in ("sink", "reader"):
            assert "addBatch" in p.phases_ms[query], (p.kind, query)
            assert all(math.isfinite(v) and v >= 0 for v in p.phases_ms[query].values())
    assert math.isfinite(report.p50_ratio) and report.p50_ratio > 0
    waits = by["persist"].waits  # from the persist source's metricsFile
    assert waits["batches"] > 0 and 0 <= waits["waited"] <= waits["batches"]
    text = render(report)
    assert "persist sink -> persist source" in text and "file sink -> file source" in text
    assert all(phase in text for phase in PHASES[:4])
    assert "waited_ms median" in text
    alone = {p.kind: p for p in report.alone}
    assert set(alone) == set(APPEND_KINDS)
    for kind in ("persist", "file"):  # the floor's rows carry no stamp
        assert alone[kind].samples > 0, kind
        assert 0 <= alone[kind].p50_ms <= alone[kind].p95_ms, kind
    for p in report.alone:
        assert {"addBatch", "walCommit"} <= set(p.phases_ms["reader"]), p.kind
    floor_sink = by["floor"].phases_ms["sink"]
    assert report.sink_floor_ms == sum(
        floor_sink[p] for p in ("walCommit", "queryPlanning", "addBatch")
    )
    assert "the floor of any Python sink" in text
    assert json.loads(json.dumps(report.to_json()))["sink_floor_ms"] == report.sink_floor_ms
    assert "Each reader alone" in text and "append -> seen p50/p95" in text
    assert spark.streams.active == []  # every query the benchmark started was stopped
    steps = capsys.readouterr().err
    for kind in APPEND_KINDS:
        assert f"... spark-freshness: the {kind} pipeline, two queries" in steps, steps
        assert f"... spark-freshness: the {kind} reader alone" in steps, steps
    assert "upsert" not in steps and "upsert" not in text  # not asked for
    assert "warming up" not in steps  # --warmup-seconds 0


def test_upsert_pipeline_reports_its_ratios_to_the_append_pipeline(
    spark: SparkSession, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The upsert pipeline, its shard prefilled with keys the rate source then rewrites (so
    its reader sees retractions, which it skips): its rows reach the reader, its shard holds
    one row per key throughout, and its addBatch and freshness ratios to the append pipeline
    of the same run are printed with their targets; the pipelines run in the order given,
    after the warm-up."""
    prefill = 1000  # more keys than 5 s at 50 rows/s write: every write replaces a live row
    options = FreshnessOptions.make(
        quick=True,
        seconds=5.0,
        steady_seconds=2.0,
        workdir=str(tmp_path),
        pipelines=("upsert", "persist"),
        upsert_prefill=prefill,
        warmup_seconds=2.0,
    )
    report = run(options, spark)
    steps = capsys.readouterr().err.splitlines()
    assert [s.split(" (")[0] for s in steps if s.startswith("... spark-freshness")] == [
        "... spark-freshness: warming up, a persist pipeline not measured",
        "... spark-freshness: the upsert pipeline, two queries",
        "... spark-freshness: the persist pipeline, two queries",
        "... spark-freshness: the persist reader alone",
    ]
    assert [p.kind for p in report.pipelines] == ["upsert", "persist"]  # the order given
    upsert, append = report.pipeline("upsert"), report.pipeline("persist")
    assert upsert.samples > 0 and 0 <= upsert.p50_ms <= upsert.p95_ms <= upsert.max_ms
    assert upsert.live_keys == (prefill, prefill)
    assert upsert.commit_ms > 0 and append.commit_ms > 0
    added = upsert.phases_ms["sink"]["addBatch"] / append.phases_ms["sink"]["addBatch"]
    assert report.upsert_add_batch_ratio == round(added, 3)
    assert report.upsert_p50_ratio == round(upsert.p50_ms / append.p50_ms, 3)
    assert report.upsert_p95_ratio == round(upsert.p95_ms / append.p95_ms, 3)
    assert set(report.targets) == {"upsert addBatch", "upsert p50", "upsert p95"}
    text = render(report)
    assert "rate -> persist upsert -> persist source" in text
    p50 = ratio_text(report.upsert_p50_ratio, 1.2)  # three decimals where two would hit 1.2
    assert f"upsert/persist append: p50 {p50} (target <= 1.2x" in text
    added_text = ratio_text(report.upsert_add_batch_ratio, 1.5)
    assert f"sink addBatch {added_text} (target <= 1.5x" in text
    assert f"held {prefill} live keys at the steady window's start, {prefill} at the end" in text
    assert "persist/file" not in text  # no file pipeline ran
    assert [p.kind for p in report.alone] == ["persist"]
    assert spark.streams.active == []


def test_freshness_options_refuse_a_prefill_outside_the_key_space() -> None:
    """The upsert's keys are value % KEY_SPACE: a prefill beyond them, or no pipeline at all,
    is refused before Spark starts, naming the flag."""
    with pytest.raises(ValueError, match="--upsert-prefill 100001 is outside the key space"):
        FreshnessOptions.make(upsert_prefill=KEY_SPACE + 1)
    with pytest.raises(ValueError, match="--warmup-seconds must be 0"):
        FreshnessOptions.make(warmup_seconds=-1.0)
    with pytest.raises(ValueError, match="--pipelines is empty"):
        FreshnessOptions.make(pipelines=())
    with pytest.raises(ValueError, match="unknown pipeline 'merge'"):
        FreshnessOptions.make(pipelines=("persist", "merge"))


def test_writer_outside_spark_appends_stamped_rows_once_a_second(tmp_path: Path) -> None:
    """Two appends 1 s apart, as Parquet files and into a persist shard: every row stamped
    with its append's start, the values numbered on, and the ready file made."""
    files = tmp_path / "files"
    files.mkdir()
    assert write_outside_spark("file", str(files), 1.5, 3) == 6
    assert (files / READY).exists()
    written = sorted(files.glob("part-*.parquet"))
    assert len(written) == 2 and not list(files.glob(".*.tmp"))
    tables = [pq.read_table(f) for f in written]
    assert [t.column("value").to_pylist() for t in tables] == [[0, 1, 2], [3, 4, 5]]
    stamps = [set(t.column("stamp_us").to_pylist()) for t in tables]
    assert all(len(s) == 1 for s in stamps)
    assert 0.95e6 <= min(stamps[1]) - min(stamps[0]) <= 1.5e6

    shard_dir = tmp_path / "persist"
    shard_dir.mkdir()
    assert write_outside_spark("persist", str(shard_dir), 0.5, 4, pubsub="off") == 4
    assert (shard_dir / READY).exists()
    with PersistClient.open(
        f"file://{shard_dir}/blob", f"sqlite:///{shard_dir}/consensus.db"
    ) as client:
        rows = client.open_shard(ALONE_SHARD).reader().snapshot_table()
    assert sorted(rows.column("value").to_pylist()) == [0, 1, 2, 3]
    assert len(set(rows.column("stamp_us").to_pylist())) == 1


def test_a_reader_alone_whose_writer_fails_names_the_writers_error(tmp_path: Path) -> None:
    """The writer outside Spark dies at once (a bad pubsub option): the run stops before any
    query starts and quotes the writer's own error."""
    with pytest.raises(
        RuntimeError, match="(?s)writer outside Spark did not start.*invalid pubsub"
    ):
        run_alone(None, "persist", 5.0, 1.0, 10, str(tmp_path), "bogus")
