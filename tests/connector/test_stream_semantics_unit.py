"""What Delta and Kafka users expect of the persist source, without Spark (issue 17).

Each rule here is also checked end to end in ``test_stream_semantics_spark.py``;
these make the same calls Spark makes on an in-memory location, in milliseconds.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest
from source_helpers import SCHEMA, Row, rows

from pyspark_persist.options import PersistOptions
from pyspark_persist.schema import read_schema
from pyspark_persist.state import PersistClient, Shard
from pyspark_persist.state.errors import (
    InvalidFrontier,
    InvalidUsage,
    SchemaChanged,
    SchemaMismatch,
)
from pyspark_persist.stream_reader import DataLoss, PersistStreamReader

DAY = 86_400_000
NOV_20 = 1795132800000  # 2026-11-20T00:00:00Z in epoch milliseconds


class Env:
    """A fresh in-memory location with one shard, written at epoch-millisecond times."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex
        self.base = {"blob": f"mem://{tag}", "consensus": f"mem://{tag}", "shard": f"s{tag[:12]}"}
        self.client = PersistClient.open(self.base["blob"], self.base["consensus"])
        self.shard: Shard = self.client.open_shard(self.base["shard"], SCHEMA)
        self.writer = self.shard.writer()

    def write_at(self, table: pa.Table, t: int) -> int:
        """Commit ``table`` at time ``t`` (the upper first jumps to ``t``); returns ``t``."""
        upper = self.shard.upper
        if upper < t:
            self.writer.compare_and_append(SCHEMA.empty_table(), upper, t)
        self.writer.compare_and_append(table, t, t + 1)
        return t

    def options(self, purpose: str, **extra: str) -> PersistOptions:
        """Options for this shard as Spark hands them over (keys lower-cased)."""
        given = {k.lower(): v for k, v in {**self.base, **extra}.items()}
        return PersistOptions.parse(given, purpose)  # type: ignore[arg-type]

    def reader(self, **extra: str) -> PersistStreamReader:
        """A streaming reader as ``format("persist")`` builds it."""
        return PersistStreamReader(self.options("stream_read", **extra), read_schema(SCHEMA))


def consolidated(updates: list[dict[str, Any]]) -> Counter[Row]:
    """Sum diffs per row; drop zeros."""
    c: Counter[Row] = Counter()
    for u in updates:
        c[(u["id"], u["s"])] += u["_diff"]
    return Counter({k: v for k, v in c.items() if v})


