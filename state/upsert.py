"""Upserts and deletes on a keyed shard: find the current rows of a write's keys, then commit.

An upsert is one ``compare_and_append`` at the shard's upper whose batch
retracts the current rows of the write's keys and inserts the new rows, at
one time ``t >= upper`` (:mod:`.keyed` decides what it writes). The current
rows are the rows the shard's updates add up to before the upper, so
nothing but the upper needs checking at the commit: if it moved, another
write landed in between and :class:`~.commands.UpperMismatch` sends the
upsert back to look again, at the batches added since only, and retry with
the same token (a retry of a landed attempt is answered
``AlreadyCommitted``). Concurrent upserts are therefore linearizable by the
compare-and-set alone, as every other write.

Finding the current rows reads neither the whole shard nor, mostly, whole
parts (see the docs' architecture page for the measurements):

1. A part whose key range (the column ranges ``PartStats`` keeps in its
   reference) holds none of the write's keys is skipped with no I/O.
2. Of a part that may hold some, only its key columns are compared with the
   write's keys. A part is immutable, so its key columns are cached in the
   process by part key (:class:`KeyColumnCache`, bounded by bytes): a writer
   that keeps upserting (a streaming sink's driver) reads each part's keys once.
3. Only the rows that matched are decoded whole: the Parquet row groups
   that hold them, or a ``take`` of an Arrow part's mapped batches.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .blob import Blob
from .codec import ARROW, PARQUET, encode_inline, iter_part_batches, part_checksum
from .commands import AlreadyCommitted, AppendResult, Committed, UpperMismatch
from .errors import InvalidUsage, PartNotFound
from .fetch import fetch_part_bytes
from .keyed import (
    DELETE,
    mask_with_keys,
    plan_upsert,
    rows_with_keys,
)
from .machine import Machine
from .part_formats import new_part_key
from .schema import DIFF, data_schema
from .state import Batch, PartRef, ShardState, Time
from .stats import PartStats
from .upsert_input import UpsertWrite

KEY_CACHE_BYTES = 256 << 20
"""The bytes of part key columns one process keeps (:class:`KeyColumnCache`)."""
MAPPED_PARTS = 256
"""The ``file://`` Arrow parts one process keeps mapped for lookups (:class:`KeyColumnCache`)."""


CacheKey = tuple[str, str | bytes, tuple[str, ...]]
"""A cached part's Blob, identity (its Blob key, or an inline part's bytes) and key columns."""


@dataclass(frozen=True)
class PartKeys:
    """The key columns of one part's stored updates, read (and checksummed) once.

    One integer key column is kept as its distinct values sorted, each with where its rows
    start in ``order`` (the rows sorted by key; the next key's start ends them): finding a
    write's keys is one binary search per key, in 16 bytes a row. Other keys keep their
    columns, matched with ``is_in`` or a semi join.
    """

    columns: pa.Table | None
    distinct: np.ndarray | None = None
    starts: np.ndarray | None = None
    order: np.ndarray | None = None

    @classmethod
    def of(cls, columns: pa.Table) -> PartKeys:
        """Index ``columns`` (combined into one chunk)."""
        columns = columns.combine_chunks()
        n = columns.num_rows
        if columns.num_columns == 1 and pa.types.is_integer(columns.schema.types[0]) and n:
            values = columns.column(0).to_numpy()
            index = np.int32 if n < 2**31 else np.int64
            order = np.argsort(values, kind="stable").astype(index)
            distinct, starts = np.unique(values[order], return_index=True)
            starts = np.append(starts, n).astype(index)
            return cls(None, distinct, starts, order)
        return cls(columns)

    @property
    def nbytes(self) -> int:
        """Memory held."""
        arrays = (self.distinct, self.starts, self.order)
        held = sum(a.nbytes for a in arrays if a is not None)
        return held + (0 if self.columns is None else int(self.columns.nbytes))

    def positions(self, keys: tuple[str, ...], wanted: Wanted) -> np.ndarray:
        """The sorted row positions whose key is one of ``wanted``'s."""
        if self.columns is not None:
            mask = mask_with_keys(self.columns, keys, wanted.table)
            return np.flatnonzero(mask.to_numpy(zero_copy_only=False))
        values = wanted.values
        assert values is not None and self.distinct is not None
        assert self.starts is not None and self.order is not None
        at = np.searchsorted(self.distinct, values)
        inside = at < len(self.distinct)
        at, values = at[inside], values[inside]
        hit = at[self.distinct[at] == values]
        first = self.starts[hit].astype(np.int64)
        lens = self.starts[hit + 1] - first
        total = int(lens.sum())
        if total == 0:
            return np.empty(0, dtype=np.int64)
        ends = np.cumsum(lens)
        offsets = np.arange(total) - np.repeat(ends - lens, lens)
        return np.sort(self.order[np.repeat(first, lens) + offsets].astype(np.int64))


