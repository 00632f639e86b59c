"""The sink: executors stage parts in ``write()``; the driver commits once in ``commit()``.

Every task of a micro-batch stages its rows as Arrow IPC parts in Blob
(``arrow-rows``: the row columns only, their time and diff +1 recorded in
the part's reference), encoded batch by batch as Spark hands them over (bounded memory: parts of
``partSizeBytes``, a bounded number uploading; compaction later rewrites
them as Parquet), and returns a :class:`PersistCommitMessage` naming them; nothing is visible
yet. A task whose rows are tiny (within ``inline_write_max_bytes`` encoded) writes
no part: the rows ride in its message, and the commit puts them inline in state
(or, when state's inline cap is reached, in Blob first). ``commit(messages,
batchId)`` on the driver makes all of them visible in ONE compare_and_append
at a fresh time ``T = max(upper, now in ms)``, retrying when another writer
moved the upper. The commit carries the
idempotency token ``batchId`` under a writer id that is the streaming
query's own id (read from its checkpoint), so a micro-batch replayed after a
crash is answered "already committed" and applied once. ``abort`` deletes
what was staged where no commit can reference it (a commit whose outcome is
unknown may have landed, or land later: see ``abort_staged``); the rest, and
parts of a crashed attempt, are reclaimed by GC's orphan sweep later.

Complete output mode and ``mode("overwrite")`` replace the shard's contents
atomically: the same commit retracts what is there (by reference, no reread)
and inserts the new result.

A write to a keyed shard (created by a first write with ``upsertKeys``) is an
upsert: the tasks stage the rows as above (with the ``deleteColumn``, if
any), and the driver's commit reads them back and upserts them in one
compare_and_append with the micro-batch's token (``WriteHandle.upsert``:
each key's current row retracted, its new row inserted); the staged rows are
deleted once read, as no commit references them. An overwrite of a keyed
shard replaces it with one row per key.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from pyspark_persist.options import DELETE_COLUMN, SEQUENCE_COLUMN, PersistOptions
from pyspark_persist.schema import sink_schema, write_schema
from pyspark_persist.source import blob_for, client_for, freeze_worker_heap, open_shard
from pyspark_persist.state import (
    ARROW,
    ARROW_ROWS,
    DIFF,
    DIFF_TYPE,
    TIME,
    AlreadyCommitted,
    BatchBuilder,
    Committed,
    LeasedPart,
    PartRef,
    PersistConfig,
    Shard,
    StagedBatch,
    UpperMismatch,
    WriteHandle,
    abandon_staged,
    conform_columns,
    decode_schema,
    encode_schema,
    iter_parts,
    latest_rows,
)
from pyspark_persist.state.errors import InvalidUpdates, InvalidUsage, ShardDropped, ShardNotFound

log = logging.getLogger(__name__)

MAX_TIME = 2**64 - 1
"""The largest time: a staged part's updates are read whatever their time."""
METRICS_FILE = "persist-sink-metrics.jsonl"
"""Per-micro-batch sink figures, appended (one JSON object a line) in the checkpoint directory."""
SHARD_RECORD = "persist-sink-shard.json"
"""Which incarnation of its shard a streaming query writes, kept in its checkpoint directory:
``{"shard": name, "incarnation": id}``, written by the query's first micro-batch."""


@dataclass
class PersistCommitMessage(WriterCommitMessage):
    """What one task staged (a StagedBatch as JSON) and how long it took."""

    staged: str
    rows: int
    size_bytes: int
    parts: int
    queued_s: float
    upload_s: float
    task_s: float
    batch_rows: int = 0
    """The most rows Spark handed this task in one Arrow batch (see SinkBatchMetrics)."""


