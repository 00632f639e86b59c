"""Named consumers in the streaming source, without Spark (issue 36).

The calls Spark makes on the driver, in its order, on :class:`PersistStreamReader`
over an in-memory location (see ``test_source_unit.py``): a query resuming
without its checkpoint from the consumer's position replays the micro-batch
its predecessor planned; the position moves only in ``commit``; two queries
with one consumer name: the older is fenced; a consumer holds since against
retention; bad names are refused before anything is written.
"""

from __future__ import annotations

from collections import Counter

import pytest
from pyspark.sql.streaming.datasource import ReadMaxRows
from source_helpers import SCHEMA, rows
from test_source_unit import Env, consolidated, drain, micro_batch, read_all, snapshot

from pyspark_persist.offsets import Offset, offset_json
from pyspark_persist.options import PersistOptions
from pyspark_persist.state.commands import expire_leased_readers
from pyspark_persist.state.drop import drop_shard
from pyspark_persist.state.errors import (
    ConsumerFenced,
    ConsumerInUse,
    InvalidUsage,
    ShardDropped,
)

LIMIT = ReadMaxRows(100)
"""One written batch of 100 rows per micro-batch."""


def env_with(batches: int) -> Env:
    """A fresh location whose shard holds ``batches`` writes of 100 rows each."""
    env = Env()
    for k in range(batches):
        env.write(rows(range(k * 100, (k + 1) * 100)))
    return env


def position(env: Env, name: str = "c") -> str:
    """The consumer's position as Consensus holds it now."""
    return env.shard.consumers()[name].position


def test_a_query_without_its_checkpoint_resumes_from_the_consumer_and_replays_its_plan() -> None:
    env = env_with(3)
    first = env.reader(consumer="c")
    start = first.initialOffset()
    committed_end, committed, _ = micro_batch(first, start, LIMIT)
    # The next micro-batch is planned and read, and the driver dies before Spark commits it.
    lost_end = first.latestOffset(committed_end, LIMIT)
    lost = read_all(first, first.partitions(committed_end, lost_end))
    assert position(env) == offset_json(Offset.from_dict(committed_end, env.base["shard"]))

    second = env.reader(consumer="c")  # a new checkpoint: Spark asks for the initial offset
    assert second.initialOffset() == committed_end
    replayed_end, replayed, _ = micro_batch(second, committed_end, ReadMaxRows(10_000))
    assert replayed_end == lost_end  # the same range as planned, whatever the limit now
    assert Counter(map(str, replayed)) == Counter(map(str, lost))
    _, rest = drain(second, replayed_end, LIMIT)
    delivered = committed + replayed + [r for b in rest for r in b]
    assert consolidated(delivered) == snapshot(env)
    assert sum(r["_diff"] for r in delivered) == 300  # no row twice, none lost
    second.stop()
    assert env.shard.consumers()["c"].holder == ""


def test_the_position_moves_only_at_commit_and_a_starting_option_wins_over_it() -> None:
    env = env_with(2)
    reader = env.reader(consumer="c")
    start = reader.initialOffset()
    end = reader.latestOffset(start, LIMIT)
    read_all(reader, reader.partitions(start, end))
    assert position(env) == ""
    reader.commit(end)
    assert position(env) == offset_json(Offset.from_dict(end, env.base["shard"]))
    reader.stop()
    latest = env.reader(consumer="c", startingPosition="latest")
    assert latest.initialOffset()["upper"] == env.shard.upper != end["upper"]
    latest.stop()


def test_the_older_of_two_queries_with_one_consumer_is_fenced_naming_both() -> None:
    env = env_with(1)
    older = env.reader(consumer="c")
    start = older.initialOffset()
    end, _, _ = micro_batch(older, start, LIMIT)
    newer = env.reader(consumer="c")
    assert newer.initialOffset() == end
    env.write(rows(range(100, 200)))
    holders = (older.holder.consumer.holder, newer.holder.consumer.holder)  # type: ignore[union-attr]
    with pytest.raises(ConsumerFenced) as fenced:
        older.latestOffset(end, LIMIT)
    assert all(h in str(fenced.value) for h in holders)
    with pytest.raises(ConsumerFenced):
        older.commit(end)
    older.stop()  # a fenced query stopping does not release its successor's hold
    done, _ = drain(newer, end, LIMIT)
    assert env.shard.consumers()["c"].holder == holders[1]
    assert position(env) == offset_json(Offset.from_dict(done, env.base["shard"]))
    newer.stop()


def test_a_query_gone_without_stop_no_longer_holds_once_its_lease_is_gone() -> None:
    """PySpark ends a stopped query's reader without calling stop(): the consumer counts as
    held only while the query's leased reader lives, so a reset needs no force after."""
    env = env_with(1)
    dead = env.reader(consumer="c")
    end, _, _ = micro_batch(dead, dead.initialOffset(), LIMIT)
    with pytest.raises(ConsumerInUse, match="stop that query first"):
        env.shard.drop_consumer("c")
    readers = tuple(env.shard.state().leased_readers)
    env.shard.machine.run(lambda s: expire_leased_readers(s, reader_ids=readers))
    env.shard.reset_consumer("c", position="", upper=0, since=env.shard.since)
    with pytest.raises(ConsumerFenced, match="held by nobody"):
        dead.commit(end)
    assert position(env) == ""


def test_a_consumer_holds_since_against_retention_until_it_reads_on() -> None:
    env = env_with(1)
    reader = env.reader(consumer="c")
    end, first, _ = micro_batch(reader, reader.initialOffset(), LIMIT)
    reader.stop()  # the query stops: its leased reader goes; the consumer stays
    for k in range(1, 4):
        env.write(rows(range(k * 100, (k + 1) * 100)))
    env.shard.set_retention(1)
    env.shard.gc()  # retention would move since to upper - 1
    held = env.shard.consumers()["c"].since
    assert env.shard.since == held == end["upper"] - 1
    resumed = env.reader(consumer="c")
    assert resumed.initialOffset() == end
    _, rest = drain(resumed, end, LIMIT)  # no DataLoss: nothing it had not read was compacted
    delivered = first + [r for b in rest for r in b]
    assert consolidated(delivered) == snapshot(env)
    resumed.stop()


def test_a_consumer_of_a_dropped_shard_ends_with_shard_dropped() -> None:
    """The shard is dropped and created again: the running query fails with ShardDropped at
    its next call; the new shard has no consumer, so the name starts afresh there."""
    env = env_with(1)
    running = env.reader(consumer="c")
    end, _, _ = micro_batch(running, running.initialOffset(), LIMIT)
    name = env.base["shard"]
    drop_shard(env.client.consensus, env.client.blob, name, now_ms=0, force=True)
    again = env.client.open_shard(name, SCHEMA)
    again.writer().compare_and_append(rows(range(10)), 0, 1)
    with pytest.raises(ShardDropped):
        running.latestOffset(end, LIMIT)
    with pytest.raises(ShardDropped):
        running.commit(end)
    fresh = env.reader(consumer="c")
    assert fresh.initialOffset()["phase"] == "snapshot" and again.consumers()["c"].position == ""
    fresh.stop()


@pytest.mark.parametrize("name", ["to pg", "a/b", "", "x" * 129])
def test_a_bad_consumer_name_is_refused_before_anything_is_written(name: str) -> None:
    env = env_with(1)
    with pytest.raises(InvalidUsage, match="option consumer: invalid consumer name"):
        PersistOptions.parse({**env.base, "consumer": name}, "stream_read")
    assert env.shard.consumers() == {}
