"""``spark.read.format("persist").option("history", "true")``: a shard's commits as a DataFrame.

Delta users run ``DESCRIBE HISTORY``; a Python data source cannot add SQL,
so the same table is a read option. One row per commit still described by
Consensus (see :mod:`pyspark_persist.state.history`), oldest first. The
history is small (GC truncates Consensus), so the driver computes it while
planning and the one task only turns it into Arrow.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Sequence

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pyspark_persist.options import PersistOptions
from pyspark_persist.source import client_for
from pyspark_persist.state import Commit

_STRINGS = frozenset({"operation", "writer_id", "columns_added", "txn_id"})
HISTORY_SCHEMA = StructType(
    [
        StructField(f.name, StringType() if f.name in _STRINGS else LongType(), True)
        for f in dataclasses.fields(Commit)
    ]
)
"""The columns of a history read: the fields of :class:`Commit`, in order."""


class HistoryPartition(InputPartition):
    """The one task of a history read: the commits, as JSON."""

    def __init__(self, commits: str) -> None:
        super().__init__(None)
        self.commits = commits


class PersistHistoryReader(DataSourceReader):
    """Reads a shard's commit history (see the module doc)."""

    def __init__(self, opts: PersistOptions) -> None:
        self._opts = opts

    def partitions(self) -> Sequence[InputPartition]:
        """Replay the shard's kept state diffs on the driver (read-only: no reader registered)."""
        shard = client_for(self._opts).open_shard(self._opts.shard, create=False)
        return [HistoryPartition(json.dumps([c.to_dict() for c in shard.history()]))]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """The commits as one Arrow batch in :data:`HISTORY_SCHEMA`."""
        from pyspark_persist.schema import output_arrow_schema

        if not isinstance(partition, HistoryPartition):
            return  # not one of ours: nothing to read
        target = output_arrow_schema(HISTORY_SCHEMA)
        commits = json.loads(partition.commits)
        yield pa.RecordBatch.from_pylist(commits, schema=target)
