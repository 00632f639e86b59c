"""Edges a hostile or careless environment pushes on.

- Credentials in a PostgreSQL or S3 URI never reach logs or errors.
- SQL is parameterized: keys full of quotes and SQL leave the table intact.
- A shard name cannot escape its Blob prefix or its Consensus key.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, retry
from pyspark_persist.state.blob import open_blob, validate_key
from pyspark_persist.state.client import validate_shard_name
from pyspark_persist.state.consensus import CaSCommitted, VersionedData, open_consensus
from pyspark_persist.state.errors import InvalidUri, InvalidUsage, PersistError

SECRET = "Sup3r-s3cret-pw"

# --- credentials --------------------------------------------------------------------------------


def _chain(e: BaseException) -> str:
    return "".join(traceback.format_exception(e))


@pytest.mark.postgres
def test_postgres_password_never_logged(
    postgres_url: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A write/read cycle with a password in the URI logs (at DEBUG) and shows no password."""
    caplog.set_level(logging.DEBUG)
    uri = postgres_url.replace("postgres@", f"postgres:{SECRET}@")
    with PersistClient.open(f"file://{tmp_path}/blob", uri) as client:
        assert SECRET not in client.consensus.uri
        shard = client.open_shard(f"cred-{uuid.uuid4().hex[:8]}", pa.schema([("v", pa.int64())]))
        shard.writer().append(pa.table({"v": [1, 2]}))
        assert shard.reader().snapshot_table().num_rows == 2
        shard.gc()
    assert SECRET not in caplog.text


def test_unreachable_postgres_password_not_in_error(caplog: pytest.LogCaptureFixture) -> None:
    """Failing to connect says so without echoing the password, in the message or its chain."""
    caplog.set_level(logging.DEBUG)
    uri = f"postgresql://postgres:{SECRET}@127.0.0.1:1/test?connect_timeout=2"
    with retry.deadline_in(0.5), pytest.raises(PersistError) as info:
        open_consensus(uri).head("k")
    assert SECRET not in _chain(info.value)
    leaked = [r.getMessage() for r in caplog.records if SECRET in r.getMessage()]
    assert not leaked, leaked
    with retry.deadline_in(0.5), pytest.raises(PersistError) as bad:
        open_consensus(f"postgresql://postgres:{SECRET}@127.0.0.1:99999999/test").head("k")
    assert SECRET not in _chain(bad.value)


@pytest.mark.parametrize(
    "uri",
    [
        f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix",
        f"s3://bucket/prefix?aws_secret_access_key={SECRET}",
        f"s3://bucket/prefix?{SECRET}=1",
    ],
)
def test_s3_credentials_not_echoed(uri: str) -> None:
    """An S3 URI carrying a secret is refused without repeating it."""
    with pytest.raises(InvalidUri) as info:
        open_blob(uri)
    assert SECRET not in _chain(info.value)


# --- SQL injection ------------------------------------------------------------------------------

HOSTILE_KEYS = [
    "a'; DROP TABLE consensus; --",
    'b"; DELETE FROM consensus; --',
    "c') OR ('1'='1",
    "d\\'; SELECT pg_sleep(5); --",
    "%_*",
]


@pytest.mark.parametrize(
    "backend", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def test_sql_is_parameterized(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Keys with quotes and SQL are stored as data: the table and other keys survive."""
    uri = (
        f"sqlite:///{tmp_path}/c.db"
        if backend == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    store = open_consensus(uri)
    try:
        canary = f"canary-{uuid.uuid4().hex}"
        assert store.compare_and_set(canary, None, VersionedData(1, b"c")) == CaSCommitted()
        for raw in HOSTILE_KEYS:
            key = f"{raw}-{uuid.uuid4().hex[:6]}"
            assert store.compare_and_set(key, None, VersionedData(1, b"x")) == CaSCommitted()
            assert store.compare_and_set(key, 1, VersionedData(2, b"y")) == CaSCommitted()
            assert [r.data for r in store.scan(key, 0)] == [b"x", b"y"]
            assert store.truncate(key, 2) == 1
            assert store.head(key) == VersionedData(2, b"y")
            assert key in store.list_keys()
            with pytest.raises(InvalidUsage):
                validate_shard_name(raw)
        assert store.head(canary) == VersionedData(1, b"c")
        assert store.head("%") is None  # LIKE wildcards are not patterns either
    finally:
        store.close()


# --- shard names cannot escape ------------------------------------------------------------------

ESCAPES = [
    "../x",
    "a/../../b",
    "/etc/passwd",
    "a/b",
    "..",
    ".",
    "a\x00b",
    "a\nb",
    "",
    " a",
    "a" * 201,
    "x/..",
    "C:\\x",
    "-rf",
    "ä",
    "a b",
    "a..b",
]


@pytest.mark.parametrize("name", ESCAPES)
def test_shard_name_cannot_escape(name: str, tmp_path: Path) -> None:
    """Names that could leave the shard's Blob prefix or Consensus key are refused."""
    with pytest.raises(InvalidUsage):
        validate_shard_name(name)
    with PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db") as c:
        with pytest.raises(InvalidUsage):
            c.open_shard(name, pa.schema([("v", pa.int64())]))
    assert not (tmp_path / "x").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "key", ["../x", "a/../../b", "/abs", "a//b", "a/./b", "a\x00", "a/", "..", "a\\b"]
)
def test_blob_key_cannot_escape(key: str, tmp_path: Path) -> None:
    """Blob keys are checked by every backend before any I/O."""
    with pytest.raises(InvalidUsage):
        validate_key(key)
    blob = open_blob(f"file://{tmp_path}/root")
    for op in (lambda: blob.set(key, b"x"), lambda: blob.get(key), lambda: blob.delete(key)):
        with pytest.raises(InvalidUsage):
            op()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"]
