"""Part formats: Arrow IPC parts staged as rows arrive, Parquet parts, and readers of both.

The Spark sink stages Arrow IPC parts; the Python API and compaction write
Parquet. A shard may hold both at once (parts written before and after an
upgrade, or before and after compaction), and every read must return the same
updates whatever the mix.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pyspark_persist.state import (
    ARROW,
    ARROW_ROWS,
    DIFF,
    PARQUET,
    TIME,
    BatchBuilder,
    LeasedPart,
    PartRef,
    PersistClient,
    PersistConfig,
    iter_parts,
)
from pyspark_persist.state.codec import PART_FORMATS, iter_part_batches
from pyspark_persist.state.errors import CorruptData, InvalidUpdates, InvalidUsage, SchemaMismatch
from pyspark_persist.state.fetch import fetch_part_bytes
from pyspark_persist.state.schema import conform_updates
from pyspark_persist.state.stats import PartStats, _column_bounds, part_ref

SCHEMA = pa.schema(
    [("id", pa.int64()), ("x", pa.float64()), ("name", pa.string()), ("flag", pa.bool_())]
)


def rows(n: int, start: int = 0) -> pa.Table:
    """``n`` rows with ids from ``start``; every 7th name is null."""
    return pa.table(
        {
            "id": pa.array(range(start, start + n), pa.int64()),
            "x": pa.array([i * 0.5 for i in range(start, start + n)], pa.float64()),
            "name": pa.array(
                [None if i % 7 == 0 else f"n{i}" for i in range(start, start + n)], pa.string()
            ),
            "flag": pa.array([i % 2 == 0 for i in range(start, start + n)], pa.bool_()),
        },
        schema=SCHEMA,
    )


def as_counter(table: pa.Table) -> Counter[tuple[Any, ...]]:
    """The multiset a snapshot table denotes: row -> summed diff (zeros dropped)."""
    out: Counter[tuple[Any, ...]] = Counter()
    cols = [table.column(n).to_pylist() for n in SCHEMA.names]
    for *row, d in zip(*cols, table.column(DIFF).to_pylist(), strict=True):
        out[tuple(row)] += d
    return +out


@pytest.fixture
def client(tmp_path: Path) -> Any:
    """A file/sqlite client with small parts (many parts from a few thousand rows), no
    background maintenance (compaction is run by hand)."""
    config = PersistConfig(part_target_bytes=16 << 10, compaction_fan_in=2, maintenance=False)
    c = PersistClient.open(
        f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/consensus.db", config=config
    )
    yield c
    c.close()


def stage(client: Any, shard: Any, tables: list[pa.Table], fmt: str) -> Any:
    """Stage ``tables`` through a BatchBuilder writing ``fmt`` parts (to Blob, never inline)."""
    builder = BatchBuilder(
        client.blob,
        shard.machine.shard_id,
        SCHEMA,
        client.config,
        allow_inline=False,
        part_format=fmt,
    )
    for t in tables:
        builder.add(t)
    return builder.finish()


def test_arrow_parts_are_cut_at_the_target_size_and_read_back(client: Any) -> None:
    """Small inputs stream into Arrow parts of about the target size; a snapshot reads them."""
    shard = client.open_shard("arrow", SCHEMA)
    inputs = [rows(100, i * 100) for i in range(40)]
    staged = stage(client, shard, inputs, ARROW)
    assert all(p.fmt == ARROW and p.key and p.key.endswith(".arrow") for p in staged.parts)
    assert len(staged.parts) > 3  # 4,000 rows of ~30 bytes: several 16 KiB parts
    assert sum(p.rows for p in staged.parts) == 4000
    target = client.config.part_target_bytes
    assert all(p.size_bytes < 2 * target for p in staged.parts)
    writer = shard.writer()
    writer.compare_and_append_batches([staged], 0, 1, ts_rewrite=0)
    got = as_counter(shard.reader().snapshot_table(0))
    assert got == as_counter(rows(4000).append_column(DIFF, pa.repeat(1, 4000)))


def test_parquet_and_arrow_parts_read_together(client: Any) -> None:
    """A shard holding Parquet parts (old writers, compaction) and Arrow parts reads both."""
    shard = client.open_shard("mixed", SCHEMA)
    writer = shard.writer()
    old = stage(client, shard, [rows(1500)], PARQUET)
    new = stage(client, shard, [rows(1500, 1500)], ARROW)
    assert {p.fmt for p in old.parts} == {PARQUET} and {p.fmt for p in new.parts} == {ARROW}
    writer.compare_and_append_batches([old], 0, 1, ts_rewrite=0)
    writer.compare_and_append_batches([new], 1, 2, ts_rewrite=1)
    expected = as_counter(rows(3000).append_column(DIFF, pa.repeat(1, 3000)))
    assert as_counter(shard.reader().snapshot_table(1)) == expected
    # Listen-style reads (times kept) through iter_parts see both formats with their times.
    state = shard.state()
    leased = [
        LeasedPart(state.shard_id, client.blob.uri, p, 0, 2, None, state.seqno)
        for b in state.trace
        for p in b.parts
    ]
    table = pa.concat_tables(iter_parts(client.blob, leased))
    assert sorted(Counter(table.column(TIME).to_pylist()).items()) == [(0, 1500), (1, 1500)]


def test_a_tiny_arrow_write_rides_inline_and_a_larger_one_streams_to_blob(client: Any) -> None:
    """An Arrow-staging builder (the Spark sink's) holds tiny updates back: if they are the
    whole write they become one inline part (nothing in Blob); once they outgrow
    inline_write_max_bytes they stream into an Arrow part with what was held back."""
    shard = client.open_shard("arrow-inline", SCHEMA)

    def build(tables: list[pa.Table]) -> Any:
        builder = BatchBuilder(
            client.blob, shard.machine.shard_id, SCHEMA, client.config, part_format=ARROW
        )
        for t in tables:
            builder.add(t)
        return builder.finish()

    keys_before = {m.key for m in client.blob.list_keys("arrow-inline/part/")}
    tiny = build([rows(5), rows(5, 5)])
    (part,) = tiny.parts
    assert part.key is None and part.inline is not None and part.rows == 10
    assert {m.key for m in client.blob.list_keys("arrow-inline/part/")} == keys_before
    larger = build([rows(5, 10), rows(500, 15)])  # held back, then past the inline limit
    assert all(p.key is not None and p.fmt == ARROW for p in larger.parts)
    assert sum(p.rows for p in larger.parts) == 505
    writer = shard.writer()
    writer.compare_and_append_batches([tiny, larger], 0, 1, ts_rewrite=0)
    expected = as_counter(rows(515).append_column(DIFF, pa.repeat(1, 515)))
    assert as_counter(shard.reader().snapshot_table(0)) == expected


def test_fit_inline_moves_inline_parts_to_blob_once_states_cap_is_reached(tmp_path: Path) -> None:
    """Parts staged inline where state is not known (Spark tasks) are committed inline while
    state's inline data stays within inline_total_max_bytes, and written to Blob first past
    it; every row reads back once either way."""
    config = PersistConfig(inline_total_max_bytes=3000, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    try:
        shard = c.open_shard("fit", SCHEMA)
        writer = shard.writer()

        def staged(start: int) -> Any:
            builder = BatchBuilder(
                c.blob, shard.machine.shard_id, SCHEMA, c.config, part_format=ARROW
            )
            builder.add(rows(10, start))
            return builder.finish()

        upper, blob_parts = 0, 0
        for i in range(8):
            batch = staged(10 * i)
            assert batch.parts[0].inline is not None
            fitted = writer.fit_inline([batch])
            before = shard.state().inline_bytes
            writer.compare_and_append_batches(fitted, upper, upper + 1, ts_rewrite=upper)
            upper += 1
            (part,) = fitted[0].parts
            if part.inline is None:
                blob_parts += 1
                assert part.fmt == ARROW and part.key is not None and part.crc is not None
                assert before + batch.parts[0].size_bytes > config.inline_total_max_bytes
            assert shard.state().inline_bytes <= config.inline_total_max_bytes
        assert blob_parts > 0
        expected = as_counter(rows(80).append_column(DIFF, pa.repeat(1, 80)))
        assert as_counter(shard.reader().snapshot_table(upper - 1)) == expected
    finally:
        c.close()


def test_small_parts_are_fetched_without_a_prefetch_thread(
    client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streaming micro-batch's few small parts are read in the caller's thread (a thread
    started and joined per read task cost more than the read); big ones are prefetched."""
    from pyspark_persist.state import read

    shard = client.open_shard("prefetch", SCHEMA)
    writer = shard.writer()
    for t in range(3):
        writer.compare_and_append_batches(
            [stage(client, shard, [rows(200, t * 200)], ARROW)], t, t + 1, ts_rewrite=t
        )
    state = shard.state()
    leased = [
        LeasedPart(state.shard_id, client.blob.uri, p, 0, 3, None, state.seqno)
        for b in state.trace
        for p in b.parts
    ]
    assert len(leased) == 3 and sum(lp.part.size_bytes for lp in leased) < read.PREFETCH_MIN_BYTES
    pools: list[object] = []

    class CountedPool(read.ThreadPoolExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pools.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(read, "ThreadPoolExecutor", CountedPool)
    expected = sorted(rows(600).column("id").to_pylist())
    small = pa.concat_tables(iter_parts(client.blob, leased))
    assert sorted(small.column("id").to_pylist()) == expected
    assert pools == []
    monkeypatch.setattr(read, "PREFETCH_MIN_BYTES", 0)  # the same parts as if they were big
    big = pa.concat_tables(iter_parts(client.blob, leased))
    assert sorted(big.column("id").to_pylist()) == expected
    assert len(pools) == 1


def test_arrow_rows_parts_store_only_the_rows_and_read_as_every_other_format(
    client: Any,
) -> None:
    """An insert-only batch staged as arrow-rows stores the row columns alone; snapshots,
    listen-style reads (the commit's time on every row), an atomic replace that retracts it
    by reference, and reads beside Parquet and Arrow parts all see the same updates."""
    shard = client.open_shard("rows", SCHEMA)
    writer = shard.writer()
    inserts = stage(client, shard, [rows(700, i * 700) for i in range(3)], ARROW_ROWS)
    assert inserts.parts and {p.fmt for p in inserts.parts} == {ARROW_ROWS}
    for part in inserts.parts:
        assert part.key is not None and part.key.endswith(".arrow-rows")
        stored = pa.ipc.open_stream(pa.py_buffer(client.blob.get(part.key))).read_all()
        assert stored.column_names == SCHEMA.names  # no _time, no _diff on disk
        assert (part.min_time, part.max_time, part.dmin, part.dmax) == (0, 0, 1, 1)
    old = stage(client, shard, [rows(300, 2100)], PARQUET)
    new = stage(client, shard, [rows(300, 2400)], ARROW)
    writer.compare_and_append_batches([inserts], 0, 8, ts_rewrite=7)
    writer.compare_and_append_batches([old, new], 8, 9, ts_rewrite=8)
    expected = as_counter(rows(2700).append_column(DIFF, pa.repeat(1, 2700)))
    assert as_counter(shard.reader().snapshot_table(8)) == expected
    state = shard.state()
    leased = [
        LeasedPart(state.shard_id, client.blob.uri, p, 0, 9, None, state.seqno)
        for b in state.trace
        for p in b.parts
    ]
    table = pa.concat_tables(iter_parts(client.blob, leased))
    assert sorted(Counter(table.column(TIME).to_pylist()).items()) == [(7, 2100), (8, 600)]
    assert set(table.column(DIFF).to_pylist()) == {1}
    replacement = stage(client, shard, [rows(5, 9000)], ARROW_ROWS)
    writer.compare_and_append_batches([replacement], 9, 10, ts_rewrite=9, replace=True)
    assert as_counter(shard.reader().snapshot_table(9)) == as_counter(
        rows(5, 9000).append_column(DIFF, pa.repeat(1, 5))
    )


def test_arrow_rows_refuses_updates_that_are_not_inserts_at_one_time(client: Any) -> None:
    """Only inserts at one time fit an arrow-rows part: a retraction, or a second time, is
    refused before anything is committed, and the builder leaves nothing behind."""
    shard = client.open_shard("not-inserts", SCHEMA)
    retraction = rows(10).append_column(DIFF, pa.array([-1] * 10, pa.int64()))
    two_times = rows(10).append_column(TIME, pa.array([0] * 5 + [1] * 5, pa.uint64()))
    for updates in (retraction, two_times):
        with pytest.raises(InvalidUsage, match="arrow-rows part holds inserts"):
            stage(client, shard, [updates], ARROW_ROWS)
    assert not list(client.blob.list_keys("not-inserts/"))


def builder_for(client: Any, shard: Any, fmt: str = ARROW_ROWS, **kw: Any) -> BatchBuilder:
    return BatchBuilder(
        client.blob, shard.machine.shard_id, SCHEMA, client.config, part_format=fmt, **kw
    )


def test_rows_added_as_inserts_stage_the_parts_add_stages(client: Any) -> None:
    """add_inserts (the sink's path: row columns alone, nothing constant built) stages what
    add does from the same rows: parts near the target size holding every row once, each
    an insert at time 0 whose column ranges are its stored rows', inline while the write is
    tiny, and the same updates read back once committed."""
    shard = client.open_shard("inserts", SCHEMA)
    inputs = [rows(150, i * 150) for i in range(30)]
    via_add, via_inserts = builder_for(client, shard), builder_for(client, shard)
    for t in inputs:
        via_add.add(t)
        via_inserts.add_inserts(t)
    a, b = via_add.finish(), via_inserts.finish()
    assert len(b.parts) > 3 and not b.has_time and not a.has_time
    assert sum(p.rows for p in a.parts) == sum(p.rows for p in b.parts) == 4500
    target = client.config.part_target_bytes
    for p in b.parts:
        assert p.key is not None and p.fmt == ARROW_ROWS and p.size_bytes < 2 * target
        assert (p.min_time, p.max_time, p.dmin, p.dmax) == (0, 0, 1, 1)
        stored = pa.ipc.open_stream(pa.py_buffer(client.blob.get(p.key))).read_all()
        assert stored.column_names == SCHEMA.names and stored.num_rows == p.rows
        ranges = {n: pc.min_max(stored.column(n)).values() for n in ("id", "x", "name")}
        assert p.stats == {n: (lo.as_py(), hi.as_py()) for n, (lo, hi) in ranges.items()}
    shard.writer().compare_and_append_batches([b], 0, 4, ts_rewrite=3)
    expected = as_counter(rows(4500).append_column(DIFF, pa.repeat(1, 4500)))
    assert as_counter(shard.reader().snapshot_table(3)) == expected
    tiny = builder_for(client, shard)
    tiny.add_inserts(rows(3, 10_000))
    assert [p.inline is not None for p in tiny.finish().parts] == [True]


def test_add_inserts_refuses_updates_and_nulls_before_writing(client: Any) -> None:
    """Rows given as inserts must be the shard's row columns: a _time or _diff column, a
    null in a non-nullable column, or a builder of another format is refused by name, and
    nothing reaches Blob."""
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("x", pa.float64())])
    shard = client.open_shard("refused", schema)
    good = pa.table({"id": list(range(2000)), "x": [0.5] * 2000}, schema)
    cases = [
        (good.append_column(DIFF, pa.repeat(pa.scalar(1, pa.int64()), 2000)), "no _time or _diff"),
        (good.append_column(TIME, pa.repeat(pa.scalar(0, pa.uint64()), 2000)), "no _time or _diff"),
        (pa.table({"id": [1, None] * 1000, "x": [0.5] * 2000}), "'id' .* non-nullable"),
    ]
    for streaming in (False, True):
        for bad, message in cases:
            builder = BatchBuilder(
                client.blob, shard.machine.shard_id, schema, client.config, part_format=ARROW_ROWS
            )
            if streaming:
                builder.add_inserts(pa.concat_tables([good] * 20))  # a part is streaming
            with pytest.raises((InvalidUsage, InvalidUpdates), match=message):
                builder.add_inserts(bad)
            builder.abort()
    assert not list(client.blob.list_keys("refused/"))
    with pytest.raises(InvalidUsage, match="add_inserts stages arrow-rows parts, not arrow"):
        builder_for(client, client.open_shard("arrow-fmt", SCHEMA), ARROW).add_inserts(rows(5))


