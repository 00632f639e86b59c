"""State diffs: the unit stored in Consensus, pushed over PubSub and rolled up in Blob.

A :class:`~pyspark_persist.state.state.StateDiff` (defined beside the state it
changes, so that module needs nothing from this one) takes a
:class:`~pyspark_persist.state.state.ShardState` from SeqNo ``n`` to
``n + 1``: scalars it sets, and for each map-valued field the entries it
puts and the keys it deletes. A rollup is the same thing from
the empty state (SeqNo 0) straight to a SeqNo, so one decoder reads both.

Encoding (``FORMAT_VERSION`` 1)::

    b"PSD" + version byte + CRC-32 (big endian, of the JSON) + UTF-8 JSON

The checksum turns a flipped bit into :class:`CorruptData` rather than a
silently different state; the version byte lets a newer release refuse, with
:class:`IncompatibleVersion`, a format it does not know.
"""

from __future__ import annotations

import json
import struct
import zlib
from base64 import b64decode, b64encode
from collections.abc import Mapping
from typing import Any

from .errors import CorruptData, IncompatibleVersion, ShardNotFound
from .state import (
    MAP_CODECS,
    SCALARS,
    Batch,
    ConsumerState,
    CriticalReaderState,
    LeasedReaderState,
    ShardState,
    StateDiff,
    Time,
    WriterState,
)

FORMAT_VERSION = 1
_MAGIC = b"PSD"
_HEADER = struct.Struct(">3sBI")


class DiffBuilder:
    """Collects the changes a command makes to one state, then builds the diff to its next SeqNo.

    Typed: :meth:`set` takes each scalar field as a keyword, and each map of
    :class:`~pyspark_persist.state.state.ShardState` has its own ``put_*``
    and ``delete_*``, so a misspelled field is a type error, not a diff no
    reader understands. The field names as strings stay inside this module,
    where they are the wire format.
    """

    def __init__(self, state: ShardState) -> None:
        self._state = state
        self._scalars: dict[str, Any] = {}
        self._puts: dict[str, dict[Any, Any]] = {}
        self._dels: dict[str, set[Any]] = {}

    def set(
        self,
        *,
        shard_id: str | None = None,
        schema: bytes | None = None,
        since: Time | None = None,
        upper: Time | None = None,
        created_ms: int | None = None,
        last_gc_seqno: int | None = None,
        retention_ms: int | None = None,
        incarnation: str | None = None,
        keys: tuple[str, ...] | None = None,
    ) -> DiffBuilder:
        """Set scalar fields (``None``: leave as is); only values that change enter the diff,
        so no-op diffs stay empty."""
        given = {
            "shard_id": shard_id,
            "schema": schema,
            "since": since,
            "upper": upper,
            "created_ms": created_ms,
            "last_gc_seqno": last_gc_seqno,
            "retention_ms": retention_ms,
            "incarnation": incarnation,
            "keys": keys,
        }
        for name, value in given.items():
            if value is not None and getattr(self._state, name) != value:
                self._scalars[name] = value
        return self

    def put_batch(self, batch: Batch) -> DiffBuilder:
        """Add (or replace) the batch of its interval."""
        return self._put("batches", batch.key, batch)

    def delete_batch(self, key: str) -> DiffBuilder:
        """Remove the batch named ``key`` (its interval, :attr:`Batch.key`)."""
        return self._delete("batches", key)

    def put_writer(self, writer_id: str, writer: WriterState) -> DiffBuilder:
        """Register or update a writer."""
        return self._put("writers", writer_id, writer)

    def delete_writer(self, writer_id: str) -> DiffBuilder:
        """Expire a writer."""
        return self._delete("writers", writer_id)

    def put_leased_reader(self, reader_id: str, reader: LeasedReaderState) -> DiffBuilder:
        """Register or update a leased reader."""
        return self._put("leased_readers", reader_id, reader)

    def delete_leased_reader(self, reader_id: str) -> DiffBuilder:
        """Expire a leased reader."""
        return self._delete("leased_readers", reader_id)

    def put_critical_reader(self, reader_id: str, reader: CriticalReaderState) -> DiffBuilder:
        """Register or update a critical reader."""
        return self._put("critical_readers", reader_id, reader)

    def delete_critical_reader(self, reader_id: str) -> DiffBuilder:
        """Remove a critical reader (its since hold goes with it)."""
        return self._delete("critical_readers", reader_id)

    def put_consumer(self, name: str, consumer: ConsumerState) -> DiffBuilder:
        """Create or update a named consumer."""
        return self._put("consumers", name, consumer)

    def delete_consumer(self, name: str) -> DiffBuilder:
        """Remove a named consumer (its since hold goes with it)."""
        return self._delete("consumers", name)

    def put_rollup(self, seqno: int, key: str) -> DiffBuilder:
        """Record the rollup of SeqNo ``seqno`` stored under Blob ``key``."""
        return self._put("rollups", seqno, key)

    def delete_rollup(self, seqno: int) -> DiffBuilder:
        """Forget the rollup of SeqNo ``seqno``."""
        return self._delete("rollups", seqno)

    def _put(self, map_name: str, key: Any, value: Any) -> DiffBuilder:
        self._puts.setdefault(map_name, {})[key] = value
        self._dels.get(map_name, set()).discard(key)
        return self

    def _delete(self, map_name: str, key: Any) -> DiffBuilder:
        """Remove one entry (it must exist or have been put)."""
        self._puts.get(map_name, {}).pop(key, None)
        if key in getattr(self._state, map_name):
            self._dels.setdefault(map_name, set()).add(key)
        return self

    @property
    def is_empty(self) -> bool:
        """True when the command changed nothing (no Consensus write is needed)."""
        return not self._scalars and not any(self._puts.values()) and not any(self._dels.values())

    def build(self) -> StateDiff:
        """The diff from the builder's state to its next SeqNo."""
        names = set(self._puts) | set(self._dels)
        return StateDiff(
            shard_id=self._state.shard_id,
            from_seqno=self._state.seqno,
            to_seqno=self._state.seqno + 1,
            scalars=dict(self._scalars),
            maps={
                n: (dict(self._puts.get(n, {})), frozenset(self._dels.get(n, set()))) for n in names
            },
        )


