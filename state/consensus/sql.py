"""SQL Consensus on SQLite (the embedded default) or PostgreSQL, via SQLAlchemy Core.

All rows live in one table, ``consensus(shard, sequence_number, data)`` with
primary key ``(shard, sequence_number)``. compare_and_set is a single
conditional ``INSERT ... SELECT ... WHERE <head is expected>``: it inserts the
row only if the head is what the caller expected. Because the new SeqNo must be
``expected + 1``, two racers that both pass the WHERE insert the same primary
key and the database lets at most one commit; the loser gets a unique
violation, reported as :class:`CaSMismatch`. The happy path is therefore one
statement. On PostgreSQL (autocommit) a connection that ran a CaS in the last
``_PG_REUSE_S`` seconds is kept checked out for the next one and checked locally
first: its socket must have nothing to read (a server restart or a terminated
backend leaves an EOF or an error message there, the one thing an idle CaS
connection ever receives). So a busy writer's CaS is one round trip; any other
goes through the pool's pre-ping, a second round trip. Either check tells a
connection already broken, to be discarded (surely not applied), from a CaS
whose outcome is unknown.

The compare-and-set, the one statement on every write's path, runs straight on
the driver's connection (the statement compiled by SQLAlchemy once): SQLite's
on one connection kept checked out for it, PostgreSQL's on a recently used one
(see above) or one the pool hands out (pre-pinged). SQLAlchemy's per-call
connection, transaction and result objects cost about as much as SQLite's own
work. Everything else goes through SQLAlchemy Core.

The table is created by the first compare_and_set into a database that
lacks it (``CREATE TABLE IF NOT EXISTS``); opening a store (which touches
PostgreSQL not at all, and opens or creates a SQLite file) and every read
only SELECT, so read-only tools work with a role that may not create or
write anything, and a read of a database without the table sees no shards.

SQLite specifics: WAL (readers never block the writer), ``synchronous=FULL``
(a committed CaS survives power loss) and ``BEGIN IMMEDIATE`` for writes, so a
writer takes the write lock up front (waiting up to ``busy_timeout``) instead
of failing mid-transaction with SQLITE_BUSY_SNAPSHOT.

Retries (:mod:`pyspark_persist.state.retry`): every operation retries
transient failures with jittered backoff until the deadline (60 s, or the
command's ``retry_timeout_s``): a refused, reset or closed connection, a
server shutting down or starting up, too many connections, a serialization
failure or deadlock, SQLite's "database is locked". Pooled connections are
pinged before use (``pool_pre_ping``) and a connection that failed is
discarded, never reused. Permanent failures (authentication, a missing
database, no privilege) fail at once.

Error mapping: a failure that persists past the deadline, or a permanent
one, raises :class:`~pyspark_persist.state.errors.StoreUnavailable` naming
the store, the operation and how long it was retried (nothing happened). A
connection lost after a CaS statement was sent raises
:class:`~pyspark_persist.state.errors.Indeterminate` at once, unretried: the
commit may have landed, and only the caller can tell whether retrying is
safe. Passwords never appear in :attr:`SqlConsensus.uri` or in messages.
"""

from __future__ import annotations

import functools
import os
import re
import sqlite3
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from select import POLLIN, poll
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    LargeBinary,
    MetaData,
    Table,
    Text,
    bindparam,
    create_engine,
    delete,
    event,
    exists,
    func,
    insert,
    literal_column,
    select,
)
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import (
    ArgumentError,
    DBAPIError,
    IntegrityError,
    InterfaceError,
    OperationalError,
    SQLAlchemyError,
)
from sqlalchemy.pool import PoolProxiedConnection
from sqlalchemy.schema import CreateTable

from .. import retry
from ..errors import (
    Indeterminate,
    InvalidUri,
    InvalidUsage,
    StoreUnavailable,
)
from . import (
    CaSCommitted,
    CaSManyMismatch,
    CaSManyResult,
    CaSMismatch,
    CaSOp,
    CaSResult,
    Consensus,
    SeqNo,
    VersionedData,
)
from .mem import check_cas_args, check_cas_many_args, check_scan_limit

T = TypeVar("T")

DEFAULT_TABLE = "consensus"
DEFAULT_CONNECT_TIMEOUT_S = 5
"""libpq's default is to wait forever; a dead host should fail an open in seconds."""

