"""The Consensus contract, run against every backend (mem, sqlite, postgres).

The concurrency tests are the point: a counter incremented by many threads
(and, for the durable backends, many processes) through head/compare_and_set
retry loops must end with every SeqNo present exactly once and every
increment counted, i.e. no lost update and no duplicate commit.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import sqlite3
import time
import uuid
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest
from sqlalchemy import text

from pyspark_persist.state import retry
from pyspark_persist.state.consensus import (
    CaSCommitted,
    CaSMismatch,
    Consensus,
    VersionedData,
    open_consensus,
    sql,
)
from pyspark_persist.state.errors import (
    Indeterminate,
    InvalidUri,
    InvalidUsage,
    StoreUnavailable,
)

SQL_BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
"""Params for ``consensus_uri`` (indirect) in tests that need a store other processes see."""


def new_key() -> str:
    """A key no other test (or earlier run on the shared PostgreSQL table) has used."""
    return f"shard-{uuid.uuid4()}"


def append(store: Consensus, key: str, *payloads: bytes) -> None:
    """Append ``payloads`` as the next rows of ``key``, asserting each commits."""
    for payload in payloads:
        head = store.head(key)
        expected = None if head is None else head.seqno
        new = VersionedData((expected or 0) + 1, payload)
        assert store.compare_and_set(key, expected, new) == CaSCommitted()


def seqnos(store: Consensus, key: str) -> list[int]:
    return [row.seqno for row in store.scan(key, 0)]


def increment(store: Consensus, key: str, times: int) -> None:
    """Add one to the counter under ``key`` ``times`` times, retrying every lost race."""
    done = 0
    while done < times:
        head = store.head(key)
        assert head is not None
        bumped = VersionedData(head.seqno + 1, str(int(head.data) + 1).encode())
        if store.compare_and_set(key, head.seqno, bumped) == CaSCommitted():
            done += 1


def increment_in_child(uri: str, key: str, times: int) -> None:
    """Process entry point: open the backend from its URI, as a Spark executor would."""
    store = open_consensus(uri)
    try:
        increment(store, key, times)
    finally:
        store.close()


def assert_counter(store: Consensus, key: str, total: int) -> None:
    """Row SeqNo n holds n - 1: every increment landed exactly once, in order."""
    rows = store.scan(key, 0)
    assert [row.seqno for row in rows] == list(range(1, total + 2))
    assert [int(row.data) for row in rows] == list(range(total + 1))


def test_head_of_new_key_is_none(consensus: Consensus) -> None:
    assert consensus.head(new_key()) is None


def test_cas_appends_consecutive_seqnos(consensus: Consensus) -> None:
    key = new_key()
    assert consensus.compare_and_set(key, None, VersionedData(1, b"one")) == CaSCommitted()
    assert consensus.compare_and_set(key, 1, VersionedData(2, b"two")) == CaSCommitted()
    assert consensus.compare_and_set(key, 2, VersionedData(3, b"three")) == CaSCommitted()
    assert consensus.head(key) == VersionedData(3, b"three")
    assert consensus.scan(key, 1) == [
        VersionedData(1, b"one"),
        VersionedData(2, b"two"),
        VersionedData(3, b"three"),
    ]


def test_cas_mismatch_reports_current_head(consensus: Consensus) -> None:
    key = new_key()
    append(consensus, key, b"a", b"b")
    assert consensus.compare_and_set(key, 1, VersionedData(2, b"x")) == CaSMismatch(2)
    assert consensus.compare_and_set(key, None, VersionedData(1, b"x")) == CaSMismatch(2)
    assert consensus.compare_and_set(key, 7, VersionedData(8, b"x")) == CaSMismatch(2)
    assert consensus.compare_and_set(new_key(), 3, VersionedData(4, b"x")) == CaSMismatch(None)
    assert consensus.scan(key, 0) == [VersionedData(1, b"a"), VersionedData(2, b"b")]


@pytest.mark.parametrize(
    ("expected", "new_seqno"),
    [(None, 2), (None, 0), (1, 1), (1, 3), (0, 1), (-1, 0)],
)
def test_wrong_new_seqno_is_invalid_usage_and_writes_nothing(
    consensus: Consensus, expected: int | None, new_seqno: int
) -> None:
    key, fresh = new_key(), new_key()
    append(consensus, key, b"a")
    with pytest.raises(InvalidUsage):
        consensus.compare_and_set(key, expected, VersionedData(new_seqno, b"bad"))
    with pytest.raises(InvalidUsage):
        consensus.compare_and_set(fresh, expected, VersionedData(new_seqno, b"bad"))
    assert consensus.scan(key, 0) == [VersionedData(1, b"a")]
    assert consensus.head(fresh) is None


def test_scan_from_and_limit(consensus: Consensus) -> None:
    key = new_key()
    append(consensus, key, b"1", b"2", b"3", b"4", b"5")
    assert seqnos(consensus, key) == [1, 2, 3, 4, 5]
    assert [r.seqno for r in consensus.scan(key, 3)] == [3, 4, 5]
    assert [r.seqno for r in consensus.scan(key, 3, limit=1)] == [3]
    assert [r.seqno for r in consensus.scan(key, 0, limit=2)] == [1, 2]
    assert [r.seqno for r in consensus.scan(key, 4, limit=10)] == [4, 5]
    assert consensus.scan(key, 1, limit=0) == []
    assert consensus.scan(key, 6) == []
    assert consensus.scan(new_key(), 0) == []
    with pytest.raises(InvalidUsage):
        consensus.scan(key, 0, limit=-1)


def test_truncate_deletes_below_and_never_the_head(consensus: Consensus) -> None:
    key = new_key()
    append(consensus, key, b"1", b"2", b"3", b"4", b"5")
    assert consensus.truncate(key, 3) == 2
    assert seqnos(consensus, key) == [3, 4, 5]
    assert consensus.truncate(key, 3) == 0
    assert consensus.truncate(key, 1) == 0
    with pytest.raises(InvalidUsage):
        consensus.truncate(key, 6)
    assert consensus.truncate(key, 5) == 2
    assert consensus.scan(key, 0) == [VersionedData(5, b"5")]
    with pytest.raises(InvalidUsage):
        consensus.truncate(new_key(), 1)
    assert consensus.compare_and_set(key, 5, VersionedData(6, b"6")) == CaSCommitted()
    assert seqnos(consensus, key) == [5, 6]


def test_list_keys(consensus: Consensus) -> None:
    a, b, unused = new_key(), new_key(), new_key()
    append(consensus, a, b"x")
    append(consensus, b, b"y", b"z")
    consensus.truncate(b, 2)
    consensus.compare_and_set(unused, 4, VersionedData(5, b"lost"))
    keys = consensus.list_keys()
    assert {a, b} <= set(keys)
    assert unused not in keys
    assert keys == sorted(keys)
    assert len(keys) == len(set(keys))


def test_keys_are_independent(consensus: Consensus) -> None:
    a, b = new_key(), new_key()
    append(consensus, a, b"a1", b"a2", b"a3")
    append(consensus, b, b"b1")
    assert consensus.compare_and_set(b, 1, VersionedData(2, b"b2")) == CaSCommitted()
    assert consensus.compare_and_set(a, 1, VersionedData(2, b"no")) == CaSMismatch(3)
    consensus.truncate(a, 3)
    assert consensus.scan(b, 0) == [VersionedData(1, b"b1"), VersionedData(2, b"b2")]
    assert consensus.head(a) == VersionedData(3, b"a3")


@pytest.mark.parametrize(
    "payload",
    [b"", b"\x00", bytes(range(256)), b"\xff" * 3 + b"\x00" * 3, os.urandom(1 << 20)],
    ids=["empty", "nul", "all-bytes", "high-and-nul", "1MiB"],
)
def test_data_roundtrips_exactly(consensus: Consensus, payload: bytes) -> None:
    key = new_key()
    append(consensus, key, payload)
    head = consensus.head(key)
    assert head is not None and type(head.data) is bytes and head.data == payload
    assert consensus.scan(key, 1) == [VersionedData(1, payload)]


def test_uri_reopens_the_same_store(consensus: Consensus) -> None:
    key = new_key()
    append(consensus, key, b"shared")
    again = open_consensus(consensus.uri)
    try:
        assert again.head(key) == VersionedData(1, b"shared")
        assert again.compare_and_set(key, 1, VersionedData(2, b"two")) == CaSCommitted()
        assert consensus.head(key) == VersionedData(2, b"two")
    finally:
        again.close()


def test_threads_never_lose_an_update(consensus: Consensus) -> None:
    threads, times = 8, 50
    key = new_key()
    append(consensus, key, b"0")
    with ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(increment, consensus, key, times) for _ in range(threads)]:
            future.result()
    assert_counter(consensus, key, threads * times)


@pytest.mark.parametrize("consensus_uri", SQL_BACKENDS, indirect=True)
def test_processes_never_lose_an_update(consensus_uri: str, consensus: Consensus) -> None:
    processes, times = 4, 50
    key = new_key()
    append(consensus, key, b"0")
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(processes, mp_context=spawn) as pool:
        futures = [
            pool.submit(increment_in_child, consensus_uri, key, times) for _ in range(processes)
        ]
        for future in futures:
            future.result()
    assert_counter(consensus, key, processes * times)


@pytest.mark.parametrize("consensus_uri", SQL_BACKENDS, indirect=True)
def test_forked_child_uses_its_own_connections(consensus: Consensus) -> None:
    key = new_key()
    append(consensus, key, b"parent")  # leaves a pooled connection for the child to inherit
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            result = consensus.compare_and_set(key, 1, VersionedData(2, b"child"))
            code = 0 if result == CaSCommitted() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert consensus.head(key) == VersionedData(2, b"child")
    assert consensus.compare_and_set(key, 2, VersionedData(3, b"parent")) == CaSCommitted()


def test_mem_names_share_and_empty_name_is_private() -> None:
    name = f"mem://{uuid.uuid4()}"
    key = new_key()
    append(open_consensus(name), key, b"x")
    assert open_consensus(name).head(key) == VersionedData(1, b"x")
    private = open_consensus("mem://")
    append(private, key, b"y")
    assert open_consensus("mem://").head(key) is None


def test_sqlite_table_override(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/c.db"
    key = new_key()
    alt = open_consensus(uri + "?table=alt_consensus")
    default = open_consensus(uri)
    try:
        append(alt, key, b"alt")
        assert default.head(key) is None
        assert alt.uri.endswith("?table=alt_consensus")
        assert open_consensus(alt.uri).head(key) == VersionedData(1, b"alt")
    finally:
        alt.close()
        default.close()


def test_sqlite_relative_path_becomes_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    store = open_consensus("sqlite:///nested/dir/c.db")
    try:
        assert store.uri == f"sqlite:///{tmp_path}/nested/dir/c.db"
        assert (tmp_path / "nested" / "dir" / "c.db").is_file()
    finally:
        store.close()


@pytest.mark.parametrize("table", ["x;drop", "1abc", "a b", "a" * 64])
def test_bad_table_name_is_invalid_uri(tmp_path: Path, table: str) -> None:
    with pytest.raises(InvalidUri):
        open_consensus(f"sqlite:///{tmp_path}/c.db?table={table}")


@pytest.mark.parametrize(
    "uri",
    [
        "mysql://x",
        "no-scheme",
        "sqlite:///",
        "sqlite:///:memory:",
        "postgresql+psycopg2://u@h/d",
        "postgresql://u:s3cret@h:notaport/d",
    ],
)
def test_bad_uri_is_invalid_uri(uri: str) -> None:
    with pytest.raises(InvalidUri) as info:
        open_consensus(uri)
    assert "s3cret" not in str(info.value)


def test_sqlite_unopenable_path_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")
    for uri in (f"sqlite:///{tmp_path}", f"sqlite:///{tmp_path}/file/sub/c.db"):
        with pytest.raises(StoreUnavailable):
            open_consensus(uri)


def test_unreachable_postgres_retries_to_the_deadline_without_leaking_the_password() -> None:
    """Opening touches nothing; the first read retries the refused connection until the
    deadline, then fails naming the store and how long it tried, never the password."""
    # Nothing listens on port 1: an open that connected would raise here.
    store = open_consensus("postgresql://u:s3cret@127.0.0.1:1/x")
    started = time.monotonic()
    with retry.deadline_in(1.0), pytest.raises(StoreUnavailable) as info:
        store.head("k")
    assert 0.8 < time.monotonic() - started < 30  # tried until the deadline, then gave up
    message = str(info.value)
    assert "postgresql://u@127.0.0.1:1/x" in message
    assert "PostgreSQL running" in message
    assert re.search(r"gave up for \d+\.\d s \(\d+ attempts\)", message), message
    chain: list[BaseException] = []
    error: BaseException | None = info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert all("s3cret" not in f"{e} {e.args!r}" for e in chain)


@pytest.mark.postgres
def test_postgres_uri_drops_the_password(postgres_url: str) -> None:
    # The test server uses trust auth, so any password is accepted and ignored.
    store = open_consensus(postgres_url.replace("postgres@", "postgres:s3cret@"))
    try:
        assert store.uri == postgres_url
    finally:
        store.close()


@pytest.mark.postgres
@pytest.mark.parametrize("consensus_uri", ["postgres"], indirect=True)
def test_connection_lost_during_cas_is_indeterminate(
    consensus: Consensus, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = new_key()
    append(consensus, key, b"a")
    # Fault injection: the "CaS" statement kills its own backend, so the
    # connection dies after the statement was sent, as in a real crash.
    suicide = text("SELECT pg_terminate_backend(pg_backend_pid())")
    monkeypatch.setattr(consensus._stmts, "cas", suicide)  # type: ignore[attr-defined]
    with pytest.raises(Indeterminate):
        consensus.compare_and_set(key, 1, VersionedData(2, b"b"))
    monkeypatch.undo()
    # pool_pre_ping replaced the dead connection: the store keeps working.
    assert consensus.compare_and_set(key, 1, VersionedData(2, b"b")) == CaSCommitted()


def _cas_backend(store: Consensus) -> int:
    """The server process of the connection the store keeps for its next CaS."""
    ((fairy, _),) = store._pg_idle  # type: ignore[attr-defined]
    return int(fairy.driver_connection.info.backend_pid)


@pytest.mark.postgres
@pytest.mark.parametrize("consensus_uri", ["postgres"], indirect=True)
def test_back_to_back_cas_reuse_their_connection_without_the_pool_ping(
    consensus: Consensus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CaS right after another runs on its connection, not one the pool pings first (one
    round trip instead of two); one whose connection sat idle past _PG_REUSE_S goes through
    the pool again."""
    key = new_key()
    append(consensus, key, b"a")
    backend = _cas_backend(consensus)
    checkouts = []
    real = consensus._checkout  # type: ignore[attr-defined]
    monkeypatch.setattr(consensus, "_checkout", lambda: checkouts.append(1) or real())
    append(consensus, key, b"b", b"c")
    assert checkouts == [] and _cas_backend(consensus) == backend
    monkeypatch.setattr(sql, "_PG_REUSE_S", 0.0)
    append(consensus, key, b"d")
    assert checkouts == [1]
    assert seqnos(consensus, key) == [1, 2, 3, 4]