@pytest.mark.parametrize("fmt", [ARROW, ARROW_ROWS])
def test_compaction_rewrites_arrow_parts_as_parquet(client: Any, fmt: str) -> None:
    """Compaction turns the sink's Arrow parts into Parquet ones; the contents stay the same."""
    shard = client.open_shard("compact", SCHEMA)
    writer = shard.writer()
    for t in range(3):
        staged = stage(client, shard, [rows(500, t * 500)], fmt)
        writer.compare_and_append_batches([staged], t, t + 1, ts_rewrite=t)
    before = as_counter(shard.reader().snapshot_table(2))
    reports = shard.compact()
    assert reports and reports[-1].applied
    parts = [p for b in shard.state().trace for p in b.parts]
    assert parts and {p.fmt for p in parts} == {PARQUET}
    assert as_counter(shard.reader().snapshot_table(2)) == before


def test_streamed_stats_equal_whole_part_stats() -> None:
    """Ranges gathered table by table are the ranges of the whole part, NaN and long strings
    included (a column with either anywhere gets no range)."""
    schema = pa.schema([("a", pa.int64()), ("f", pa.float64()), ("s", pa.string())])
    pieces = [
        pa.table({"a": [3, 1], "f": [0.5, 2.0], "s": ["b", "c"]}, schema=schema),
        pa.table({"a": [None, 9], "f": [float("nan"), 1.0], "s": ["a", "x" * 80]}, schema=schema),
        pa.table({"a": [None, None], "f": [0.1, 0.2], "s": ["d", None]}, schema=schema),
    ]
    streamed = PartStats()
    for i, p in enumerate(pieces):
        streamed.add(
            conform_updates(p.append_column(TIME, pa.array([i, i], pa.uint64())), schema, "s")[0]
        )
    whole, _ = conform_updates(
        pa.concat_tables(
            [p.append_column(TIME, pa.array([i, i], pa.uint64())) for i, p in enumerate(pieces)]
        ),
        schema,
        "s",
    )
    ref = streamed.ref("k", None, 1, None, ARROW)
    assert ref == part_ref(whole, "k", None, 1, None, ARROW)
    assert ref.stats == {"a": (1, 9)}
    assert (ref.min_time, ref.max_time, ref.dmin, ref.dmax, ref.rows) == (0, 2, 1, 1, 6)


