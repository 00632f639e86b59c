"""The ``persist`` command line.

Subcommands (more will join: ``persist pubsub serve``, ``persist shards ...``)::

    persist bench core [--quick] [--json] [flags]   # the core benchmark

Errors print one line, ``persist: error: ...``, on stderr and exit non-zero
(2 for bad usage, 1 for a failure, 130 when interrupted); no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

Handler = Callable[[argparse.Namespace], int]


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from pyspark_persist.benchmarks import core

    bench = sub.add_parser("bench", help="benchmarks", description="Benchmarks of persist.")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_sub.required = True
    core_parser = bench_sub.add_parser(
        "core",
        help="small-write and listen latency, throughput vs raw pyarrow, peak memory",
        description=(
            "Small-write and write-to-listen latency on every location, write and "
            "snapshot-read goodput next to raw pyarrow Parquet, and peak memory of a writer "
            "and a reader against persist's memory model."
        ),
    )
    core.add_arguments(core_parser)
    core_parser.set_defaults(handler=core.run_from_args)


def build_parser() -> argparse.ArgumentParser:
    """The ``persist`` argument parser with every subcommand."""
    parser = argparse.ArgumentParser(
        prog="persist", description="pyspark-persist: durable shards of (row, time, diff)."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``persist`` console script; returns the exit status."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    handler: Handler = ns.handler
    try:
        status = handler(ns)
    except KeyboardInterrupt:
        print("persist: interrupted", file=sys.stderr)
        status = 130
    except Exception as e:  # noqa: BLE001 - one clear line, no traceback
        text = str(e).strip().splitlines()
        detail = text[0] if text else type(e).__name__
        print(f"persist: error: {detail}", file=sys.stderr)
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
