"""The one-row write path: inline encoding and buffer sizing, exact however cheap."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import DIFF, TIME, BatchBuilder, PersistClient, PersistConfig
from pyspark_persist.state.codec import encode_inline

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])


def stream_writer_bytes(table: pa.Table) -> bytes:
    """What ``pa.ipc.new_stream`` writes for ``table``: the format inline parts promise."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


def part_table(schema: pa.Schema, columns: dict[str, list[object]]) -> pa.Table:
    n = len(next(iter(columns.values())))
    full = schema.append(pa.field(TIME, pa.uint64())).append(pa.field(DIFF, pa.int64()))
    return pa.table({**columns, TIME: [7] * n, DIFF: [1] * n}, schema=full)


TABLES = {
    "one row": part_table(SCHEMA, {"id": [1], "name": ["row-1"]}),
    "nulls": part_table(SCHEMA, {"id": [None, 2], "name": ["a", None]}),
    "chunked": pa.concat_tables(
        [
            part_table(SCHEMA, {"id": [1], "name": ["a"]}),
            part_table(SCHEMA, {"id": [2], "name": ["b"]}),
        ]
    ),
    "schema metadata": part_table(SCHEMA.with_metadata({"k": "v"}), {"id": [1], "name": ["x"]}),
    "dictionary": part_table(
        pa.schema([("tag", pa.dictionary(pa.int32(), pa.string()))]), {"tag": ["a", "b", "a"]}
    ),
    "nested dictionary": part_table(
        pa.schema([("tags", pa.list_(pa.dictionary(pa.int32(), pa.string())))]),
        {"tags": [["a", "b"], ["a"]]},
    ),
    "sliced": part_table(SCHEMA, {"id": list(range(10)), "name": list("abcdefghij")}).slice(3, 2),
}


@pytest.mark.parametrize("name", list(TABLES))
def test_inline_encoding_is_the_ipc_stream_and_reads_back(name: str) -> None:
    """Every inline part is the IPC stream the writer would have written, bytes for bytes."""
    # Twice in a row, then after another schema: the cached schema message never goes stale.
    for table in (TABLES[name], TABLES[name], TABLES["one row"], TABLES[name]):
        encoded = encode_inline(table)
        assert encoded == stream_writer_bytes(table)
        back = pa.ipc.open_stream(encoded).read_all()
        assert back.equals(table, check_metadata=True)


def test_one_row_writes_ride_inline_and_read_back(tmp_path: Path) -> None:
    client = PersistClient.open(
        f"file://{tmp_path}/blob",
        f"sqlite:///{tmp_path}/c.db",
        config=PersistConfig(maintenance=False),
    )
    with client:
        shard = client.open_shard("small", SCHEMA)
        writer = shard.writer()
        for i in range(20):
            writer.append(pa.table({"id": [i], "name": [f"row-{i}"]}, schema=SCHEMA))
        state = shard.machine.state()
        assert all(p.inline is not None for b in state.trace for p in b.parts)
        got = shard.reader().snapshot_table(writer.upper - 1)
        assert sorted(got.column("id").to_pylist()) == list(range(20))


@pytest.mark.parametrize("sliced", [False, True])
def test_parts_are_cut_at_the_target_from_small_or_sliced_inputs(
    tmp_path: Path, sliced: bool
) -> None:
    """Sizing by buffer bounds never cuts a part early, even from slices of a big table
    (whose buffers are the whole table's)."""
    target = 64 << 10
    config = PersistConfig(part_target_bytes=target)
    client = PersistClient.open(
        f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config
    )
    with client:
        shard = client.open_shard("cut", SCHEMA)
        n = 40_000
        big = part_table(
            SCHEMA, {"id": list(range(n)), "name": [f"name-{i:06d}" for i in range(n)]}
        )
        pieces = (
            [big.slice(i, 100) for i in range(0, n, 100)]
            if sliced
            else [
                pa.Table.from_batches(big.slice(i, 100).to_batches()).combine_chunks()
                for i in range(0, n, 100)
            ]
        )
        builder = BatchBuilder(
            client.blob, shard.machine.shard_id, SCHEMA, config, allow_inline=False
        )
        for piece in pieces:
            builder.add(piece)
        staged = builder.finish()
        rows_per_target = target * n // big.nbytes
        assert sum(p.rows for p in staged.parts) == n
        assert len(staged.parts) == -(-n // rows_per_target)
        assert all(abs(p.rows - rows_per_target) <= 100 for p in staged.parts[:-1])


def test_trace_and_inline_bytes_carried_through_commits_equal_recomputed() -> None:
    """Commits carry the trace and inline byte total forward; after appends, replaces and
    merges they are what a fresh look at the batches gives."""
    config = PersistConfig(compaction_fan_in=2, inline_write_max_bytes=1 << 20)
    with PersistClient.open("mem://totals", "mem://totals", config=config) as client:
        shard = client.open_shard("totals", SCHEMA)
        writer = shard.writer()
        machine = shard.machine
        merged = False
        for i in range(60):
            n = 1 + i % 3
            table = pa.table({"id": [i] * n, "name": ["x"] * n}, schema=SCHEMA)
            if i % 17 == 16:
                staged = writer.builder()
                staged.add(table.append_column(TIME, pa.array([writer.upper] * n, pa.uint64())))
                upper = writer.upper
                writer.compare_and_append_batches([staged.finish()], upper, upper + 1, replace=True)
            else:
                writer.append(table)
            client.maintenance.wait_idle()
            state = machine.state()
            fresh = dataclasses.replace(state)  # no cached totals: computed from the batches
            assert state.trace == fresh.trace
            assert state.inline_bytes == fresh.inline_bytes
            merged = merged or len(state.trace) < i + 1
        assert merged  # compaction replaced batches along the way


def test_parquet_parts_stream_to_blob_in_pieces_and_read_back(tmp_path: Path) -> None:
    """A staged Parquet part goes to Blob page by page as it is encoded, never as one whole
    encoded copy in memory; its recorded size and checksum are the stored file's."""
    from pyspark_persist.state.codec import part_checksum

    writes: list[int] = []
    config = PersistConfig(part_target_bytes=8 << 20, maintenance=False)
    with PersistClient.open(
        f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config
    ) as client:
        open_writer = client.blob.open_writer

        def recording_writer(key: str) -> Any:
            out = open_writer(key)
            write = out.write

            def counted(data: Any) -> int:
                writes.append(memoryview(data).nbytes)
                return write(data)

            out.write = counted  # type: ignore[method-assign]
            return out

        client.blob.open_writer = recording_writer  # type: ignore[method-assign]
        shard = client.open_shard("stream", SCHEMA)
        n = 200_000
        table = pa.table(
            {"id": list(range(n)), "name": [f"name-{i}" for i in range(n)]}, schema=SCHEMA
        )
        builder = shard.writer().builder()
        builder.add(table)
        staged = builder.finish()
        (part,) = staged.parts
        assert part.key is not None and len(writes) > 2
        assert max(writes) < part.size_bytes / 2
        stored = (tmp_path / "blob" / part.key).read_bytes()
        assert len(stored) == part.size_bytes and part_checksum(stored) == part.crc
        writer = shard.writer()
        writer.compare_and_append_batches([staged], 0, 1, ts_rewrite=0)
        got = shard.reader().snapshot_table(0)
        assert sorted(got.column("id").to_pylist()) == list(range(n))
