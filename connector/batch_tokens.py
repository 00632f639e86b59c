"""``exactly_once(fn)``: a ``foreachBatch`` function told which range of the shard it writes.

A sink outside persist (PostgreSQL, a key-value store, a REST service) can apply a
micro-batch exactly once if it stores, in the same transaction as the micro-batch's
output, a token naming what the micro-batch read, and skips a micro-batch whose token it
already holds. Spark's batch id is no such token: a query restarted without its
checkpoint numbers its micro-batches from 0 again. The persist source's offsets are:
a micro-batch reads the updates between its start and end offsets, a replay of it
(same checkpoint, or a named consumer's planned ranges after a lost one) reads between
the same two, and two different micro-batches of one shard never share both.

So the token is the micro-batch's persist start and end offsets, as canonical JSON,
without what they only observed (``seqno``: the state the offset was computed at,
which a replay computing the same range again may see newer). Spark keeps them in the
micro-batch's logical plan (a ``StreamingDataSourceV2ScanRelation`` with ``startOffset``
and ``endOffset``); the DataFrame ``foreachBatch`` hands over is a ``LogicalRDD`` cut off
from it, so they are read from the query execution Spark runs the sink under (its
``spark.sql.execution.id``), checked to be the same micro-batch. That is classic
PySpark's JVM; under Spark Connect the plan is on the server and :func:`exactly_once`
says so.

:func:`batch_token` (offsets in, token out) is pure; :func:`micro_batch_offsets` reads
the plan.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark_persist.state.errors import InvalidUsage

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

log = logging.getLogger(__name__)

BatchFunction = Callable[["DataFrame", str], Any]
"""What :func:`exactly_once` wraps: ``fn(df, token)``."""

OFFSET_KEYS = frozenset({"shard", "seqno", "upper", "phase"})
"""The fields every persist offset has (``offsets.Offset.to_dict``): how a persist source's
offsets are told from another source's."""

RANGE_FIELDS = ("upper", "phase", "as_of")
"""The fields of an offset that say where it is; ``seqno`` only says when it was seen."""

SCAN_RELATION = "StreamingDataSourceV2ScanRelation"


@dataclass(frozen=True)
class SourceRange:
    """One streaming source's part in a micro-batch: its name (the table Spark shows) and
    its start and end offsets as JSON text (start ``None`` for a query's first micro-batch
    of a source with no initial offset)."""

    source: str
    start: str | None
    end: str


def is_persist_offset(offset_json: str | None) -> bool:
    """Whether ``offset_json`` is a persist offset (``offsets.Offset.to_dict``)."""
    if offset_json is None:
        return False
    try:
        value = json.loads(offset_json)
    except ValueError:
        return False
    return isinstance(value, dict) and OFFSET_KEYS <= value.keys()


def batch_token(start_json: str, end_json: str) -> str:
    """The token of the micro-batch that read a persist shard from ``start_json`` to
    ``end_json``: canonical JSON of the shard, its incarnation and both positions, the same
    whenever the same range is read again, whatever SeqNo each offset was observed at.

    Offsets of two incarnations (the shard dropped and created again between them) have no
    range between them: InvalidUsage (the source itself refuses to read one).
    """
    start, end = json.loads(start_json), json.loads(end_json)
    if start.get("shard") != end.get("shard") or start.get("incarnation", "") != end.get(
        "incarnation", ""
    ):
        raise InvalidUsage(
            f"exactly_once: the micro-batch's start offset {start_json} and end offset "
            f"{end_json} are of different shards or incarnations of one: no range of one "
            "shard lies between them"
        )

    def position(offset: dict[str, Any]) -> list[Any]:
        return [offset.get(field, -1 if field == "as_of" else None) for field in RANGE_FIELDS]

    token = {
        "shard": end["shard"],
        "incarnation": end.get("incarnation", ""),
        "start": position(start),
        "end": position(end),
    }
    return json.dumps(token, sort_keys=True, separators=(",", ":"))


def persist_range(ranges: list[SourceRange]) -> tuple[str, str]:
    """The one persist source's (start, end) among a micro-batch's streaming sources.

    Refused (InvalidUsage, naming what was found): no persist source, more than one, or a
    persist source beside another streaming source (whose part in the output the token
    could not name).
    """
    persist = [r for r in ranges if is_persist_offset(r.end)]
    found = ", ".join(r.source for r in ranges) or "no streaming source Spark reads through DSv2"
    if not persist:
        raise InvalidUsage(
            f"exactly_once: the micro-batch reads {found}, not a persist source: the token "
            "names a range of a persist shard, so the query must read "
            'spark.readStream.format("persist")'
        )
    if len(ranges) > 1:
        raise InvalidUsage(
            f"exactly_once: the micro-batch reads {len(ranges)} streaming sources ({found}); "
            "the token names one persist shard's range, so the query must read exactly one "
            "persist source (union the shards into one first, or run one query per shard)"
        )
    (only,) = persist
    if only.start is None:
        raise InvalidUsage(
            f"exactly_once: the micro-batch of {only.source} has no start offset in its plan"
        )
    return only.start, only.end