@dataclass
class SinkBatchMetrics:
    """The figures of one committed micro-batch (logged at INFO and appended to METRICS_FILE)."""

    batch_id: int
    outcome: str
    rows: int
    size_bytes: int
    parts: int
    tasks: int
    queued_s: float
    upload_s: float
    commit_s: float
    upper: int
    batch_rows: int = 0
    """The largest Arrow batch Spark handed a task, in rows: at most
    ``spark.sql.execution.arrow.maxRecordsPerBatch``. Below persist's ``read_batch_rows``
    (65,536) the tasks copied Spark's batches together; at it they stored them as they came
    (docs/spark.md, "Bulk writes")."""
    extra: dict[str, Any] = field(default_factory=dict)


def query_writer_id(opts: PersistOptions) -> str:
    """The writer identity of a streaming query: stable across restarts from one checkpoint.

    ``writerId`` if given; else the query id Spark keeps in
    ``<checkpointLocation>/metadata``. A new checkpoint (even one recreated
    under the same path) is a new query id and so a new writer: its batches
    are written, never skipped as a replay of the old query's.
    """
    if opts.writer_id:
        return opts.writer_id
    if not opts.checkpoint_location:
        raise InvalidUsage(
            "persist sink: exactly-once needs a stable query identity: set "
            '.option("checkpointLocation", ...) on writeStream (or .option("writerId", ...))'
        )
    return f"spark-query-{checkpoint_query_id(opts.checkpoint_location)}"


_S3_ALIASES = ("s3a://", "s3n://")
"""Hadoop's names for S3, which Arrow's file systems call ``s3://``."""


def checkpoint_query_id(location: str) -> str:
    """The query id in ``<location>/metadata``, read where the checkpoint lives.

    ``commit`` runs in a Python planner worker with no handle on the JVM (see
    SPARK-API.md), so the file is read with Arrow's file systems: local paths
    and ``file:``, S3 (``s3``/``s3a``/``s3n``, credentials and endpoint from
    the standard AWS variables such as ``AWS_ENDPOINT_URL``), GCS, Azure
    (``abfs``/``abfss``) and HDFS (with libhdfs). Nothing is cached: a
    checkpoint deleted and recreated under the same path has a new id, and a
    stale one would drop the new query's first batches as replays.
    """
    path = location.removeprefix("file://").removeprefix("file:")
    try:
        if "://" not in path:
            with open(os.path.join(path, "metadata"), "rb") as f:
                raw = f.readline()
        else:
            raw = _read_remote(location.rstrip("/") + "/metadata")
        return str(json.loads(raw)["id"])
    except (OSError, ValueError, KeyError, TypeError, pa.ArrowException) as e:
        raise InvalidUsage(
            f"persist sink: cannot read the query id from {location.rstrip('/')}/metadata "
            f"({type(e).__name__}: {e}); exactly-once needs it to tell a new checkpoint from "
            "a restart. Make the checkpoint readable from the driver's Python, or set "
            '.option("writerId", ...) and change it whenever you start a new checkpoint'
        ) from None


def _read_remote(uri: str) -> bytes:
    """The first line of a file on a file system Arrow knows (see checkpoint_query_id)."""
    fs, path = _remote(uri)
    with fs.open_input_stream(path) as f:
        data: bytes = f.read()
    return data.split(b"\n", 1)[0]


def _remote(uri: str) -> tuple[Any, str]:
    """Arrow's file system for ``uri`` (Hadoop's S3 names taken as ``s3://``) and the path in it."""
    import pyarrow.fs

    for alias in _S3_ALIASES:
        if uri.startswith(alias):
            uri = "s3://" + uri.removeprefix(alias)
    return pyarrow.fs.FileSystem.from_uri(uri)


