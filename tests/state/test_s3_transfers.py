"""S3 transfers against moto's server: multipart upload of large parts, batched deletes.

Large values (above ``MULTIPART_THRESHOLD``) go up in pieces; what a user can
check from outside is the object's multipart ETag (``md5-N``), that it reads
back whole, and that a failed upload leaves neither an object nor an open
upload behind. Faults are injected by wrapping the Blob's own boto3 client
methods, deterministically (the N-th call fails), never by timing.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from typing import Any

import boto3
import pytest
from blob_fixtures import MOTO_BUCKET
from botocore.exceptions import ClientError

from pyspark_persist.state.blob import open_blob, s3
from pyspark_persist.state.blob.s3 import MULTIPART_PART_BYTES, MULTIPART_THRESHOLD, S3Blob
from pyspark_persist.state.errors import StoreUnavailable

LARGE = 2 * MULTIPART_PART_BYTES + 12345  # three pieces: two full, one short


@pytest.fixture
def s3_blob(moto_server: str) -> Iterator[S3Blob]:
    prefix = uuid.uuid4().hex
    blob = open_blob(f"s3://{MOTO_BUCKET}/{prefix}?endpoint_url={moto_server}&region=us-east-1")
    assert isinstance(blob, S3Blob)
    try:
        yield blob
    finally:
        blob.close()


def raw_client(moto_server: str) -> Any:
    return boto3.session.Session().client("s3", endpoint_url=moto_server, region_name="us-east-1")


def open_uploads(moto_server: str, prefix: str) -> list[str]:
    listed = raw_client(moto_server).list_multipart_uploads(Bucket=MOTO_BUCKET, Prefix=prefix)
    return [u["Key"] for u in listed.get("Uploads", [])]


def payload(size: int) -> bytes:
    block = uuid.uuid4().bytes * 64  # 1 KiB that differs between calls
    return (block * (size // len(block) + 1))[:size]


def client_error(code: str, status: int, op: str) -> ClientError:
    return ClientError(
        {
            "Error": {"Code": code, "Message": "injected"},
            "ResponseMetadata": {"HTTPStatusCode": status},
        },
        op,
    )  # type: ignore[arg-type]


def wrap(
    blob: S3Blob, method: str, hook: Callable[[int, Callable[..., Any], dict[str, Any]], Any]
) -> list[str]:
    """Replace the blob client's ``method`` by ``hook(call_number, real, kwargs)``; record calls."""
    client = blob._client()
    real = getattr(client, method)
    calls: list[str] = []

    def wrapped(**kwargs: Any) -> Any:
        calls.append(method)
        return hook(len(calls), real, kwargs)

    setattr(client, method, wrapped)
    return calls


def test_large_value_is_uploaded_in_pieces_and_reads_back_whole(
    s3_blob: S3Blob, moto_server: str
) -> None:
    assert MULTIPART_THRESHOLD == 16 * 1024 * 1024
    value = payload(LARGE)
    s3_blob.set("shard/part/big", value)
    assert s3_blob.get("shard/part/big") == value
    name = s3_blob._key_prefix + "shard/part/big"
    head = raw_client(moto_server).head_object(Bucket=MOTO_BUCKET, Key=name)
    assert head["ContentLength"] == LARGE
    assert head["ETag"].strip('"').endswith("-3")  # S3's mark of a 3-piece multipart upload
    small = payload(1000)
    s3_blob.set("shard/part/small", memoryview(small))
    small_head = raw_client(moto_server).head_object(
        Bucket=MOTO_BUCKET, Key=s3_blob._key_prefix + "shard/part/small"
    )
    assert "-" not in small_head["ETag"]  # one put_object
    assert open_uploads(moto_server, s3_blob._key_prefix) == []


