"""``python -m pyspark_persist.pubsub serve [--host H] [--port P] [--tls-cert C --tls-key K]
[--token T] [--allow-remote] [--metrics-port N [--metrics-host H] [--consumer-lag [--blob URI]
[--consensus URI]]]``: the PubSub server.

The same as ``persist pubsub serve``, for environments without the console script.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..state.errors import InvalidUsage
from . import serve
from .server import DEFAULT_HOST, DEFAULT_PORT


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host``, ``--port``, TLS, token and ``--allow-remote`` of ``pubsub serve``."""
    parser.add_argument(
        "--host",
        default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}: this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})"
    )
    parser.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument(
        "--token",
        default=None,
        help="shared token every client must send (default $PERSIST_PUBSUB_TOKEN); "
        "prefer the environment variable, a flag shows in the process list",
    )
    parser.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow binding a non-loopback address (use TLS and a token)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics at http://METRICS_HOST:PORT/metrics (0: any free port)",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_HOST,
        help=f"address of the metrics endpoint (default {DEFAULT_HOST}; another needs "
        "--allow-remote)",
    )
    parser.add_argument(
        "--consumer-lag",
        action="store_true",
        help="also export every named consumer's lag (rows, bytes, times behind; held) at the "
        "location --blob/--consensus on the metrics endpoint; these gauges name shards",
    )
    parser.add_argument(
        "--blob", default=None, help="Blob URI of --consumer-lag (default: the embedded default)"
    )
    parser.add_argument(
        "--consensus",
        default=None,
        help="Consensus URI of --consumer-lag (default: the embedded default)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``serve [--host] [--port]`` and run the server in the foreground."""
    parser = argparse.ArgumentParser(
        prog="python -m pyspark_persist.pubsub", description="Persist PubSub server."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_serve_arguments(sub.add_parser("serve", help="serve PubSub until interrupted"))
    return serve_parsed(parser.parse_args(argv))


def serve_parsed(ns: argparse.Namespace) -> int:
    """Run the server with every flag :func:`add_serve_arguments` parsed (one place, so no
    entry point can drop a security flag)."""
    return serve(
        ns.host,
        ns.port,
        tls_cert=ns.tls_cert,
        tls_key=ns.tls_key,
        token=ns.token,
        allow_remote=ns.allow_remote,
        metrics_host=ns.metrics_host,
        metrics_port=ns.metrics_port,
        consumer_lag=_lag_location(ns),
    )


def _lag_location(ns: argparse.Namespace) -> tuple[str, str] | None:
    """The (Blob, Consensus) URIs of ``--consumer-lag``; None without it (a location flag
    alone is refused: it would do nothing)."""
    if not ns.consumer_lag:
        if ns.blob or ns.consensus:
            raise InvalidUsage("--blob/--consensus name where --consumer-lag reads: pass it too")
        return None
    from ..state.client import default_blob_uri, default_consensus_uri

    return ns.blob or default_blob_uri(), ns.consensus or default_consensus_uri()


if __name__ == "__main__":
    sys.exit(main())
