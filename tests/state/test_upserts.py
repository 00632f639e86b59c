"""Upserts and deletes on keyed shards, as a user checks them (JVM-free).

What must hold: at every time at most one row per key; the shard equals its
writes applied one at a time in SeqNo order (last row of a key wins within a
write), under concurrent writers (threads and a process) and with faults
injected into the stores; bad input fails before anything is staged; the
lookup of a write's keys skips parts that cannot hold them.
"""

from __future__ import annotations

import collections
import json
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import (
    AlreadyCommitted,
    Committed,
    LeasedPart,
    PersistClient,
    PersistConfig,
    Shard,
    iter_parts,
)
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import InvalidUpdates, InvalidUsage, PersistError
from pyspark_persist.state.keyed import key_table
from pyspark_persist.state.unreliable import Faults, UnreliableBlob, UnreliableConsensus
from pyspark_persist.state.upsert import KeyColumnCache, lookup

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string())])
NO_MAINTENANCE = PersistConfig(maintenance=False)


def table(ids: list[int], names: list[str]) -> pa.Table:
    return pa.table({"id": ids, "name": names}, schema=SCHEMA)


def live(shard: Shard) -> dict[int, str]:
    """The shard's rows at its latest time, by key (asserting one row per key, diff 1)."""
    rows = shard.reader().snapshot_table().to_pylist()
    assert all(r["_diff"] == 1 for r in rows), rows
    out = {r["id"]: r["name"] for r in rows}
    assert len(out) == len(rows), f"two rows of one key: {rows}"
    return out


def every_time_one_row_per_key(shard: Shard) -> None:
    """Walk every update the shard holds, time by time: after each time, every key has at most
    one row, with multiplicity 1 (no retraction of a row that is not there)."""
    state = shard.state()
    leased = [
        LeasedPart(shard.name, shard.client.blob.uri, p, 0, state.upper, None, state.seqno)
        for b in state.trace
        for p in b.parts
    ]
    by_time: dict[int, list[tuple[tuple[Any, ...], int]]] = collections.defaultdict(list)
    for t in iter_parts(shard.client.blob, leased, schema=shard.schema):
        for r in t.to_pylist():
            by_time[r["_time"]].append(((r["id"], r["name"]), r["_diff"]))
    counts: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for t in sorted(by_time):
        for row, d in by_time[t]:
            counts[row] += d
        alive = {row: n for row, n in counts.items() if n}
        assert all(n == 1 for n in alive.values()), (t, alive)
        keys = [row[0] for row in alive]
        assert len(keys) == len(set(keys)), (t, sorted(alive))


def apply_serially(model: dict[int, str], ids: list[int], names: list[str | None]) -> None:
    """One write applied to a model: the last row of a key wins; a None name deletes it."""
    for k, name in zip(ids, names, strict=True):
        if name is None:
            model.pop(k, None)
        else:
            model[k] = name


@pytest.fixture
def mem() -> Iterator[PersistClient]:
    c = PersistClient.open("mem://", "mem://", config=NO_MAINTENANCE)
    yield c
    c.close()


def test_upsert_retracts_the_current_row_and_the_last_row_of_a_key_wins(
    client: PersistClient, shard_name: str
) -> None:
    shard = client.open_shard(shard_name, SCHEMA, keys=["id"])
    w = shard.writer("w")
    assert isinstance(w.upsert(table([1, 2, 1], ["a", "b", "a2"]), token=1), Committed)
    assert live(shard) == {1: "a2", 2: "b"}
    first = shard.upper
    r = w.upsert(table([2, 3], ["b2", "c"]), token=2)
    assert isinstance(r, Committed)
    # The listen of that commit carries the retraction and the insertion at one time.
    reader = shard.reader()
    listen = reader.listen(first - 1)
    event = listen.next(timeout_s=10)
    assert event is not None
    changes = sorted(
        (x["id"], x["name"], x["_diff"]) for x in reader.fetch(event.parts).to_pylist()
    )
    assert changes == [(2, "b", -1), (2, "b2", 1), (3, "c", 1)]
    assert w.upsert(table([2, 3], ["b2", "c"]), token=2) == AlreadyCommitted(2, r.upper)
    w.delete(pa.table({"id": [1, 99]}), token=3)
    w.append(table([3], ["c2"]))  # append on a keyed shard is an upsert
    assert live(shard) == {2: "b2", 3: "c2"}
    every_time_one_row_per_key(shard)


