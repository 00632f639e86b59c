"""An in-process Blob for tests and benchmarks: ``mem://`` or ``mem://NAME``.

``mem://NAME`` names a process-global store, so two clients opened from one URI
(say a writer and a reader in the same test) share data the way two clients of
one S3 bucket would. ``mem://`` with no name gives a fresh private store each
time it is opened; its :attr:`MemBlob.uri` is ``mem://``, so reopening it gives
another empty store. Named stores live until the process exits: nothing
persists and nothing is freed, which is the point for tests and the price for
benchmarks.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable, Iterator

from ..errors import InvalidUri
from . import Blob, BlobMeta, BlobValue, validate_key

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]*$")


class _Store:
    """The shared state behind every MemBlob opened with one name."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.data: dict[str, bytes] = {}
        self.modified_ms: dict[str, int] = {}


# Named stores, shared by every MemBlob opened with the same name in this process.
_REGISTRY: dict[str, _Store] = {}
_REGISTRY_LOCK = threading.Lock()


class MemBlob(Blob):
    """A dict behind a lock. Values are stored as immutable ``bytes`` so a set is atomic."""

    def __init__(self, name: str, store: _Store) -> None:
        self._name = name
        self._store = store

    @classmethod
    def from_uri(cls, uri: str) -> MemBlob:
        """Open ``mem://NAME`` (shared per process) or ``mem://`` (private, fresh)."""
        scheme, sep, name = uri.partition("://")
        if scheme != "mem" or not sep or not _NAME_RE.match(name):
            raise InvalidUri(
                f"invalid mem blob URI {uri!r}: use mem:// or mem://NAME where NAME is "
                "letters, digits, '_', '-' and '.'"
            )
        if not name:
            return cls(name, _Store())
        with _REGISTRY_LOCK:
            store = _REGISTRY.setdefault(name, _Store())
        return cls(name, store)

    @property
    def uri(self) -> str:
        """``mem://NAME``; ``mem://`` for a private store (reopening it gives a fresh one)."""
        return f"mem://{self._name}"

    def get(self, key: str) -> bytes | None:
        """Return the stored bytes; they are immutable, so no copy is needed."""
        validate_key(key)
        with self._store.lock:
            return self._store.data.get(key)

    def set(self, key: str, value: BlobValue) -> None:
        """Store a private ``bytes`` copy so later changes to a caller's buffer cannot leak in."""
        validate_key(key)
        frozen = bytes(value)
        with self._store.lock:
            self._store.data[key] = frozen
            self._store.modified_ms[key] = time.time_ns() // 1_000_000

    def delete(self, key: str) -> int | None:
        """Remove ``key``; idempotent."""
        validate_key(key)
        with self._store.lock:
            value = self._store.data.pop(key, None)
            self._store.modified_ms.pop(key, None)
        return None if value is None else len(value)

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Yield from a snapshot taken under the lock, so concurrent writers cannot break it."""
        with self._store.lock:
            snapshot = [
                BlobMeta(key, len(value), self._store.modified_ms.get(key))
                for key, value in self._store.data.items()
                if key.startswith(prefix)
            ]
        return iter(snapshot)

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """Look every key up under one lock."""
        checked = [validate_key(k) for k in keys]
        with self._store.lock:
            data, modified = self._store.data, self._store.modified_ms
            return {k: BlobMeta(k, len(data[k]), modified.get(k)) for k in checked if k in data}
