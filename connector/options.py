"""The options of ``format("persist")``, parsed once into a frozen dataclass.

Spark hands options over case-insensitively (keys lower-cased); each known
key is a constant below with its default. Unknown keys, keys that do not
apply to the operation (a read limit on a write), malformed values and
contradictory combinations are all errors that name the option and the fix,
raised on the driver before any task runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pyspark_persist.state.client import (
    default_blob_uri,
    default_consensus_uri,
    validate_shard_name,
)
from pyspark_persist.state.errors import InvalidUsage

Purpose = Literal["read", "stream_read", "read_schema", "write", "stream_write"]

SHARD = "shard"
PATH = "path"  # what load(path) / save(path) pass: an alias of shard
BLOB = "blob"
CONSENSUS = "consensus"
PUBSUB = "pubsub"
STARTING_POSITION = "startingposition"
STARTING_AS_OF = "startingasof"
AS_OF = "asof"
MAX_BYTES = "maxbytespertrigger"
MAX_FILES = "maxfilespertrigger"
MAX_ROWS = "maxrowspertrigger"
SPLIT_SIZE = "splitsizebytes"
MIN_PARTITIONS = "minpartitions"
FAIL_ON_DATA_LOSS = "failondataloss"
WRITER_ID = "writerid"
PART_SIZE = "partsizebytes"
CHECKPOINT = "checkpointlocation"  # passed by Spark for streaming writes
FILTER_PUSHDOWN = "filterpushdown"

DEFAULT_SPLIT_SIZE = 64 << 20
DEFAULT_MIN_PARTITIONS = 1

_COMMON = {SHARD, PATH, BLOB, CONSENSUS, PUBSUB}
_ALLOWED: dict[str, set[str]] = {
    "read": _COMMON | {AS_OF, SPLIT_SIZE, MIN_PARTITIONS, FILTER_PUSHDOWN},
    "stream_read": _COMMON
    | {
        STARTING_POSITION,
        STARTING_AS_OF,
        MAX_BYTES,
        MAX_FILES,
        MAX_ROWS,
        SPLIT_SIZE,
        MIN_PARTITIONS,
        FAIL_ON_DATA_LOSS,
    },
    "read_schema": set(),  # filled below: anything a batch or streaming read accepts
    "write": _COMMON | {WRITER_ID, PART_SIZE},
    "stream_write": _COMMON | {WRITER_ID, PART_SIZE, CHECKPOINT},
}
_ALLOWED["read_schema"] = _ALLOWED["read"] | _ALLOWED["stream_read"]
# The user-facing spelling of every key, for error messages and the README.
SPELLING = {
    k.lower(): k
    for k in (
        "shard path blob consensus pubsub startingPosition startingAsOf asOf "
        "maxBytesPerTrigger maxFilesPerTrigger maxRowsPerTrigger splitSizeBytes minPartitions "
        "failOnDataLoss writerId partSizeBytes checkpointLocation filterPushdown"
    ).split()
}

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class PersistOptions:
    """Everything ``format("persist")`` was told, validated."""

    shard: str
    blob: str
    consensus: str
    pubsub: str | None = None
    starting_position: Literal["earliest", "latest"] = "earliest"
    starting_as_of: int | None = None
    as_of: int | None = None
    max_bytes: int | None = None
    max_files: int | None = None
    max_rows: int | None = None
    split_size_bytes: int = DEFAULT_SPLIT_SIZE
    min_partitions: int = DEFAULT_MIN_PARTITIONS
    fail_on_data_loss: bool = True
    writer_id: str | None = None
    part_size_bytes: int | None = None
    checkpoint_location: str | None = None
    filter_pushdown: bool = False

    @classmethod
    def parse(cls, options: Mapping[str, str], purpose: Purpose) -> PersistOptions:
        """Validate Spark's options for ``purpose``; raise InvalidUsage naming any bad one."""
        opts = {str(k).lower(): str(v) for k, v in options.items()}
        allowed = _ALLOWED[purpose]
        unknown = sorted(k for k in opts if k not in allowed)
        if unknown:
            names = ", ".join(SPELLING.get(k, k) for k in unknown)
            valid = ", ".join(sorted(SPELLING[k] for k in allowed if k != PATH))
            raise InvalidUsage(
                f"persist: option(s) {names} not valid for {purpose.replace('_', ' ')}; "
                f"valid options: {valid}"
            )
        shard = opts.get(SHARD)
        path = opts.get(PATH)
        if shard and path and shard != path:
            raise InvalidUsage(
                f"persist: option shard={shard!r} contradicts the load()/save() path {path!r}; "
                "give the shard name once"
            )
        name = shard or path
        if not name:
            raise InvalidUsage(
                'persist: no shard named: use .option("shard", "name") or '
                '.load("name") / .save("name")'
            )
        validate_shard_name(name)
        position = opts.get(STARTING_POSITION, "earliest").lower()
        if position not in ("earliest", "latest"):
            raise InvalidUsage(
                f"persist: startingPosition={position!r}: use 'earliest' (the snapshot, then "
                "changes) or 'latest' (only new changes); for a time use startingAsOf"
            )
        starting_as_of = _int(opts, STARTING_AS_OF)
        if starting_as_of is not None and STARTING_POSITION in opts:
            raise InvalidUsage(
                "persist: startingPosition and startingAsOf contradict each other; give one"
            )
        limits = [SPELLING[k] for k in (MAX_BYTES, MAX_FILES, MAX_ROWS) if opts.get(k)]
        if len(limits) > 1:
            raise InvalidUsage(
                f"persist: read limits {', '.join(limits)} contradict each other (Spark passes "
                "one limit per micro-batch); set only one"
            )
        pubsub = opts.get(PUBSUB)
        return cls(
            shard=name,
            blob=opts.get(BLOB) or default_blob_uri(),
            consensus=opts.get(CONSENSUS) or default_consensus_uri(),
            pubsub=None if pubsub in (None, "", "off", "none") else pubsub,
            starting_position="latest" if position == "latest" else "earliest",
            starting_as_of=starting_as_of,
            as_of=_int(opts, AS_OF),
            max_bytes=_size(opts, MAX_BYTES),
            max_files=_int(opts, MAX_FILES, minimum=1),
            max_rows=_int(opts, MAX_ROWS, minimum=1),
            split_size_bytes=_size(opts, SPLIT_SIZE) or DEFAULT_SPLIT_SIZE,
            min_partitions=_int(opts, MIN_PARTITIONS, minimum=1) or DEFAULT_MIN_PARTITIONS,
            fail_on_data_loss=_bool(opts, FAIL_ON_DATA_LOSS, default=True),
            writer_id=opts.get(WRITER_ID) or None,
            part_size_bytes=_size(opts, PART_SIZE),
            checkpoint_location=opts.get(CHECKPOINT) or None,
            filter_pushdown=_bool(opts, FILTER_PUSHDOWN, default=False),
        )


def _int(opts: Mapping[str, str], key: str, minimum: int = 0) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidUsage(
            f"persist: option {SPELLING[key]}={raw!r} must be a whole number"
        ) from None
    if value < minimum:
        raise InvalidUsage(f"persist: option {SPELLING[key]}={raw!r} must be at least {minimum}")
    return value


def _size(opts: Mapping[str, str], key: str) -> int | None:
    raw = opts.get(key)
    if raw is None or raw == "":
        return None
    m = _SIZE_RE.match(raw)
    if not m:
        raise InvalidUsage(
            f"persist: option {SPELLING[key]}={raw!r} must be a size in bytes, e.g. 1048576, "
            "512k, 64m or 1g"
        )
    value = int(m.group(1)) << {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}[m.group(2).lower()]
    if value < 1:
        raise InvalidUsage(f"persist: option {SPELLING[key]}={raw!r} must be at least 1 byte")
    return value


def _bool(opts: Mapping[str, str], key: str, default: bool) -> bool:
    raw = opts.get(key)
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise InvalidUsage(f"persist: option {SPELLING[key]}={raw!r} must be true or false")
