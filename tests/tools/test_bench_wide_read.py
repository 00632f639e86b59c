"""The wide-shard case of ``persist bench spark-read``: its figures and its printout, no JVM."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("pyspark")

from pyspark_persist.tools.bench import spark_read, wide_read  # noqa: E402


def wide_report(seconds: dict[str, float]) -> wide_read.WideReport:
    report = wide_read.WideReport(rows=10, arrow_mib=512.0, write_s=1.0, parquet_write_s=1.0)
    report.timings = [spark_read.Timing(n, 2, s, 512.0 / s) for n, s in seconds.items()]
    return report


SECONDS = {
    wide_read.PERSIST_SUBSET: 0.30,
    wide_read.PERSIST_SUBSET_PER_CORE: 0.27,
    wide_read.PARQUET_SUBSET: 0.27,
    wide_read.CEILING_SUBSET: 0.25,
    wide_read.PERSIST_FULL: 2.0,
    wide_read.PERSIST_FULL_PER_CORE: 1.5,
    wide_read.CEILING_FULL: 1.2,
}


def test_the_wide_ratios_pair_the_same_runs_readers_and_judge_the_targets() -> None:
    report = wide_report(SECONDS)
    assert report.subset_vs_parquet == pytest.approx(0.9) and report.subset_ok
    assert report.subset_per_core_vs_parquet == pytest.approx(1.0)
    assert report.full_vs_ceiling == pytest.approx(0.8) and not report.full_ok
    assert report.full_default_vs_ceiling == pytest.approx(0.6)
    lines = wide_read.format_wide(report, 2)
    assert "persist / Spark Parquet pruned: 0.90x (target >= 0.8x: ok)" in lines[-2]
    assert "1 partition per core each): 0.80x (target >= 0.95x: MISSED)" in lines[-1]


def test_a_wide_only_run_prints_and_serialises_without_the_narrow_readers() -> None:
    options = spark_read.SparkReadOptions.make(cases=("wide",))
    report = spark_read.Report(options, 0, 0.0, 0.0, wide=wide_report(SECONDS))
    text = spark_read.format_report(report)
    assert text.startswith("persist Spark read of a wide shard") and "appended" not in text
    assert json.loads(json.dumps(report.to_json()))["wide"]["subset_ok"] is True
    with pytest.raises(ValueError, match="unknown case 'tall'"):
        spark_read.SparkReadOptions.make(cases=("tall",))
