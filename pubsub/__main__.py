"""``python -m pyspark_persist.pubsub serve [--host H] [--port P]``: the PubSub server.

The same as ``persist pubsub serve``, for environments without the console script.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pyspark_persist.pubsub import serve
from pyspark_persist.pubsub.server import DEFAULT_HOST, DEFAULT_PORT


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """``--host`` and ``--port`` of ``pubsub serve``."""
    parser.add_argument(
        "--host", default=DEFAULT_HOST,
        help=f"address to bind (default {DEFAULT_HOST}: this machine only)",
    )
    parser.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``serve [--host] [--port]`` and run the server in the foreground."""
    parser = argparse.ArgumentParser(
        prog="python -m pyspark_persist.pubsub", description="Persist PubSub server."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    add_serve_arguments(sub.add_parser("serve", help="serve PubSub until interrupted"))
    ns = parser.parse_args(argv)
    return serve(ns.host, ns.port)


if __name__ == "__main__":
    sys.exit(main())
