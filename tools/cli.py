"""The ``persist`` command line (also ``python -m pyspark_persist``).

Commands::

    persist shards list [--json]                         # every shard, one line each
    persist shards inspect NAME [--json]                 # frontiers, SeqNos, batches, readers...
    persist shards show NAME [--as-of T] [--limit N] [--json]   # contents as of a time
    persist shards compact NAME [--json]                 # compaction now
    persist shards gc NAME [--json]                      # GC now (with the orphan sweep)
    persist pubsub serve [--host H] [--port P] [--tls-cert C --tls-key K] [--token T]
                         [--allow-remote]                # the PubSub server, in the foreground
    persist bench core|maintenance|pubsub|spark-read|spark-write|load|all [flags]
    persist check [flags]                                # the consistency checker

``--blob URI`` and ``--consensus URI`` (before the command or after the
``shards`` subcommand) name the location, as the connector's options do;
both default to the embedded default under ``$PERSIST_HOME``
(``~/.pyspark-persist``). The ``shards`` commands never create a location:
a ``file://`` Blob directory or SQLite Consensus file that does not exist
is an error, not a new empty store. Only ``compact`` and ``gc`` write
(``show`` registers a short-lived reader to hold what it reads).

Errors print one line, ``persist: error: ...``, on stderr and exit non-zero
(2 for bad usage, 1 for a failure, 130 when interrupted); no traceback.
Long operations draw a progress bar on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import pyarrow as pa

    from pyspark_persist.state.client import PersistClient, Shard
    from pyspark_persist.state.state import ShardState

Handler = Callable[[argparse.Namespace], int]

SHOW_LIMIT = 20
"""Rows ``persist shards show`` prints unless told otherwise."""

BENCHMARKS: dict[str, tuple[str, str]] = {
    "core": ("core", "small-write and listen latency, throughput vs raw pyarrow, peak memory"),
    "maintenance": ("maintenance", "compaction and GC: storage and read speed-up"),
    "pubsub": ("pubsub", "write-to-listen latency and Consensus load with and without PubSub"),
    "spark-read": ("spark_read", "Spark batch and streaming reads of a shard"),
    "spark-write": ("spark_write", "the Spark sink's throughput and commit latency"),
    "load": ("load", "many writers and readers at once"),
    "all": ("report", "every benchmark, one report"),
}
"""``persist bench NAME`` -> (module under ``pyspark_persist.tools.bench``, help)."""


class UsageError(Exception):
    """Bad command-line usage: reported on one line, exit status 2."""


class CliError(Exception):
    """A failure the CLI itself detected (e.g. a location that does not exist): exit 1."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors raise :class:`UsageError` instead of printing usage."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing usage and exiting."""
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


@contextlib.contextmanager
def _one_line_argparse() -> Iterator[None]:
    """Make every ArgumentParser (also those of delegated ``main(argv)``) raise UsageError."""
    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = _Parser.error  # type: ignore[method-assign, assignment]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]


# --------------------------------------------------------------------------- output helpers


def _progress_enabled() -> bool:
    """Progress bars go to stderr only when it is a terminal (never into logs or pipes)."""
    return sys.stderr.isatty()


class Progress:
    """A one-line ``label [#####.....] done/total`` bar on stderr (no dependency)."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None) -> None:
        self.label = label
        self.total = max(0, total)
        self.done = 0
        self.enabled = _progress_enabled() if enabled is None else enabled
        self._drawn = 0.0

    def advance(self, n: int = 1, *, total: int | None = None) -> None:
        """Count ``n`` more steps (and optionally reset the total); redraw at most 10 times/s."""
        self.done += n
        if total is not None:
            self.total = total
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.1 or self.done >= self.total):
            self._drawn = now
            self._draw()

    def _draw(self) -> None:
        width = 30
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        print(
            f"\r{self.label} [{bar}] {self.done}/{self.total}", end="", file=sys.stderr, flush=True
        )

    def close(self) -> None:
        """Finish the line (the bar stays visible above what follows)."""
        if self.enabled:
            self._draw()
            print(file=sys.stderr, flush=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in headers], *[[_cell(v) for v in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _size(n: int) -> str:
    """Bytes for people: 512 B, 3.2 KiB, 41.0 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


_EPOCH_MS_RANGE = (946_684_800_000, 4_102_444_800_000)  # 2000-01-01 .. 2100-01-01


def _time(t: int) -> str:
    """A time, with its UTC date when it looks like milliseconds since the epoch."""
    if _EPOCH_MS_RANGE[0] <= t < _EPOCH_MS_RANGE[1]:
        return f"{t} ({_iso(t)})"
    return str(t)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def _relative(ms_from_now: int) -> str:
    s = abs(ms_from_now) / 1000
    text = f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"
    return f"in {text}" if ms_from_now >= 0 else f"{text} ago"


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


# --------------------------------------------------------------------------- the location


def _uris(ns: argparse.Namespace) -> tuple[str, str]:
    from pyspark_persist.state.client import default_blob_uri, default_consensus_uri

    return (
        getattr(ns, "blob", None) or default_blob_uri(),
        getattr(ns, "consensus", None) or default_consensus_uri(),
    )


def _sqlite_path(consensus_uri: str) -> str | None:
    """The file of a ``sqlite://`` Consensus URI (None: not SQLite, or no file named)."""
    if not consensus_uri.lower().startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        path = make_url(consensus_uri).database or ""
    except (ArgumentError, ValueError):
        return None  # open_consensus explains what is malformed
    if not path or path == ":memory:" or path.startswith("file:"):
        return None
    return os.path.abspath(path)


def check_location_exists(blob_uri: str, consensus_uri: str) -> None:
    """Refuse (CliError) a ``file://`` Blob or SQLite Consensus that does not exist yet.

    Opening either would create it, so a mistyped path would silently show an
    empty location and leave a new directory or database behind.
    """
    hint = "check --consensus/--blob, or $PERSIST_HOME for the embedded default"
    db = _sqlite_path(consensus_uri)
    if db is not None and not os.path.isfile(db):
        raise CliError(f"consensus {consensus_uri} does not exist (no file {db}): {hint}")
    scheme, sep, path = blob_uri.partition("://")
    if sep and scheme == "file" and os.path.isabs(path) and not os.path.isdir(path):
        raise CliError(f"blob {blob_uri} does not exist (no directory {path}): {hint}")


def open_client(ns: argparse.Namespace) -> PersistClient:
    """The client for ``--blob``/``--consensus`` (defaults: the embedded default).

    Background maintenance is off: the CLI compacts and collects only when asked.
    """
    from pyspark_persist.pubsub import connect
    from pyspark_persist.state.blob import open_blob
    from pyspark_persist.state.client import PersistClient
    from pyspark_persist.state.config import PersistConfig
    from pyspark_persist.state.consensus import open_consensus

    blob_uri, consensus_uri = _uris(ns)
    check_location_exists(blob_uri, consensus_uri)
    publisher = connect(getattr(ns, "pubsub", None), consensus_uri)
    consensus = open_consensus(consensus_uri)
    try:
        blob = open_blob(blob_uri)
    except BaseException:
        consensus.close()
        raise
    return PersistClient(
        blob, consensus, config=PersistConfig(maintenance=False), publisher=publisher
    )


@contextlib.contextmanager
def _shard(ns: argparse.Namespace) -> Iterator[tuple[PersistClient, Shard]]:
    """The client and the existing shard ``ns.name`` (ShardNotFound otherwise; nothing written)."""
    from pyspark_persist.state.client import validate_shard_name
    from pyspark_persist.state.errors import ShardNotFound

    validate_shard_name(ns.name)
    client = open_client(ns)
    try:
        try:
            shard = client.open_shard(ns.name, create=False)
        except ShardNotFound:
            raise CliError(
                f"shard {ns.name!r} does not exist in consensus {client.consensus.uri} "
                "(see persist shards list)"
            ) from None
        yield client, shard
    finally:
        client.close()


# --------------------------------------------------------------------------- shards


def shard_summary(state: ShardState) -> dict[str, Any]:
    """One shard in a few numbers (a row of ``shards list``)."""
    batches = state.batches.values()
    return {
        "name": state.shard_id,
        "upper": state.upper,
        "since": state.since,
        "seqno": state.seqno,
        "batches": len(state.batches),
        "parts": sum(len(b.parts) for b in batches),
        "rows": sum(b.rows for b in batches),
        "bytes": sum(b.size_bytes for b in batches),
        "readers": len(state.leased_readers) + len(state.critical_readers),
        "writers": len(state.writers),
    }


def cmd_list(ns: argparse.Namespace) -> int:
    """``persist shards list``."""
    with contextlib.closing(open_client(ns)) as client:
        names = client.list_shards()
        progress = Progress("reading shards", len(names))
        rows = []
        for name in names:
            rows.append(shard_summary(client.open_shard(name, create=False).state()))
            progress.advance()
        progress.close()
        location = {"blob": client.blob.uri, "consensus": client.consensus.uri}
    if ns.json:
        _print_json({**location, "shards": rows})
        return 0
    if not rows:
        print(f"no shards in consensus {location['consensus']}")
        return 0
    headers = [
        "NAME",
        "UPPER",
        "SINCE",
        "SEQNO",
        "BATCHES",
        "PARTS",
        "ROWS",
        "SIZE",
        "READERS",
        "WRITERS",
    ]
    print(
        _table(
            headers,
            [
                [
                    r["name"],
                    r["upper"],
                    r["since"],
                    r["seqno"],
                    r["batches"],
                    r["parts"],
                    r["rows"],
                    _size(r["bytes"]),
                    r["readers"],
                    r["writers"],
                ]
                for r in rows
            ],
        )
    )
    print(f"{len(rows)} shard(s) in consensus {location['consensus']}")
    return 0


def _advertised_pubsub(consensus_uri: str) -> dict[str, Any] | None:
    """The ``pubsub=auto`` server advertised next to a SQLite Consensus, and if it answers."""
    db = _sqlite_path(consensus_uri)
    if db is None:
        return None
    path = os.path.join(os.path.dirname(db), "pubsub.addr")
    try:
        with open(path, encoding="utf-8") as f:
            address = f.read().strip()
    except OSError:
        return None
    host, _, port = address.rpartition(":")
    reachable = False
    if host and port.isdigit():
        with contextlib.suppress(OSError), socket.create_connection((host, int(port)), 0.2):
            reachable = True
    return {"address": address, "reachable": reachable}


def inspect_shard(client: PersistClient, shard: Shard, pubsub: str | None = None) -> dict[str, Any]:
    """Everything ``shards inspect`` reports, as plain JSON-able values.

    ``pubsub`` is the PubSub spec the client was opened with (``None``: off).
    """
    state = shard.state()
    now = int(time.time() * 1000)
    first = client.consensus.scan(shard.name, 0, limit=1)
    batches = state.trace
    return {
        "name": shard.name,
        "blob": client.blob.uri,
        "consensus": client.consensus.uri,
        "schema": [f"{f.name}: {f.type}" for f in shard.schema],
        "upper": state.upper,
        "since": state.since,
        "seqno": state.seqno,
        "seqno_range": [first[0].seqno if first else state.seqno, state.seqno],
        "seqno_since": state.seqno_since,
        "last_gc_seqno": state.last_gc_seqno,
        "rollups": sorted(state.rollups),
        "created_ms": state.created_ms,
        "totals": {
            "batches": len(batches),
            "parts": sum(len(b.parts) for b in batches),
            "rows": sum(b.rows for b in batches),
            "bytes": sum(b.size_bytes for b in batches),
            "inline_bytes": state.inline_bytes,
        },
        "batches": [
            {
                "lower": b.lower,
                "upper": b.upper,
                "since": b.since,
                "parts": len(b.parts),
                "inline_parts": sum(1 for p in b.parts if p.inline is not None),
                "rows": b.rows,
                "bytes": b.size_bytes,
            }
            for b in batches
        ],
        "leased_readers": [
            {
                "id": rid,
                "since": r.since,
                "seqno": r.seqno,
                "last_heartbeat_ms": r.last_heartbeat_ms,
                "lease_ms": r.lease_duration_ms,
                "expires_at_ms": r.expires_at_ms,
                "expires_in_ms": r.expires_at_ms - now,
            }
            for rid, r in sorted(state.leased_readers.items())
        ],
        "critical_readers": [
            {"id": rid, "since": r.since, "opaque": r.opaque}
            for rid, r in sorted(state.critical_readers.items())
        ],
        "writers": [
            {"id": wid, "last_token": w.last_token, "last_heartbeat_ms": w.last_heartbeat_ms}
            for wid, w in sorted(state.writers.items())
        ],
        "pubsub": {
            "mode": pubsub or "off",
            "advertised": _advertised_pubsub(client.consensus.uri),
            "counters": client.pubsub_metrics(),
        },
    }


_BATCHES_SHOWN = 30


def format_inspect(info: dict[str, Any]) -> str:
    """The readable form of :func:`inspect_shard`."""
    now = int(time.time() * 1000)
    t = info["totals"]
    lo, hi = info["seqno_range"]
    lines = [
        f"shard      {info['name']}",
        f"location   blob {info['blob']}",
        f"           consensus {info['consensus']}",
        f"schema     {', '.join(info['schema'])}",
        f"upper      {_time(info['upper'])}",
        f"since      {_time(info['since'])}",
        f"seqno      {hi} (consensus holds {lo}..{hi}; readers hold from {info['seqno_since']}; "
        f"last gc at {info['last_gc_seqno']})",
        f"rollups    {', '.join(map(str, info['rollups'])) or '-'}",
        f"data       {t['batches']} batches, {t['parts']} parts, {t['rows']} rows, "
        f"{_size(t['bytes'])} ({_size(t['inline_bytes'])} inline in state)",
        "",
    ]
    batches = info["batches"]
    if batches:
        shown = batches[-_BATCHES_SHOWN:]
        title = (
            "batches"
            if len(shown) == len(batches)
            else (f"batches (newest {len(shown)} of {len(batches)})")
        )
        lines += [
            title,
            _table(
                ["LOWER", "UPPER", "SINCE", "PARTS", "INLINE", "ROWS", "SIZE"],
                [
                    [
                        b["lower"],
                        b["upper"],
                        b["since"],
                        b["parts"],
                        b["inline_parts"],
                        b["rows"],
                        _size(b["bytes"]),
                    ]
                    for b in shown
                ],
            ),
            "",
        ]
    readers = [
        [
            "leased",
            r["id"],
            r["since"],
            r["seqno"],
            _relative(r["last_heartbeat_ms"] - now),
            ("expires " if r["expires_at_ms"] >= now else "expired ")
            + _relative(r["expires_at_ms"] - now),
        ]
        for r in info["leased_readers"]
    ] + [
        ["critical", r["id"], r["since"], None, None, f"never (opaque {r['opaque']})"]
        for r in info["critical_readers"]
    ]
    lines += [
        "readers",
        _table(["KIND", "ID", "SINCE HOLD", "SEQNO HOLD", "HEARTBEAT", "LEASE"], readers)
        if readers
        else "  none",
        "",
    ]
    writers = [
        [w["id"], w["last_token"], _relative(w["last_heartbeat_ms"] - now)] for w in info["writers"]
    ]
    lines += [
        "writers",
        _table(["ID", "LAST TOKEN", "LAST COMMIT"], writers) if writers else "  none",
        "",
    ]
    ps = info["pubsub"]
    adv = ps["advertised"]
    advertised = (
        "none"
        if adv is None
        else (f"{adv['address']} ({'reachable' if adv['reachable'] else 'not answering'})")
    )
    counters = ", ".join(f"{k}={_cell(v)}" for k, v in sorted(ps["counters"].items()))
    lines += [
        f"pubsub     this client: {ps['mode']}; auto server advertised: {advertised}",
        f"           counters: {counters}",
    ]
    return "\n".join(lines)


def cmd_inspect(ns: argparse.Namespace) -> int:
    """``persist shards inspect NAME``."""
    with _shard(ns) as (client, shard):
        info = inspect_shard(client, shard, getattr(ns, "pubsub", None))
    if ns.json:
        _print_json(info)
    else:
        print(format_inspect(info))
    return 0


def _check_as_of(state: ShardState, as_of: int | None) -> int:
    """The time to read (default ``upper - 1``), refusing one the shard cannot answer."""
    name = state.shard_id
    if state.upper == 0:
        raise CliError(f"shard {name!r} has no complete time yet (upper is 0): nothing to show")
    if as_of is None:
        return state.upper - 1
    if as_of >= state.upper:
        raise CliError(
            f"--as-of {as_of} is at or past the upper {state.upper} of shard {name!r}: "
            f"use {state.upper - 1} or earlier"
        )
    if as_of < state.since:
        raise CliError(
            f"--as-of {as_of} is before the since {state.since} of shard {name!r} "
            f"(compacted away): use {state.since} or later"
        )
    return as_of


def read_as_of(shard: Shard, as_of: int | None) -> tuple[int, pa.Table]:
    """The shard's consolidated contents at ``as_of``, fetched part by part with a progress bar.

    Read-only: no reader is registered (that would write to Consensus), so
    nothing holds the parts. If GC deletes one meanwhile, the newer state no
    longer names it: read the state again and fetch its parts instead.
    """
    import pyarrow as pa

    from pyspark_persist.state.errors import PartNotFound
    from pyspark_persist.state.parts import consolidate, data_schema
    from pyspark_persist.state.read import iter_parts, snapshot_parts

    for _attempt in range(_SHOW_ATTEMPTS):
        state = shard.state()
        at = _check_as_of(state, as_of)
        parts = snapshot_parts(state, at, shard.client.blob.uri)
        progress = Progress(f"reading {shard.name}", len(parts))
        tables: list[pa.Table] = []
        try:
            for part in parts:
                tables.extend(iter_parts(shard.client.blob, [part]))
                progress.advance()
        except PartNotFound:
            continue
        finally:
            progress.close()
        table = pa.concat_tables(tables) if tables else data_schema(shard.schema).empty_table()
        return at, consolidate(table, shard.schema.names)
    raise CliError(
        f"shard {shard.name!r} kept changing under the read (its parts were compacted and "
        f"deleted {_SHOW_ATTEMPTS} times): try again, or with a later --as-of"
    )


_SHOW_ATTEMPTS = 5


def cmd_show(ns: argparse.Namespace) -> int:
    """``persist shards show NAME``."""
    with _shard(ns) as (_client, shard):
        as_of, table = read_as_of(shard, ns.as_of)
    shown = table.slice(0, ns.limit) if ns.limit is not None else table
    rows = shown.to_pylist()
    if ns.json:
        _print_json({"shard": ns.name, "as_of": as_of, "total_rows": table.num_rows, "rows": rows})
        return 0
    if rows:
        print(_table(shown.column_names, [list(r.values()) for r in rows]))
    more = f", showing {len(rows)} (--limit)" if len(rows) < table.num_rows else ""
    print(
        f"shard {ns.name!r} as of {_time(as_of)}: {table.num_rows} distinct "
        f"(row, time) with a non-zero diff{more}"
    )
    return 0


def cmd_compact(ns: argparse.Namespace) -> int:
    """``persist shards compact NAME``: rounds of compaction until the policy is satisfied."""
    from pyspark_persist.state.maintenance import compact, compaction_request

    with _shard(ns) as (client, shard):
        started = time.monotonic()
        before = shard.state()
        progress = Progress(f"compacting {shard.name}", len(before.batches))
        reports = []
        state = before
        for _ in range(1000):
            request = compaction_request(state, client.config)
            if request is None:
                break
            reports.append(compact(shard.machine, request))
            state = shard.state()
            progress.done = len(before.batches) - len(state.batches)
            progress.advance(0)
        progress.close()
    result = {
        "shard": ns.name,
        "rounds": len(reports),
        "applied": sum(1 for r in reports if r.applied),
        "batches_before": len(before.batches),
        "batches_after": len(state.batches),
        "rows_in": sum(r.rows_in for r in reports),
        "rows_out": sum(r.rows_out for r in reports),
        "seconds": round(time.monotonic() - started, 3),
    }
    if ns.json:
        _print_json(result)
    elif not reports:
        print(f"shard {ns.name!r}: nothing to compact ({len(before.batches)} batches)")
    else:
        print(
            f"shard {ns.name!r}: {result['rounds']} compaction(s) ({result['applied']} "
            f"applied), batches {result['batches_before']} -> {result['batches_after']}, "
            f"rows {result['rows_in']} -> {result['rows_out']}, in {result['seconds']:.2f} s"
        )
    return 0


def cmd_gc(ns: argparse.Namespace) -> int:
    """``persist shards gc NAME``: one full GC pass including the orphan sweep."""
    with _shard(ns) as (_client, shard):
        started = time.monotonic()
        if _progress_enabled():
            print(f"collecting garbage of {shard.name} ...", end="", file=sys.stderr, flush=True)
        report = shard.gc()
        if _progress_enabled():
            print(" done", file=sys.stderr, flush=True)
    result = {
        "shard": ns.name,
        "seqno_since": report.seqno_since,
        "parts_deleted": report.parts_deleted,
        "rollups_deleted": report.rollups_deleted,
        "consensus_rows_deleted": report.consensus_rows_deleted,
        "orphans_deleted": report.orphans_deleted,
        "readers_expired": list(report.readers_expired),
        "seconds": round(time.monotonic() - started, 3),
    }
    if ns.json:
        _print_json(result)
    else:
        print(
            f"shard {ns.name!r}: gc up to SeqNo {report.seqno_since} deleted "
            f"{report.parts_deleted} part(s), {report.rollups_deleted} rollup(s), "
            f"{report.consensus_rows_deleted} consensus row(s), {report.orphans_deleted} "
            f"orphan(s); expired {len(report.readers_expired)} reader(s); "
            f"in {result['seconds']:.2f} s"
        )
    return 0


def _location_arguments(parser: argparse.ArgumentParser, *, default: Any) -> None:
    parser.add_argument(
        "--blob",
        metavar="URI",
        default=default,
        help="Blob URI: file:///dir, s3://bucket/prefix, mem://name "
        "(default: the embedded default under $PERSIST_HOME)",
    )
    parser.add_argument(
        "--consensus",
        metavar="URI",
        default=default,
        help="Consensus URI: sqlite:///file.db, postgresql://..., mem://name "
        "(default: the embedded default under $PERSIST_HOME)",
    )
    parser.add_argument(
        "--pubsub",
        metavar="SPEC",
        default=default,
        help="PubSub of this command's client: off (default), host:port, auto or postgres",
    )


def _add_shards(sub: argparse._SubParsersAction[_Parser]) -> None:
    location = _Parser(add_help=False)
    _location_arguments(location, default=argparse.SUPPRESS)
    shards = sub.add_parser(
        "shards",
        help="list, inspect, read and maintain shards",
        description="List, inspect, read and maintain shards.",
    )
    shards_sub = shards.add_subparsers(dest="shards_command", metavar="SUBCOMMAND")
    shards_sub.required = True

    def add(
        name: str,
        handler: Handler,
        help_text: str,
        *,
        shard: bool = True,
        json_help: str = "print JSON instead of a table",
    ) -> argparse.ArgumentParser:
        p = shards_sub.add_parser(
            name, help=help_text, description=help_text + ".", parents=[location]
        )
        if shard:
            p.add_argument("name", metavar="NAME", help="the shard's name")
        p.add_argument("--json", action="store_true", help=json_help)
        p.set_defaults(handler=handler)
        return p

    add("list", cmd_list, "list every shard with its frontiers and size", shard=False)
    add("inspect", cmd_inspect, "a shard's frontiers, SeqNos, batches, readers, writers, pubsub")
    show = add("show", cmd_show, "a shard's contents as of a time (consolidated)")
    show.add_argument(
        "--as-of",
        type=int,
        default=None,
        metavar="T",
        help="the time to read (default: upper - 1, the latest complete time)",
    )
    show.add_argument(
        "--limit",
        type=_non_negative,
        default=SHOW_LIMIT,
        metavar="N",
        help=f"rows to print (default {SHOW_LIMIT})",
    )
    add("compact", cmd_compact, "run compaction now, until the policy asks for nothing more")
    add(
        "gc",
        cmd_gc,
        "run garbage collection now (expire stale readers, delete garbage, "
        "truncate consensus, sweep orphans)",
    )


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


# --------------------------------------------------------------------------- delegated commands


def _import_optional(module: str, what: str) -> Any:
    """Import ``module``; a CliError naming ``what`` if it is not part of this installation."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            raise CliError(
                f"{what} is not available in this installation ({module} is missing)"
            ) from None
        raise


def _delegate(module: str, what: str, prog: str, argv: Sequence[str]) -> int:
    """Run ``module``'s command with ``argv``: its ``add_arguments`` + ``run_from_args`` when
    it has them (parsed here, one-line errors), else its ``main(argv)``."""
    mod = _import_optional(module, what)
    with _one_line_argparse():
        if hasattr(mod, "add_arguments") and hasattr(mod, "run_from_args"):
            parser = _Parser(prog=prog, description=(mod.__doc__ or "").split("\n\n")[0])
            mod.add_arguments(parser)
            return int(mod.run_from_args(parser.parse_args(list(argv))) or 0)
        try:
            return int(mod.main(list(argv)) or 0)
        except SystemExit as e:
            return _exit_code(e)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(f"persist: error: {e.code}", file=sys.stderr)
    return 1


def _add_bench(sub: argparse._SubParsersAction[_Parser]) -> None:
    bench = sub.add_parser(
        "bench",
        help="benchmarks",
        description="Benchmarks of persist. Flags after the benchmark's name are its own: "
        "see persist bench NAME --help.",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench_sub.required = True
    for name, (module, help_text) in BENCHMARKS.items():
        p = bench_sub.add_parser(name, help=help_text, add_help=False)
        p.set_defaults(
            handler=_delegating(
                f"pyspark_persist.tools.bench.{module}",
                f"benchmark {name!r}",
                f"persist bench {name}",
            ),
            passthrough=True,
        )


def _delegating(module: str, what: str, prog: str) -> Handler:
    def handler(ns: argparse.Namespace) -> int:
        return _delegate(module, what, prog, ns.rest)

    return handler


def _add_pubsub(sub: argparse._SubParsersAction[_Parser]) -> None:
    pubsub = sub.add_parser(
        "pubsub",
        help="the PubSub server",
        description="Push committed state diffs between processes.",
    )
    pubsub_sub = pubsub.add_subparsers(dest="pubsub_command", metavar="SUBCOMMAND")
    pubsub_sub.required = True
    serve = pubsub_sub.add_parser(
        "serve", help="serve PubSub in the foreground until interrupted", add_help=False
    )
    serve.set_defaults(handler=cmd_pubsub_serve, passthrough=True)


def cmd_pubsub_serve(ns: argparse.Namespace) -> int:
    """``persist pubsub serve``: every flag of ``python -m pyspark_persist.pubsub serve``."""
    from pyspark_persist.pubsub.__main__ import add_serve_arguments, serve_parsed

    parser = _Parser(
        prog="persist pubsub serve",
        description="Serve persist PubSub in the foreground until interrupted.",
    )
    add_serve_arguments(parser)
    return serve_parsed(parser.parse_args(ns.rest))


def _add_check(sub: argparse._SubParsersAction[_Parser]) -> None:
    check = sub.add_parser(
        "check", help="check shards' consistency (see persist check --help)", add_help=False
    )
    check.set_defaults(
        handler=_delegating("pyspark_persist.tools.checker", "persist check", "persist check"),
        passthrough=True,
    )


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    """The ``persist`` argument parser with every subcommand."""
    parser = _Parser(
        prog="persist", description="pyspark-persist: durable shards of (row, time, diff)."
    )
    _location_arguments(parser, default=None)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_shards(sub)
    _add_pubsub(sub)
    _add_bench(sub)
    _add_check(sub)
    return parser


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    ns, rest = parser.parse_known_args(argv)
    if getattr(ns, "passthrough", False):
        ns.rest = rest
    elif rest:
        words = [ns.command, getattr(ns, f"{ns.command}_command", None)]
        prog = " ".join(["persist", *(w for w in words if w)])
        raise UsageError(f"{prog}: unrecognized arguments: {' '.join(rest)} (see {prog} --help)")
    handler: Handler = ns.handler
    return handler(ns)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``persist`` console script; returns the exit status."""
    from pyspark_persist.state.errors import PersistError

    try:
        return _run(argv)
    except UsageError as e:
        print(f"persist: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("persist: interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help, or a delegated command's own exit
        return _exit_code(e)
    except (PersistError, CliError, Exception) as e:  # noqa: BLE001 - one clear line
        text = str(e).strip().splitlines()
        detail = text[0] if text else type(e).__name__
        print(f"persist: error: {detail}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
