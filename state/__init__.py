"""The shard: a durable, definite, time-varying collection of ``(row, time, diff)`` updates.

This is a Python rebuild of Materialize's *persist*. Everything else in
pyspark_persist (PubSub, the Spark source and sink, the CLI) stands on it,
and nothing here imports Spark.

The story
---------
A *shard* holds updates ``(row, time, diff)``: ``row`` is the user's columns
(an Arrow schema fixed when the shard is created), ``time`` an unsigned
64-bit integer, ``diff`` a signed 64-bit multiplicity (+1 insert, -1
retraction). Two frontiers describe it: ``upper`` (every time before it is
final: no more updates will arrive there) and ``since`` (times before it
have been compacted, so reads must be at or after it).

The data lives in two stores with two small contracts:

- **Blob** (:mod:`.blob`): write-once bytes under keys, ``file://`` (the
  embedded default), ``s3://`` or ``mem://``. Parts (files of updates: Parquet,
  Arrow IPC, or Arrow IPC of the row columns alone for inserts at one time,
  each part's reference naming its format) and rollups (full states) live here.
- **Consensus** (:mod:`.consensus`): a linearizable log per shard, one row per
  SeqNo, changed only by compare-and-set; ``sqlite://`` (the embedded
  default), ``postgresql://`` or ``mem://``. Each row holds a state *diff*.

Every change to a shard is a pure function ``state -> state'``
(:mod:`.commands`) turned into a :class:`~.diff.StateDiff`, which
:class:`~.machine.Machine` compare-and-sets at the next SeqNo, retrying
against fresher state when it loses a race. So every change is
linearizable, and a retry after an unknown outcome is safe: writers carry an
idempotency token, and a commit whose token already landed is reported as
:class:`AlreadyCommitted` instead of being applied twice. Every store
operation retries transient failures (a restarting PostgreSQL, an S3 blip)
until ``retry_timeout_s``, by one policy (:mod:`.retry`) that also logs any
wait longer than a few seconds.

Writing is two-phase: any number of processes stage parts
(:class:`~.staging.BatchBuilder`, bounded memory, streamed into Blob), then one
:meth:`~.write.WriteHandle.compare_and_append_batches` makes them all
visible atomically at ``[expected_upper, new_upper)``. Tiny writes skip Blob
and ride inline in the state diff, which is how a small write costs one
Consensus round trip.

Reading is planning, then fetching. Which parts answer a read is one pure
function of one state, :func:`~.planning.plan_read`: the collection at
``as_of`` (:meth:`~.read.ReadHandle.snapshot`), the updates in ``[lower,
upper)`` (each event of :meth:`~.read.ReadHandle.listen`, a change feed, a
streaming micro-batch), optionally capped and split over tasks. A reader
*leases* the state it planned from, so GC keeps those parts until it is
done; each part is a :class:`~.planning.LeasedPart` any process can fetch.

Maintenance is data too. After each commit the pure
:func:`~.maintenance_policy.requests_after_commit` says whether compaction (merge
adjacent batches, advancing times below ``since``) or GC (delete what no
reader can need, truncate Consensus below a rollup) is due; a background
runner executes the requests, off the writer's path.

Dropping a shard (:mod:`.drop`) leaves a tombstone in Consensus; a shard
created again under the name is a new *incarnation* (an id in its state),
made on the tombstone so its SeqNos go on from the dropped one's. Every
handle, listen and lease stays bound to the incarnation it opened and fails
with :class:`~.errors.ShardDropped` once that one is dropped, never touching
its successor.

Invariants: ``upper`` and ``since`` only advance; batches tile ``[0, upper)``;
a part key is written once and never changed; a committed update is never
lost or applied twice; a shard's SeqNos never repeat, across drops too.

Memory: a writer holds at most ``B * (2N + 1)`` bytes per batch builder
(``B`` = ``part_target_bytes``, ``N`` = ``max_outstanding_parts``); a reader
streams parts and holds about ``3B``.

The public surface is the names this package exports (``__all__``) and the
exceptions of :mod:`.errors`; the Spark connector uses the shard through
them alone (``tests/test_layout.py`` checks it). Inside, pure modules decide
(``state``, ``commands``, ``diff``, ``planning``, ``schema``, ``stats``,
``codec``, ...: functions of their arguments, no store, no clock, no
threads) and the rest do the I/O around them (``machine``, ``versions``,
``read``, ``staging``, ``write``, ``fetch``, ...); the layout test keeps the
list of the pure ones.

Quick start (the embedded default: file:// + sqlite:// under ~/.pyspark-persist):

>>> import pyarrow as pa
>>> from pyspark_persist.state import PersistClient
>>> client = PersistClient.open()
>>> shard = client.open_shard("events", pa.schema([("id", pa.int64()), ("name", pa.string())]))
>>> shard.writer().append(pa.table({"id": [1, 2], "name": ["a", "b"]}))
>>> shard.reader().snapshot_table().to_pylist()
"""

