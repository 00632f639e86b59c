"""``auto`` mode: push freshness on the embedded default with nothing to run.

Every process that uses a location asks :class:`AutoDiscovery` for the
server's address. The first one takes an exclusive ``flock`` on
``<dir>/pubsub.lock``, serves PubSub on ``127.0.0.1`` with an OS-assigned
port and advertises ``host:port`` in ``<dir>/pubsub.addr`` (written to a
temporary file and renamed into place, so readers never see half of it).
Every other process finds the lock taken and connects to the advertised
address. The lock is released by the kernel when the serving process dies,
however it dies, so the next process whose stream breaks takes it and
serves in turn: there is no stale-lock timeout to tune. If the address file
names a dead server while its lock is still held (a server that is about to
take over has not written yet), connecting fails and the client retries
with backoff, polling meanwhile.

``<dir>`` is the directory of the SQLite Consensus file (``$PERSIST_HOME``
for the embedded default) unless given explicitly (``auto:/some/dir``).

The server requires a token (gRPC metadata ``x-persist-token``) that only
processes able to read the data can learn: ``$PERSIST_PUBSUB_TOKEN`` if set,
else the location's own, 256 random bits in ``<dir>/pubsub.token`` (mode
0600, made by the first process that needs it; :func:`location_token`). Any
other local process that finds the advertised port gets UNAUTHENTICATED. A
push carries no rows anyway (only a shard's topic and SeqNo), so the token
guards what a subscriber could still learn: which shards exist and when
they commit.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import threading

from ..state.errors import InvalidUsage
from ..state.registry import sqlite_file
from .server import PubSubServer

log = logging.getLogger(__name__)

ADDR_FILE = "pubsub.addr"
LOCK_FILE = "pubsub.lock"
TOKEN_FILE = "pubsub.token"

_lock = threading.Lock()
_served: dict[str, tuple[PubSubServer, int]] = {}
"""Directory -> (the server this process runs for it, the fd holding its lock)."""


def _close_locks_in_child() -> None:
    # A forked child must not keep the parent's lock alive after the parent dies.
    for _server, fd in _served.values():
        try:
            os.close(fd)
        except OSError:
            pass
    _served.clear()


os.register_at_fork(after_in_child=_close_locks_in_child)


def location_token(directory: str) -> str:
    """The token of ``directory``'s auto server, from ``<directory>/pubsub.token``, which the
    first caller creates (mode 0600: readable by whoever owns the data beside it).

    Created under a temporary name and linked into place, so a concurrent
    caller either creates it or reads the whole of someone else's. Raises
    OSError when the file can be neither read nor created (the caller then
    goes without PubSub) and InvalidUsage when it holds no token.
    """
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, TOKEN_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w", encoding="ascii") as f:
                f.write(secrets.token_hex(32) + "\n")
            try:
                os.link(tmp, path)  # whole, since closed: nobody reads half a token
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp)
    with open(path, encoding="ascii") as f:
        token = f.read().strip()
    if not token:
        raise InvalidUsage(
            f"the PubSub token file {path} is empty: delete it (the next process makes a new "
            "one) or write a token into it"
        )
    return token


class AutoDiscovery:
    """Returns the address of this directory's PubSub server, serving it if nobody does.

    A server this process starts requires ``token`` (see :func:`location_token`) and
    serves TLS with ``tls_cert``/``tls_key`` (PEM bytes) when given, as
    ``persist pubsub serve`` would.
    """

    def __init__(
        self,
        directory: str,
        *,
        token: str,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
    ) -> None:
        self.directory = os.path.abspath(directory)
        self._token = token
        self._tls = (tls_cert, tls_key)
        self.addr_path = os.path.join(self.directory, ADDR_FILE)
        self.lock_path = os.path.join(self.directory, LOCK_FILE)

    def __call__(self) -> str | None:
        """The address to dial now, or None if there is none yet (retry later)."""
        with _lock:
            served = _served.get(self.directory)
            if served is not None:
                return served[0].address
            if self._try_serve():
                return _served[self.directory][0].address
        return self.read_address()

    def read_address(self) -> str | None:
        """The advertised ``host:port``, or None if none is advertised."""
        try:
            with open(self.addr_path, encoding="utf-8") as f:
                addr = f.read().strip()
        except OSError:
            return None
        return addr or None

    def serving(self) -> bool:
        """True if this process serves this directory."""
        with _lock:
            return self.directory in _served

    def _try_serve(self) -> bool:
        os.makedirs(self.directory, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False  # someone alive serves (or is about to)
        try:
            server = PubSubServer(
                "127.0.0.1", 0, tls_cert=self._tls[0], tls_key=self._tls[1], token=self._token
            ).start()
            tmp = f"{self.addr_path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(server.address + "\n")
            os.replace(tmp, self.addr_path)
        except BaseException:
            os.close(fd)
            raise
        _served[self.directory] = (server, fd)
        log.debug("pubsub auto: serving %s on %s", self.directory, server.address)
        return True


def stop_serving(directory: str) -> None:
    """Stop this process's server for ``directory`` and release its lock (tests, shutdown)."""
    with _lock:
        served = _served.pop(os.path.abspath(directory), None)
    if served is None:
        return
    server, fd = served
    server.stop()
    try:
        os.close(fd)
    except OSError:
        pass


def directory_for(consensus_uri: str) -> str | None:
    """Where ``auto`` advertises the server for ``consensus_uri``: next to a SQLite file."""
    path = sqlite_file(consensus_uri)
    return None if path is None else os.path.dirname(path)
