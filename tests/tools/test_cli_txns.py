"""``persist txns list|show``: the transactions the shards' histories hold, as text and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient
from pyspark_persist.state.config import PersistConfig
from pyspark_persist.tools import cli

IDS = pa.schema([("id", pa.int64())])


def test_txns_list_and_show(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PERSIST_HOME", str(tmp_path / "home"))
    with PersistClient.open(config=PersistConfig(maintenance=False)) as client:
        for name in ("orders", "items", "other"):
            client.open_shard(name, IDS)
        client.open_shard("orders").writer("plain").append(pa.table({"id": [0]}))
        with client.txn(writer_id="etl", token=1) as first:
            first.append("orders", pa.table({"id": [1]}))
            first.append("items", pa.table({"id": [1, 2]}))
        with client.txn(writer_id="etl", token=2) as second:
            second.append("orders", pa.table({"id": [3]}))
            second.append("other", pa.table({"id": [3]}))
        open_txn = client.txn(writer_id="etl", token=3)
        open_txn.append("items", pa.table({"id": [4]}))  # built, never committed

        assert cli.main(["txns", "list", "orders", "items", "--json"]) == 0
        listed = json.loads(capsys.readouterr().out)
        got = [
            (t["txn_id"], t["time"], t["writer_id"], t["participants"])
            for t in listed["transactions"]
        ]
        assert got == [
            (second.txn_id, second.commit_time, "etl", ["orders"]),  # "other" was not named
            (first.txn_id, first.commit_time, "etl", ["items", "orders"]),
        ]
        assert open_txn.txn_id not in json.dumps(listed) and "not listed" in listed["note"]
        assert cli.main(["txns", "list", "orders", "items", "--limit", "1"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert lines[0].split() == ["TXN", "TIME", "COMMITTED", "WRITER", "PARTICIPANTS"]
        assert lines[1].split()[0] == second.txn_id and len(lines) == 3
        assert "1 of 2 transaction(s)" in lines[2]

        assert cli.main(["txns", "show", first.txn_id, "orders", "items", "other", "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert (shown["time"], shown["not_in"]) == (first.commit_time, ["other"])
        assert [(c["shard"], c["rows_added"], c["upper"]) for c in shown["commits"]] == [
            ("items", 2, first.commit_time + 1),
            ("orders", 1, first.commit_time + 1),
        ]
        assert cli.main(["txns", "show", first.txn_id, "orders", "items"]) == 0
        text = capsys.readouterr().out
        assert f"transaction {first.txn_id} by writer 'etl'" in text and "not in" not in text
        assert cli.main(["txns", "show", open_txn.txn_id, "items"]) == 1
        assert "lives only in the process" in capsys.readouterr().err