@dataclass(frozen=True)
class Wanted:
    """A write's distinct keys (a key table), and with one integer key column its values."""

    table: pa.Table

    @cached_property
    def values(self) -> np.ndarray | None:
        """The values of a single integer key column, sorted (a binary search of sorted needles
        walks the part's values in order), else None."""
        if self.table.num_columns == 1 and pa.types.is_integer(self.table.schema.types[0]):
            return np.sort(np.asarray(self.table.column(0).to_numpy()))
        return None


class KeyColumnCache:
    """The key columns of immutable parts (:class:`PartKeys`), by Blob key (an inline part:
    by its bytes), least recently used out first.

    Never stale: a part key is written once and never changed. Thread-safe.
    """

    def __init__(self, max_bytes: int = KEY_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[CacheKey, PartKeys] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._mapped: OrderedDict[CacheKey, list[pa.RecordBatch]] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def mapped(
        self, key: CacheKey, load: Callable[[], list[pa.RecordBatch]]
    ) -> list[pa.RecordBatch]:
        """The batches of a mapped (``file://``) Arrow part, kept mapped across lookups: its
        pages stay in this process's page tables (they are the page cache's, not its heap),
        where mapping the file anew faulted in every page a lookup touched, each time."""
        with self._lock:
            found = self._mapped.get(key)
            if found is not None:
                self._mapped.move_to_end(key)
                return found
        batches = load()
        with self._lock:
            self._mapped[key] = batches
            while len(self._mapped) > MAPPED_PARTS:
                self._mapped.popitem(last=False)
        return batches

    def get(self, key: CacheKey) -> PartKeys | None:
        with self._lock:
            found = self._items.get(key)
            if found is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: CacheKey, keys: PartKeys) -> None:
        size = keys.nbytes
        if size > self.max_bytes // 4:
            return
        with self._lock:
            if key in self._items:
                return
            self._items[key] = keys
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._items.popitem(last=False)
                self._bytes -= old.nbytes


KEY_CACHE = KeyColumnCache()
"""The process's cache of part key columns (shared by every shard and client)."""


@dataclass
class Lookup:
    """What one lookup read: the matching updates, and how much it touched (for tests/benches)."""

    updates: pa.Table
    tombstones: pa.Table | None = None
    """With a sequence column: the (key columns, sequence) of the keys' remembered deletes."""
    parts: int = 0
    parts_skipped: int = 0
    parts_read: int = 0
    rows_decoded: int = 0


def _may_hold(part: PartRef, keys: tuple[str, ...], wanted: pa.Table) -> bool:
    """False when the part's recorded key ranges hold none of ``wanted``'s keys."""
    stats = part.stats
    if not stats:
        return True
    mask: pa.Array | None = None
    for k in keys:
        span = stats.get(k)
        col = wanted.column(k)
        if span is None:
            return True
        typ = col.type
        if not (pa.types.is_integer(typ) or pa.types.is_string(typ)):
            return True
        lo, hi = pa.scalar(span[0], typ), pa.scalar(span[1], typ)
        inside = pc.and_(pc.greater_equal(col, lo), pc.less_equal(col, hi))
        mask = inside if mask is None else pc.and_(mask, inside)
    return mask is None or bool(pc.any(mask).as_py())


