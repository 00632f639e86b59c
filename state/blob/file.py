"""A Blob in a local (or shared, POSIX) directory: ``file:///absolute/path``.

Each key is a file under the root; the ``/`` in a key makes subdirectories
(every segment is checked by :func:`validate_key`, so no key escapes the root).

Atomicity and durability of :meth:`FileBlob.set`: the value is written to a
temporary file in the key's directory, flushed and ``fsync``-ed, then
``os.replace``-d onto the key. A reader therefore sees the old bytes or the new
bytes whole, never a prefix, and a crash of the *process* at any point leaves
either no key or the whole value (the page cache outlives the process).

The directory is deliberately *not* ``fsync``-ed after the rename: that would
double the synchronous flushes of every write. The trade-off is for *power
loss* (or a kernel crash) only: a set that returned just before may be rolled
back so that the key is absent (or holds its previous value) after reboot. The
data itself is already on disk, so on journaling filesystems (ext4, xfs) a
key, when present, is always whole. Persist keys are write-once, so a rolled
back set can only lose a part or rollup that the last moments before the power
loss wrote; deployments that must survive power loss with no loss at all
should use an object store (``s3://``).

Temporary files are named ``.tmp~<uuid>``; ``~`` is outside the key alphabet,
so no key can collide with one. :meth:`FileBlob.list_keys` skips every file or
directory whose name is not a valid key segment, temp files included. A
process crash mid-set (or mid-stream: a part is streamed into its temp file
while it is encoded, see :meth:`FileBlob.open_writer`) can leave one behind; it
is never listed, and the orphan sweep deletes it once no writer has touched it
for the staged-part grace period (:meth:`FileBlob.delete_abandoned`).

Because keys are files and directories, a key cannot also be a "directory" of
other keys (``a`` and ``a/b`` cannot coexist, unlike in S3); such a set raises
:class:`InvalidUsage`. Persist's key layout never does this. Directories emptied
by deletes are left in place, so a delete never races a concurrent set into
the same directory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import BinaryIO, cast

from ..errors import InvalidUri, InvalidUsage, StoreUnavailable
from . import Blob, BlobMeta, BlobValue, BlobWriter, validate_key

_TMP_PREFIX = ".tmp~"

WRITEBACK_BYTES = 8 * 1024 * 1024
"""A streamed value's bytes are handed to the kernel's writeback every this many bytes
(``sync_file_range(SYNC_FILE_RANGE_WRITE)``, Linux), so the fsync at commit finds little
left to write. Without it a 64 MiB part sat dirty in the page cache until the fsync, which
then stalled the writer for the whole flush; with it the disk works while the part is
still being encoded."""


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; Python's ``os`` does not wrap it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int, int], int], fn)


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
"""Start writeback of the range's dirty pages, and do not wait for it (linux/fs.h)."""

# Errors that mean "no file at this key": the path is missing, or a segment of
# it is a file (``a`` exists, ``a/b`` asked for), or it names a directory.
_ABSENT = (FileNotFoundError, NotADirectoryError, IsADirectoryError)


def _is_key_segment(name: str) -> bool:
    """Whether ``name`` could be one ``/``-separated segment of a valid key."""
    try:
        validate_key(name)
    except InvalidUsage:
        return False
    return True


@contextmanager
def _store_errors(root: str, key: str, path: str) -> Iterator[None]:
    """Turn the OS's errors writing ``key`` into persist's (a collision is the caller's)."""
    try:
        yield
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
        raise InvalidUsage(
            f"blob key {key!r} collides with another key in {root}: a key cannot "
            f"also be a prefix directory of other keys in a file:// blob ({e})"
        ) from e
    except OSError as e:
        raise StoreUnavailable(f"cannot write blob {path}: {e}") from e