_BUSY_TIMEOUT_MS = 10_000
_PG_REUSE_S = 10.0
"""A PostgreSQL CaS connection idle longer than this goes back to the pool (pinged before its
next use): a socket that broke silently (a NAT's timeout, no FIN) shows nothing to read, so the
local check only vouches for a connection a CaS used moments ago."""
_PG_KEEP = 2
"""PostgreSQL CaS connections kept checked out at most (the rest go back to the pool, which the
store's reads share)."""
_WRITE_OPTION = "persist_write"
"""Execution option marking a SQLite transaction that must start with BEGIN IMMEDIATE."""

_IDENTIFIER_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_SECRET_QUERY_KEYS = ("password",)

_POSTGRES_HINT = (
    "is PostgreSQL running and reachable? check host, port, database and user "
    "(passwords come from the URI, PGPASSWORD or ~/.pgpass)"
)
_POSTGRES_REFUSED_HINT = (
    "PostgreSQL refused it: check the user, its password and its privileges on the consensus "
    "table (a read-only role can run read-only commands only)"
)
_SQLITE_HINT = "check that the path names a file (not a directory) in a writable directory"


@functools.cache
def consensus_table(name: str = DEFAULT_TABLE) -> Table:
    """The Consensus table (declared once per name; BYTEA on PostgreSQL, BLOB on SQLite)."""
    return Table(
        name,
        MetaData(),
        Column("shard", Text, primary_key=True),
        Column("sequence_number", BigInteger, primary_key=True, autoincrement=False),
        Column("data", LargeBinary, nullable=False),
    )


class _Statements:
    """Every statement the backend runs, built once per store so SQLAlchemy's compiled
    cache makes each execution a lookup, not a compile."""

    def __init__(self, table: Table) -> None:
        shard = bindparam("shard", type_=Text)
        seqno = table.c.sequence_number
        mine = table.c.shard == shard
        new_row = select(
            shard,
            bindparam("new", type_=BigInteger),
            bindparam("data", type_=LargeBinary),
        )
        columns = ["shard", "sequence_number", "data"]
        head_seqno = select(func.max(seqno)).where(mine).scalar_subquery()
        # SQLAlchemy memoizes rowcount only for UPDATE/DELETE unless told to;
        # without this an INSERT reports -1 on psycopg.
        self.cas = (
            insert(table)
            .from_select(
                columns, new_row.where(head_seqno == bindparam("expected", type_=BigInteger))
            )
            .execution_options(preserve_rowcount=True)
        )
        self.cas_new_key = (
            insert(table)
            .from_select(columns, new_row.where(~exists(select(literal_column("1")).where(mine))))
            .execution_options(preserve_rowcount=True)
        )
        self.head_seqno = select(func.max(seqno)).where(mine)
        self.head = select(seqno, table.c.data).where(mine).order_by(seqno.desc()).limit(1)
        self.scan = (
            select(seqno, table.c.data)
            .where(mine, seqno >= bindparam("from_seqno", type_=BigInteger))
            .order_by(seqno)
        )
        # The EXISTS guard makes the DELETE itself refuse to remove the head,
        # so there is no read-then-delete race; truncate() reads the head only
        # when nothing was deleted, to tell "nothing older" from "past the head".
        at_or_above = bindparam("seqno", type_=BigInteger)
        self.truncate = delete(table).where(
            mine,
            seqno < at_or_above,
            exists(select(literal_column("1")).where(mine, seqno >= at_or_above)),
        )
        self.list_keys = select(table.c.shard).distinct()
        self.create = CreateTable(table, if_not_exists=True)


_OPEN: weakref.WeakSet[SqlConsensus] = weakref.WeakSet()


def _dispose_after_fork() -> None:
    """Drop (without closing) pooled connections a forked child inherited from its parent.

    A socket or SQLite handle shared by two processes corrupts both sides'
    protocol state; ``close=False`` leaves the parent's connections intact.
    """
    for consensus in list(_OPEN):
        consensus._engine.dispose(close=False)
        # The CaS connection too: kept referenced, never closed nor reset by this process.
        _INHERITED.append(consensus._cas_connection)
        _INHERITED.extend(fairy for fairy, _ in consensus._pg_idle)
        consensus._cas_connection = None
        consensus._pg_idle = []
        consensus._cas_lock = threading.Lock()


_INHERITED: list[Any] = []
"""Connections a forked child inherited checked out: held so they are never finalized here."""