def test_format_survives_state_encoding_and_old_refs_read_as_parquet() -> None:
    """A part reference keeps its format through JSON; one written before formats is Parquet."""
    ref = PartRef("k.arrow", None, 10, 1, 0, 0, fmt=ARROW)
    assert PartRef.from_json(json.loads(json.dumps(ref.to_json()))).fmt == ARROW
    old = {"key": "k.parquet", "size": 10, "rows": 1, "tmin": 0, "tmax": 0}
    assert PartRef.from_json(old).fmt == PARQUET
    assert "fmt" not in PartRef.from_json(old).to_json()  # state written by old versions: same


def test_unknown_or_garbled_format_is_corrupt_data(client: Any) -> None:
    """A part of a format this version does not know, or bytes that are not what the ref says,
    is refused with CorruptData naming the part, never read as something else."""
    shard = client.open_shard("bad", SCHEMA)
    staged = stage(client, shard, [rows(200)], ARROW)
    part = staged.parts[0]
    data = fetch_part_bytes(client.blob, part, shard.machine.shard_id)

    with pytest.raises(CorruptData, match="format 'orc'"):
        list(iter_part_batches(data, replace(part, fmt="orc"), shard.machine.shard_id))
    with pytest.raises(CorruptData, match="cannot be decoded"):
        list(iter_part_batches(data, replace(part, fmt=PARQUET), shard.machine.shard_id))


