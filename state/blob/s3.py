"""A Blob in an S3 (or S3-compatible) bucket: ``s3://bucket/optional/prefix?query``.

Credentials come only from boto3's standard chain (environment variables, the
shared config/profile, an instance or task role): a URI never carries secrets,
so :attr:`S3Blob.uri` can be logged and shipped to Spark executors as is. URIs
with a ``user:password@`` part or unknown query parameters are rejected.

Query parameters (all optional):

- ``endpoint_url``: an S3-compatible endpoint (MinIO, moto, LocalStack). It
  switches to path-style addressing, which those stores need. Without it,
  boto3's own ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` handling applies.
- ``region``: the signing region (otherwise ``AWS_REGION``/profile/default).
- ``connect_timeout``, ``read_timeout``: seconds (boto3 defaults to 60 each).
- ``max_attempts``: total attempts per request, including botocore's retries
  in ``standard`` mode (default 3); ``1`` fails fast.

Retries: besides botocore's own few quick attempts, every operation retries
transient failures (connection refused or reset, timeouts, a 5xx, throttling)
with jittered backoff until the deadline (60 s, or the enclosing command's
``retry_timeout_s``; :mod:`pyspark_persist.state.retry`), logging a warning
once it has waited a few seconds. Every operation is safe to repeat: a key's
bytes never change, so a ``set`` whose reply was lost is simply sent again.

Errors say whether a write may have happened: a request that surely never
reached S3 (connection refused, connect timeout, no credentials, a 4xx) raises
:class:`StoreUnavailable`; a ``set`` whose reply was lost (read timeout, closed
connection, a 5xx) still at the deadline raises :class:`Indeterminate`.
``get``, ``delete`` and ``list_keys`` always raise :class:`StoreUnavailable`.
Permanent failures (no credentials, access denied, no such bucket) are not
retried.

Large values go up as a multipart upload (above
:data:`MULTIPART_THRESHOLD`, in :data:`MULTIPART_PART_BYTES` pieces), each
request retried by the same policy; S3 makes the object visible only when the
upload completes, so readers still see all of it or nothing, and an upload
that fails is aborted so its pieces do not linger. (A bucket lifecycle rule
that aborts incomplete uploads after a day also catches the pieces of a
process killed mid-upload.) :meth:`S3Blob.delete_many` deletes up to 1,000
keys per ``delete_objects`` request.

The boto3 client is created lazily per process id: a client inherited through
``os.fork`` (Spark's Python workers fork) shares sockets with its parent, so
the child builds its own on first use.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit

import boto3
import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    HTTPClientError,
    IncompleteReadError,
    NoCredentialsError,
)
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.loaders import Loader, create_loader

from .. import retry
from ..errors import (
    Indeterminate,
    InvalidUri,
    InvalidUsage,
    PersistError,
    StoreUnavailable,
)
from . import Blob, BlobMeta, BlobValue, validate_key

# Loose on purpose: legacy buckets may hold upper case or '_'. No ':' (no port) or '@'.
log = logging.getLogger(__name__)

_BUCKET_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
_PARAM_NAME_RE = re.compile(r"^[a-z_]{1,40}$")
_FLOAT_PARAMS = ("connect_timeout", "read_timeout")
_PARAMS = ("endpoint_url", "region", *_FLOAT_PARAMS, "max_attempts")
_THROTTLED = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout"})

T = TypeVar("T")

MULTIPART_THRESHOLD = 16 * 1024 * 1024
"""A value larger than this is uploaded in pieces (one ``put_object`` holds it whole otherwise)."""
MULTIPART_PART_BYTES = 16 * 1024 * 1024
"""The size of each piece but the last (S3 wants at least 5 MiB; at most 10,000 pieces)."""
DELETE_BATCH = 1000
"""Keys per ``delete_objects`` request: S3's limit."""
STAT_THREADS = 8
"""``head_object`` requests a commit's existence check of its staged parts runs at once."""
_TRANSIENT_DELETE_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown"})


# Guards client creation. Recreated in a forked child, where a lock held by a
# parent thread at fork time would otherwise stay locked forever.
_CLIENT_LOCK = threading.Lock()


def _reset_client_lock() -> None:
    global _CLIENT_LOCK
    _CLIENT_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_client_lock)


