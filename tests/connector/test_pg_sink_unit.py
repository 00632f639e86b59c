"""``sinks.postgres`` and the token rules of ``exactly_once``, without Spark.

The sink is called as ``foreachBatch`` would call it, with a stand-in for the
micro-batch DataFrame (its schema and ``toArrow()``, all the sink reads of it), against
the test PostgreSQL server; each test writes its own fresh table. The tokens are
checked as the pure functions of offset JSON they are.
"""

from __future__ import annotations

import datetime as dt
import json
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from pyspark.sql.types import (
    BinaryType,
    DoubleType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pyspark_persist.batch_tokens import SourceRange, batch_token, persist_range
from pyspark_persist.sinks import PostgresSink, postgres
from pyspark_persist.state.errors import InvalidUsage, SinkDiverged

SCHEMA = StructType(
    [
        StructField("id", LongType()),
        StructField("s", StringType()),
        StructField("_time", LongType()),
        StructField("_diff", LongType()),
    ]
)


class Batch:
    """What the sink reads of a micro-batch DataFrame: ``schema`` and ``toArrow()``."""

    def __init__(self, rows: list[tuple[Any, ...]], schema: StructType = SCHEMA) -> None:
        self.schema = schema
        names = schema.fieldNames()
        arrow_types = {
            "long": pa.int64(),
            "string": pa.string(),
            "binary": pa.binary(),
            "timestamp": pa.timestamp("us", tz="UTC"),
            "double": pa.float64(),
        }
        self._table = pa.table(
            {
                n: pa.array([r[i] for r in rows], arrow_types[f.dataType.typeName()])
                for i, (n, f) in enumerate(zip(names, schema.fields, strict=True))
            }
        )

    def toArrow(self) -> pa.Table:  # noqa: N802 - DataFrame's name
        return self._table


@pytest.fixture
def table(postgres_url: str) -> Iterator[str]:
    """A fresh table name, dropped after the test (with its tokens)."""
    name = f"sink_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {name}")
        if conn.execute("SELECT to_regclass('persist_tokens')").fetchone() != (None,):
            conn.execute("DELETE FROM persist_tokens WHERE target = %s", (name,))


def contents(url: str, table: str) -> Counter[tuple[Any, ...]]:
    """The table's rows as a multiset."""
    with psycopg.connect(url) as conn:
        return Counter(conn.execute(f"SELECT * FROM {table}").fetchall())


def tokens(url: str, table: str) -> list[str]:
    with psycopg.connect(url) as conn:
        if conn.execute("SELECT to_regclass('persist_tokens')").fetchone() == (None,):
            return []
        rows = conn.execute(
            "SELECT token FROM persist_tokens WHERE target = %s ORDER BY token", (table,)
        )
        return [r[0] for r in rows]


def exists(url: str, table: str) -> bool:
    with psycopg.connect(url) as conn:
        return conn.execute("SELECT to_regclass(%s)", (table,)).fetchone() != (None,)


pg = pytest.mark.postgres


@pg
def test_inserts_and_retractions_make_the_table_the_shards_multiset(
    postgres_url: str, table: str
) -> None:
    """+n inserts n copies, -n deletes n of them; a token's updates in any order."""
    sink = postgres(postgres_url, table)
    sink(Batch([(1, "a", 1, 1), (2, "b", 1, 2), (3, None, 1, 1), (4, "", 1, 1)]), "t1")
    assert contents(postgres_url, table) == Counter(
        {(1, "a"): 1, (2, "b"): 2, (3, None): 1, (4, ""): 1}
    )
    # A retraction listed before the insertion it follows, both in one micro-batch.
    sink(Batch([(2, "b", 2, -1), (3, None, 2, -1), (5, "e", 2, 1), (5, "e", 3, -1)]), "t2")
    assert contents(postgres_url, table) == Counter({(1, "a"): 1, (2, "b"): 1, (4, ""): 1})
    assert tokens(postgres_url, table) == ["t1", "t2"]


@pg
def test_a_replayed_token_applies_nothing(postgres_url: str, table: str) -> None:
    """The second call with a token (Spark's replay) changes nothing, even with other rows."""
    sink = postgres(postgres_url, table)
    assert sink(Batch([(1, "a", 1, 1)]), "t1") is True
    assert sink(Batch([(1, "a", 1, 1)]), "t1") is False
    assert sink(Batch([(1, "a", 2, -1), (9, "z", 2, 1)]), "t1") is False
    assert contents(postgres_url, table) == Counter({(1, "a"): 1})
    assert sink.applied("t1") and not sink.applied("t2")
    # Another sink object (a restarted driver) sees the token too.
    other = postgres(postgres_url, table)
    other(Batch([(1, "a", 1, 1)]), "t1")
    assert contents(postgres_url, table) == Counter({(1, "a"): 1})


