"""``persist bench upsert --quick``: runs end to end against deltalake and reports same-run
ratios (never timed asserts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pyspark_persist.tools.bench.upsert import READS

pytest.importorskip("deltalake")


def test_bench_upsert_quick_json() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "upsert", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["rows"] == 20_000 and result["upsert_rows"] == 200
    assert len(result["persist_s"]) == len(result["delta_s"]) == len(result["grown_s"]) == 3
    assert result["speedup"] > 0 and result["growth"] > 0
    assert result["grown_rows"] == 60_000
    history = result["history"]
    assert history["rounds"] == 20 and history["live_rows"] == 20_000
    assert len(history["upserted_read_s"]) == len(history["once_read_s"]) == READS
    assert history["read_ratio"] > 0 and history["bytes_ratio"] > 0


def test_render_reports_the_history_figures_against_their_targets() -> None:
    from pyspark_persist.tools.bench.upsert import HistoryFigures, UpsertResult, render

    history = HistoryFigures(
        100, 1_000, [0.02, 0.01], [0.01, 0.009], 3_000_000, 1_000_000, 4, 5, 1.5
    )
    text = render(UpsertResult(1_000, 10, [0.01], [0.05], 1_000, [], 0.1, 0.1, history))
    assert "after 100 upserts of 10 rows" in text
    assert "0.90x its speed (target >= 0.8x: met)" in text
    assert "3.00x (target <= 2x: NOT met)" in text