def recorded_incarnation(location: str, shard: str) -> str | None:
    """The incarnation of ``shard`` the streaming query of checkpoint ``location`` writes, as its
    first micro-batch recorded it (:data:`SHARD_RECORD`); ``None`` before that, or when the
    query wrote another shard then (a query renamed to write elsewhere starts afresh)."""
    uri = location.rstrip("/") + "/" + SHARD_RECORD
    path = uri.removeprefix("file://").removeprefix("file:")
    try:
        if "://" not in path:
            with open(path, "rb") as f:
                raw = f.read()
        else:
            raw = _read_remote(uri)
        record = json.loads(raw)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, pa.ArrowException) as e:
        if isinstance(e, OSError) and "not found" in str(e).lower():
            return None  # Arrow's file systems say so in the message
        raise InvalidUsage(
            f"persist sink: cannot read {uri} ({type(e).__name__}: {e}), which records the "
            "shard incarnation this query writes; make the checkpoint readable from the "
            "driver's Python, or start the query with a new checkpointLocation"
        ) from None
    if not isinstance(record, dict) or record.get("shard") != shard:
        return None
    return str(record.get("incarnation", ""))


def record_incarnation(location: str, shard: str, incarnation: str) -> None:
    """Write :data:`SHARD_RECORD` in checkpoint ``location`` (whole or not at all)."""
    uri = location.rstrip("/") + "/" + SHARD_RECORD
    data = json.dumps({"shard": shard, "incarnation": incarnation}).encode()
    path = uri.removeprefix("file://").removeprefix("file:")
    if "://" not in path:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        return
    if uri.startswith(("s3://", *_S3_ALIASES)):
        # boto3, not Arrow: Arrow's S3 output stream ends with a multipart upload, and pyarrow
        # 26 read an S3-compatible server's (moto's) 200 OK to it as an error.
        import boto3

        bucket, _, key = uri.split("://", 1)[1].partition("/")
        boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=data)
        return
    fs, remote = _remote(uri)
    with fs.open_output_stream(remote) as out:  # object stores make it visible whole at close
        out.write(data)


@dataclass(frozen=True)
class SinkSchema:
    """What the driver decided about a write's columns, before any task runs."""

    staged: bytes
    """The schema tasks stage with (encoded): the shard's, plus new columns under mergeSchema."""
    has_diff: bool
    """The DataFrame carries its own ``_diff`` column."""
    evolves: bool
    """The write adds columns: its commit carries ``staged`` to add them in the same step."""
    incarnation: str
    """The incarnation of the shard checked against: the commit refuses any other one."""
    keys: tuple[str, ...] = ()
    """The shard's key columns: a keyed shard's writes upsert (see the module doc)."""


def prepare_shard(
    opts: PersistOptions, schema: StructType, expected: str | None = None
) -> SinkSchema:
    """Create the shard on first write, or check the DataFrame against it; before any task.

    ``expected``: the incarnation a streaming query recorded at its first micro-batch. Once
    that shard is dropped, the query fails with ShardDropped rather than create the shard
    again, or write into one created again under its name.
    """
    arrow, has_diff = write_schema(schema)
    arrow, delete_field = _without_delete_column(opts, arrow)
    # Consensus, not the PubSub-confirmed state this process may hold: a drop (by another
    # process) pushes nothing, and a new query must find the shard gone and create it again,
    # not be checked against (and commit onto) the dropped one. One read, ~0.3 ms.
    client = client_for(opts)
    keys = opts.upsert_keys
    try:
        shard = client.open_shard(
            opts.shard, create=False, retention_ms=opts.retention_ms, keys=keys
        )
    except ShardNotFound:
        if expected is not None:
            raise _dropped(opts, expected) from None
        shard = client.open_shard(
            opts.shard, arrow, create=True, retention_ms=opts.retention_ms, keys=keys
        )
    state = shard.machine.state()
    incarnation = state.incarnation
    if expected is not None and incarnation != expected:
        raise _dropped(opts, expected)
    _check_keyed(opts, state.keys, has_diff)
    current = shard.schema
    staged = sink_schema(current, arrow, shard.name, opts.merge_schema)
    evolves = not staged.equals(current)
    if delete_field is not None:
        staged = staged.append(delete_field)
    return SinkSchema(encode_schema(staged), has_diff, evolves, incarnation, state.keys)


