"""The options of ``format("persist")``, parsed once into a frozen dataclass.

Spark hands options over case-insensitively (it lower-cases the keys before the
source sees them), and adds some of its own: ``path`` (or ``paths``) from
``.load(path)`` / ``.save(path)`` / ``.start(path)``, ``checkpointLocation`` and
``queryName`` for streaming writes. Every name persist accepts, its own and
Spark's, is one line of :data:`OPTIONS`: the spelling users read in docs and
errors, the setting it feeds, and the operations it applies to. An alias (the
``path`` Spark passes for the shard name, or another system's name for one of
persist's settings) is one more line naming the same setting.

Unknown keys (with a "did you mean" when one is close), keys that do not apply
to the operation (a read limit on a write), malformed values and contradictory
combinations are all errors that name the option, in the spelling the user
gave, and the fix, raised on the driver before any task runs.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from pyspark_persist.state import (
    blob_kind,
    consensus_kind,
    default_blob_uri,
    default_consensus_uri,
    parse_retention,
    parse_time,
    validate_consumer_name,
    validate_shard_name,
)
from pyspark_persist.state.errors import InvalidUri, InvalidUsage

Purpose = Literal["read", "stream_read", "read_schema", "write", "stream_write"]

# The settings: each the lower-cased name of its main option, which is how parse() keys them.
SHARD = "shard"
SHARDS = "shards"
BLOB = "blob"
CONSENSUS = "consensus"
PUBSUB = "pubsub"
PUBSUB_POLL = "pubsubpollms"
STARTING_POSITION = "startingposition"
STARTING_AS_OF = "startingasof"
STARTING_TIME = "startingtime"
STARTING_SEQNO = "startingseqno"
READ_CHANGES = "readchanges"
ENDING_TIME = "endingtime"
ENDING_SEQNO = "endingseqno"
HISTORY = "history"
CHANGE_TYPES = "changetypes"
METRICS_FILE = "metricsfile"
AS_OF = "asof"
MAX_BYTES = "maxbytespertrigger"
MAX_FILES = "maxfilespertrigger"
MAX_ROWS = "maxrowspertrigger"
SPLIT_SIZE = "splitsizebytes"
MIN_PARTITIONS = "minpartitions"
FAIL_ON_DATA_LOSS = "failondataloss"
WRITER_ID = "writerid"
TXN_VERSION = "txnversion"
LEASE_SECONDS = "leaseseconds"
PART_SIZE = "partsizebytes"
RETENTION = "retention"
MERGE_SCHEMA = "mergeschema"
UPSERT_KEYS = "upsertkeys"
DELETE_COLUMN = "deletecolumn"
SEQUENCE_COLUMN = "sequencecolumn"
CHECKPOINT = "checkpointlocation"
FILTER_PUSHDOWN = "filterpushdown"
COLUMNS = "columns"
QUERY_NAME = "queryname"
PATHS = "paths"
CONSUMER = "consumer"
CONSUMER_EXPIRY = "consumerexpiry"

DEFAULT_SPLIT_SIZE = 128 << 20
"""Spark's own ``spark.sql.files.maxPartitionBytes``. At 64 MiB a 1 GiB read made 16 tasks,
which on 2 cores took 1.35-1.48x the time of 2 or 4 (bench-report/history.md, 2026-11-27)."""
DEFAULT_MIN_PARTITIONS = 1
DEFAULT_PUBSUB_POLL_MS = 1000
"""How stale a streaming source's cached answer may be while PubSub pushes look healthy."""

_ALL: frozenset[Purpose] = frozenset({"read", "stream_read", "write", "stream_write"})
_READS: frozenset[Purpose] = frozenset({"read", "stream_read"})
_WRITES: frozenset[Purpose] = frozenset({"write", "stream_write"})
_READ: frozenset[Purpose] = frozenset({"read"})
_STREAM_READ: frozenset[Purpose] = frozenset({"stream_read"})
_STREAM_WRITE: frozenset[Purpose] = frozenset({"stream_write"})
_BATCH_WRITE: frozenset[Purpose] = frozenset({"write"})


@dataclass(frozen=True)
class OptionDoc:
    """What the docs say of one setting: its row of the options table in
    ``docs/spark-options.md``, which ``docs/hooks.py`` builds from :data:`OPTIONS`."""

    default: str
    meaning: str
    """What it does, ending with an example (``e.g. ...``); Markdown."""
    applies: str = ""
    """Where it applies, when its operations say too little (``stream read, change feed``)."""


@dataclass(frozen=True)
class OptionName:
    """One name ``format("persist")`` accepts: its spelling, the setting it feeds, and where."""

    spelling: str
    setting: str
    purposes: frozenset[Purpose]
    peers: str = ""
    """The other systems that spell a name so ("Delta", "Delta, Kafka"): for an alias, whose
    name it is; for persist's own name of a setting, who shares it."""
    doc: OptionDoc | None = None
    """The setting's documentation, on persist's own name of it (the one whose lower-cased
    spelling is the setting); aliases and the names Spark passes itself have none."""


_CAP = (
    "cap one micro-batch at this many {what}, the first snapshot included (whole persist "
    "batches; at least one). Set one limit at most; a capped snapshot is cut by time (see "
    "[Read limits](#read-limits)), e.g. `{example}`"
)

