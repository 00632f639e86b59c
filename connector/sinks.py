"""Ready-made writers for ``foreachBatch(exactly_once(...))``: a persist stream into another system.

:func:`postgres` applies each micro-batch's updates ``(row, _diff)`` to a PostgreSQL
table and records the micro-batch's token (:func:`pyspark_persist.exactly_once`) in a
tokens table in the same transaction. A token already recorded means the micro-batch was
applied (Spark ran it again after a crash, or a query resumed a named consumer without
its checkpoint): nothing is applied and the transaction is rolled back. So every update
of the shard lands once, however often the query is killed and restarted.

What the rows do to the table (multiset or by key) is decided by the pure
:mod:`pyspark_persist.pg_changes`; this module is the shell: the connection, the tables,
``COPY`` and the transaction.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from pyspark_persist.pg_changes import (
    COUNT,
    csv_payload,
    data_columns,
    insertions,
    keyed_changes,
    pg_type,
    retractions,
)
from pyspark_persist.state import DIFF
from pyspark_persist.state.errors import InvalidUsage, SinkDiverged

if TYPE_CHECKING:
    import psycopg
    from psycopg import sql
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

log = logging.getLogger(__name__)

TOKENS_TABLE = "persist_tokens"
"""The default table of applied tokens: ``(target, token, applied_at)``, one row per
micro-batch applied, shared by every sink of the database (``target`` names the table)."""

COPY_ROWS = 65_536
"""Rows encoded per ``COPY`` write: bounds the CSV text held at once."""

STAGE_PREFIX = "persist_stage_"
"""Staging tables (``stage=True``) are named this and a hash of the target and the token."""

PART = "_persist_part"
"""The staging table's column naming the Spark partition that staged the row."""


def postgres(
    url: str,
    table: str,
    keys: Sequence[str] | None = None,
    *,
    create: bool = True,
    tokens_table: str = TOKENS_TABLE,
    stage: bool = False,
) -> PostgresSink:
    """A ``fn(df, token)`` for :func:`pyspark_persist.exactly_once` that applies a persist
    stream's micro-batches to PostgreSQL table ``table`` (``name`` or ``schema.name``).

    Without ``keys`` the table holds the shard's rows as a multiset: a row with ``_diff``
    n > 0 is inserted n times (``COPY``), one with n < 0 deletes n matching rows. With
    ``keys`` it holds one row per key: each key the micro-batch changed is deleted and its
    new row, if any, inserted (an upsert; a keyed shard's update arrives as its old row
    retracted and the new one inserted). ``_time`` and ``_change_type`` are not stored.

    ``create``: a missing table is created from the micro-batch's schema (primary key
    ``keys``); with ``create=False`` it must exist (a clear error otherwise). Either way
    it must have every column of the stream. ``url``: a libpq URL
    (``postgresql://user@host:5432/db``). The micro-batch is collected to the driver as
    Arrow (so it must fit ``spark.driver.maxResultSize``: bound it with
    ``maxBytesPerTrigger``) and applied in one transaction.

    ``stage=True``: nothing is collected; each partition ``COPY``s its rows from the
    executor into an UNLOGGED staging table named from the token, and the driver applies
    the staging table in one transaction with the token, then drops it. For micro-batches
    too big for the driver (a compacted shard's first micro-batch holds whole batches,
    which ``maxBytesPerTrigger`` cannot cut). Executors must reach ``url``. A crash leaves
    the token absent and nothing applied; the replay drops the staging table it finds.
    """
    return PostgresSink(url, table, tuple(keys) if keys else (), create, tokens_table, stage)


