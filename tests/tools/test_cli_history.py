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


def test_history_shows_a_transactions_id_on_each_of_its_commits(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A transaction over two shards: both histories name it in a TXN column (and JSON's
    txn_id); a plain commit's cell stays empty, and a history with no transaction has no
    such column."""
    assert cli.main(["shards", "history", "events"]) == 0
    assert "TXN" not in capsys.readouterr().out.splitlines()[0]
    with PersistClient.open(config=PersistConfig(maintenance=False)) as client:
        client.open_shard("items", pa.schema([("id", pa.int64())]))
        with client.txn(writer_id="etl", token=1) as t:
            t.append("events", pa.table({"id": [9]}))
            t.append("items", pa.table({"id": [9]}))
    for shard in ("events", "items"):
        assert cli.main(["shards", "history", shard, "--json"]) == 0
        newest = json.loads(capsys.readouterr().out)["commits"][0]
        assert (newest["txn_id"], newest["writer_id"]) == (t.txn_id, "etl")
        assert cli.main(["shards", "history", shard]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split()[-1] == "TXN" and lines[1].split()[-1] == t.txn_id
    assert cli.main(["shards", "history", "events"]) == 0
    plain = capsys.readouterr().out.splitlines()[2]  # the append before: w2's retraction
    assert "w2" in plain and t.txn_id not in plain