def _without_delete_column(
    opts: PersistOptions, arrow: pa.Schema
) -> tuple[pa.Schema, pa.Field | None]:
    """The DataFrame's columns to store, and its ``deleteColumn`` (checked boolean), if any."""
    name = opts.delete_column
    if name is None:
        return arrow, None
    idx = arrow.get_field_index(name)
    if idx < 0:
        raise InvalidUpdates(
            f"persist sink: {opts.spelled(DELETE_COLUMN)} {name!r} is not a column of the "
            f"DataFrame ({', '.join(arrow.names)}): name its boolean delete column"
        )
    field = arrow.field(idx)
    if not pa.types.is_boolean(field.type):
        raise InvalidUpdates(
            f"persist sink: {opts.spelled(DELETE_COLUMN)} {name!r} is {field.type}: it must be "
            f"boolean (true: delete the key), e.g. col({name!r}).cast('boolean')"
        )
    return arrow.remove(idx), field


def _check_keyed(opts: PersistOptions, keys: tuple[str, ...], has_diff: bool) -> None:
    """Refuse key options on an unkeyed shard, and hand-made diffs on a keyed one."""
    if not keys:
        given = [opts.spelled(s) for s in (DELETE_COLUMN, SEQUENCE_COLUMN) if opts.said.get(s)]
        if given:
            raise InvalidUsage(
                f"persist sink: {' and '.join(given)} apply to a keyed shard, and shard "
                f'{opts.shard!r} has no keys: create it with .option("upsertKeys", "id")'
            )
    elif has_diff:
        raise InvalidUsage(
            f"persist sink: shard {opts.shard!r} is keyed by {list(keys)}: every write upserts, "
            "so a _diff column cannot be written to it; drop _diff (deletes: deleteColumn)"
        )


def _dropped(opts: PersistOptions, incarnation: str) -> ShardDropped:
    """The error of a write whose shard (``incarnation``) was dropped since it was planned."""
    query = (
        f"this streaming query (checkpoint {opts.checkpoint_location}) first wrote"
        if opts.checkpoint_location
        else "this write was planned against"
    )
    return ShardDropped(
        f"persist sink: shard {opts.shard!r} was dropped (persist shards drop) after {query} "
        f"it (incarnation {incarnation or 'unnamed'}); nothing of this micro-batch or job was "
        "committed, and a shard created again under that name is never written by it. "
        "Restart the query with a new checkpointLocation (or re-run the batch write) to write "
        "the shard of that name now"
    )


def stage_rows(
    opts: PersistOptions, shard_schema: bytes, has_diff: bool, batches: Iterator[pa.RecordBatch]
) -> PersistCommitMessage:
    """Executor side: stage one task's rows as parts; return what was staged."""

    started = time.perf_counter()
    freeze_worker_heap()
    schema = decode_schema(shard_schema)
    staged = schema.append(pa.field(DIFF, DIFF_TYPE)) if has_diff else schema
    # Spark's columns are all nullable: cast to nullable fields and leave a null in a column
    # the shard declares non-nullable to the builder, which names it. Shard columns the
    # DataFrame lacks are written null (Delta's rule; the driver checked they are nullable).
    target = pa.schema([f.with_nullable(True) for f in staged])
    config = PersistConfig(
        part_target_bytes=opts.part_size_bytes or PersistConfig.part_target_bytes
    )
    # Rows with no _diff of their own are inserts at the commit's one time: their parts
    # store the row columns only (arrow-rows); a DataFrame carrying _diff stages it too.
    # A task whose rows encode within inline_write_max_bytes stages nothing in Blob: its
    # rows travel in the commit message, and the driver's commit puts them in state.
    fmt = ARROW if has_diff else ARROW_ROWS
    builder = BatchBuilder(blob_for(opts.blob), opts.shard, schema, config, part_format=fmt)
    batch_rows = 0
    try:
        for rb in batches:
            batch_rows = max(batch_rows, rb.num_rows)
            if rb.num_rows:
                table = _in_target(pa.Table.from_batches([rb]), target)
                if has_diff:
                    builder.add(table)
                else:
                    builder.add_inserts(table)
        staged = builder.finish()
    except BaseException:
        builder.abort()
        raise
    return PersistCommitMessage(
        staged=json.dumps(staged.to_json()),
        rows=staged.rows,
        size_bytes=staged.size_bytes,
        parts=len(staged.parts),
        queued_s=builder.queued_s,
        upload_s=builder.upload_s,
        task_s=time.perf_counter() - started,
        batch_rows=batch_rows,
    )