OPTIONS: tuple[OptionName, ...] = (
    OptionName(
        "shard",
        SHARD,
        _ALL,
        doc=OptionDoc(
            "—",
            "shard name (or the `load()`/`save()`/`start()` path): letters, digits, `_ - .`, at "
            'most 200, e.g. `.load("events")`',
        ),
    ),
    OptionName(
        "shards",
        SHARDS,
        _STREAM_READ,
        doc=OptionDoc(
            "—",
            "instead of `shard`: stream several shards in one source, comma-separated; rows "
            "carry the shard's name in `_shard`, columns are the union of the shards' "
            "(nullable), and no micro-batch splits a [transaction](transactions.md) (see "
            "[Several shards in one stream](spark.md#several-shards-in-one-stream)), e.g. "
            "`orders,order_items`",
        ),
    ),
    OptionName("path", SHARD, _ALL),  # Spark's, from .load(path) / .save(path) / .start(path)
    OptionName("paths", PATHS, _READS),  # Spark's, from .load([p1, p2]): refused, one shard
    OptionName(
        "blob",
        BLOB,
        _ALL,
        doc=OptionDoc(
            "`file://$PERSIST_HOME/blob`",
            "Blob URI (see [Locations](configuration.md#locations-uris)), e.g. "
            "`s3://bucket/prefix`",
        ),
    ),
    OptionName(
        "consensus",
        CONSENSUS,
        _ALL,
        doc=OptionDoc(
            "`sqlite:///$PERSIST_HOME/consensus.db`",
            "Consensus URI, e.g. `postgresql://persist@db:5432/persist`",
        ),
    ),
    OptionName(
        "pubsub",
        PUBSUB,
        _ALL,
        doc=OptionDoc(
            "off",
            "`host:port` (gRPC server), `auto` (embedded default: first reader serves on "
            "loopback), `postgres` (LISTEN/NOTIFY), e.g. `auto`",
        ),
    ),
    OptionName(
        "pubsubPollMs",
        PUBSUB_POLL,
        _STREAM_READ,
        doc=OptionDoc(
            str(DEFAULT_PUBSUB_POLL_MS),
            "with `pubsub` set, how stale `latestOffset`'s answer from the PubSub-confirmed "
            "state may be: Consensus is read at least this often anyway, since a push may be "
            "lost (`0`: on every `latestOffset`; see [PubSub](pubsub.md)), e.g. `250`",
        ),
    ),
    OptionName(
        "startingPosition",
        STARTING_POSITION,
        _STREAM_READ,
        doc=OptionDoc(
            "`earliest`",
            "`earliest`: the snapshot, then changes; `latest`: only new changes, e.g. `latest`",
        ),
    ),
    OptionName(
        "startingAsOf",
        STARTING_AS_OF,
        _STREAM_READ,
        doc=OptionDoc(
            "—",
            "the snapshot as of this time, then changes (contradicts the other starting "
            "options); a time in `[since, upper)`, else an error naming both, e.g. "
            "`2026-11-21T12:00:00Z`",
        ),
    ),
    OptionName(
        "startingTime",
        STARTING_TIME,
        _READS,
        doc=OptionDoc(
            "—",
            "no snapshot: every change at a time from this one on, with its own `_time`, e.g. "
            "`2026-11-21`. Must be in `[since + 1, upper]`: earlier changes were compacted "
            "together (`failOnDataLoss`)",
            applies="stream read, change feed",
        ),
    ),
    OptionName("startingTimestamp", STARTING_TIME, _READS, peers="Delta, Kafka"),
    OptionName(
        "startingSeqNo",
        STARTING_SEQNO,
        _READS,
        doc=OptionDoc(
            "—",
            "no snapshot: every change committed at this SeqNo or later (the times from the "
            "upper SeqNo − 1 left), e.g. `42`; the SeqNo must still be in Consensus (`persist "
            "shards history` lists them)",
            applies="stream read, change feed",
        ),
    ),
    OptionName("startingVersion", STARTING_SEQNO, _READS, peers="Delta"),
    OptionName(
        "consumer",
        CONSUMER,
        _STREAM_READ,
        doc=OptionDoc(
            "none",
            "a named, durable consumer of the shard, kept in Consensus: the query holds it "
            "(a newer query with the name fences this one), it holds the data it has not "
            "consumed from retention and GC, its position moves when Spark commits a "
            "micro-batch, and a query without a checkpoint resumes from it unless a starting "
            "option is given (see [Named consumers](spark.md#named-consumers)); letters, "
            "digits, `- _ .`, at most 128, e.g. `to-pg`",
        ),
    ),
    OptionName(
        "consumerExpiry",
        CONSUMER_EXPIRY,
        _STREAM_READ,
        doc=OptionDoc(
            "never",
            "with `consumer`: once it is idle (no query acquires it, no micro-batch commits) "
            "for this long, the consumer stops holding data, e.g. `7d`, `12h` (`0`: never)",
        ),
    ),
    OptionName(
        "maxBytesPerTrigger",
        MAX_BYTES,
        _STREAM_READ,
        peers="Delta",
        doc=OptionDoc("none", _CAP.format(what="bytes", example="64m")),
    ),
    OptionName(
        "maxFilesPerTrigger",
        MAX_FILES,
        _STREAM_READ,
        peers="Delta",
        doc=OptionDoc("none", _CAP.format(what="parts", example="10")),
    ),
    OptionName(
        "maxRowsPerTrigger",
        MAX_ROWS,
        _STREAM_READ,
        doc=OptionDoc("none", _CAP.format(what="rows", example="100000")),
    ),
    OptionName(
        "metricsFile",
        METRICS_FILE,
        _STREAM_READ,
        doc=OptionDoc(
            "none",
            "append one JSON line per micro-batch to this local file: its end offset, "
            "`latest_offset_ms` (`waited_ms` of it spent waiting for a PubSub commit notice), "
            "`partitions_ms`, tasks, parts, rows and bytes planned, and `behind` (see "
            "[Lag](spark.md#lag)); with `consumer`, its name and `consumer_behind`, e.g. "
            "`/tmp/q1-source.jsonl`",
        ),
    ),
    OptionName(
        "failOnDataLoss",
        FAIL_ON_DATA_LOSS,
        _STREAM_READ,
        peers="Kafka",
        doc=OptionDoc(
            "`true`",
            "offsets compacted away: fail (naming this option), or with `false` skip ahead and "
            "log it, e.g. `false`",
        ),
    ),
    OptionName(
        "splitSizeBytes",
        SPLIT_SIZE,
        _READS,
        doc=OptionDoc(
            f"{DEFAULT_SPLIT_SIZE >> 20} MiB",
            "target bytes per read task: the read's bytes over this, rounded to a power of "
            "two, is the task count, and the tasks get about equal bytes; a read of some "
            "columns counts its share of each part's bytes (see "
            "[Read splits](spark.md#read-splits)), e.g. `128m`",
        ),
    ),
    OptionName(
        "minPartitions",
        MIN_PARTITIONS,
        _READS,
        peers="Kafka",
        doc=OptionDoc(
            str(DEFAULT_MIN_PARTITIONS),
            "at least this many read tasks of about equal bytes (when the parts can be cut "
            "that fine), e.g. `4`",
        ),
    ),
    OptionName(
        "asOf",
        AS_OF,
        _READ,
        doc=OptionDoc(
            "latest",
            "read the collection as of this time, e.g. `2026-11-23T15:04:05Z` (must be in "
            "`[since, upper)`: the error names both)",
        ),
    ),
    OptionName("timestampAsOf", AS_OF, _READ, peers="Delta"),
    OptionName(
        "leaseSeconds",
        LEASE_SECONDS,
        _READ,
        doc=OptionDoc(
            "60",
            "how long the read's parts stay held while none of its tasks runs (the tasks "
            "heartbeat the lease, so a job holds its parts as long as it runs); raise it for "
            "jobs whose tasks queue longer than this before starting, e.g. `600`",
        ),
    ),
    OptionName(
        "readChanges",
        READ_CHANGES,
        _READ,
        doc=OptionDoc(
            "`false`",
            "the change feed: every update with a time in `[start, end)`, each with its own "
            "`_time` and `_diff`, nothing consolidated away, e.g. "
            '`.option("readChangeFeed", "true").option("startingTimestamp", "2026-11-21")`. '
            "Start: `startingTime`/`startingSeqNo` (default 0: all kept history); end: "
            "`endingTime`/`endingSeqNo`. The range must start at 0 or after since and end "
            "after since, at most at upper: the error names both",
        ),
    ),
    OptionName("readChangeFeed", READ_CHANGES, _READ, peers="Delta"),
    OptionName(
        "endingTime",
        ENDING_TIME,
        _READ,
        doc=OptionDoc(
            "upper",
            "end of the change range: `endingTime` is exclusive; Delta's `endingTimestamp` is "
            "inclusive, as in Delta, e.g. `2026-11-22`",
            applies="batch read, `readChanges`",
        ),
    ),
    OptionName("endingTimestamp", ENDING_TIME, _READ, peers="Delta"),  # inclusive, so + 1
    OptionName(
        "endingSeqNo",
        ENDING_SEQNO,
        _READ,
        doc=OptionDoc(
            "—",
            "the changes committed up to this SeqNo, inclusive, e.g. `57`",
            applies="batch read, `readChanges`",
        ),
    ),
    OptionName("endingVersion", ENDING_SEQNO, _READ, peers="Delta"),
    OptionName(
        "changeTypes",
        CHANGE_TYPES,
        _READS,
        doc=OptionDoc(
            "`false`",
            "add a string column `_change_type` with Delta Change Data Feed's values: on a keyed "
            "shard an update's retraction and insertion of a key at one time are "
            "`update_preimage` and `update_postimage`, an insertion alone `insert`, a retraction "
            "alone `delete`; on an unkeyed shard `+` rows are `insert` and `-` rows `delete` "
            '(see [Change types](spark.md#change-types)), e.g. `.option("changeTypes", "true")`',
        ),
    ),
    OptionName(
        "history",
        HISTORY,
        _READ,
        doc=OptionDoc(
            "`false`",
            "the shard's commits instead of its data (Delta's `DESCRIBE HISTORY`): one row per "
            'commit, columns as `shards history --json`, e.g. `.option("history", "true")`',
        ),
    ),
    OptionName(
        "columns",
        COLUMNS,
        _READS,
        doc=OptionDoc(
            "all",
            "read only these of the shard's columns (comma-separated), then `_time` and "
            "`_diff`: the others are neither decoded nor copied. The same as a `.schema(...)` "
            "naming them (see [Reading some columns](spark.md#reading-some-columns)); a "
            "column the shard lacks fails before any task runs, e.g. `l5,s7`",
        ),
    ),
    OptionName(
        "filterPushdown",
        FILTER_PUSHDOWN,
        _READ,
        doc=OptionDoc(
            "`false`",
            "skip parts by per-column min/max; also needs "
            "`spark.sql.python.filterPushdown.enabled=true` (Spark refuses a Python reader "
            "with `pushFilters` unless that conf is on, so this is opt-in), e.g. `true`",
        ),
    ),
    OptionName(
        "writerId",
        WRITER_ID,
        _WRITES,
        doc=OptionDoc(
            "the query id",
            "writer identity for exactly-once (see the [idempotency contract]"
            "(idempotency.md)), e.g. `nightly-load`",
        ),
    ),
    OptionName("txnAppId", WRITER_ID, _BATCH_WRITE, peers="Delta"),
    OptionName(
        "txnVersion",
        TXN_VERSION,
        _BATCH_WRITE,
        peers="Delta",
        doc=OptionDoc(
            "none",
            "with `writerId`: this write's version; the same or a lower version of that "
            "`writerId` again is skipped (logged at INFO), a higher one is written. Without it "
            "a batch write always lands, e.g. `7`",
        ),
    ),
    OptionName(
        "partSizeBytes",
        PART_SIZE,
        _WRITES,
        doc=OptionDoc(
            "64 MiB",
            "staged part size: an executor holds about `partSizeBytes * 5` while staging, "
            "e.g. `32m`",
        ),
    ),
    OptionName(
        "mergeSchema",
        MERGE_SCHEMA,
        _WRITES,
        peers="Delta",
        doc=OptionDoc(
            "`false`",
            "add the DataFrame's columns the shard lacks to its schema, in the write's own "
            "commit (see [Schema evolution](spark.md#schema-evolution)), e.g. "
            '`.option("mergeSchema", "true")`',
        ),
    ),
    OptionName(
        "retention",
        RETENTION,
        _WRITES,
        doc=OptionDoc(
            "as the shard has it (none for a new one)",
            "the shard's retention period, e.g. `7d`, `12h`, `30m`, `45s`, `500ms` or "
            "milliseconds (`0`: none); set on creation and whenever it differs (see "
            "[Retention](maintenance.md"
            "#retention-storage-bounded-by-time-never-at-a-live-readers-expense))",
        ),
    ),
    OptionName(
        "upsertKeys",
        UPSERT_KEYS,
        _WRITES,
        peers="Hudi's recordkey.field, Paimon's primary-key",
        doc=OptionDoc(
            "none (an unkeyed shard; a keyed shard upserts anyway)",
            "the key columns, comma-separated: the first write creates the shard keyed by "
            "them, and every write to a keyed shard upserts (each key's current row retracted, "
            "its new row inserted; see [Keyed shards](spark.md#keyed-shards-upserts-and-"
            "deletes)); a write naming other keys is refused, e.g. "
            '`.option("upsertKeys", "region,id")`',
        ),
    ),
    OptionName(
        "deleteColumn",
        DELETE_COLUMN,
        _WRITES,
        doc=OptionDoc(
            "none",
            "on a keyed shard, a boolean column whose true rows delete their key; it is not "
            'stored, e.g. `.option("deleteColumn", "is_deleted")`',
        ),
    ),
    OptionName(
        "sequenceColumn",
        SEQUENCE_COLUMN,
        _WRITES,
        peers="Hudi's precombine.field, Paimon's sequence.field",
        doc=OptionDoc(
            "none (the last write wins)",
            "on a keyed shard, an integer or timestamp column: the highest sequence of a key "
            "wins, within and across writes, deletes included (ties: the write), e.g. "
            '`.option("sequenceColumn", "lsn")`',
        ),
    ),
    OptionName("checkpointLocation", CHECKPOINT, _STREAM_WRITE),  # Spark's, for streaming
    OptionName("queryName", QUERY_NAME, _STREAM_WRITE),  # Spark's, from .queryName(name)
)
_BY_KEY = {o.spelling.lower(): o for o in OPTIONS}
SPELLING = {key: o.spelling for key, o in _BY_KEY.items()}
"""The user-facing spelling of every accepted (lower-cased) key, for messages and the docs."""
_SPARKS = frozenset({"path", "paths", CHECKPOINT, QUERY_NAME})
"""Names Spark itself passes: never listed as valid choices in a message."""


