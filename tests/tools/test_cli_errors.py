"""Every ``persist`` command fails the same way: exit non-zero, ONE line on stderr naming the
problem and the fix, no traceback, nothing on stdout, nothing written.

One table over the commands: bad input, a missing shard, an unreachable store. Another test
walks the command tree, so a new command without a row here fails. The unreachable-store rows
run as a user runs them, in a fresh interpreter with Python's logging defaults, since that is
where the store watchdog's warnings would add lines; the rest run in-process (fast).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import click
import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.tools import cli

UNREACHABLE_PG = "postgresql://nobody@127.0.0.1:1/persist"
"""Nothing listens on port 1: connections are refused at once."""
UNREACHABLE_S3 = "s3://bucket?endpoint_url=http://127.0.0.1:1&region=us-east-1"
STORE_TIMEOUT = ("--store-timeout", "1")


class Case(NamedTuple):
    argv: tuple[str, ...]
    code: int
    problem: str
    fix: str


MISSING = "shard 'nope' does not exist in consensus"
SEE_LIST = "(see persist shards list)"
PG_DOWN = f"consensus store {UNREACHABLE_PG} unavailable while"
PG_FIX = "is PostgreSQL running and reachable? check host, port, database and user"

CASES: dict[str, Case] = {
    # a missing shard
    "list-typo-home": Case(
        ("--consensus", "sqlite:///{tmp}/typo.db", "shards", "list"),
        1,
        "does not exist (no file",
        "check --consensus/--blob, or $PERSIST_HOME",
    ),
    "inspect-missing": Case(("inspect", "nope"), 1, MISSING, SEE_LIST),
    "shards-inspect-missing": Case(("shards", "inspect", "nope"), 1, MISSING, SEE_LIST),
    "show-missing": Case(("shards", "show", "nope"), 1, MISSING, SEE_LIST),
    "tail-missing": Case(("shards", "tail", "nope"), 1, MISSING, SEE_LIST),
    "compact-missing": Case(("shards", "compact", "nope", "--dry-run"), 1, MISSING, SEE_LIST),
    "gc-missing": Case(("shards", "gc", "nope"), 1, MISSING, SEE_LIST),
    "drop-missing": Case(("shards", "drop", "nope", "--yes"), 1, MISSING, SEE_LIST),
    # bad input
    "list-extra": Case(
        ("shards", "list", "extra"),
        2,
        "unexpected extra argument",
        "see persist shards list --help",
    ),
    "bad-name": Case(
        ("inspect", "../x"), 1, "invalid shard name '../x'", "use 1-200 letters, digits"
    ),
    "bad-scheme": Case(
        ("shards", "gc", "events", "--blob", "ftp://x"), 1, "unknown blob scheme", "file://"
    ),
    "show-as-of": Case(
        ("shards", "show", "events", "--as-of", "99999999999999"),
        1,
        "is at or past the upper",
        "pick a time from 0 to",
    ),
    "tail-as-of": Case(
        ("shards", "tail", "events", "--as-of", "x"),
        2,
        "--as-of='x' is not a time: give epoch milliseconds",
        "see persist shards tail --help",
    ),
    "history-missing": Case(("shards", "history", "nope"), 1, MISSING, SEE_LIST),
    "txns-list-missing": Case(("txns", "list", "events", "nope"), 1, MISSING, SEE_LIST),
    "txns-show-unknown": Case(
        ("txns", "show", "0123abcd", "events"),
        1,
        "transaction '0123abcd' is in the kept history of none of events",
        "name a shard it wrote (persist txns list SHARD... lists them)",
    ),
    "alter-retention": Case(
        ("shards", "alter", "events", "--retention", "7 days"),
        2,
        "is not a duration",
        "see persist shards alter --help",
    ),
    "compact-flag": Case(
        ("shards", "compact", "events", "--yes"),
        2,
        "No such option '--yes'",
        "see persist shards compact --help",
    ),
    "drop-in-use": Case(
        ("shards", "drop", "events", "--yes"),
        1,
        "is in use by reader(s) r1",
        "or pass --force",
    ),
    "store-timeout": Case(
        ("--store-timeout", "0", "shards", "list"),
        2,
        "0.0 is not in the range",
        "see persist --help",
    ),
    "serve-remote": Case(
        ("pubsub", "serve", "--host", "0.0.0.0", "--port", "0"),
        1,
        "refusing to serve persist PubSub on non-loopback address '0.0.0.0'",
        "(--allow-remote)",
    ),
    "serve-tls-file": Case(
        ("pubsub", "serve", "--tls-cert", "{tmp}/no.pem", "--tls-key", "{tmp}/no.key"),
        1,
        "cannot read the PubSub TLS certificate or key: No such file or directory",
        "--tls-cert and --tls-key name PEM files",
    ),
    "serve-port-taken": Case(
        ("pubsub", "serve", "--port", "{busy}"),
        1,
        "cannot serve persist PubSub on 127.0.0.1:",
        "pick another with --port",
    ),
    "serve-metrics-taken": Case(
        ("pubsub", "serve", "--port", "0", "--metrics-port", "{busy}"),
        1,
        "cannot serve PubSub metrics on 127.0.0.1:",
        "pick another with --metrics-port",
    ),
    "consumers-list-missing": Case(("consumers", "list", "nope"), 1, MISSING, SEE_LIST),
    "consumers-show-unknown": Case(
        ("consumers", "show", "events", "to-pg"),
        1,
        "shard 'events' has no consumer 'to-pg' (its consumers: none)",
        "check the name (persist consumers list SHARD)",
    ),
    "consumers-reset-unknown": Case(
        ("consumers", "reset", "events", "to-pg", "--to-time", "1"),
        1,
        "has no consumer 'to-pg'",
        "or start a query with .option('consumer', 'to-pg') to create it",
    ),
    "consumers-reset-target": Case(
        ("consumers", "reset", "events", "to-pg"),
        2,
        "give exactly one of --to-time T and --to-seqno N",
        "see persist consumers reset --help",
    ),
    "consumers-drop-name": Case(
        ("consumers", "drop", "events", "to pg"),
        2,
        "invalid consumer name 'to pg'",
        "use 1 to 128 letters, digits, '-', '_' or '.'",
    ),
    "serve-consumer-lag": Case(
        ("pubsub", "serve", "--port", "0", "--consumer-lag"),
        1,
        "--consumer-lag exports the lag on the metrics endpoint",
        "give --metrics-port too",
    ),
    "bench-name": Case(("bench", "nope"), 2, "No such command 'nope'", "see persist bench --help"),
    "bench-flag": Case(
        ("bench", "core", "--nope"),
        2,
        "unrecognized arguments: --nope",
        "see persist bench core --help",
    ),
    "check-backend": Case(
        ("check", "--backend", "nope"), 2, "invalid choice: 'nope'", "see persist check --help"
    ),
    "command": Case(("frobnicate",), 2, "No such command 'frobnicate'", "see persist --help"),
}

UNREACHABLE: dict[str, Case] = {
    "list-pg": Case(
        (*STORE_TIMEOUT, "--consensus", UNREACHABLE_PG, "shards", "list"), 1, PG_DOWN, PG_FIX
    ),
    "inspect-pg": Case(
        (*STORE_TIMEOUT, "--consensus", UNREACHABLE_PG, "inspect", "events"), 1, PG_DOWN, PG_FIX
    ),
    "tail-pg": Case(
        (*STORE_TIMEOUT, "--consensus", UNREACHABLE_PG, "shards", "tail", "events"),
        1,
        PG_DOWN,
        PG_FIX,
    ),
    "gc-pg": Case(
        (*STORE_TIMEOUT, "--consensus", UNREACHABLE_PG, "shards", "gc", "events"),
        1,
        PG_DOWN,
        PG_FIX,
    ),
    "consumers-pg": Case(
        (*STORE_TIMEOUT, "--consensus", UNREACHABLE_PG, "consumers", "list", "events"),
        1,
        PG_DOWN,
        PG_FIX,
    ),
    "show-s3": Case(
        (*STORE_TIMEOUT, "--blob", UNREACHABLE_S3, "shards", "show", "events"),
        1,
        "S3 head_bucket of s3://bucket/ at http://127.0.0.1:1 failed",
        "is the S3 endpoint up and reachable? check endpoint_url and region",
    ),
}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The embedded default with shard ``events`` (two commits) and a reader ``r1`` on it."""
    home = tmp_path / "home"
    monkeypatch.setenv("PERSIST_HOME", str(home))
    client = PersistClient.open(config=PersistConfig(maintenance=False))
    shard = client.open_shard("events", pa.schema([("id", pa.int64())]))
    writer = shard.writer()
    writer.append(pa.table({"id": [1]}))
    writer.append(pa.table({"id": [2]}))
    shard.reader("r1")
    client.close()
    yield home


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port something else is listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


