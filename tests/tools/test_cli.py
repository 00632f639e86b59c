"""The ``persist`` command line: every command on a populated shard, and bad input.

Bad input (a wrong URI, a missing shard, a bad flag) must print exactly one
line on stderr, exit non-zero and write nothing: the tests compare every
Consensus row and Blob key before and after.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.tools import cli
from pyspark_persist.tools.bench.api import Benchmark, Options, Result, flag

SHARD = "events"
SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh embedded default with shard ``events``: 9 commits, a reader, a critical reader."""
    home = tmp_path / "home"
    monkeypatch.setenv("PERSIST_HOME", str(home))
    client = PersistClient.open(config=PersistConfig(maintenance=False))
    shard = client.open_shard(SHARD, SCHEMA)
    writer = shard.writer("w1")
    for i in range(8):
        writer.compare_and_append(
            pa.table({"id": [i, 100 + i], "name": ["a", "b"]}), i * 10, i * 10 + 10, token=i + 1
        )
    # A retraction at time 80: id 0 is gone as of 80, still there as of 79.
    writer.compare_and_append(
        pa.table({"id": [0], "name": ["a"], "_diff": pa.array([-1], pa.int64())}), 80, 90, token=9
    )
    shard.reader("r1")
    shard.critical_reader("crit")
    client.close()
    yield home


def stored(home: Path) -> dict[str, Any]:
    """Every Consensus row and Blob key (with size) of the embedded default under ``home``."""
    consensus = open_consensus(f"sqlite:///{home}/consensus.db")
    blob = open_blob(f"file://{home}/blob")
    try:
        rows = {k: [(r.seqno, r.data) for r in consensus.scan(k, 0)] for k in consensus.list_keys()}
        keys = sorted((m.key, m.size_bytes) for m in blob.list_keys())
    finally:
        consensus.close()
        blob.close()
    return {"consensus": rows, "blob": keys}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_list(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "shards", "list")
    assert status == 0, err
    assert out.splitlines()[0].split()[:4] == ["NAME", "UPPER", "SINCE", "SEQNO"]
    assert out.splitlines()[1].split()[:3] == [SHARD, "90", "0"]
    status, out, _ = run(capsys, "shards", "list", "--json")
    assert status == 0
    (row,) = json.loads(out)["shards"]
    assert row["name"] == SHARD and row["upper"] == 90 and row["batches"] == 9
    assert row["rows"] == 17 and row["readers"] == 2 and row["writers"] == 1


def test_inspect(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "shards", "inspect", SHARD)
    assert status == 0, err
    for needle in (
        "upper      90",
        "since      0",
        "9 batches",
        "r1",
        "crit",
        "w1",
        "expires in",
        "pubsub",
        "fallback_polls=0",
        "id: int64, name: string",
    ):
        assert needle in out, needle
    status, out, _ = run(capsys, "shards", "inspect", SHARD, "--json")
    info = json.loads(out)
    assert status == 0
    assert info["upper"] == 90 and info["since"] == 0
    assert info["seqno_range"] == [1, info["seqno"]]
    assert info["totals"]["batches"] == 9 and info["totals"]["rows"] == 17
    (reader,) = info["leased_readers"]
    assert reader["id"] == "r1" and reader["expires_in_ms"] > 0
    assert [r["id"] for r in info["critical_readers"]] == ["crit"]
    assert [(w["id"], w["last_token"]) for w in info["writers"]] == [("w1", 9)]
    assert info["pubsub"]["mode"] == "off" and "fallback_polls" in info["pubsub"]["counters"]


def test_show_as_of(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "shards", "show", SHARD, "--json", "--limit", "100")
    assert status == 0, err
    latest = json.loads(out)
    assert latest["as_of"] == 89 and latest["total_rows"] == 15
    assert {r["id"] for r in latest["rows"]} == {*range(1, 8), *range(100, 108)}
    status, out, _ = run(capsys, "shards", "show", SHARD, "--as-of", "79", "--json")
    early = json.loads(out)
    assert early["total_rows"] == 16 and 0 in {r["id"] for r in early["rows"]}
    status, out, _ = run(capsys, "shards", "show", SHARD, "--as-of", "15", "--limit", "1")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].split() == ["id", "name", "_time", "_diff"]
    assert len(lines) == 3 and "4 distinct" in lines[-1] and "showing 1" in lines[-1]


