"""``persist bench upsert --quick``: runs end to end against deltalake and reports same-run
ratios (never timed asserts)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
