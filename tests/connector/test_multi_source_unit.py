"""A stream of several shards (``shards``) without Spark: rows tagged, columns unioned, and no
micro-batch ever splitting a transaction, whatever the writers do meanwhile.

The calls are Spark's, in Spark's order (``initialOffset``, then per trigger
``latestOffset``, ``partitions``, ``read`` on a pickled copy, ``commit``), on a
:class:`MultiShardStreamReader` over an in-memory or SQLite location.
``tests/connector/test_txn_spark.py`` runs the same source under Spark.
"""

from __future__ import annotations

import pickle
import threading
import uuid
from collections import defaultdict
from typing import Any

import pyarrow as pa
import pytest
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows
from source_helpers import PUBSUB, reader_with_lost_pushes

from pyspark_persist.joint_offsets import next_joint, reads_nothing, settled
from pyspark_persist.multi_stream_reader import MultiShardStreamReader
from pyspark_persist.offsets import LISTEN, SNAPSHOT, Offset
from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import union_read_schema
from pyspark_persist.state import PersistClient, ShardState
from pyspark_persist.state.errors import InvalidUsage, SchemaMismatch
from pyspark_persist.state.machine import Machine

ORDERS = pa.schema([("order", pa.int64()), ("amount", pa.float64())])
ITEMS = pa.schema([("order", pa.int64()), ("sku", pa.string())])
ORDERS_IN_TXNS = 60
"""Transactions committed while a stream runs beside them."""


class Env:
    """Two shards, ``orders`` and ``items``, with different columns, in a fresh location."""

    def __init__(self, consensus: str | None = None) -> None:
        tag = uuid.uuid4().hex
        self.blob = f"mem://{tag}"
        self.consensus = consensus or f"mem://{tag}"
        self.client = PersistClient.open(self.blob, self.consensus)
        self.orders = f"o{tag[:10]}"
        self.items = f"i{tag[:10]}"
        self.client.open_shard(self.orders, ORDERS)
        self.client.open_shard(self.items, ITEMS)

    def opts(self, **extra: str) -> PersistOptions:
        given = {"blob": self.blob, "consensus": self.consensus}
        return PersistOptions.parse(
            {**given, "shards": f"{self.orders},{self.items}", **extra}, "stream_read"
        )

    def reader(self, **extra: str) -> MultiShardStreamReader:
        opts = self.opts(**extra)
        schemas = {n: self.client.open_shard(n).schema for n in (self.orders, self.items)}
        return MultiShardStreamReader(opts, union_read_schema(schemas))

    def txn(self, order: int, items: int, token: int | None = None) -> int:
        """Order ``order`` with ``items`` items, committed to both shards in one transaction."""
        with self.client.txn(writer_id="etl", token=token) as t:
            t.append(self.orders, pa.table({"order": [order], "amount": [order * 1.5]}, ORDERS))
            t.append(
                self.items,
                pa.table({"order": [order] * items, "sku": [f"s{j}" for j in range(items)]}, ITEMS),
            )
        assert t.commit_time is not None
        return t.commit_time

    def append_order(self, order: int) -> None:
        """An order alone, appended to ``orders`` outside any transaction."""
        shard = self.client.open_shard(self.orders)
        shard.writer().append(pa.table({"order": [order], "amount": [0.0]}, ORDERS))


def run(
    reader: MultiShardStreamReader,
    start: dict[str, Any] | None = None,
    limit: ReadLimit | None = None,
    triggers: int = 50,
) -> tuple[list[list[dict[str, Any]]], dict[str, Any]]:
    """Spark's calls for up to ``triggers`` micro-batches (stopping at the first with nothing
    new); each micro-batch's rows, and the last offset."""
    offset = start if start is not None else reader.initialOffset()
    batches = []
    for _ in range(triggers):
        end = reader.latestOffset(offset, limit or ReadAllAvailable())
        if end == offset:
            break
        parts = reader.partitions(offset, end)
        remote = pickle.loads(pickle.dumps(reader))
        rows: list[dict[str, Any]] = []
        for p in parts:
            for b in remote.read(pickle.loads(pickle.dumps(p))):
                rows.extend(b.to_pylist())
        batches.append(rows)
        reader.commit(end)
        offset = end
    return batches, offset


def test_rows_carry_their_shard_and_the_union_of_columns() -> None:
    env = Env()
    env.txn(1, 2)
    reader = env.reader()
    assert reader._schema.fieldNames() == ["order", "amount", "sku", "_shard", "_time", "_diff"]
    (batch,), _ = run(reader)
    by_shard = sorted((r["_shard"], r["order"], r["amount"], r["sku"]) for r in batch)
    assert by_shard == [
        (env.items, 1, None, "s0"),
        (env.items, 1, None, "s1"),
        (env.orders, 1, 1.5, None),
    ]
    assert len({r["_time"] for r in batch}) == 1  # the transaction's one time in both shards
    reader.stop()