def drain(reader: PersistStreamReader, start: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Micro-batches as Spark runs them until nothing is new: each one's rows."""
    import pickle

    batches: list[list[dict[str, Any]]] = []
    for _ in range(100):
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        if end == start:
            return batches
        remote: PersistStreamReader = pickle.loads(pickle.dumps(reader))
        out = [
            r
            for p in reader.partitions(start, end)
            for b in remote.read(pickle.loads(pickle.dumps(p)))
            for r in b.to_pylist()
        ]
        reader.commit(end)
        batches.append(out)
        start = end
    raise AssertionError("the source never stopped producing micro-batches")


# --- item 2: times as text, Delta's names, both frontiers in errors ---------------------------


def test_times_as_text_and_deltas_names_parse_to_epoch_millis() -> None:
    """asOf/timestampAsOf/startingAsOf take ISO-8601 and dates; two names of one setting clash."""
    env = Env()
    assert env.options("read", timestampAsOf="2026-11-20").as_of == NOV_20
    assert env.options("read", asOf="2026-11-20T00:00:01.5Z").as_of == NOV_20 + 1500
    assert env.options("stream_read", startingAsOf="2026-11-21").starting_as_of == NOV_20 + DAY
    with pytest.raises(InvalidUsage, match="options asOf='1' and timestampAsOf='2' set the same"):
        env.options("read", asOf="1", timestampAsOf="2")
    with pytest.raises(InvalidUsage, match="option timestampAsOf='noon' is not a time"):
        env.options("read", timestampAsOf="noon")


def test_starting_as_of_a_date_reads_the_snapshot_then_changes_and_refuses_the_future() -> None:
    """startingAsOf=<day>: the collection as of that instant, then later changes; a time at or
    past upper (or before since) is refused naming both frontiers."""
    env = Env()
    env.write_at(rows(range(0, 50)), NOV_20)
    env.write_at(rows(range(50, 80)), NOV_20 + DAY)
    env.write_at(rows(range(0, 10), diff=-1), NOV_20 + 2 * DAY)
    reader = env.reader(startingAsOf="2026-11-21T12:00:00")
    batches = drain(reader, reader.initialOffset())
    assert consolidated(batches[0]) == consolidated(rows(range(0, 80)).to_pylist())
    assert {r["_time"] for r in batches[0]} == {NOV_20 + DAY + DAY // 2}
    later = [r for b in batches[1:] for r in b]
    assert consolidated(later) == consolidated(rows(range(0, 10), diff=-1).to_pylist())
    reader.stop()
    future = env.reader(startingAsOf="2026-12-01")
    with pytest.raises(
        InvalidFrontier,
        match=r"startingAsOf 1796083200000 \(2026-12-01T00:00:00.000Z\) is at or past the upper "
        rf"{NOV_20 + 2 * DAY + 1} .*\[since, upper\) = \[\d+, {NOV_20 + 2 * DAY + 1}\)",
    ):
        future.initialOffset()
    future.stop()
    with env.shard.reader() as r:
        r.downgrade_since(NOV_20 + DAY)
    past = env.reader(startingAsOf="2026-11-20")
    with pytest.raises(DataLoss, match=r"before the since .*\[since, upper\) = .*failOnDataLoss"):
        past.initialOffset()
    past.stop()


# --- item 9: peers' option names get the persist option, in readable spelling ---------------


@pytest.mark.parametrize(
    ("purpose", "given", "message"),
    [
        (
            "stream_read",
            {"startingoffsets": "earliest"},
            r"option\(s\) startingOffsets not valid for stream read \(startingOffsets is Kafka's "
            r"option: use startingPosition \(earliest/latest\) or startingAsOf",
        ),
        ("stream_read", {"maxoffsetspertrigger": "9"}, "Kafka's option: use maxRowsPerTrigger"),
        ("read", {"versionasof": "3"}, "versionAsOf is Delta's option: persist reads by time"),
        ("stream_read", {"ignorechanges": "true"}, "retractions included"),
        ("stream_read", {"kafka.group.id": "g"}, "kafka.group.id configures a Kafka client"),
        ("stream_read", {"startingoffset": "1"}, r"startingoffset: Kafka's startingOffsets\?"),
        (
            "stream_read",
            {"maxrowpertriger": "1"},
            "maxrowpertriger: did you mean maxRowsPerTrigger",
        ),
        ("read", {"maxrowspertrigger": "1"}, "maxRowsPerTrigger applies to stream reads only"),
    ],
)
def test_peer_option_names_hint_the_persist_option(
    purpose: str, given: dict[str, str], message: str
) -> None:
    """Kafka/Delta names, typos and misplaced options: the message names persist's option."""
    base = {"shard": "s1", "blob": "mem://o", "consensus": "mem://o"}
    with pytest.raises(InvalidUsage, match=message):
        PersistOptions.parse({**base, **given}, purpose)  # type: ignore[arg-type]


def test_unknown_names_are_quoted_as_spark_hands_them_over() -> None:
    """Spark lower-cases keys before a Python source sees them: the message says so, and every
    name persist knows (its own, a peer's) is quoted in its documented spelling."""
    base = {"shard": "s1", "blob": "mem://o", "consensus": "mem://o"}
    with pytest.raises(InvalidUsage, match=r"option\(s\) frobnicate not valid.*lower-cased"):
        PersistOptions.parse({**base, "frobnicate": "1"}, "read")
    with pytest.raises(InvalidUsage) as ei:
        PersistOptions.parse({**base, "versionasof": "1"}, "read")
    assert "lower-cased" not in str(ei.value) and "versionAsOf" in str(ei.value)


# --- item 3: start at a time or SeqNo with changes only ---------------------------------------


def _three_days(env: Env) -> list[int]:
    """Inserts on Nov 20 and 21, a retraction on Nov 22; the SeqNo of each data commit."""
    seqnos = []
    for table, t in (
        (rows(range(0, 50)), NOV_20),
        (rows(range(50, 80)), NOV_20 + DAY),
        (rows(range(0, 10), diff=-1), NOV_20 + 2 * DAY),
    ):
        env.write_at(table, t)
        seqnos.append(env.shard.state().seqno)
    return seqnos


def test_starting_time_or_seqno_streams_changes_only_from_there() -> None:
    """startingTimestamp=<day> / startingVersion=S: no snapshot; exactly the changes at or after
    that time (committed at or after that SeqNo), with their own times, then new ones."""
    env = Env()
    seqnos = _three_days(env)
    want = consolidated(rows(range(50, 80)).to_pylist() + rows(range(10), -1).to_pylist())
    for option in ({"startingTimestamp": "2026-11-21"}, {"startingVersion": str(seqnos[1])}):
        reader = env.reader(**option)
        start = reader.initialOffset()
        got = [r for b in drain(reader, start) for r in b]
        assert consolidated(got) == want, option
        assert {r["_time"] for r in got} == {NOV_20 + DAY, NOV_20 + 2 * DAY}
        reader.stop()
    # Changes from a time between two commits start at the next one; new commits follow.
    reader = env.reader(startingTime=str(NOV_20 + DAY + 1))
    start = reader.initialOffset()
    env.write_at(rows(range(100, 105)), NOV_20 + 3 * DAY)
    got = [r for b in drain(reader, start) for r in b]
    assert consolidated(got) == consolidated(
        rows(range(10), -1).to_pylist() + rows(range(100, 105)).to_pylist()
    )
    reader.stop()


def start_of(env: Env, **options: str) -> dict[str, Any]:
    """The initial offset of a reader with ``options``; the reader is stopped either way (so its
    hold on since goes)."""
    reader = env.reader(**options)
    try:
        return reader.initialOffset()
    finally:
        reader.stop()


def test_starting_time_or_seqno_outside_the_kept_past_is_refused() -> None:
    """Past upper, or before since (the changes were merged), or a SeqNo not kept: errors naming
    the frontiers; failOnDataLoss=false starts at since instead."""
    env = Env()
    _three_days(env)
    upper = env.shard.upper
    with pytest.raises(InvalidFrontier, match=rf"past the upper {upper} .*\[since, upper\]"):
        start_of(env, startingTime=str(upper + 1))
    with pytest.raises(InvalidFrontier, match=r"SeqNo 999 .* not written yet.*SeqNos kept are"):
        start_of(env, startingSeqNo="1000")
    head = env.shard.machine.fetch_latest().seqno
    at_upper = env.reader(startingSeqNo=str(head + 1))
    assert drain(at_upper, at_upper.initialOffset()) == []  # from the head: only new changes
    at_upper.stop()
    with env.shard.reader() as r:
        r.downgrade_since(NOV_20 + DAY)
    with pytest.raises(
        DataLoss, match=r"startingTimestamp: time .* before the since .*failOnDataLoss"
    ):
        start_of(env, startingTimestamp="2026-11-21")
    lenient = env.reader(startingTimestamp="2026-11-21", failOnDataLoss="false")
    got = [r for b in drain(lenient, lenient.initialOffset()) for r in b]
    assert consolidated(got) == consolidated(rows(range(10), -1).to_pylist())
    lenient.stop()
    with pytest.raises(InvalidUsage, match="startingAsOf and startingTimestamp contradict"):
        env.reader(startingAsOf="1", startingTimestamp="2")


# --- item 7: the batch change feed ------------------------------------------------------------


def read_changes(env: Env, **options: str) -> list[tuple[int, str, int, int]]:
    """A batch read with ``options`` as Spark runs it (partitions on the driver, read on
    executors after a pickle round trip): sorted (id, s, _time, _diff)."""
    import pickle

    from pyspark_persist.batch_reader import make_batch_reader

    reader = make_batch_reader(env.options("read", **options), read_schema(SCHEMA))
    remote = pickle.loads(pickle.dumps(reader))
    out = [
        (r["id"], r["s"], r["_time"], r["_diff"])
        for p in reader.partitions()
        for b in remote.read(pickle.loads(pickle.dumps(p)))
        for r in b.to_pylist()
    ]
    return sorted(out)


def changes(table: pa.Table, t: int) -> list[tuple[int, str, int, int]]:
    """``table``'s updates as the change feed shows them at time ``t``."""
    return [(r["id"], r["s"], t, r["_diff"]) for r in table.to_pylist()]


def test_change_feed_returns_every_update_in_range_unconsolidated() -> None:
    """readChanges / readChangeFeed with times or SeqNos: each update in [from, to) with its own
    time; an insert and its retraction both show (nothing consolidated away)."""
    env = Env()
    seqnos = _three_days(env)
    nov21 = changes(rows(range(50, 80)), NOV_20 + DAY)
    nov22 = changes(rows(range(0, 10), diff=-1), NOV_20 + 2 * DAY)
    everything = sorted(changes(rows(range(0, 50)), NOV_20) + nov21 + nov22)
    assert read_changes(env, readChanges="true") == everything
    assert read_changes(env, readChangeFeed="true", startingTimestamp="2026-11-21") == sorted(
        nov21 + nov22
    )
    assert read_changes(
        env, readChanges="true", startingTime="2026-11-21", endingTime="2026-11-22"
    ) == sorted(nov21)
    # Delta's endingTimestamp is inclusive: the changes at that instant are in.
    assert read_changes(env, readChangeFeed="true", endingTimestamp=str(NOV_20 + DAY)) == sorted(
        changes(rows(range(0, 50)), NOV_20) + nov21
    )
    # Versions are SeqNos, both ends inclusive as in Delta.
    assert read_changes(
        env, readChangeFeed="true", startingVersion=str(seqnos[1]), endingVersion=str(seqnos[1])
    ) == sorted(nov21)
    assert read_changes(env, readChanges="true", startingSeqNo=str(seqnos[2])) == sorted(nov22)


def test_change_feed_refuses_ranges_before_since_and_bad_combinations() -> None:
    """Below since the changes were merged: an error naming both frontiers; range options
    without readChanges, or with asOf, are refused with the fix."""
    env = Env()
    _three_days(env)
    with env.shard.reader() as r:
        r.downgrade_since(NOV_20 + DAY)
    with pytest.raises(InvalidFrontier, match=r"readChangeFeed: the range .* before the since"):
        read_changes(env, readChangeFeed="true", startingTimestamp="2026-11-21")
    assert read_changes(env, readChangeFeed="true", startingTimestamp=str(NOV_20 + DAY + 1)) == (
        sorted(changes(rows(range(0, 10), diff=-1), NOV_20 + 2 * DAY))
    )
    with pytest.raises(InvalidUsage, match=r"startingTime bound\(s\) a change range: add"):
        env.options("read", startingTime="5")
    with pytest.raises(InvalidUsage, match="asOf and readChanges contradict"):
        env.options("read", readChanges="true", asOf="5")
    with pytest.raises(InvalidUsage, match="endingTimestamp and endingVersion contradict"):
        env.options("read", readChangeFeed="true", endingTimestamp="5", endingVersion="2")


# --- item 5: history as a read --------------------------------------------------------------


def test_history_read_gives_one_row_per_commit_in_the_history_schema() -> None:
    """history=true: the commits (Shard.history) as Arrow rows of exactly HISTORY_SCHEMA;
    data options with it are refused."""
    import pickle

    from pyspark_persist.history_reader import HISTORY_SCHEMA, PersistHistoryReader
    from pyspark_persist.schema import output_arrow_schema

    env = Env()
    _three_days(env)
    reader = PersistHistoryReader(env.options("read", history="true"))
    remote = pickle.loads(pickle.dumps(reader))
    batches = [b for p in reader.partitions() for b in remote.read(pickle.loads(pickle.dumps(p)))]
    assert all(b.schema == output_arrow_schema(HISTORY_SCHEMA) for b in batches)
    got = [r for b in batches for r in b.to_pylist()]
    assert got == [c.to_dict() for c in env.shard.history()]
    data = [(r["operation"], r["lower"], r["rows_added"], r["rows_retracted"]) for r in got]
    assert [d for d in data if d[2] or d[3]] == [
        ("append", NOV_20, 50, 0),
        ("append", NOV_20 + DAY, 30, 0),
        ("append", NOV_20 + 2 * DAY, 0, 10),
    ]
    with pytest.raises(InvalidUsage, match="history reads the shard's commits, so asOf"):
        env.options("read", history="true", asOf="3")


# --- item 8: lag ----------------------------------------------------------------------------


def test_lag_is_reported_with_the_latest_offset_and_per_micro_batch(tmp_path: Any) -> None:
    """reportLatestOffset carries what is left after the planned micro-batch; metricsFile gets
    one line per micro-batch with its figures and the lag, down to nothing when caught up."""
    import json

    env = Env()
    for k in range(3):
        env.write_at(rows(range(k * 100, k * 100 + 100)), NOV_20 + k * DAY)
    path = tmp_path / "source-metrics.jsonl"
    reader = env.reader(startingTime=str(NOV_20), maxRowsPerTrigger="100", metricsFile=str(path))
    start = reader.initialOffset()
    reported = []
    for _ in range(3):
        end = reader.latestOffset(start, reader.getDefaultReadLimit())
        reported.append(reader.reportLatestOffset() or {})
        reader.partitions(start, end)
        reader.commit(end)
        start = end
    reader.stop()
    upper = NOV_20 + 2 * DAY + 1
    assert [r["upper"] for r in reported] == [upper] * 3  # the newest offset, as before
    assert [r["behind"]["rows"] for r in reported] == [200, 100, 0]
    # Empty batches ride along with the data before them: ends at Nov 21 and Nov 22.
    assert [r["behind"]["times"] for r in reported] == [DAY + 1, 1, 0]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["planned_rows"] for line in lines] == [100, 100, 100]
    assert [line["behind"]["rows"] for line in lines] == [200, 100, 0]
    assert all(line["tasks"] >= 1 and line["partitions_ms"] >= 0 for line in lines)
    assert all("latest_offset_ms" in line and line["upper"] == upper for line in lines)


# --- item 1: admission control cuts the snapshot --------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "cost"),
    [
        ("maxRowsPerTrigger", "150", lambda p: p.rows),
        ("maxFilesPerTrigger", "1", lambda p: 1),
        ("maxBytesPerTrigger", "1", lambda p: p.size_bytes),
    ],
)
def test_every_cap_cuts_the_snapshot_and_the_offsets_say_how_far(
    option: str, value: str, cost: Any
) -> None:
    """The first snapshot spreads over micro-batches under maxRows/Files/BytesPerTrigger; the
    offsets in between are snapshot offsets at one as_of with a growing upper; the diffs sum to
    the collection; then the changes follow."""
    import json

    env = Env()
    for k in range(5):
        env.write_at(rows(range(k * 100, k * 100 + 100)), k)
    env.write_at(rows(range(0, 50), diff=-1), 5)
    reader = env.reader(**{option: value})
    limit = reader.getDefaultReadLimit()
    start = reader.initialOffset()
    offsets, batches = [], []
    while True:
        end = reader.latestOffset(start, limit)
        if end == start:
            break
        parts = reader.partitions(start, end)
        costs = [cost(lp.part) for p in parts for lp in p.leased_parts()]  # type: ignore[attr-defined]
        assert sum(costs) <= max(int(value), max(costs, default=0)), (option, costs)
        batches.append(read_all(reader, parts))
        reader.commit(end)
        offsets.append(json.loads(json.dumps(end)))
        start = end
    reader.stop()
    snapshot_offsets = [o for o in offsets if o["phase"] == "snapshot"]
    assert len(snapshot_offsets) >= 2 and {o["as_of"] for o in snapshot_offsets} == {5}
    assert [o["upper"] for o in snapshot_offsets] == sorted({o["upper"] for o in snapshot_offsets})
    assert offsets[-1] == {**offsets[-1], "phase": "listen", "upper": 6}
    emitted = [r for b in batches for r in b]
    assert {r["_time"] for r in emitted} == {5}
    assert consolidated(emitted) == consolidated(rows(range(50, 500)).to_pylist())