def test_writing_a_keys_current_row_again_changes_nothing(mem: PersistClient) -> None:
    shard = mem.open_shard("k", SCHEMA, keys=["id"])
    w = shard.writer()
    w.upsert(table([1, 2], ["a", "b"]))
    rows_before = sum(b.rows for b in shard.state().trace)
    w.upsert(table([1, 2], ["a", "b"]))
    assert sum(b.rows for b in shard.state().trace) == rows_before


def test_composite_keys_and_delete_column(mem: PersistClient) -> None:
    schema = pa.schema([("region", pa.string()), ("id", pa.int32()), ("v", pa.int64())])
    shard = mem.open_shard("k", schema, keys=["region", "id"])
    w = shard.writer()
    rows = pa.table(
        {"region": ["eu", "us", "eu"], "id": [1, 1, 2], "v": [10, 20, 30]}, schema=schema
    )
    w.upsert(rows)
    flagged = pa.table(
        {
            "region": ["us", "eu"],
            "id": pa.array([1, 2], pa.int32()),
            "v": [0, 31],
            "is_deleted": [True, False],
        }
    )
    w.upsert(flagged, delete_column="is_deleted")
    got = shard.reader().snapshot_table()
    assert "is_deleted" not in got.column_names
    assert sorted((r["region"], r["id"], r["v"]) for r in got.to_pylist()) == [
        ("eu", 1, 10),
        ("eu", 2, 31),
    ]


@pytest.mark.parametrize(
    ("rows", "kwargs", "message"),
    [
        (pa.table({"id": [1, None], "name": ["a", "b"]}), {}, r"1 rows .* null key 'id'"),
        (pa.table({"name": ["a"]}), {}, r"lacks key column 'id'"),
        (pa.table({"id": ["1"], "name": ["a"]}), {}, r"key column 'id' .* is string.*int64"),
        (
            pa.table({"id": [1], "name": ["a"], "del": [1]}),
            {"delete_column": "del"},
            r"delete column 'del' .* is int64: it must be boolean",
        ),
        (
            pa.table({"id": [1], "name": ["a"]}),
            {"sequence_column": "lsn"},
            r"sequence column 'lsn' is not a column of shard",
        ),
    ],
)
def test_bad_upserts_fail_before_anything_is_staged(
    mem: PersistClient, rows: pa.Table, kwargs: dict[str, str], message: str
) -> None:
    shard = mem.open_shard("k", SCHEMA, keys=["id"])
    w = shard.writer()
    with pytest.raises(InvalidUpdates, match=message):
        w.upsert(rows, **kwargs)
    assert list(mem.blob.list_keys()) == []
    assert shard.state().seqno == 1


def test_non_upsert_writes_to_keyed_shards_and_upserts_to_unkeyed_ones_are_refused(
    mem: PersistClient,
) -> None:
    keyed = mem.open_shard("k", SCHEMA, keys=["id"])
    with pytest.raises(InvalidUsage, match="could leave two rows of a key .* upsert"):
        keyed.writer().compare_and_append(table([1], ["a"]), 0, 1)
    plain = mem.open_shard("p", SCHEMA)
    with pytest.raises(InvalidUsage, match=r"upsert needs a keyed shard.*keys=\[\"id\"\]"):
        plain.writer().upsert(table([1], ["a"]))


def test_lookup_skips_parts_whose_key_range_misses_and_caches_key_columns(
    mem: PersistClient,
) -> None:
    shard = mem.open_shard("k", SCHEMA, keys=["id"])
    w = shard.writer()
    for i in range(10):  # ten Blob parts of disjoint key ranges
        ids = list(range(i * 1000, (i + 1) * 1000))
        w.upsert(table(ids, [f"n{k}" for k in ids]))
    state = shard.state()
    assert all(p.key is not None for b in state.trace for p in b.parts)
    cache = KeyColumnCache()
    wanted = key_table(pa.table({"id": [4005, 4999, 5000]}), ("id",))
    found = lookup(mem.blob, "k", SCHEMA, state.trace, ("id",), wanted, cache)
    assert (found.parts, found.parts_skipped, found.parts_read) == (10, 8, 2)
    assert sorted(found.updates.column("id").to_pylist()) == [4005, 4999, 5000]
    assert found.rows_decoded == 3
    lookup(mem.blob, "k", SCHEMA, state.trace, ("id",), wanted, cache)
    assert (cache.misses, cache.hits) == (2, 2)  # each part's keys read once


