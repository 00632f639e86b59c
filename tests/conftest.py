"""Shared fixtures: every backend-parametrized fixture lives in a sibling module."""

import os
import sys
import tempfile

import pytest

# Before any Spark JVM or Python worker starts: the embedded default location of every
# test process (and of Spark's workers, which inherit it) is a fresh directory.
os.environ.setdefault("PERSIST_HOME", tempfile.mkdtemp(prefix="persist-home-"))
# Spark's Python workers run this interpreter, so they import the pyspark_persist under test
# (by default they run the first python3 on PATH, which may hold another installed copy).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import early  # noqa: E402
from blob_fixtures import blob, blob_uri, moto_server  # noqa: E402, F401
from consensus_fixtures import consensus, consensus_uri, postgres_url  # noqa: E402, F401
from jvm_fixtures import spark_submit_java_options  # noqa: E402, F401
from shard_fixtures import client, location, shard_name  # noqa: E402, F401
from spark_fixtures import spark  # noqa: E402, F401


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the slow set-up jobs of the collected tests' fixtures in the background (``early``)."""
    if session.config.option.collectonly or not session.items:
        return
    early.start(session.config, [f for item in session.items for f in item.fixturenames])


def pytest_unconfigure(config: pytest.Config) -> None:
    """No background job starts once the run is over (e.g. after ``-x`` or Ctrl-C)."""
    early.cancel()
