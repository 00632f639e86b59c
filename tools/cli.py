"""The ``persist`` command line (also ``python -m pyspark_persist``), built on click.

Commands::

    persist --version
    persist -v|-vv COMMAND ...                           # with logs on stderr (INFO, DEBUG)
    persist shards list [--json]                         # every shard, one line each
    persist shards inspect NAME [--json]                 # frontiers, SeqNos, batches, readers...
    persist inspect NAME [--json]                        # the same, shorter
    persist shards show NAME [--as-of T] [--limit N] [--json]   # contents as of a time
    persist shards tail NAME [--as-of T] [--json]        # follow changes as they commit
    persist shards history NAME [--limit N] [--json]     # each commit: operation, writer, rows
    persist shards compact NAME [--dry-run] [--json]     # compaction now
    persist shards gc NAME [--dry-run] [--json]          # GC now (with the orphan sweep)
    persist shards alter NAME --retention 7d [--json]    # set the retention period (0: none)
    persist shards drop NAME [--yes] [--force] [--json]  # delete the shard
    persist pubsub serve [--host H] [--port P] [--tls-cert C --tls-key K] [--token T]
                         [--allow-remote] [--metrics-port N]  # the PubSub server, in the foreground
    persist bench core|maintenance|pubsub|spark-read|spark-write|load|all [flags]
    persist check [flags]                                # the consistency checker

``--blob URI``, ``--consensus URI`` and ``--pubsub SPEC`` (before the command
or after the ``shards`` subcommand) name the location, as the connector's
options do; both URIs default to the embedded default under
``$PERSIST_HOME`` (``~/.pyspark-persist``). The ``shards`` commands never
create a location: a ``file://`` Blob directory or SQLite Consensus file that
does not exist is an error, not a new empty store. Only ``compact``, ``gc``
and ``drop`` change a shard; ``tail`` registers a reader while it runs, so
GC keeps what it has still to print.

Errors print one line, ``persist: error: ...``, on stderr and exit non-zero
(2 for bad usage, 1 for a failure, 130 when interrupted); no traceback.
Long operations draw a progress bar on stderr when it is a terminal.

Start-up is kept short: click is the only import before a command runs; the
shard core (pyarrow, SQLAlchemy), tabulate (tables), rich (progress bars, on a
terminal only) and each benchmark are imported by the commands that use them,
so ``persist --help`` and ``--version`` cost a fraction of what ``shards list``
does.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

import click

from pyspark_persist.tools.bench import BENCHMARKS

if TYPE_CHECKING:
    import pyarrow as pa

    from pyspark_persist.state.client import PersistClient, Shard
    from pyspark_persist.state.read import ListenEvent, ReadHandle
    from pyspark_persist.state.state import ShardState

SHOW_LIMIT = 20
"""Rows ``persist shards show`` prints unless told otherwise."""


class UsageError(Exception):
    """Bad command-line usage: reported on one line, exit status 2."""


class CliError(Exception):
    """A failure the CLI itself detected (e.g. a location that does not exist): exit 1."""


class _ArgParser(argparse.ArgumentParser):
    """The parser of a delegated command's own flags (a benchmark, the checker, ``pubsub
    serve``): errors raise :class:`UsageError`, and ``--help`` exits through click."""

    def error(self, message: str) -> NoReturn:
        """Raise instead of printing usage and exiting."""
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")

    def exit(self, status: int = 0, message: str | None = None) -> NoReturn:
        """Leave through click's Exit, which :func:`main` turns into the exit status."""
        if message:
            print(message, file=sys.stderr, end="")
        raise click.exceptions.Exit(status)


# --------------------------------------------------------------------------- output helpers


def _progress_enabled() -> bool:
    """Progress bars go to stderr only when it is a terminal (never into logs or pipes)."""
    return sys.stderr.isatty()


