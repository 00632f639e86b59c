"""The scheme table: which URIs open which backend, table-driven, nothing opened."""

from __future__ import annotations

import pytest

from pyspark_persist.state.errors import InvalidUri
from pyspark_persist.state.registry import (
    BACKENDS,
    blob_kind,
    consensus_kind,
    file_blob_directory,
    resolve,
    schemes,
    sqlite_file,
)

ACCEPTED = [
    ("blob", "file:///tmp/b", "file"),
    ("blob", "FILE:///tmp/b", "file"),
    ("blob", "s3://bucket/prefix?region=x", "s3"),
    ("blob", "mem://name", "mem"),
    ("blob", "mem://", "mem"),
    ("consensus", "sqlite:///tmp/c.db", "sqlite"),
    ("consensus", "SQLite:////tmp/c.db", "sqlite"),
    ("consensus", "sqlite+pysqlite:///c.db", "sqlite"),
    ("consensus", "postgresql://u@h:5432/db", "postgresql"),
    ("consensus", "postgres://u@h/db", "postgresql"),
    ("consensus", "postgresql+psycopg://u@h/db", "postgresql"),
    ("consensus", "mem://name", "mem"),
]

REFUSED = [
    ("blob", "no-scheme", "blob URI 'no-scheme' has no scheme"),
    ("blob", "://x", "has no scheme"),
    ("blob", "nope://x", "unknown blob scheme 'nope'"),
    ("blob", "sqlite:///x.db", "unknown blob scheme 'sqlite'"),
    ("blob", "gs://bucket", "unknown blob scheme 'gs'"),
    ("consensus", "s3://bucket", "unknown consensus scheme 's3'"),
    ("consensus", "file:///x", "unknown consensus scheme 'file'"),
    ("consensus", "postgresql+asyncpg://h/db", "unknown consensus scheme 'postgresql+asyncpg'"),
    ("consensus", "mysql://h/db", "unknown consensus scheme 'mysql'"),
    ("consensus", "", "has no scheme"),
]


@pytest.mark.parametrize(("store", "uri", "kind"), ACCEPTED)
def test_accepted(store: str, uri: str, kind: str) -> None:
    resolved = resolve(store, uri)  # type: ignore[arg-type]
    assert resolved.kind == kind
    assert resolved.uri.split("://")[0] == uri.split("://")[0].lower()
    assert (blob_kind if store == "blob" else consensus_kind)(uri) == kind


@pytest.mark.parametrize(("store", "uri", "message"), REFUSED)
def test_refused(store: str, uri: str, message: str) -> None:
    with pytest.raises(InvalidUri, match="use ") as info:
        resolve(store, uri)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_password_in_a_bad_uri_is_never_echoed() -> None:
    with pytest.raises(InvalidUri) as info:
        resolve("consensus", "postgress://user:s3cret@host/db")
    assert "s3cret" not in str(info.value) and "'postgress'" in str(info.value)


def test_one_entry_per_backend_module_and_no_scheme_twice() -> None:
    assert len({b.module for b in BACKENDS}) == len(BACKENDS)
    for store in ("blob", "consensus"):
        listed = schemes(store)  # type: ignore[arg-type]
        assert len(listed) == len(set(listed))


@pytest.mark.parametrize(
    ("uri", "path"),
    [
        ("sqlite:////abs/c.db", "/abs/c.db"),
        ("SQLITE:////abs/c.db?table=t", "/abs/c.db"),
        ("sqlite://", None),
        ("sqlite:///:memory:", None),
        ("postgresql://u@h/db", None),
        ("mem://x", None),
    ],
)
def test_sqlite_file(uri: str, path: str | None) -> None:
    assert sqlite_file(uri) == path


@pytest.mark.parametrize(
    ("uri", "path"),
    [("file:///abs/b/", "/abs/b"), ("file://relative", None), ("s3://b/p", None)],
)
def test_file_blob_directory(uri: str, path: str | None) -> None:
    assert file_blob_directory(uri) == path
