"""Replacing a shard's contents keeps state small (issue 13 item 9) and never mixes old and new.

A replace used to retract by negating every part reference in the trace,
the previous retractions included, so references doubled with each replace
(1, 3, 7, ... 2^n - 1). Now a replace adds only its new parts and the
retraction of what the last replace wrote plus the appends since.
"""

from __future__ import annotations

import collections
import random
import uuid

import pyarrow as pa
import pytest

from pyspark_persist.state import DIFF, PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.commands import Committed
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.diff import encode, full_diff
from pyspark_persist.state.state import ShardState

SCHEMA = pa.schema([("k", pa.int64())])
REPLACES = 100
REFS_PER_REPLACE = 3
"""A replace adds its new part and negates the last replace's (measured: 2; the old code 2^n)."""
HELD_BYTES_PER_REPLACE = {False: 600, True: 2_000}
"""Encoded state per replace while since is held: ~450 bytes measured with Blob parts, ~1,700
with inline parts, whose bytes ride in state (and in each negated reference to them)."""
STATE_BYTES_COMPACTED = 2_000
"""Once since passed the replaced rows, compaction leaves one batch of one part: ~900 bytes."""


def counts(table: pa.Table) -> collections.Counter[int]:
    """The multiset a snapshot table stands for."""
    out: collections.Counter[int] = collections.Counter()
    for k, d in zip(table.column("k").to_pylist(), table.column(DIFF).to_pylist(), strict=True):
        out[k] += d
    return +out


def references(state: ShardState) -> int:
    """Part references held in state (negated ones included)."""
    return sum(len(b.parts) for b in state.batches.values())


def state_bytes(state: ShardState) -> int:
    """The encoded size of the whole state: what a rollup stores."""
    return len(encode(full_diff(state)))


@pytest.mark.parametrize("inline", [False, True], ids=["blob-parts", "inline-parts"])
def test_replaces_add_a_few_references_each_and_compact_to_a_constant(inline: bool) -> None:
    tag = uuid.uuid4().hex
    config = PersistConfig(maintenance=False, **({} if inline else {"inline_write_max_bytes": 1}))
    client = PersistClient(
        open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"), config=config, cache=StateCache()
    )
    try:
        shard = client.open_shard("replaced", SCHEMA)
        writer = shard.writer()
        reader = shard.reader()  # holds since at 0: every replaced version stays readable
        for i in range(REPLACES):
            builder = writer.builder()
            builder.add(pa.table({"k": pa.array([i, 1000 + i], pa.int64())}))
            staged = builder.finish()
            upper = shard.upper
            res = writer.compare_and_append_batches(
                [staged], upper, upper + 1, ts_rewrite=upper, replace=True
            )
            assert isinstance(res, Committed)
            state = shard.state()
            assert references(state) <= REFS_PER_REPLACE * (i + 1), f"after {i + 1} replaces"
        held = shard.state()
        assert state_bytes(held) <= HELD_BYTES_PER_REPLACE[inline] * REPLACES
        for as_of in (0, 41, REPLACES - 1):  # history is kept while since is held
            got = counts(reader.snapshot_table(as_of))
            assert got == collections.Counter({as_of: 1, 1000 + as_of: 1})

        reader.downgrade_since(REPLACES - 1)
        shard.compact()
        compacted = shard.state()
        assert references(compacted) <= 2
        assert state_bytes(compacted) <= STATE_BYTES_COMPACTED
        last = REPLACES - 1
        assert counts(reader.snapshot_table(last)) == collections.Counter({last: 1, 1000 + last: 1})
    finally:
        client.close()


def test_replace_over_several_times_never_shows_old_and_new_together() -> None:
    """A replace whose batch spans times [5, 9): every as_of sees the old rows or only new ones."""
    tag = uuid.uuid4().hex
    client = PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=PersistConfig(maintenance=False),
        cache=StateCache(),
    )
    try:
        shard = client.open_shard("span", SCHEMA)
        writer = shard.writer()
        old = pa.table({"k": pa.array([1, 2], pa.int64()), "_time": pa.array([0, 4], pa.uint64())})
        writer.compare_and_append(old, 0, 5)
        builder = writer.builder()
        builder.add(
            pa.table({"k": pa.array([7, 8], pa.int64()), "_time": pa.array([5, 8], pa.uint64())})
        )
        res = writer.compare_and_append_batches([builder.finish()], 5, 9, replace=True)
        assert isinstance(res, Committed)
        reader = shard.reader()
        assert counts(reader.snapshot_table(4)) == collections.Counter({1: 1, 2: 1})
        for as_of in range(5, 8):
            assert counts(reader.snapshot_table(as_of)) == collections.Counter({7: 1}), as_of
        assert counts(reader.snapshot_table(8)) == collections.Counter({7: 1, 8: 1})
    finally:
        client.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_replaces_appends_and_compaction_interleaved_read_exactly(seed: int) -> None:
    """Random appends and replaces with compaction between: every as_of equals the model."""
    rng = random.Random(seed)
    tag = uuid.uuid4().hex
    config = PersistConfig(maintenance=False, compaction_fan_in=2, inline_write_max_bytes=64)
    client = PersistClient(
        open_blob(f"mem://{tag}"), open_consensus(f"mem://{tag}"), config=config, cache=StateCache()
    )
    try:
        shard = client.open_shard("mixed", SCHEMA)
        writer = shard.writer()
        reader = shard.reader()
        model: list[collections.Counter[int]] = []  # contents as of each time
        current: collections.Counter[int] = collections.Counter()
        for _ in range(60):
            keys = [rng.randrange(20) for _ in range(rng.randint(0, 6))]
            replace = rng.random() < 0.4
            builder = writer.builder()
            builder.add(pa.table({"k": pa.array(keys, pa.int64())}))
            upper = shard.upper
            res = writer.compare_and_append_batches(
                [builder.finish()], upper, upper + 1, ts_rewrite=upper, replace=replace
            )
            assert isinstance(res, Committed)
            current = collections.Counter(keys) if replace else current + collections.Counter(keys)
            model.append(+current)
            if rng.random() < 0.3:
                shard.compact()
            if rng.random() < 0.1:
                reader.downgrade_since(rng.randint(reader.since, len(model) - 1))
        for as_of in range(reader.since, len(model)):
            assert counts(reader.snapshot_table(as_of)) == model[as_of], as_of
        assert references(shard.state()) <= 3 * len(model)
    finally:
        client.close()