os.register_at_fork(after_in_child=_dispose_after_fork)


class SqlConsensus(Consensus):
    """Consensus in one SQL table on SQLite or PostgreSQL. See the module doc."""

    def __init__(self, engine: Engine, table: Table, uri: str, password: str | None) -> None:
        self._engine = engine
        self._sqlite = engine.dialect.name == "sqlite"
        self._stmts = _Statements(table)
        self._uri = uri
        self._password = password
        self._hint = _SQLITE_HINT if self._sqlite else _POSTGRES_HINT
        self._cas_lock = threading.Lock()
        self._cas_connection: PoolProxiedConnection | None = None
        """SQLite: the pooled connection compare-and-sets run on, kept checked out."""
        self._pg_idle: list[tuple[PoolProxiedConnection, float]] = []
        """PostgreSQL: connections kept checked out after a CaS, with when it ended
        (``time.monotonic``); guarded by ``_cas_lock``."""
        self._compiled: dict[int, tuple[Any, str, tuple[str, ...] | None]] = {}
        self._pg_many = _pg_many_sql(table.name)
        """Statements run on the driver directly, by id: (statement, SQL, positional names)."""
        _OPEN.add(self)
        if self._sqlite:
            # Open the file now (creating it, as an embedded store should), so a path
            # that cannot be a database fails here rather than at the first read.
            try:
                self._run(
                    lambda conn: conn.exec_driver_sql("SELECT 1"), write=False, what="opening"
                )
            except BaseException:
                self.close()
                raise

    @classmethod
    def from_uri(cls, uri: str) -> SqlConsensus:
        """Open ``sqlite:///path``, ``postgresql://...`` (or ``postgres://``,
        ``postgresql+psycopg://``); ``?table=NAME`` picks another table name."""
        try:
            url = make_url(uri)
        except (ArgumentError, ValueError):
            # The parser's message may echo the whole URI, password included.
            raise InvalidUri(
                "malformed consensus URI: use sqlite:///path or "
                "postgresql://user@host:port/database"
            ) from None
        table_name = url.query.get("table", DEFAULT_TABLE)
        if not isinstance(table_name, str) or not _IDENTIFIER_RE.match(table_name):
            raise InvalidUri(
                f"consensus table name {table_name!r} must be one SQL identifier "
                "(letters, digits, '_'; not starting with a digit; at most 63 characters)"
            )
        password = url.password or url.query.get("password")
        if not isinstance(password, str):
            password = None
        backend, _, driver = url.drivername.partition("+")
        engine_url = url.difference_update_query(["table"])
        if backend == "sqlite":
            if driver not in ("", "pysqlite"):
                raise InvalidUri(f"unsupported SQLite driver {driver!r}: use sqlite:///path")
            engine_url, uri_url = _sqlite_urls(engine_url, url)
            engine = _sqlite_engine(engine_url)
        elif backend in ("postgresql", "postgres"):
            if driver not in ("", "psycopg"):
                raise InvalidUri(
                    f"unsupported PostgreSQL driver {driver!r}: use postgresql:// (psycopg 3)"
                )
            uri_url = url
            engine = _postgres_engine(engine_url.set(drivername="postgresql+psycopg"))
        else:
            raise InvalidUri(
                f"not a SQL consensus URI: {_redact(url)}; use sqlite:///path or postgresql://..."
            )
        return cls(engine, consensus_table(table_name), _redact(uri_url), password)

    @property
    def uri(self) -> str:
        """The URI with the password removed (libpq then falls back to PGPASSWORD/.pgpass)."""
        return self._uri

    def head(self, key: str) -> VersionedData | None:
        """Return the newest row of ``key`` (one indexed lookup), or ``None``."""

        def work(conn: Connection) -> VersionedData | None:
            row = conn.execute(self._stmts.head, {"shard": key}).first()
            return None if row is None else VersionedData(int(row[0]), bytes(row[1]))

        return self._run(
            work, write=False, what=f"reading the head of {key!r}", no_table=lambda: None
        )

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """Append ``new`` iff the head SeqNo is ``expected``: one conditional INSERT.

        The current head is read (a second query) only when the INSERT lost.
        """
        check_cas_args(expected, new)

        sql, args = self._cas_sql(key, expected, new)
        what = f"compare_and_set on {key!r}"
        if self._sqlite:
            direct = functools.partial(self._sqlite_cas_attempt, [(sql, args)])
        else:
            direct = functools.partial(self._postgres_cas_attempt, sql, args, 1)
        committed = self._run(None, write=True, what=what, cas=True, direct=direct)
        if committed:
            return CaSCommitted()
        return CaSMismatch(self._head_seqno(key))

    def compare_and_set_many(self, ops: Sequence[CaSOp]) -> CaSManyResult:
        """Append every row iff every head is as expected, in one database transaction.

        SQLite: one conditional INSERT per key inside one ``BEGIN IMMEDIATE``
        transaction, rolled back at the first that inserts nothing (all in
        process: no round trips to save). PostgreSQL: one statement, so one
        round trip, inserting every row from arrays iff no key's head differs
        from its expected one; a racer's row at the same (shard, SeqNo) makes
        it fail whole (a unique violation), like the single-key CaS. The heads
        are read (a second query) only when it lost.
        """
        ops = check_cas_many_args(ops)
        keys = ", ".join(repr(key) for key, _, _ in ops)
        what = f"compare_and_set_many on {keys}"
        direct: Callable[[], bool]
        if self._sqlite:
            statements = [self._cas_sql(key, expected, new) for key, expected, new in ops]
            direct = functools.partial(self._sqlite_cas_attempt, statements)
        else:
            args = {
                "shards": [key for key, _, _ in ops],
                "news": [new.seqno for _, _, new in ops],
                "datas": [new.data for _, _, new in ops],
                "expected": [expected for _, expected, _ in ops],
            }
            direct = functools.partial(self._postgres_cas_attempt, self._pg_many, args, len(ops))
        if self._run(None, write=True, what=what, cas=True, direct=direct):
            return CaSCommitted()
        heads = {key: self._head_seqno(key) for key, _, _ in ops}
        return CaSManyMismatch({k: h for k, e, _ in ops if (h := heads[k]) != e})

    def _cas_sql(
        self, key: str, expected: SeqNo | None, new: VersionedData
    ) -> tuple[str, dict[str, Any] | tuple[Any, ...]]:
        """The conditional INSERT of one key's row, as the driver's SQL and arguments."""
        stmt = self._stmts.cas_new_key if expected is None else self._stmts.cas
        params = {"shard": key, "new": new.seqno, "data": new.data, "expected": expected}
        sql, names = self._driver_sql(stmt)
        return sql, params if names is None else tuple(params[n] for n in names)

    def scan(self, key: str, from_seqno: SeqNo, limit: int | None = None) -> list[VersionedData]:
        """Return rows of ``key`` with SeqNo >= ``from_seqno``, ascending, at most ``limit``."""
        check_scan_limit(limit)
        stmt = self._stmts.scan if limit is None else self._stmts.scan.limit(limit)

        def work(conn: Connection) -> list[VersionedData]:
            rows = conn.execute(stmt, {"shard": key, "from_seqno": from_seqno})
            return [VersionedData(int(seqno), bytes(data)) for seqno, data in rows]

        return self._run(work, write=False, what=f"scanning {key!r}", no_table=list)

    def truncate(self, key: str, seqno: SeqNo) -> int:
        """Delete rows of ``key`` below ``seqno``; InvalidUsage if that would delete the head.

        The guarded DELETE cannot remove the head even under races; the head
        is read only when it deleted nothing, to tell "nothing older" from
        "seqno is past the head".
        """

        def work(conn: Connection) -> int:
            return conn.execute(self._stmts.truncate, {"shard": key, "seqno": seqno}).rowcount

        deleted = self._run(work, write=True, what=f"truncating {key!r}", no_table=lambda: 0)
        if deleted == 0:
            head = self._head_seqno(key)
            if head is None or seqno > head:
                raise InvalidUsage(
                    f"truncate({key!r}, {seqno}) would delete the head (head SeqNo: {head})"
                )
        return deleted

    def list_keys(self) -> list[str]:
        """Return every key with at least one row, sorted by code point.

        Sorted in Python, not SQL, so the order does not depend on the
        database's collation and matches the other backends.
        """

        def work(conn: Connection) -> list[str]:
            return sorted(str(shard) for (shard,) in conn.execute(self._stmts.list_keys))

        return self._run(work, write=False, what="listing keys", no_table=list)

    def close(self) -> None:
        """Close every pooled connection."""
        _OPEN.discard(self)
        with self._cas_lock:
            self._drop_cas_connection(invalidate=False)
            idle, self._pg_idle = self._pg_idle, []
        for fairy, _ in idle:
            fairy.close()
        self._engine.dispose()

    def _create_table(self) -> None:
        """Create the table; only the first compare_and_set into a new database needs it."""

        def work(conn: Connection) -> None:
            try:
                conn.execute(self._stmts.create)
            except IntegrityError:
                # PostgreSQL: a concurrent creator got in between our IF NOT EXISTS
                # check and our insert into the catalog; the table exists now.
                pass

        self._run(work, write=True, what="creating the consensus table")

    def _head_seqno(self, key: str) -> SeqNo | None:
        def work(conn: Connection) -> SeqNo | None:
            current = conn.execute(self._stmts.head_seqno, {"shard": key}).scalar()
            return None if current is None else int(current)

        return self._run(
            work, write=False, what=f"reading the head SeqNo of {key!r}", no_table=lambda: None
        )

    def _run(
        self,
        work: Callable[[Connection], T] | None,
        *,
        write: bool,
        what: str,
        cas: bool = False,
        no_table: Callable[[], T] | None = None,
        direct: Callable[[], T] | None = None,
    ) -> T:
        """Run ``work`` in one transaction, retrying transient failures (:mod:`..retry`).

        ``cas``: a connection lost after the statement was sent may have
        committed: :class:`Indeterminate`, never retried here. Every other
        write is idempotent or guarded, so its transient failures are retried
        like reads'. ``no_table``: the answer of a read when the table does
        not exist yet (it is created by the first compare_and_set, so opening
        a store, and every read, needs only SELECT). ``direct``: a CaS attempt
        straight on the driver's connection (:meth:`_sqlite_cas_attempt`,
        :meth:`_postgres_cas_attempt`), run instead of ``work``.
        """

        def attempt() -> T:
            if direct is not None:
                return direct()
            assert work is not None
            try:
                conn = self._engine.connect()
            except SQLAlchemyError as exc:
                raise _Failed(exc, self._detail(exc), sent=False) from exc
            with conn:
                try:
                    conn.execution_options(**{_WRITE_OPTION: write})
                    conn.begin()
                except DBAPIError as exc:
                    raise _Failed(exc, self._detail(exc), sent=False) from exc
                try:
                    result = work(conn)
                    conn.commit()
                    return result
                except DBAPIError as exc:
                    kind = self._kind(exc)
                    if kind == _NO_TABLE and no_table is not None:
                        return no_table()
                    if kind == _TRANSIENT:
                        # Never hand a connection that failed mid-use back to the pool.
                        conn.invalidate()
                    raise _Failed(exc, self._detail(exc), sent=True) from exc

        def transient(exc: Exception) -> bool:
            if not isinstance(exc, _Failed):
                return False
            kind = self._kind(exc.error)
            if kind == _NO_TABLE and cas:
                self._create_table()
                return True
            if kind != _TRANSIENT:
                return False
            # A CaS whose statement reached the server and then lost its connection
            # may have committed: that is for the caller to sort out.
            return not (cas and exc.sent and not self._surely_not_applied(exc.error))

        def gave_up(exc: Exception, w: retry.Watch) -> Exception:
            assert isinstance(exc, _Failed)
            return self._unavailable(what, exc.error, f"gave up {retry.waited(w)}")

        try:
            return retry.call(
                attempt,
                store=f"consensus {self._uri}",
                what=what,
                transient=transient,
                gave_up=gave_up,
            )
        except _Failed as failed:
            exc = failed.error
            if cas and failed.sent and not self._surely_not_applied(exc):
                raise Indeterminate(
                    f"{what} at {self._uri} may or may not have committed: "
                    f"{self._detail(exc)}; read head() to find out"
                ) from exc
            raise self._unavailable(what, exc) from exc

    def _driver_sql(self, stmt: Any) -> tuple[str, tuple[str, ...] | None]:
        """``stmt`` as the SQL the driver runs and its positional parameters' names (None:
        named), compiled once per statement."""
        entry = self._compiled.get(id(stmt))
        if entry is None or entry[0] is not stmt:
            compiled = stmt.compile(dialect=self._engine.dialect)
            names = None if compiled.positiontup is None else tuple(compiled.positiontup)
            entry = self._compiled[id(stmt)] = (stmt, compiled.string, names)
        return entry[1], entry[2]

    def _checkout(self) -> PoolProxiedConnection:
        """A pooled driver connection (pinged first on PostgreSQL); a failure is ``sent=False``.

        The pool raises the driver's own errors (``Engine.connect`` wraps them):
        they are wrapped here as SQLAlchemy's, so they are classified alike.
        """
        dbapi = self._engine.dialect.loaded_dbapi
        try:
            return self._engine.raw_connection()
        except SQLAlchemyError as exc:
            raise _Failed(exc, self._detail(exc), sent=False) from exc
        except dbapi.Error as e:
            error = DBAPIError.instance(None, None, e, dbapi.Error)
            raise _Failed(error, self._detail(error), sent=False) from e

    def _postgres_cas_attempt(self, sql: str, args: Any, rows: int) -> bool:
        """One PostgreSQL compare-and-set (of ``rows`` rows, all or none: one statement)
        straight on a psycopg connection; whether it inserted them.

        The connection is one a CaS used moments ago, checked locally, or the
        pool's, pre-ping included (see the module doc), so a connection a
        server restart broke is replaced before the statement is sent (a
        failure there is ``sent=False``: surely not applied). Then one
        autocommit statement, without SQLAlchemy's per-call connection,
        transaction and result objects. A connection that failed is discarded;
        one that succeeded is kept for the next CaS.
        """
        fairy = self._pg_cas_connection()
        conn = fairy.driver_connection
        assert conn is not None
        dbapi = self._engine.dialect.loaded_dbapi
        try:
            try:
                inserted = int(conn.execute(sql, args).rowcount) == rows
            except dbapi.IntegrityError:
                inserted = False  # a racer inserted this (shard, seqno) first: it won
            except dbapi.Error as e:
                disconnect = self._engine.dialect.is_disconnect(e, conn, None)
                error = DBAPIError.instance(
                    sql, args, e, dbapi.Error, connection_invalidated=disconnect
                )
                if disconnect or self._kind(error) == _TRANSIENT:
                    fairy.invalidate()
                raise _Failed(error, self._detail(error), sent=True) from e
        except BaseException as e:
            if not isinstance(e, _Failed):
                fairy.invalidate()  # state unknown: never reuse it
            fairy.close()  # back to the pool (a no-op once invalidated)
            raise
        with self._cas_lock:
            if len(self._pg_idle) < _PG_KEEP:
                self._pg_idle.append((fairy, time.monotonic()))
                return inserted
        fairy.close()
        return inserted

    def _pg_cas_connection(self) -> PoolProxiedConnection:
        """A connection a CaS used in the last ``_PG_REUSE_S`` seconds whose socket has
        nothing to read; else the pool's (pinged).

        A goodbye still in flight when the check runs (a restart that very
        moment) is not seen: the CaS then goes out and fails ``Indeterminate``,
        as any statement does whose connection dies around its send.
        """
        while True:
            with self._cas_lock:
                if not self._pg_idle:
                    break
                fairy, used = self._pg_idle.pop()
            if time.monotonic() - used > _PG_REUSE_S:
                fairy.close()  # the pool pings it before handing it out again
            elif _untouched(fairy):
                return fairy
            else:
                fairy.invalidate()  # closed by the server (or spoken to): never reuse it
        return self._checkout()

    def _sqlite_cas_attempt(self, statements: list[tuple[str, Any]]) -> bool:
        """One SQLite compare-and-set (of one row per statement, all or none) on the
        connection kept checked out for them; whether every statement inserted its row.

        What the general attempt does (BEGIN IMMEDIATE, the conditional
        INSERTs, COMMIT, or ROLLBACK at the first that inserted nothing;
        failures classified alike), straight on the sqlite3
        connection with the statement SQLAlchemy compiled once: its per-call
        checkout, transaction objects and begin event cost as much as
        SQLite's own work. A connection that failed mid-use is discarded.
        """
        with self._cas_lock:
            fairy = self._cas_connection
            if fairy is None:
                fairy = self._cas_connection = self._checkout()
            conn = fairy.driver_connection
            assert isinstance(conn, sqlite3.Connection)
            sent = False
            try:
                conn.execute("BEGIN IMMEDIATE")
                sent = True
                for sql, args in statements:
                    try:
                        inserted = conn.execute(sql, args).rowcount == 1
                    except sqlite3.IntegrityError:
                        inserted = False  # a racer inserted this (shard, seqno) first: it won
                    if not inserted:
                        conn.execute("ROLLBACK")
                        return False
                conn.execute("COMMIT")
                return True
            except sqlite3.Error as e:
                error = DBAPIError.instance(statements[0][0], None, e, sqlite3.Error)
                if conn.in_transaction:
                    try:
                        conn.rollback()
                    except sqlite3.Error:
                        self._drop_cas_connection(invalidate=True)
                if self._kind(error) == _TRANSIENT:
                    self._drop_cas_connection(invalidate=True)
                raise _Failed(error, self._detail(error), sent=sent) from e
            except BaseException:
                self._drop_cas_connection(invalidate=True)  # state unknown: never reuse it
                raise

    def _drop_cas_connection(self, *, invalidate: bool) -> None:
        fairy, self._cas_connection = self._cas_connection, None
        if fairy is None:
            return
        if invalidate:
            fairy.invalidate()
        else:
            fairy.close()  # back to the pool

    def _kind(self, exc: SQLAlchemyError) -> str:
        """Classify a driver error: transient (retry), a missing table, or permanent."""
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        if self._sqlite:
            text = str(orig if orig is not None else exc)
            if "no such table" in text:
                return _NO_TABLE
            code = getattr(orig, "sqlite_errorcode", None)
            busy = code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED) or "locked" in text
            return _TRANSIENT if busy else _PERMANENT
        state = getattr(orig, "sqlstate", None)
        if state == "42P01":
            return _NO_TABLE
        if state is None:
            # No SQLSTATE: the connection itself failed (refused, reset, closed, timed out).
            connection_level = isinstance(exc, OperationalError | InterfaceError) or (
                isinstance(exc, DBAPIError) and exc.connection_invalidated
            )
            return _TRANSIENT if connection_level else _PERMANENT
        if state.startswith("08") or state in _TRANSIENT_SQLSTATES:
            return _TRANSIENT
        return _PERMANENT

    def _surely_not_applied(self, exc: SQLAlchemyError) -> bool:
        """Whether a failed statement is known not to have committed (so a CaS did not land).

        SQLite's busy/locked refuse before writing. PostgreSQL runs each
        statement in its own transaction (autocommit), so an error the server
        reports for it (a SQLSTATE) means it was rolled back, except for the
        classes that can strike after the commit: connection exceptions (08),
        operator intervention such as a shutdown (57), system and internal
        errors (58, XX). Without a SQLSTATE the connection failed: unknown.
        """
        if self._sqlite:
            return self._kind(exc) in (_TRANSIENT, _NO_TABLE)
        orig = exc.orig if isinstance(exc, DBAPIError) else None
        state = getattr(orig, "sqlstate", None)
        return state is not None and state[:2] not in _AMBIGUOUS_SQLSTATE_CLASSES

    def _unavailable(self, what: str, exc: Exception, waited: str = "") -> StoreUnavailable:
        after = f" ({waited})" if waited else ""
        transient = not isinstance(exc, SQLAlchemyError) or self._kind(exc) != _PERMANENT
        hint = self._hint if transient or self._sqlite else _POSTGRES_REFUSED_HINT
        return StoreUnavailable(
            f"consensus store {self._uri} unavailable while {what}{after}: "
            f"{self._detail(exc)}; {hint}",
            transient=transient,
        )

    def _detail(self, exc: Exception) -> str:
        """The driver's one-line reason (not SQLAlchemy's SQL echo), with any password masked."""
        orig = exc.orig if isinstance(exc, DBAPIError) else exc
        lines = str(orig).strip().splitlines()
        detail = lines[0] if lines else type(orig).__name__
        if self._password:
            detail = detail.replace(self._password, "***")
        return detail