@pytest.mark.postgres
@pytest.mark.parametrize("consensus_uri", ["postgres"], indirect=True)
def test_cas_connection_terminated_while_idle_is_replaced_before_sending(
    consensus: Consensus, postgres_url: str
) -> None:
    """A kept CaS connection whose backend the server ended while it sat idle (a restart, an
    administrator's pg_terminate_backend) is found broken before the next CaS is sent: that
    CaS commits on a new connection, once, instead of failing as Indeterminate."""
    key = new_key()
    append(consensus, key, b"a")
    backend = _cas_backend(consensus)
    ((kept, _),) = consensus._pg_idle  # type: ignore[attr-defined]
    assert sql._untouched(kept)
    admin = open_consensus(postgres_url)
    try:
        with admin._engine.connect() as conn:  # type: ignore[attr-defined]
            assert conn.execute(text(f"SELECT pg_terminate_backend({backend})")).scalar()
    finally:
        admin.close()
    deadline = time.monotonic() + 5
    while sql._untouched(kept) and time.monotonic() < deadline:
        time.sleep(0.01)  # the server's goodbye reaches the socket
    assert not sql._untouched(kept)
    assert consensus.compare_and_set(key, 1, VersionedData(2, b"b")) == CaSCommitted()
    assert _cas_backend(consensus) != backend
    assert [row.data for row in consensus.scan(key, 0)] == [b"a", b"b"]


