"""Shard fixtures: a client per backend pair, so shard behaviour is tested on every store.

The pairs are the ones a user deploys: ``mem/mem`` (tests), ``file/sqlite``
(the embedded default), ``file/postgres`` and ``s3/postgres`` (S3 through a
moto server on loopback). Shard names are fresh per test because the
PostgreSQL database outlives the test run.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyspark_persist.state import PersistClient

PAIRS = [
    "mem-mem",
    "file-sqlite",
    pytest.param("file-postgres", marks=pytest.mark.postgres),
    pytest.param("s3-postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=PAIRS)
def location(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """A ``(blob_uri, consensus_uri)`` pair, fresh for the test."""
    blob_kind, consensus_kind = request.param.split("-")
    tag = uuid.uuid4().hex
    if blob_kind == "mem":
        blob = f"mem://{tag}"
    elif blob_kind == "file":
        blob = f"file://{tmp_path}/blob"
    else:
        endpoint = request.getfixturevalue("moto_server")
        blob = f"s3://persist-test/{tag}?endpoint_url={endpoint}"
    if consensus_kind == "mem":
        consensus = f"mem://{tag}"
    elif consensus_kind == "sqlite":
        consensus = f"sqlite:///{tmp_path}/consensus.db"
    else:
        consensus = request.getfixturevalue("postgres_url")
    return blob, consensus


@pytest.fixture
def client(location: tuple[str, str]) -> Iterator[PersistClient]:
    """A client on the test's backend pair."""
    c = PersistClient.open(*location)
    yield c
    c.close()


@pytest.fixture
def shard_name() -> str:
    """A shard name no other test (or earlier run against PostgreSQL) has used."""
    return f"s{uuid.uuid4().hex[:16]}"