def test_a_shard_nobody_writes_holds_nothing_back() -> None:
    env = Env()
    reader = env.reader()
    offset = reader.initialOffset()
    env.append_order(1)  # items stays empty, its upper 0
    batches, offset = run(reader, offset)
    assert [[r["order"] for r in b] for b in batches] == [[1]]
    env.append_order(2)
    batches, _ = run(reader, offset)
    assert [[(r["_shard"], r["order"]) for r in b] for b in batches] == [[(env.orders, 2)]]
    reader.stop()


def test_an_idle_stream_reads_consensus_only_every_pubsub_poll_ms_and_a_push_never_cuts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While PubSub delivers every shard, a trigger that finds nothing new in the cached
    states reads no Consensus (Spark asks every 10 ms); a commit whose push was lost shows
    once pubsubPollMs has passed. When a push shows one shard of a transaction before the
    other's (they come one per shard), the cut is still read from Consensus for all: the
    transaction arrives whole."""
    env = Env()
    env.txn(1, 1)
    clock = reader_with_lost_pushes(monkeypatch, env.blob, env.consensus)
    reads = [0]
    fetch_latest = Machine.fetch_latest

    def counted(machine: Machine) -> ShardState:
        reads[0] += 1
        return fetch_latest(machine)

    monkeypatch.setattr(Machine, "fetch_latest", counted)
    reader = env.reader(pubsub=PUBSUB, startingPosition="latest")
    start = reader.initialOffset()
    reads[0] = 0
    for _ in range(50):
        assert reader.latestOffset(start, ReadAllAvailable()) == start
    # One poll of each shard (the first trigger's); before, two reads of both per trigger.
    assert reads[0] <= 2, f"{reads[0]} Consensus reads over 50 idle triggers"

    env.txn(2, 2)  # another process's transaction; both pushes lost
    assert reader.latestOffset(start, ReadAllAvailable()) == start  # cached, within 1 s
    reader.shard_set.holders[env.orders].machine.fetch_latest()  # the orders push alone came
    (batch,), offset = run(reader, start)
    assert sorted((r["_shard"], r["order"]) for r in batch) == sorted(
        [(env.orders, 2), (env.items, 2), (env.items, 2)]
    )

    env.append_order(3)  # its push lost too
    assert reader.latestOffset(offset, ReadAllAvailable()) == offset
    clock[0] += 1000  # pubsubPollMs (default 1 s) later: Consensus is read again
    (batch,), _ = run(reader, offset)
    assert [(r["_shard"], r["order"]) for r in batch] == [(env.orders, 3)]
    reader.stop()


def _orders_per_batch(batches: list[list[dict[str, Any]]]) -> dict[int, list[int]]:
    """Order -> the micro-batches its rows (in either shard) arrived in."""
    seen: dict[int, list[int]] = defaultdict(list)
    for i, b in enumerate(batches):
        for r in b:
            seen[r["order"]].append(i)
    return seen


@pytest.mark.parametrize("limit", [None, ReadMaxRows(3)], ids=["all", "maxRows3"])
def test_no_micro_batch_splits_a_transaction_while_writers_commit(
    limit: ReadLimit | None, tmp_path: Any
) -> None:
    """Transactions and plain appends commit on two threads while the stream runs; every
    transaction's rows (an order and its three items) arrive in one micro-batch, once."""
    env = Env(consensus=f"sqlite:///{tmp_path}/consensus.db")
    reader = env.reader()
    offset = reader.initialOffset()
    stop = threading.Event()

    def transactions() -> None:
        for order in range(ORDERS_IN_TXNS):
            env.txn(order, 3, token=order)
        stop.set()

    def appends() -> None:
        order = 10_000
        while not stop.wait(0.005):
            env.append_order(order)
            order += 1

    threads = [threading.Thread(target=transactions), threading.Thread(target=appends)]
    for t in threads:
        t.start()
    batches: list[list[dict[str, Any]]] = []
    while not stop.is_set():
        got, offset = run(reader, offset, limit, triggers=1)
        batches += got
    for t in threads:
        t.join()
    got, offset = run(reader, offset, limit, triggers=10_000)
    batches += got
    seen = _orders_per_batch(batches)
    for order in range(ORDERS_IN_TXNS):
        assert len(seen[order]) == 4, (order, seen[order])  # once in orders, three items
        assert len(set(seen[order])) == 1, f"transaction {order} split: {seen[order]}"
    assert all(len(v) == 1 for k, v in seen.items() if k >= 10_000)
    assert len(batches) > 3  # the stream ran beside the writers, not after them
    reader.stop()


def test_a_restart_from_the_checkpointed_offset_goes_on_exactly() -> None:
    env = Env()
    env.txn(1, 1)
    reader = env.reader()
    first, offset = run(reader)
    reader.stop()
    env.txn(2, 1)
    again = env.reader()
    batches, _ = run(again, pickle.loads(pickle.dumps(offset)))
    assert sorted(r["order"] for b in first for r in b) == [1, 1]
    assert sorted(r["order"] for b in batches for r in b) == [2, 2]
    again.stop()


