"""Edges a hostile or careless environment pushes on the PubSub server.

It binds loopback unless told otherwise, can require TLS and a shared token,
rejects (and counts) streams without it, and never logs the token.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from pyspark_persist import pubsub
from pyspark_persist.pubsub.addresses import is_loopback
from pyspark_persist.pubsub.server import PubSubServer
from pyspark_persist.state.cache import SharedState
from pyspark_persist.state.errors import InvalidUsage

TOKEN = "t0ken-" + uuid.uuid4().hex

# --- PubSub: loopback, TLS, token ---------------------------------------------------------------


def test_pubsub_binds_loopback_unless_allowed() -> None:
    """The default is loopback; another address needs an explicit allow_remote."""
    server = PubSubServer(port=0).start()
    try:
        assert server.host == "127.0.0.1"
    finally:
        server.stop()
    with pytest.raises(InvalidUsage, match="allow_remote"):
        PubSubServer("0.0.0.0", 0)
    with pytest.raises(InvalidUsage, match="certificate and its key"):
        PubSubServer(port=0, tls_cert=b"cert")
    server = PubSubServer("0.0.0.0", 0, allow_remote=True).start()
    server.stop()
    assert is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.1")
    assert not is_loopback("example.com")


def _self_signed(tmp_path: Path) -> tuple[bytes, bytes, Path]:
    """A self-signed certificate for 127.0.0.1/localhost: (cert PEM, key PEM, cert path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path = tmp_path / "cert.pem"
    path.write_bytes(cert_pem)
    return cert_pem, key_pem, path


def _connects(spec: str, **kw: str) -> tuple[bool, object]:
    # A SQL location (mem:// is in-process and never subscribes); nothing opens the file.
    location = "sqlite:////nonexistent/pyspark-persist-edges.db"
    pub = pubsub.connect(spec, location, **kw)
    pub.subscribe("edge-shard", SharedState("edge-shard"), location)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and not getattr(pub, "connected", False):
        time.sleep(0.02)
    ok = bool(getattr(pub, "connected", False))
    pub.close()  # type: ignore[attr-defined]
    return ok, pub


def test_pubsub_tls_and_token(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """TLS plus token: the right client connects; no token, a wrong one or plaintext do not."""
    caplog.set_level(logging.DEBUG)
    cert, key, cert_path = _self_signed(tmp_path)
    server = PubSubServer("127.0.0.1", 0, tls_cert=cert, tls_key=key, token=TOKEN).start()
    try:
        addr = server.address
        assert _connects(f"tls://{addr}", token=TOKEN, tls_ca=str(cert_path))[0]
        assert server.counters["rejected"] == 0
        assert not _connects(f"tls://{addr}", token="wrong", tls_ca=str(cert_path))[0]
        assert not _connects(f"tls://{addr}", token="", tls_ca=str(cert_path))[0]
        assert server.counters["rejected"] >= 2
        rejected = server.counters["rejected"]
        assert not _connects(addr, token=TOKEN)[0]  # plaintext to a TLS server
        assert server.counters["rejected"] == rejected  # never got as far as the handler
    finally:
        server.stop()
    text = caplog.text + "".join(str(r.args) for r in caplog.records)
    assert TOKEN not in text and "wrong" not in text.replace("wrong token", "")


def test_pubsub_token_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clients pick the token up from PERSIST_PUBSUB_TOKEN; a token-less server ignores it."""
    server = PubSubServer("127.0.0.1", 0, token=TOKEN).start()
    try:
        assert not _connects(server.address)[0]
        monkeypatch.setenv("PERSIST_PUBSUB_TOKEN", TOKEN)
        assert _connects(server.address)[0]
    finally:
        server.stop()


def test_pubsub_serve_cli_arguments() -> None:
    """``pubsub serve`` knows the TLS, token and remote flags."""
    import argparse

    from pyspark_persist.pubsub.__main__ import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    ns = parser.parse_args(
        ["--tls-cert", "c", "--tls-key", "k", "--token", "t", "--allow-remote", "--host", "0.0.0.0"]
    )
    assert (ns.tls_cert, ns.tls_key, ns.token, ns.allow_remote) == ("c", "k", "t", True)


# --- every entry point that starts a server honours the flags --------------------------------


def _persist() -> list[str]:
    """The installed ``persist`` console script (``python -m pyspark_persist`` without one)."""
    script = Path(sys.executable).with_name("persist")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pyspark_persist"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _cli_server(*flags: str) -> Iterator[str]:
    """``persist pubsub serve --port P FLAGS`` in a child process; yields ``127.0.0.1:P``."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_PUBSUB_")}
    proc = subprocess.Popen(
        [*_persist(), "pubsub", "serve", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert b"serving on" in line, proc.stderr.read().decode()
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _subscribe(address: str, *, token: str | None = None, ca: bytes | None = None) -> object:
    """Open a stream and subscribe once: None if the server acknowledged, else the gRPC code."""
    import grpc

    from pyspark_persist.pubsub import persist_pubsub_pb2 as pb
    from pyspark_persist.pubsub import persist_pubsub_pb2_grpc as pb_grpc

    channel = (
        grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca))
        if ca is not None
        else grpc.insecure_channel(address)
    )
    with channel:
        stub = pb_grpc.ProtoPersistPubSubStub(channel)
        request = pb.ProtoPubSubMessage(subscribe=pb.ProtoSubscribe(shard="0123456789abcdef/shard"))
        metadata = (("x-persist-token", token),) if token else None
        try:
            for msg in stub.PubSub(iter([request]), metadata=metadata, timeout=5):
                if msg.WhichOneof("message") == "subscribe":
                    return None
        except grpc.RpcError as e:
            return e.code()
    return "closed without an acknowledgement"


