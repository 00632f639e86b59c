"""``PersistDataSource``: the Spark data source named ``persist``.

Spark calls the methods here on the driver (in Python workers) to plan;
every reader and writer they return is pickled to executors, so those carry
options and schemas only and open stores lazily where they run.
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import TYPE_CHECKING

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader
from pyspark.sql.types import StructType

from pyspark_persist.options import PersistOptions
from pyspark_persist.state import Blob, PersistClient, Shard, open_blob

if TYPE_CHECKING:
    from pyspark_persist.writer import PersistBatchWriter, PersistStreamWriter

REFREEZE_OBJECTS = 5_000
"""A daemon-forked worker freezes its heap again once this many objects escaped the last
freeze (caches, pooled connections, a client): the per-task collection stays this small."""

_heap_frozen = False


def _forked_by_pyspark_daemon() -> bool:
    """True in a Python worker Spark's daemon forked (``python -m pyspark.daemon``)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None) == "pyspark.daemon"


def freeze_worker_heap() -> None:
    """In a Python worker forked by Spark's daemon, take the objects it holds out of the
    cyclic GC's reach (``gc.freeze``): once after its imports and set-up, and again once
    more than :data:`REFREEZE_OBJECTS` new objects are tracked.

    The daemon runs a full ``gc.collect()`` after every task of a reused worker; it walks
    every tracked object, and pyspark, pyarrow and persist's own modules are ~50,000 of
    them: ~30 ms a task, more CPU than reading a 128 MiB split from mapped parts or
    staging a micro-batch (measured; a profile of a Spark read had the collection at a
    quarter of the workers' samples). Sink tasks, the planner and committer workers that
    call ``streamWriter()``, and read tasks all pay it. What a worker holds when it starts
    a task is its imports and what outlived earlier tasks' collections: long-lived, so
    freezing it loses nothing; a frozen object is still freed when its last reference
    goes, only a cycle among frozen objects would stay. Every task's own cyclic garbage
    is still collected. Any other process (the user's driver, a test) is left alone:
    there nothing collects after every task, and a freeze would keep its cycles for good.
    """
    global _heap_frozen
    if not _forked_by_pyspark_daemon():
        return
    # gc.get_objects() lists only the unfrozen objects: kept under the bound, it is cheap.
    if _heap_frozen and len(gc.get_objects()) <= REFREEZE_OBJECTS:
        return
    _heap_frozen = True
    gc.freeze()


_clients: dict[tuple[str, str, str | None], PersistClient] = {}
_clients_lock = threading.Lock()


def client_for(opts: PersistOptions, *, pubsub: bool = True) -> PersistClient:
    """One client per location (and PubSub setting) per process, reused across micro-batches.

    Spark reuses its Python workers, so a cached client keeps its shared
    state, connections and PubSub subscription from one call to the next.
    ``pubsub=False``: a client of the location without PubSub whatever the
    options say, for a one-off look at the shard where a subscription (or,
    with ``auto``, a PubSub server) would cost more than the look.
    """
    channel = opts.pubsub if pubsub else None
    key = (opts.blob, opts.consensus, channel)
    with _clients_lock:
        client = _clients.get(key)
        if client is None:
            publisher = None
            if channel is not None:
                from pyspark_persist.pubsub import connect

                publisher = connect(channel, opts.consensus)
            client = _clients[key] = PersistClient.open(
                opts.blob, opts.consensus, publisher=publisher
            )
        return client


def open_shard(opts: PersistOptions) -> Shard:
    """The shard to commit to: the state this process holds while PubSub delivers it, else
    ``client_for(opts).open_shard(...)`` (a Consensus read).

    The sink's driver commit needs only an expected upper: while PubSub
    delivers the shard, the state this process holds is Consensus's (every
    push is confirmed against it), and a stale upper is answered by the
    compare-and-set itself (UpperMismatch with the current one), so the
    commit is one round trip. A drop is no PubSub diff, though: a shard
    dropped since makes the compare-and-set find it gone (ShardNotFound,
    nothing committed). That is why the sink's schema check before any task
    (``writer.prepare_shard``) reads Consensus instead of this.
    """
    client = client_for(opts)
    machine = client.machine(opts.shard)
    if machine.shared.state is not None and opts.pubsub is not None and machine.shared.push_healthy:
        return Shard(client, machine)
    return client.open_shard(opts.shard, create=False)