def test_starting_position_latest_reads_only_new_transactions() -> None:
    env = Env()
    env.txn(1, 1)
    reader = env.reader(startingPosition="latest")
    offset = reader.initialOffset()
    env.txn(2, 2)
    batches, _ = run(reader, offset)
    assert sorted(r["order"] for b in batches for r in b) == [2, 2, 2]
    reader.stop()


def test_starting_time_past_an_idle_shards_upper_starts_there_and_as_of_is_refused() -> None:
    env = Env()
    first = env.txn(1, 1)
    env.append_order(2)  # orders moves past items' upper
    later = env.client.open_shard(env.orders).upper - 1
    assert later > first  # items' upper is first + 1: its snapshot at later is not complete
    with pytest.raises(InvalidUsage, match=f"startingAsOf .* of shard '{env.items}'"):
        env.reader(startingAsOf=str(later)).initialOffset()
    reader = env.reader(startingTime=str(later))
    offset = reader.initialOffset()
    env.txn(3, 1)
    batches, _ = run(reader, offset)
    assert sorted(r["order"] for b in batches for r in b) == [2, 3, 3]
    reader.stop()


def test_available_now_stops_at_the_uppers_seen_when_prepared() -> None:
    env = Env()
    env.txn(1, 1)
    reader = env.reader()
    offset = reader.initialOffset()
    reader.prepareForTriggerAvailableNow()
    env.txn(2, 1)
    batches, _ = run(reader, offset)
    assert sorted(r["order"] for b in batches for r in b) == [1, 1]
    reader.stop()


def test_a_checkpoint_of_other_shards_is_refused() -> None:
    env = Env()
    reader = env.reader()
    single = {"shard": env.orders, "seqno": 1, "upper": 0, "phase": "snapshot", "as_of": -1}
    with pytest.raises(InvalidUsage, match="alone, but this query reads shards"):
        reader.latestOffset(single, ReadAllAvailable())
    other = {"shards": {env.orders: single}}
    with pytest.raises(InvalidUsage, match="new checkpointLocation"):
        reader.latestOffset(other, ReadAllAvailable())
    reader.stop()


def test_columns_of_one_name_and_two_types_are_refused() -> None:
    with pytest.raises(SchemaMismatch, match="'order' is bigint in shard 'a' but string"):
        union_read_schema({"a": ORDERS, "b": pa.schema([("order", pa.string())])})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"shard": "x"}, "both name what to read"),
        ({"consumer": "c"}, "consumer is one shard's"),
        ({"columns": "order"}, "select the columns after reading"),
        ({"startingSeqNo": "3"}, "use startingTime"),
        ({"changeTypes": "true"}, "own stream with changeTypes"),
    ],
)
def test_what_a_stream_of_several_shards_does_not_take_is_refused(
    extra: dict[str, str], message: str
) -> None:
    with pytest.raises(InvalidUsage, match=message):
        Env().opts(**extra)


@pytest.mark.parametrize(
    ("value", "message"),
    [("a,,b", "names an empty shard"), ("a,b,a", "names \\['a'\\] twice"), ("a,b c", "shard")],
)
def test_bad_shard_lists_are_refused(value: str, message: str) -> None:
    with pytest.raises(InvalidUsage, match=message):
        PersistOptions.parse({"shards": value}, "stream_read")


def test_a_batch_read_of_several_shards_is_refused() -> None:
    with pytest.raises(InvalidUsage, match="shards applies to stream reads only"):
        PersistOptions.parse({"shards": "a,b"}, "read")


def _state(shard: str, upper: int) -> ShardState:
    """A state of ``shard`` at ``upper`` (its batches do not matter to these rules)."""
    return ShardState(shard, 1, b"", 0, upper)


def test_settled_compares_uppers_only() -> None:
    a, b = _state("a", 3), _state("b", 5)
    assert settled({"a": a, "b": b}, {"a": a, "b": b})
    assert not settled({"a": a, "b": b}, {"a": a, "b": _state("b", 6)})


def test_the_snapshot_waits_for_every_shard_and_an_empty_one_starts_at_zero() -> None:
    states = {"a": _state("a", 4), "b": _state("b", 0)}
    start = {n: Offset(n, 0, 0, SNAPSHOT) for n in states}
    end = next_joint(states, start)
    assert end["a"] == Offset("a", states["a"].seqno, 4, LISTEN)
    assert end["b"].upper == 0 and end["b"].phase == LISTEN
    assert reads_nothing(start["b"], end["b"]) and not reads_nothing(start["a"], end["a"])
    at = {n: Offset(n, 0, 0, SNAPSHOT, as_of=2) for n in states}  # startingAsOf 2: b has no 2
    assert next_joint(states, at) == at
