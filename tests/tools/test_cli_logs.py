"""The command line's logs: a default run prints nothing on stderr; ``-v``/``-vv`` and
``$PERSIST_LOG_LEVEL`` print persist's records as key=value lines; a bad level is bad usage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig


@pytest.fixture
def home(tmp_path: Path) -> Path:
    """An embedded default holding shard ``events`` (three commits)."""
    home = tmp_path / "home"
    client = PersistClient.open(
        f"file://{home}/blob", f"sqlite:///{home}/consensus.db", config=PersistConfig()
    )
    writer = client.open_shard("events", pa.schema([("id", pa.int64())])).writer()
    for i in range(3):
        writer.append(pa.table({"id": [i]}))
    client.close()
    return home


def persist(home: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    return subprocess.run(
        [sys.executable, "-m", "pyspark_persist.tools.cli", *args],
        env={**base, "PERSIST_HOME": str(home), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args",
    [
        ("shards", "list"),
        ("inspect", "events"),
        ("shards", "show", "events"),
        ("shards", "compact", "events"),
        ("shards", "gc", "events"),
    ],
)
def test_a_default_run_prints_nothing_on_stderr(home: Path, args: tuple[str, ...]) -> None:
    done = persist(home, *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout and done.stderr == ""


@pytest.mark.parametrize(
    ("flags", "env"),
    [(("-vv",), {}), ((), {"PERSIST_LOG_LEVEL": "DEBUG"})],
    ids=["-vv", "PERSIST_LOG_LEVEL"],
)
def test_asked_for_logs_are_key_value_lines(
    home: Path, flags: tuple[str, ...], env: dict[str, str]
) -> None:
    done = persist(home, *flags, "shards", "gc", "events", **env)
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert lines, "gc logs its work at DEBUG"
    for line in lines:
        assert line.startswith("time=") and " level=" in line and " msg=" in line, line
    assert any(
        ' level=DEBUG logger=pyspark_persist.state.maintenance msg="shard events: gc' in line
        for line in lines
    )


def test_v_is_info_only(home: Path) -> None:
    done = persist(home, "-v", "shards", "gc", "events")
    assert done.returncode == 0 and "level=DEBUG" not in done.stderr


def test_a_bad_log_level_is_one_line_of_bad_usage(home: Path) -> None:
    done = persist(home, "shards", "list", PERSIST_LOG_LEVEL="loud")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "persist: error: unknown log level 'loud': use one of DEBUG, INFO, WARNING, ERROR "
        "(in $PERSIST_LOG_LEVEL or with -v/-vv)"
    ]