def test_failed_piece_aborts_the_upload_and_writes_nothing(
    s3_blob: S3Blob, moto_server: str
) -> None:
    def fail_second(n: int, real: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        if n == 2:
            raise client_error("AccessDenied", 403, "UploadPart")
        return real(**kwargs)

    calls = wrap(s3_blob, "upload_part", fail_second)
    with pytest.raises(StoreUnavailable, match="upload_part"):
        s3_blob.set("shard/part/big", payload(LARGE))
    assert calls == ["upload_part", "upload_part"]  # a permanent failure is not retried
    assert s3_blob.get("shard/part/big") is None
    assert open_uploads(moto_server, s3_blob._key_prefix) == []


def test_transient_piece_failure_is_retried(s3_blob: S3Blob) -> None:
    def flaky_first(n: int, real: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        if n == 1:
            raise client_error("InternalError", 500, "UploadPart")
        return real(**kwargs)

    calls = wrap(s3_blob, "upload_part", flaky_first)
    value = payload(LARGE)
    s3_blob.set("shard/part/big", value)
    assert len(calls) == 4  # three pieces, the first sent twice
    assert s3_blob.get("shard/part/big") == value


def test_lost_reply_to_completion_is_retried_and_found_done(
    s3_blob: S3Blob, moto_server: str
) -> None:
    def complete_then_lose_reply(n: int, real: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        result = real(**kwargs)
        if n == 1:
            raise client_error("InternalError", 500, "CompleteMultipartUpload")
        return result

    calls = wrap(s3_blob, "complete_multipart_upload", complete_then_lose_reply)
    value = payload(LARGE)
    s3_blob.set("shard/part/big", value)  # the retry finds the upload completed: no error
    assert len(calls) == 2
    assert s3_blob.get("shard/part/big") == value
    assert open_uploads(moto_server, s3_blob._key_prefix) == []


def test_delete_many_batches_requests(s3_blob: S3Blob, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(s3, "DELETE_BATCH", 10)
    keys = [f"shard/part/{i:03d}" for i in range(25)]
    for key in keys:
        s3_blob.set(key, b"x")
    s3_blob.set("shard/part/keep", b"y")
    batches = wrap(s3_blob, "delete_objects", lambda _n, real, kw: real(**kw))
    singles = wrap(s3_blob, "delete_object", lambda _n, real, kw: real(**kw))
    assert s3_blob.delete_many(keys) == 25
    assert (len(batches), singles) == (3, [])
    assert [m.key for m in s3_blob.list_keys()] == ["shard/part/keep"]


def test_delete_many_retries_only_the_keys_s3_failed_to_delete(s3_blob: S3Blob) -> None:
    keys = [f"shard/part/{i}" for i in range(4)]
    for key in keys:
        s3_blob.set(key, b"x")
    sent: list[list[str]] = []

    def one_key_fails_once(n: int, real: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        names = [o["Key"] for o in kwargs["Delete"]["Objects"]]
        sent.append(names)
        if n == 1:
            real(**{**kwargs, "Delete": {"Objects": [{"Key": k} for k in names[1:]]}})
            return {"Errors": [{"Key": names[0], "Code": "InternalError", "Message": "x"}]}
        return real(**kwargs)

    wrap(s3_blob, "delete_objects", one_key_fails_once)
    assert s3_blob.delete_many(keys) == 4
    assert len(sent) == 2 and sent[1] == sent[0][:1]
    assert list(s3_blob.list_keys()) == []


def test_delete_many_permanent_key_error_is_unavailable(s3_blob: S3Blob) -> None:
    s3_blob.set("shard/part/0", b"x")

    def denied(_n: int, _real: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        names = [o["Key"] for o in kwargs["Delete"]["Objects"]]
        return {"Errors": [{"Key": names[0], "Code": "AccessDenied", "Message": "no"}]}

    wrap(s3_blob, "delete_objects", denied)
    with pytest.raises(StoreUnavailable, match="AccessDenied") as info:
        s3_blob.delete_many(["shard/part/0"])
    assert info.value.transient is False


def test_gc_deletes_in_batches(s3_blob: S3Blob) -> None:
    """Compaction leaves garbage; GC (with the orphan sweep) removes it with delete_objects."""
    import pyarrow as pa

    from pyspark_persist.state import PersistClient, PersistConfig
    from pyspark_persist.state.consensus import open_consensus

    config = PersistConfig(maintenance=False, inline_write_max_bytes=1, compaction_fan_in=2)
    client = PersistClient(s3_blob, open_consensus(f"mem://{uuid.uuid4().hex}"), config=config)
    shard = client.open_shard("gc", pa.schema([("id", pa.int64())]))
    writer = shard.writer()
    for i in range(8):
        writer.append(pa.table({"id": [i]}))
    shard.compact()
    parts_before = len(list(s3_blob.list_keys("gc/part/")))
    batches = wrap(s3_blob, "delete_objects", lambda _n, real, kw: real(**kw))
    singles = wrap(s3_blob, "delete_object", lambda _n, real, kw: real(**kw))
    report = shard.gc()
    assert report.parts_deleted > 0 and batches and not singles
    assert len(list(s3_blob.list_keys("gc/part/"))) == parts_before - report.parts_deleted
    assert sorted(shard.reader().snapshot_table()["id"].to_pylist()) == list(range(8))
