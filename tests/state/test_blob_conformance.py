"""The Blob contract, run against every backend (mem, file, s3 on moto), plus URI errors.

Persist relies on exactly these properties: a missing key reads as ``None``, a
set is atomic (a reader sees the old or new bytes whole), delete is idempotent
and reports the bytes freed, ``list_keys`` shows every key and nothing else
(temp files never), and a Blob reopened from its ``uri`` sees the same data.
"""

from __future__ import annotations

import errno
import os
import random
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from blob_fixtures import MOTO_BUCKET

from pyspark_persist.state import retry
from pyspark_persist.state.blob import Blob, open_blob
from pyspark_persist.state.errors import (
    Indeterminate,
    InvalidUri,
    InvalidUsage,
    StoreUnavailable,
)

MIB = 1 << 20


def listed(blob: Blob, prefix: str = "") -> dict[str, int]:
    return {meta.key: meta.size_bytes for meta in blob.list_keys(prefix)}


def backend(blob: Blob) -> str:
    return blob.uri.partition("://")[0]


# --- the contract -------------------------------------------------------------------------


def test_get_missing_is_none(blob: Blob) -> None:
    assert blob.get("nope") is None
    assert blob.get("no/such/key") is None


@pytest.mark.parametrize("size", [0, 1, 5 * MIB], ids=["empty", "one-byte", "5MiB"])
def test_set_get_roundtrip(blob: Blob, size: int) -> None:
    value = os.urandom(size)
    blob.set("k", value)
    assert blob.get("k") == value
    assert listed(blob) == {"k": size}


@pytest.mark.parametrize("size", [0, 1, 5 * MIB], ids=["empty", "one-byte", "5MiB"])
def test_get_view_reads_what_get_reads(blob: Blob, size: int) -> None:
    """Parts are read through ``get_view`` (a file Blob maps the file): same bytes as ``get``,
    ``None`` when absent, and a view taken before an overwrite or a delete (GC) keeps the
    bytes it had: a part is never changed in place, so a reader mid-part is never torn."""
    assert blob.get_view("k") is None
    value = os.urandom(size)
    blob.set("k", value)
    view = blob.get_view("k")
    assert view is not None and view.readonly
    assert view.tobytes() == value
    blob.set("k", b"replaced")
    blob.delete("k")
    assert view.tobytes() == value
    assert blob.get_view("k") is None


def test_overwrite(blob: Blob) -> None:
    blob.set("k", b"first")
    blob.set("k", b"second, longer")
    assert blob.get("k") == b"second, longer"
    assert listed(blob) == {"k": len(b"second, longer")}


def test_delete_returns_size_then_none(blob: Blob) -> None:
    blob.set("k", b"12345")
    assert blob.delete("k") == 5
    assert blob.get("k") is None
    assert blob.delete("k") is None
    assert blob.delete("never-was") is None
    assert listed(blob) == {}


def test_delete_many_deletes_present_and_ignores_absent_keys(blob: Blob) -> None:
    for i in range(5):
        blob.set(f"s/part/{i}", b"x" * (i + 1))
    assert blob.delete_many(["s/part/0", "s/part/2", "s/part/4", "s/part/missing"]) == 4
    assert listed(blob) == {"s/part/1": 2, "s/part/3": 4}
    assert blob.delete_many([]) == 0
    assert blob.delete_many(iter(["s/part/1", "s/part/3"])) == 2
    assert listed(blob) == {}


def test_delete_many_validates_every_key_before_deleting(blob: Blob) -> None:
    blob.set("s/a", b"1")
    with pytest.raises(InvalidUsage):
        blob.delete_many(["s/a", "../escape"])
    assert listed(blob) == {"s/a": 1}


def test_list_keys_with_and_without_prefix(blob: Blob) -> None:
    keys = {
        "shard-a/part-1": b"x" * 10,
        "shard-a/part-2": b"y" * 20,
        "shard-a/rollup/v1": b"z" * 3,
        "shard-ab/part-1": b"",
        "shard-b/part-1": b"w" * 7,
        "top": b"t",
    }
    for key, value in keys.items():
        blob.set(key, value)
    sizes = {key: len(value) for key, value in keys.items()}

    def expect(prefix: str) -> dict[str, int]:
        return {k: v for k, v in sizes.items() if k.startswith(prefix)}

    assert listed(blob) == sizes
    for prefix in [
        "shard-a/",
        "shard-a",
        "shard-a/part",
        "shard-a/rollup/",
        "shard-a/rollup/v",
        "shard-",
        "t",
        "missing/",
        "missing",
        "shard-a/part-1",
        "shard-a//",
        "../",
    ]:
        assert listed(blob, prefix) == expect(prefix), prefix


