"""``persist bench txn --quick``: runs end to end and reports same-run ratios (never timed
asserts)."""

from __future__ import annotations

import json
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