def _in_target(table: pa.Table, target: pa.Schema) -> pa.Table:
    """``table`` with ``target``'s columns, in its types. Spark marks some columns
    non-nullable (``spark.range``'s id) that the target has nullable: for those types are
    equal and only the schema changes, over the same arrays, at a third of a cast's cost."""
    table = conform_columns(table, target)
    if table.schema.equals(target):
        return table
    if table.schema.types == target.types:
        return pa.Table.from_arrays(table.columns, schema=target)
    return table.cast(target)


def _staged(messages: list[WriterCommitMessage | None]) -> list[PersistCommitMessage]:
    return [m for m in messages if isinstance(m, PersistCommitMessage)]


def commit_staged(
    opts: PersistOptions,
    writer_id: str,
    token: int,
    messages: list[WriterCommitMessage | None],
    replace: bool,
    incarnation: str,
    schema: bytes | None = None,
) -> SinkBatchMetrics:
    """Driver side: make every task's parts visible in one compare_and_append, exactly once.

    ``incarnation``: the shard's that the write was planned against (ShardDropped for any
    other: the shard was dropped meanwhile). ``schema`` (a mergeSchema write adding columns)
    joins the same commit.

    One Consensus round trip when nothing races: the expected upper is the
    one this process holds, and a stale one is answered with the current
    upper (UpperMismatch), which the next attempt uses.
    """
    started = time.perf_counter()
    msgs = _staged(messages)
    shard = open_shard(opts)
    if shard.machine.state().incarnation != incarnation:
        raise _dropped(opts, incarnation)
    writer = shard.writer(writer_id)
    staged = [StagedBatch.from_json(json.loads(m.staged)) for m in msgs]
    keys = shard.machine.state().keys
    if keys:
        result = _commit_keyed(opts, shard, writer, token, staged, replace, keys)
    else:
        result = _commit(writer, token, staged, replace, schema)
    outcome = "committed" if isinstance(result, Committed) else "already committed"
    return SinkBatchMetrics(
        batch_id=token,
        outcome=outcome,
        rows=sum(m.rows for m in msgs),
        size_bytes=sum(m.size_bytes for m in msgs),
        parts=sum(m.parts for m in msgs),
        tasks=len(msgs),
        queued_s=round(sum(m.queued_s for m in msgs), 6),
        upload_s=round(sum(m.upload_s for m in msgs), 6),
        commit_s=round(time.perf_counter() - started, 6),
        upper=result.upper,
        batch_rows=max((m.batch_rows for m in msgs), default=0),
        extra={"committed_token": result.token} if isinstance(result, AlreadyCommitted) else {},
    )