# botocore's parsed service models, shared by every session: loading them costs
# about 50 ms per session, which opening a Blob per Spark task would pay each time.
_LOADER: Loader | None = None


def _new_session() -> boto3.session.Session:
    """A fresh session per client, since a boto3 session is not thread-safe.

    A fresh one also resolves credentials anew, so rotated environment
    credentials are picked up by the next Blob opened. Call with _CLIENT_LOCK held.
    """
    global _LOADER
    if _LOADER is None:
        _LOADER = create_loader()
    core = botocore.session.Session()
    core.register_component("data_loader", _LOADER)
    return boto3.session.Session(botocore_session=core)


class S3Blob(Blob):
    """Keys are objects under ``prefix/`` in one bucket; see the module doc."""

    def __init__(self, bucket: str, prefix: str, params: dict[str, str]) -> None:
        """Use :meth:`from_uri`, which validates the arguments and checks the bucket."""
        self._bucket = bucket
        self._prefix = prefix
        self._key_prefix = f"{prefix}/" if prefix else ""
        self._params = params
        config: dict[str, Any] = {
            "max_pool_connections": 32,
            "retries": {"mode": "standard"},
        }
        for name in _FLOAT_PARAMS:
            if name in params:
                config[name] = float(params[name])
        if "max_attempts" in params:
            config["retries"]["total_max_attempts"] = int(params["max_attempts"])
        if "endpoint_url" in params:
            config["s3"] = {"addressing_style": "path"}
        self._config = Config(**config)
        # (pid, client): one tuple so a reader never pairs one process's pid with another's client.
        self._state: tuple[int, Any] | None = None

    @classmethod
    def from_uri(cls, uri: str) -> S3Blob:
        """Parse ``uri`` and check once, with ``head_bucket``, that the bucket is reachable."""
        blob = cls(*_parse(uri))
        try:
            blob._check_bucket()
        except BaseException:
            blob.close()
            raise
        return blob

    @property
    def uri(self) -> str:
        """The canonical URI; it never holds secrets, since a URI with any is rejected."""
        path = f"/{self._prefix}" if self._prefix else ""
        query = urlencode([(k, self._params[k]) for k in _PARAMS if k in self._params])
        return f"s3://{self._bucket}{path}" + (f"?{query}" if query else "")

    def _client(self) -> Any:
        pid = os.getpid()
        state = self._state
        if state is None or state[0] != pid:
            with _CLIENT_LOCK:
                state = self._state
                if state is None or state[0] != pid:
                    client = _new_session().client(
                        "s3",
                        region_name=self._params.get("region"),
                        endpoint_url=self._params.get("endpoint_url"),
                        config=self._config,
                    )
                    state = (pid, client)
                    self._state = state
        return state[1]

    def close(self) -> None:
        """Close this process's connection pool (an inherited client is left to the parent)."""
        state, self._state = self._state, None
        if state is not None and state[0] == os.getpid():
            state[1].close()

    def _where(self, key: str | None = None) -> str:
        state = self._state
        endpoint = (
            state[1].meta.endpoint_url
            if state is not None
            else self._params.get("endpoint_url", "the default S3 endpoint")
        )
        name = self._key_prefix + key if key is not None else self._key_prefix
        return f"s3://{self._bucket}/{name} at {endpoint}"

    def _missing_bucket(self) -> StoreUnavailable:
        return StoreUnavailable(
            f"S3 bucket {self._bucket!r} does not exist ({self._where()}): create it "
            f"(e.g. `aws s3 mb s3://{self._bucket}`) or fix the bucket in the blob URI",
            transient=False,
        )

    def _error(
        self,
        op: str,
        key: str | None,
        e: Exception,
        *,
        may_have_happened: bool = False,
        waited: str = "",
    ) -> PersistError:
        """Translate a boto error; only a ``set`` whose reply was lost is indeterminate.

        The message is built from the error code, HTTP status and S3's message
        (never the request, its headers or the client), so it holds no secrets.
        """
        if isinstance(e, ClientError):
            err = e.response.get("Error", {})
            code = err.get("Code", "")
            if code == "NoSuchBucket":
                return self._missing_bucket()
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            detail = f"{code} (HTTP {status}): {err.get('Message', '')}"
            unknown = may_have_happened and status >= 500
        else:
            detail = f"{type(e).__name__}: {e}{_fix(e)}"
            unknown = (
                may_have_happened
                and isinstance(e, HTTPClientError)
                and not isinstance(e, BotoConnectionError)
            )
        after = f" (gave up {waited})" if waited else ""
        if unknown:
            return Indeterminate(
                f"S3 {op} of {self._where(key)} may or may not have happened{after}: {detail}"
            )
        return StoreUnavailable(
            f"S3 {op} of {self._where(key)} failed{after}: {detail}", transient=_transient(e)
        )

    def _call(
        self, op: str, key: str | None, fn: Callable[[], T], *, may_have_happened: bool = False
    ) -> T:
        """Run one S3 request through the retry policy, translating what finally fails."""

        def gave_up(e: Exception, w: retry.Watch) -> Exception:
            return self._error(
                op, key, e, may_have_happened=may_have_happened, waited=retry.waited(w)
            )

        try:
            return retry.call(
                fn,
                store=f"S3 blob {self._where()}",
                what=f"{op} {key!r}" if key is not None else op,
                transient=_transient,
                gave_up=gave_up,
            )
        except (ClientError, BotoCoreError, _DeleteErrors) as e:
            raise self._error(op, key, e, may_have_happened=may_have_happened) from e

    def _check_bucket(self) -> None:
        try:
            self._call("head_bucket", None, lambda: self._client().head_bucket(Bucket=self._bucket))
        except StoreUnavailable as e:
            cause = e.__cause__
            if isinstance(cause, ClientError):
                status = cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status == 404:
                    raise self._missing_bucket() from cause
                if status == 403:
                    raise StoreUnavailable(
                        f"access to S3 bucket {self._bucket!r} denied ({self._where()}): check "
                        "the credentials (AWS environment variables, profile or instance role) "
                        "and the bucket policy",
                        transient=False,
                    ) from cause
            raise

    def get(self, key: str) -> bytes | None:
        """Fetch the object; a missing key is ``None`` (a missing bucket is an error)."""
        name = self._key_prefix + validate_key(key)

        def fetch() -> bytes | None:
            try:
                response = self._client().get_object(Bucket=self._bucket, Key=name)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                    return None
                raise
            body: bytes = response["Body"].read()
            return body

        return self._call("get", key, fetch)

    def set(self, key: str, value: BlobValue) -> None:
        """One ``put_object``, or a multipart upload above :data:`MULTIPART_THRESHOLD`.

        Either way S3 makes it atomic: readers see the old or new object whole.
        """
        name = self._key_prefix + validate_key(key)
        view = memoryview(value).cast("B")
        if view.nbytes > MULTIPART_THRESHOLD:
            self._set_multipart(key, name, view)
            return
        body = value if isinstance(value, bytes) else view.tobytes()
        self._call(
            "set",
            key,
            lambda: self._client().put_object(Bucket=self._bucket, Key=name, Body=body),
            may_have_happened=True,
        )

    def _set_multipart(self, key: str, name: str, view: memoryview) -> None:
        """Upload ``view`` in pieces; abort the upload if any step finally fails.

        Until ``complete_multipart_upload`` nothing is visible, so a failure
        before it is a :class:`StoreUnavailable` (surely not written); only a
        lost reply to the completion is :class:`Indeterminate`.
        """
        where = {"Bucket": self._bucket, "Key": name}
        upload_id: str = self._call(
            "create_multipart_upload",
            key,
            lambda: self._client().create_multipart_upload(**where)["UploadId"],
        )
        try:
            pieces = []
            for number, start in enumerate(range(0, view.nbytes, MULTIPART_PART_BYTES), 1):
                body = view[start : start + MULTIPART_PART_BYTES].tobytes()

                def upload(number: int = number, body: bytes = body) -> str:
                    response = self._client().upload_part(
                        **where, UploadId=upload_id, PartNumber=number, Body=body
                    )
                    etag: str = response["ETag"]
                    return etag

                etag = self._call("upload_part", key, upload)
                pieces.append({"PartNumber": number, "ETag": etag})

            def complete() -> None:
                try:
                    self._client().complete_multipart_upload(
                        **where, UploadId=upload_id, MultipartUpload={"Parts": pieces}
                    )
                except ClientError as e:
                    # A retry after a lost reply finds the upload gone because it completed.
                    if e.response.get("Error", {}).get("Code") != "NoSuchUpload":
                        raise
                    head = self._client().head_object(**where)
                    if head["ContentLength"] != view.nbytes:
                        raise

            self._call("complete_multipart_upload", key, complete, may_have_happened=True)
        except BaseException:
            self._abort_upload(where, upload_id)
            raise

    def _abort_upload(self, where: dict[str, str], upload_id: str) -> None:
        """Best effort: a failed abort leaves pieces for the bucket's lifecycle rule."""
        try:
            self._client().abort_multipart_upload(**where, UploadId=upload_id)
        except (BotoCoreError, ClientError) as e:
            log.debug("could not abort multipart upload of %s: %s", where["Key"], e)

    def delete(self, key: str) -> int | None:
        """``head_object`` for the size, then ``delete_object``.

        Not atomic: two concurrent deletes of one key may both report its size.
        """
        name = self._key_prefix + validate_key(key)

        def remove() -> int | None:
            client = self._client()
            try:
                size: int = client.head_object(Bucket=self._bucket, Key=name)["ContentLength"]
            except ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    return None
                raise
            client.delete_object(Bucket=self._bucket, Key=name)
            return size

        return self._call("delete", key, remove)

    def delete_many(self, keys: Iterable[str]) -> int:
        """``delete_objects`` in batches of :data:`DELETE_BATCH`; keys S3 reports as failed
        with a transient code are retried, by themselves, under the retry policy."""
        names = [self._key_prefix + validate_key(k) for k in keys]
        for start in range(0, len(names), DELETE_BATCH):
            pending = names[start : start + DELETE_BATCH]

            def remove() -> None:
                nonlocal pending
                response = self._client().delete_objects(
                    Bucket=self._bucket,
                    Delete={"Objects": [{"Key": n} for n in pending], "Quiet": True},
                )
                errors = response.get("Errors", [])
                if errors:
                    pending = [e["Key"] for e in errors]
                    raise _DeleteErrors(errors)

            first = pending[0][len(self._key_prefix) :]
            self._call("delete_many", f"{first} and {len(pending) - 1} more", remove)
        return len(names)

    def stat_many(self, keys: Iterable[str]) -> dict[str, BlobMeta]:
        """``head_object`` per key (no data moves), up to :data:`STAT_THREADS` at once."""
        checked = [validate_key(k) for k in keys]

        def head(key: str) -> BlobMeta | None:
            name = self._key_prefix + key

            def call() -> BlobMeta | None:
                try:
                    got = self._client().head_object(Bucket=self._bucket, Key=name)
                except ClientError as e:
                    if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                        return None
                    raise
                return BlobMeta(key, got["ContentLength"], _ms(got.get("LastModified")))

            return self._call("head", key, call)

        if len(checked) <= 1:
            metas = [head(k) for k in checked]
        else:
            with ThreadPoolExecutor(min(STAT_THREADS, len(checked))) as pool:
                metas = list(pool.map(head, checked))
        return {m.key: m for m in metas if m is not None}

    def list_keys(self, prefix: str = "") -> Iterator[BlobMeta]:
        """Page through ``list_objects_v2``; objects whose names are not valid keys are skipped.

        Skipping keeps GC from tripping over foreign objects under the prefix
        (a console's ``folder/`` marker, say), as the file backend does. Each
        page is one retried request, so a blip mid-listing resumes where it was.
        """
        start = len(self._key_prefix)
        args: dict[str, Any] = {"Bucket": self._bucket, "Prefix": self._key_prefix + prefix}
        while True:
            page = self._call("list", prefix, lambda: self._client().list_objects_v2(**args))
            for obj in page.get("Contents", ()):
                key = obj["Key"][start:]
                if _is_valid_key(key):
                    yield BlobMeta(key, obj["Size"], _ms(obj.get("LastModified")))
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args["ContinuationToken"] = token