# --- concurrency: threads and a process ------------------------------------------------------

KEYS = 40
WRITES = 12


def random_write(rng: random.Random) -> tuple[list[int], list[str | None]]:
    """A write of a few overlapping keys, some repeated, some deletes (name None)."""
    ids = [rng.randrange(KEYS) for _ in range(rng.randrange(1, 8))]
    names: list[str | None] = [None if rng.random() < 0.2 else f"v{rng.random():.6f}" for _ in ids]
    return ids, names


def commit_write(w: Any, ids: list[int], names: list[str | None], token: int) -> None:
    """One write as an upsert with a delete column, resent with its token until acknowledged."""
    rows = pa.table(
        {
            "id": pa.array(ids, pa.int64()),
            "name": pa.array([n or "" for n in names], pa.string()),
            "gone": [n is None for n in names],
        }
    )
    while True:
        try:
            r = w.upsert(rows, token=token, delete_column="gone")
            assert isinstance(r, Committed | AlreadyCommitted)
            return
        except PersistError:
            continue  # an unknown outcome or a store blip: resend with the same token


PROCESS_WRITER = """
import json, random, sys
sys.path.insert(0, sys.argv[4])
from test_upserts import random_write, commit_write, WRITES
from pyspark_persist.state import PersistClient, PersistConfig
client = PersistClient.open(sys.argv[1], sys.argv[2], config=PersistConfig(maintenance=False))
w = client.open_shard(sys.argv[3]).writer("proc")
rng = random.Random(99)
writes = []
for token in range(1, WRITES + 1):
    ids, names = random_write(rng)
    commit_write(w, ids, names, token)
    writes.append([ids, names])
print(json.dumps(writes))
"""


def serial_model(shard: Shard, writes: dict[str, list[Any]]) -> dict[int, str]:
    """The writes applied one at a time in the order of their commits' SeqNos (each writer's
    commits land in token order, so its n-th commit in the history is its n-th write)."""
    pending = {w: collections.deque(ws) for w, ws in writes.items()}
    model: dict[int, str] = {}
    for commit in shard.history():
        if commit.writer_id in pending:
            ids, names = pending[commit.writer_id].popleft()
            apply_serially(model, ids, names)
    assert all(not q for q in pending.values()), "a write was lost"
    return model