def read_all(reader: PersistStreamReader, parts: Any) -> list[dict[str, Any]]:
    """What executors emit for ``parts`` (pickled as Spark ships them)."""
    import pickle

    remote: PersistStreamReader = pickle.loads(pickle.dumps(reader))
    return [
        r for p in parts for b in remote.read(pickle.loads(pickle.dumps(p))) for r in b.to_pylist()
    ]


def test_a_restart_mid_snapshot_replays_the_same_cut_exactly_once() -> None:
    """A new driver resuming from a checkpointed mid-snapshot offset (after compaction within
    since) emits the rest of the snapshot once: no row missing, none twice; compaction merged
    across the cut is data loss, as for a listen."""
    from source_helpers import merge_all

    env = Env()
    for k in range(4):
        env.write_at(rows(range(k * 100, k * 100 + 100)), k)
    first = env.reader(maxFilesPerTrigger="1")
    limit = first.getDefaultReadLimit()
    start = first.initialOffset()
    end = first.latestOffset(start, limit)
    assert end["phase"] == "snapshot" and end["upper"] == 1
    got = read_all(first, first.partitions(start, end))
    first.commit(end)
    second_end = first.latestOffset(end, limit)
    first.partitions(end, second_end)  # planned, then the driver dies before it is committed
    first.holder.holds.close()  # SIGKILL: nothing more reaches state
    resumed = env.reader(maxFilesPerTrigger="1")
    # Spark replays the planned micro-batch with the same offsets, then goes on.
    got += read_all(resumed, resumed.partitions(end, second_end))
    resumed.commit(second_end)
    got += [r for b in drain(resumed, second_end) for r in b]
    resumed.stop()
    assert sorted(r["id"] for r in got) == list(range(400))  # each row exactly once
    # Compaction that merges across a checkpointed cut: the cut cannot be told apart.
    first.stop()
    with env.shard.reader() as r:
        r.downgrade_since(2)
    merge_all(env.shard)
    late = env.reader(maxFilesPerTrigger="1")
    with pytest.raises(DataLoss, match=r"snapshot's times \[1, 2\] were compacted"):
        late.partitions(end, second_end)
    late.stop()