class _FileWriter(BlobWriter):
    """A temp file in the key's directory, renamed onto the key at commit (see the module doc)."""

    def __init__(self, root: str, key: str, path: str) -> None:
        self._root = root
        self._key = key
        self._path = path
        directory = os.path.dirname(path)
        self._tmp = os.path.join(directory, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        with _store_errors(root, key, path):
            os.makedirs(directory, exist_ok=True)
            self._file: BinaryIO | None = open(self._tmp, "xb")  # noqa: SIM115 - closed at commit
        self._written = 0
        self._synced = 0
        """Bytes of the temp file already handed to writeback (``_start_writeback``)."""
        self._writeback = _SYNC_FILE_RANGE is not None

    def write(self, data: BlobValue) -> int:
        """Write ``data`` to the temp file (large pieces go straight to the OS, no copy)."""
        if self._file is None:
            raise InvalidUsage(f"blob writer of {self._key!r} was already committed or aborted")
        try:
            with _store_errors(self._root, self._key, self._path):
                n = self._file.write(data)
                self._written += n
                if self._writeback and self._written - self._synced >= WRITEBACK_BYTES:
                    self._start_writeback(self._file)
                return n
        except BaseException:
            self.abort()
            raise

    def _start_writeback(self, file: BinaryIO) -> None:
        """Start (not wait for) the disk write of what was written since the last call.

        Only a hint: durability still comes from commit's fsync. Where the call is missing
        or refused (not Linux, a file system without it) writeback is left to the kernel.
        """
        assert _SYNC_FILE_RANGE is not None
        file.flush()
        length = self._written - self._synced
        if _SYNC_FILE_RANGE(file.fileno(), self._synced, length, _SYNC_FILE_RANGE_WRITE) != 0:
            self._writeback = False
            return
        self._synced = self._written

    def commit(self) -> None:
        """Flush and fsync the temp file, then rename it onto the key."""
        if self._file is None:
            raise InvalidUsage(f"blob writer of {self._key!r} was already committed or aborted")
        try:
            with _store_errors(self._root, self._key, self._path):
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None
                os.replace(self._tmp, self._path)
        except BaseException:
            # Nothing was renamed, so the key is unchanged; do not leave litter.
            self.abort()
            raise

    def abort(self) -> None:
        """Close and remove the temp file."""
        if self._file is not None:
            self._file.close()
            self._file = None
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


class FileBlob(Blob):
    """Keys are files under one root directory; see the module doc for the guarantees."""

    def __init__(self, root: str) -> None:
        self._root = root

    @classmethod
    def from_uri(cls, uri: str) -> FileBlob:
        """Open ``file:///absolute/path``, creating the directory if it does not exist."""
        scheme, sep, path = uri.partition("://")
        if scheme != "file" or not sep or not os.path.isabs(path):
            raise InvalidUri(
                f"invalid file blob URI {uri!r}: the path must be absolute, "
                "use file:///absolute/path"
            )
        root = os.path.normpath(path)
        if os.path.exists(root) and not os.path.isdir(root):
            raise InvalidUri(
                f"invalid file blob URI {uri!r}: {root} exists and is not a directory, "
                "use file:///absolute/path naming a directory"
            )
        try:
            os.makedirs(root, exist_ok=True)
        except OSError as e:
            raise StoreUnavailable(f"cannot create blob directory {root}: {e}") from e
        return cls(root)

    @property
    def uri(self) -> str:
        """``file://`` followed by the absolute root path."""
        return f"file://{self._root}"

    def _path(self, key: str) -> str:
        return os.path.join(self._root, *validate_key(key).split("/"))

    def get(self, key: str) -> bytes | None:
        """Read the whole file; a missing key (or one shadowed by a directory) is ``None``."""
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                return f.read()
        except _ABSENT:
            return None
        except OSError as e:
            raise StoreUnavailable(f"cannot read blob {path}: {e}") from e

    def get_view(self, key: str) -> memoryview | None:
        """The file mapped read-only: its pages are the page cache's, never copied.

        Reading a 64 MiB part with ``read()`` cost ~7x the CPU of mapping it (a
        fresh 64 MiB buffer faulted in page by page, then a copy), most of a Spark
        read task's own time. Safe because a key's file is never modified in
        place: a set replaces it by rename, and a delete (GC) unlinks it, which
        leaves an existing mapping readable until its last view is dropped.
        """
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size == 0:
                    return memoryview(b"")  # mmap refuses an empty file
                return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except _ABSENT:
            return None
        except (OSError, ValueError) as e:
            raise StoreUnavailable(f"cannot read blob {path}: {e}") from e

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """``stat`` each file: size and modification time, no data read."""
        out: dict[str, BlobMeta] = {}
        for key in keys:
            path = self._path(key)
            try:
                st = os.stat(path)
            except _ABSENT:
                continue
            except OSError as e:
                raise StoreUnavailable(f"cannot stat blob {path}: {e}") from e
            if stat.S_ISREG(st.st_mode):
                out[key] = BlobMeta(key, st.st_size, st.st_mtime_ns // 1_000_000)
        return out

    def set(self, key: str, value: BlobValue) -> None:
        """Write a temp file, fsync it, rename it onto the key (see the module doc)."""
        writer = self.open_writer(key)
        writer.write(value)
        writer.commit()

    def open_writer(self, key: str) -> BlobWriter:
        """Stream into a temp file beside the key; commit fsyncs it and renames it onto the key.

        The bytes go to the file as they are written (nothing is held in
        memory), with ``set``'s guarantees: until the rename there is no key.
        """
        return _FileWriter(self._root, key, self._path(key))

    def delete(self, key: str) -> int | None:
        """Unlink the file; the size comes from a stat just before."""
        path = self._path(key)
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                return None
            os.unlink(path)
        except _ABSENT:
            return None
        except OSError as e:
            raise StoreUnavailable(f"cannot delete blob {path}: {e}") from e
        return st.st_size

    def delete_abandoned(self, prefix: str, older_than_ms: int) -> int:
        """Delete temp files in ``prefix``'s directory not written for ``older_than_ms``.

        A live writer's temp file is modified with every write; one a crashed
        process left (a part streamed when its executor died) stays put. A
        writer idle for longer loses its temp file, so its commit fails and
        stores nothing (its part was never referenced).
        """
        head = prefix.rpartition("/")[0]
        directory = os.path.join(self._root, *validate_key(head).split("/")) if head else self._root
        limit_ns = time.time_ns() - older_than_ms * 1_000_000
        deleted = 0
        try:
            entries = [e for e in os.scandir(directory) if e.name.startswith(_TMP_PREFIX)]
        except _ABSENT:
            return 0
        except OSError as e:
            raise StoreUnavailable(f"cannot list blob directory {directory}: {e}") from e
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_mtime_ns <= limit_ns:
                    os.unlink(entry.path)
                    deleted += 1
            except FileNotFoundError:
                continue  # committed (renamed) or deleted meanwhile
            except OSError as e:
                raise StoreUnavailable(f"cannot delete blob temp file {entry.path}: {e}") from e
        return deleted

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Walk only the subtree that can hold keys with ``prefix``; skip non-key names."""
        head, slash, _ = prefix.rpartition("/")
        if not slash:
            return self._walk(self._root, "", prefix)
        try:
            validate_key(head)
        except InvalidUsage:
            # A valid key starting with ``head/`` would make ``head`` a valid key too,
            # so there is no such key (and ``head`` may not be safe to join to the root).
            return iter(())
        return self._walk(os.path.join(self._root, *head.split("/")), f"{head}/", prefix)

    def _walk(self, directory: str, key_prefix: str, prefix: str) -> Iterator[BlobMeta]:
        try:
            entries = list(os.scandir(directory))
        except _ABSENT:
            return
        except OSError as e:
            raise StoreUnavailable(f"cannot list blob directory {directory}: {e}") from e
        for entry in entries:
            if not _is_key_segment(entry.name):
                continue  # a temp file, or litter no key can name
            key = key_prefix + entry.name
            try:
                if entry.is_dir(follow_symlinks=False):
                    # Descend only where a key below could still start with ``prefix``.
                    below = f"{key}/"
                    if below.startswith(prefix) or prefix.startswith(below):
                        yield from self._walk(entry.path, below, prefix)
                elif key.startswith(prefix):
                    st = entry.stat(follow_symlinks=False)
                    yield BlobMeta(key, st.st_size, st.st_mtime_ns // 1_000_000)
            except FileNotFoundError:
                continue  # deleted while we were listing