def test_stat_many_names_existing_keys_with_size_and_store_time(blob: Blob) -> None:
    """What a commit's check of its staged parts relies on: present keys only, store timestamps."""
    before_ms = time.time_ns() // 1_000_000 - 5_000  # the store's clock may differ a little
    blob.set("shard-s/part/a", b"x" * 10)
    blob.set("shard-s/part/b", b"")
    got = blob.stat_many(["shard-s/part/a", "shard-s/part/missing", "shard-s/part/b"])
    assert {k: m.size_bytes for k, m in got.items()} == {"shard-s/part/a": 10, "shard-s/part/b": 0}
    for meta in [*got.values(), *blob.list_keys("shard-s/")]:
        assert meta.modified_ms is not None and meta.modified_ms >= before_ms
    assert blob.stat_many([]) == {}


def test_streamed_value_is_invisible_until_commit_then_whole(blob: Blob) -> None:
    """A value written piece by piece reads as no key until commit, then as every piece."""
    pieces = [os.urandom(n) for n in (0, 1, 4096, 3 * MIB)]
    writer = blob.open_writer("s/part/streamed")
    for piece in pieces:
        writer.write(memoryview(piece))
        assert blob.get("s/part/streamed") is None
    assert listed(blob) == {}
    writer.commit()
    assert blob.get("s/part/streamed") == b"".join(pieces)
    assert listed(blob) == {"s/part/streamed": sum(len(p) for p in pieces)}


def test_aborted_stream_leaves_no_key(blob: Blob) -> None:
    """An aborted writer stores nothing (and leaves nothing listed); abort is idempotent."""
    blob.set("s/part/kept", b"old")
    writer = blob.open_writer("s/part/kept")
    writer.write(b"new bytes that never land")
    writer.abort()
    writer.abort()
    other = blob.open_writer("s/part/other")
    other.write(b"x")
    other.abort()
    assert blob.get("s/part/kept") == b"old"
    assert listed(blob) == {"s/part/kept": 3}


def test_keys_with_slashes(blob: Blob) -> None:
    blob.set("a/b/c/d", b"deep")
    blob.set("a/e", b"shallow")
    assert blob.get("a/b/c/d") == b"deep"
    assert blob.get("a/e") == b"shallow"
    assert blob.get("a/b") is None  # a "directory" is not a key
    assert blob.delete("a/b") is None
    assert listed(blob, "a/b/") == {"a/b/c/d": 4}


@pytest.mark.parametrize(
    "key", ["../x", "/abs", "a//b", "a/./b", "a/../b", "..", ".", "", "a/", "sp ace", "a\\b"]
)
def test_invalid_keys_rejected_before_writing(blob: Blob, key: str, tmp_path: Path) -> None:
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    with pytest.raises(InvalidUsage):
        blob.set(key, b"escaped?")
    with pytest.raises(InvalidUsage):
        blob.get(key)
    with pytest.raises(InvalidUsage):
        blob.delete(key)
    assert listed(blob) == {}
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


def test_concurrent_sets_of_distinct_keys_all_land(blob: Blob) -> None:
    values = {f"t{i}/part-{j}": os.urandom(1000 + i * 10 + j) for i in range(8) for j in range(8)}
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []
    seen_while_writing: set[str] = set()

    def writer(i: int) -> None:
        try:
            barrier.wait()
            for j in range(8):
                key = f"t{i}/part-{j}"
                blob.set(key, values[key])
                seen_while_writing.update(listed(blob))
        except BaseException as e:  # surfaced below; a thread cannot fail the test itself
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    # Listing mid-write shows finished keys only: never a temp file or other litter.
    assert seen_while_writing <= set(values)
    assert listed(blob) == {key: len(value) for key, value in values.items()}
    for key, value in values.items():
        assert blob.get(key) == value


def test_reader_never_sees_a_partial_value(blob: Blob) -> None:
    old, new = b"o" * (2 * MIB), b"n" * (2 * MIB + 1)
    blob.set("k", old)
    stop = threading.Event()
    reads: list[bytes | None] = []

    def reader() -> None:
        while not stop.is_set():
            reads.append(blob.get("k"))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for i in range(8):
            blob.set("k", new if i % 2 == 0 else old)
    finally:
        stop.set()
        thread.join()
    assert reads
    assert all(value == old or value == new for value in reads)


