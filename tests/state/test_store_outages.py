"""Stores taken away for real, through a loopback proxy, and given back: nothing fails.

Every Consensus operation (connect, read, scan, compare-and-set, truncate) and
every S3 Blob operation retries transient failures until the deadline, logs a
warning once it has waited a few seconds and logs when the store is back.
Faults are injected by :class:`FaultProxy` (stop = refused and reset
connections, pause = a hang) between the client and the shared PostgreSQL or
the session's moto server; a test waits until the operation is seen retrying
(``retry.in_flight()``) before giving the store back, so nothing depends on timing luck.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pytest
from fault_proxy import FaultProxy

from pyspark_persist.state import Committed, PersistClient, PersistConfig, retry
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import (
    CaSCommitted,
    Consensus,
    VersionedData,
    open_consensus,
)
from pyspark_persist.state.errors import StoreUnavailable

pytestmark = pytest.mark.postgres

SCHEMA = pa.schema([("id", pa.int64())])


@pytest.fixture
def pg_proxy(postgres_url: str) -> Iterator[FaultProxy]:
    """A proxy in front of the shared PostgreSQL, owned by one test."""
    proxy = FaultProxy("127.0.0.1", 5432).start()
    yield proxy
    proxy.close()


@pytest.fixture
def quick_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    """Warn after 0.2 s of waiting instead of 5 s."""
    monkeypatch.setattr(retry, "DEFAULT_POLICY", retry.RetryPolicy(warn_after_s=0.2))


def proxied_consensus(proxy: FaultProxy) -> str:
    """A Consensus URI through ``proxy``, in a table of its own (created on first write)."""
    table = f"outage_{uuid.uuid4().hex[:12]}"
    return f"postgresql://postgres@127.0.0.1:{proxy.port}/test?table={table}"


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def retrying(store_part: str, attempts: int = 3) -> Callable[[], bool]:
    """True once an operation on a store whose name holds ``store_part`` made ``attempts``."""
    return lambda: any(
        store_part in store and n >= attempts for store, _what, n in retry.in_flight()
    )


def during_outage(proxy: FaultProxy, store_part: str, op: Callable[[], Any]) -> Any:
    """Run ``op`` with the store gone; give it back once ``op`` is seen retrying."""
    proxy.stop()
    with ThreadPoolExecutor(1) as pool:
        fut: Future[Any] = pool.submit(op)
        try:
            wait_until(retrying(store_part), "the operation to retry")
            assert not fut.done()
        finally:
            proxy.start()
        return fut.result(timeout=60)


CONSENSUS_OPS: dict[str, tuple[Callable[[Consensus, str], Any], Any]] = {
    "head": (lambda c, k: c.head(k), VersionedData(1, b"a")),
    "scan": (lambda c, k: c.scan(k, 0), [VersionedData(1, b"a")]),
    "compare_and_set": (
        lambda c, k: c.compare_and_set(k, 1, VersionedData(2, b"b")),
        CaSCommitted(),
    ),
    "truncate": (lambda c, k: c.truncate(k, 1), 0),
}


@pytest.mark.parametrize("op", sorted(CONSENSUS_OPS))
def test_every_consensus_operation_rides_out_an_outage(pg_proxy: FaultProxy, op: str) -> None:
    """Refused and reset connections are retried until PostgreSQL is back; a compare-and-set
    that never reached it lands exactly once."""
    store = open_consensus(proxied_consensus(pg_proxy))
    try:
        key = uuid.uuid4().hex
        assert store.compare_and_set(key, None, VersionedData(1, b"a")) == CaSCommitted()
        fn, expected = CONSENSUS_OPS[op]
        assert during_outage(pg_proxy, f":{pg_proxy.port}/", lambda: fn(store, key)) == expected
        head = VersionedData(2, b"b") if op == "compare_and_set" else VersionedData(1, b"a")
        assert store.head(key) == head
    finally:
        store.close()


def test_connecting_rides_out_an_outage(pg_proxy: FaultProxy) -> None:
    """A store opened while PostgreSQL is away connects once it is back."""
    store = open_consensus(proxied_consensus(pg_proxy))
    try:
        assert during_outage(pg_proxy, f":{pg_proxy.port}/", store.list_keys) == []
    finally:
        store.close()


def test_pooled_connections_broken_by_a_restart_are_discarded(pg_proxy: FaultProxy) -> None:
    """Every pooled connection reset between two calls: the next calls get fresh ones, and a
    compare-and-set on a dead pooled connection is never reported as an unknown outcome."""
    store = open_consensus(proxied_consensus(pg_proxy))
    try:
        key = uuid.uuid4().hex
        assert store.compare_and_set(key, None, VersionedData(1, b"a")) == CaSCommitted()
        for seqno in range(2, 6):
            pg_proxy.stop()
            pg_proxy.start()
            assert store.compare_and_set(key, seqno - 1, VersionedData(seqno, b"x")) == (
                CaSCommitted()
            )
        assert [r.seqno for r in store.scan(key, 0)] == [1, 2, 3, 4, 5]
    finally:
        store.close()


def test_outage_past_the_deadline_names_the_store_and_the_wait(pg_proxy: FaultProxy) -> None:
    """Past retry_timeout_s a command fails with StoreUnavailable naming the store and how
    long it retried, and nothing was written."""
    uri = proxied_consensus(pg_proxy)
    with PersistClient.open("mem://outage", uri, config=PersistConfig(retry_timeout_s=1.0)) as c:
        writer = c.open_shard("s", SCHEMA).writer()
        pg_proxy.stop()
        started = time.monotonic()
        try:
            with pytest.raises(StoreUnavailable) as info:
                writer.append(pa.table({"id": [1]}))
        finally:
            pg_proxy.start()
        assert 0.9 < time.monotonic() - started < 10
        message = str(info.value)
        assert f"127.0.0.1:{pg_proxy.port}/test" in message
        assert "gave up for" in message
        state = c.open_shard("s").state()
        assert (state.upper, len(state.batches)) == (0, 0)


def test_writer_and_reader_ride_out_an_outage_exactly_once(pg_proxy: FaultProxy) -> None:
    """A write issued while Consensus is away commits once it is back, exactly once."""
    uri = proxied_consensus(pg_proxy)
    with PersistClient.open("mem://outage-rw", uri) as c:
        shard = c.open_shard("s", SCHEMA)
        writer = shard.writer()
        writer.append(pa.table({"id": [0]}))
        result = during_outage(
            pg_proxy, f":{pg_proxy.port}/", lambda: writer.append(pa.table({"id": [1]}))
        )
        assert isinstance(result, Committed)
        reader = shard.reader()
        assert sorted(reader.snapshot_table().column("id").to_pylist()) == [0, 1]


def test_long_waits_are_logged_and_so_is_the_recovery(
    pg_proxy: FaultProxy, quick_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A warning names the store, the operation and the time waited; recovery is logged."""
    caplog.set_level(logging.WARNING, logger="pyspark_persist.state.retry")
    store = open_consensus(proxied_consensus(pg_proxy))
    try:
        pg_proxy.stop()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(store.list_keys)
            try:
                wait_until(lambda: "has been failing" in caplog.text, "the warning")
            finally:
                pg_proxy.start()
            assert fut.result(timeout=60) == []
        wait_until(lambda: "recovered" in caplog.text, "the recovery line")
        warning, recovery = (r.getMessage() for r in caplog.records[:2])
        assert f"127.0.0.1:{pg_proxy.port}/test" in warning and "listing keys" in warning
        assert "has been failing for 0." in warning
        assert "recovered: listing keys succeeded after" in recovery
    finally:
        store.close()


