"""Consensus fixtures: one URI per backend, so every contract test runs on all of them.

Tests use fresh random keys (uuid4), so the shared PostgreSQL table never
needs cleaning and tests cannot see each other's rows.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pyspark_persist.state.consensus import Consensus, open_consensus

POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
_PG_START_WAIT_S = 30.0


def _postgres_up() -> bool:
    try:
        with psycopg.connect(POSTGRES_URL, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False


def _start_postgres() -> None:
    """Start the local cluster the way a container without systemd must."""
    versions = sorted(os.listdir("/etc/postgresql")) if os.path.isdir("/etc/postgresql") else []
    if not versions:
        pytest.fail("PostgreSQL is not running and /etc/postgresql has no cluster to start")
    subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"],
        check=False,
        capture_output=True,
    )


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """The test database's URL, starting the server first if it is down."""
    if _postgres_up():
        return POSTGRES_URL
    _start_postgres()
    deadline = time.monotonic() + _PG_START_WAIT_S
    while time.monotonic() < deadline:
        if _postgres_up():
            return POSTGRES_URL
        time.sleep(0.5)
    pytest.fail(
        f"PostgreSQL at {POSTGRES_URL} did not come up within {_PG_START_WAIT_S:.0f} s; "
        "start it or deselect with -m 'not postgres'"
    )


@pytest.fixture(
    params=["mem", "sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    ids=["mem", "sqlite", "postgres"],
)
def consensus_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh URI per test for each backend (PostgreSQL only started when selected)."""
    if request.param == "mem":
        return f"mem://{uuid.uuid4()}"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/consensus.db"
    url: str = request.getfixturevalue("postgres_url")
    return url


@pytest.fixture
def consensus(consensus_uri: str) -> Iterator[Consensus]:
    """The Consensus at ``consensus_uri``, closed after the test."""
    store = open_consensus(consensus_uri)
    yield store
    store.close()