def test_reopen_from_uri_sees_same_data(blob: Blob) -> None:
    blob.set("shard/part", b"payload")
    other = open_blob(blob.uri)
    try:
        assert other is not blob
        assert other.uri == blob.uri
        assert other.get("shard/part") == b"payload"
        other.set("shard/from-other", b"2")
        assert blob.get("shard/from-other") == b"2"
    finally:
        other.close()


def test_forked_child_writes_through_its_own_client(blob: Blob) -> None:
    """Spark's Python workers fork: a Blob inherited by a child must keep working."""
    if backend(blob) == "mem":
        pytest.skip("a mem:// store is per process by design")
    blob.set("parent", b"p")  # the parent's client (if any) now exists and is inherited
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only, never through pytest
        code = 1
        try:
            blob.set("child", b"from the child")
            code = 0 if blob.get("parent") == b"p" else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert blob.get("child") == b"from the child"


# --- backend specifics --------------------------------------------------------------------


def test_mem_named_stores_are_shared_and_anonymous_ones_private() -> None:
    name = uuid.uuid4().hex
    first, second = open_blob(f"mem://{name}"), open_blob(f"mem://{name}")
    first.set("k", b"v")
    assert second.get("k") == b"v"
    private = open_blob("mem://")
    private.set("k", b"mine")
    assert private.uri == "mem://"
    assert open_blob("mem://").get("k") is None
    assert open_blob(f"mem://{uuid.uuid4().hex}").get("k") is None


def test_file_temp_files_are_never_listed_and_failed_sets_leave_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob = open_blob(f"file://{tmp_path}/blob")
    blob.set("shard/part-1", b"whole")
    # What a crash between write and rename leaves behind:
    (tmp_path / "blob" / "shard" / ".tmp~deadbeef").write_bytes(b"half")
    (tmp_path / "blob" / ".tmp~cafe").write_bytes(b"half")
    assert listed(blob) == {"shard/part-1": 5}

    def broken_replace(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StoreUnavailable, match="No space left"):
        blob.set("shard/part-2", b"never")
    with pytest.raises(StoreUnavailable):
        blob.set("shard/part-1", b"overwrite fails")
    monkeypatch.undo()
    assert blob.get("shard/part-1") == b"whole"
    assert sorted(p.name for p in (tmp_path / "blob" / "shard").iterdir()) == [
        ".tmp~deadbeef",
        "part-1",
    ]


def _resident_bytes(path: Path) -> int:
    """Bytes of the file that sit in the page cache (``mincore`` on a mapping of it)."""
    import ctypes
    import mmap

    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) as m:
        libc = ctypes.CDLL(None, use_errno=True)
        vec = (ctypes.c_ubyte * pages)()
        buf = (ctypes.c_char * size).from_buffer(m)
        addr = ctypes.addressof(buf)
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0
        del buf
    return sum(v & 1 for v in vec) * mmap.PAGESIZE


def _takes_o_direct(directory: Path) -> bool:
    """Whether the file system under ``directory`` takes O_DIRECT (tmpfs may not)."""
    flag = getattr(os, "O_DIRECT", None)
    if flag is None:
        return False
    probe = directory / "o_direct_probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | flag, 0o644))
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
    return True


