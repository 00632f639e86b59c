"""A loopback TCP proxy a test owns, to take a store away and give it back deterministically.

The shared PostgreSQL (and the session's moto S3 server) must never be
restarted by a test, so a test puts a :class:`FaultProxy` between its client
and the real server and breaks the proxy instead:

- :meth:`FaultProxy.stop`: the port refuses connections and every open one
  is reset, as when the server process dies or restarts;
- :meth:`FaultProxy.pause`: connections stay open but no byte moves, and new
  ones are accepted but go nowhere, as when the network or the server hangs;
- :meth:`FaultProxy.start` / :meth:`FaultProxy.resume`: back to normal, on the
  same port, so a client reconnects to the address it was given.

Each state change takes effect before the call returns, so a test decides
exactly which operations see the fault.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; see the module doc."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False

    @property
    def address(self) -> str:
        """``127.0.0.1:<port>``."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        """Listen (again, on the same port after a :meth:`stop`) and forward."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return self

    def stop(self) -> None:
        """Refuse new connections and reset every open one (a dead server)."""
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            listener.close()
        client_ports = [port for conn in conns if (port := self._client_port(conn)) is not None]
        for conn in conns:
            _reset(conn)
        _await_resets_delivered(self.port, client_ports)

    def _client_port(self, conn: socket.socket) -> int | None:
        """The client's port if ``conn`` is a client's connection to this proxy (not one to
        the target), while it is open."""
        try:
            return conn.getpeername()[1] if conn.getsockname()[1] == self.port else None
        except OSError:
            return None

    def pause(self) -> None:
        """Hold every byte (a hung server or network); connections stay open."""
        self._flowing.clear()

    def resume(self) -> None:
        """Let bytes flow again after :meth:`pause`."""
        self._flowing.set()

    def close(self) -> None:
        """Stop for good."""
        self._closed = True
        self._flowing.set()
        self.stop()

    @contextlib.contextmanager
    def down(self) -> Iterator[None]:
        """The server is gone for the duration of the block."""
        self.stop()
        try:
            yield
        finally:
            self.start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # stopped
            self._flowing.wait()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                if self._listener is not listener:
                    _reset(client)
                    _reset(upstream)
                    return
                self._conns.update((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self._flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)
            _reset(dst)
            _reset(src)


def _reset(sock: socket.socket) -> None:
    """Close with an RST (linger 0), as a crashed peer's kernel would.

    ``shutdown(SHUT_RD)`` first wakes a pump thread blocked in ``recv`` on it.
    """
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RD)
    with contextlib.suppress(OSError):
        sock.close()


def _await_resets_delivered(proxy_port: int, client_ports: Iterable[int]) -> None:
    """Wait until the client end of every reset connection has taken its RST in.

    Loopback delivers an RST through the kernel's deferred packet processing,
    which a loaded machine can run milliseconds later: until then the
    client's socket is still established and a client checking it would find
    it sound. Waiting here is what makes :meth:`FaultProxy.stop` take effect
    before it returns (a client socket that took the RST in leaves the TCP
    table).
    """
    pending = set(client_ports)
    deadline = time.monotonic() + 10.0
    while pending and time.monotonic() < deadline:
        pending &= _established_local_ports(proxy_port)
        if pending:
            time.sleep(0.001)


def _established_local_ports(remote_port: int) -> set[int]:
    """Local ports of this machine's established IPv4 TCP sockets talking to ``remote_port``."""
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == "01" and int(remote.split(":")[1], 16) == remote_port:
            ports.add(int(local.split(":")[1], 16))
    return ports