class PostgresSink:
    """The writer :func:`postgres` returns; call it as ``fn(df, token)``.

    Holds one connection, reused across micro-batches (opened again if it broke).
    """

    def __init__(
        self,
        url: str,
        table: str,
        keys: tuple[str, ...],
        create: bool,
        tokens_table: str,
        stage: bool = False,
    ) -> None:
        """See :func:`postgres`."""
        for name, what in ((table, "table"), (tokens_table, "tokens_table")):
            parts = name.split(".")
            if not 1 <= len(parts) <= 2 or not all(parts):
                raise InvalidUsage(
                    f"sinks.postgres: {what} {name!r} is not a table name: give 'name' or "
                    "'schema.name'"
                )
        self.url = url
        self.table = table
        self.keys = keys
        self.create = create
        self.tokens_table = tokens_table
        self.stage = stage
        self._conn: psycopg.Connection | None = None
        self._ready: dict[tuple[str, ...], frozenset[str]] = {}
        """The column lists whose tables were checked (or created): the target's NOT NULL
        columns for each."""

    def __call__(self, df: DataFrame, token: str) -> bool:
        """Apply micro-batch ``df`` unless ``token`` was applied (then False); every check
        before anything is written."""
        columns = data_columns(df.schema, self.keys, self.table)
        types = self._created_types(df.schema, columns) if self.create else None
        t0 = time.monotonic()
        conn = self._connection()
        if self.stage:
            not_null = self._prepare(conn, columns, types)
            staged = self._stage_batch(conn, df, columns, token)
            applied = staged is not None and self._commit_staged(
                conn, staged, columns, not_null, token
            )
            count = staged or 0
        else:
            updates = df.toArrow()
            not_null = self._prepare(conn, columns, types)
            applied = self._apply(conn, updates, columns, not_null, token)
            count = updates.num_rows
        log.info(
            "sinks.postgres(%s): %s %d updates in %.3f s (token %s)",
            self.table,
            "applied" if applied else "skipped (token already applied)",
            count,
            time.monotonic() - t0,
            token,
        )
        return applied

    def close(self) -> None:
        """Close the connection (the next call opens another)."""
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def applied(self, token: str) -> bool:
        """Whether ``token``'s micro-batch was applied to the table."""
        from psycopg import sql

        conn = self._connection()
        with conn.transaction():
            row = conn.execute(
                sql.SQL("SELECT 1 FROM {} WHERE target = %s AND token = %s").format(
                    _name(self.tokens_table)
                ),
                (self.table, token),
            ).fetchone()
        return row is not None

    def _created_types(self, schema: StructType, columns: list[str]) -> dict[str, str]:
        """The PostgreSQL type of each column, should the table be created (checked first)."""
        fields = {f.name: f.dataType for f in schema.fields}
        return {c: pg_type(fields[c], c, self.table) for c in columns}

    def _connection(self) -> psycopg.Connection:
        import psycopg

        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self.url)
        return self._conn

    def _prepare(
        self, conn: psycopg.Connection, columns: list[str], types: dict[str, str] | None
    ) -> frozenset[str]:
        """Create the tokens table and (``create``) the target if missing; check the target
        has every column. Once per column list. Returns the target's NOT NULL columns."""
        from psycopg import sql

        key = tuple(columns)
        if key in self._ready:
            return self._ready[key]
        target = _name(self.table)
        with conn.transaction():
            conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (target text NOT NULL, token text NOT NULL, "
                    "applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, token))"
                ).format(_name(self.tokens_table))
            )
            exists = conn.execute("SELECT to_regclass(%s)", (target.as_string(conn),)).fetchone()
            if exists is None or exists[0] is None:
                if types is None:
                    raise InvalidUsage(
                        f"sinks.postgres: table {self.table!r} does not exist in {_safe(self.url)} "
                        "(create=False): create it with the stream's columns "
                        f"({', '.join(columns)}), or pass create=True"
                    )
                definitions = [
                    sql.SQL("{} {}").format(sql.Identifier(c), sql.SQL(types[c])) for c in columns
                ]
                if self.keys:
                    definitions.append(
                        sql.SQL("PRIMARY KEY ({})").format(
                            sql.SQL(", ").join(map(sql.Identifier, self.keys))
                        )
                    )
                conn.execute(
                    sql.SQL("CREATE TABLE IF NOT EXISTS {} ({})").format(
                        target, sql.SQL(", ").join(definitions)
                    )
                )
                log.info("sinks.postgres: created table %s (%s)", self.table, ", ".join(columns))
            rows = conn.execute(
                "SELECT attname, attnotnull FROM pg_attribute WHERE attrelid = %s::regclass "
                "AND attnum > 0 AND NOT attisdropped",
                (target.as_string(conn),),
            ).fetchall()
        have = {name: bool(not_null) for name, not_null in rows}
        missing = [c for c in columns if c not in have]
        if missing:
            raise InvalidUsage(
                f"sinks.postgres: table {self.table!r} has no column(s) {', '.join(missing)} "
                f"of the stream (it has {', '.join(have)}): add them (ALTER TABLE ... ADD "
                "COLUMN), or select only the table's columns"
            )
        self._ready[key] = frozenset(c for c in columns if have[c])
        return self._ready[key]

    def _apply(
        self,
        conn: psycopg.Connection,
        updates: pa.Table,
        columns: list[str],
        not_null: frozenset[str],
        token: str,
    ) -> bool:
        """One transaction: record ``token`` (nothing else if it was recorded), then the
        updates. True when applied. Recording first also serializes two queries racing
        with one token: the second waits on the first's row, then finds it."""
        import psycopg

        with conn.transaction():
            if not self._record_token(conn, token):
                raise psycopg.Rollback()
            if self.keys:
                touched, rows = keyed_changes(updates, columns, self.keys, self.table)
                self._delete_keys(conn, touched)
                _copy(conn, _name(self.table), rows)
            else:
                _copy(conn, _name(self.table), insertions(updates, columns))
                self._delete_rows(conn, retractions(updates, columns), columns, not_null)
            return True
        return False

    def _record_token(self, conn: psycopg.Connection, token: str) -> bool:
        """Record ``token`` in the transaction open on ``conn``; False when it was recorded
        before (its micro-batch was applied: the caller rolls back)."""
        from psycopg import sql

        recorded = conn.execute(
            sql.SQL("INSERT INTO {} (target, token) VALUES (%s, %s) ON CONFLICT DO NOTHING").format(
                _name(self.tokens_table)
            ),
            (self.table, token),
        )
        return recorded.rowcount != 0

    def _stage_batch(
        self, conn: psycopg.Connection, df: DataFrame, columns: list[str], token: str
    ) -> int | None:
        """COPY micro-batch ``df`` from the executors into a fresh staging table (one left
        by an earlier attempt is dropped); the rows staged, or None (nothing staged) when
        ``token`` was applied."""
        from psycopg import sql

        stage = sql.Identifier(stage_name(self.table, token))
        if self.applied(token):
            with conn.transaction():
                conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(stage))
            return None
        with conn.transaction():
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(stage))
            conn.execute(
                sql.SQL("CREATE UNLOGGED TABLE {} AS SELECT {} FROM {} WITH NO DATA").format(
                    stage, sql.SQL(", ").join(map(sql.Identifier, columns)), _name(self.table)
                )
            )
            conn.execute(
                sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint, ADD COLUMN {} integer").format(
                    stage, sql.Identifier(DIFF), sql.Identifier(PART)
                )
            )
        copy = functools.partial(
            _copy_partition, self.url, stage_name(self.table, token), [*columns, DIFF]
        )
        counts = df.select(*columns, DIFF).mapInArrow(copy, "rows long").collect()
        return sum(int(r.rows) for r in counts)

    def _commit_staged(
        self,
        conn: psycopg.Connection,
        staged: int,
        columns: list[str],
        not_null: frozenset[str],
        token: str,
    ) -> bool:
        """One transaction: record ``token`` (nothing else if it was recorded), apply the
        staging table's ``staged`` rows, drop it. True when applied."""
        import psycopg
        from psycopg import sql

        stage = sql.Identifier(stage_name(self.table, token))
        cols = sql.SQL(", ").join(map(sql.Identifier, columns))
        with conn.transaction():
            if not self._record_token(conn, token):
                raise psycopg.Rollback()
            found = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(stage)).fetchone()
            if found is None or int(found[0]) != staged:
                raise RuntimeError(
                    f"sinks.postgres: staging table {stage_name(self.table, token)} holds "
                    f"{found} rows, the micro-batch staged {staged}: nothing applied (rolled "
                    "back); the micro-batch's replay stages it again"
                )
            if self.keys:
                self._apply_staged_keyed(conn, stage, columns)
            else:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {t} ({c}) SELECT {c} FROM {s}, generate_series(1, {s}.{d}) "
                        "WHERE {s}.{d} > 0"
                    ).format(t=_name(self.table), c=cols, s=stage, d=sql.Identifier(DIFF))
                )
                scratch = sql.Identifier("persist_sink_retractions")
                conn.execute(
                    sql.SQL(
                        "CREATE TEMP TABLE {r} ON COMMIT DROP AS SELECT {c}, "
                        "(-sum({d}))::bigint AS {n} FROM {s} WHERE {d} < 0 GROUP BY {c}"
                    ).format(
                        r=scratch, c=cols, d=sql.Identifier(DIFF), n=sql.Identifier(COUNT), s=stage
                    )
                )
                total = conn.execute(
                    sql.SQL("SELECT coalesce(sum({}), 0) FROM {}").format(
                        sql.Identifier(COUNT), scratch
                    )
                ).fetchone()
                self._delete_counted(
                    conn, scratch, columns, not_null, int(total[0]) if total else 0
                )
            conn.execute(sql.SQL("DROP TABLE {}").format(stage))
            return True
        with conn.transaction():
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(stage))
        return False

    def _apply_staged_keyed(
        self, conn: psycopg.Connection, stage: sql.Identifier, columns: list[str]
    ) -> None:
        """:func:`keyed_changes` in SQL over the staging table: refuse keys that do not
        identify the rows, delete every touched key, insert the rows that survive."""
        from psycopg import sql

        cols = sql.SQL(", ").join(map(sql.Identifier, columns))
        keys = sql.SQL(", ").join(map(sql.Identifier, self.keys))
        net = sql.Identifier("persist_sink_net")
        n = sql.Identifier(COUNT)
        conn.execute(
            sql.SQL(
                "CREATE TEMP TABLE {net} ON COMMIT DROP AS SELECT {c}, sum({d})::bigint AS {n} "
                "FROM {s} GROUP BY {c} HAVING sum({d}) <> 0"
            ).format(net=net, c=cols, d=sql.Identifier(DIFF), n=n, s=stage)
        )
        low, high = conn.execute(
            sql.SQL("SELECT coalesce(min({n}), 0), coalesce(max({n}), 0) FROM {net}").format(
                n=n, net=net
            )
        ).fetchone() or (0, 0)
        if low < -1 or high > 1:
            raise InvalidUsage(
                f"sinks.postgres({self.table!r}): with keys {list(self.keys)} a row's net diff "
                f"in one micro-batch is within [-1, 1], here [{low}, {high}]: the keys do not "
                "identify the shard's rows (give the shard's key columns, or no keys for a "
                "table of every row)"
            )
        doubled = conn.execute(
            sql.SQL(
                "SELECT {k}, count(*) FROM {net} WHERE {n} = 1 GROUP BY {k} HAVING count(*) > 1 "
                "LIMIT 1"
            ).format(k=keys, net=net, n=n)
        ).fetchone()
        if doubled is not None:
            raise InvalidUsage(
                f"sinks.postgres({self.table!r}): key {list(doubled[:-1])} has {doubled[-1]} "
                f"rows after the micro-batch: the keys {list(self.keys)} do not identify the "
                "shard's rows (give the shard's key columns, or no keys for a table of every row)"
            )
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{k} = s.{k}").format(k=sql.Identifier(k)) for k in self.keys
        )
        conn.execute(
            sql.SQL("DELETE FROM {} t USING (SELECT DISTINCT {} FROM {}) s WHERE {}").format(
                _name(self.table), keys, net, match
            )
        )
        conn.execute(
            sql.SQL("INSERT INTO {t} ({c}) SELECT {c} FROM {net} WHERE {n} = 1").format(
                t=_name(self.table), c=cols, net=net, n=n
            )
        )

    def _delete_keys(self, conn: psycopg.Connection, touched: pa.Table) -> None:
        """Delete every row whose key is in ``touched``."""
        from psycopg import sql

        if touched.num_rows == 0:
            return
        scratch = sql.Identifier("persist_sink_keys")
        keys = sql.SQL(", ").join(map(sql.Identifier, self.keys))
        conn.execute(
            sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                scratch, keys, _name(self.table)
            )
        )
        _copy(conn, scratch, touched)
        match = sql.SQL(" AND ").join(
            sql.SQL("t.{k} = s.{k}").format(k=sql.Identifier(k)) for k in self.keys
        )
        conn.execute(
            sql.SQL("DELETE FROM {} t USING {} s WHERE {}").format(
                _name(self.table), scratch, match
            )
        )

    def _delete_rows(
        self,
        conn: psycopg.Connection,
        doomed: pa.Table,
        columns: list[str],
        not_null: frozenset[str],
    ) -> None:
        """Delete :data:`COUNT` copies of each row of ``doomed``; SinkDiverged (rolled back)
        when the table has fewer."""
        from psycopg import sql

        if doomed.num_rows == 0:
            return
        scratch = sql.Identifier("persist_sink_retractions")
        conn.execute(
            sql.SQL("CREATE TEMP TABLE {} ON COMMIT DROP AS SELECT {} FROM {} WITH NO DATA").format(
                scratch, sql.SQL(", ").join(map(sql.Identifier, columns)), _name(self.table)
            )
        )
        conn.execute(
            sql.SQL("ALTER TABLE {} ADD COLUMN {} bigint").format(scratch, sql.Identifier(COUNT))
        )
        _copy(conn, scratch, doomed)
        self._delete_counted(
            conn, scratch, columns, not_null, int(pc.sum(doomed.column(COUNT)).as_py())
        )

    def _delete_counted(
        self,
        conn: psycopg.Connection,
        scratch: sql.Identifier,
        columns: list[str],
        not_null: frozenset[str],
        expected: int,
    ) -> None:
        """Delete :data:`COUNT` copies of each row of table ``scratch`` (``expected`` in
        all); SinkDiverged (rolled back) when the table has fewer.

        A row is matched by every column (``IS NOT DISTINCT FROM`` where NULL is allowed),
        which PostgreSQL can only join row by row: retracting R rows from a table of T rows
        cost T x R comparisons (20,000 x 5,000: 1.8 s). So the rows are first matched by
        their text (``ROW(...)::text``, which sorts and hashes: 21 ms there), the exact
        comparison kept as the join's filter. Two equal values with different texts (-0.0
        and 0.0) would escape that match: when it deletes fewer rows than retracted, the
        row-by-row match runs instead (the first rolled back), and only its count decides.
        """
        from psycopg import sql

        exact = sql.SQL(" AND ").join(
            sql.SQL("t.{c} {op} s.{c}").format(
                c=sql.Identifier(c),
                op=sql.SQL("=" if c in not_null else "IS NOT DISTINCT FROM"),
            )
            for c in columns
        )

        def delete(match: sql.Composable) -> int:
            return conn.execute(
                sql.SQL(
                    "DELETE FROM {t} WHERE ctid = ANY (ARRAY("
                    "SELECT m.ctid FROM (SELECT t.ctid, s.{n} AS n, "
                    "row_number() OVER (PARTITION BY s.ctid ORDER BY t.ctid) AS k "
                    "FROM {t} t JOIN {s} s ON {match}) m WHERE m.k <= m.n))"
                ).format(t=_name(self.table), s=scratch, n=sql.Identifier(COUNT), match=match)
            ).rowcount

        def text(alias: str) -> sql.Composable:
            return sql.SQL("ROW({})::text").format(
                sql.SQL(", ").join(sql.Identifier(alias, c) for c in columns)
            )

        deleted = -1
        if not not_null.issuperset(columns):  # with every column compared by =, PG hashes it
            with contextlib.suppress(_Unmatched), conn.transaction():
                deleted = delete(sql.SQL("{} = {} AND {}").format(text("t"), text("s"), exact))
                if deleted != expected:
                    raise _Unmatched  # rolls the savepoint back
        if deleted != expected:
            deleted = delete(exact)
        if deleted != expected:
            raise SinkDiverged(
                f"sinks.postgres: the micro-batch retracts {expected} rows but table "
                f"{self.table!r} holds only {deleted} of them: it no longer equals the shard "
                "(changed by another writer, or its tokens were deleted). Nothing of the "
                "micro-batch was applied; rebuild the table from the shard (a new consumer "
                "from the snapshot into an empty table)"
            )


