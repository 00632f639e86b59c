"""PubSub: announcing commits between processes, so readers learn of writes at once.

The story
---------
A shard's state changes only by compare-and-set in Consensus
(:mod:`pyspark_persist.state`). Without PubSub, a process that reads a shard
written elsewhere learns of a change by *polling* Consensus: an idle
listener queries it several times a second, and a write is seen a polling
interval later.

With PubSub, every successful compare-and-set also *pushes* the shard's
topic and its new SeqNo to the other processes that hold the shard. A push
carries nothing else: not the diff, not a row, not a part key. A push is a
hint, never trusted on its own (anyone who can reach the server could
forge, replay or reorder one) and never the only way to learn of a commit
(it may be dropped). A process that receives a SeqNo past the one it holds
reads Consensus at once (one indexed scan of the rows after its SeqNo) and
installs what Consensus holds into its one cached state per shard
(:class:`~pyspark_persist.state.cache.SharedState`), waking its waiting
listens: a reader sees a write about a millisecond after it committed, and
an idle one queries Consensus far less often. A forged push costs that
process one read and changes nothing; a duplicate or old one is ignored.

Staleness is bounded whatever PubSub says: a push can be lost (a full send
queue, a server restart, a writer with PubSub off or on another server), so
every reader that trusts its cache while pushes look healthy still reads
Consensus on a timer: an idle listen every ``listen_poll_pushed_s`` (5 s),
a Spark source's ``latestOffset`` whenever its last read is older than
``pubsubPollMs`` (1 s), and ``Trigger.AvailableNow``'s end always. A lost
push delays a reader by at most that.

PubSub is about latency and load only, never correctness. It is off by
default; with it off, slow, broken or killed, every write still succeeds
(a push only enqueues) and every reader keeps up by polling at the polling
cadence (a Spark source's ``latestOffset`` reads Consensus whenever the
shard is not currently delivered), picking pushes up again when the
connection comes back (it reconnects in the background). The server bounds
what it holds for each subscriber and drops one that falls behind; that
subscriber reconnects and catches up from Consensus.

Inside one Python process nothing goes over the network: handles to one
shard share one cached state and wake each other directly; a push this
process sent is never sent back to it (the server skips the sender) and
would be ignored as a duplicate if it were.

Transports, all behind one entry point, :func:`connect`:

- ``"host:port"``: the gRPC service from the design (a bidirectional stream
  of PushDiff / Subscribe / Unsubscribe, ``persist_pubsub.proto``) served by
  ``persist pubsub serve`` (:func:`serve`, default ``127.0.0.1:6879``).
- ``"tls://host:port"``: the same over TLS (trusting ``tls_ca``, a PEM file,
  or the system roots). A server started with a token (``--token`` or
  ``$PERSIST_PUBSUB_TOKEN``) rejects streams without it; clients send
  ``token=`` (default ``$PERSIST_PUBSUB_TOKEN``) as gRPC metadata. The
  server binds loopback only unless started with ``--allow-remote``.
- ``"postgres"``: LISTEN/NOTIFY on the Consensus database itself.
- ``"auto"``: nothing to run. On the embedded default (SQLite) the first
  process serves gRPC on loopback and advertises its address next to the
  data; the others find it there and one takes over if it dies
  (:mod:`.auto`). That server always requires a token, the location's own
  (``pubsub.token`` beside the data, mode 0600) unless
  ``$PERSIST_PUBSUB_TOKEN`` is set. On PostgreSQL it is LISTEN/NOTIFY; on
  ``mem://`` off.
- ``None`` / ``"off"``: no PubSub (polling only).

Example (counters: pushed, applied_cleanly, fallback_polls, latency...):

>>> from pyspark_persist import pubsub
>>> client = pubsub.open_client(blob_uri, consensus_uri, pubsub="127.0.0.1:6879")
>>> client.pubsub_metrics()

Counters (:class:`PubSubMetrics`): pushes sent, dropped, received,
confirmed by Consensus (``applied_cleanly``), ``unconfirmed``, duplicates,
approximate push-to-apply latency; ``PersistClient.pubsub_metrics()`` adds
the listens' fallback polls.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..state import consensus_kind
from ..state.errors import InvalidUsage
from ..state.machine import DiffPublisher, NoopPublisher
from .metrics import PubSubMetrics

if TYPE_CHECKING:
    from ..state import PersistClient, PersistConfig

log = logging.getLogger(__name__)

DEFAULT_ADDRESS = "127.0.0.1:6879"
"""Where ``persist pubsub serve`` listens unless told otherwise."""

_OFF = ("", "off", "none", "false", "0", "no")
TOKEN_ENV = "PERSIST_PUBSUB_TOKEN"
"""Environment variable holding the shared PubSub token (server and clients)."""
TLS_CERT_ENV = "PERSIST_PUBSUB_TLS_CERT"
"""Environment variable naming the PEM certificate a server (``serve`` or ``auto``) presents."""
TLS_KEY_ENV = "PERSIST_PUBSUB_TLS_KEY"
"""Environment variable naming the PEM private key of :data:`TLS_CERT_ENV`."""


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def connect(
    spec: str | None,
    consensus_uri: str,
    *,
    token: str | None = None,
    tls_ca: str | None = None,
) -> DiffPublisher:
    """The publisher for ``spec`` on the Consensus at ``consensus_uri`` (see the module doc).

    ``spec``: ``None``/``"off"``, ``"host:port"`` (or ``"grpc://host:port"``,
    ``"tls://host:port"`` for TLS trusting the PEM file ``tls_ca``),
    ``"auto"`` (or ``"auto:/dir"``) or ``"postgres"``. Connecting is lazy
    and never fails a write; only a malformed ``spec`` raises (InvalidUsage).
    Create one per process and location and reuse it; ``close()`` it when done.
    """
    text = (spec or "").strip()
    lowered = text.lower()
    if lowered in _OFF:
        return NoopPublisher()
    kind = consensus_kind(consensus_uri)
    if lowered in ("postgres", "postgresql"):
        if kind != "postgresql":
            raise InvalidUsage(
                f"pubsub={spec!r} needs a postgresql:// Consensus, not {kind}://; "
                "use pubsub=auto or pubsub=host:port instead"
            )
        from .postgres import PostgresPublisher

        return PostgresPublisher(consensus_uri)
    if lowered == "auto" or lowered.startswith("auto:"):
        return _auto(text[5:] or None, consensus_uri, kind)
    tls = lowered.startswith("tls://")
    address = text[7:] if lowered.startswith("grpc://") else text[6:] if tls else text
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidUsage(
            f"invalid pubsub {spec!r}: use host:port (e.g. {DEFAULT_ADDRESS}, served by "
            "`persist pubsub serve`), auto, postgres or off"
        )
    from .grpc_client import GrpcPublisher

    ca = None
    if tls_ca is not None:
        with open(tls_ca, "rb") as f:
            ca = f.read()
    return GrpcPublisher(
        address,
        consensus_uri,
        tls=tls,
        tls_ca=ca,
        token=token if token is not None else _env(TOKEN_ENV),
    )


def _auto(directory: str | None, consensus_uri: str, kind: str) -> DiffPublisher:
    """``auto``: the server one process starts for the others always requires a token:
    ``$PERSIST_PUBSUB_TOKEN`` if set, else the location's own (``<dir>/pubsub.token``, mode
    0600, see :func:`.auto.location_token`), sent by every client. It serves TLS with
    ``$PERSIST_PUBSUB_TLS_CERT`` / ``$PERSIST_PUBSUB_TLS_KEY`` (clients trust that
    certificate). A process that can neither read nor create the token file goes without
    PubSub (it polls), with a warning."""
    from .auto import AutoDiscovery, directory_for, location_token

    if directory is None:
        if kind == "postgresql":
            from .postgres import PostgresPublisher

            return PostgresPublisher(consensus_uri)
        directory = directory_for(consensus_uri)
        if directory is None:
            return NoopPublisher()  # mem://: one process, the shared cache is enough
    from .grpc_client import GrpcPublisher

    token = _env(TOKEN_ENV)
    if token is None:
        try:
            token = location_token(directory)
        except OSError as e:
            log.warning(
                "pubsub=auto: cannot read or create the PubSub token in %s (%s); polling "
                "Consensus instead",
                directory,
                e.strerror or e,
            )
            return NoopPublisher()
    cert, key = read_tls_pair(_env(TLS_CERT_ENV), _env(TLS_KEY_ENV))
    discovery = AutoDiscovery(directory, token=token, tls_cert=cert, tls_key=key)
    return GrpcPublisher(discovery, consensus_uri, tls=cert is not None, tls_ca=cert, token=token)


def read_tls_pair(cert_path: str | None, key_path: str | None) -> tuple[bytes | None, bytes | None]:
    """The PEM bytes of a server certificate and its key (both or neither; InvalidUsage else)."""
    if not cert_path and not key_path:
        return None, None
    if not (cert_path and key_path):
        raise InvalidUsage(
            "persist PubSub TLS needs both a certificate and its key (--tls-cert and --tls-key, "
            f"or ${TLS_CERT_ENV} and ${TLS_KEY_ENV})"
        )
    try:
        with open(cert_path, "rb") as f:
            cert = f.read()
        with open(key_path, "rb") as f:
            key = f.read()
    except OSError as e:
        raise InvalidUsage(
            f"cannot read the PubSub TLS certificate or key: {e.strerror}: {e.filename!r} "
            "(--tls-cert and --tls-key name PEM files)"
        ) from e
    return cert, key


def serve(
    host: str = "127.0.0.1",
    port: int = 6879,
    *,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    token: str | None = None,
    allow_remote: bool = False,
    metrics_host: str = "127.0.0.1",
    metrics_port: int | None = None,
    consumer_lag: tuple[str, str] | None = None,
) -> int:
    """Run the PubSub server in the foreground until interrupted (``persist pubsub serve``).

    ``tls_cert``/``tls_key``: PEM file paths (default ``$PERSIST_PUBSUB_TLS_CERT`` /
    ``$PERSIST_PUBSUB_TLS_KEY``); ``token``: required from every client (default
    ``$PERSIST_PUBSUB_TOKEN``); a non-loopback ``host`` needs ``allow_remote``;
    ``metrics_port``: serve Prometheus metrics on ``metrics_host`` (loopback unless
    ``allow_remote``) at that port; ``consumer_lag``: the (Blob, Consensus) URIs whose named
    consumers' lag those metrics include (``--consumer-lag``, :mod:`.consumer_lag`).
    """
    from .server import serve as _serve

    return _serve(
        host,
        port,
        tls_cert=tls_cert or _env(TLS_CERT_ENV),
        tls_key=tls_key or _env(TLS_KEY_ENV),
        token=token if token is not None else _env(TOKEN_ENV),
        allow_remote=allow_remote,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        consumer_lag=consumer_lag,
    )


def open_client(
    blob: str | None = None,
    consensus: str | None = None,
    *,
    pubsub: str | None = None,
    config: PersistConfig | None = None,
) -> PersistClient:
    """``PersistClient.open`` with PubSub: ``pubsub`` as for :func:`connect`."""
    from ..state import (
        PersistClient,
        default_blob_uri,
        default_consensus_uri,
        open_blob,
        open_consensus,
    )

    store = open_consensus(consensus or default_consensus_uri())
    uri = consensus or default_consensus_uri()
    return PersistClient(
        open_blob(blob or default_blob_uri()),
        store,
        config=config,
        publisher=connect(pubsub, uri),
    )


__all__ = [
    "DEFAULT_ADDRESS",
    "PubSubMetrics",
    "connect",
    "open_client",
    "serve",
]
