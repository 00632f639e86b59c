"""Reading a keyed shard: its consolidation sums only the keys that need it, and stays exact.

:func:`~pyspark_persist.state.keyed.consolidate_keyed` is checked against the general
:func:`~pyspark_persist.state.updates.consolidate` on random keyed histories built by the pure
upsert planner (upserts, rewrites of a key's current row, deletes; one key column or two), in
the three shapes a read or a compaction hands it: a snapshot (every time set to ``as_of``), a
fold at a since (times below it advanced), and a run of later batches (a history's suffix).
Then a keyed shard on the mem backend: its snapshot matches a model of the writes before and
after ``Shard.compact()``, which leaves the idle shard one batch without retractions.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.keyed import consolidate_keyed, plan_upsert, prepare_write
from pyspark_persist.state.schema import DIFF, TIME, TIME_TYPE, data_schema
from pyspark_persist.state.updates import consolidate

ONE_KEY = (pa.schema([("id", pa.int64()), ("v", pa.string())]), ("id",))
TWO_KEYS = (
    pa.schema([("region", pa.string()), ("id", pa.int32()), ("v", pa.string())]),
    ("region", "id"),
)


def _history(seed: int, schema: pa.Schema, keys: tuple[str, ...]) -> pa.Table:
    """Every update of 40 random writes at times 1..40 into a keyed shard of ``schema``.

    Keys come from a small set and values from three, so writes hit the same keys
    again and again, some rewrite a key's current row (which cancels), some delete it.
    """
    rng = random.Random(seed)
    updates = [data_schema(schema).empty_table()]
    for t in range(1, 41):
        n = rng.randint(1, 6)
        ids = [rng.randrange(12) for _ in range(n)]
        columns = {
            "region": [("eu", "us")[i % 2] for i in ids],
            "id": ids,
            "v": [f"v{rng.randrange(3)}" for _ in ids],
        }
        rows = pa.table({f.name: pa.array(columns[f.name], f.type) for f in schema})
        deletes = pa.array([rng.random() < 0.2 for _ in ids])
        writes = prepare_write(rows, schema, keys, "s", deletes=deletes, sequence=None)
        planned, _ = plan_upsert(writes, pa.concat_tables(updates), schema, keys, t)
        updates.append(planned)
    return pa.concat_tables(updates)


def _at(table: pa.Table, times: pa.Array | pa.ChunkedArray) -> pa.Table:
    idx = table.schema.get_field_index(TIME)
    return table.set_column(idx, table.schema.field(idx), times)


def _shapes(history: pa.Table, rng: random.Random) -> list[pa.Table]:
    """A snapshot at the end, a fold at a random since, and a random suffix of ``history``."""
    n = history.num_rows
    since = pa.scalar(rng.randint(1, 40), TIME_TYPE)
    snapshot = _at(history, pa.array(np.full(n, 40, dtype=np.uint64), TIME_TYPE))
    folded = _at(history, pc.max_element_wise(history.column(TIME), since))
    suffix = history.filter(pc.greater_equal(history.column(TIME), since))
    return [snapshot, folded, suffix]


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([(name, "ascending") for name in table.column_names])


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize(("schema", "keys"), [ONE_KEY, TWO_KEYS], ids=["one-key", "two-keys"])
def test_keyed_consolidation_is_the_general_one_on_random_keyed_histories(
    seed: int, schema: pa.Schema, keys: tuple[str, ...]
) -> None:
    history = _history(seed, schema, keys)
    assert pc.min(history.column(DIFF)).as_py() < 0  # the history does retract
    for shaped in _shapes(history, random.Random(seed)):
        general = consolidate(shaped, schema.names)
        keyed = consolidate_keyed(shaped, schema.names, keys)
        assert keyed.schema == general.schema
        assert _sorted(keyed).equals(_sorted(general))


def test_a_keyed_snapshot_of_inserts_alone_is_read_as_stored() -> None:
    """No key has a diff other than +1: nothing to sum, every row comes back, in order."""
    schema, keys = ONE_KEY
    rows = pa.table({"id": pa.array([3, 1, 2], pa.int64()), "v": ["c", "a", "b"]})
    writes = prepare_write(rows, schema, keys, "s", deletes=False, sequence=None)
    inserts, _ = plan_upsert(writes, data_schema(schema).empty_table(), schema, keys, 7)
    assert consolidate_keyed(inserts, schema.names, keys).equals(inserts)
    empty = data_schema(schema).empty_table()
    assert consolidate_keyed(empty, schema.names, keys).equals(empty)


def test_compact_leaves_an_idle_upserted_shard_one_batch_that_reads_the_same() -> None:
    """After upserts and deletes, background maintenance off: the snapshot (with the pairs of
    retraction and insert) matches the model; ``Shard.compact()`` folds everything since has
    passed into one batch without retractions, which reads the same."""
    client = PersistClient.open("mem://", "mem://", config=PersistConfig(maintenance=False))
    schema, keys = ONE_KEY
    shard = client.open_shard("k", schema, keys=list(keys), retention_ms=1)
    writer, rng, model = shard.writer(), random.Random(5), {}
    writer.upsert(pa.table({"id": pa.array(range(200), pa.int64()), "v": ["v0"] * 200}))
    model.update({i: "v0" for i in range(200)})
    # Fewer batches after the head than fan_in (8), holding fewer rows than it: in the
    # background these would wait (see expired_run).
    for r in range(1, 4):
        ids = rng.sample(range(220), 8)
        writer.upsert(pa.table({"id": pa.array(ids, pa.int64()), "v": [f"v{r}"] * 8}))
        model.update({i: f"v{r}" for i in ids})
        gone = rng.sample(range(220), 2)
        writer.delete(pa.table({"id": pa.array(gone, pa.int64())}))
        for i in gone:
            model.pop(i, None)

    def read() -> dict[int, str]:
        with shard.reader() as reader:  # (closed: an open reader would hold since back)
            table = reader.snapshot_table()
        assert set(table.column(DIFF).to_pylist()) == {1}
        ids, values = table.column("id").to_pylist(), table.column("v").to_pylist()
        return dict(zip(ids, values, strict=True))

    assert read() == model
    assert len(shard.state().batches) > 1
    time.sleep(0.01)  # (retention 1 ms: since may then pass every write)
    shard.gc()
    shard.compact()
    state = shard.state()
    assert state.since == state.upper - 1
    (batch,) = state.trace
    assert batch.rows == len(model)
    assert all(p.effective_dmin is not None and p.effective_dmin >= 1 for p in batch.parts)
    assert read() == model
    assert shard.compact() == []  # settled: nothing more to fold
    client.close()