@pg
def test_keyed_upsert_and_delete(postgres_url: str, table: str) -> None:
    """With keys: an update's (old, -1) (new, +1) replaces the row, a lone -1 deletes the key,
    and a key changed twice in one micro-batch ends at its last row."""
    sink = postgres(postgres_url, table, keys=["id"])
    sink(Batch([(1, "a", 1, 1), (2, "b", 1, 1), (3, "c", 1, 1)]), "t1")
    sink(
        Batch(
            [
                (1, "a", 2, -1),
                (1, "a2", 2, 1),
                (2, "b", 2, -1),
                (3, "c", 2, -1),
                (3, "c2", 2, 1),
                (3, "c2", 3, -1),
                (3, "c3", 3, 1),
                (4, "d", 3, 1),
            ]
        ),
        "t2",
    )
    assert contents(postgres_url, table) == Counter({(1, "a2"): 1, (3, "c3"): 1, (4, "d"): 1})
    with psycopg.connect(postgres_url) as conn:
        key = conn.execute(
            "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid "
            "AND a.attnum = ANY(i.indkey) WHERE i.indrelid = %s::regclass AND i.indisprimary",
            (table,),
        ).fetchall()
    assert key == [("id",)], "the created table's primary key is the keys"


@pg
def test_keys_that_do_not_identify_rows_are_refused_before_writing(
    postgres_url: str, table: str
) -> None:
    sink = postgres(postgres_url, table, keys=["s"])
    sink(Batch([(1, "a", 1, 1)]), "t1")
    with pytest.raises(InvalidUsage, match="do not identify the shard's rows"):
        sink(Batch([(2, "a", 2, 1), (3, "a", 2, 1)]), "t2")
    assert contents(postgres_url, table) == Counter({(1, "a"): 1})
    assert tokens(postgres_url, table) == ["t1"]


@pg
def test_bad_input_is_refused_before_anything_is_written(postgres_url: str, table: str) -> None:
    """No _diff, a key that is no column, a missing table with create=False, a type no
    created column holds: each a clear error, and no table, no token."""
    no_diff = StructType([StructField("id", LongType()), StructField("s", StringType())])
    with pytest.raises(InvalidUsage, match="no _diff column"):
        postgres(postgres_url, table)(Batch([(1, "a")], no_diff), "t1")
    with pytest.raises(InvalidUsage, match="key column.* nope not in the micro-batch"):
        postgres(postgres_url, table, keys=["nope"])(Batch([(1, "a", 1, 1)]), "t1")
    with pytest.raises(InvalidUsage, match="does not exist.*create=False"):
        postgres(postgres_url, table, create=False)(Batch([(1, "a", 1, 1)]), "t1")
    with pytest.raises(InvalidUsage, match="not a table name"):
        postgres(postgres_url, "a.b.c")
    assert not exists(postgres_url, table)
    assert tokens(postgres_url, table) == []


@pg
def test_an_existing_table_lacking_a_column_is_refused(postgres_url: str, table: str) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id bigint)")
    with pytest.raises(InvalidUsage, match="has no column.* s of the stream"):
        postgres(postgres_url, table, create=False)(Batch([(1, "a", 1, 1)]), "t1")
    assert tokens(postgres_url, table) == []


@pg
def test_a_retraction_the_table_lacks_rolls_back_the_whole_micro_batch(
    postgres_url: str, table: str
) -> None:
    """The table changed behind the sink's back: SinkDiverged, and neither the micro-batch's
    inserts nor its token are kept (run again once repaired, it applies)."""
    sink = postgres(postgres_url, table)
    sink(Batch([(1, "a", 1, 1)]), "t1")
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DELETE FROM {table}")
    batch = Batch([(1, "a", 2, -1), (2, "b", 2, 1)])
    with pytest.raises(SinkDiverged, match="retracts 1 rows but table .* holds only 0"):
        sink(batch, "t2")
    assert contents(postgres_url, table) == Counter()
    assert tokens(postgres_url, table) == ["t1"]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {table} VALUES (1, 'a')")
    sink(batch, "t2")
    assert contents(postgres_url, table) == Counter({(2, "b"): 1})