def test_file_stream_writes_a_part_past_the_page_cache_and_lands_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed value reaches its file WRITEBACK_BYTES at a time; where the file system
    takes O_DIRECT, straight to the disk: none of it is copied into the page cache (the
    bulk of a part's staging cost), and the value still lands whole, to the byte, whatever
    its length. A value smaller than one buffer goes through the page cache, where readers
    tailing the shard find it."""
    from pyspark_persist.state.blob import file as file_blob

    if not _takes_o_direct(tmp_path):
        pytest.skip("this file system refuses O_DIRECT: every write is buffered")
    monkeypatch.setattr(file_blob, "WRITEBACK_BYTES", MIB)
    blob = open_blob(f"file://{tmp_path}/blob")
    for length in (3 * MIB + 4097, 2 * MIB, MIB + 1, 5000):
        pieces = (
            [os.urandom(n) for n in (700_001, length - 700_001)]
            if length > MIB
            else [os.urandom(length)]
        )
        writer = blob.open_writer(f"shard/part-{length}")
        for piece in pieces:
            writer.write(piece)
        writer.commit()
        path = tmp_path / "blob" / "shard" / f"part-{length}"
        assert path.stat().st_size == length
        if length > MIB:
            assert _resident_bytes(path) == 0, "a direct write left its bytes in the page cache"
        else:
            assert _resident_bytes(path) == length + (-length % 4096)
        assert blob.get(f"shard/part-{length}") == b"".join(pieces)


def test_file_stream_refused_o_direct_hands_its_bytes_to_writeback_as_it_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where O_DIRECT is refused (tmpfs, some network file systems), a long streamed value is
    written through the page cache and handed to the kernel's writeback every
    WRITEBACK_BYTES (Linux), so commit's fsync has little left; the value still lands whole."""
    import errno
    import fcntl

    from pyspark_persist.state.blob import file as file_blob

    if file_blob._SYNC_FILE_RANGE is None:
        pytest.skip("sync_file_range is Linux-only; elsewhere writeback is the kernel's")
    calls: list[tuple[int, int]] = []
    real = file_blob._SYNC_FILE_RANGE
    real_fcntl = fcntl.fcntl

    def recording(fd: int, offset: int, length: int, flags: int) -> int:
        calls.append((offset, length))
        return real(fd, offset, length, flags)

    def refusing(fd: int, cmd: int, arg: int = 0) -> int:
        if cmd == fcntl.F_SETFL and file_blob._O_DIRECT and arg & file_blob._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_fcntl(fd, cmd, arg)

    monkeypatch.setattr(file_blob, "_SYNC_FILE_RANGE", recording)
    monkeypatch.setattr(fcntl, "fcntl", refusing)
    monkeypatch.setattr(file_blob, "WRITEBACK_BYTES", MIB)
    blob = open_blob(f"file://{tmp_path}/blob")
    pieces = [os.urandom(MIB // 2) for _ in range(5)]
    writer = blob.open_writer("shard/part-1")
    for piece in pieces:
        writer.write(piece)
    writer.commit()
    # Each full buffer was handed to writeback after its (background) write; the rest,
    # written by commit itself, goes straight to the fsync.
    assert calls == [(0, MIB), (MIB, MIB)]
    assert blob.get("shard/part-1") == b"".join(pieces)


def test_file_streamed_write_that_fails_leaves_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream whose fsync fails is unavailable, stores nothing, and cleans its temp file."""
    blob = open_blob(f"file://{tmp_path}/blob")
    writer = blob.open_writer("shard/part-1")
    writer.write(b"half a part")

    def broken_fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(StoreUnavailable, match="Input/output error"):
        writer.commit()
    monkeypatch.undo()
    assert blob.get("shard/part-1") is None
    assert list((tmp_path / "blob" / "shard").iterdir()) == []
    with pytest.raises(InvalidUsage, match="already committed or aborted"):
        writer.write(b"more")


@pytest.mark.parametrize("fails_at", ["write", "commit"])
def test_file_stream_whose_background_write_fails_raises_and_stores_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fails_at: str
) -> None:
    """A full buffer is written by a background thread; when that write fails (a full
    disk), the error reaches the caller at its next write or at commit, as the store's
    error: nothing is stored under the key and no temp file is left."""
    from pyspark_persist.state.blob import file as file_blob

    monkeypatch.setattr(file_blob, "WRITEBACK_BYTES", MIB)
    blob = open_blob(f"file://{tmp_path}/blob")
    writer = blob.open_writer("shard/part-1")
    real_write = os.write
    failed = threading.Event()

    def full_disk(fd: int, data: Any) -> int:
        if threading.current_thread() is not threading.main_thread():
            failed.set()
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    writer.write(os.urandom(MIB))  # fills the buffer: its write goes to the background
    assert failed.wait(10)
    with pytest.raises(StoreUnavailable, match="No space left on device"):
        if fails_at == "write":
            writer.write(os.urandom(MIB))
        else:
            writer.commit()
    monkeypatch.undo()
    assert blob.get("shard/part-1") is None
    assert list((tmp_path / "blob" / "shard").iterdir()) == []


def test_file_write_buffer_given_back_while_a_view_is_held_raises_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A buffer returned past the pool's limit is closed, unless a view of it is still alive
    (the traceback of a failed write holds one): then it is left to go with that view, and
    returning it raises nothing that would hide the write's own error."""
    import mmap

    from pyspark_persist.state.blob import file as file_blob

    buffers = file_blob._Buffers()
    monkeypatch.setattr(buffers, "KEEP", 0)
    held = mmap.mmap(-1, 4096)
    view = memoryview(held)[:10]
    buffers.give(held)
    assert not held.closed
    view.release()
    free = mmap.mmap(-1, 4096)
    buffers.give(free)
    assert free.closed


def test_file_stream_of_many_buffers_lands_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Full buffers are written in the background one at a time while the next fills, in
    writes of every size: the stored value is the bytes in the order given."""
    from pyspark_persist.state.blob import file as file_blob

    monkeypatch.setattr(file_blob, "WRITEBACK_BYTES", 64 * 1024)
    blob = open_blob(f"file://{tmp_path}/blob")
    rng = random.Random(7)
    pieces = [os.urandom(rng.choice([1, 4095, 4096, 65536, 100_000, 300_000])) for _ in range(40)]
    writer = blob.open_writer("shard/part-1")
    for piece in pieces:
        writer.write(piece)
    writer.commit()
    assert blob.get("shard/part-1") == b"".join(pieces)


def test_file_abandoned_stream_is_deleted_once_untouched_for_the_limit(tmp_path: Path) -> None:
    """The temp file of a writer that died mid-stream goes once untouched for the limit; a
    live writer's, other directories' temp files and every key stay."""
    blob = open_blob(f"file://{tmp_path}/blob")
    blob.set("s/part/kept", b"committed")
    dead = blob.open_writer("s/part/dead")
    dead.write(b"half a part")  # its process "dies": never committed nor aborted
    part_dir = tmp_path / "blob" / "s" / "part"
    (stale,) = [p for p in part_dir.iterdir() if p.name.startswith(".tmp~")]
    os.utime(stale, (time.time() - 120, time.time() - 120))
    live = blob.open_writer("s/part/live")
    live.write(b"being written")
    blob.set("other/part/x", b"1")
    other = tmp_path / "blob" / "other" / "part" / ".tmp~old"
    other.write_bytes(b"another shard's")
    os.utime(other, (time.time() - 120, time.time() - 120))

    assert blob.delete_abandoned("s/part/", older_than_ms=60_000) == 1
    assert not stale.exists() and other.exists()
    assert blob.delete_abandoned("s/part/", older_than_ms=60_000) == 0
    assert blob.delete_abandoned("missing/part/", older_than_ms=0) == 0
    live.commit()
    assert listed(blob) == {"s/part/kept": 9, "s/part/live": 13, "other/part/x": 1}


def test_file_key_that_is_also_a_directory_is_invalid_usage(tmp_path: Path) -> None:
    blob = open_blob(f"file://{tmp_path}/blob")
    blob.set("a/b", b"1")
    with pytest.raises(InvalidUsage, match="collides"):
        blob.set("a", b"2")
    with pytest.raises(InvalidUsage, match="collides"):
        blob.set("a/b/c", b"3")
    assert blob.get("a") is None
    assert blob.get("a/b/c") is None
    assert listed(blob) == {"a/b": 1}


def test_file_uri_naming_a_regular_file_is_invalid(tmp_path: Path) -> None:
    path = tmp_path / "afile"
    path.write_bytes(b"")
    with pytest.raises(InvalidUri) as info:
        open_blob(f"file://{path}")
    assert f"file://{path}" in str(info.value)
    assert "file:///absolute/path" in str(info.value)


def test_file_root_that_cannot_be_created_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "afile").write_bytes(b"")
    root = tmp_path / "afile" / "blob"
    with pytest.raises(StoreUnavailable) as info:
        open_blob(f"file://{root}")
    assert str(root) in str(info.value)


# --- URI and store errors ------------------------------------------------------------------


@pytest.mark.parametrize(
    "uri",
    [
        "nope",
        "ftp://x",
        "file://relative",
        "file://relative/path",
        "file://",
        "s3://",
        "s3:///prefix",
        "s3://bucket:9000/p",
        "s3://bucket/a//b",
        "s3://bucket/p?bogus=1",
        "s3://bucket/p?connect_timeout=soon",
        "s3://bucket/p?max_attempts=0",
        "s3://bucket/p?endpoint_url=ftp://host",
        "mem://bad name",
        "mem://a/b",
    ],
)
def test_malformed_uri_is_invalid(uri: str) -> None:
    with pytest.raises(InvalidUri):
        open_blob(uri)


def test_relative_file_uri_message_says_how_to_fix() -> None:
    with pytest.raises(InvalidUri) as info:
        open_blob("file://relative/path")
    assert "file://relative/path" in str(info.value)
    assert "file:///absolute/path" in str(info.value)


SECRET_ID = "AKIASENTINEL0KEYID123"
SECRET_KEY = "sentinel/Secret+Access+Key/do-not-log"


@pytest.fixture
def sentinel_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Credentials that must never show up in an error (moto accepts any)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", SECRET_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)


def assert_no_secrets(error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    assert SECRET_ID not in text
    assert SECRET_KEY not in text


@pytest.mark.parametrize(
    "uri",
    [
        f"s3://{SECRET_ID}:{SECRET_KEY}@bucket/p",
        f"s3://bucket/p?aws_secret_access_key={SECRET_KEY}",
        f"s3://bucket/p?endpoint_url=http://{SECRET_ID}:{SECRET_KEY}@127.0.0.1:1",
    ],
    ids=["userinfo", "query", "endpoint-userinfo"],
)
def test_secrets_in_s3_uri_are_rejected_without_echo(uri: str) -> None:
    with pytest.raises(InvalidUri) as info:
        open_blob(uri)
    assert_no_secrets(info.value)


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.usefixtures("sentinel_credentials")
def test_s3_endpoint_nobody_listens_on_is_unavailable_at_the_deadline() -> None:
    """A refused connection is retried until the deadline, then named with the time waited."""
    endpoint = f"http://127.0.0.1:{free_loopback_port()}"
    start = time.monotonic()
    with retry.deadline_in(1.0), pytest.raises(StoreUnavailable) as info:
        open_blob(
            f"s3://bucket/p?endpoint_url={endpoint}&region=us-east-1"
            "&connect_timeout=1&max_attempts=1"
        )
    assert 0.8 < time.monotonic() - start < 5
    assert endpoint in str(info.value)
    assert "gave up for 1." in str(info.value)
    assert_no_secrets(info.value)


@pytest.mark.usefixtures("sentinel_credentials")
def test_s3_missing_bucket_is_unavailable_and_names_the_fix(moto_server: str) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:12]}"
    with pytest.raises(StoreUnavailable) as info:
        open_blob(f"s3://{bucket}/p?endpoint_url={moto_server}&region=us-east-1")
    assert bucket in str(info.value)
    assert "create it" in str(info.value)
    assert_no_secrets(info.value)


def test_s3_uri_is_canonical_and_reopenable(moto_server: str) -> None:
    blob = open_blob(
        f"s3://{MOTO_BUCKET}/a/b/?region=us-east-1&endpoint_url={moto_server}&max_attempts=2"
    )
    assert blob.uri == (
        f"s3://{MOTO_BUCKET}/a/b?endpoint_url={moto_server.replace(':', '%3A').replace('/', '%2F')}"
        "&region=us-east-1&max_attempts=2"
    )
    assert open_blob(blob.uri).uri == blob.uri


class _SilentAfterHead(BaseHTTPRequestHandler):
    """Answers ``head_bucket``, then swallows every other request without replying."""

    server: _HangingServer

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_PUT(self) -> None:
        self.server.release.wait(30)

    do_GET = do_PUT

    def log_message(self, format: str, *args: object) -> None:
        """Keep the test output clean."""


class _HangingServer(ThreadingHTTPServer):
    daemon_threads = True
    release: threading.Event  # set at teardown so the stuck handlers can finish


@pytest.fixture
def hanging_endpoint() -> Iterator[str]:
    """An S3 look-alike whose replies to reads and writes are lost."""
    server = _HangingServer(("127.0.0.1", 0), _SilentAfterHead)
    server.release = threading.Event()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.usefixtures("sentinel_credentials")
def test_s3_lost_reply_to_set_is_indeterminate_and_to_get_unavailable(
    hanging_endpoint: str,
) -> None:
    blob = open_blob(
        f"s3://bucket/p?endpoint_url={hanging_endpoint}&region=us-east-1"
        "&read_timeout=0.3&max_attempts=1"
    )
    try:
        with retry.deadline_in(0.5), pytest.raises(Indeterminate) as lost:
            blob.set("k", b"v")
        assert_no_secrets(lost.value)
        with retry.deadline_in(0.5), pytest.raises(StoreUnavailable) as failed:
            blob.get("k")
        assert_no_secrets(failed.value)
        with retry.deadline_in(0.5), pytest.raises(StoreUnavailable):
            list(blob.list_keys())
    finally:
        blob.close()
