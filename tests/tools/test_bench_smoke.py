"""Smoke test of ``persist bench core``: tiny sizes, mem/mem and file/sqlite, every figure there.

No timed assertions: the benchmark's targets are checked by people reading its
output on a quiet machine, not by the test suite.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value) and value > 0


def test_bench_core_quick_json(tmp_path: Path) -> None:
    """The CLI runs end to end and reports every figure as a positive number."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pyspark_persist.tools.cli",
            "bench",
            "core",
            "--quick",
            "--json",
            "--locations",
            "mem/mem,file/sqlite",
            "--writes",
            "20",
            "--listen-samples",
            "5",
            "--listen-gap-ms",
            "2",
            "--size-mib",
            "4",
            "--part-mib",
            "1",
            "--workdir",
            str(tmp_path / "made" / "for-it"),  # missing: the benchmark creates it
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["notes"] == []

    latency = {r["location"]: r for r in report["latency"]}
    assert set(latency) == {"mem/mem", "file/sqlite"}
    for r in latency.values():
        assert r["writes"] == 20
        for name in ("p50_ms", "p95_ms", "p99_ms", "target_p50_ms"):
            assert _positive(r[name]), (r["location"], name, r[name])
        assert r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"]
        assert _positive(r["cas_p50_ms"]), r  # the compare-and-set floor, measured beside
    assert latency["mem/mem"]["driver_p50_ms"] is None  # no database behind mem://
    assert _positive(latency["file/sqlite"]["driver_p50_ms"])  # sqlite3 alone

    listen = {(r["location"], r["listener"]) for r in report["listen"]}
    assert listen == {
        (loc, kind) for loc in ("mem/mem", "file/sqlite") for kind in ("polling", "same-client")
    }
    for r in report["listen"]:
        assert r["samples"] == 5 and r["missed"] == 0
        assert _positive(r["p50_ms"]) and _positive(r["p95_ms"])

    (tp,) = report["throughput"]
    assert tp["location"] == "file/sqlite"
    assert tp["parts"] >= 2  # 4 MiB of rows with 1 MiB parts
    for name in (
        "arrow_mib",
        "rows",
        "encoded_mib",
        "raw_file_mib",
        "persist_write_mib_s",
        "raw_write_mib_s",
        "write_ratio",
        "persist_read_mib_s",
        "raw_read_mib_s",
        "read_ratio",
    ):
        assert _positive(tp[name]), (name, tp[name])

    memory = {r["role"]: r for r in report["memory"]}
    assert set(memory) == {"writer", "reader"}
    assert memory["writer"]["bound_mib"] == 5  # B*(2N+1) with B = 1 MiB, N = 2
    assert memory["reader"]["bound_mib"] == 3  # 3B
    for r in memory.values():
        assert r["rows"] == tp["rows"]
        assert _positive(r["arrow_pool_peak_mib"]) and r["rss_growth_mib"] >= 0
        assert isinstance(r["within"], bool)


def test_bench_core_bad_flag_is_one_line() -> None:
    """A bad location is one clear error line and a non-zero exit, no traceback."""
    proc = subprocess.run(
        [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "core", "--locations", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "persist: error: unknown location 'nope': use some of "
        "mem/mem, file/sqlite, file/postgres, s3/postgres"
    ]
