"""The read-only commands (``shards list``, ``inspect``, ``show``, ``history``) on a read-only
PostgreSQL role.

A role that may only SELECT the Consensus table, and whose transactions are
read-only, is created for the test in the ``test`` database and dropped
afterwards. The commands must answer correctly and leave Consensus exactly as
they found it: no table created, no reader registered, no row written.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient
from pyspark_persist.tools import cli

pytestmark = pytest.mark.postgres


@pytest.fixture
def read_only_role(postgres_url: str) -> Iterator[tuple[str, str]]:
    """(role, table): a fresh LOGIN role allowed SELECT on a fresh table name, and nothing else."""
    role = f"persist_ro_{uuid.uuid4().hex[:10]}"
    table = f"ro_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN")
        admin.execute(f"ALTER ROLE {role} SET default_transaction_read_only = on")
        admin.execute(f"GRANT CONNECT ON DATABASE test TO {role}")
        admin.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
    try:
        yield role, table
    finally:
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute(f"DROP TABLE IF EXISTS {table}")
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def consensus_rows(postgres_url: str, table: str) -> list[tuple[str, int, bytes]]:
    with psycopg.connect(postgres_url) as conn:
        rows = conn.execute(f"SELECT shard, sequence_number, data FROM {table} ORDER BY 1, 2")
        return [(str(s), int(n), bytes(d)) for s, n, d in rows]


def table_exists(postgres_url: str, table: str) -> bool:
    with psycopg.connect(postgres_url) as conn:
        row = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
        return row is not None and row[0] is not None


def test_read_only_commands_work_with_a_read_only_role_and_write_nothing(
    postgres_url: str,
    read_only_role: tuple[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    role, table = read_only_role
    blob = f"file://{tmp_path}/blob"
    writer_uri = f"{postgres_url}?table={table}"
    with PersistClient.open(blob, writer_uri) as client:
        shard = client.open_shard("events", pa.schema([("id", pa.int64())]))
        for i in range(3):
            shard.writer().append(pa.table({"id": [i, i + 10]}))
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"GRANT SELECT ON {table} TO {role}")
    before = consensus_rows(postgres_url, table)
    location = [
        "--blob",
        blob,
        "--consensus",
        f"postgresql://{role}@127.0.0.1:5432/test?table={table}",
    ]

    code, out, err = run(capsys, *location, "shards", "list", "--json")
    assert code == 0, err
    listed = json.loads(out)["shards"]
    assert [(s["name"], s["rows"]) for s in listed] == [("events", 6)]

    code, out, err = run(capsys, *location, "shards", "inspect", "events", "--json")
    assert code == 0, err
    assert json.loads(out)["totals"]["rows"] == 6

    code, out, err = run(capsys, *location, "shards", "show", "events", "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert sorted(r["id"] for r in shown["rows"]) == [0, 1, 2, 10, 11, 12]

    code, out, err = run(capsys, *location, "shards", "history", "events", "--json")
    assert code == 0, err
    commits = json.loads(out)["commits"]
    assert [(c["operation"], c["rows_added"]) for c in commits[:3]] == [("append", 2)] * 3

    assert consensus_rows(postgres_url, table) == before  # no reader registered, nothing written


def test_read_only_list_of_an_empty_database_creates_no_table(
    postgres_url: str,
    read_only_role: tuple[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    role, table = read_only_role
    (tmp_path / "blob").mkdir()
    code, out, err = run(
        capsys,
        "--blob",
        f"file://{tmp_path}/blob",
        "--consensus",
        f"postgresql://{role}@127.0.0.1:5432/test?table={table}",
        "shards",
        "list",
    )
    assert code == 0, err
    assert "no shards" in out
    assert not table_exists(postgres_url, table)