def test_show_reader_is_released(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run(capsys, "shards", "show", SHARD)
    status, out, _ = run(capsys, "shards", "inspect", SHARD, "--json")
    assert [r["id"] for r in json.loads(out)["leased_readers"]] == ["r1"]


def test_compact_and_gc(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = stored(home)
    status, out, err = run(capsys, "shards", "compact", SHARD, "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["batches_before"] == 9 and report["batches_after"] < 9
    status, out, err = run(capsys, "shards", "gc", SHARD)
    assert status == 0, err
    assert out.startswith(f"shard {SHARD!r}: gc up to SeqNo")
    after = stored(home)
    assert len(after["consensus"][SHARD]) < len(before["consensus"][SHARD])
    status, out, _ = run(capsys, "shards", "show", SHARD, "--json", "--limit", "100")
    assert json.loads(out)["total_rows"] == 15  # same contents after maintenance
    status, out, _ = run(capsys, "shards", "compact", SHARD)
    assert "nothing to compact" in out


def test_progress_bar(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cli, "_progress_enabled", lambda: True)
    status, _, err = run(capsys, "shards", "show", SHARD)
    assert status == 0
    assert f"reading {SHARD} " in err and "9/9" in err  # rich's bar: label, bar, done/total


def test_uri_flags_after_subcommand(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PERSIST_HOME", str(home.parent / "elsewhere"))
    blob, consensus = f"file://{home}/blob", f"sqlite:///{home}/consensus.db"
    for argv in (
        ("--blob", blob, "--consensus", consensus, "shards", "list"),
        ("shards", "list", "--blob", blob, "--consensus", consensus),
    ):
        status, out, err = run(capsys, *argv)
        assert status == 0, err
        assert SHARD in out
    assert not (home.parent / "elsewhere").exists()


BAD = [
    pytest.param(("shards", "inspect", "nope"), 1, "shard 'nope' does not exist", id="missing"),
    pytest.param(("shards", "show", "nope"), 1, "does not exist", id="show-missing"),
    pytest.param(("shards", "compact", "nope"), 1, "does not exist", id="compact-missing"),
    pytest.param(("shards", "gc", "nope"), 1, "does not exist", id="gc-missing"),
    pytest.param(("shards", "gc", "../x"), 1, "invalid shard name", id="bad-name"),
    pytest.param(
        ("--consensus", "sqlite:///{tmp}/typo/c.db", "shards", "list"),
        1,
        "does not exist",
        id="missing-sqlite",
    ),
    pytest.param(
        ("shards", "gc", SHARD, "--blob", "file:///{tmp}/typo"),
        1,
        "does not exist",
        id="missing-blob-dir",
    ),
    pytest.param(
        ("shards", "compact", SHARD, "--consensus", "nope://x"),
        1,
        "unknown consensus scheme",
        id="bad-scheme",
    ),
    pytest.param(
        ("shards", "inspect", SHARD, "--blob", "no-scheme"), 1, "has no scheme", id="no-scheme"
    ),
    pytest.param(
        ("shards", "show", SHARD, "--as-of", "90"), 1, "at or past the upper", id="as-of-upper"
    ),
    pytest.param(
        ("shards", "show", SHARD, "--as-of", "x"), 2, "--as-of='x' is not a time", id="as-of-int"
    ),
    pytest.param(("shards", "show", SHARD, "--limit", "-3"), 2, "not in the range", id="limit"),
    pytest.param(("shards", "gc", SHARD, "--force"), 2, "No such option '--force'", id="bad-flag"),
    pytest.param(("shards", "inspect"), 2, "Missing argument 'NAME'", id="no-name"),
    pytest.param(("shards",), 2, "persist shards: Missing command", id="no-subcommand"),
    pytest.param(("frobnicate",), 2, "No such command 'frobnicate'", id="bad-command"),
    pytest.param(("bench", "nope"), 2, "No such command 'nope'", id="bad-benchmark"),
    pytest.param(("bench", "core", "--nope"), 2, "unrecognized arguments: --nope", id="bench-flag"),
    pytest.param(("pubsub", "serve", "--port", "x"), 2, "invalid int value", id="serve-port"),
    pytest.param(("--pubsub", "nonsense", "shards", "list"), 1, "invalid pubsub", id="bad-pubsub"),
]


@pytest.mark.parametrize(("argv", "code", "message"), BAD)
def test_bad_input_is_one_line_and_writes_nothing(
    home: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: tuple[str, ...],
    code: int,
    message: str,
) -> None:
    before = stored(home)
    files_before = sorted(p.name for p in tmp_path.iterdir())
    status, out, err = run(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert status == code
    assert out == ""
    assert len(err.splitlines()) == 1, err
    assert err.startswith("persist: error: ") and message in err, err
    assert stored(home) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == files_before  # no "typo" dir


def test_missing_benchmark_module(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(cli.BENCHMARKS, "ghost", ("no_such_benchmark", "not written yet"))
    status, out, err = run(capsys, "bench", "ghost", "--quick")
    assert status == 1 and out == ""
    assert err.strip() == (
        "persist: error: benchmark 'ghost' is not available in this "
        "installation (pyspark_persist.tools.bench.no_such_benchmark is "
        "missing)"
    )


def _fake_module(name: str, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A delegated module (the checker): ``add_arguments`` + ``run_from_args``."""
    import argparse

    calls: list[list[str]] = []

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--rows", type=int, default=1)

    def run_from_args(ns: argparse.Namespace) -> int:
        calls.append(["--rows", str(ns.rows)])
        print(f"rows={ns.rows}")
        return 3

    module = types.ModuleType(name)
    module.add_arguments = add_arguments  # type: ignore[attr-defined]
    module.run_from_args = run_from_args  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, name, module)
    return calls


@dataclass(frozen=True)
class _RowsOptions(Options):
    rows: int = flag(1, "rows")


@dataclass
class _Rows(Result):
    rows: int

    def exit_status(self) -> int:
        return 3


def test_benchmark_command_gets_its_declared_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``persist bench NAME`` parses the flags the benchmark's options declare (a bad value is
    one usage line), runs it, prints its render (or JSON) and exits with its result's status."""
    name = "pyspark_persist.tools.bench.spark_read"
    ran: list[_RowsOptions] = []

    def run_rows(options: _RowsOptions) -> _Rows:
        ran.append(options)
        return _Rows(options.rows)

    module = types.ModuleType(name)
    module.BENCHMARK = Benchmark(  # type: ignore[attr-defined]
        "spark-read", _RowsOptions, run_rows, lambda r: f"rows={r.rows}", "Counts rows."
    )
    monkeypatch.setitem(sys.modules, name, module)
    status, out, _ = run(capsys, "bench", "spark-read", "--rows", "5")
    assert (status, out, ran) == (3, "rows=5\n", [_RowsOptions(rows=5)])
    status, out, _ = run(capsys, "bench", "spark-read", "--json")
    assert (status, json.loads(out)) == (3, {"rows": 1})
    status, out, err = run(capsys, "bench", "spark-read", "--rows", "many")
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    assert "persist bench spark-read: argument --rows: invalid int value" in err
    status, out, _ = run(capsys, "bench", "spark-read", "--help")
    assert status == 0 and "Counts rows." in out and "--rows ROWS" in out


def test_delegated_command_gets_its_flags(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = _fake_module("pyspark_persist.tools.checker", monkeypatch)
    status, out, _ = run(capsys, "check", "--rows", "2")
    assert (status, out, checker) == (3, "rows=2\n", [["--rows", "2"]])


def test_help_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "pubsub", "serve", "--help")
    assert status == 0 and "--host" in out and "--port" in out
    status, out, _ = run(capsys, "shards", "show", "--help")
    assert status == 0 and "--as-of" in out


def test_console_script_and_python_m(home: Path) -> None:
    env = {**os.environ, "PERSIST_HOME": str(home)}
    ok = subprocess.run(
        [sys.executable, "-m", "pyspark_persist", "shards", "list", "--json"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["shards"][0]["name"] == SHARD
    bad = subprocess.run(
        [sys.executable, "-m", "pyspark_persist", "shards", "inspect", "gone"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr
