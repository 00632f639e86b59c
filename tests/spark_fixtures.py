"""Spark fixtures: one SparkSession (local[2]) for the whole run, shared by every Spark test.

``format("persist")`` is found by Spark's scan of installed ``pyspark_*``
modules (a normal ``pip install .``, as in CI). A development checkout
installed in editable mode is invisible to that scan, so there, and only
there, the source is registered explicitly.
"""

from __future__ import annotations

import pkgutil

import pytest
from pyspark.sql import SparkSession


def auto_registered() -> bool:
    """Whether Spark's module scan can see pyspark_persist (a regular install)."""
    return any(m.name == "pyspark_persist" for m in pkgutil.iter_modules())


@pytest.fixture(scope="session")
def spark(spark_session: SparkSession) -> SparkSession:
    """The run's SparkSession, with format("persist") available."""
    if not auto_registered():
        from pyspark_persist import DefaultSource

        spark_session.dataSource.register(DefaultSource)
    spark_session.sparkContext.setLogLevel("ERROR")
    return spark_session
