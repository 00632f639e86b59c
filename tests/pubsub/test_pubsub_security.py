"""Edges a hostile or careless environment pushes on the PubSub server.

It binds loopback unless told otherwise, can require TLS and a shared token,
rejects (and counts) streams without it, and never logs the token.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import time
import uuid
from pathlib import Path

import pytest

from pyspark_persist import pubsub
from pyspark_persist.pubsub.server import PubSubServer, is_loopback
from pyspark_persist.state.cache import SharedState

TOKEN = "t0ken-" + uuid.uuid4().hex

# --- PubSub: loopback, TLS, token ---------------------------------------------------------------


def test_pubsub_binds_loopback_unless_allowed() -> None:
    """The default is loopback; another address needs an explicit allow_remote."""
    server = PubSubServer(port=0).start()
    try:
        assert server.host == "127.0.0.1"
    finally:
        server.stop()
    with pytest.raises(ValueError, match="allow_remote"):
        PubSubServer("0.0.0.0", 0)
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
