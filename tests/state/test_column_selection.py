"""Reading only some columns of a shard: every part format, nothing of the rest decoded or copied.

A query that needs 2 of 40 columns must not pay for 40: Parquet parts decode
only the named column chunks, Arrow IPC parts (``arrow``, ``arrow-rows``,
inline) hand out views of the named columns' buffers. Whatever the format, the
rows and their ``_time``/``_diff`` are the full read's, projected.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pyspark_persist.state import (
    DIFF,
    TIME,
    BatchBuilder,
    LeasedPart,
    PersistClient,
    PersistConfig,
    iter_parts,
    select_columns,
)
from pyspark_persist.state.codec import ARROW, ARROW_ROWS, PARQUET, PART_FORMATS, iter_part_batches
from pyspark_persist.state.errors import CorruptData, InvalidUsage, SchemaMismatch
from pyspark_persist.state.fetch import fetch_part_bytes

SCHEMA = pa.schema(
    [("id", pa.int64()), ("x", pa.float64()), ("name", pa.string()), ("flag", pa.bool_())]
)


def rows(n: int, start: int = 0) -> pa.Table:
    """``n`` rows with ids from ``start``; every 5th name is null."""
    ids = range(start, start + n)
    return pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "x": pa.array([i * 0.25 for i in ids], pa.float64()),
            "name": pa.array([None if i % 5 == 0 else f"n{i}" for i in ids], pa.string()),
            "flag": pa.array([i % 3 == 0 for i in ids], pa.bool_()),
        },
        schema=SCHEMA,
    )


@pytest.fixture
def client(tmp_path: Path) -> Any:
    config = PersistConfig(part_target_bytes=16 << 10, maintenance=False, read_batch_rows=256)
    c = PersistClient.open(
        f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/consensus.db", config=config
    )
    yield c
    c.close()


def committed_parts(client: Any, fmt: str, inline: bool = False) -> tuple[Any, list[LeasedPart]]:
    """A shard holding 3,000 rows in parts of ``fmt`` (one inline part if ``inline``),
    committed at time 4, and its parts leased for a listen-style read of [0, 5)."""
    shard = client.open_shard(f"sel-{fmt}-{inline}", SCHEMA)
    builder = BatchBuilder(
        client.blob,
        shard.machine.shard_id,
        SCHEMA,
        client.config,
        allow_inline=inline,
        part_format=fmt,
    )
    builder.add(rows(2 if inline else 3000))
    staged = builder.finish()
    assert [p.inline is not None for p in staged.parts][:1] == [inline]
    shard.writer().compare_and_append_batches([staged], 0, 5, ts_rewrite=4)
    state = shard.state()
    leased = [
        LeasedPart(state.shard_id, client.blob.uri, p, 0, 5, None, state.seqno)
        for b in state.trace
        for p in b.parts
    ]
    return shard, leased


@pytest.mark.parametrize(("fmt", "inline"), [(f, False) for f in PART_FORMATS] + [(ARROW, True)])
def test_a_column_subset_reads_the_full_reads_rows_projected(
    client: Any, fmt: str, inline: bool
) -> None:
    """Named columns come in the order named, then _time and _diff, with the full read's
    values, in every part format and inline."""
    _, leased = committed_parts(client, fmt, inline)
    full = pa.concat_tables(iter_parts(client.blob, leased, schema=SCHEMA))
    some = pa.concat_tables(iter_parts(client.blob, leased, schema=SCHEMA, columns=["name", "id"]))
    assert some.column_names == ["name", "id", TIME, DIFF]
    assert some.num_rows == full.num_rows > 0
    assert some.equals(full.select(["name", "id", TIME, DIFF]))
    assert set(some.column(TIME).to_pylist()) == {4} and set(some.column(DIFF).to_pylist()) == {1}


@pytest.mark.parametrize("fmt", [ARROW, ARROW_ROWS])
def test_arrow_parts_hand_out_views_of_the_named_columns_only(client: Any, fmt: str) -> None:
    """An Arrow part's selected columns are the stored bytes in place (no copy), and the
    batches hold no other row column."""
    _, leased = committed_parts(client, fmt)
    part = leased[0].part
    data = fetch_part_bytes(client.blob, part, leased[0].shard_id)
    start = pa.py_buffer(data).address
    batches = list(iter_part_batches(data, part, leased[0].shard_id, columns=["x"]))
    assert batches and all(rb.schema.names == ["x", TIME, DIFF] for rb in batches)
    for rb in batches:
        values = rb.column(0).buffers()[1]
        assert values is not None and start <= values.address < start + len(data)


def corrupt_column_chunks(data: bytes, column: str) -> bytes:
    """A Parquet file's bytes with every page of ``column`` overwritten with garbage."""
    meta = pq.ParquetFile(pa.BufferReader(data)).metadata
    out = bytearray(data)
    index = meta.schema.to_arrow_schema().get_field_index(column)
    for g in range(meta.num_row_groups):
        chunk = meta.row_group(g).column(index)
        begin = chunk.dictionary_page_offset or chunk.data_page_offset
        out[begin : begin + chunk.total_compressed_size] = b"\xa5" * chunk.total_compressed_size
    return bytes(out)


