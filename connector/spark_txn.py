"""``pyspark_persist.txn``: a transaction across shards from Spark, for ``foreachBatch``.

::

    def load(df, batch_id):
        with pyspark_persist.txn(df.sparkSession, writerId="etl", txnVersion=batch_id) as t:
            t.append(df.filter("kind = 'order'"), "orders")
            t.append(df.filter("kind = 'item'"), "order_items")

Each ``append`` checks the DataFrame's columns against the shard on the driver
(creating the shard on its first write, as the sink does), then runs one Spark
job, ``df.mapInArrow(...).collect()``: every task stages its rows in Blob
with the sink's own code (:func:`~pyspark_persist.writer.stage_rows`) and
yields the description of what it staged, which the driver hands to a
:class:`~pyspark_persist.state.Txn` (``append_staged``). Leaving the block
commits every shard with one ``compare_and_set_many`` on the driver; an
exception in it commits nothing and deletes what was staged. ``writerId`` and
``txnVersion`` (the micro-batch id) are the transaction's idempotency pair,
recorded in every participant: a replayed micro-batch applies nothing, and
stages nothing for a shard that already holds the version.

A keyed shard's ``upsert`` stages the rows the same way and reads them back on
the driver (as the sink's keyed commit does), where the transaction plans the
upsert at its commit; the rows' staged parts are deleted once read.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from pyspark_persist.options import PersistOptions
from pyspark_persist.source import client_for
from pyspark_persist.state import PersistClient, StagedBatch, Time, Txn
from pyspark_persist.state.errors import InvalidUsage
from pyspark_persist.writer import prepare_shard, stage_rows, staged_rows

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

STAGED = "staged"
"""The one column (binary: a StagedBatch as JSON) of what each staging task yields."""


def txn(
    spark: SparkSession, *, writerId: str, txnVersion: int | None = None, **options: Any
) -> SparkTxn:
    """A transaction across shards whose DataFrames stage on the executors (see the module doc).

    ``writerId`` and ``txnVersion`` are as the sink's batch-write options: the same pair
    again applies nothing (``foreachBatch``: pass its ``batch_id``); without a version the
    transaction claims no idempotency. ``options``: the location (``blob``, ``consensus``,
    ``pubsub``) and any other write option, as ``.option(...)`` of ``format("persist")``
    takes them; ``append``/``upsert`` take more per shard.
    """
    if not writerId:
        raise InvalidUsage(
            'pyspark_persist.txn: give writerId="<your application>": it names the writer '
            "whose txnVersion makes a replayed micro-batch apply nothing"
        )
    if txnVersion is not None and (isinstance(txnVersion, bool) or int(txnVersion) < 0):
        raise InvalidUsage(
            f"pyspark_persist.txn: txnVersion={txnVersion!r} must be an integer 0 or more "
            "(foreachBatch's batch_id)"
        )
    return SparkTxn(spark, writerId, None if txnVersion is None else int(txnVersion), options)


class SparkTxn:
    """One transaction: ``append``/``upsert`` DataFrames, then leave the ``with`` block."""

    def __init__(
        self, spark: SparkSession, writer_id: str, version: int | None, options: dict[str, Any]
    ) -> None:
        self._spark = spark
        self._options = {str(k): str(v) for k, v in options.items()}
        self._version = version
        self._client: PersistClient | None = None
        self._txn: Txn | None = None
        self._writer_id = writer_id

    def _begin(self, opts: PersistOptions) -> Txn:
        """The core transaction, on the location of the first shard named (all share it)."""
        client = client_for(opts)
        if self._client is not None and client is not self._client:
            raise InvalidUsage(
                f"pyspark_persist.txn: shard {opts.shard!r} is in another location than the "
                "transaction's first shard: a transaction's shards share one Consensus; give "
                "the location to pyspark_persist.txn(...), not to append()"
            )
        if self._txn is None:
            self._client = client
            self._txn = client.txn(self._writer_id, self._version)
        return self._txn

    @property
    def txn_id(self) -> str | None:
        """The id recorded on the transaction's commit in every shard (once a shard joined)."""
        return None if self._txn is None else self._txn.txn_id

    @property
    def commit_time(self) -> Time | None:
        """The one time every shard's updates got (after the commit)."""
        return None if self._txn is None else self._txn.commit_time

    @property
    def already_committed(self) -> bool:
        """The commit found ``txnVersion`` already landed (a replay): nothing was applied."""
        return self._txn is not None and self._txn.already_committed

    def append(self, df: DataFrame, shard: str, **options: Any) -> None:
        """Stage ``df``'s rows for ``shard`` on the executors; on a keyed shard, :meth:`upsert`.

        The columns are checked (and the shard created on its first write) before any task
        runs; ``options``: write options for this shard (``upsertKeys`` to create it keyed,
        ``retentionMs``, ``partSizeBytes``).
        """
        opts = self._parse(shard, options)
        schema = prepare_shard(opts, df.schema)
        t = self._begin(opts)
        if schema.keys:
            self._upsert(t, opts, df, schema.staged, schema.has_diff)
            return
        if self._landed(opts):
            t.append_staged(shard, [])
            return
        t.append_staged(shard, self._stage(t, opts, df, schema.staged, schema.has_diff))

    def upsert(self, df: DataFrame, shard: str, **options: Any) -> None:
        """Upsert ``df``'s rows into keyed ``shard`` (``sequenceColumn``, ``deleteColumn`` in
        ``options`` as for the sink); one upsert per keyed shard per transaction."""
        opts = self._parse(shard, options)
        schema = prepare_shard(opts, df.schema)
        if not schema.keys:
            raise InvalidUsage(
                f"pyspark_persist.txn: shard {shard!r} has no keys, so it cannot be upserted: "
                'append() to it, or create it keyed (upsertKeys="id")'
            )
        self._upsert(self._begin(opts), opts, df, schema.staged, schema.has_diff)

    def _upsert(
        self, t: Txn, opts: PersistOptions, df: DataFrame, staged: bytes, has_diff: bool
    ) -> None:
        """Stage the rows, read them back here, and give them to the transaction's upsert."""
        if self._landed(opts):
            rows = client_for(opts).open_shard(opts.shard, create=False).schema.empty_table()
            t.upsert(opts.shard, rows)
            return
        parts = [p for b in self._stage(t, opts, df, staged, has_diff) for p in b.parts]
        shard = client_for(opts).open_shard(opts.shard, create=False)
        try:
            rows = staged_rows(opts, shard, parts)
        finally:
            # No commit references them: the transaction stages the upsert's own updates.
            shard.client.blob.delete_many(p.key for p in parts if p.key is not None)
        t.upsert(
            opts.shard,
            rows,
            sequence_column=opts.sequence_column,
            delete_column=opts.delete_column,
        )

    def _parse(self, shard: str, options: dict[str, Any]) -> PersistOptions:
        opts = PersistOptions.parse(
            {**self._options, **{k: str(v) for k, v in options.items()}, "shard": shard},
            "write",
        )
        if opts.merge_schema:
            raise InvalidUsage(
                "pyspark_persist.txn: mergeSchema is not offered in a transaction: add the "
                "columns with a plain write first, then write the transaction"
            )
        return opts

    def _landed(self, opts: PersistOptions) -> bool:
        """Whether the shard already holds this version of the writer (a replay): staging it
        again would be thrown away. Tokens only go up, so this cannot turn false."""
        if self._version is None:
            return False
        state = client_for(opts).machine(opts.shard).state()
        writer = state.writers.get(self._writer_id)
        return writer is not None and self._version <= writer.last_token

    def _stage(
        self, t: Txn, opts: PersistOptions, df: DataFrame, staged: bytes, has_diff: bool
    ) -> list[StagedBatch]:
        """One Spark job: each task stages its rows and yields what it staged."""

        def stage(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            message = stage_rows(opts, staged, has_diff, batches)
            yield pa.RecordBatch.from_pydict(
                {STAGED: [message.staged.encode()]}, schema=pa.schema([(STAGED, pa.binary())])
            )

        tag = f"persist-txn-{t.txn_id}"
        self._spark.addTag(tag)
        try:
            rows = df.mapInArrow(stage, f"{STAGED} binary").collect()
        finally:
            self._spark.removeTag(tag)
        return [StagedBatch.from_json(json.loads(r[STAGED])) for r in rows]

    def __enter__(self) -> SparkTxn:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Commit every shard at one time; after an exception, commit nothing."""
        if self._txn is None:
            if exc_type is None:
                raise InvalidUsage(
                    "pyspark_persist.txn: the transaction names no shard: append() first"
                )
            return
        self._txn.__exit__(exc_type, exc, tb)