@pytest.mark.parametrize("fmt", PART_FORMATS)
def test_every_part_format_keeps_the_builders_contract(client: Any, fmt: str) -> None:
    """Whatever the format's strategy: a tiny write rides inline (nothing in Blob); a larger
    one becomes parts of that format near part_target_bytes, every update once, read back as
    written; a builder aborted mid-write leaves nothing in Blob; a finished one takes no more."""
    shard = client.open_shard(f"contract-{fmt}", SCHEMA)
    prefix = f"{shard.machine.shard_id}/"
    tiny = builder_for(client, shard, fmt)
    tiny.add(rows(2))
    assert [p.inline is not None for p in tiny.finish().parts] == [True]
    assert not list(client.blob.list_keys(prefix))
    big = builder_for(client, shard, fmt)
    for i in range(40):
        big.add(rows(100, i * 100))
    staged = big.finish()
    target = client.config.part_target_bytes
    assert len(staged.parts) > 3 and sum(p.rows for p in staged.parts) == 4000
    assert all(p.key and p.fmt == fmt and p.size_bytes < 2 * target for p in staged.parts)
    with pytest.raises(InvalidUsage, match="already finished"):
        big.add(rows(1))
    aborted = builder_for(client, shard, fmt)
    for i in range(40):
        aborted.add(rows(100, i * 100))
    aborted.abort()
    left = sorted(m.key for m in client.blob.list_keys(prefix))
    assert left == sorted(p.key for p in staged.parts)
    shard.writer().compare_and_append_batches([staged], 0, 1, ts_rewrite=0)
    expected = as_counter(rows(4000).append_column(DIFF, pa.repeat(1, 4000)))
    assert as_counter(shard.reader().snapshot_table(0)) == expected


def test_builder_refuses_an_unknown_format(client: Any) -> None:
    """The builder names the formats it can write."""
    with pytest.raises(InvalidUsage, match="arrow"):
        BatchBuilder(client.blob, "s", SCHEMA, client.config, part_format="csv")


