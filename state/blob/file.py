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
import errno
import fcntl
import mmap
import os
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import cast

from ..errors import InvalidUri, InvalidUsage, StoreUnavailable
from . import Blob, BlobMeta, BlobValue, BlobWriter, validate_key

_TMP_PREFIX = ".tmp~"

WRITEBACK_BYTES = 8 * 1024 * 1024
"""A streamed value reaches its file this many bytes at a time, from one page-aligned
buffer: with ``O_DIRECT`` (Linux) straight to the disk, else through the page cache, handed
to the kernel's writeback at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``) so commit's
fsync finds little left to write. Without the writeback hint a 64 MiB part sat dirty in the
page cache until the fsync, which then stalled the writer for the whole flush."""

_ALIGN = 4096
"""What ``O_DIRECT`` needs of a write's address, length and file offset (a page: at least
every file system's logical block)."""

_O_DIRECT: int | None = getattr(os, "O_DIRECT", None)
"""Linux's flag to write a file's bytes from the caller's buffer to the disk, bypassing the
page cache; None where the OS has none (then every write is buffered)."""


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


class _Buffers:
    """Page-aligned ``WRITEBACK_BYTES`` buffers, reused by the writers of this process.

    A fresh buffer costs its pages' first touch; kept, it is warm for the next part.
    At most ``KEEP`` idle ones are kept: a streaming writer uses two (one filling, one
    being written), and staging streams one part at a time per task.
    """

    KEEP = 4

    def __init__(self) -> None:
        self._idle: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        """An idle buffer of WRITEBACK_BYTES, or a new one."""
        with self._lock:
            while self._idle:
                buf = self._idle.pop()
                if len(buf) == WRITEBACK_BYTES:  # a test may have changed the size
                    return buf
        return mmap.mmap(-1, WRITEBACK_BYTES)

    def give(self, buf: mmap.mmap) -> None:
        """Return a buffer taken with :meth:`take`."""
        with self._lock:
            if len(self._idle) < self.KEEP:
                self._idle.append(buf)
                return
        try:
            buf.close()
        except BufferError:
            pass  # a failed write's traceback still holds a view of it: it goes with that


_BUFFERS = _Buffers()

_write_pool: tuple[int, ThreadPoolExecutor] | None = None
_write_pool_lock = threading.Lock()


def _writes() -> ThreadPoolExecutor:
    """The threads that write full buffers to their files, started on first use in each
    process (a forked Spark worker inherits no threads, so not its parent's pool)."""
    global _write_pool  # noqa: PLW0603 - one pool a process, made on first use
    with _write_pool_lock:
        if _write_pool is None or _write_pool[0] != os.getpid():
            _write_pool = (
                os.getpid(),
                ThreadPoolExecutor(max_workers=4, thread_name_prefix="persist-file-write"),
            )
        return _write_pool[1]