def _commit(
    writer: WriteHandle,
    token: int,
    batches: list[StagedBatch],
    replace: bool,
    schema: bytes | None,
) -> Committed | AlreadyCommitted:
    """Commit staged batches at a fresh time, retrying races with the same token."""
    staged = writer.fit_inline(batches)
    upper = writer.upper
    while True:
        t = max(upper, time.time_ns() // 1_000_000)
        result = writer.compare_and_append_batches(
            staged,
            upper,
            t + 1,
            token=token,
            ts_rewrite=t,
            delete_on_mismatch=False,
            replace=replace,
            schema=None if schema is None else decode_schema(schema),
        )
        if not isinstance(result, UpperMismatch):
            return result
        upper = result.current


def _commit_keyed(
    opts: PersistOptions,
    shard: Shard,
    writer: WriteHandle,
    token: int,
    batches: list[StagedBatch],
    replace: bool,
    keys: tuple[str, ...],
) -> Committed | AlreadyCommitted:
    """Upsert (or, with ``replace``, replace by one row per key) the rows the tasks staged.

    A replayed micro-batch is answered ``AlreadyCommitted`` before its rows are read. The
    rows are read back on the driver, and their staged parts deleted once the commit is
    decided: no commit ever references them (the upsert stages its own updates).
    """
    state = shard.machine.state()
    done = state.writers.get(writer.writer_id)
    parts = [p for b in batches for p in b.parts]
    try:
        if done is not None and token <= done.last_token:
            return AlreadyCommitted(token=done.last_token, upper=state.upper)
        rows = staged_rows(opts, shard, parts)
        if not replace:
            return writer.upsert(
                rows,
                token=token,
                sequence_column=opts.sequence_column,
                delete_column=opts.delete_column,
            )
        kept = latest_rows(
            rows,
            shard.schema,
            keys,
            shard.name,
            delete_column=opts.delete_column,
            sequence=opts.sequence_column,
        )
        builder = writer.builder()
        try:
            builder.add(kept)
            staged = builder.finish()
        except BaseException:
            builder.abort()
            raise
        return _commit(writer, token, [staged], True, None)
    finally:
        shard.client.blob.delete_many(p.key for p in parts if p.key is not None)


def staged_rows(opts: PersistOptions, shard: Shard, parts: list[PartRef]) -> pa.Table:
    """The rows the tasks staged (the row columns and the delete column), read on the driver."""
    blob = shard.client.blob
    leased = [LeasedPart(shard.name, blob.uri, p, 0, MAX_TIME, None, 0) for p in parts]
    tables = [t.drop_columns([TIME, DIFF]) for t in iter_parts(blob, leased)]
    if tables:
        return pa.concat_tables(tables)
    schema = shard.schema
    if opts.delete_column is not None:
        schema = schema.append(pa.field(opts.delete_column, pa.bool_()))
    return schema.empty_table()


def abort_staged(opts: PersistOptions, messages: list[WriterCommitMessage | None]) -> None:
    """Delete the parts the tasks staged that no commit can reference (driver, after a failure).

    Spark calls ``abort`` once the commit raised (or was never called), in a
    planner worker that may not be the commit's, so nothing here knows what
    the commit attempted. An attempt whose reply was lost may have landed, or
    be in flight and land later (Spark's replay then says "already
    committed"): :func:`~pyspark_persist.state.write.abandon_staged` fences
    those off with a no-op compare-and-set and deletes only what no state
    references; if it cannot, the orphan sweep takes the parts after
    ``staged_part_grace_s``.
    """
    parts = [
        p for m in _staged(messages) for p in StagedBatch.from_json(json.loads(m.staged)).parts
    ]
    if not any(p.key is not None for p in parts):
        return
    abandon_staged(client_for(opts).open_shard(opts.shard, create=False).machine, parts)


def _report(metrics: SinkBatchMetrics, checkpoint: str | None) -> None:
    record = json.dumps(metrics.__dict__)
    log.info("persist sink: %s", record)
    if checkpoint is None:
        return
    path = checkpoint.removeprefix("file://").removeprefix("file:")
    if os.path.isdir(path):
        with open(os.path.join(path, METRICS_FILE), "a") as f:
            f.write(record + "\n")


def read_sink_metrics(checkpoint_location: str) -> list[dict[str, Any]]:
    """The per-micro-batch figures a streaming query's persist sink recorded, oldest first."""
    path = checkpoint_location.removeprefix("file://").removeprefix("file:")
    try:
        with open(os.path.join(path, METRICS_FILE)) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


class PersistStreamWriter(DataSourceStreamArrowWriter):
    """``df.writeStream.format("persist")``: append, or complete mode as an atomic replace."""

    def __init__(self, opts: PersistOptions, schema: StructType, overwrite: bool) -> None:
        self._opts = opts
        self._writer_id = query_writer_id(opts)
        checkpoint = opts.checkpoint_location
        expected = None if checkpoint is None else recorded_incarnation(checkpoint, opts.shard)
        self._schema = prepare_shard(opts, schema, expected)
        if checkpoint is not None and expected is None:
            # The query's first micro-batch: from here on it writes this incarnation only.
            record_incarnation(checkpoint, opts.shard, self._schema.incarnation)
        self._replace = overwrite
        # Spark builds this writer in a pooled planner worker twice a micro-batch (to plan
        # the tasks and to commit): the worker's daemon collects after each call.
        freeze_worker_heap()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PersistCommitMessage:
        """Stage this task's rows (executor)."""
        return stage_rows(self._opts, self._schema.staged, self._schema.has_diff, iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Commit the micro-batch exactly once (driver)."""
        evolves = self._schema.staged if self._schema.evolves else None
        metrics = commit_staged(
            self._opts,
            self._writer_id,
            batchId,
            messages,
            self._replace,
            self._schema.incarnation,
            evolves,
        )
        _report(metrics, self._opts.checkpoint_location)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Delete what the micro-batch staged (driver)."""
        abort_staged(self._opts, messages)


class PersistBatchWriter(DataSourceArrowWriter):
    """``df.write.format("persist")``: ``mode("append")`` or ``mode("overwrite")`` (atomic).

    Idempotency follows Delta's model. With ``writerId`` and ``txnVersion``
    the job commits with token ``txnVersion`` under the writer ``writerId``:
    the same (or a lower) version again is skipped, and says so in the log; a
    higher one is written. That is what makes a re-run of one logical write
    (a ``foreachBatch`` retry passing its batch id) apply once. Without a
    version the write claims no idempotency: it commits under a writer
    identity of its own, so it always lands, whatever else used ``writerId``.
    """

    def __init__(self, opts: PersistOptions, schema: StructType, overwrite: bool) -> None:
        self._opts = opts
        if opts.writer_id is not None and opts.txn_version is not None:
            self._writer_id, self._token = opts.writer_id, opts.txn_version
        else:
            # One identity per write, so its token 1 is only ever this write's own retry.
            prefix = opts.writer_id or "spark-batch"
            self._writer_id, self._token = f"{prefix}.unversioned-{os.urandom(12).hex()}", 1
        self._schema = prepare_shard(opts, schema)
        self._replace = overwrite

    def write(self, iterator: Iterator[pa.RecordBatch]) -> PersistCommitMessage:
        """Stage this task's rows (executor)."""
        return stage_rows(self._opts, self._schema.staged, self._schema.has_diff, iterator)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        """Commit the whole job in one compare_and_append (driver); skip a done version."""
        evolves = self._schema.staged if self._schema.evolves else None
        metrics = commit_staged(
            self._opts,
            self._writer_id,
            self._token,
            messages,
            self._replace,
            self._schema.incarnation,
            evolves,
        )
        if metrics.outcome != "committed":
            # Its staged parts stay for GC's orphan sweep: if this very commit landed and was
            # compacted since, a reader may still hold them.
            log.info(
                "persist batch write skipped: %s",
                json.dumps(
                    {
                        "shard": self._opts.shard,
                        "writer_id": self._writer_id,
                        "txn_version": self._token,
                        "committed_version": metrics.extra["committed_token"],
                        "reason": "this writerId already committed this txnVersion or a higher one",
                    }
                ),
            )
        _report(metrics, None)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        """Delete what the job staged (driver)."""
        abort_staged(self._opts, messages)