@dataclass(frozen=True)
class PeerName:
    """An option name of a system users come from (Kafka, Delta, Spark's file sources) that
    persist does not take, with the persist option (or way) that does what it did."""

    spelling: str
    system: str
    hint: str
    setting: str | None = None
    """The setting that does its job, whose row of the docs' options table names it (None: no
    one setting does; the docs list it with its hint only)."""


PEER_NAMES: tuple[PeerName, ...] = (
    PeerName(
        "startingOffsets",
        "Kafka",
        "use startingPosition (earliest/latest) or startingAsOf (a time)",
        STARTING_POSITION,
    ),
    PeerName(
        "endingOffsets",
        "Kafka",
        "use asOf (a time), or readChanges=true with endingTime for the changes up to a time",
    ),
    PeerName("maxOffsetsPerTrigger", "Kafka", "use maxRowsPerTrigger", MAX_ROWS),
    PeerName("minOffsetsPerTrigger", "Kafka", "persist has no minimum: use maxRowsPerTrigger"),
    PeerName("startingOffsetsByTimestamp", "Kafka", "use startingAsOf (a time)", STARTING_AS_OF),
    PeerName("subscribe", "Kafka", "use shard (or .load(name))", SHARD),
    PeerName("subscribePattern", "Kafka", "name the shards: use shards (a,b,c)", SHARDS),
    PeerName("assign", "Kafka", "use shard, or shards (a,b,c) for several", SHARDS),
    PeerName("topic", "Kafka", "use shard (or .save(name))", SHARD),
    PeerName(
        "kafka.bootstrap.servers",
        "Kafka",
        "use blob and consensus (docs/configuration.md: Locations)",
        BLOB,
    ),
    PeerName("versionAsOf", "Delta", "persist reads by time: use asOf (a time)", AS_OF),
    PeerName(
        "ignoreChanges",
        "Delta",
        "persist streams every change, retractions included (_diff -1): nothing to ignore",
    ),
    PeerName("ignoreDeletes", "Delta", "persist streams retractions as rows with _diff -1"),
    PeerName("skipChangeCommits", "Delta", "filter _diff > 0 to keep only insertions"),
    PeerName("replaceWhere", "Delta", 'mode("overwrite") replaces the whole shard'),
    PeerName(
        "overwriteSchema",
        "Delta",
        "a shard's columns are only ever added (mergeSchema=true); for other columns write "
        "to a new shard",
        MERGE_SCHEMA,
    ),
    PeerName("maxFileAge", "Spark's file source", "use startingAsOf (a time)", STARTING_AS_OF),
    PeerName("latestFirst", "Spark's file source", "persist reads in time order"),
)
"""Peer names that get a "did you mean" naming persist's option (matched lower-cased)."""
_PEERS = {p.spelling.lower(): p for p in PEER_NAMES}