class _Failed(Exception):
    """A driver error of one attempt, and whether its statement may have reached the server."""

    def __init__(self, error: SQLAlchemyError, detail: str, *, sent: bool) -> None:
        super().__init__(detail)
        self.error = error
        self.sent = sent


_TRANSIENT = "transient"
_NO_TABLE = "no table"
_PERMANENT = "permanent"

_AMBIGUOUS_SQLSTATE_CLASSES = frozenset({"08", "57", "58", "XX"})
"""SQLSTATE classes a statement may fail with after its transaction committed."""
_TRANSIENT_SQLSTATES = frozenset(
    {
        "40001",  # serialization_failure
        "40P01",  # deadlock_detected
        "55P03",  # lock_not_available
        "57P01",  # admin_shutdown: the server is stopping (restart in progress)
        "57P02",  # crash_shutdown
        "57P03",  # cannot_connect_now: starting up or shutting down
        "53300",  # too_many_connections
    }
)
"""SQLSTATEs worth retrying (besides class 08, connection exceptions)."""


def _pg_many_sql(table: str) -> str:
    """PostgreSQL's compare_and_set_many: one INSERT of every row (from arrays, so one
    statement serves any number of keys), guarded by no key's head differing from its
    expected one (``IS DISTINCT FROM``: a NULL expected is "no rows")."""
    return (
        f'INSERT INTO "{table}" (shard, sequence_number, data) '
        "SELECT o.shard, o.new, o.data FROM unnest(%(shards)s::text[], %(news)s::bigint[], "
        "%(datas)s::bytea[]) AS o(shard, new, data) WHERE NOT EXISTS (SELECT 1 FROM "
        "unnest(%(shards)s::text[], %(expected)s::bigint[]) AS c(shard, expected) WHERE "
        f'(SELECT max(sequence_number) FROM "{table}" WHERE shard = c.shard) '
        "IS DISTINCT FROM c.expected)"
    )


