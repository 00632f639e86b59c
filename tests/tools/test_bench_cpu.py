"""The Spark benchmarks' CPU split: who in the process tree spent the CPU of a scan or write."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_persist.tools.bench.cpu import CpuMeter

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_cpu_of_a_jvms_children_counts_as_workers_and_the_rest_as_driver(tmp_path: Path) -> None:
    """A process named ``java`` is the JVM and whatever it starts (Spark's Python workers,
    running or exited, whoever reaps them) is the workers'; this process and its other
    children are the driver's; CPU spent before the meter started does not count.
    Protects: persist's own cost in the Spark benchmarks is read from the workers' share."""
    java = tmp_path / "java"  # a shell under the JVM's process name
    java.symlink_to("/bin/sh")
    # The "JVM" starts worker A, which burns CPU (before the meter starts), then more, idles
    # and exits (a streaming query's runner); then worker B, which burns and stays up (as
    # Spark's daemon does) until its stdin closes.
    a = (
        BURN.format(s=0.3)
        + "print('a', flush=True)\nimport sys, time\nsys.stdin.readline()\n"
        + BURN.format(s=0.2)
        + "time.sleep(0.6)\n"
    )
    b = BURN.format(s=0.3) + "print('b', flush=True)\nimport sys\nsys.stdin.read()\n"
    jvm = subprocess.Popen(
        [str(java), "-c", f'"{sys.executable}" -c "$0"; "{sys.executable}" -c "$1"', a, b],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert jvm.stdin is not None and jvm.stdout is not None
    try:
        assert jvm.stdout.readline() == "a\n"
        with CpuMeter(interval_s=0.1) as meter:
            jvm.stdin.write("go\n")
            jvm.stdin.flush()
            assert jvm.stdout.readline() == "b\n"
            idle_end = BURN.format(s=0.3) + "import time\ntime.sleep(0.3)\n"
            subprocess.run([sys.executable, "-c", idle_end], check=True)
    finally:
        jvm.communicate("")
    spent = meter.split
    assert spent is not None
    # A's last 0.2 s and B's 0.3 s, not A's first 0.3 s (spent before the meter started).
    assert 0.45 <= spent.workers <= 0.7, spent
    assert spent.driver >= 0.25, spent
    assert spent.jvm < 0.15, spent
