"""Issue 13's lower-severity cases: a lost reply is not "fenced", idle writers expire.

(The third, a replace over several times never showing old and new rows
together, is in test_replace_state_size.py.)
"""

from __future__ import annotations

import time
import uuid

import pyarrow as pa

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus

SCHEMA = pa.schema([("k", pa.int64())])
DAY_MS = 86_400_000


def test_critical_downgrade_whose_reply_was_lost_is_not_reported_fenced() -> None:
    """The downgrade lands, its reply is lost, the retry finds the new token: that is ok."""
    tag = uuid.uuid4().hex
    consensus = UnreliableConsensus(
        open_consensus(f"mem://{tag}"),
        Faults(seed=0, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set"})),
        enabled=False,
    )
    client = PersistClient(
        open_blob(f"mem://{tag}"),
        consensus,
        config=PersistConfig(maintenance=False),
        cache=StateCache(),
    )
    try:
        shard = client.open_shard("critical", SCHEMA)
        shard.writer().compare_and_append(pa.table({"k": [1]}), 0, 10)
        holder = shard.critical_reader("controller", opaque=1)
        consensus.enabled = True
        result = holder.compare_and_downgrade_since(1, 2, 5)
        assert consensus.injected["fail_after"] == 1
        assert result.ok, f"a lost reply was reported as fenced: {result}"
        assert (result.current.opaque, result.current.since) == (2, 5)
        assert shard.state().critical_readers["controller"].opaque == 2
        # A handle with a really stale token is still fenced.
        assert not holder.compare_and_downgrade_since(1, 3, 6).ok
    finally:
        client.close()


def test_writers_idle_past_the_expiry_are_forgotten_by_gc() -> None:
    """The writers map stays small: GC drops whole entries of writers idle past the period."""
    tag = uuid.uuid4().hex
    clock = [time.time_ns() // 1_000_000]
    client = PersistClient(
        open_blob(f"mem://{tag}"),
        open_consensus(f"mem://{tag}"),
        config=PersistConfig(maintenance=False, writer_idle_expiry_s=7 * 86400.0),
        cache=StateCache(),
        clock_ms=lambda: clock[0],
    )
    try:
        shard = client.open_shard("writers", SCHEMA)
        for i in range(20):
            shard.writer(f"old-{i}").compare_and_append(pa.table({"k": [i]}), i, i + 1, token=1)
        clock[0] += 6 * DAY_MS
        shard.writer("recent").compare_and_append(pa.table({"k": [99]}), 20, 21, token=1)
        assert shard.gc().writers_expired == ()
        clock[0] += 2 * DAY_MS  # the old writers are 8 days idle, the recent one 2
        report = shard.gc()
        assert report.writers_expired == tuple(sorted(f"old-{i}" for i in range(20)))
        assert set(shard.state().writers) == {"recent"}
        # A forgotten writer id registers afresh with its next commit.
        shard.writer("old-3").compare_and_append(pa.table({"k": [7]}), 21, 22, token=2)
        assert set(shard.state().writers) == {"recent", "old-3"}
        rows = shard.reader().snapshot_table()
        got = dict(zip(rows.column("k").to_pylist(), rows.column("_diff").to_pylist(), strict=True))
        assert got == {**dict.fromkeys(range(20), 1), 7: 2, 99: 1}
    finally:
        client.close()
