"""Replaying a shard's past from the diffs Consensus keeps (no Spark)."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient
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
