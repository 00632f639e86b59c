"""``persist shards history``: each commit, newest first, as text and JSON."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient
from pyspark_persist.state.config import PersistConfig
from pyspark_persist.tools import cli


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The embedded default with shard ``events``: two appends by w1, a retraction by w2."""
    home = tmp_path / "home"
    monkeypatch.setenv("PERSIST_HOME", str(home))
    with PersistClient.open(config=PersistConfig(maintenance=False)) as client:
        shard = client.open_shard("events", pa.schema([("id", pa.int64())]))
        w1 = shard.writer("w1")
        w1.compare_and_append(pa.table({"id": [1, 2, 3]}), 0, 10, token=1)
        w1.compare_and_append(pa.table({"id": [4]}), 10, 20, token=2)
        shard.writer("w2").compare_and_append(pa.table({"id": [1], "_diff": [-1]}), 20, 30, token=1)
    yield home


def test_history_lists_commits_newest_first(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """JSON: operation, writer, times, rows added and retracted; text: one line per commit."""
    assert cli.main(["shards", "history", "events", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    got = [
        (
            c["operation"],
            c["writer_id"],
            c["lower"],
            c["upper"],
            c["rows_added"],
            c["rows_retracted"],
        )
        for c in result["commits"]
    ]
    assert got == [
        ("append", "w2", 20, 30, 0, 1),
        ("append", "w1", 10, 20, 1, 0),
        ("append", "w1", 0, 10, 3, 0),
        ("create", None, 0, 0, 0, 0),
    ]
    assert result["oldest_seqno"] == 1 and result["total"] == 4
    assert cli.main(["shards", "history", "events", "--limit", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["SEQNO", "OPERATION", "COMMITTED"]
    assert [line.split()[1] for line in lines[1:3]] == ["append", "append"]
    assert "w2" in lines[1] and "[20, 30)" in lines[1]
    assert lines[-1].startswith("2 of 4 commit(s) of shard 'events'")
    assert cli.main(["shards", "history", "nope"]) == 1
    assert "nope" in capsys.readouterr().err