class _Unmatched(Exception):
    """The match by text deleted fewer rows than retracted (rolled back to its savepoint)."""


def stage_name(table: str, token: str) -> str:
    """The staging table of ``token``'s micro-batch into ``table``: the same on a replay."""
    digest = hashlib.sha256(f"{table}\0{token}".encode()).hexdigest()[:32]
    return f"{STAGE_PREFIX}{digest}"


def _copy_partition(
    url: str, stage: str, columns: list[str], batches: Iterator[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """On an executor (``mapInArrow``): COPY one partition's rows into ``stage``; yields its
    row count. One transaction that first deletes what an earlier attempt of the partition
    staged, under a lock on (stage, partition): a retried or speculative task leaves one
    attempt's rows."""
    import psycopg
    from psycopg import sql
    from pyspark import TaskContext

    context = TaskContext.get()
    assert context is not None, "_copy_partition runs in a Spark task"
    part = context.partitionId()
    rows = 0
    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s), %s)", (stage, part))
        conn.execute(
            sql.SQL("DELETE FROM {} WHERE {} = %s").format(
                sql.Identifier(stage), sql.Identifier(PART)
            ),
            (part,),
        )
        for batch in batches:
            table = pa.Table.from_batches([batch]).select(columns)
            table = table.append_column(PART, pa.array([part] * table.num_rows, pa.int32()))
            _copy(conn, sql.Identifier(stage), table)
            rows += table.num_rows
    yield pa.RecordBatch.from_pydict({"rows": pa.array([rows], pa.int64())})


def _copy(conn: psycopg.Connection, target: sql.Composable, rows: pa.Table) -> None:
    """``COPY`` ``rows`` into ``target`` (their columns, by name), as CSV in slices."""
    from psycopg import sql

    if rows.num_rows == 0:
        return
    statement = sql.SQL("COPY {} ({}) FROM STDIN (FORMAT csv)").format(
        target, sql.SQL(", ").join(map(sql.Identifier, rows.column_names))
    )
    with conn.cursor().copy(statement) as copy:
        for start in range(0, rows.num_rows, COPY_ROWS):
            copy.write(csv_payload(rows.slice(start, COPY_ROWS)))


def _name(table: str) -> sql.Identifier:
    """``name`` or ``schema.name`` as a quoted identifier."""
    from psycopg import sql

    return sql.Identifier(*table.split("."))


def _safe(url: str) -> str:
    """``url`` without a password, for messages."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    user, host = rest.rsplit("@", 1)
    return f"{scheme}://{user.split(':', 1)[0]}@{host}"
