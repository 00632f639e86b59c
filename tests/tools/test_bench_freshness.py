"""Smoke test of ``persist bench spark-freshness``: short pipelines in the shared session.

No timed assertions: whether persist is fresher than files is read off the
benchmark's printout on a quiet machine. This checks that each pipeline really
moved rows from its writer to its reader and that every figure is reported.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from pyspark.sql import SparkSession

from pyspark_persist.tools.bench.spark_freshness import PHASES, add_arguments, render, run


def test_freshness_quick_reports_every_pipeline(spark: SparkSession, tmp_path: Path) -> None:
    """persist and file pipelines see steady-state rows; every query reports its phases."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    ns = parser.parse_args(
        ["--quick", "--seconds", "5", "--steady-seconds", "2", "--workdir", str(tmp_path)]
    )
    report = run(ns, spark)
    by = {p.kind: p for p in report.pipelines}
    assert set(by) == {"persist", "file", "floor"}
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
    assert spark.streams.active == []  # every query the benchmark started was stopped