_LABELS: dict[Purpose, str] = {
    "read": "batch reads",
    "stream_read": "stream reads",
    "read_schema": "reads",
    "write": "batch writes",
    "stream_write": "stream writes",
}


def _applies(option: OptionName, purpose: Purpose) -> bool:
    if purpose == "read_schema":  # the schema of a batch or streaming read
        return bool(option.purposes & _READS)
    return purpose in option.purposes


_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class PersistOptions:
    """Everything ``format("persist")`` was told, validated."""

    shard: str
    """The shard read or written; with ``shards``, their names joined by commas (messages only:
    each shard's reader takes its own options, :meth:`for_shard`)."""
    blob: str
    consensus: str
    pubsub: str | None = None
    pubsub_poll_ms: int = DEFAULT_PUBSUB_POLL_MS
    """While PubSub delivers the shard, a streaming source reads Consensus at least this
    often anyway (0: always): a push may be lost, and must not hide a commit for longer."""
    starting_position: Literal["earliest", "latest"] = "earliest"
    starting_as_of: int | None = None
    starting_time: int | None = None
    starting_seqno: int | None = None
    read_changes: bool = False
    ending_time: int | None = None
    ending_seqno: int | None = None
    history: bool = False
    change_types: bool = False
    """Add ``_change_type`` (Delta CDF's values) to every row read."""
    metrics_file: str | None = None
    as_of: int | None = None
    max_bytes: int | None = None
    max_files: int | None = None
    max_rows: int | None = None
    split_size_bytes: int = DEFAULT_SPLIT_SIZE
    min_partitions: int = DEFAULT_MIN_PARTITIONS
    fail_on_data_loss: bool = True
    writer_id: str | None = None
    txn_version: int | None = None
    part_size_bytes: int | None = None
    checkpoint_location: str | None = None
    filter_pushdown: bool = False
    columns: tuple[str, ...] | None = None
    """The shard's columns to read (``columns``), in order; None: the schema's."""
    lease_seconds: int | None = None
    retention_ms: int | None = None
    """The shard's retention period to set (on creation or after); None leaves it as it is."""
    merge_schema: bool = False
    """Add the DataFrame's columns the shard lacks to its schema, in the write's own commit."""
    upsert_keys: tuple[str, ...] | None = None
    """The key columns a write names (creating the shard keyed); None: as the shard has it."""
    delete_column: str | None = None
    """A boolean column of a keyed write whose true rows delete their key (not stored)."""
    sequence_column: str | None = None
    """The column whose highest value of a key wins, within and across writes."""
    consumer: str | None = None
    """The named consumer a stream reads as (``consumer``); None: none."""
    consumer_expiry_ms: int = 0
    """How long the consumer may stay idle before it stops holding data (0: forever)."""
    shards: tuple[str, ...] | None = None
    """A stream read of several shards in one source (``shards``); None: of ``shard`` alone."""
    said: Mapping[str, str] = field(default_factory=dict)
    """The option name the user gave each setting by (an alias, or persist's own name)."""

    @property
    def starting_given(self) -> bool:
        """Whether the user gave a starting option: it wins over a consumer's position."""
        return any(
            k in self.said
            for k in (STARTING_POSITION, STARTING_AS_OF, STARTING_TIME, STARTING_SEQNO)
        )

    def for_shard(self, shard: str) -> PersistOptions:
        """These options for one of the ``shards``: how a stream of several reads each."""
        return replace(self, shard=shard, shards=None)

    def spelled(self, setting: str) -> str:
        """How to name ``setting`` in a message: as the user named it."""
        return self.said.get(setting, SPELLING[setting])

    @classmethod
    def parse(cls, options: Mapping[str, str], purpose: Purpose) -> PersistOptions:
        """Validate Spark's options for ``purpose``; raise InvalidUsage naming any bad one."""
        given = {str(k).lower(): str(v) for k, v in options.items()}
        _refuse_misplaced(given, purpose)
        opts, said = _settings(given)
        if PATHS in opts:
            raise InvalidUsage(
                f"persist: a read names one shard, not several paths ({opts[PATHS]}): use "
                '.load("name") or .option("shard", "name")'
            )
        shards = _shards(opts, said)
        name = ",".join(shards) if shards is not None else opts.get(SHARD)
        if not name:
            raise InvalidUsage(
                'persist: no shard named: use .option("shard", "name") or '
                '.load("name") / .save("name") / .start("name")'
            )
        if shards is None:
            try:
                validate_shard_name(name)
            except InvalidUsage as e:
                raise InvalidUsage(f"persist: option {said[SHARD]}: {e}") from None
        position = opts.get(STARTING_POSITION, "earliest").lower()
        if position not in ("earliest", "latest"):
            raise InvalidUsage(
                f"persist: startingPosition={position!r}: use 'earliest' (the snapshot, then "
                "changes) or 'latest' (only new changes); for a time use startingAsOf"
            )
        starting_as_of = _time(opts, said, STARTING_AS_OF)
        starting_time = _time(opts, said, STARTING_TIME)
        starting_seqno = _int(opts, said, STARTING_SEQNO, minimum=1)
        starts = [
            said[k]
            for k in (STARTING_POSITION, STARTING_AS_OF, STARTING_TIME, STARTING_SEQNO)
            if opts.get(k)
        ]
        if len(starts) > 1:
            raise InvalidUsage(
                f"persist: {' and '.join(starts)} contradict each other (each says where the "
                "read starts); give one"
            )
        read_changes = _bool(opts, said, READ_CHANGES, default=False)
        ending_time = _time(opts, said, ENDING_TIME)
        if ending_time is not None and said[ENDING_TIME] == "endingTimestamp":
            ending_time += 1  # Delta's end is inclusive, persist's endingTime exclusive
        ending_seqno = _int(opts, said, ENDING_SEQNO, minimum=1)
        _check_change_range(opts, said, purpose, read_changes)
        _check_history(opts, said)
        limits = [said[k] for k in (MAX_BYTES, MAX_FILES, MAX_ROWS) if opts.get(k)]
        if len(limits) > 1:
            raise InvalidUsage(
                f"persist: read limits {', '.join(limits)} contradict each other (Spark passes "
                "one limit per micro-batch); set only one"
            )
        pubsub = opts.get(PUBSUB)
        poll_ms = _int(opts, said, PUBSUB_POLL)
        writer_id = opts.get(WRITER_ID) or None
        txn_version = _int(opts, said, TXN_VERSION)
        if txn_version is not None and writer_id is None:
            raise InvalidUsage(
                f"persist: option {said[TXN_VERSION]} needs a writer to version: set "
                '.option("writerId", "<your application>") too (a version is counted per '
                "writerId; the same writerId and version again is skipped)"
            )
        return cls(
            shard=name,
            blob=_uri(opts, said, BLOB) or default_blob_uri(),
            consensus=_uri(opts, said, CONSENSUS) or default_consensus_uri(),
            pubsub=None if pubsub in (None, "", "off", "none") else pubsub,
            pubsub_poll_ms=DEFAULT_PUBSUB_POLL_MS if poll_ms is None else poll_ms,
            starting_position="latest" if position == "latest" else "earliest",
            starting_as_of=starting_as_of,
            starting_time=starting_time,
            starting_seqno=starting_seqno,
            read_changes=read_changes,
            ending_time=ending_time,
            ending_seqno=ending_seqno,
            history=_bool(opts, said, HISTORY, default=False),
            change_types=_bool(opts, said, CHANGE_TYPES, default=False),
            metrics_file=opts.get(METRICS_FILE) or None,
            as_of=_time(opts, said, AS_OF),
            max_bytes=_size(opts, said, MAX_BYTES),
            max_files=_int(opts, said, MAX_FILES, minimum=1),
            max_rows=_int(opts, said, MAX_ROWS, minimum=1),
            split_size_bytes=_size(opts, said, SPLIT_SIZE) or DEFAULT_SPLIT_SIZE,
            min_partitions=_int(opts, said, MIN_PARTITIONS, minimum=1) or DEFAULT_MIN_PARTITIONS,
            fail_on_data_loss=_bool(opts, said, FAIL_ON_DATA_LOSS, default=True),
            writer_id=writer_id,
            txn_version=txn_version,
            part_size_bytes=_size(opts, said, PART_SIZE),
            checkpoint_location=opts.get(CHECKPOINT) or None,
            filter_pushdown=_bool(opts, said, FILTER_PUSHDOWN, default=False),
            columns=_column_list(opts, said, COLUMNS, "l5,s7"),
            lease_seconds=_int(opts, said, LEASE_SECONDS, minimum=1),
            retention_ms=_retention(opts, said),
            merge_schema=_bool(opts, said, MERGE_SCHEMA, default=False),
            upsert_keys=_column_list(opts, said, UPSERT_KEYS, "region,id"),
            delete_column=opts.get(DELETE_COLUMN) or None,
            sequence_column=opts.get(SEQUENCE_COLUMN) or None,
            consumer=_consumer(opts, said),
            consumer_expiry_ms=_consumer_expiry(opts, said),
            shards=shards,
            said={k: v for k, v in said.items() if k in opts},
        )