# --- item 6: schema evolution -------------------------------------------------------------------


def test_a_schema_change_stops_the_stream_and_a_restart_reads_on_once_with_nulls() -> None:
    """Both the next cut and the planning of a cut made before the change refuse with
    SchemaChanged; a reader restarted from the committed offset with the new schema gets every
    later row once, older ones null in the new column."""
    env = Env()
    env.writer.append(rows(range(0, 5)))
    reader = env.reader()
    start = reader.initialOffset()
    end = reader.latestOffset(start, reader.getDefaultReadLimit())
    first = [
        r for p in reader.partitions(start, end) for b in reader.read(p) for r in b.to_pylist()
    ]
    assert sorted(r["id"] for r in first) == [0, 1, 2, 3, 4]
    reader.commit(end)
    env.writer.append(rows(range(5, 8)))
    planned = reader.latestOffset(end, reader.getDefaultReadLimit())
    env.writer.append(
        rows(range(8, 10)).append_column("score", pa.array([0.5, 1.5])), merge_schema=True
    )
    for call in (
        lambda: reader.latestOffset(end, reader.getDefaultReadLimit()),
        lambda: reader.partitions(end, planned),
    ):
        with pytest.raises(SchemaChanged, match=r"gained column\(s\) 'score' \(double\).*Restart"):
            call()
    reader.stop()
    env.shard.state()
    restarted = PersistStreamReader(env.options("stream_read"), read_schema(env.shard.schema))
    after = [r for b in drain(restarted, end) for r in b]
    restarted.stop()
    assert sorted((r["id"], r["score"], r["_diff"]) for r in after) == [
        (5, None, 1),
        (6, None, 1),
        (7, None, 1),
        (8, 0.5, 1),
        (9, 1.5, 1),
    ]


