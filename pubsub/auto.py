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
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading

from ..state.registry import sqlite_file
from .server import PubSubServer

log = logging.getLogger(__name__)

ADDR_FILE = "pubsub.addr"
LOCK_FILE = "pubsub.lock"

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


class AutoDiscovery:
    """Returns the address of this directory's PubSub server, serving it if nobody does.

    A server this process starts requires ``token`` and serves TLS with
    ``tls_cert``/``tls_key`` (PEM bytes) when given, as ``persist pubsub serve`` would.
    """

    def __init__(
        self,
        directory: str,
        *,
        token: str | None = None,
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
