"""Benchmarks of persist itself (no Spark): see :mod:`pyspark_persist.tools.bench.core`."""