def full_diff(state: ShardState) -> StateDiff:
    """The diff from the empty state to ``state``: what a rollup stores."""
    # A shard without consumers leaves the map out, as rollups written before consumers did,
    # so releases that predate them still read its rollups.
    maps: dict[str, tuple[Mapping[Any, Any], frozenset[Any]]] = {
        name: (dict(getattr(state, name)), frozenset())
        for name in (*MAP_CODECS, "rollups")
        if name != "consumers" or state.consumers
    }
    return StateDiff(
        shard_id=state.shard_id,
        from_seqno=0,
        to_seqno=state.seqno,
        # An unkeyed shard's rollup leaves ``keys`` out, as rollups before keyed shards did.
        scalars={name: getattr(state, name) for name in SCALARS if name != "keys" or state.keys},
        maps=maps,
    )


_JSON = json.JSONEncoder(separators=(",", ":"))
"""One encoder for every diff (``json.dumps`` with options builds a new one per call)."""


def encode(diff: StateDiff) -> bytes:
    """Encode a diff (or rollup) with magic, format version and checksum."""
    scalars = dict(diff.scalars)
    if "schema" in scalars:
        scalars["schema"] = b64encode(scalars["schema"]).decode("ascii")
    maps: dict[str, Any] = {}
    for name, (puts, dels) in diff.maps.items():
        if name == "rollups":
            enc_puts = {str(k): v for k, v in puts.items()}
            enc_dels = sorted(dels)
        else:
            enc_puts = {k: v.to_json() for k, v in puts.items()}
            enc_dels = sorted(dels)
        maps[name] = {"put": enc_puts, "del": enc_dels}
    body = _JSON.encode(
        {
            "shard": diff.shard_id,
            "from": diff.from_seqno,
            "to": diff.to_seqno,
            "s": scalars,
            "m": maps,
        }
    ).encode("utf-8")
    return _HEADER.pack(_MAGIC, FORMAT_VERSION, zlib.crc32(body)) + body


def row_checksum(data: bytes) -> int | None:
    """The CRC-32 an encoded diff carries in its header (None for anything else, such as
    :data:`FENCE`): what tells one Consensus row from another at the same SeqNo."""
    if len(data) < _HEADER.size or data[:3] != _MAGIC:
        return None
    return int(_HEADER.unpack_from(data)[2])


FENCE = b"pyspark-persist: dropped shard"
"""The data of the row a drop appends first (:mod:`.drop`): not a diff, so no process can build
on it, and :func:`decode` reports the shard as being dropped. (The bytes earlier versions wrote
for their one drop row, so a drop they left half done reads as being dropped too.)"""

TOMBSTONE = b"pyspark-persist: shard dropped; its name is free"
"""The row a finished drop leaves as the only one of its shard's key (:mod:`.drop`): the shard
does not exist, and the next shard of that name is created on top of it, so its SeqNos go on
from the dropped one's and never repeat a SeqNo a handle of the dropped one may still hold."""


def decode(data: bytes, *, where: str) -> StateDiff:
    """Decode what :func:`encode` wrote; ``where`` names the row or object for errors."""
    if data == FENCE:
        raise ShardNotFound(
            f"{where}: the shard is being dropped (persist shards drop); open it again once "
            "the drop is done to create a new shard of that name"
        )
    if data == TOMBSTONE:
        raise ShardNotFound(f"{where}: the shard was dropped (persist shards drop)")
    if len(data) < _HEADER.size:
        raise CorruptData(f"{where}: state data is truncated ({len(data)} bytes)")
    magic, version, crc = _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise CorruptData(f"{where}: not persist state data (bad magic {magic!r})")
    if version != FORMAT_VERSION:
        raise IncompatibleVersion(
            f"{where}: state format version {version}, this pyspark_persist reads version "
            f"{FORMAT_VERSION}; upgrade pyspark_persist to read this shard"
        )
    body = data[_HEADER.size :]
    if zlib.crc32(body) != crc:
        raise CorruptData(f"{where}: state checksum mismatch (the row or object is corrupt)")
    try:
        doc = json.loads(body)
        scalars = dict(doc["s"])
        if "schema" in scalars:
            scalars["schema"] = b64decode(scalars["schema"])
        if "keys" in scalars:
            scalars["keys"] = tuple(str(k) for k in scalars["keys"])
        maps: dict[str, tuple[Mapping[Any, Any], frozenset[Any]]] = {}
        for name, m in doc["m"].items():
            if name == "rollups":
                maps[name] = (
                    {int(k): str(v) for k, v in m["put"].items()},
                    frozenset(int(k) for k in m["del"]),
                )
            else:
                codec = MAP_CODECS[name]
                maps[name] = (
                    {k: codec.from_json(v) for k, v in m["put"].items()},
                    frozenset(m["del"]),
                )
        return StateDiff(
            shard_id=str(doc["shard"]),
            from_seqno=int(doc["from"]),
            to_seqno=int(doc["to"]),
            scalars=scalars,
            maps=maps,
        )
    except CorruptData:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CorruptData(f"{where}: malformed state data: {e!r}") from e
