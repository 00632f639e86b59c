"""``persist bench delivery --quick``: runs end to end against the test PostgreSQL and prints its
same-run ratios with a verdict each (never timed asserts: the targets are read off a run on a
quiet machine); and how a row's freshness is matched to the micro-batch that delivered it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from pyspark_persist.tools.bench.delivery import JDBC_JAR, _freshness


@pytest.mark.spark
@pytest.mark.postgres
@pytest.mark.slow
def test_bench_delivery_quick_prints_its_ratios(postgres_url: str, tmp_path: Path) -> None:
    """Both bulk writers deliver every row, both pipelines deliver steady rows, and every
    target is printed with its ratio and ok/MISSED."""
    if not os.path.exists(JDBC_JAR):
        pytest.skip(f"no PostgreSQL JDBC driver at {JDBC_JAR} (libpostgresql-jdbc-java)")
    cmd = [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "delivery", "--quick"]
    proc = subprocess.run(
        [
            *cmd,
            *("--size-mib", "4", "--batch-mib", "1", "--seconds", "8", "--steady-seconds", "3"),
            *("--url", postgres_url, "--workdir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    verdict = r"(ok|MISSED)\)"
    assert re.search(r"sinks\.postgres/jdbc: \d+\.\d+x \(target >= 0\.8x: " + verdict, out), out
    assert re.search(r"postgres/memory p50: \d+\.\d+x \(target <= 1\.3x: " + verdict, out), out
    assert re.search(r"postgres/collect p50 \d+\.\d+x, collect/memory p50 \d+\.\d+x", out), out
    for phase in ("latestOffset", "walCommit"):
        assert re.search(rf"{phase} .* \(target <= 5 ms: " + verdict, out), out
    rows = re.findall(
        r"^  (?:batch read|stream) .*?\s(\d+)\s+\d+\s+[\d.]+\s+[\d.]+\s+\d+$", out, re.M
    )
    assert len(rows) == 2 and rows[0] == rows[1] and int(rows[0]) > 0, out  # every row, both
    samples = re.findall(r"^  persist -> .*?\s(\d+)(?:\s+\d+){3}$", out, re.M)
    assert len(samples) == 7 and all(int(n) > 0 for n in samples), out
    assert ("... delivery: freshness" in proc.stderr) and ("consumer cost" in proc.stderr)


@dataclass
class _Progress:
    timestamp: str
    durationMs: dict[str, int]  # noqa: N815 - Spark's name


@dataclass
class _Query:
    recentProgress: list[_Progress]  # noqa: N815 - Spark's name


def test_a_row_is_delivered_when_its_micro_batch_addbatch_returns() -> None:
    """A row seen at a micro-batch's start (its current_timestamp, a few ms after the progress
    timestamp) is delivered at that start + triggerExecution - commitOffsets."""
    query = _Query(
        [
            _Progress("2026-11-27T19:00:01.000Z", {"triggerExecution": 500, "commitOffsets": 100}),
            _Progress("2026-11-27T19:00:00.000Z", {"triggerExecution": 300, "commitOffsets": 50}),
        ]
    )
    t0 = 1795806000.0  # 2026-11-27T19:00:00Z
    stamp = int((t0 - 0.2) * 1e6)
    rows = [(stamp, int((t0 + 0.004) * 1e6)), (stamp, int((t0 + 1.0) * 1e6))]
    delivered, seen = _freshness("memory", rows, query, {})
    assert (delivered.samples, seen.samples) == (2, 2)
    assert (delivered.p50_ms, delivered.max_ms) == pytest.approx((1025.0, 1600.0))  # 450, 1600
    assert (seen.kind, seen.max_ms) == ("memory seen", pytest.approx(1200.0))
