"""``persist bench txn --quick``: runs end to end and reports same-run ratios (never timed
asserts)."""

from __future__ import annotations

import json
import re
import subprocess
import sys


def test_bench_txn_quick_json() -> None:
    cmd = [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "txn", "--quick"]
    proc = subprocess.run(
        [*cmd, "--commits", "10", "--shards", "2,3", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["location"] == "file/sqlite"
    assert len(result["append"]["seconds"]) == 10
    assert sorted(result["txns"]) == ["2", "3"]
    assert all(len(t["seconds"]) == 10 and t["p50_ms"] > 0 for t in result["txns"].values())


def test_bench_txn_freshness_section_reads_plain_txn_and_ceiling() -> None:
    """The freshness section at a tiny size: the reader saw every row of both kinds and the
    bare pushes, and the text names each figure and both ratios against the 1.2x target."""
    cmd = [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "txn", "--quick"]
    args = ["--commits", "3", "--shards", "2", "--fresh-commits", "4"]
    proc = subprocess.run([*cmd, *args, "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    fresh = json.loads(proc.stdout)["freshness"]
    assert fresh["missed"] == 0
    for kind in ("plain", "txn", "round_trip"):
        assert len(fresh[kind]["seconds"]) == 4
        assert 0 < fresh[kind]["p50_ms"] <= fresh[kind]["p95_ms"] <= fresh[kind]["max_ms"]
    assert fresh["ratio_p50"] == fresh["txn"]["p50_ms"] / fresh["plain"]["p50_ms"]

    proc = subprocess.run(cmd + args, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("freshness through PubSub"))
    section = lines[start:]
    for label in ("plain shard", "txn shard", "ceiling: PubSub round trip alone"):
        assert re.search(
            rf"^  {label}.* p50 +[\d.]+ ms  p95 +[\d.]+ ms  max +[\d.]+ ms$",
            "\n".join(section),
            re.MULTILINE,
        ), section
    ratios = [line for line in section if line.startswith("  txn/plain")]
    assert len(ratios) == 1 and re.fullmatch(
        r"  txn/plain  p50 [\d.]+x \(target <= 1\.2x: (ok|missed)\)"
        r"  p95 [\d.]+x \(target <= 1\.2x: (ok|missed)\)",
        ratios[0],
    ), section


def test_bench_txn_freshness_skipped_on_mem() -> None:
    """On mem/mem no other process could read the shards: no freshness figures (null in the
    JSON), and the text says why."""
    cmd = [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "txn", "--quick"]
    args = ["--commits", "3", "--shards", "2", "--location", "mem/mem"]
    proc = subprocess.run([*cmd, *args, "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["freshness"] is None
    proc = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "freshness through PubSub: not timed on mem/mem" in proc.stdout


def test_bench_txn_refuses_negative_fresh_commits_before_running() -> None:
    """A negative count is named with what it takes, before any commit is timed."""
    cmd = [sys.executable, "-m", "pyspark_persist.tools.cli", "bench", "txn", "--fresh-commits"]
    proc = subprocess.run([*cmd, "-1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--fresh-commits must be 0 (no freshness section) or more" in proc.stderr
    assert "untimed commits" not in proc.stderr