class Progress:
    """A ``label ━━━━━ done/total`` bar on stderr (rich), drawn only when it is a terminal."""

    def __init__(self, label: str, total: int, *, enabled: bool | None = None) -> None:
        self.enabled = _progress_enabled() if enabled is None else enabled
        self._bar: Any = None
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("{task.description}"),
                BarColumn(bar_width=30),
                MofNCompleteColumn(),
                console=Console(stderr=True, highlight=False),
            )
            self._task = self._bar.add_task(label, total=max(0, total))
            self._bar.start()

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more steps."""
        if self._bar is not None:
            self._bar.advance(self._task, n)

    def update(self, completed: int) -> None:
        """Set how many steps are done."""
        if self._bar is not None:
            self._bar.update(self._task, completed=completed)

    def close(self) -> None:
        """Finish the bar (it stays visible above what follows)."""
        if self._bar is not None:
            self._bar.stop()


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Left-aligned columns two spaces apart (tabulate's plain format), never wrapped or cut,
    so a pipe gets whole lines. tabulate rather than rich here: it imports in a third of the
    time, and ``shards list`` pays for it on every run (rich draws only the progress bars,
    which exist only on a terminal)."""
    import tabulate

    tabulate.MIN_PADDING = 0  # headers get the two spaces between columns, no more
    return tabulate.tabulate(
        [[_cell(v) for v in row] for row in rows],
        headers=list(headers),
        tablefmt="plain",
        stralign="left",
        numalign="left",
        disable_numparse=True,
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


@dataclass(frozen=True)
class Location:
    """Where a command works: ``--blob``, ``--consensus`` and ``--pubsub`` as given, and how
    long a store may stay unreachable before the command gives up (``--store-timeout``)."""

    blob: str | None = None
    consensus: str | None = None
    pubsub: str | None = None
    store_timeout_s: float = 15.0

    def uris(self) -> tuple[str, str]:
        """The Blob and Consensus URIs, the embedded default for any not given."""
        from pyspark_persist.state.client import default_blob_uri, default_consensus_uri

        return self.blob or default_blob_uri(), self.consensus or default_consensus_uri()


def check_location_exists(blob_uri: str, consensus_uri: str) -> None:
    """Refuse (CliError) a ``file://`` Blob or SQLite Consensus that does not exist yet.

    Opening either would create it, so a mistyped path would silently show an
    empty location and leave a new directory or database behind. Both URIs
    are checked by the registry every entry point uses (InvalidUri if bad).
    """
    from pyspark_persist.state.registry import (
        blob_kind,
        consensus_kind,
        file_blob_directory,
        sqlite_file,
    )

    blob_kind(blob_uri), consensus_kind(consensus_uri)  # a bad URI first, whichever it is
    hint = "check --consensus/--blob, or $PERSIST_HOME for the embedded default"
    db = sqlite_file(consensus_uri)
    if db is not None and not os.path.isfile(db):
        raise CliError(f"consensus {consensus_uri} does not exist (no file {db}): {hint}")
    directory = file_blob_directory(blob_uri)
    if directory is not None and not os.path.isdir(directory):
        raise CliError(f"blob {blob_uri} does not exist (no directory {directory}): {hint}")


def open_client(where: Location) -> PersistClient:
    """The client for ``--blob``/``--consensus`` (defaults: the embedded default).

    Background maintenance is off: the CLI compacts and collects only when asked.
    """
    from pyspark_persist.pubsub import connect
    from pyspark_persist.state.blob import open_blob
    from pyspark_persist.state.client import PersistClient
    from pyspark_persist.state.config import PersistConfig
    from pyspark_persist.state.consensus import open_consensus

    blob_uri, consensus_uri = where.uris()
    check_location_exists(blob_uri, consensus_uri)
    publisher = connect(where.pubsub, consensus_uri)
    consensus = open_consensus(consensus_uri)
    try:
        blob = open_blob(blob_uri)
    except BaseException:
        consensus.close()
        raise
    config = PersistConfig(maintenance=False, retry_timeout_s=where.store_timeout_s)
    return PersistClient(blob, consensus, config=config, publisher=publisher)


@contextlib.contextmanager
def _shard(where: Location, name: str) -> Iterator[tuple[PersistClient, Shard]]:
    """The client and the existing shard ``name`` (CliError otherwise; nothing written)."""
    from pyspark_persist.state.client import validate_shard_name
    from pyspark_persist.state.errors import ShardNotFound

    validate_shard_name(name)
    client = open_client(where)
    try:
        try:
            shard = client.open_shard(name, create=False)
        except ShardNotFound:
            raise CliError(
                f"shard {name!r} does not exist in consensus {client.consensus.uri} "
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


def list_shards(where: Location) -> dict[str, Any]:
    """Every shard's summary, and the location (what ``shards list`` prints)."""
    from pyspark_persist.state.errors import ShardNotFound

    with contextlib.closing(open_client(where)) as client:
        names = client.list_shards()
        progress = Progress("reading shards", len(names))
        rows = []
        try:
            for name in names:
                with contextlib.suppress(ShardNotFound):  # dropped since it was listed
                    rows.append(shard_summary(client.open_shard(name, create=False).state()))
                progress.advance()
        finally:
            progress.close()
        return {"blob": client.blob.uri, "consensus": client.consensus.uri, "shards": rows}


def format_list(listing: dict[str, Any]) -> str:
    """The readable form of :func:`list_shards`."""
    rows = listing["shards"]
    if not rows:
        return f"no shards in consensus {listing['consensus']}"
    headers = ["NAME", "UPPER", "SINCE", "SEQNO", "BATCHES", "PARTS", "ROWS", "SIZE"]
    table = _table(
        [*headers, "READERS", "WRITERS"],
        [
            [*(r[h.lower()] for h in headers[:-1]), _size(r["bytes"]), r["readers"], r["writers"]]
            for r in rows
        ],
    )
    return f"{table}\n{len(rows)} shard(s) in consensus {listing['consensus']}"


def shard_history(where: Location, name: str, limit: int | None) -> dict[str, Any]:
    """The newest ``limit`` commits of ``name`` (what ``shards history`` prints), read-only."""
    with _shard(where, name) as (_client, shard):
        commits = shard.history()
        oldest = commits[0].seqno if commits else None
    kept = commits if limit is None else commits[-limit:] if limit else []
    return {
        "shard": name,
        "oldest_seqno": oldest,
        "commits": [c.to_dict() for c in reversed(kept)],
        "total": len(commits),
    }


def format_history(result: dict[str, Any]) -> str:
    """The readable form of :func:`shard_history`: newest first, one line per commit; a TXN
    column when some commit was part of a transaction across shards."""
    rows = result["commits"]
    if not rows:
        return f"shard {result['shard']!r}: no commits kept"
    txns = any(c.get("txn_id") for c in rows)
    table = _table(
        ["SEQNO", "OPERATION", "COMMITTED", "WRITER", "TIMES", "PARTS", "ADDED", "RETRACTED"]
        + (["TXN"] if txns else []),
        [
            [
                c["seqno"],
                c["operation"] + (f" +{c['columns_added']}" if c["columns_added"] else ""),
                "" if c["committed_ms"] is None else _iso(c["committed_ms"]),
                c["writer_id"] or "",
                f"[{c['lower']}, {c['upper']})",
                c["parts"],
                _history_sizes(c, "added"),
                _history_sizes(c, "retracted"),
            ]
            + ([c.get("txn_id") or ""] if txns else [])
            for c in rows
        ],
    )
    return (
        f"{table}\n{len(rows)} of {result['total']} commit(s) of shard {result['shard']!r} "
        f"(Consensus keeps them from SeqNo {result['oldest_seqno']} on; GC truncates older ones)"
    )


def _history_sizes(c: dict[str, Any], kind: str) -> str:
    """``rows (size)``, or for a compaction ``before -> after`` rows; mixed parts noted."""
    if c["operation"] == "compaction":
        return f"{c['rows_before']} -> {c['rows_after']} rows" if kind == "added" else ""
    text = f"{c[f'rows_{kind}']} ({_size(c[f'bytes_{kind}'])})"
    if kind == "added" and c["rows_mixed"]:
        text += f" + {c['rows_mixed']} mixed"
    return text


def _advertised_pubsub(consensus_uri: str) -> dict[str, Any] | None:
    """The ``pubsub=auto`` server advertised next to a SQLite Consensus, and if it answers."""
    from pyspark_persist.state.registry import sqlite_file

    db = sqlite_file(consensus_uri)
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
        "keys": list(state.keys),
        "upper": state.upper,
        "since": state.since,
        "seqno": state.seqno,
        "seqno_range": [first[0].seqno if first else state.seqno, state.seqno],
        "seqno_since": state.seqno_since,
        "last_gc_seqno": state.last_gc_seqno,
        "rollups": sorted(state.rollups),
        "created_ms": state.created_ms,
        "incarnation": state.incarnation,
        "retention_ms": state.retention_ms,
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
        f"shard      {info['name']} (incarnation {info['incarnation'] or '-'})",
        f"location   blob {info['blob']}",
        f"           consensus {info['consensus']}",
        f"schema     {', '.join(info['schema'])}",
        f"keys       {_keys(info['keys'])}",
        f"upper      {_time(info['upper'])}",
        f"since      {_time(info['since'])}",
        f"retention  {_retention(info['retention_ms'])}",
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


def _check_as_of(state: ShardState, as_of: int | None) -> int:
    """The time to read (default ``upper - 1``), refusing one the shard cannot answer."""
    from pyspark_persist.state.errors import InvalidFrontier
    from pyspark_persist.state.times import check_readable

    name = state.shard_id
    if state.upper == 0:
        raise CliError(f"shard {name!r} has no complete time yet (upper is 0): nothing to show")
    if as_of is None:
        return state.upper - 1
    try:
        return check_readable(as_of, state.since, state.upper, "--as-of", name)
    except InvalidFrontier as e:
        raise CliError(str(e)) from None


def read_as_of(shard: Shard, as_of: int | None) -> tuple[int, pa.Table]:
    """The shard's consolidated contents at ``as_of``, fetched part by part with a progress bar.

    Read-only: no reader is registered (that would write to Consensus), so
    nothing holds the parts. If GC deletes one meanwhile, the newer state no
    longer names it: read the state again and fetch its parts instead.
    """
    import pyarrow as pa

    from pyspark_persist.state import consolidate, iter_parts, plan_read
    from pyspark_persist.state.errors import PartNotFound
    from pyspark_persist.state.keyed import consolidate_keyed
    from pyspark_persist.state.schema import data_schema

    for _attempt in range(_SHOW_ATTEMPTS):
        state = shard.state()
        schema = shard.schema  # of that state: parts older than a column read null there
        at = _check_as_of(state, as_of)
        parts = plan_read(state, shard.client.blob.uri, as_of=at).parts
        progress = Progress(f"reading {shard.name}", len(parts))
        tables: list[pa.Table] = []
        try:
            for part in parts:
                tables.extend(iter_parts(shard.client.blob, [part], schema=schema))
                progress.advance()
        except PartNotFound:
            continue
        finally:
            progress.close()
        table = pa.concat_tables(tables) if tables else data_schema(schema).empty_table()
        if state.keys:  # (sums only the keys with a retraction, as a snapshot_table does)
            return at, consolidate_keyed(table, schema.names, state.keys)
        return at, consolidate(table, schema.names)
    raise CliError(
        f"shard {shard.name!r} kept changing under the read (its parts were compacted and "
        f"deleted {_SHOW_ATTEMPTS} times): try again, or with a later --as-of"
    )


_SHOW_ATTEMPTS = 5


def _retention(ms: int) -> str:
    """A retention period as people write it, with what it does."""
    from pyspark_persist.state.retention import format_retention

    if ms <= 0:
        return "none (only readers advance since)"
    return f"{format_retention(ms)} (since follows the clock, held back by readers)"


def _keys(keys: list[str]) -> str:
    """A shard's key columns as ``inspect`` and ``show`` print them."""
    return f"{', '.join(keys)} (every write upserts by them)" if keys else "none (unkeyed)"


def show(where: Location, name: str, as_of: int | None, limit: int | None) -> dict[str, Any]:
    """The consolidated contents of ``name`` at ``as_of`` (what ``shards show`` prints)."""
    with _shard(where, name) as (_client, shard):
        at, table = read_as_of(shard, as_of)
        retention_ms = shard.machine.state().retention_ms
        keys = list(shard.machine.state().keys)
    shown = table.slice(0, limit) if limit is not None else table
    return {
        "shard": name,
        "keys": keys,
        "retention_ms": retention_ms,
        "as_of": at,
        "total_rows": table.num_rows,
        "columns": shown.column_names,
        "rows": shown.to_pylist(),
    }


def format_show(result: dict[str, Any]) -> str:
    """The readable form of :func:`show`."""
    rows, total = result["rows"], result["total_rows"]
    lines = [_table(result["columns"], [list(r.values()) for r in rows])] if rows else []
    more = f", showing {len(rows)} (--limit)" if len(rows) < total else ""
    lines.append(
        f"shard {result['shard']!r} as of {_time(result['as_of'])}: {total} distinct "
        f"(row, time) with a non-zero diff{more}"
    )
    if result["keys"]:
        lines.append(f"keys {_keys(result['keys'])}")
    if result["retention_ms"]:
        lines.append(f"retention {_retention(result['retention_ms'])}")
    return "\n".join(lines)


def compact(where: Location, name: str, *, dry_run: bool) -> dict[str, Any]:
    """Rounds of compaction until the policy is satisfied, or (``dry_run``) their plan."""
    from pyspark_persist.state.maintenance import compact as run_compaction
    from pyspark_persist.state.maintenance_policy import compaction_plan, compaction_request

    with _shard(where, name) as (client, shard):
        started = time.monotonic()
        before = shard.state()
        if dry_run:
            merges = [
                {
                    "batches": len(m),
                    "lower": m[0].lower,
                    "upper": m[-1].upper,
                    "parts": sum(len(b.parts) for b in m),
                    "rows": sum(b.rows for b in m),
                    "bytes": sum(b.size_bytes for b in m),
                }
                for m in compaction_plan(before, client.config, settle=True)
            ]
            return {
                "shard": name,
                "dry_run": True,
                "batches": len(before.batches),
                "merges": merges,
            }
        progress = Progress(f"compacting {shard.name}", len(before.batches))
        reports = []
        state = before
        try:
            for _ in range(1000):
                request = compaction_request(state, client.config, settle=True)
                if request is None:
                    break
                reports.append(run_compaction(shard.machine, request))
                state = shard.state()
                progress.update(len(before.batches) - len(state.batches))
        finally:
            progress.close()
    return {
        "shard": name,
        "rounds": len(reports),
        "applied": sum(1 for r in reports if r.applied),
        "batches_before": len(before.batches),
        "batches_after": len(state.batches),
        "rows_in": sum(r.rows_in for r in reports),
        "rows_out": sum(r.rows_out for r in reports),
        "seconds": round(time.monotonic() - started, 3),
    }


def format_compact(result: dict[str, Any]) -> str:
    """The readable form of :func:`compact`."""
    name = result["shard"]
    if result.get("dry_run"):
        merges = result["merges"]
        if not merges:
            return f"shard {name!r}: nothing to compact ({result['batches']} batches)"
        lines = [
            f"  merge {m['batches']} batches [{m['lower']}, {m['upper']}): {m['parts']} parts, "
            f"{m['rows']} rows, {_size(m['bytes'])}"
            for m in merges
        ]
        return "\n".join(
            [
                f"shard {name!r}: compaction would run {len(merges)} merge(s) of its "
                f"{result['batches']} batches (dry run: nothing changed)",
                *lines,
            ]
        )
    if not result["rounds"]:
        return f"shard {name!r}: nothing to compact ({result['batches_before']} batches)"
    return (
        f"shard {name!r}: {result['rounds']} compaction(s) ({result['applied']} "
        f"applied), batches {result['batches_before']} -> {result['batches_after']}, "
        f"rows {result['rows_in']} -> {result['rows_out']}, in {result['seconds']:.2f} s"
    )


def gc(where: Location, name: str, *, dry_run: bool) -> dict[str, Any]:
    """One full GC pass including the orphan sweep, or (``dry_run``) what it would delete."""
    from pyspark_persist.state.maintenance import plan_gc

    with _shard(where, name) as (_client, shard):
        started = time.monotonic()
        if dry_run:
            plan = plan_gc(shard.machine)
            return {
                "shard": name,
                "dry_run": True,
                "seqno_since": plan.seqno_since,
                "readers_expired": list(plan.readers_expired),
                "parts": list(plan.parts),
                "rollups": list(plan.rollups),
                "consensus_rows": plan.consensus_rows,
                "orphans": list(plan.orphans),
            }
        if _progress_enabled():
            print(f"collecting garbage of {shard.name} ...", end="", file=sys.stderr, flush=True)
        report = shard.gc()
        if _progress_enabled():
            print(" done", file=sys.stderr, flush=True)
    return {
        "shard": name,
        "seqno_since": report.seqno_since,
        "parts_deleted": report.parts_deleted,
        "rollups_deleted": report.rollups_deleted,
        "consensus_rows_deleted": report.consensus_rows_deleted,
        "orphans_deleted": report.orphans_deleted,
        "readers_expired": list(report.readers_expired),
        "writers_expired": list(report.writers_expired),
        "seconds": round(time.monotonic() - started, 3),
    }


def format_gc(result: dict[str, Any]) -> str:
    """The readable form of :func:`gc`."""
    name = result["shard"]
    if result.get("dry_run"):
        lines = [
            f"shard {name!r}: gc up to SeqNo {result['seqno_since']} would delete "
            f"{len(result['parts'])} part(s), {len(result['rollups'])} rollup(s), about "
            f"{result['consensus_rows']} consensus row(s), {len(result['orphans'])} orphan(s); "
            f"expire {len(result['readers_expired'])} reader(s) (dry run: nothing changed)"
        ]
        lines += [f"  reader {r}" for r in result["readers_expired"]]
        lines += [f"  part {k}" for k in result["parts"]]
        lines += [f"  rollup at SeqNo {s}" for s in result["rollups"]]
        lines += [f"  orphan {k}" for k in result["orphans"]]
        return "\n".join(lines)
    return (
        f"shard {name!r}: gc up to SeqNo {result['seqno_since']} deleted "
        f"{result['parts_deleted']} part(s), {result['rollups_deleted']} rollup(s), "
        f"{result['consensus_rows_deleted']} consensus row(s), {result['orphans_deleted']} "
        f"orphan(s); expired {len(result['readers_expired'])} reader(s), "
        f"{len(result.get('writers_expired', []))} idle writer(s); in {result['seconds']:.2f} s"
    )


def alter(where: Location, name: str, *, retention_ms: int) -> dict[str, Any]:
    """Set ``name``'s retention period (what ``shards alter`` does); since moves at the next GC."""
    with _shard(where, name) as (_client, shard):
        before = shard.machine.fetch_latest().retention_ms
        after = shard.set_retention(retention_ms)
        since = shard.since
    return {"shard": name, "retention_ms": after, "previous_retention_ms": before, "since": since}


def format_alter(result: dict[str, Any]) -> str:
    """The readable form of :func:`alter`."""
    return (
        f"shard {result['shard']!r}: retention {_retention(result['retention_ms'])}, was "
        f"{_retention(result['previous_retention_ms']).split(' ')[0]}; since is "
        f"{_time(result['since'])} (GC advances it)"
    )


def drop(where: Location, name: str, *, yes: bool, force: bool) -> dict[str, Any]:
    """Delete shard ``name`` (see :mod:`pyspark_persist.state.drop`), after a confirmation.

    Refuses, before asking or writing anything, while readers hold the shard
    and ``force`` is not set; asks on stderr, reading the answer from stdin,
    unless ``yes``.
    """
    from pyspark_persist.state.drop import drop_shard, holders

    with _shard(where, name) as (client, shard):
        state = shard.machine.fetch_latest()
        now = shard.machine.clock_ms()
        held = holders(state, now)
        if held and not force:
            raise CliError(
                f"shard {name!r} is in use by reader(s) {', '.join(held)}: stop them (a leased "
                f"reader's hold ends when its lease runs out; see persist shards inspect {name}), "
                "or pass --force to drop it anyway and let them fail"
            )
        if not yes:
            summary = shard_summary(state)
            question = (
                f"Drop shard {name!r} ({summary['batches']} batches, {summary['rows']} rows, "
                f"{_size(summary['bytes'])}) from consensus {client.consensus.uri} and blob "
                f"{client.blob.uri}? This deletes it for good"
            )
            try:
                confirmed = click.confirm(question, default=False, err=True)
                if not sys.stdin.isatty():  # a piped answer is not echoed: end the line
                    print(file=sys.stderr)
            except click.exceptions.Abort:  # end of input, or Ctrl-C at the prompt
                print(file=sys.stderr)
                confirmed = False
            if not confirmed:
                raise CliError(f"shard {name!r} was not dropped: answer y, or pass --yes")
        report = drop_shard(client.consensus, client.blob, name, now_ms=now, force=force)
        shard.machine.shared.forget()  # this process's handles must not see the old state
    return {
        "shard": name,
        "consensus_rows_deleted": report.consensus_rows,
        "blob_objects_deleted": report.blob_objects,
        "blob_bytes_deleted": report.blob_bytes,
        "readers": list(report.readers),
    }


def format_drop(result: dict[str, Any]) -> str:
    """The readable form of :func:`drop`."""
    forced = f"; reader(s) {', '.join(result['readers'])} lost it" if result["readers"] else ""
    return (
        f"dropped shard {result['shard']!r}: deleted {result['consensus_rows_deleted']} "
        f"consensus row(s) and {result['blob_objects_deleted']} blob object(s) "
        f"({_size(result['blob_bytes_deleted'])}){forced}"
    )


def tail_events(shard: Shard, reader: ReadHandle, after: int | None) -> Iterator[ListenEvent]:
    """Every batch committed after time ``after``, forever; with ``after`` None (the shard
    had nothing complete yet), from the first commit on, starting with everything in it."""
    if after is not None:
        yield from reader.listen(after)
        return
    state = shard.state()
    while state.upper == 0:
        time.sleep(shard.client.config.listen_poll_max_s)
        state = shard.machine.fetch_latest()
    yield from reader.subscribe(state.upper - 1)


def tail(where: Location, name: str, as_of: int | None, as_json: bool) -> int:
    """Print each change of ``name`` as it commits until interrupted (then exit 0).

    One line per update, in time order within each batch: ``TIME +DIFF
    col=value ...``, or with ``as_json`` one JSON object of the row's columns
    with ``_time`` and ``_diff``. A reader holds what is still to print
    against GC while it runs and is expired on the way out; a bad ``as_of``
    is refused before it is registered.
    """
    with _shard(where, name) as (_client, shard):
        state = shard.state()
        after = None if as_of is None and state.upper == 0 else _check_as_of(state, as_of)
        reader = shard.reader(f"tail-{uuid.uuid4().hex[:12]}")
        try:
            for event in tail_events(shard, reader, after):
                table = reader.fetch(event.parts).sort_by("_time")
                for row in table.to_pylist():
                    print(_tail_line(row, as_json), flush=True)
        except KeyboardInterrupt:
            pass
        finally:
            reader.close()
    return 0


def _tail_line(row: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(row, default=str)
    at, diff = row.pop("_time"), row.pop("_diff")
    return f"{at} {diff:+d} " + " ".join(f"{k}={v!r}" for k, v in row.items())


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
    """Run ``module``'s command: its ``add_arguments`` flags parsed here from ``argv`` (one
    line per error), then its ``run_from_args``."""
    mod = _import_optional(module, what)
    parser = _ArgParser(prog=prog, description=(mod.__doc__ or "").split("\n\n")[0])
    mod.add_arguments(parser)
    return int(mod.run_from_args(parser.parse_args(list(argv))) or 0)


# --------------------------------------------------------------------------- the commands

CONTEXT = {"help_option_names": ["-h", "--help"], "max_content_width": 100}
PASSTHROUGH = {**CONTEXT, "ignore_unknown_options": True, "help_option_names": []}


def _remember(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Keep a location flag in the context's meta (shared by the command chain), so one given
    after the command overrides one given before it."""
    if value is not None:
        ctx.meta[f"persist.{param.name}"] = value


def _location_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--blob``, ``--consensus`` and ``--pubsub``, on the root and on each shards command."""
    for name, metavar, help_text in reversed(LOCATION_FLAGS):
        f = click.option(
            f"--{name}",
            metavar=metavar,
            default=None,
            expose_value=False,
            callback=_remember,
            help=help_text,
        )(f)
    return f


LOCATION_FLAGS = (
    (
        "blob",
        "URI",
        "Blob URI: file:///dir, s3://bucket/prefix, mem://name "
        "(default: the embedded default under $PERSIST_HOME)",
    ),
    (
        "consensus",
        "URI",
        "Consensus URI: sqlite:///file.db, postgresql://..., mem://name "
        "(default: the embedded default under $PERSIST_HOME)",
    ),
    (
        "pubsub",
        "SPEC",
        "PubSub of this command's client: off (default), host:port, auto or postgres",
    ),
)


def _where() -> Location:
    """The location of this command: its own flags, else those given before the command."""
    meta = click.get_current_context().meta
    return Location(
        blob=meta.get("persist.blob"),
        consensus=meta.get("persist.consensus"),
        pubsub=meta.get("persist.pubsub"),
        store_timeout_s=meta.get("persist.store_timeout", Location.store_timeout_s),
    )


def _bounded(f: Callable[..., int]) -> Callable[..., int]:
    """Run a command that ends by itself within ``--store-timeout`` of store retries in all: a
    store that stays unreachable fails it with one line (store, operation, wait, fix).

    The store watchdog's own warnings (a store failing for 5 s, recovered, given up) would only
    repeat that line, so they are kept for ``-v``: a command prints one error line, not three.
    """

    @functools.wraps(f)
    def command(*args: Any, **kwargs: Any) -> int:
        from pyspark_persist.state.retry import deadline_in

        watchdog = logging.getLogger("pyspark_persist.state.retry")
        level = watchdog.level
        if not click.get_current_context().meta.get("persist.logs"):
            watchdog.setLevel(logging.ERROR)
        try:
            with deadline_in(_where().store_timeout_s):
                return f(*args, **kwargs)
        finally:
            watchdog.setLevel(level)

    return command


def _emit(result: dict[str, Any], as_json: bool, text: Callable[[dict[str, Any]], str]) -> int:
    if as_json:
        _print_json(result)
    else:
        print(text(result))
    return 0


JSON_HELP = "print JSON instead of text"


class _TimeParam(click.ParamType):
    """A time as every entry point takes one: epoch ms, ``YYYY-MM-DD`` or ISO-8601."""

    name = "time"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """The time in milliseconds, or click's usage error (exit 2) naming the forms."""
        from pyspark_persist.state.errors import InvalidUsage
        from pyspark_persist.state.times import parse_time

        try:
            return parse_time(value if isinstance(value, int) else str(value), "--as-of")
        except InvalidUsage as e:
            self.fail(str(e), param, ctx)


class _RetentionParam(click.ParamType):
    """A retention period: ``7d``, ``12h``, ``30m``, ``45s``, ``500ms``, ``2w`` or milliseconds."""

    name = "duration"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        """The period in milliseconds, or click's usage error (exit 2) naming the forms."""
        from pyspark_persist.state.errors import InvalidUsage
        from pyspark_persist.state.retention import parse_retention

        try:
            return parse_retention(
                value if isinstance(value, int) else str(value), name="--retention"
            )
        except InvalidUsage as e:
            self.fail(str(e), param, ctx)


def _as_of_option(help_text: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--as-of T``, a time (``show`` reads at it, ``tail`` prints what comes after it)."""
    return click.option(
        "--as-of",
        type=_TimeParam(),
        default=None,
        metavar="T",
        help=help_text + "; epoch ms, YYYY-MM-DD or ISO-8601",
    )


@click.group(
    context_settings=CONTEXT,
    no_args_is_help=False,
    help="pyspark-persist: durable shards of (row, time, diff). Inspect, read, follow and "
    "maintain shards; serve PubSub; run the benchmarks and the consistency checker.",
)
@_location_options
@click.option(
    "-v",
    "--verbose",
    count=True,
    help="print persist's logs on stderr as key=value lines: -v from INFO, -vv from DEBUG "
    "(default: warnings only; also $PERSIST_LOG_LEVEL, and $PERSIST_LOG_FORMAT=json)",
)
@click.version_option(
    package_name="pyspark-persist", prog_name="persist", message="%(prog)s %(version)s"
)
@click.option(
    "--store-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=Location.store_timeout_s,
    show_default=True,
    metavar="SECONDS",
    help="how long the shards commands retry a Blob or Consensus store that cannot be reached "
    "before failing",
)
def cli(verbose: int, store_timeout: float) -> None:
    """The root: its location flags are remembered for the command (see :func:`_where`), and
    logs are switched on when asked."""
    meta = click.get_current_context().meta
    meta["persist.store_timeout"] = store_timeout
    level = ("INFO", "DEBUG")[min(verbose, 2) - 1] if verbose else os.environ.get(LOG_LEVEL_ENV)
    if level:
        _configure_logs(level)
        meta["persist.logs"] = True


LOG_LEVEL_ENV = "PERSIST_LOG_LEVEL"
"""Read here as well as by ``pyspark_persist.state.logs``, so that a run without it does not
import the shard core before it needs to."""


def _configure_logs(level: str) -> None:
    """Persist's logs on stderr from ``level``; a bad level or format is bad usage (exit 2)."""
    import warnings

    with warnings.catch_warnings():  # the import's own check of the environment is repeated
        warnings.simplefilter("ignore")
        from pyspark_persist.state.errors import InvalidUsage
        from pyspark_persist.state.logs import FORMAT_ENV, configure
    try:
        configure(level, os.environ.get(FORMAT_ENV, "kv").strip().lower() or "kv")
    except InvalidUsage as e:
        raise UsageError(str(e)) from None


@cli.group(context_settings=CONTEXT, no_args_is_help=False)
def shards() -> None:
    """List, inspect, read, follow, maintain and drop shards."""


@shards.command("list")
@_location_options
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@_bounded
def shards_list(as_json: bool) -> int:
    """List every shard with its frontiers, size, readers and writers."""
    return _emit(list_shards(_where()), as_json, format_list)


def _inspect_command(name: str, help_text: str, short_help: str) -> click.Command:
    @click.command(name, help=help_text, short_help=short_help, context_settings=CONTEXT)
    @_location_options
    @click.argument("name", metavar="NAME")
    @click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
    @_bounded
    def command(name: str, as_json: bool) -> int:
        where = _where()
        with _shard(where, name) as (client, shard):
            info = inspect_shard(client, shard, where.pubsub)
        return _emit(info, as_json, format_inspect)

    return command


INSPECT_SHORT = "Show a shard's frontiers, SeqNos, batches, readers, writers."
INSPECT_HELP = (
    "Show a shard's frontiers (with UTC dates), SeqNo range, rollups, batches, readers "
    "(holds and lease expiry), writers and PubSub."
)
shards.add_command(_inspect_command("inspect", INSPECT_HELP, INSPECT_SHORT))
cli.add_command(
    _inspect_command(
        "inspect",
        "The same as persist shards inspect. " + INSPECT_HELP,
        "The same as persist shards inspect.",
    )
)


@shards.command("show", short_help="Print a shard's contents as of a time.")
@_location_options
@click.argument("name", metavar="NAME")
@_as_of_option("the time to read (default: upper - 1, the latest complete time)")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=SHOW_LIMIT,
    metavar="N",
    show_default=True,
    help="rows to print",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@_bounded
def shards_show(name: str, as_of: int | None, limit: int, as_json: bool) -> int:
    """Print a shard's contents as of a time, consolidated: each distinct (row, time) with its
    non-zero diff."""
    result = show(_where(), name, as_of, limit)
    if as_json:
        del result["columns"]
    return _emit(result, as_json, format_show)


@shards.command("history", short_help="List a shard's commits, newest first.")
@_location_options
@click.argument("name", metavar="NAME")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=None,
    metavar="N",
    help="print the newest N commits (default: all Consensus keeps)",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def shards_history(name: str, limit: int | None, as_json: bool) -> int:
    """List a shard's commits, newest first: SeqNo, operation (create, append, overwrite,
    compaction), commit time, writer, the times it covers, rows and bytes added and retracted.
    Read from the state diffs Consensus keeps: GC truncates those below the oldest SeqNo a
    reader holds, so older commits are no longer listed (their data stays, compacted)."""
    return _emit(shard_history(_where(), name, limit), as_json, format_history)


@shards.command("tail", short_help="Follow a shard's changes as they commit.")
@_location_options
@click.argument("name", metavar="NAME")
@_as_of_option("print the changes after this time (default: those committed from now on)")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="one JSON object per change: the row's columns, _time and _diff",
)
def shards_tail(name: str, as_of: int | None, as_json: bool) -> int:
    """Follow a shard: print each change as it commits, until Ctrl-C. With --pubsub, changes
    are pushed to it; otherwise it polls Consensus."""
    return tail(_where(), name, as_of, as_json)


@shards.command("compact")
@_location_options
@click.argument("name", metavar="NAME")
@click.option("--dry-run", is_flag=True, help="show the merges it would run; change nothing")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@_bounded
def shards_compact(name: str, dry_run: bool, as_json: bool) -> int:
    """Run compaction now, until the policy asks for nothing more."""
    result = compact(_where(), name, dry_run=dry_run)
    return _emit(result, as_json, format_compact)


@shards.command("gc", short_help="Run garbage collection now.")
@_location_options
@click.argument("name", metavar="NAME")
@click.option("--dry-run", is_flag=True, help="show what it would delete; change nothing")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@_bounded
def shards_gc(name: str, dry_run: bool, as_json: bool) -> int:
    """Run garbage collection now: expire stale readers, delete garbage, truncate Consensus,
    sweep orphans."""
    return _emit(gc(_where(), name, dry_run=dry_run), as_json, format_gc)


@shards.command("alter", short_help="Change a shard's settings (its retention period).")
@_location_options
@click.argument("name", metavar="NAME")
@click.option(
    "--retention",
    type=_RetentionParam(),
    required=True,
    metavar="DURATION",
    help="keep since at most this far behind the clock: 7d, 12h, 30m, 45s, 500ms or "
    "milliseconds; 0 or off: no retention",
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@_bounded
def shards_alter(name: str, retention: int, as_json: bool) -> int:
    """Change a shard's retention period. With one, GC advances since to now minus the period
    even when nobody reads, so compaction folds old versions away and storage stays bounded;
    since never passes a registered reader's hold. A longer period cannot bring back what since
    already passed."""
    return _emit(alter(_where(), name, retention_ms=retention), as_json, format_alter)


@shards.command("drop", short_help="Delete a shard for good (asks first).")
@_location_options
@click.argument("name", metavar="NAME")
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation")
@click.option(
    "--force", is_flag=True, help="drop even while readers hold the shard (they will fail)"
)
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
def shards_drop(name: str, yes: bool, force: bool, as_json: bool) -> int:
    """Delete a shard for good: every Consensus row and Blob object of it. Asks first (--yes
    does not); refuses while readers hold it (--force drops anyway). Stop its writers first."""
    result = drop(_where(), name, yes=yes, force=force)
    return _emit(result, as_json, format_drop)


@cli.group(context_settings=CONTEXT, no_args_is_help=False, short_help="The PubSub server.")
def pubsub() -> None:
    """Push committed state diffs between processes (see persist pubsub serve --help)."""


@pubsub.command(
    "serve",
    context_settings=PASSTHROUGH,
    add_help_option=False,
    short_help="Serve PubSub in the foreground until interrupted.",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def pubsub_serve(args: tuple[str, ...]) -> int:
    """Serve persist PubSub in the foreground until interrupted."""
    from pyspark_persist.pubsub.__main__ import add_serve_arguments, serve_parsed

    parser = _ArgParser(
        prog="persist pubsub serve",
        description="Serve persist PubSub in the foreground until interrupted: processes "
        "reading with pubsub=host:port get each committed state diff pushed to them.",
    )
    add_serve_arguments(parser)
    return serve_parsed(parser.parse_args(list(args)))


class _Benchmarks(click.Group):
    """``persist bench NAME``: one passthrough command per entry of the benchmarks' table
    (:data:`pyspark_persist.tools.bench.BENCHMARKS`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        """Every benchmark, in the table's order."""
        return list(BENCHMARKS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The benchmark ``cmd_name``, whose flags its options declare (imported only when it
        runs)."""
        if cmd_name not in BENCHMARKS:
            return None
        module, help_text = BENCHMARKS[cmd_name]

        @click.command(
            cmd_name,
            context_settings=PASSTHROUGH,
            add_help_option=False,
            help=help_text,
            short_help=help_text,
        )
        @click.argument("args", nargs=-1, type=click.UNPROCESSED)
        def run(args: tuple[str, ...]) -> int:
            mod = _import_optional(
                f"pyspark_persist.tools.bench.{module}", f"benchmark {cmd_name!r}"
            )
            benchmark = mod.BENCHMARK
            parser = _ArgParser(prog=f"persist bench {cmd_name}", description=benchmark.about)
            return int(benchmark.main(args, parser))

        return run


@cli.group(cls=_Benchmarks, context_settings=CONTEXT, no_args_is_help=False)
def bench() -> None:
    """Benchmarks of persist. Flags after the benchmark's name are its own: see persist bench
    NAME --help."""


@cli.command(
    "check",
    context_settings=PASSTHROUGH,
    add_help_option=False,
    short_help="Check no committed update is lost or doubled, under faults.",
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def check(args: tuple[str, ...]) -> int:
    """The consistency checker (see persist check --help)."""
    given = _where()
    location = [*("--blob", given.blob)] if given.blob else []
    location += [*("--consensus", given.consensus)] if given.consensus else []
    return _delegate(
        "pyspark_persist.tools.checker", "persist check", "persist check", [*location, *args]
    )


# --------------------------------------------------------------------------- entry point


def _usage_line(e: click.UsageError) -> str:
    path = e.ctx.command_path if e.ctx is not None else "persist"
    return f"{path}: {e.format_message()} (see {path} --help)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``persist`` console script; returns the exit status."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        with cli.make_context("persist", args) as ctx:
            return int(cli.invoke(ctx) or 0)
    except click.exceptions.Exit as e:  # --help, --version
        return e.exit_code
    except click.UsageError as e:
        print(f"persist: error: {_usage_line(e)}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"persist: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, click.exceptions.Abort):
        print("persist: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line, whatever failed
        text = str(e).strip().splitlines()
        detail = text[0] if text else type(e).__name__
        print(f"persist: error: {detail}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