class _FileWriter(BlobWriter):
    """A temp file in the key's directory, renamed onto the key at commit (see the module doc).

    Bytes collect in a page-aligned buffer and reach the file WRITEBACK_BYTES at a
    time, with ``O_DIRECT`` where the file system takes it: a part's bytes then go
    from that buffer to the disk without a copy into the page cache. That copy was
    the largest cost of staging a part (a Spark sink's 1 GiB write: 36% of its tasks'
    samples, 1.3-1.5 s of system CPU per GiB, most of it the kernel finding fresh
    page-cache pages); written directly, a GiB cost 0.04 s of system CPU and went 1.5-2x
    faster. A value smaller than the buffer (a streaming micro-batch's part, a rollup)
    is written through the page cache at commit, where a reader tailing the shard will
    find it. A file system that refuses ``O_DIRECT`` (tmpfs) gets every write buffered,
    with the writeback hint.

    A full buffer is written by a background thread while the caller fills the next:
    a direct write returns only once the disk has the bytes, and staging 512 MiB spent
    1.55 of its 1.93 s there, blocked, with the part's encoding (and, in a Spark task,
    the rows coming in) stopped behind it. One write is in flight at a time, so the file
    is written in order, and a writer holds two buffers at most.
    """

    def __init__(self, root: str, key: str, path: str) -> None:
        self._root = root
        self._key = key
        self._path = path
        directory = os.path.dirname(path)
        self._tmp = os.path.join(directory, f"{_TMP_PREFIX}{uuid.uuid4().hex}")
        with _store_errors(root, key, path):
            os.makedirs(directory, exist_ok=True)
            self._fd: int | None = os.open(
                self._tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644
            )
        self._buf: mmap.mmap | None = None
        self._filled = 0
        """Bytes in ``_buf`` not yet in the file."""
        self._written = 0
        """Bytes in the file."""
        self._direct = False
        """Whether the file is open with ``O_DIRECT`` (from its first full buffer on)."""
        self._may_direct = _O_DIRECT is not None
        self._writeback = _SYNC_FILE_RANGE is not None
        self._in_flight: Future[None] | None = None
        """The background write of the last full buffer (see the class doc)."""

    def write(self, data: BlobValue) -> int:
        """Append ``data``: into the buffer, and each time it fills, to the file."""
        if self._fd is None:
            raise InvalidUsage(f"blob writer of {self._key!r} was already committed or aborted")
        try:
            with _store_errors(self._root, self._key, self._path):
                view = memoryview(data).cast("B")
                if self._buf is None:
                    self._buf = _BUFFERS.take()
                size = len(self._buf)
                done = 0
                while done < len(view):
                    n = min(size - self._filled, len(view) - done)
                    self._buf[self._filled : self._filled + n] = view[done : done + n]
                    self._filled += n
                    done += n
                    if self._filled == size:
                        self._flush_full()
                return len(view)
        except BaseException:
            self.abort()
            raise

    def _flush_full(self) -> None:
        """Hand the full buffer to a background write, once the one before has ended, and
        go on in a fresh buffer."""
        assert self._buf is not None
        self._await_write()
        full, length = self._buf, self._filled
        self._buf, self._filled = _BUFFERS.take(), 0
        self._in_flight = _writes().submit(self._write_full, full, length)

    def _await_write(self) -> None:
        """Wait for the background write in flight, if any; raise what it raised."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            in_flight.result()

    def _write_full(self, buf: mmap.mmap, length: int) -> None:
        """Write a full buffer to the file, directly if it can be, else buffered; then
        return the buffer (on a background thread: the caller waits for it before any other
        use of the file)."""
        try:
            if self._may_direct and not self._direct:
                self._direct = self._may_direct = self._set_direct(True)
            self._write_all(memoryview(buf)[:length])
            if not self._direct and self._writeback:
                self._start_writeback(length)
        finally:
            _BUFFERS.give(buf)

    def _set_direct(self, on: bool) -> bool:
        """Turn ``O_DIRECT`` on or off for the file; whether it is on now (False if the file
        system refused it)."""
        assert self._fd is not None and _O_DIRECT is not None
        flags = fcntl.fcntl(self._fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETFL, flags | _O_DIRECT if on else flags & ~_O_DIRECT)
        except OSError:
            return False
        return on

    def _stop_direct(self) -> None:
        """Write the rest of the file buffered, for good."""
        self._direct = self._may_direct = self._set_direct(False)

    def _write_all(self, view: memoryview) -> None:
        """``os.write`` until all of ``view`` is in the file. A direct write refused, or cut
        short at an unaligned length (a full disk, a signal), leaves the rest buffered."""
        assert self._fd is not None
        while len(view):
            try:
                n = os.write(self._fd, view)
            except OSError as e:
                if not (self._direct and e.errno == errno.EINVAL):
                    raise
                # Took the flag, refused the write (some network and FUSE file systems).
                self._stop_direct()
                continue
            self._written += n
            view = view[n:]
            if self._direct and len(view) and n % _ALIGN:
                self._stop_direct()

    def _start_writeback(self, length: int) -> None:
        """Start (not wait for) the disk write of the ``length`` buffered bytes just written.

        Only a hint: durability still comes from commit's fsync. Where the call is missing
        or refused (not Linux, a file system without it) writeback is left to the kernel.
        """
        assert _SYNC_FILE_RANGE is not None and self._fd is not None
        if _SYNC_FILE_RANGE(self._fd, self._written - length, length, _SYNC_FILE_RANGE_WRITE) != 0:
            self._writeback = False

    def _flush_rest(self) -> None:
        """Write what the buffer holds: a direct file takes it padded to a whole page and
        is cut back to its length; any other is written as it is."""
        assert self._fd is not None
        self._await_write()
        if self._buf is None or not self._filled:
            return
        if not self._direct:
            self._write_all(memoryview(self._buf)[: self._filled])
            return
        length = self._written + self._filled
        padded = -(-self._filled // _ALIGN) * _ALIGN
        self._buf[self._filled : padded] = bytes(padded - self._filled)
        self._write_all(memoryview(self._buf)[:padded])
        os.ftruncate(self._fd, length)
        self._written = length

    def commit(self) -> None:
        """Write the rest, fsync the temp file, then rename it onto the key."""
        if self._fd is None:
            raise InvalidUsage(f"blob writer of {self._key!r} was already committed or aborted")
        try:
            with _store_errors(self._root, self._key, self._path):
                self._flush_rest()
                os.fsync(self._fd)
                self._close()
                os.replace(self._tmp, self._path)
        except BaseException:
            # Nothing was renamed, so the key is unchanged; do not leave litter.
            self.abort()
            raise

    def _close(self) -> None:
        """Close the file (once no write is in flight: an abort's error is moot) and return
        the buffer."""
        try:
            self._await_write()
        except Exception:  # noqa: BLE001, S110 - the file is being given up
            pass
        if self._buf is not None:
            _BUFFERS.give(self._buf)
            self._buf = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def abort(self) -> None:
        """Close and remove the temp file."""
        self._close()
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

        A live writer's temp file is modified with every WRITEBACK_BYTES it is
        given; one a crashed process left (a part streamed when its executor
        died) stays put. A writer that fills no buffer for longer loses its temp
        file, so its commit fails and stores nothing (its part was never referenced).
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