def test_cli_serve_requires_the_token() -> None:
    """``persist pubsub serve --token T``: a client without T (or with another) is refused
    UNAUTHENTICATED; the right one is served."""
    import grpc

    with _cli_server("--token", TOKEN) as address:
        assert _subscribe(address) == grpc.StatusCode.UNAUTHENTICATED
        assert _subscribe(address, token="wrong") == grpc.StatusCode.UNAUTHENTICATED
        assert _subscribe(address, token=TOKEN) is None


def test_cli_serve_with_tls_refuses_plaintext(tmp_path: Path) -> None:
    """``persist pubsub serve --tls-cert C --tls-key K --token T``: a client without TLS
    cannot connect at all; a TLS client needs the token too."""
    import grpc

    cert, key, cert_path = _self_signed(tmp_path)
    key_path = tmp_path / "key.pem"
    key_path.write_bytes(key)
    flags = ("--tls-cert", str(cert_path), "--tls-key", str(key_path), "--token", TOKEN)
    with _cli_server(*flags) as address:
        assert _subscribe(address, token=TOKEN) == grpc.StatusCode.UNAVAILABLE
        assert _subscribe(address, ca=cert) == grpc.StatusCode.UNAUTHENTICATED
        assert _subscribe(address, token=TOKEN, ca=cert) is None


def test_cli_serve_binds_remote_only_when_allowed() -> None:
    """A non-loopback --host is refused (exit 1, naming the flag) unless --allow-remote."""
    port = str(_free_port())
    refused = subprocess.run(
        [*_persist(), "pubsub", "serve", "--host", "0.0.0.0", "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "--allow-remote" in refused.stderr
    with _cli_server("--host", "0.0.0.0", "--allow-remote", "--token", TOKEN) as address:
        assert _subscribe(address, token=TOKEN) is None


def test_auto_server_honours_the_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``pubsub=auto`` with $PERSIST_PUBSUB_TOKEN: the server it starts refuses clients
    without the token, and its own clients send it."""
    import grpc

    from pyspark_persist.pubsub import auto

    monkeypatch.setenv("PERSIST_PUBSUB_TOKEN", TOKEN)
    location = f"sqlite:///{tmp_path}/consensus.db"
    pub = pubsub.connect("auto", location)
    try:
        pub.subscribe("s", SharedState("s"), location)
        deadline = time.monotonic() + 10
        while not getattr(pub, "connected", False):
            assert time.monotonic() < deadline, "the auto client never connected"
            time.sleep(0.02)
        address = (tmp_path / "pubsub.addr").read_text().strip()
        assert _subscribe(address) == grpc.StatusCode.UNAUTHENTICATED
        assert _subscribe(address, token=TOKEN) is None
    finally:
        pub.close()  # type: ignore[attr-defined]
        auto.stop_serving(str(tmp_path))


def test_auto_server_refuses_a_subscriber_without_the_host_token(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pubsub=auto`` with no token configured still requires one: the location's own, in
    ``pubsub.token`` beside the SQLite database, readable by its owner only. Another local
    process that finds the advertised port but cannot read that file gets UNAUTHENTICATED;
    every process of the location (the same file) connects.

    Regression: the auto server accepted any subscriber without a token."""
    import grpc

    from pyspark_persist.pubsub import auto

    monkeypatch.delenv("PERSIST_PUBSUB_TOKEN", raising=False)
    location = f"sqlite:///{tmp_path}/consensus.db"
    pub = pubsub.connect("auto", location)
    other = pubsub.connect("auto", location)  # another client of the location
    try:
        pub.subscribe("s", SharedState("s"), location)
        other.subscribe("s", SharedState("s"), location)
        deadline = time.monotonic() + 10
        while not (getattr(pub, "connected", False) and getattr(other, "connected", False)):
            assert time.monotonic() < deadline, "the auto clients never connected"
            time.sleep(0.02)
        address = (tmp_path / "pubsub.addr").read_text().strip()
        assert _subscribe(address) == grpc.StatusCode.UNAUTHENTICATED
        assert _subscribe(address, token="guessed") == grpc.StatusCode.UNAUTHENTICATED
        token_file = tmp_path / "pubsub.token"
        assert token_file.stat().st_mode & 0o777 == 0o600
        assert _subscribe(address, token=token_file.read_text().strip()) is None
    finally:
        pub.close()  # type: ignore[attr-defined]
        other.close()  # type: ignore[attr-defined]
        auto.stop_serving(str(tmp_path))


def test_an_empty_host_token_file_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token file with no token names the file and the fix, before anything connects."""
    monkeypatch.delenv("PERSIST_PUBSUB_TOKEN", raising=False)
    (tmp_path / "pubsub.token").write_text("\n")
    with pytest.raises(InvalidUsage, match=r"pubsub\.token is empty: delete it"):
        pubsub.connect("auto", f"sqlite:///{tmp_path}/consensus.db")