def _key_columns(
    blob: Blob, part: PartRef, shard_id: str, keys: tuple[str, ...], cache: KeyColumnCache
) -> tuple[PartKeys, bool]:
    """The key columns of every stored update of ``part``, and whether they came from the
    cache (then the part's bytes were checksummed when they were read)."""
    ckey = (blob.uri, part.identity, keys)
    hit = cache.get(ckey)
    if hit is not None:
        return hit, True
    data = fetch_part_bytes(blob, part, shard_id)
    if part.inline is None and part.fmt == PARQUET:
        table = pq.read_table(pa.BufferReader(pa.py_buffer(data)), columns=list(keys))
    else:
        batches = [b.select(list(keys)) for b in iter_part_batches(data, part, shard_id)]
        if not batches:
            return PartKeys(pa.table({k: pa.array([], pa.int64()) for k in keys})), False
        table = pa.Table.from_batches(batches)
    found = PartKeys.of(table)
    cache.put(ckey, found)
    return found, False


def _rows_at(
    blob: Blob,
    part: PartRef,
    shard_id: str,
    rows: np.ndarray,
    checked: bool,
    cache: KeyColumnCache,
) -> pa.Table:
    """The stored updates of ``part`` at the sorted row positions ``rows``.

    Of a Parquet part only the row groups that hold them are decoded; of an Arrow part (a
    mapped file) only the batches that hold them are taken from. ``checked``: the part's
    bytes were checksummed before (a part never changes), so they are not again; an Arrow
    part of a ``file://`` Blob then stays mapped in ``cache`` (:meth:`KeyColumnCache.mapped`).
    """
    if checked and part.key is not None and part.fmt != PARQUET and blob.uri.startswith("file:"):
        ckey = (blob.uri, part.identity, ())
        batches = cache.mapped(ckey, lambda: _batches(blob, part, shard_id, checked))
        return _take(batches, rows)
    data = blob.get_view(part.key) if checked and part.key is not None else None
    if data is None:
        data = fetch_part_bytes(blob, part, shard_id)
    if part.inline is None and part.fmt == PARQUET:
        pf = pq.ParquetFile(pa.BufferReader(pa.py_buffer(data)))
        starts = np.cumsum(
            [0] + [pf.metadata.row_group(i).num_rows for i in range(pf.num_row_groups)]
        )
        groups = sorted(set(np.searchsorted(starts, rows, side="right") - 1))
        table = pf.read_row_groups(groups)
        offsets = np.concatenate([np.arange(starts[g], starts[g + 1]) for g in groups])
        local = np.searchsorted(offsets, rows)
        return table.take(pa.array(local))
    return _take(list(iter_part_batches(data, part, shard_id)), rows)


def _batches(blob: Blob, part: PartRef, shard_id: str, checked: bool) -> list[pa.RecordBatch]:
    """A part's stored batches (views of its mapped bytes)."""
    data = blob.get_view(part.key) if checked and part.key is not None else None
    if data is None:
        data = fetch_part_bytes(blob, part, shard_id)
    return list(iter_part_batches(data, part, shard_id))


def _take(batches: list[pa.RecordBatch], rows: np.ndarray) -> pa.Table:
    """The rows at sorted positions ``rows`` of ``batches`` taken in order, batch by batch."""
    bounds = np.cumsum([0] + [b.num_rows for b in batches])
    which = np.searchsorted(bounds, rows, side="right") - 1
    taken = [
        batches[i].take(pa.array(rows[which == i] - bounds[i])) for i in np.unique(which).tolist()
    ]
    return pa.Table.from_batches(taken)