_blobs: dict[str, Blob] = {}


def blob_for(uri: str) -> Blob:
    """One Blob per URI per process: executors reuse it across tasks (Spark reuses workers)."""
    with _clients_lock:
        blob = _blobs.get(uri)
        if blob is None:
            blob = _blobs[uri] = open_blob(uri)
        return blob


def _union_schema(opts: PersistOptions) -> StructType:
    """The schema of a stream of the shards ``opts.shards`` (each must exist)."""
    from pyspark_persist.schema import union_read_schema

    client = client_for(opts, pubsub=False)
    assert opts.shards is not None
    return union_read_schema(
        {name: client.open_shard(name, create=False).schema for name in opts.shards}
    )


class PersistDataSource(DataSource):
    """``spark.read/readStream/write/writeStream.format("persist")`` (docs/spark-options.md)."""

    @classmethod
    def name(cls) -> str:
        """The format name users write."""
        return "persist"

    def schema(self) -> StructType:
        """The shard's columns (those of the ``columns`` option, if given) plus ``_time`` and
        ``_diff`` (the shard must exist to be read). Spark asks only when the user gave no
        ``.schema(...)``; the readers check a given one (``schema.read_columns``)."""
        from pyspark_persist.schema import read_schema

        opts = PersistOptions.parse(self.options, "read_schema")
        if opts.history:
            from pyspark_persist.history_reader import HISTORY_SCHEMA

            return HISTORY_SCHEMA
        # Spark asks once, in a planner worker on the driver: one Consensus read, and no
        # PubSub connection (with pubsub=auto that worker could even end up serving it).
        if opts.shards is not None:
            return _union_schema(opts)
        shard = client_for(opts, pubsub=False).open_shard(opts.shard, create=False)
        columns = shard.schema
        if opts.columns is not None:
            from pyspark_persist.state import select_columns

            columns = select_columns(shard.schema, opts.columns, opts.shard, "persist read")
        return read_schema(columns, opts.change_types)

    def reader(self, schema: StructType) -> DataSourceReader:
        """A batch reader of the consolidated collection at ``asOf`` (or of the changes, or
        with ``history`` of the commits)."""
        from pyspark_persist.batch_reader import make_batch_reader
        from pyspark_persist.schema import check_change_type_column

        opts = PersistOptions.parse(self.options, "read")
        if opts.history:
            from pyspark_persist.history_reader import PersistHistoryReader

            return PersistHistoryReader(opts)
        check_change_type_column(schema, opts.change_types)
        return make_batch_reader(opts, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        """A streaming reader: the snapshot, then every change, with leases held by the driver
        (of several shards with ``shards``: :mod:`pyspark_persist.multi_stream_reader`)."""
        from pyspark_persist.schema import check_change_type_column
        from pyspark_persist.stream_reader import PersistStreamReader

        opts = PersistOptions.parse(self.options, "stream_read")
        if opts.shards is not None:
            from pyspark_persist.multi_stream_reader import MultiShardStreamReader
            from pyspark_persist.schema import check_union_schema

            check_union_schema(schema, _union_schema(opts))
            return MultiShardStreamReader(opts, schema)
        check_change_type_column(schema, opts.change_types)
        return PersistStreamReader(opts, schema)

    def writer(self, schema: StructType, overwrite: bool) -> PersistBatchWriter:
        """A batch writer: append, or (overwrite) atomically replace the shard's contents."""
        from pyspark_persist.writer import PersistBatchWriter

        return PersistBatchWriter(PersistOptions.parse(self.options, "write"), schema, overwrite)

    def streamWriter(self, schema: StructType, overwrite: bool) -> PersistStreamWriter:
        """A streaming writer: one exactly-once compare_and_append per micro-batch."""
        from pyspark_persist.writer import PersistStreamWriter

        return PersistStreamWriter(
            PersistOptions.parse(self.options, "stream_write"), schema, overwrite
        )