def _untouched(fairy: PoolProxiedConnection) -> bool:
    """Whether an idle psycopg connection is open with nothing waiting on its socket (a
    terminated backend's error message, or the EOF of a server gone), without a round trip."""
    conn = fairy.driver_connection
    if conn is None or conn.closed or conn.broken:
        return False
    try:
        waiting = poll()
        waiting.register(conn.fileno(), POLLIN)
        return not waiting.poll(0)  # POLLIN, POLLHUP or POLLERR: something came
    except (OSError, ValueError):
        return False


def _redact(url: URL) -> str:
    """Render ``url`` without its password (in the userinfo or the query string)."""
    # URL.set(password=None) means "leave unchanged", so build a fresh URL.
    clean = URL.create(
        drivername=url.drivername,
        username=url.username,
        host=url.host,
        port=url.port,
        database=url.database,
        query=url.difference_update_query(_SECRET_QUERY_KEYS).query,
    )
    return clean.render_as_string(hide_password=False)


def _sqlite_urls(engine_url: URL, url: URL) -> tuple[URL, URL]:
    """Resolve the file to an absolute path (so ``uri`` reopens it from any working
    directory, e.g. a Spark executor) and create its parent directory."""
    path = engine_url.database or ""
    if path in ("", ":memory:") or path.startswith("file:"):
        raise InvalidUri(
            f"SQLite consensus URI {_redact(url)!r} names no file: use sqlite:///relative.db "
            "or sqlite:////abs/path.db (an in-memory database is private to one connection)"
        )
    path = os.path.abspath(path)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as exc:
        raise StoreUnavailable(
            f"cannot create the directory of SQLite consensus {path}: {exc.strerror}; "
            f"{_SQLITE_HINT}"
        ) from exc
    return engine_url.set(database=path), url.set(database=path)


