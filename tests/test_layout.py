"""The promised layering: state never imports Spark, pubsub never imports the connector."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import importlib, pkgutil, sys
import pyspark_persist.state as state, pyspark_persist.pubsub as pubsub
for pkg in (state, pubsub):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
spark = sorted(n for n in sys.modules if n == "pyspark" or n.startswith("pyspark."))
connector = sorted(
    n for n in sys.modules
    if n.startswith("pyspark_persist.")
    and not n.startswith(("pyspark_persist.state", "pyspark_persist.pubsub"))
)
print(spark, connector)
"""


def test_state_and_pubsub_import_neither_spark_nor_the_connector() -> None:
    """Importing every module of state/ and pubsub/ loads no pyspark and no connector module."""
    out = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[] []", out.stdout + out.stderr
