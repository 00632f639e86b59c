"""An upsert's or delete's input, checked against its keyed shard before anything is staged.

What :meth:`~.write.WriteHandle.upsert` and a transaction's upsert
(:mod:`.txn_commit`) both do first: the key columns present, of the shard's
types and never null, a sequence and a delete column as documented, the
rows in the shard's columns, one row per key (:func:`~.keyed.prepare_write`).
Every attempt of the write then plans from the :class:`UpsertWrite`
(:func:`~.upsert.plan_attempt`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa

from .errors import InvalidUpdates, InvalidUsage
from .keyed import check_key_columns, check_sequence_column, key_table, prepare_write
from .machine import Machine
from .schema import conform_inserts, decode_schema


@dataclass(frozen=True)
class UpsertWrite:
    """An upsert's (or delete's) rows checked against the shard, one per key
    (:func:`~.keyed.prepare_write`'s): what every attempt plans from."""

    schema: pa.Schema
    keys: tuple[str, ...]
    writes: pa.Table
    sequence: str | None

    @cached_property
    def wanted(self) -> pa.Table:
        """The write's distinct keys."""
        return key_table(self.writes, self.keys)


def prepare_upsert(
    machine: Machine,
    rows: pa.Table | pa.RecordBatch,
    *,
    sequence: str | None = None,
    delete_column: str | None = None,
) -> UpsertWrite:
    """Check ``rows`` for an upsert (keys, sequence and delete columns, the shard's columns),
    raising before anything is staged; see :meth:`~.write.WriteHandle.upsert`."""
    table = _as_table(rows)
    deletes: pa.ChunkedArray | bool = False
    if delete_column is not None:
        deletes = _delete_flags(table, delete_column, machine.shard_id)
        table = table.drop_columns([delete_column])
    schema = decode_schema(machine.state().schema)
    keys = _keys(machine, "upsert")
    check_key_columns(table, keys, schema, machine.shard_id)  # names the key, before the rest
    if sequence is not None:
        check_sequence_column(table, schema, sequence, machine.shard_id)
    table = conform_inserts(table, schema, machine.shard_id)
    writes = prepare_write(
        table, schema, keys, machine.shard_id, deletes=deletes, sequence=sequence
    )
    return UpsertWrite(schema, keys, writes, sequence)


def prepare_delete(
    machine: Machine, keys: pa.Table | pa.RecordBatch, sequence: str | None = None
) -> UpsertWrite:
    """Check ``keys`` (a table of the key columns) for a delete; see
    :meth:`~.write.WriteHandle.delete`."""
    table = _as_table(keys)
    schema = decode_schema(machine.state().schema)
    key_columns = _keys(machine, "delete")
    writes = prepare_write(
        table, schema, key_columns, machine.shard_id, deletes=True, sequence=sequence
    )
    return UpsertWrite(schema, key_columns, writes, sequence)


def _keys(machine: Machine, what: str) -> tuple[str, ...]:
    keys = machine.state().keys
    if not keys:
        raise InvalidUsage(
            f"{what} needs a keyed shard, and shard {machine.shard_id!r} has no keys: create "
            'it with open_shard(name, schema, keys=["id"]), or use append()'
        )
    return keys


def _as_table(rows: pa.Table | pa.RecordBatch) -> pa.Table:
    if isinstance(rows, pa.RecordBatch):
        return pa.Table.from_batches([rows])
    if not isinstance(rows, pa.Table):
        raise InvalidUpdates(
            f"rows must be a pyarrow.Table or RecordBatch, got {type(rows).__name__}"
        )
    return rows


def _delete_flags(table: pa.Table, column: str, shard: str) -> pa.ChunkedArray:
    """The boolean delete column of an upsert, checked: present, boolean, never null."""
    if column not in table.column_names:
        raise InvalidUpdates(
            f"the upsert to shard {shard!r} lacks its delete column {column!r}: add a boolean "
            "column (true: delete the key)"
        )
    flags = table.column(column)
    if not pa.types.is_boolean(flags.type):
        raise InvalidUpdates(
            f"delete column {column!r} of the upsert to shard {shard!r} is {flags.type}: it "
            "must be boolean (true: delete the key)"
        )
    if flags.null_count:
        raise InvalidUpdates(
            f"{flags.null_count} rows of the upsert to shard {shard!r} have a null in delete "
            f"column {column!r}: say true or false"
        )
    return flags