def _column_list(
    opts: Mapping[str, str], said: Mapping[str, str], key: str, example: str
) -> tuple[str, ...] | None:
    """Option ``key`` as column names separated by commas (``columns``, ``upsertKeys``), in
    order, or None if not given; whether the shard or DataFrame has them is checked where
    the read or write is planned."""
    raw = opts.get(key)
    if raw is None or (key == COLUMNS and raw == ""):
        return None
    names = tuple(n.strip() for n in raw.split(","))
    if not all(names):
        raise InvalidUsage(
            f"persist: option {said[key]}={raw!r} names no column or an empty one: give "
            f"column names separated by commas, e.g. {example}"
        )
    if len(set(names)) != len(names):
        raise InvalidUsage(f"persist: option {said[key]}={raw!r} names a column twice")
    return names


def _retention(opts: Mapping[str, str], said: Mapping[str, str]) -> int | None:
    """The ``retention`` option in milliseconds (``7d``, ``12h``, ms...), or None if not given."""
    value = opts.get(RETENTION)
    if value is None or value == "":
        return None
    try:
        return parse_retention(value, name=f"option {said[RETENTION]}")
    except InvalidUsage as e:
        raise InvalidUsage(f"persist: {e}") from None


SHARDS_REFUSES = (CONSUMER, COLUMNS, STARTING_SEQNO, CHANGE_TYPES)
"""What a stream of several shards does not take, and why (the message names the fix)."""