def test_concurrent_upserts_of_overlapping_keys_equal_serial_application(
    tmp_path: Path,
) -> None:
    blob, consensus = f"file://{tmp_path}/blob", f"sqlite:///{tmp_path}/c.db"
    base = PersistClient.open(blob, consensus, config=NO_MAINTENANCE)
    shard = base.open_shard("cdc", SCHEMA, keys=["id"])
    writes: dict[str, list[Any]] = {}

    def thread_writer(i: int) -> None:
        # A client each, with a private state cache: they really race on Consensus.
        c = PersistClient(
            open_blob(blob), open_consensus(consensus), config=NO_MAINTENANCE, cache=StateCache()
        )
        w = c.open_shard("cdc").writer(f"t{i}")
        rng = random.Random(i)
        mine = writes.setdefault(f"t{i}", [])
        for token in range(1, WRITES + 1):
            ids, names = random_write(rng)
            commit_write(w, ids, names, token)
            mine.append([ids, names])
        c.close()

    here = str(Path(__file__).parent)
    proc = subprocess.Popen(
        [sys.executable, "-c", PROCESS_WRITER, blob, consensus, "cdc", here],
        stdout=subprocess.PIPE,
        text=True,
    )
    threads = [threading.Thread(target=thread_writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    writes["proc"] = json.loads(out)
    assert live(shard) == serial_model(shard, writes)
    every_time_one_row_per_key(shard)
    base.close()


def test_faults_lose_no_upsert_and_apply_none_twice(tmp_path: Path) -> None:
    blob, consensus = (
        open_blob(f"file://{tmp_path}/blob"),
        open_consensus(f"sqlite:///{tmp_path}/c"),
    )
    faults = Faults(seed=5, fail_before=0.1, fail_after=0.15)
    flaky_blob = UnreliableBlob(blob, Faults(seed=6, fail_before=0.05, fail_after=0.05))
    flaky = UnreliableConsensus(consensus, faults)
    config = PersistConfig(maintenance=False, retry_timeout_s=0.05)
    clients = [
        PersistClient(flaky_blob, flaky, config=config, cache=StateCache()) for _ in range(2)
    ]
    flaky.enabled = flaky_blob.enabled = False
    clients[0].open_shard("cdc", SCHEMA, keys=["id"])
    flaky.enabled = flaky_blob.enabled = True
    writes: dict[str, list[Any]] = {}

    def writer(i: int) -> None:
        w = clients[i].open_shard("cdc").writer(f"w{i}")
        rng = random.Random(100 + i)
        mine = writes.setdefault(f"w{i}", [])
        for token in range(1, WRITES + 1):
            ids, names = random_write(rng)
            commit_write(w, ids, names, token)
            mine.append([ids, names])

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert flaky.injected["fail_after"] > 0 and flaky.injected["fail_before"] > 0
    flaky.enabled = flaky_blob.enabled = False
    with PersistClient(blob, consensus, config=NO_MAINTENANCE, cache=StateCache()) as check:
        shard = check.open_shard("cdc")
        commits = [c for c in shard.history() if c.writer_id in writes]
        assert len(commits) == 2 * WRITES  # none lost, none applied twice
        assert live(shard) == serial_model(shard, writes)
        every_time_one_row_per_key(shard)


# --- order: a sequence column -----------------------------------------------------------------

SEQ = pa.schema([("id", pa.int64()), ("name", pa.string()), ("lsn", pa.int64())])


def seq_rows(ids: list[int], names: list[str], lsns: list[int]) -> pa.Table:
    return pa.table({"id": ids, "name": names, "lsn": lsns}, schema=SEQ)


def test_the_highest_sequence_wins_within_and_across_writes_deletes_included(
    client: PersistClient, shard_name: str
) -> None:
    shard = client.open_shard(shard_name, SEQ, keys=["id"])
    w = shard.writer()
    w.upsert(seq_rows([1, 1, 2], ["a5", "a3", "b1"], [5, 3, 1]), sequence_column="lsn")
    assert live(shard) == {1: "a5", 2: "b1"}  # within a write: lsn 5 beats the later lsn 3
    w.upsert(seq_rows([1, 2], ["a4", "b2"], [4, 2]), sequence_column="lsn")
    assert live(shard) == {1: "a5", 2: "b2"}  # a late event for id 1 is ignored
    w.delete(pa.table({"id": [2, 3], "lsn": [10, 7]}), sequence_column="lsn")
    w.upsert(seq_rows([2, 3], ["b9", "c6"], [9, 6]), sequence_column="lsn")
    assert live(shard) == {1: "a5"}  # updates older than their key's delete stay deleted
    w.delete(pa.table({"id": [1], "lsn": [4]}), sequence_column="lsn")
    assert live(shard) == {1: "a5"}  # a delete older than the row is ignored too
    shard.compact()
    shard.gc()
    w.upsert(seq_rows([2, 3], ["b8", "c7"], [8, 7]), sequence_column="lsn")
    assert live(shard) == {1: "a5", 3: "c7"}  # tombstones outlive compaction and GC; a tie
    # (c7 at lsn 7, the delete's) goes to the write
    every_time_one_row_per_key(shard)


def test_tombstones_in_blob_survive_compaction_and_gc(tmp_path: Path) -> None:
    config = PersistConfig(maintenance=False, inline_write_max_bytes=1)
    with PersistClient.open(f"file://{tmp_path}/b", f"sqlite:///{tmp_path}/c", config=config) as c:
        shard = c.open_shard("k", SEQ, keys=["id"])
        w = shard.writer()
        w.upsert(seq_rows([1, 2], ["a", "b"], [1, 1]), sequence_column="lsn")
        w.delete(pa.table({"id": [1], "lsn": [5]}), sequence_column="lsn")
        tombs = [t for b in shard.state().trace for t in b.tombstones]
        assert len(tombs) == 1 and tombs[0].key is not None
        for _ in range(3):
            w.upsert(seq_rows([2], ["b"], [2]), sequence_column="lsn")
        shard.compact()
        shard.gc()
        assert c.blob.get(tombs[0].key) is not None
        w.upsert(seq_rows([1], ["late"], [4]), sequence_column="lsn")
        assert live(shard) == {2: "b"}


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (pa.table({"id": [1], "name": ["a"]}), r"lacks its sequence column 'lsn'"),
        (pa.table({"id": [1], "name": ["a"], "lsn": ["x"]}), r"lsn.* is string"),
        (pa.table({"id": [1], "name": ["a"], "lsn": pa.array([None], pa.int64())}), r"null seq"),
    ],
)
def test_a_bad_sequence_column_fails_before_staging(
    mem: PersistClient, rows: pa.Table, message: str
) -> None:
    shard = mem.open_shard("k", SEQ, keys=["id"])
    with pytest.raises((InvalidUpdates, PersistError), match=message):
        shard.writer().upsert(rows, sequence_column="lsn")
    assert shard.state().seqno == 1


