"""The PubSub server's counters for Prometheus: the text exposition format over HTTP.

``persist pubsub serve --metrics-port N`` serves ``GET /metrics`` on
``127.0.0.1:N`` (another address needs ``--metrics-host`` and
``--allow-remote``), for a Prometheus scrape or ``curl``. The format (``# HELP``,
``# TYPE``, one ``name value`` line per metric) is written here rather than
through ``prometheus_client``: eleven numbers do not justify a dependency, and
the values are read from the server at scrape time, so nothing is kept twice.
No metric of the server names a shard or a peer: the endpoint says how busy the
server is, not what it carries. Named consumers' lag, which does name shards and
consumers, is added only with ``--consumer-lag`` (:mod:`.consumer_lag`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

from ..state.errors import InvalidUsage
from .addresses import is_loopback


class MetricsSource(Protocol):
    """What the endpoint scrapes: :class:`~pyspark_persist.pubsub.server.PubSubServer`."""

    def metrics(self) -> dict[str, int]:
        """The counters and gauges, read now, from any thread."""


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""Prometheus' text exposition format."""

METRICS: tuple[tuple[str, str, str, str], ...] = (
    # (metric name, type, key of PubSubServer.metrics(), help)
    ("persist_pubsub_connections", "gauge", "connections", "Client streams open now."),
    (
        "persist_pubsub_connections_total",
        "counter",
        "connections_total",
        "Client streams accepted since the server started.",
    ),
    (
        "persist_pubsub_rejected_total",
        "counter",
        "rejected",
        "Client streams refused for a missing or wrong token.",
    ),
    (
        "persist_pubsub_invalid_total",
        "counter",
        "invalid",
        "Client streams ended for a malformed message.",
    ),
    (
        "persist_pubsub_diffs_received_total",
        "counter",
        "diffs_received",
        "Pushes (a shard's new SeqNo) sent to the server by writers.",
    ),
    (
        "persist_pubsub_diff_bytes_received_total",
        "counter",
        "bytes_received",
        "Bytes of the push messages sent to the server.",
    ),
    (
        "persist_pubsub_diffs_forwarded_total",
        "counter",
        "diffs_forwarded",
        "Pushes queued for a subscriber (one per subscriber of the shard).",
    ),
    (
        "persist_pubsub_diff_bytes_forwarded_total",
        "counter",
        "bytes_forwarded",
        "Bytes of the push messages queued for subscribers.",
    ),
    (
        "persist_pubsub_slow_subscribers_dropped_total",
        "counter",
        "slow_subscribers_dropped",
        "Pushes dropped because a subscriber fell too far behind; its stream was ended and it "
        "catches up from Consensus.",
    ),
    (
        "persist_pubsub_queued_bytes",
        "gauge",
        "queued_bytes",
        "Bytes of messages waiting to be sent to subscribers now.",
    ),
    ("persist_pubsub_topics", "gauge", "topics", "Shards with at least one subscriber now."),
)


def render(values: dict[str, int]) -> str:
    """``values`` (from :meth:`PubSubServer.metrics`) in Prometheus' text format."""
    lines = []
    for name, kind, key, help_text in METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {values[key]}"]
    return "\n".join(lines) + "\n"


class MetricsEndpoint:
    """``GET /metrics`` of one PubSub server, on its own daemon thread.

    Example::

        endpoint = MetricsEndpoint(server, "127.0.0.1", 0).start()
        print(endpoint.url)   # e.g. "http://127.0.0.1:41236/metrics"
        endpoint.stop()
    """

    def __init__(
        self,
        server: MetricsSource,
        host: str,
        port: int,
        *,
        allow_remote: bool = False,
        extra: Callable[[], str] | None = None,
    ) -> None:
        """``extra``: more metrics in the text format, appended to each scrape (the consumers'
        lag, :mod:`.consumer_lag`)."""
        if not allow_remote and not is_loopback(host):
            raise InvalidUsage(
                f"refusing to serve PubSub metrics on non-loopback address {host!r}: pass "
                "--allow-remote, or keep the default --metrics-host 127.0.0.1"
            )
        self.host = host
        self.port = port
        self._server = server
        self._extra = extra
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        """Where to scrape (the real port when 0 was asked for)."""
        return f"http://{self.host}:{self.port}/metrics"

    def start(self) -> MetricsEndpoint:
        """Bind and serve; an OSError naming the fix if the port is taken."""
        source, extra = self._server, self._extra

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != "/metrics":
                    self.send_error(404, "only /metrics is served here")
                    return
                text = render(source.metrics()) + (extra() if extra is not None else "")
                body = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                """Quiet: a scrape every few seconds is not worth a line on stderr."""

        try:
            self._httpd = ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as e:
            raise OSError(
                f"cannot serve PubSub metrics on {self.host}:{self.port}: {e.strerror} "
                "(pick another with --metrics-port)"
            ) from None
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        threading.Thread(
            target=self._httpd.serve_forever, name="persist-pubsub-metrics", daemon=True
        ).start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
