"""Blob fixtures: every test that takes ``blob`` or ``blob_uri`` runs once per backend.

The S3 backend runs against moto's server mode on loopback, a real HTTP server,
so the tests exercise boto3's networking, retries and error mapping, and child
processes (Spark workers, forks) can reach it too. The server starts only when
an ``s3`` test first asks for it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyspark_persist.state.blob import Blob, open_blob

MOTO_BUCKET = "persist-test"

# Set in os.environ (not just passed to clients) so child processes inherit them.
_MOTO_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture(scope="session")
def moto_server() -> Iterator[str]:
    """Start moto on 127.0.0.1 (a free port), create ``persist-test``; yield the endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    saved = {name: os.environ.get(name) for name in _MOTO_ENV}
    os.environ.update(_MOTO_ENV)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.session.Session().client("s3", endpoint_url=endpoint).create_bucket(
            Bucket=MOTO_BUCKET
        )
        yield endpoint
    finally:
        server.stop()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(params=["mem", "file", "s3"])
def blob_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty Blob URI of each backend."""
    if request.param == "mem":
        return f"mem://{uuid.uuid4().hex}"
    if request.param == "file":
        return f"file://{tmp_path}/blob"
    endpoint = request.getfixturevalue("moto_server")
    return f"s3://{MOTO_BUCKET}/{uuid.uuid4().hex}?endpoint_url={endpoint}&region=us-east-1"


@pytest.fixture
def blob(blob_uri: str) -> Iterator[Blob]:
    """The Blob opened from ``blob_uri``, closed after the test."""
    opened = open_blob(blob_uri)
    try:
        yield opened
    finally:
        opened.close()