def _sqlite_engine(url: URL) -> Engine:
    """An engine whose connections run WAL + synchronous=FULL and BEGIN IMMEDIATE writes."""
    engine = create_engine(url.set(drivername="sqlite+pysqlite"))

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Take transaction control away from pysqlite, which would otherwise
        # issue a deferred BEGIN of its own before the first write.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        try:
            cursor.execute(f"PRAGMA busy_timeout={_BUSY_TIMEOUT_MS}")
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA synchronous=FULL")
        finally:
            cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Connection) -> None:
        # Reads run as single autocommit statements (WAL gives each a
        # consistent snapshot without blocking writers); writes take the write
        # lock up front so they can never fail with SQLITE_BUSY_SNAPSHOT.
        if conn.get_execution_options().get(_WRITE_OPTION):
            conn.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def _postgres_engine(url: URL) -> Engine:
    """A pooled psycopg 3 engine in autocommit, so a compare_and_set is one statement (after
    the pre-ping that discards connections a server restart broke: see the module doc)."""
    connect_args: dict[str, Any] = {}
    if "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = DEFAULT_CONNECT_TIMEOUT_S
    return create_engine(
        url,
        isolation_level="AUTOCOMMIT",
        pool_pre_ping=True,
        connect_args=connect_args,
    )