@pg
def test_retractions_match_rows_whose_texts_differ_or_look_alike(
    postgres_url: str, table: str
) -> None:
    """Rows are matched by their text first (so PostgreSQL can sort or hash the join), then
    compared exactly: texts with the row format's own commas, quotes, parentheses and
    NULL-looking strings retract exactly their rows and multiplicities, and a value equal
    but differently written (-0.0 against 0.0: '-0' and '0') is still retracted, by the
    row-by-row match that runs when the text match falls short."""
    schema = StructType(
        [
            StructField("id", LongType()),
            StructField("s", StringType()),
            StructField("x", DoubleType()),
            StructField("_diff", LongType()),
        ]
    )
    tricky = ["a,b", '"q"', "(p)", "", None, "NULL", "\\", " "]
    rows = [(i, s, 1.5, 2) for i, s in enumerate(tricky)] + [(99, None, 0.0, 1)]
    sink = postgres(postgres_url, table)
    sink(Batch(rows, schema), "t1")
    # One copy of each tricky row back, and -0.0 for the 0.0 row.
    sink(
        Batch([(i, s, 1.5, -1) for i, s in enumerate(tricky)] + [(99, None, -0.0, -1)], schema),
        "t2",
    )
    assert contents(postgres_url, table) == Counter({(i, s, 1.5): 1 for i, s in enumerate(tricky)})
    # A NULL is not the string 'NULL' nor '': retracting (5, None) finds no such row.
    with pytest.raises(SinkDiverged, match="retracts 1 rows but table .* holds only 0"):
        sink(Batch([(5, None, 1.5, -1)], schema), "t3")
    assert contents(postgres_url, table) == Counter({(i, s, 1.5): 1 for i, s in enumerate(tricky)})


@pg
def test_binary_and_timestamps_round_trip(postgres_url: str, table: str) -> None:
    schema = StructType(
        [
            StructField("b", BinaryType()),
            StructField("at", TimestampType()),
            StructField("_diff", LongType()),
        ]
    )
    at = dt.datetime(2024, 5, 6, 7, 8, 9, 123456, tzinfo=dt.UTC)
    sink = postgres(postgres_url, table)
    sink(Batch([(b"\x00\xffx", at, 1), (None, None, 1)], schema), "t1")
    assert contents(postgres_url, table) == Counter({(b"\x00\xffx", at): 1, (None, None): 1})
    sink(Batch([(b"\x00\xffx", at, -1)], schema), "t2")
    assert contents(postgres_url, table) == Counter({(None, None): 1})


def test_the_sink_is_a_postgres_sink() -> None:
    assert isinstance(postgres("postgresql://x@h/db", "t", keys=["id"]), PostgresSink)


# --- tokens -------------------------------------------------------------------------------


def offset(upper: int, phase: str = "listen", seqno: int = 7, as_of: int = -1, **kw: Any) -> str:
    d = {"shard": "s1", "seqno": seqno, "upper": upper, "phase": phase, "as_of": as_of}
    d.update(kw)
    return json.dumps(d)


def test_token_is_the_range_without_the_seqno_it_was_observed_at() -> None:
    """A replay that observed its offsets at other SeqNos has the same token; another range
    (start, end, phase, as_of, incarnation) another one."""
    base = batch_token(offset(3, seqno=4), offset(9, seqno=12))
    assert base == batch_token(offset(3, seqno=5), offset(9, seqno=40))
    others = {
        batch_token(offset(3), offset(10)),
        batch_token(offset(4), offset(9)),
        batch_token(offset(3, "snapshot", as_of=8), offset(9)),
        batch_token(offset(3, incarnation="x"), offset(9, incarnation="x")),
        batch_token(offset(0, "snapshot", as_of=8), offset(3, "snapshot", as_of=8)),
        batch_token(offset(0, "snapshot", as_of=9), offset(3, "snapshot", as_of=9)),
    }
    assert base not in others and len(others) == 6
    assert json.loads(base) == {
        "shard": "s1",
        "incarnation": "",
        "start": [3, "listen", -1],
        "end": [9, "listen", -1],
    }


def test_token_refuses_offsets_of_two_incarnations() -> None:
    with pytest.raises(InvalidUsage, match="different shards or incarnations"):
        batch_token(offset(3, incarnation="a"), offset(9, incarnation="b"))


def test_persist_range_names_what_the_micro_batch_reads() -> None:
    """One persist source: its range; none, two, or one beside another source: refused,
    naming the sources."""
    persist = SourceRange("persist", offset(1), offset(2))
    rate = SourceRange("RateStreamTable", '{"0": 5}', '{"0": 9}')
    assert persist_range([persist]) == (offset(1), offset(2))
    with pytest.raises(InvalidUsage, match="reads RateStreamTable, not a persist source"):
        persist_range([rate])
    with pytest.raises(InvalidUsage, match="2 streaming sources \\(persist, persist\\)"):
        persist_range([persist, persist])
    with pytest.raises(InvalidUsage, match="2 streaming sources \\(persist, RateStreamTable\\)"):
        persist_range([persist, rate])
    with pytest.raises(InvalidUsage, match="no streaming source"):
        persist_range([])