def stored(home: Path) -> list[str]:
    """Every file of the location, with its size (a write changes one)."""
    return sorted(f"{p.relative_to(home)}:{p.stat().st_size}" for p in home.rglob("*"))


def expand(argv: tuple[str, ...], tmp: Path, busy: int) -> list[str]:
    return [a.replace("{tmp}", str(tmp)).replace("{busy}", str(busy)) for a in argv]


def check_one_line(case: Case, code: int, out: str, err: str) -> None:
    assert code == case.code, err
    assert out == ""
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("persist: error: "), err
    assert case.problem in err and case.fix in err, err


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_input_and_missing_shards(
    home: Path,
    tmp_path: Path,
    busy_port: int,
    capsys: pytest.CaptureFixture[str],
    case: Case,
) -> None:
    before = stored(home)
    code = cli.main(expand(case.argv, tmp_path, busy_port))
    out, err = capsys.readouterr()
    check_one_line(case, code, out, err)
    assert stored(home) == before, "nothing written"
    assert not (tmp_path / "typo.db").exists()


@pytest.mark.parametrize("case", UNREACHABLE.values(), ids=UNREACHABLE.keys())
def test_unreachable_stores(home: Path, tmp_path: Path, case: Case) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PERSIST_LOG", "AWS_"))}
    env.update(PERSIST_HOME=str(home), AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test")
    done = subprocess.run(
        [sys.executable, "-m", "pyspark_persist.tools.cli", *case.argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    check_one_line(case, done.returncode, done.stdout, done.stderr)


def command_paths(group: click.Group, prefix: str = "") -> Iterator[str]:
    """Every command's path under ``group`` (one benchmark stands for all: they share a parser)."""
    ctx = click.Context(group)
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        path = f"{prefix}{name}"
        if isinstance(command, click.Group) and name != "bench":
            yield from command_paths(command, path + " ")
        else:
            yield path


def test_every_command_is_in_the_table() -> None:
    rows = [case.argv for case in (*CASES.values(), *UNREACHABLE.values())]

    def covered(path: str) -> bool:
        words = path.split()
        return any(
            list(argv[i : i + len(words)]) == words for argv in rows for i in range(len(argv))
        )

    assert [path for path in command_paths(cli.cli) if not covered(path)] == []
