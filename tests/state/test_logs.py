"""Persist's logs: nothing on stderr by default; structured lines when asked for.

The workload runs in a fresh interpreter, as an application would, so what reaches stderr is
exactly what a user sees: no handler configured by the test, Python's defaults only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pyspark_persist.state.errors import InvalidUsage
from pyspark_persist.state.logs import KeyValueFormatter, configure

WORKLOAD = """
import sys
import pyarrow as pa
from pyspark_persist.state import PersistClient, PersistConfig

config = PersistConfig(inline_write_max_bytes=1, rollup_interval=4, compaction_fan_in=4)
client = PersistClient.open(f"file://{sys.argv[1]}/blob", f"sqlite:///{sys.argv[1]}/c.db",
                            config=config)
shard = client.open_shard("events", pa.schema([("id", pa.int64())]))
writer = shard.writer("w")
reader = shard.reader()
listen = reader.listen(shard.upper - 1 if shard.upper else 0)
for i in range(12):
    writer.append(pa.table({"id": [i]}))
assert listen.next(timeout_s=10) is not None
listen.close()
print(reader.snapshot_table().num_rows)
reader.close()
shard.compact()
shard.gc()
client.maintenance.wait_idle(30)
client.close()
"""
KV = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def run_workload(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_LOG")}
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, str(tmp_path)],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "12\n"
    return done


def parse_kv(line: str) -> dict[str, str]:
    fields = {k: json.loads(v) if v.startswith('"') else v for k, v in KV.findall(line)}
    assert " ".join(f"{k}={v}" for k, v in KV.findall(line)) == line, "nothing but pairs"
    return fields


def test_a_default_run_prints_nothing_on_stderr(tmp_path: Path) -> None:
    assert run_workload(tmp_path).stderr == ""


def test_persist_log_level_prints_one_key_value_line_per_record(tmp_path: Path) -> None:
    lines = run_workload(tmp_path, PERSIST_LOG_LEVEL="debug").stderr.splitlines()
    records = [parse_kv(line) for line in lines]
    assert records, "gc logs its work at DEBUG"
    for record in records:
        assert list(record)[:4] == ["time", "level", "logger", "msg"]
        assert record["logger"].startswith("pyspark_persist.")
        assert record["level"] in {"DEBUG", "INFO", "WARNING", "ERROR"}
    assert any(
        r["logger"] == "pyspark_persist.state.maintenance" and r["msg"].startswith("shard events:")
        for r in records
    )


def test_json_format(tmp_path: Path) -> None:
    done = run_workload(tmp_path, PERSIST_LOG_LEVEL="DEBUG", PERSIST_LOG_FORMAT="json")
    records = [json.loads(line) for line in done.stderr.splitlines()]
    assert records and all(r["logger"].startswith("pyspark_persist.") for r in records)


def test_a_bad_level_is_one_warning_and_the_default(tmp_path: Path) -> None:
    stderr = run_workload(tmp_path, PERSIST_LOG_LEVEL="loud").stderr
    assert "unknown log level 'loud'" in stderr and "PERSIST_LOG_LEVEL" in stderr
    assert "level=" not in stderr


def test_values_are_quoted_only_when_they_must_be() -> None:
    record = logging.LogRecord(
        "pyspark_persist.state.x", logging.INFO, __file__, 1, 'a "b" = c', None, None
    )
    line = KeyValueFormatter().format(record)
    assert parse_kv(line)["msg"] == 'a "b" = c'
    assert " level=INFO logger=pyspark_persist.state.x " in line


def test_configure_names_the_valid_levels() -> None:
    with pytest.raises(InvalidUsage, match="DEBUG, INFO, WARNING, ERROR"):
        configure("chatty")


def test_every_logger_is_under_pyspark_persist() -> None:
    """Each module logs to ``logging.getLogger(__name__)``: one tree, one parent per layer."""
    repo = Path(__file__).resolve().parents[2]
    call = re.compile(r"logging\.getLogger\(([^)]*)\)")
    # state/logs.py configures the root of the tree (LOGGER); the CLI quiets the store
    # watchdog's logger; a benchmark quiets moto's web server (werkzeug).
    allowed = {"__name__", "LOGGER", '"pyspark_persist.state.retry"', '"werkzeug"'}
    odd = [
        f"{path.relative_to(repo)}: getLogger({arg})"
        for layer in ("state", "pubsub", "connector", "tools")
        for path in sorted((repo / layer).rglob("*.py"))
        for arg in call.findall(path.read_text())
        if arg not in allowed and not arg.startswith('"pyspark_persist')
    ]
    assert odd == []