def _shards(opts: Mapping[str, str], said: Mapping[str, str]) -> tuple[str, ...] | None:
    """The ``shards`` option as distinct shard names, or None if not given; with the options
    a stream of several shards does not take refused by name."""
    value = opts.get(SHARDS)
    if value is None:
        return None
    names = tuple(n.strip() for n in value.split(","))
    if not value.strip() or any(not n for n in names):
        raise InvalidUsage(
            f"persist: option {said[SHARDS]}={value!r} names an empty shard: list shard names "
            "separated by commas, e.g. orders,order_items"
        )
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise InvalidUsage(f"persist: option {said[SHARDS]} names {twice} twice: name each once")
    for n in names:
        try:
            validate_shard_name(n)
        except InvalidUsage as e:
            raise InvalidUsage(f"persist: option {said[SHARDS]}: {e}") from None
    if opts.get(SHARD):
        raise InvalidUsage(
            f"persist: {said[SHARD]} and {said[SHARDS]} both name what to read: give shards "
            f"alone for several shards (the load() path is a shard name too), or shard for one"
        )
    why = {
        CONSUMER: "a consumer is one shard's: read each shard in its own query with a consumer",
        COLUMNS: "select the columns after reading (the union of the shards' columns is read)",
        STARTING_SEQNO: "SeqNos are each shard's own: use startingTime, which all shards share",
        CHANGE_TYPES: "read each shard in its own stream with changeTypes",
    }
    for key in SHARDS_REFUSES:
        if opts.get(key):
            raise InvalidUsage(
                f"persist: option {said[key]} does not apply to a stream of several shards "
                f"({said[SHARDS]}): {why[key]}"
            )
    return names


