"""Shared fixtures: every backend-parametrized fixture lives in a sibling module."""

import os
import sys
import tempfile

import pytest

# Before any Spark JVM or Python worker starts: the embedded default location of every
# test process (and of Spark's workers, which inherit it) is a fresh directory. Each xdist
# worker (``lanes``) gets its own, below the one the controlling process made.
os.environ.setdefault("PERSIST_HOME", tempfile.mkdtemp(prefix="persist-home-"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["PERSIST_HOME"] = os.path.join(
        os.environ["PERSIST_HOME"], os.environ["PYTEST_XDIST_WORKER"]
    )
    os.makedirs(os.environ["PERSIST_HOME"], exist_ok=True)
# Spark's Python workers run this interpreter, so they import the pyspark_persist under test
# (by default they run the first python3 on PATH, which may hold another installed copy).
os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

import early  # noqa: E402
import lanes  # noqa: E402
from blob_fixtures import blob, blob_uri, moto_server  # noqa: E402, F401
from consensus_fixtures import consensus, consensus_uri, postgres_url  # noqa: E402, F401
from jvm_fixtures import spark_submit_java_options  # noqa: E402, F401
from shard_fixtures import client, location, shard_name  # noqa: E402, F401
from spark_fixtures import spark  # noqa: E402, F401


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``-n`` with the default ``--dist load``: Spark's tests in one worker (``lanes``)."""
    if config.getvalue("dist") != "load":
        return None
    return lanes.LaneScheduling(config, log)  # type: ignore[arg-type]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In an xdist worker: tell the scheduler which tests are Spark's (``lanes``)."""
    lanes.write_kinds(config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the slow set-up jobs of the collected tests' fixtures in the background (``early``).

    Under xdist, one worker runs them (``lanes.is_lane_worker``); a job's result is shared with
    the other workers (``early.result``).
    """
    if session.config.option.collectonly or not session.items or not lanes.is_lane_worker():
        return
    early.start(session.config, [f for item in session.items for f in item.fixturenames])


def pytest_unconfigure(config: pytest.Config) -> None:
    """No background job starts once the run is over (e.g. after ``-x`` or Ctrl-C)."""
    early.cancel()
