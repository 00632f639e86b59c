"""pyspark_persist: Materialize's persist as a Spark source and sink (``format("persist")``).

- :mod:`pyspark_persist.state`: the shard (Blob + Consensus, writes, reads,
  leases, compaction, GC); no Spark.
- :mod:`pyspark_persist.pubsub`: pushing state diffs between processes.
- ``DefaultSource`` (here): the Spark data source named ``persist``. Spark
  finds it by importing every top-level ``pyspark_*`` module, so this module
  stays cheap and side-effect free: ``DefaultSource`` is resolved on first
  access and importing ``pyspark_persist.state`` never imports Spark.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark_persist.source import PersistDataSource as DefaultSource

__all__ = ["DefaultSource"]


def __getattr__(name: str) -> Any:
    if name == "DefaultSource":
        from pyspark_persist.source import PersistDataSource

        return PersistDataSource
    raise AttributeError(f"module 'pyspark_persist' has no attribute {name!r}")