def test_checksums_of_older_parts_still_verify_and_a_flipped_byte_is_caught(client: Any) -> None:
    """Parts written before the faster checksum recorded zlib's CRC-32: they still read, and a
    byte flipped anywhere in a stored part is CorruptData naming it, never other rows."""
    import zlib

    shard = client.open_shard("crc", SCHEMA)
    staged = stage(client, shard, [rows(300)], ARROW)
    part = staged.parts[0]
    assert part.key is not None
    data = client.blob.get(part.key)
    assert part.crc == zlib.crc32(data)
    old_ref = replace(part, crc=zlib.crc32(data))
    assert fetch_part_bytes(client.blob, old_ref, "crc") == data
    for pos in (0, len(data) // 2, len(data) - 1):
        client.blob.set(part.key, data[:pos] + bytes([data[pos] ^ 0x10]) + data[pos + 1 :])
        with pytest.raises(CorruptData, match=part.key.rsplit("/", 1)[1]):
            fetch_part_bytes(client.blob, part, "crc")


def test_snapshot_shaping_sets_every_time_to_as_of_after_a_rewrite(client: Any) -> None:
    """A snapshot part whose stored times sit below its ts_rewrite (the sink's parts) reads at
    as_of; a negated one reads with its diffs negated; a listen keeps the rewritten times."""

    from pyspark_persist.state.updates import shape_updates

    shard = client.open_shard("shape", SCHEMA)
    part = replace(stage(client, shard, [rows(100)], ARROW).parts[0], ts_rewrite=7)
    data = fetch_part_bytes(client.blob, part, "shape")
    (batch,) = list(iter_part_batches(data, part, "shape"))
    snap = LeasedPart("shape", client.blob.uri, part, 0, 10, 9, 1)
    got = shape_updates(batch, snap)
    assert set(got.column(TIME).to_pylist()) == {9}
    assert got.schema.field(TIME).nullable is False
    assert set(got.column(DIFF).to_pylist()) == {1}
    negated = shape_updates(batch, replace(snap, part=replace(part, negate=True)))
    assert set(negated.column(DIFF).to_pylist()) == {-1}
    listen = shape_updates(batch, LeasedPart("shape", client.blob.uri, part, 7, 8, None, 1))
    assert set(listen.column(TIME).to_pylist()) == {7} and listen.num_rows == 100


def test_arrow_parts_hold_batches_of_at_most_read_batch_rows(tmp_path: Path) -> None:
    """One large input is stored as record batches of at most ``read_batch_rows`` rows, so a
    reader hands Spark bounded batches whatever sizes the writer was given."""
    config = PersistConfig(read_batch_rows=1000, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    shard = c.open_shard("big", SCHEMA)
    (part,) = stage(c, shard, [rows(4500)], ARROW).parts
    data = fetch_part_bytes(c.blob, part, "big")
    sizes = [b.num_rows for b in iter_part_batches(data, part, "big")]
    assert sum(sizes) == 4500 and max(sizes) <= 1000
    c.close()


def test_arrow_parts_coalesce_small_inputs_into_full_read_batches(tmp_path: Path) -> None:
    """Inputs of odd sizes (Spark hands over 10,000-row batches) are stored as batches of
    exactly ``read_batch_rows`` rows but the part's last, in the order the rows came."""
    config = PersistConfig(read_batch_rows=1000, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    shard = c.open_shard("odd", SCHEMA)
    inputs = [rows(n, start) for n, start in [(300, 0), (1450, 300), (7, 1750), (993, 1757)]]
    (part,) = stage(c, shard, inputs, ARROW).parts
    data = fetch_part_bytes(c.blob, part, "odd")
    batches = list(iter_part_batches(data, part, "odd"))
    assert [b.num_rows for b in batches] == [1000, 1000, 750]
    got = pa.Table.from_batches(batches).select(SCHEMA.names)
    assert got.equals(rows(2750))
    c.close()


def _part_batch_rows(c: Any, parts: list[PartRef]) -> list[list[int]]:
    """Each part's stored record batches, as row counts."""
    out = []
    for part in parts:
        data = fetch_part_bytes(c.blob, part, "whole")
        out.append([b.num_rows for b in iter_part_batches(data, part, "whole")])
    return out


@pytest.mark.parametrize("fmt", [ARROW, ARROW_ROWS])
def test_inputs_of_whole_batches_are_stored_as_they_come_across_parts(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inputs of exactly ``read_batch_rows`` rows (Spark's Arrow batches at persist's batch
    size) spread over several parts: every part ends on a whole batch, so no input is split
    across two stored batches and none is copied to coalesce, and the rows read back in
    order."""
    config = PersistConfig(read_batch_rows=100, part_target_bytes=12 << 10, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    shard = c.open_shard("whole", SCHEMA)
    concats: list[int] = []
    real_concat = pa.concat_tables

    def counted_concat(*args: Any, **kwargs: Any) -> pa.Table:
        concats.append(1)
        return real_concat(*args, **kwargs)

    monkeypatch.setattr(pa, "concat_tables", counted_concat)
    staged = stage(c, shard, [rows(100, i * 100) for i in range(30)], fmt)
    monkeypatch.setattr(pa, "concat_tables", real_concat)
    assert not concats
    assert len(staged.parts) >= 3
    assert all(sizes == [100] * len(sizes) for sizes in _part_batch_rows(c, staged.parts))
    assert all(p.size_bytes <= config.part_target_bytes for p in staged.parts[:-1])
    shard.writer().compare_and_append_batches([staged], 0, 1, ts_rewrite=0)
    got = shard.reader().snapshot_table(0).select(SCHEMA.names).sort_by("id")
    assert got.equals(rows(3000))
    c.close()


def test_parts_of_odd_inputs_end_on_whole_batches(tmp_path: Path) -> None:
    """Inputs of odd sizes spread over several parts: each part but the last holds whole
    batches only (a reader never gets a short batch mid-shard), each within the target."""
    config = PersistConfig(read_batch_rows=100, part_target_bytes=12 << 10, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    shard = c.open_shard("odd-parts", SCHEMA)
    staged = stage(c, shard, [rows(130, i * 130) for i in range(25)], ARROW_ROWS)
    sizes = _part_batch_rows(c, staged.parts)
    assert len(sizes) >= 3
    assert all(s == [100] * len(s) for s in sizes[:-1])
    assert sum(map(sum, sizes)) == 3250
    assert all(p.size_bytes <= config.part_target_bytes for p in staged.parts[:-1])
    c.close()


def test_arrow_part_streams_to_blob_as_rows_arrive_and_its_crc_verifies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of an open Arrow part reach the store as they are added (the builder holds less
    than one read batch of them and the file writer one buffer, not the part); the CRC-32
    counted on the way is the stored object's, and an abort mid-part leaves no key and no
    temp file."""
    from pyspark_persist.state.blob import file as file_blob

    monkeypatch.setattr(file_blob, "WRITEBACK_BYTES", 8192)  # a page-aligned buffer, small
    config = PersistConfig(read_batch_rows=1000, part_target_bytes=1 << 30, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    part_dir = tmp_path / "blob" / "streamed" / "part"

    def streamed_bytes() -> int:
        return sum(p.stat().st_size for p in part_dir.iterdir()) if part_dir.exists() else 0

    builder = BatchBuilder(c.blob, "streamed", SCHEMA, c.config, part_format=ARROW)
    builder.add(rows(2500))
    assert streamed_bytes() > 0  # two 1,000-row batches written, nothing committed yet
    assert not any(part_dir.glob("*.arrow"))
    builder.add(rows(2500, 2500))
    (part,) = builder.finish().parts
    assert part.key is not None and part.rows == 5000
    data = fetch_part_bytes(c.blob, part, "streamed")  # raises CorruptData on a CRC mismatch
    assert part.size_bytes == len(data)
    got = pa.Table.from_batches(list(iter_part_batches(data, part, "streamed")))
    assert got.select(SCHEMA.names).equals(rows(5000))

    aborted = BatchBuilder(c.blob, "streamed", SCHEMA, c.config, part_format=ARROW)
    aborted.add(rows(2500))
    aborted.abort()
    assert sorted(p.name for p in part_dir.iterdir()) == [part.key.rsplit("/", 1)[-1]]
    c.close()


def test_conform_checks_every_table_though_its_schema_pair_is_planned_once() -> None:
    """Updates of the shard's schema become part layout; a second table of the same schema
    still has its data checked (a null in a non-nullable column), and another schema is still
    checked on its own (a wrong type refused, a merge-schema write filled with nulls)."""
    shard = pa.schema([pa.field("id", pa.int64(), nullable=False), ("name", pa.string())])
    given = pa.table({"id": [1, 2], "name": ["a", None]}, schema=shard)
    table, has_time = conform_updates(given, shard, "s")
    assert not has_time and table.column_names == ["id", "name", TIME, DIFF]
    assert table.column(DIFF).to_pylist() == [1, 1] and table.column(TIME).to_pylist() == [0, 0]
    nullable = pa.schema([("id", pa.int64()), ("name", pa.string())])
    conform_updates(pa.table({"id": [3], "name": ["c"]}, schema=nullable), shard, "s")
    with pytest.raises(InvalidUpdates, match="'id' of shard 's' is non-nullable"):
        conform_updates(pa.table({"id": [None], "name": ["c"]}, schema=nullable), shard, "s")
    with pytest.raises(SchemaMismatch):
        conform_updates(pa.table({"id": ["x"], "name": ["c"]}), shard, "s")
    reordered = pa.table({"name": ["z"], "id": pa.array([9], pa.int64())})
    table, _ = conform_updates(reordered, shard, "s")
    assert table.select(["id", "name"]).to_pylist() == [{"id": 9, "name": "z"}]
    only_id = pa.table({"id": pa.array([4], pa.int64())})
    with pytest.raises(SchemaMismatch):
        conform_updates(only_id, shard, "s")
    table, _ = conform_updates(only_id, shard, "s", fill_missing=True)
    assert table.column("name").to_pylist() == [None]


def test_updates_already_in_part_layout_pass_as_they_are_with_every_check_kept() -> None:
    """Updates carrying the part layout's exact schema come back as the very same table; the
    checks still run on each one (null times, nulls in a non-nullable column), and a
    near-miss (an int32 ``_diff``) is cast as before, whichever schema came just before."""
    shard = pa.schema([pa.field("id", pa.int64(), nullable=False), ("name", pa.string())])
    layout = shard.append(pa.field(TIME, pa.uint64(), nullable=False)).append(
        pa.field(DIFF, pa.int64(), nullable=False)
    )
    given = pa.table({"id": [1], "name": ["a"], TIME: [5], DIFF: [-1]}, schema=layout)
    for _ in range(2):  # planned, then the plan reused
        table, has_time = conform_updates(given, shard, "s")
        assert table is given and has_time
    null_time = pa.table({"id": [1], "name": ["a"], TIME: [None], DIFF: [1]}, schema=layout)
    with pytest.raises(InvalidUpdates, match="'_time' has 1 nulls"):
        conform_updates(null_time, shard, "s")
    null_id = pa.table({"id": [None], "name": ["a"], TIME: [5], DIFF: [1]}, schema=layout)
    with pytest.raises(InvalidUpdates, match="'id' of shard 's' is non-nullable"):
        conform_updates(null_id, shard, "s")
    narrow = pa.table({"id": [1], "name": ["a"], TIME: pa.array([5], pa.uint64())})
    narrow = narrow.append_column(DIFF, pa.array([-1], pa.int32()))
    for _ in range(2):
        table, _ = conform_updates(narrow, shard, "s")
        assert table.schema.equals(layout) and table.to_pylist() == given.to_pylist()
    with pytest.raises(SchemaMismatch, match="shard 't'"):
        conform_updates(given, pa.schema([("id", pa.int64())]), "t")
    assert conform_updates(given, shard, "s")[0] is given


def test_parquet_part_streams_into_blob_and_its_crc_verifies(tmp_path: Path) -> None:
    """A Parquet part is encoded straight into the store (no whole encoded copy is returned to
    the builder): the CRC-32 counted on the way is the stored object's, and it reads back."""
    config = PersistConfig(part_target_bytes=1 << 30, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    builder = BatchBuilder(c.blob, "pq", SCHEMA, c.config, allow_inline=False)
    builder.add(rows(5000))
    (part,) = builder.finish().parts
    assert part.fmt == PARQUET and part.rows == 5000
    data = fetch_part_bytes(c.blob, part, "pq")  # raises CorruptData on a CRC mismatch
    assert part.size_bytes == len(data)
    got = pa.Table.from_batches(list(iter_part_batches(data, part, "pq")))
    assert got.select(SCHEMA.names).equals(rows(5000))
    c.close()


@pytest.mark.parametrize(
    "values",
    [
        ["%032x" % (i * 7919 % 1000) for i in range(1000)],  # hashes: distinct prefixes
        [f"customer-{i:08d}" for i in range(500, 0, -1)],  # 17 bytes, long shared prefix
        ["same"] * 20,
        ["a\x00c", "a\x00b", "\x00zz", "éa", "aé"],  # NUL bytes; multi-byte widths differ
        ["中a", "a中", "éé", "bbbb"],  # 4 bytes each, some multi-byte
        ["", "", ""],
        ["b", "ab", "abc", "x"],  # unequal widths
        ["%032x" % (i * 2654435761 % 2**62) for i in range(3000)],  # the benchmark's: 16 zeros
        ["aaaaaaaaaab" + "z" * 9, "aaaaaaaaaaa" + "z" * 9, "aaaaaaaaaab" + "a" * 9] * 3,  # ties
    ],
)
@pytest.mark.parametrize("typ", [pa.string(), pa.large_string()])
def test_string_ranges_equal_arrows_min_max(values: list[str], typ: pa.DataType) -> None:
    """A part's string range is Arrow's (code point order) whatever the values' widths,
    for whole and sliced arrays."""
    schema = pa.schema([("s", typ)])
    for table in (pa.table({"s": pa.array(values, typ)}), pa.table({"s": values[1:]}, schema)):
        if table.num_rows == 0:
            continue
        ref = part_ref(conform_updates(table, schema, "s")[0], "k", None, 1, None, ARROW)
        assert ref.stats is not None
        assert ref.stats["s"] == (min(table.column("s").to_pylist()), max(table["s"].to_pylist()))


@pytest.mark.parametrize("width", [1, 7, 8, 9, 16, 23, 40])
def test_string_ranges_of_many_tied_prefixes_equal_arrows_min_max(width: int) -> None:
    """Equal-width values over a two-letter alphabet tie in many 8-byte windows, the min's and
    the max's candidates narrowing apart: the range is still Arrow's min_max."""
    rng = np.random.default_rng(width)
    for _ in range(20):
        rows = int(rng.integers(1, 400))
        prefix = "p" * int(rng.integers(0, width + 1))
        values = [
            (prefix + "".join(rng.choice(["a", "b"], size=width)))[:width] for _ in range(rows)
        ]
        col = pa.array(values)
        lo, hi = pc.min_max(col).values()
        assert _column_bounds(col) == (lo.as_py(), hi.as_py())


@pytest.mark.parametrize(
    ("typ", "values"),
    [
        (pa.uint64(), [2**64 - 1, 0, 2**63, 5] * 40),
        (pa.int64(), [-(2**63), 2**63 - 1, 0, -1] * 40),
        (pa.int8(), [-128, 127, 3, 0] * 40),
        (pa.uint16(), [65535, 1, 0, 7] * 40),
    ],
)
def test_integer_ranges_and_time_bounds_are_exact_at_the_type_limits(
    typ: pa.DataType, values: list[int]
) -> None:
    """Integer ranges (and the time range) are exact at each type's limits, for whole and
    sliced columns of more rows than the small-input path takes."""
    schema = pa.schema([("n", typ)])
    for table in (pa.table({"n": pa.array(values, typ)}), pa.table({"n": values[3:-2]}, schema)):
        times = pa.array([v % 2**64 for v in table.column("n").to_pylist()], pa.uint64())
        updates = conform_updates(table.append_column(TIME, times), schema, "s")[0]
        ref = part_ref(updates, "k", None, 1, None, ARROW)
        got = table.column("n").to_pylist()
        assert ref.stats is not None and ref.stats["n"] == (min(got), max(got))
        assert (ref.min_time, ref.max_time) == (min(times.to_pylist()), max(times.to_pylist()))


@pytest.mark.parametrize("typ", [pa.float16(), pa.float32(), pa.float64()])
def test_float_ranges_of_every_width_are_exact(typ: pa.DataType) -> None:
    """Half, single and double floats all get their exact range (read in place by numpy)."""
    import numpy as np

    values = np.array([1.5, -2.25, 3.0, 0.5] * 40, dtype=typ.to_pandas_dtype())
    schema = pa.schema([("f", typ)])
    table = pa.table({"f": pa.array(values, typ)})
    ref = part_ref(conform_updates(table, schema, "s")[0], "k", None, 1, None, ARROW)
    assert ref.stats is not None and ref.stats["f"] == (-2.25, 3.0)
    with_null = pa.table({"f": pa.array([*values[:3], None], typ)})
    ref = part_ref(conform_updates(with_null, schema, "s")[0], "k", None, 1, None, ARROW)
    assert ref.stats is not None
    assert ref.stats.get("f") in (None, (-2.25, 3.0))  # no range beats a wrong one


def test_float_range_ignores_nulls_and_a_nan_anywhere_drops_it() -> None:
    """Float ranges are exact (-0.0 and infinities included); a NaN in any batch drops the
    column's range, nulls are ignored."""
    schema = pa.schema([("f", pa.float64()), ("g", pa.float32())])
    stats = PartStats()
    for f, g in (
        ([0.5, -0.0, float("inf")], [1.5, 2.5, -3.0]),
        ([None, -7.25, 2.0], [0.25, float("nan"), 1.0]),
    ):
        stats.add(conform_updates(pa.table({"f": f, "g": g}, schema), schema, "s")[0])
    ref = stats.ref("k", None, 1, None, ARROW)
    assert ref.stats == {"f": (-7.25, float("inf"))}


def test_staging_a_part_imports_no_pandas() -> None:
    """Gathering a part's ranges (floats, strings) stays off pandas, which a fresh Spark
    worker would otherwise import (~0.2 s) on its first write for nothing else."""
    code = """
import sys
import numpy as np
import pyarrow as pa
from pyspark_persist.state import DIFF, TIME
from pyspark_persist.state.stats import PartStats
n = 70000
ids = np.arange(n, dtype=np.int64)
table = pa.Table.from_arrays(
    [
        pa.Array.from_buffers(pa.float64(), n, [None, pa.py_buffer(ids * 0.5)]),
        pa.Array.from_buffers(
            pa.string(),
            n,
            [None, pa.py_buffer(np.arange(n + 1, dtype=np.int32) * 4), pa.py_buffer(b"abcd" * n)],
        ),
        pa.Array.from_buffers(pa.uint64(), n, [None, pa.py_buffer(ids.astype(np.uint64))]),
        pa.Array.from_buffers(pa.int64(), n, [None, pa.py_buffer(ids)]),
    ],
    names=["x", "s", TIME, DIFF],
)
stats = PartStats()
stats.add(table)
ranges = stats.ref("k", None, 1, None, "arrow").stats
assert ranges == {"x": (0.0, (n - 1) * 0.5), "s": ("abcd", "abcd")}
assert "pandas" not in sys.modules, "staging imported pandas"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_committing_and_reading_sink_parts_import_no_pandas() -> None:
    """The Spark sink's parts (inline, read with a ts_rewrite) committed and read back,
    filtered to a time range as a listen reads them, stay off pandas: a Spark read worker's
    first listen read used to import it (``pa.scalar``, ~0.2 s holding the GIL)."""
    code = """
import sys
import numpy as np
import pyarrow as pa
from pyspark_persist.state import (
    ARROW, BatchBuilder, LeasedPart, PersistClient, PersistConfig, iter_parts
)
config = PersistConfig(maintenance=False)
client = PersistClient.open("mem://nopandas", "mem://nopandas", config=config)
schema = pa.schema([("id", pa.int64())])
shard = client.open_shard("s", schema)
writer = shard.writer()
for t in range(4):
    ids = np.arange(t * 10, t * 10 + 10, dtype=np.int64)
    table = pa.Table.from_arrays(
        [pa.Array.from_buffers(pa.int64(), 10, [None, pa.py_buffer(ids)])], schema=schema
    )
    builder = BatchBuilder(client.blob, "s", schema, config, part_format=ARROW)
    builder.add(table)
    writer.compare_and_append_batches([builder.finish()], t, t + 1, ts_rewrite=t)
state = shard.state()
leased = [
    LeasedPart("s", client.blob.uri, p, 2, 3, None, state.seqno)
    for b in state.trace
    for p in b.parts
]
got = pa.concat_tables(iter_parts(client.blob, leased))
assert "pandas" not in sys.modules, "a commit or a read imported pandas"
assert sorted(got.column("id").to_pylist()) == list(range(20, 30)), got
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_compacting_insert_only_parts_keeps_every_row_and_imports_no_pandas() -> None:
    """A merge of insert-only batches (what the Spark sink writes) keeps every update as it
    is, and so never loads the group-by (Arrow's acero, and pandas with it) into the process
    that compacts: the sink's committer, whose next commit would wait for the import."""
    code = """
import sys
import numpy as np
import pyarrow as pa
from pyspark_persist.state import ARROW, BatchBuilder, PersistClient, PersistConfig
config = PersistConfig(compaction_fan_in=2, maintenance=False)
client = PersistClient.open("mem://compact-np", "mem://compact-np", config=config)
schema = pa.schema([("id", pa.int64())])
shard = client.open_shard("s", schema)
writer = shard.writer()
for t in range(4):
    ids = np.arange(t * 10, t * 10 + 10, dtype=np.int64) % 25  # some ids written twice
    table = pa.Table.from_arrays(
        [pa.Array.from_buffers(pa.int64(), 10, [None, pa.py_buffer(ids)])], schema=schema
    )
    builder = BatchBuilder(client.blob, "s", schema, config, part_format=ARROW)
    builder.add(table)
    writer.compare_and_append_batches([builder.finish()], t, t + 1, ts_rewrite=t)
reader = shard.reader()
reader.downgrade_since(3)
assert shard.compact()
assert len(shard.state().trace) < 4
assert "pandas" not in sys.modules, "compacting insert-only parts imported pandas"
snapshot = reader.snapshot_table()
counts = {}
for i, d in zip(snapshot.column("id").to_pylist(), snapshot.column("_diff").to_pylist()):
    counts[i] = counts.get(i, 0) + d
assert counts == {i: 2 if i < 15 else 1 for i in range(25)}, counts
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("fmt", PART_FORMATS)
def test_a_part_cut_between_tasks_reads_each_row_once(tmp_path: Path, fmt: str) -> None:
    """A split may cut a part by stored rows (``LeasedPart.row_range``): each piece reads
    exactly its rows, in order, whatever the format, at batch bounds or inside a batch."""
    config = PersistConfig(read_batch_rows=1000, maintenance=False)
    c = PersistClient.open(f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db", config=config)
    shard = c.open_shard("cut", SCHEMA)
    (part,) = stage(c, shard, [rows(4500)], fmt).parts
    data = fetch_part_bytes(c.blob, part, "cut")
    for start, stop in [(0, 1000), (1000, 3500), (1500, 2600), (3999, 4500), (0, 4500)]:
        got = pa.Table.from_batches(list(iter_part_batches(data, part, "cut", 1000, (start, stop))))
        assert got.select(SCHEMA.names).equals(rows(stop - start, start)), (start, stop)
    whole = LeasedPart("cut", c.blob.uri, part, 0, 1, 0, 1)
    pieces = [replace(whole, row_range=r) for r in [(0, 2000), (2000, 4000), (4000, 4500)]]
    read = pa.concat_tables(iter_parts(c.blob, pieces, schema=SCHEMA))
    assert read.select(SCHEMA.names).equals(rows(4500))
    c.close()