def test_compaction_folds_a_key_updated_a_thousand_times_into_one_row() -> None:
    """Once since passes them, a key's 1,000 upserts (each a retraction and an insertion) are
    stored as its one live row, and GC deletes the parts that held the rest."""
    with PersistClient.open("mem://", "mem://") as c:
        shard = c.open_shard("hot", SCHEMA, keys=["id"])
        w, reader = shard.writer(), shard.reader()
        for i in range(1000):
            w.upsert(table([1], [f"v{i}"]))
        before = sum(b.rows for b in shard.state().trace)
        w.upsert(table([2], ["other"]))
        reader.downgrade_since(shard.upper - 1)  # since passes every update of key 1
        c.maintenance.wait_idle()
        shard.compact()
        reader.close()  # its SeqNo lease would keep the replaced parts
        shard.gc()
        state = shard.state()
        leased = [
            LeasedPart("hot", c.blob.uri, p, 0, state.upper, None, state.seqno)
            for b in state.trace
            for p in b.parts
        ]
        stored = [r for t in iter_parts(c.blob, leased) for r in t.to_pylist()]
        assert [(r["name"], r["_diff"]) for r in stored if r["id"] == 1] == [("v999", 1)]
        assert before >= 1999 and len(stored) <= 3
        kept = {m.key for m in c.blob.list_keys("hot/part/")}
        assert kept == {p.key for b in state.trace for p in b.parts if p.key is not None}
        assert live(shard) == {1: "v999", 2: "other"}


def test_upsert_whose_state_is_stale_after_compaction_and_gc_reads_the_new_parts() -> None:
    """A writer whose cached state names parts that another client compacted away and GC
    deleted still upserts: it reads the new state and looks again (the lookup holds no
    SeqNo lease, as compaction's merge holds none). It once raised PartNotFound, which the
    checker's keyed piece found under its maintenance."""
    blob, consensus = open_blob("mem://"), open_consensus("mem://")
    in_blob = PersistConfig(maintenance=False, inline_write_max_bytes=1, compaction_fan_in=2)
    writer_client = PersistClient(blob, consensus, config=in_blob, cache=StateCache())
    other = PersistClient(blob, consensus, config=in_blob, cache=StateCache())
    shard = writer_client.open_shard("k", SCHEMA, keys=["id"])
    w = shard.writer("w")
    for i in range(4):
        w.upsert(table([1, 2], [f"a{i}", f"b{i}"]), token=i + 1)
    compacted = other.open_shard("k")
    compacted.compact()
    assert compacted.gc().parts_deleted > 0  # the writer's cached state names deleted parts
    w.upsert(table([2, 3], ["b", "c"]), token=5)
    assert live(shard) == {1: "a3", 2: "b", 3: "c"}
    every_time_one_row_per_key(shard)


def test_upsert_raises_part_not_found_for_a_part_of_batches_still_in_state() -> None:
    """Looking again is only for parts compaction replaced: a part missing from batches the
    shard still holds is data loss, and the upsert says so instead of writing past it."""
    in_blob = PersistConfig(maintenance=False, inline_write_max_bytes=1)
    client = PersistClient(open_blob("mem://"), open_consensus("mem://"), config=in_blob)
    shard = client.open_shard("k", SCHEMA, keys=["id"])
    w = shard.writer("w")
    w.upsert(table([1], ["a"]), token=1)
    (part,) = [p for b in shard.state().trace for p in b.parts]
    assert part.key is not None
    client.blob.delete(part.key)
    with pytest.raises(PersistError, match="missing from blob"):
        w.upsert(table([1], ["b"]), token=2)