def lookup(
    blob: Blob,
    shard_id: str,
    schema: pa.Schema,
    batches: Iterable[Batch],
    keys: tuple[str, ...],
    wanted: pa.Table,
    cache: KeyColumnCache = KEY_CACHE,
    sequence: str | None = None,
) -> Lookup:
    """The updates of ``batches`` whose key is one of ``wanted``'s, shaped as a reader sees them
    (a negated part's diffs flipped; times left as stored: the caller sums over them), and
    with a ``sequence`` column the tombstones of those keys."""
    out = Lookup(updates=data_schema(schema).empty_table())
    if sequence is not None:
        out.tombstones = tombstone_schema(schema, keys, sequence).empty_table()
    if wanted.num_rows == 0:
        return out
    found: list[pa.Table] = []
    tombs: list[pa.Table] = []
    target = data_schema(schema)
    want = Wanted(wanted)
    for batch in batches:
        for part in batch.tombstones if sequence is not None else ():
            if _may_hold(part, keys, wanted):
                data = fetch_part_bytes(blob, part, shard_id)
                stored = pa.Table.from_batches(list(iter_part_batches(data, part, shard_id)))
                tombs.append(rows_with_keys(stored, keys, wanted))
        for part in batch.parts:
            out.parts += 1
            if not _may_hold(part, keys, wanted):
                out.parts_skipped += 1
                continue
            out.parts_read += 1
            part_keys, checked = _key_columns(blob, part, shard_id, keys, cache)
            rows = part_keys.positions(keys, want)
            if len(rows) == 0:
                continue
            hit = _rows_at(blob, part, shard_id, rows, checked, cache)
            out.rows_decoded += hit.num_rows
            if part.negate:
                idx = hit.schema.get_field_index(DIFF)
                hit = hit.set_column(idx, hit.schema.field(idx), pc.negate(hit.column(DIFF)))
            found.append(_conformed(hit, target))
    if found:
        out.updates = pa.concat_tables(found)
    if tombs:
        out.tombstones = pa.concat_tables(tombs)
    return out


def tombstone_schema(schema: pa.Schema, keys: tuple[str, ...], sequence: str) -> pa.Schema:
    """The columns of a tombstone part: the key columns and the sequence column."""
    return pa.schema([schema.field(k) for k in (*keys, sequence)])


def stage_tombstones(machine: Machine, deleted: pa.Table, time: Time) -> tuple[PartRef, ...]:
    """A tombstone part of ``deleted`` (key columns and sequence), inline when it is small
    (``inline_write_max_bytes``) and state's inline budget has room (compaction does not move
    tombstones out), else an Arrow part in Blob (invisible until committed)."""
    if deleted.num_rows == 0:
        return ()
    data = encode_inline(deleted)
    stats = PartStats(with_columns=True)
    stats.add(deleted, insert_time=time)
    cfg = machine.config
    room = cfg.inline_total_max_bytes - machine.state().inline_bytes
    if len(data) <= min(cfg.inline_write_max_bytes, room):
        return (stats.ref(None, data, len(data), None, ARROW),)
    key = new_part_key(machine.shard_id, ARROW)
    machine.blob.set(key, data)
    return (stats.ref(key, None, len(data), part_checksum(data), ARROW),)


def _conformed(table: pa.Table, target: pa.Schema) -> pa.Table:
    """``table`` with exactly ``target``'s columns (a part older than a column reads null)."""
    n = table.num_rows
    have = set(table.column_names)
    arrays = [
        table.column(f.name).cast(f.type) if f.name in have else pa.nulls(n, f.type) for f in target
    ]
    return pa.Table.from_arrays(arrays, schema=target)


@dataclass
class KnownRows:
    """The updates (and tombstones) of a set of keys up to ``upper`` (the state read)."""

    upper: Time
    found: Lookup


def catch_up(
    known: KnownRows | None,
    state: ShardState,
    read: Callable[[Sequence[Batch]], Lookup],
) -> KnownRows:
    """The updates of the write's keys up to ``state.upper``: ``known``'s plus those of the
    batches added since, or all of them read again when compaction merged a batch across
    ``known.upper`` (a merged batch's updates can no longer be told apart)."""
    trace = state.trace
    if known is not None and all(b.lower >= known.upper or b.upper <= known.upper for b in trace):
        more = read([b for b in trace if b.lower >= known.upper])
        old = known.found
        updates = pa.concat_tables([old.updates, more.updates])
        tombs = None
        if old.tombstones is not None and more.tombstones is not None:
            tombs = pa.concat_tables([old.tombstones, more.tombstones])
        return KnownRows(state.upper, Lookup(updates, tombs))
    return KnownRows(state.upper, read(trace))