def test_a_parquet_part_decodes_only_the_named_columns(client: Any) -> None:
    """Pages of a column not named are never read: a Parquet part whose ``name`` pages are
    garbage still reads ``id`` and ``x``, while a read that needs ``name`` finds them bad."""
    _, leased = committed_parts(client, PARQUET)
    part, shard_id = leased[0].part, leased[0].shard_id
    good = bytes(fetch_part_bytes(client.blob, part, shard_id))
    bad = corrupt_column_chunks(good, "name")
    expected = pa.Table.from_batches(list(iter_part_batches(good, part, shard_id)))
    got = pa.Table.from_batches(list(iter_part_batches(bad, part, shard_id, columns=["x", "id"])))
    assert got.equals(expected.select(["x", "id", TIME, DIFF]))
    with pytest.raises(CorruptData, match="cannot be decoded"):
        list(iter_part_batches(bad, part, shard_id, columns=["name"]))


@pytest.mark.parametrize("fmt", PART_FORMATS)
def test_a_part_written_before_a_named_column_was_added_reads_null_there(
    client: Any, fmt: str
) -> None:
    """Schema evolution holds for a subset read: the old part lacks ``score`` and reads null."""
    shard, leased = committed_parts(client, fmt)
    wider = SCHEMA.append(pa.field("score", pa.float64()))
    got = pa.concat_tables(iter_parts(client.blob, leased, schema=wider, columns=["score", "flag"]))
    assert got.column_names == ["score", "flag", TIME, DIFF]
    assert got.column("score").null_count == got.num_rows == 3000
    assert got.column("flag").to_pylist() == rows(3000).column("flag").to_pylist()


def test_select_columns_keeps_the_order_asked_and_names_what_the_shard_lacks() -> None:
    assert select_columns(SCHEMA, ["flag", "id"], "s", "read").names == ["flag", "id"]
    assert select_columns(SCHEMA, ["id", DIFF, TIME], "s", "read").names == ["id"]
    with pytest.raises(SchemaMismatch, match=r"no column\(s\) 'ID' \(did you mean 'id'\?\), 'z'"):
        select_columns(SCHEMA, ["ID", "z"], "events", "read")
    with pytest.raises(InvalidUsage, match="named twice"):
        select_columns(SCHEMA, ["id", "id"], "events", "read")


@pytest.mark.parametrize("fmt", PART_FORMATS)
def test_a_cut_part_reads_its_rows_of_the_named_columns(client: Any, fmt: str) -> None:
    """A default split cuts a part by stored rows while the query names some columns: each
    piece reads exactly its rows of exactly those columns, and the pieces add up to the part."""
    _, leased = committed_parts(client, fmt)
    whole = leased[0]
    n = whole.part.rows
    full = pa.concat_tables(iter_parts(client.blob, [whole], schema=SCHEMA))
    cuts = [(0, n // 3), (n // 3, n // 2 + 1), (n // 2 + 1, n)]
    got = [
        pa.concat_tables(
            iter_parts(
                client.blob, [replace(whole, row_range=r)], schema=SCHEMA, columns=["x", "id"]
            )
        )
        for r in cuts
    ]
    for (start, stop), piece in zip(cuts, got, strict=True):
        assert piece.column_names == ["x", "id", TIME, DIFF]
        assert piece.equals(full.slice(start, stop - start).select(["x", "id", TIME, DIFF]))
