"""Blob: a durable key-value store for immutable bytes (parts and rollups).

Persist writes every key exactly once with content that never changes (a part
key is a fresh unique name; a rollup key is named after the SeqNo whose state
it holds, and that state is deterministic), so the contract is small:

- ``get`` returns the bytes or ``None`` when the key does not exist;
  ``get_view`` the same as a read-only view, without a copy where the store
  can (a file Blob maps the file: a part read then costs no copy into the
  process, which was most of a Spark task's read time);
- ``set`` stores the bytes atomically: a reader sees all of them or no key;
  ``open_writer`` does the same for a value written piece by piece (a part
  streamed as it is encoded), visible whole at its ``commit`` or never;
- ``delete`` is idempotent and returns the size freed (``None`` when absent);
  ``delete_many`` deletes many keys, in batches where the store has a
  batched delete (S3's ``delete_objects``), one by one otherwise;
- ``list_keys`` lists keys under a prefix with their sizes and the store's
  own modification times, for GC; ``stat_many`` says which of some keys
  exist (a commit checks its staged parts are still there).

Backends are chosen by URI scheme with :func:`open_blob` (the table is in
:mod:`pyspark_persist.state.registry`): ``file:///path`` (the embedded
default, atomic write via rename), ``s3://bucket/prefix`` (boto3, honours
``?endpoint_url=`` and the standard credential chain) and ``mem://name``
(one process, for tests and benchmarks).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..errors import InvalidUsage
from ..registry import open_store
from ..tracing import BLOB_TRACED, trace_store_class

_KEY_RE = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


def validate_key(key: str) -> str:
    """Reject keys that could escape a Blob's prefix (``..``, absolute paths, odd bytes)."""
    if not _KEY_RE.match(key) or any(seg in (".", "..") for seg in key.split("/")):
        raise InvalidUsage(
            f"invalid blob key {key!r}: use '/'-separated segments of letters, digits, "
            "'_', '-' and '.', with no '.' or '..' segment"
        )
    return key


BlobValue = bytes | bytearray | memoryview
"""What ``Blob.set`` takes: any contiguous bytes, so an encoder's buffer needs no extra copy."""


@dataclass(frozen=True)
class BlobMeta:
    """A key listed by :meth:`Blob.list_keys` and its size in bytes."""

    key: str
    size_bytes: int
    modified_ms: int | None = None
    """When the store wrote the object, by the store's clock (not the writer's); None if the
    store cannot tell. The orphan sweep measures a staged part's age from it."""


class BlobWriter(ABC):
    """A value written to one key piece by piece: nothing is visible before :meth:`commit`.

    The streaming form of :meth:`Blob.set`, with the same guarantee (a reader
    sees the whole value or no key). It lets a part be written as it is
    encoded, so the writer never holds the encoded part whole. Use it from one
    thread at a time; :meth:`commit` may run on another thread than the writes.
    """

    @abstractmethod
    def write(self, data: BlobValue) -> int:
        """Append ``data`` (which must not change afterwards: it may be kept until commit)."""

    @abstractmethod
    def commit(self) -> None:
        """Store everything written under the key, atomically and durably."""

    @abstractmethod
    def abort(self) -> None:
        """Drop what was written; the key is left as it was. Idempotent."""


class _SetOnCommit(BlobWriter):
    """The default writer: keep the pieces, store them with one ``set`` at commit.

    The pieces are kept by reference (an encoder's buffers are immutable), so
    until commit they cost what the caller already holds; the commit joins them
    into one value, as ``set`` takes. Stores whose ``set`` is a single upload
    (S3, memory) use it; wrappers that inject faults into ``set`` thereby inject
    them into streamed writes too.
    """

    def __init__(self, blob: Blob, key: str) -> None:
        self._blob = blob
        self._key = validate_key(key)
        self._pieces: list[BlobValue] = []

    def write(self, data: BlobValue) -> int:
        """Keep a reference to ``data``."""
        self._pieces.append(data)
        return memoryview(data).nbytes

    def commit(self) -> None:
        """One ``set`` of the joined pieces."""
        pieces, self._pieces = self._pieces, []
        self._blob.set(self._key, b"".join(pieces))

    def abort(self) -> None:
        """Forget the pieces."""
        self._pieces = []


class Blob(ABC):
    """A durable store of write-once bytes under string keys. See the module doc."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        # Every backend's get/set/delete opens a span (pyspark_persist.state.tracing).
        trace_store_class(cls, "Blob", BLOB_TRACED)

    @property
    @abstractmethod
    def uri(self) -> str:
        """The URI this Blob was opened from (credentials removed), to reopen it elsewhere."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """Return the bytes stored under ``key``, or ``None`` if there is no such key."""

    def get_view(self, key: str) -> memoryview | None:
        """The value under ``key`` as a read-only view (``None`` if absent), for readers that
        only scan it (parts). Backends that can avoid copying override it; this default
        wraps :meth:`get`'s bytes."""
        data = self.get(key)
        return None if data is None else memoryview(data)

    @abstractmethod
    def set(self, key: str, value: BlobValue) -> None:
        """Store ``value`` under ``key`` atomically and durably (overwrites are allowed)."""

    def open_writer(self, key: str) -> BlobWriter:
        """A writer that stores a value under ``key`` piece by piece (see :class:`BlobWriter`).

        This default keeps the pieces and calls :meth:`set` at commit; a store
        that can take the bytes as they come (a local file) overrides it.
        """
        return _SetOnCommit(self, key)

    @abstractmethod
    def delete(self, key: str) -> int | None:
        """Delete ``key``; idempotent. Returns the bytes freed, or ``None`` if it was absent."""

    def delete_many(self, keys: Iterable[str]) -> int:
        """Delete every key in ``keys`` (idempotent: absent keys are fine); return how many.

        The count is of keys asked for, present or not, as a batched delete
        cannot tell. Every key is checked before any is deleted. On a failure
        it raises like :meth:`delete`: keys before the failing one (or its
        batch) are gone, later ones may not be.
        GC and the orphan sweep use it, so a backend with a batched delete
        overrides it.
        """
        checked = [validate_key(key) for key in keys]  # a bad key deletes nothing
        for key in checked:
            self.delete(key)
        return len(checked)

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """The metadata of those ``keys`` that exist (absent keys are left out).

        A commit calls it on the parts it is about to reference, so it must be
        cheap: backends override it with a metadata-only request (this default
        fetches each object).
        """
        out: dict[str, BlobMeta] = {}
        for key in keys:
            data = self.get(key)
            if data is not None:
                out[key] = BlobMeta(key, len(data))
        return out

    def delete_abandoned(self, prefix: str, older_than_ms: int) -> int:
        """Delete what writers that never committed left under ``prefix`` (never a key).

        A :class:`BlobWriter` of a process that died holds unlisted bytes in
        some stores (a local file's temp file), which no key names and so no
        key-based sweep finds. The orphan sweep calls this for every shard's
        parts; only what no writer touched for ``older_than_ms`` goes. Returns
        how many such objects were deleted; stores that leave nothing (the
        default) return 0.
        """
        return 0

    @abstractmethod
    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Yield every key that starts with ``prefix``, with its size (order unspecified)."""

    def close(self) -> None:  # noqa: B027 - most backends hold nothing to release
        """Release connections; the Blob must not be used afterwards."""


def open_blob(uri: str) -> Blob:
    """Open the Blob named by ``uri`` (schemes: :data:`~..registry.BACKENDS`)."""
    opened: Blob = open_store("blob", uri)
    return opened