def _consumer(opts: Mapping[str, str], said: Mapping[str, str]) -> str | None:
    """The ``consumer`` option, checked as a key of the shard's state, or None if not given."""
    name = opts.get(CONSUMER)
    if name is None:
        return None
    try:
        return validate_consumer_name(name)
    except InvalidUsage as e:
        raise InvalidUsage(f"persist: option {said[CONSUMER]}: {e}") from None


def _consumer_expiry(opts: Mapping[str, str], said: Mapping[str, str]) -> int:
    """``consumerExpiry`` in milliseconds (0: never); only with ``consumer``."""
    value = opts.get(CONSUMER_EXPIRY)
    if value is None or value == "":
        return 0
    if opts.get(CONSUMER) is None:
        raise InvalidUsage(
            f"persist: option {said[CONSUMER_EXPIRY]} needs a consumer to expire: add "
            '.option("consumer", "<name>"), or drop it'
        )
    try:
        return parse_retention(value, name=f"option {said[CONSUMER_EXPIRY]}")
    except InvalidUsage as e:
        raise InvalidUsage(f"persist: {e}") from None


def _check_history(opts: Mapping[str, str], said: Mapping[str, str]) -> None:
    """history=true reads the commits, not data: a time or range option makes no sense with it."""
    if not _bool(opts, said, HISTORY, default=False):
        return
    data = [said[k] for k in (AS_OF, READ_CHANGES, STARTING_TIME, STARTING_SEQNO) if opts.get(k)]
    data += [
        said[k]
        for k in (ENDING_TIME, ENDING_SEQNO, FILTER_PUSHDOWN, COLUMNS, CHANGE_TYPES)
        if opts.get(k)
    ]
    if data:
        raise InvalidUsage(
            f"persist: history reads the shard's commits, so {', '.join(data)} do(es) not apply: "
            "drop them, or drop history to read data"
        )


def _check_change_range(
    opts: Mapping[str, str], said: Mapping[str, str], purpose: Purpose, read_changes: bool
) -> None:
    """A batch read's range options need readChanges; a change range has one start and one end."""
    if purpose != "read":
        return
    bounds = [
        said[k] for k in (STARTING_TIME, STARTING_SEQNO, ENDING_TIME, ENDING_SEQNO) if opts.get(k)
    ]
    if not read_changes:
        if bounds:
            raise InvalidUsage(
                f"persist: {', '.join(bounds)} bound(s) a change range: add "
                '.option("readChanges", "true") for the changes, or use asOf for the '
                "collection at one time"
            )
        return
    if opts.get(AS_OF):
        raise InvalidUsage(
            f"persist: {said[AS_OF]} and {said[READ_CHANGES]} contradict each other: asOf reads "
            "the collection at one time, readChanges the changes between two; use "
            "startingTime/endingTime with readChanges"
        )
    for a, b in ((STARTING_TIME, STARTING_SEQNO), (ENDING_TIME, ENDING_SEQNO)):
        if opts.get(a) and opts.get(b):
            raise InvalidUsage(
                f"persist: {said[a]} and {said[b]} contradict each other (both bound the same "
                "end of the change range); give one"
            )


