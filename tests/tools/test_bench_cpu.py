"""The Spark benchmarks' CPU split: who in the process tree spent the CPU of a scan or write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_persist.tools.bench.cpu import tree_cpu_split

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_cpu_of_a_jvms_children_counts_as_workers_and_the_rest_as_driver(tmp_path: Path) -> None:
    """A process named ``java`` is the JVM and whatever it starts (Spark's Python workers,
    running or exited) is the workers'; this process and its other children are the driver's.
    Protects: persist's own cost in the Spark benchmarks is read from the workers' share."""
    java = tmp_path / "java"  # a shell under the JVM's process name
    java.symlink_to("/bin/sh")
    before = tree_cpu_split()
    assert before is not None
    # The "JVM" starts a "worker" that burns CPU and exits (a streaming query's runner), then
    # one that burns and stays up (as Spark's daemon does) until its stdin closes.
    script = BURN.format(s=0.4) + "print('burnt', flush=True)\nimport sys\nsys.stdin.read()\n"
    jvm = subprocess.Popen(
        [
            str(java),
            "-c",
            f'"{sys.executable}" -c "$1"; "{sys.executable}" -c "$0"',
            script,
            BURN.format(s=0.3),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert jvm.stdout is not None and jvm.stdout.readline() == "burnt\n"
        subprocess.run([sys.executable, "-c", BURN.format(s=0.3)], check=True)
        after = tree_cpu_split()
    finally:
        jvm.communicate("")
    assert after is not None
    spent = after - before
    assert spent.workers >= 0.65, spent
    assert spent.driver >= 0.25, spent
    assert spent.jvm < 0.2, spent
    assert abs(spent.total - (spent.jvm + spent.workers + spent.driver)) < 1e-9