def _ms(when: datetime | None) -> int | None:
    """An S3 timestamp (the store's clock) in epoch milliseconds."""
    return None if when is None else int(when.timestamp() * 1000)


class _DeleteErrors(Exception):
    """Some keys of a ``delete_objects`` request were not deleted (S3 says which, and why)."""

    def __init__(self, errors: list[dict[str, str]]) -> None:
        first = errors[0]
        super().__init__(
            f"{len(errors)} key(s) not deleted, e.g. {first.get('Key')!r}: "
            f"{first.get('Code')}: {first.get('Message', '')}"
        )
        self.codes = {e.get("Code", "") for e in errors}


def _fix(e: Exception) -> str:
    """What to do about a failure S3 never answered (the end of the error's one line)."""
    if isinstance(e, NoCredentialsError):
        return (
            "; give this process S3 credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "a profile, or an instance role (Spark executors: spark.executorEnv.*)"
        )
    if isinstance(e, BotoConnectionError):
        return "; is the S3 endpoint up and reachable? check endpoint_url and region in the URI"
    return ""


def _transient(e: Exception) -> bool:
    """Whether an S3 failure may go away by itself: no connection, no reply, a 5xx, throttling."""
    if isinstance(e, _DeleteErrors):
        return e.codes <= _TRANSIENT_DELETE_CODES
    if isinstance(e, ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        code = e.response.get("Error", {}).get("Code", "")
        return status >= 500 or status in (408, 429) or code in _THROTTLED
    return isinstance(e, BotoConnectionError | HTTPClientError | IncompleteReadError)


def _is_valid_key(key: str) -> bool:
    try:
        validate_key(key)
    except InvalidUsage:
        return False
    return True


def _parse(uri: str) -> tuple[str, str, dict[str, str]]:
    """Split ``uri`` into bucket, prefix and query parameters, rejecting anything odd.

    Error messages quote only the scheme, bucket and path, never the query, and
    a URI with an ``@`` anywhere is not quoted at all, so a pasted secret does
    not end up in a log.
    """
    if "@" in uri:
        # '@' is legal nowhere in our URIs (bucket, key prefix, our parameters), and
        # where it appears it most likely ends a 'user:password@' part: do not echo.
        raise InvalidUri(
            "an s3:// blob URI must not embed credentials (it holds an '@'): use the "
            "standard AWS chain (environment variables, profile or instance role)"
        )
    parts = urlsplit(uri)
    shown = f"s3://{parts.netloc}{parts.path}"
    if parts.scheme != "s3" or not _BUCKET_RE.match(parts.netloc) or parts.fragment:
        raise InvalidUri(
            f"invalid s3 blob URI {shown!r}: use s3://bucket/optional/prefix"
            "?endpoint_url=...&region=..."
        )
    prefix = parts.path.strip("/")
    if prefix:
        try:
            validate_key(prefix)
        except InvalidUsage as e:
            raise InvalidUri(f"invalid prefix in s3 blob URI {shown!r}: {e}") from e
    params: dict[str, str] = {}
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        if name not in _PARAMS or name in params:
            # Echo the name only when it looks like a parameter name, not a pasted secret.
            which = repr(name) if _PARAM_NAME_RE.match(name) else "a"
            raise InvalidUri(
                f"unknown or repeated query parameter {which} in s3 blob URI {shown!r}: "
                f"supported are {', '.join(_PARAMS)} (credentials never go in the URI)"
            )
        params[name] = value
    for name in _FLOAT_PARAMS:
        if name in params and not _is_positive(params[name], float):
            raise InvalidUri(f"{name} in s3 blob URI {shown!r} must be a positive number")
    if "max_attempts" in params and not _is_positive(params["max_attempts"], int):
        raise InvalidUri(f"max_attempts in s3 blob URI {shown!r} must be a positive integer")
    if "endpoint_url" in params:
        endpoint = urlsplit(params["endpoint_url"])
        if (
            endpoint.scheme not in ("http", "https")
            or not endpoint.hostname
            or "@" in (endpoint.netloc)
        ):
            raise InvalidUri(
                f"endpoint_url in s3 blob URI {shown!r} must be http(s)://host[:port] "
                "with no credentials"
            )
    return parts.netloc, prefix, params


def _is_positive(text: str, kind: type[float] | type[int]) -> bool:
    try:
        return kind(text) > 0
    except ValueError:
        return False