def _refuse_misplaced(given: Mapping[str, str], purpose: Purpose) -> None:
    """Refuse keys persist does not know (suggesting the closest) or that do not apply here."""
    bad = sorted(k for k in given if k not in _BY_KEY or not _applies(_BY_KEY[k], purpose))
    if not bad:
        return
    valid = sorted(
        o.spelling for o in OPTIONS if _applies(o, purpose) and o.spelling.lower() not in _SPARKS
    )
    hints = []
    for key in bad:
        option = _BY_KEY.get(key)
        if option is not None:
            where = sorted(_LABELS[p] for p in option.purposes)
            hints.append(f"{option.spelling} applies to {' and '.join(where)} only")
        elif key in _PEERS:
            peer = _PEERS[key]
            hints.append(f"{peer.spelling} is {peer.system}'s option: {peer.hint}")
        elif key.startswith("kafka."):
            hints.append(
                f"{key} configures a Kafka client: {_PEERS['kafka.bootstrap.servers'].hint}"
            )
        else:
            choices = [o.lower() for o in valid] + list(_PEERS)
            close = difflib.get_close_matches(key, choices, n=1, cutoff=0.75)
            if close and close[0] in _PEERS:
                peer = _PEERS[close[0]]
                hints.append(f"{key}: {peer.system}'s {peer.spelling}? {peer.hint}")
            elif close:
                hints.append(f"{key}: did you mean {SPELLING[close[0]]}?")
    names = ", ".join(_shown(k) for k in bad)
    unknown = any(k not in _BY_KEY and k not in _PEERS for k in bad)
    raise InvalidUsage(
        f"persist: option(s) {names} not valid for {purpose.replace('_', ' ')}"
        + (f" ({'; '.join(hints)})" if hints else "")
        + f"; valid options: {', '.join(valid)}"
        + (" (Spark hands option names to Python sources lower-cased)" if unknown else "")
    )


def _shown(key: str) -> str:
    """How a message spells a lower-cased key: persist's or a peer's documented spelling, else
    as given (Spark lower-cases option names before a Python source sees them)."""
    if key in SPELLING:
        return SPELLING[key]
    if key in _PEERS:
        return _PEERS[key].spelling
    return key


def _settings(given: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """Each setting's value, and the spelling of the option that gave it (for messages).

    Two names of one setting (``shard`` and the ``path`` Spark passes, or an alias)
    must agree; an empty value counts as not given.
    """
    opts: dict[str, str] = {}
    said: dict[str, str] = {}
    for key, value in sorted(given.items()):
        option = _BY_KEY[key]
        setting = option.setting
        if setting in opts and value and opts[setting] and opts[setting] != value:
            first, second = said[setting], option.spelling
            if {first, second} == {"shard", "path"}:
                shard = value if second == "shard" else opts[setting]
                path = value if second == "path" else opts[setting]
                raise InvalidUsage(
                    f"persist: option shard={shard!r} contradicts the "
                    f"load()/save()/start() path {path!r}; give the shard name once"
                )
            raise InvalidUsage(
                f"persist: options {first}={opts[setting]!r} and {second}={value!r} set the "
                "same thing; give one"
            )
        if value or setting not in opts:
            opts[setting] = value
            said[setting] = option.spelling
    for setting in _BY_KEY:
        said.setdefault(setting, SPELLING[setting])
    return opts, said


def _uri(opts: Mapping[str, str], said: Mapping[str, str], key: str) -> str | None:
    """A Blob or Consensus URI, checked against the scheme table every entry point uses.

    Checked here, on the driver, so a bad scheme fails before any task runs,
    with the error ``PersistClient.open`` and the CLI give for it.
    """
    uri = opts.get(key)
    if not uri:
        return None
    try:
        (blob_kind if key == BLOB else consensus_kind)(uri)
    except InvalidUri as e:
        raise InvalidUri(f"persist: option {said[key]}: {e}") from None
    return uri


def _int(
    opts: Mapping[str, str], said: Mapping[str, str], key: str, minimum: int = 0
) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidUsage(f"persist: option {said[key]}={raw!r} must be a whole number") from None
    if value < minimum:
        raise InvalidUsage(f"persist: option {said[key]}={raw!r} must be at least {minimum}")
    return value


def _time(opts: Mapping[str, str], said: Mapping[str, str], key: str) -> int | None:
    """A time: epoch milliseconds, ``YYYY-MM-DD`` or ISO-8601 (see state/times.py)."""
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    try:
        return parse_time(raw, said[key])
    except InvalidUsage as e:
        raise InvalidUsage(f"persist: option {e}") from None


def _size(opts: Mapping[str, str], said: Mapping[str, str], key: str) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    m = _SIZE_RE.match(raw)
    if not m:
        raise InvalidUsage(
            f"persist: option {said[key]}={raw!r} must be a size in bytes, e.g. 1048576, "
            "512k, 64m or 1g"
        )
    value = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    if value < 1:
        raise InvalidUsage(f"persist: option {said[key]}={raw!r} must be at least 1 byte")
    return value


def _bool(opts: Mapping[str, str], said: Mapping[str, str], key: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise InvalidUsage(f"persist: option {said[key]}={raw!r} must be true or false")