def micro_batch_offsets(df: DataFrame, batch_id: int) -> list[SourceRange]:
    """Every streaming source's (start, end) in the plan Spark runs micro-batch ``batch_id``
    of ``df``'s query under.

    ``df`` is the DataFrame ``foreachBatch`` passed, run under the micro-batch's SQL
    execution: that execution's plan (an ``IncrementalExecution``) holds the offsets.
    """
    if type(df).__module__.startswith("pyspark.sql.connect"):
        raise InvalidUsage(
            "exactly_once: this query runs under Spark Connect, where the micro-batch's plan "
            "(and the persist offsets in it) stays on the server: exactly_once needs classic "
            "PySpark. Run the query from a classic session (spark-submit, or "
            "SparkSession.builder.master(...) without .remote(...)); under Connect, key your "
            "writes by the batch id and keep the checkpoint instead"
        )
    session = df.sparkSession
    context = session.sparkContext
    execution_id = context.getLocalProperty("spark.sql.execution.id")
    if execution_id is None:
        raise InvalidUsage(
            "exactly_once: called outside a streaming query's micro-batch: pass the wrapped "
            "function to writeStream.foreachBatch(...) and let Spark call it"
        )
    execution = _sql_execution(context).getQueryExecution(int(execution_id))
    current = getattr(execution, "currentBatchId", None) if execution is not None else None
    if current is None or int(current()) != batch_id:
        raise InvalidUsage(
            f"exactly_once: Spark runs no micro-batch {batch_id} here (SQL execution "
            f"{execution_id}): call the wrapped function only from writeStream.foreachBatch"
        )
    # Every JVM call is a py4j round trip (a fraction of a ms, more on a loaded machine), paid
    # in each micro-batch's latency: a scan relation is a leaf, so the leaves come in one call
    # (not a walk of the whole plan), and an offset in one (Option.toString: the JSON).
    leaves = execution.logical().collectLeaves()
    ranges: list[SourceRange] = []
    for i in range(leaves.size()):
        node = leaves.apply(i)
        if node.nodeName() == SCAN_RELATION:
            ranges.append(
                SourceRange(
                    str(node.relation().name()),
                    _option_text(str(node.startOffset().toString())),
                    _required(_option_text(str(node.endOffset().toString())), "end offset"),
                )
            )
    return ranges


def _option_text(text: str) -> str | None:
    """What a Scala ``Option``'s ``toString`` holds: ``Some(x)`` -> x, ``None`` -> None."""
    if text == "None":
        return None
    if not (text.startswith("Some(") and text.endswith(")")):
        raise ValueError(f"exactly_once: {text!r} is no Scala Option's text")
    return text[len("Some(") : -1]


def _required(value: str | None, what: str) -> str:
    if value is None:
        raise InvalidUsage(f"exactly_once: the micro-batch's plan has no {what}")
    return value


_SQL_EXECUTIONS: dict[int, Any] = {}
"""``SQLExecution``'s JVM class per gateway: resolving it is one py4j call per package name."""


def _sql_execution(context: Any) -> Any:
    """The JVM's ``org.apache.spark.sql.execution.SQLExecution``, looked up once per gateway."""
    jvm = context._jvm  # noqa: SLF001 - classic PySpark's gateway
    assert jvm is not None
    found = _SQL_EXECUTIONS.get(id(jvm))
    if found is None:
        found = _SQL_EXECUTIONS[id(jvm)] = jvm.org.apache.spark.sql.execution.SQLExecution
    return found


def exactly_once(fn: BatchFunction) -> Callable[[DataFrame, int], None]:
    """``foreachBatch(exactly_once(fn))`` calls ``fn(df, token)`` for each micro-batch.

    ``token`` (a string, up to a few hundred characters) names the range of the persist
    shard the micro-batch read: the same when Spark runs the micro-batch again after a
    crash (and, reading through a named ``consumer``, after a lost checkpoint), different
    for every other micro-batch of the shard. Store it with ``fn``'s output in one
    transaction and skip a micro-batch whose token is stored: each range lands once
    (``pyspark_persist.sinks.postgres`` does this for PostgreSQL).

    The query must read one persist source and no other streaming source; classic PySpark
    only (not Spark Connect). A micro-batch that read nothing (start = end: a no-data
    micro-batch) has the token of its empty range.
    """

    def run(df: DataFrame, batch_id: int) -> None:
        start, end = persist_range(micro_batch_offsets(df, batch_id))
        token = batch_token(start, end)
        log.info("micro-batch %d: token %s", batch_id, token)
        fn(df, token)

    return run