@dataclass(frozen=True)
class UpsertAttempt:
    """One attempt of an upsert: ``updates`` (in ``schema``) and ``tombstones`` (staged) to
    commit as the batch ``[upper, new_upper)``."""

    updates: pa.Table
    schema: pa.Schema
    upper: Time
    new_upper: Time
    tombstones: tuple[PartRef, ...]


UpsertCommit = Callable[[UpsertAttempt], AppendResult]
"""Stage an attempt's updates and compare_and_append them, with the same token every time."""


def part_format(state: ShardState) -> str:
    """The format a shard's writes and compactions store parts in: Parquet, but Arrow for a
    keyed shard, whose upserts fetch scattered rows of every part (a ``take`` from a mapped
    Arrow part decodes nothing; a Parquet part decodes every row group that holds one)."""
    return ARROW if state.keys else PARQUET


def refuse_keyed(state: ShardState, what: str) -> None:
    """InvalidUsage when a write that does not upsert (``what``) goes to a keyed shard."""
    if state.keys:
        raise InvalidUsage(
            f"{what} could leave two rows of a key in keyed shard {state.shard_id!r}: write it "
            "with upsert() and delete(), which retract each key's current row"
        )


def plan_attempt(
    machine: Machine, write: UpsertWrite, state: ShardState, known: KnownRows | None
) -> tuple[ShardState, KnownRows, UpsertAttempt]:
    """Plan one attempt of ``write`` at ``t = max(upper, clock)`` against ``state`` (or a newer
    state, returned, when compaction and GC took parts the lookup needed), tombstones staged.

    The attempt reads the updates of the write's keys up to the upper, caught
    up from ``known`` with the batches added since (:func:`catch_up`).
    """
    blob, shard = machine.blob, machine.shard_id

    def read(batches: Sequence[Batch]) -> Lookup:
        return lookup(
            blob, shard, write.schema, batches, write.keys, write.wanted, sequence=write.sequence
        )

    while True:
        try:
            known = catch_up(known, state, read)
            break
        except PartNotFound:
            # The lookup holds no SeqNo lease: if compaction replaced the batches it read and
            # GC deleted their parts meanwhile, look again in the new state. A part missing
            # from batches still in state is real loss: that is raised.
            current = machine.fetch_latest()
            if all(current.batches.get(b.key) == b for b in state.trace):
                raise
            state, known = current, None
    t = max(state.upper, machine.clock_ms())
    found = known.found
    updates, took = plan_upsert(
        write.writes, found.updates, write.schema, write.keys, t, write.sequence, found.tombstones
    )
    tombs: tuple[PartRef, ...] = ()
    if write.sequence is not None:
        deleted = took.filter(took.column(DELETE)).select([*write.keys, write.sequence])
        tombs = stage_tombstones(machine, deleted, t)
    return state, known, UpsertAttempt(updates, write.schema, state.upper, t + 1, tombs)


def run_upsert(
    machine: Machine, write: UpsertWrite, commit: UpsertCommit
) -> Committed | AlreadyCommitted:
    """Commit ``write`` as one upsert, retrying lost races.

    Each attempt plans against the state it read (:func:`plan_attempt`).
    ``commit`` carries the same token every time, so an attempt that landed
    answers every later one ``AlreadyCommitted``.
    """
    state = machine.state()
    known: KnownRows | None = None
    while True:
        state, known, attempt = plan_attempt(machine, write, state, known)
        result = commit(attempt)
        if not isinstance(result, UpperMismatch):
            return result
        state = machine.state()
        if state.upper != result.current:
            state = machine.fetch_latest()