def test_sqlite_lock_held_elsewhere_is_determinate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sql, "_BUSY_TIMEOUT_MS", 20)  # read when a connection opens
    path = tmp_path / "c.db"
    store = open_consensus(f"sqlite:///{path}")
    key = new_key()
    append(store, key, b"a")
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        with retry.deadline_in(0.3), pytest.raises(StoreUnavailable, match="locked"):
            store.compare_and_set(key, 1, VersionedData(2, b"b"))
        holder.execute("ROLLBACK")
        assert store.head(key) == VersionedData(1, b"a")
        assert store.compare_and_set(key, 1, VersionedData(2, b"b")) == CaSCommitted()
    finally:
        holder.close()
        store.close()


def test_sqlite_store_holds_no_lock_between_compare_and_sets(tmp_path: Path) -> None:
    """The connection SQLite compare-and-sets keep checked out ends every transaction: after a
    commit and after lost ones (a stale SeqNo, a key that exists), another process may write
    at once."""
    path = tmp_path / "c.db"
    store = open_consensus(f"sqlite:///{path}")
    other = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        key = new_key()
        outcomes = [
            store.compare_and_set(key, None, VersionedData(1, b"a")),
            store.compare_and_set(key, 5, VersionedData(6, b"b")),
            store.compare_and_set(key, None, VersionedData(1, b"c")),
            store.compare_and_set(key, 1, VersionedData(2, b"d")),
        ]
        assert [type(o) for o in outcomes] == [CaSCommitted, CaSMismatch, CaSMismatch, CaSCommitted]
        for _ in outcomes:
            other.execute("BEGIN IMMEDIATE")  # would raise "database is locked" at once
            other.execute("ROLLBACK")
        assert store.head(key) == VersionedData(2, b"d")
    finally:
        other.close()
        store.close()