from typing import TYPE_CHECKING, Any

from .blob import Blob, open_blob
from .client import (
    PersistClient,
    Shard,
    default_blob_uri,
    default_consensus_uri,
    default_home,
    validate_shard_name,
)
from .codec import ARROW, ARROW_ROWS, PARQUET
from .commands import AlreadyCommitted, AppendResult, Committed, UpperMismatch
from .config import PersistConfig
from .consensus import open_consensus
from .consumers import validate_consumer_name
from .history import Commit, Replay, state_at
from .keyed import latest_rows
from .logs import configure_from_environment
from .machine import Machine
from .planning import NO_LIMITS, LeasedPart, ReadLimits, ReadPlan, limited_upper, plan_read
from .read import Listen, ListenEvent, ReadHandle, Snapshot, iter_parts
from .registry import blob_kind, consensus_kind
from .retention import parse_retention
from .schema import (
    DIFF,
    DIFF_TYPE,
    TIME,
    TIME_TYPE,
    conform_columns,
    decode_schema,
    encode_schema,
    evolve_schema,
    select_columns,
)
from .staging import BatchBuilder, StagedBatch
from .state import ConsumerState, PartRef, ShardState, Time
from .times import check_readable, describe, parse_time
from .txn_commit import Txn
from .updates import consolidate, repeat_by_diff
from .write import WriteHandle, abandon_staged

if TYPE_CHECKING:
    from .changes import Behind, behind, check_change_range

_LAZY = {"Behind": "changes", "behind": "changes", "check_change_range": "changes"}
"""Public names loaded on first use: only a reader of the change feed needs them, and a Spark
executor that only writes imports this package without loading their module."""

__all__ = [
    "ARROW",
    "ARROW_ROWS",
    "DIFF",
    "DIFF_TYPE",
    "NO_LIMITS",
    "PARQUET",
    "TIME",
    "TIME_TYPE",
    "AlreadyCommitted",
    "AppendResult",
    "BatchBuilder",
    "Behind",
    "Blob",
    "Commit",
    "Committed",
    "ConsumerState",
    "LeasedPart",
    "Listen",
    "ListenEvent",
    "Machine",
    "PartRef",
    "PersistClient",
    "PersistConfig",
    "ReadHandle",
    "ReadLimits",
    "ReadPlan",
    "Replay",
    "Shard",
    "ShardState",
    "Snapshot",
    "StagedBatch",
    "Time",
    "Txn",
    "UpperMismatch",
    "WriteHandle",
    "abandon_staged",
    "behind",
    "blob_kind",
    "check_change_range",
    "check_readable",
    "conform_columns",
    "consensus_kind",
    "consolidate",
    "decode_schema",
    "default_blob_uri",
    "default_consensus_uri",
    "default_home",
    "describe",
    "encode_schema",
    "evolve_schema",
    "iter_parts",
    "latest_rows",
    "limited_upper",
    "open_blob",
    "open_consensus",
    "parse_retention",
    "parse_time",
    "plan_read",
    "repeat_by_diff",
    "select_columns",
    "state_at",
    "validate_consumer_name",
    "validate_shard_name",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # found directly from now on
    return value


# $PERSIST_LOG_LEVEL asks for persist's logs on stderr (state/logs.py); unset, nothing changes.
configure_from_environment()