def test_batch_and_change_feed_reads_give_old_rows_null_in_new_columns() -> None:
    """Snapshot (plain and consolidating, after an overwrite) and readChanges reads planned after
    a mergeSchema write have its column, null for the rows written before."""
    import pickle

    from pyspark_persist.batch_reader import make_batch_reader

    env = Env()
    env.writer.append(rows(range(0, 3)))
    env.writer.append(rows(range(3, 4)).append_column("tag", pa.array(["t"])), merge_schema=True)
    env.shard.state()
    schema = read_schema(env.shard.schema)

    def read(**options: str) -> list[tuple[int, str | None, int]]:
        reader = make_batch_reader(env.options("read", **options), schema)
        remote = pickle.loads(pickle.dumps(reader))
        return sorted(
            (r["id"], r["tag"], r["_diff"])
            for p in reader.partitions()
            for b in remote.read(pickle.loads(pickle.dumps(p)))
            for r in b.to_pylist()
        )

    expected = [(0, None, 1), (1, None, 1), (2, None, 1), (3, "t", 1)]
    assert read() == expected
    assert read(readChanges="true") == expected
    with pytest.raises(SchemaMismatch, match=r"missing column 'tag'.*merge_schema=True"):
        env.writer.append(rows(range(0, 1), diff=-1))
    # A retraction (one consolidating task) cancels row 0 across the two schemas.
    env.writer.append(rows(range(0, 1), diff=-1), merge_schema=True)
    assert read() == expected[1:]