# --- S3 ---------------------------------------------------------------------------------------


@pytest.fixture
def s3_proxy(moto_server: str) -> Iterator[FaultProxy]:
    """A proxy in front of the session's moto server."""
    host, _, port = moto_server.removeprefix("http://").rpartition(":")
    proxy = FaultProxy(host, int(port)).start()
    yield proxy
    proxy.close()


def proxied_blob_uri(proxy: FaultProxy) -> str:
    return (
        f"s3://persist-test/{uuid.uuid4().hex}?endpoint_url=http://127.0.0.1:{proxy.port}"
        "&region=us-east-1&connect_timeout=1&read_timeout=1&max_attempts=1"
    )


@pytest.mark.parametrize("op", ["set", "get", "delete", "list_keys"])
def test_every_s3_operation_rides_out_an_outage(s3_proxy: FaultProxy, op: str) -> None:
    blob = open_blob(proxied_blob_uri(s3_proxy))
    try:
        blob.set("k", b"v")
        fns: dict[str, Callable[[], Any]] = {
            "set": lambda: blob.set("k2", b"w"),
            "get": lambda: blob.get("k"),
            "delete": lambda: blob.delete("k"),
            "list_keys": lambda: sorted(m.key for m in blob.list_keys()),
        }
        expected = {"set": None, "get": b"v", "delete": 1, "list_keys": ["k"]}[op]
        assert during_outage(s3_proxy, f"127.0.0.1:{s3_proxy.port}", fns[op]) == expected
    finally:
        blob.close()


def test_a_hung_s3_is_logged_while_it_hangs_and_when_it_recovers(
    s3_proxy: FaultProxy, quick_warnings: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A stalled request (no reply at all) is reported while it waits, not only after."""
    caplog.set_level(logging.WARNING, logger="pyspark_persist.state.retry")
    blob = open_blob(proxied_blob_uri(s3_proxy))
    try:
        blob.set("k", b"v")
        s3_proxy.pause()
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(blob.get, "k")
            try:
                wait_until(lambda: "get 'k' has been" in caplog.text, "the warning")
            finally:
                s3_proxy.resume()
            assert fut.result(timeout=60) == b"v"
        wait_until(lambda: "recovered: get 'k' succeeded" in caplog.text, "the recovery line")
        assert f"127.0.0.1:{s3_proxy.port}" in caplog.text
    finally:
        blob.close()
