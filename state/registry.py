"""Which backend opens which URI: the one table of Blob and Consensus schemes.

Every entry point names its stores by URI: :meth:`PersistClient.open
<pyspark_persist.state.client.PersistClient.open>`, the connector's ``blob``
and ``consensus`` options, PubSub's ``connect`` and ``auto``, the ``persist``
CLI, the checker and the benchmarks. They all come here, so they accept the
same schemes and refuse a bad one with the same :class:`InvalidUri`, which
names the schemes that work. Each backend lives in a module of its own,
imported only when a URI of its scheme is opened, so opening a ``mem://``
Blob never imports boto3 and checking a URI imports no backend at all.

A scheme is matched without regard to case (``SQLite://`` is ``sqlite://``);
the backend then parses the rest of the URI and explains what is wrong
with it.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any, Literal

from .errors import InvalidUri

Store = Literal["blob", "consensus"]


@dataclass(frozen=True)
class Backend:
    """One backend module: the store it implements and the URI schemes it opens.

    ``schemes`` maps each accepted scheme to its ``kind``, the name callers
    branch on (``sqlite`` and ``postgresql`` share the SQL module but not
    PubSub's or the CLI's behaviour).
    """

    store: Store
    module: str
    cls: str
    schemes: dict[str, str]
    example: str


BACKENDS: tuple[Backend, ...] = (
    Backend("blob", ".blob.file", "FileBlob", {"file": "file"}, "file:///abs/path"),
    Backend("blob", ".blob.s3", "S3Blob", {"s3": "s3"}, "s3://bucket/prefix"),
    Backend("blob", ".blob.mem", "MemBlob", {"mem": "mem"}, "mem://name"),
    Backend(
        "consensus",
        ".consensus.sql",
        "SqlConsensus",
        {
            "sqlite": "sqlite",
            "sqlite+pysqlite": "sqlite",
            "postgresql": "postgresql",
            "postgres": "postgresql",
            "postgresql+psycopg": "postgresql",
            "postgres+psycopg": "postgresql",
        },
        "sqlite:////abs/path.db, postgresql://user@host:5432/db",
    ),
    Backend("consensus", ".consensus.mem", "MemConsensus", {"mem": "mem"}, "mem://name"),
)
"""Every backend, one entry per module. Adding a backend is adding a row here."""


@dataclass(frozen=True)
class Resolved:
    """A URI matched to its backend: ``uri`` with its scheme in lower case, and its kind."""

    backend: Backend
    uri: str
    kind: str


def _backends(store: Store) -> list[Backend]:
    return [b for b in BACKENDS if b.store == store]


def schemes(store: Store) -> list[str]:
    """Every scheme ``store`` URIs may use, in the table's order."""
    return [s for b in _backends(store) for s in b.schemes]


def resolve(store: Store, uri: str) -> Resolved:
    """Match ``uri`` to its ``store`` backend, or raise :class:`InvalidUri` (nothing opened).

    The message quotes the URI only when it has no scheme (so holds no
    ``user:password@``); an unknown scheme is quoted alone.
    """
    examples = ", ".join(b.example for b in _backends(store))
    if not isinstance(uri, str):
        raise InvalidUri(f"{store} URI must be a string, not {type(uri).__name__}: use {examples}")
    scheme, sep, rest = uri.strip().partition("://")
    if not sep or not scheme:
        raise InvalidUri(f"{store} URI {uri!r} has no scheme: use {examples}")
    lowered = scheme.lower()
    for backend in _backends(store):
        kind = backend.schemes.get(lowered)
        if kind is not None:
            return Resolved(backend, f"{lowered}://{rest}", kind)
    raise InvalidUri(f"unknown {store} scheme {scheme!r}: use {examples}")


def blob_kind(uri: str) -> str:
    """``file``, ``s3`` or ``mem``: the backend a Blob URI names (InvalidUri if none)."""
    return resolve("blob", uri).kind


def consensus_kind(uri: str) -> str:
    """``sqlite``, ``postgresql`` or ``mem``: the backend a Consensus URI names."""
    return resolve("consensus", uri).kind


def open_store(store: Store, uri: str) -> Any:
    """Open the store ``uri`` names with the backend of its scheme (see :data:`BACKENDS`).

    Typed by its two callers, :func:`~pyspark_persist.state.blob.open_blob` and
    :func:`~pyspark_persist.state.consensus.open_consensus`, which live beside the
    abstract class they return, so this table needs neither.
    """
    resolved = resolve(store, uri)
    return _backend_class(resolved.backend).from_uri(resolved.uri)


def _backend_class(backend: Backend) -> Any:
    """The backend's class (its ``from_uri`` opens a URI), importing its module on first use."""
    return getattr(importlib.import_module(backend.module, __package__), backend.cls)


def sqlite_file(consensus_uri: str) -> str | None:
    """The absolute path of a SQLite Consensus's file; None for other kinds or no file.

    The file is where ``pubsub=auto`` advertises its server and what the CLI
    checks for before opening (opening creates it). A malformed URI gives
    None here: opening it explains what is wrong.
    """
    resolved = resolve("consensus", consensus_uri)
    if resolved.kind != "sqlite":
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        path = make_url(resolved.uri).database or ""
    except (ArgumentError, ValueError):
        return None
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return os.path.abspath(path)


def file_blob_directory(blob_uri: str) -> str | None:
    """The directory of a ``file://`` Blob (None for other kinds or a relative path)."""
    resolved = resolve("blob", blob_uri)
    path = resolved.uri.partition("://")[2]
    if resolved.kind != "file" or not os.path.isabs(path):
        return None
    return os.path.normpath(path)
