"""Replaying a shard's past from the diffs Consensus keeps (no Spark)."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.config import PersistConfig
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import InvalidFrontier
from pyspark_persist.state.history import replay, state_at
from pyspark_persist.state.versions import write_rollup

SCHEMA = pa.schema([("id", pa.int64())])


def test_replay_matches_the_live_state_and_names_each_seqno() -> None:
    """Every kept SeqNo's state is the one the writer made; truncated ones are refused."""
    tag = uuid.uuid4().hex
    client = PersistClient.open(f"mem://{tag}", f"mem://{tag}")
    shard = client.open_shard("h", SCHEMA)
    writer = shard.writer()
    uppers = {}
    for k in range(4):
        result = writer.compare_and_append(pa.table({"id": [k]}), k * 10, k * 10 + 10)
        uppers[result.seqno] = k * 10 + 10  # type: ignore[union-attr]
    machine = shard.machine
    past = replay("h", machine.consensus, machine.blob)
    assert past.head == machine.fetch_latest()
    assert past.base.seqno == 0 and state_at(past, 0, "x").upper == 0
    for seqno, upper in uppers.items():
        assert state_at(past, seqno, "x").upper == upper
        assert state_at(past, seqno - 1, "x").upper == upper - 10
    with pytest.raises(InvalidFrontier, match=r"x: SeqNo 99 .* not written yet.*kept are \[0, "):
        state_at(past, 99, "x")
    # GC's truncation: the rollup at the new oldest SeqNo becomes the base.
    oldest = max(uppers)
    write_rollup(machine.blob, state_at(past, oldest, "x"))
    machine.consensus.truncate("h", oldest)
    cut = replay("h", machine.consensus, machine.blob)
    assert cut.base == state_at(past, oldest, "x") and cut.head == past.head
    with pytest.raises(InvalidFrontier, match=rf"older than the oldest SeqNo kept, {oldest}"):
        state_at(cut, oldest - 1, "x")


def test_history_lists_each_commit_with_its_operation_writer_and_sizes() -> None:
    """create, appends (inserts, retractions), an overwrite, a compaction: one entry each, with
    writer, commit time and rows; reader bookkeeping SeqNos are not commits."""
    from pyspark_persist.state.maintenance import compact

    tag = uuid.uuid4().hex
    now = [1_795_392_000_000]
    client = PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=PersistConfig(maintenance=False),
        clock_ms=lambda: now[0],
    )
    shard = client.open_shard("h", SCHEMA)
    w = shard.writer("w1")
    w.compare_and_append(pa.table({"id": list(range(100))}), 0, 1, token=1)
    now[0] += 1000
    with shard.reader():  # registering and expiring a reader: SeqNos, not commits
        pass
    w.compare_and_append(pa.table({"id": [1, 2], "_diff": [-1, -1]}), 1, 2, token=2)
    w2 = shard.writer("w2")
    builder = w2.builder()
    builder.add(pa.table({"id": [7, 8, 9]}))
    w2.compare_and_append_batches([builder.finish()], 2, 3, token=1, ts_rewrite=2, replace=True)
    compact(shard.machine, shard.state().trace)
    got = shard.history()
    assert [c.operation for c in got] == ["create", "append", "append", "overwrite", "compaction"]
    create, insert, retract, overwrite, merge = got
    assert create.seqno == 1
    assert (insert.writer_id, insert.committed_ms, insert.lower, insert.upper) == (
        "w1",
        1_795_392_000_000,
        0,
        1,
    )
    assert (insert.rows_added, insert.rows_retracted, insert.parts) == (100, 0, 1)
    assert insert.bytes_added > 0
    assert (retract.rows_added, retract.rows_retracted, retract.committed_ms) == (
        0,
        2,
        1_795_392_001_000,
    )
    # The overwrite retracts the 100 inserts and re-inserts the 2 retracted rows (negated).
    assert (overwrite.writer_id, overwrite.rows_added, overwrite.rows_retracted) == ("w2", 5, 100)
    assert (merge.writer_id, merge.lower, merge.upper, merge.rows_before) == (None, 0, 3, 207)
    assert merge.rows_after <= merge.rows_before and merge.seqno > overwrite.seqno
    assert [c.seqno for c in got] == sorted(c.seqno for c in got)


def test_a_shards_replay_is_the_past_consensus_keeps() -> None:
    """Shard.replay (what the Spark readers resolve startingSeqNo and endingSeqNo against) is
    the kept history: its head is the shard's state, and each SeqNo's state is in it."""
    tag = uuid.uuid4().hex
    shard = PersistClient.open(f"mem://{tag}", f"mem://{tag}").open_shard("r", SCHEMA)
    result = shard.writer().compare_and_append(pa.table({"id": [1]}), 0, 5)
    past = shard.replay()
    assert past.head == shard.state()
    seqno = result.seqno  # type: ignore[union-attr]
    assert state_at(past, seqno, "x").upper == 5 and state_at(past, seqno - 1, "x").upper == 0
