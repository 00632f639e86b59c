"""The stream writer's exactly-once logic through its Python objects, without Spark.

Spark builds a new ``PersistStreamWriter`` for every micro-batch commit and
calls ``write`` on executors and ``commit``/``abort`` on the driver; these
tests make the same calls directly, so replays, new queries, abort and the
times the sink assigns are checked in milliseconds.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import LongType, StringType, StructField, StructType

from pyspark_persist import writer as sink
from pyspark_persist.options import PersistOptions
from pyspark_persist.state import AlreadyCommitted, Committed, PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import (
    CaSResult,
    Consensus,
    SeqNo,
    VersionedData,
    open_consensus,
)
from pyspark_persist.state.errors import Indeterminate, InvalidUsage
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus
from pyspark_persist.writer import (
    METRICS_FILE,
    PersistBatchWriter,
    PersistCommitMessage,
    PersistStreamWriter,
    _in_target,
    query_writer_id,
    read_sink_metrics,
)

SCHEMA = StructType([StructField("id", LongType()), StructField("name", StringType())])
METRIC_KEYS = {
    "batch_id",
    "outcome",
    "rows",
    "size_bytes",
    "parts",
    "queued_s",
    "upload_s",
    "commit_s",
    "upper",
    "batch_rows",
}


def _checkpoint(root: Path, query_id: str) -> Path:
    """A checkpoint directory as Spark leaves it: ``metadata`` holds the query id."""
    root.mkdir(parents=True)
    (root / "metadata").write_text(json.dumps({"id": query_id}) + "\n")
    return root


def _writer(shard: str, checkpoint: Path, overwrite: bool = False) -> PersistStreamWriter:
    """What Spark's ``streamWriter(schema, overwrite)`` returns for one micro-batch."""
    opts = PersistOptions.parse(
        {"path": shard, "checkpointLocation": str(checkpoint)}, "stream_write"
    )
    return PersistStreamWriter(opts, SCHEMA, overwrite)


def _stage(writer: PersistStreamWriter, ids: range, pad: int = 0) -> PersistCommitMessage:
    """One task's ``write()``: Arrow batches in, a commit message out; ``pad`` characters
    added to each name (to stage past inline_write_max_bytes, in Blob)."""
    rb = pa.RecordBatch.from_pydict(
        {"id": pa.array(list(ids), pa.int64()), "name": [f"n{i}" + "x" * pad for i in ids]}
    )
    return writer.write(iter([rb]))


def _ids(shard: str) -> list[int]:
    table = PersistClient.open().open_shard(shard, create=False).reader().snapshot_table()
    assert set(table.column("_diff").to_pylist()) <= {1}
    return sorted(table.column("id").to_pylist())


def test_replayed_batch_is_already_committed_and_applied_once(tmp_path: Path) -> None:
    """A micro-batch committed twice (crash after commit, Spark replays it) lands once.

    Protects: token = batchId under the checkpoint's query id, and the metrics
    file (one line per commit, every figure present, the replay marked).
    """
    shard = f"replay-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    first = _writer(shard, ckpt)
    first.commit([_stage(first, range(0, 10)), _stage(first, range(10, 20))], 0)
    # Spark's replay after a crash: a new writer object, the same rows staged anew.
    replay = _writer(shard, ckpt)
    replay.commit([_stage(replay, range(0, 10)), _stage(replay, range(10, 20))], 0)
    nxt = _writer(shard, ckpt)
    nxt.commit([_stage(nxt, range(20, 25)), None], 1)

    assert _ids(shard) == list(range(25))
    metrics = read_sink_metrics(str(ckpt))
    assert [(m["batch_id"], m["outcome"]) for m in metrics] == [
        (0, "committed"),
        (0, "already committed"),
        (1, "committed"),
    ]
    assert all(METRIC_KEYS <= m.keys() for m in metrics)
    assert [(m["rows"], m["parts"], m["tasks"]) for m in metrics] == [(20, 2, 2)] * 2 + [(5, 1, 1)]
    assert [m["batch_rows"] for m in metrics] == [10, 10, 5]  # each task's one batch
    assert all(m["size_bytes"] > 0 and m["commit_s"] >= 0 for m in metrics)
    assert metrics[0]["upper"] == metrics[1]["upper"] < metrics[2]["upper"]
    lines = (ckpt / METRICS_FILE).read_text().splitlines()
    assert len(lines) == 3


def test_sink_stages_inserts_as_rows_only_and_a_diff_column_as_arrow(tmp_path: Path) -> None:
    """A micro-batch of plain rows stages arrow-rows parts (the commit's time and diff +1 are
    in the part's reference, not on disk) and reads back with its commit time; a DataFrame
    carrying its own _diff stages full Arrow parts, retractions included."""
    shard = f"rowsonly-{uuid.uuid4().hex[:8]}"
    w = _writer(shard, _checkpoint(tmp_path / "ckpt", str(uuid.uuid4())))
    w.commit([_stage(w, range(0, 10), pad=3000)], 0)  # past the inline limit: in Blob
    state = PersistClient.open().open_shard(shard, create=False).state()
    (part,) = [p for b in state.trace for p in b.parts]
    assert part.fmt == "arrow-rows" and part.ts_rewrite is not None
    assert _ids(shard) == list(range(10))

    with_diff = StructType([*SCHEMA.fields, StructField("_diff", LongType())])
    opts = PersistOptions.parse({"path": shard, "writerId": "diffs"}, "write")
    batch = PersistBatchWriter(opts, with_diff, False)
    rb = pa.RecordBatch.from_pydict(
        {
            "id": pa.array([3, 4], pa.int64()),
            "name": [f"n{i}" + "x" * 3000 for i in (3, 4)],
            "_diff": [-1, -1],
        }
    )
    batch.commit([batch.write(iter([rb]))])
    state = PersistClient.open().open_shard(shard, create=False).state()
    assert {p.fmt for b in state.trace for p in b.parts} == {"arrow-rows", "arrow"}
    table = PersistClient.open().open_shard(shard, create=False).reader().snapshot_table()
    assert sorted(table.column("id").to_pylist()) == [0, 1, 2, 5, 6, 7, 8, 9]


def test_new_checkpoint_is_a_new_writer_and_its_batch_0_is_written(tmp_path: Path) -> None:
    """A second query (other checkpoint) on the same shard is not mistaken for a replay."""
    shard = f"twoq-{uuid.uuid4().hex[:8]}"
    a = _writer(shard, _checkpoint(tmp_path / "a", str(uuid.uuid4())))
    a.commit([_stage(a, range(0, 5))], 0)
    ckpt_b = _checkpoint(tmp_path / "b", str(uuid.uuid4()))
    b = _writer(shard, ckpt_b)
    b.commit([_stage(b, range(100, 105))], 0)

    assert _ids(shard) == [*range(5), *range(100, 105)]
    assert [m["outcome"] for m in read_sink_metrics(str(ckpt_b))] == ["committed"]
    writers = PersistClient.open().open_shard(shard, create=False).state().writers
    assert len(writers) == 2


def test_abort_deletes_staged_parts(tmp_path: Path) -> None:
    """``abort`` removes what the tasks staged, and nothing becomes visible."""
    shard = f"abort-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    w = _writer(shard, ckpt)
    w.commit([_stage(w, range(3))], 0)
    client = PersistClient.open()
    before = {m.key for m in client.blob.list_keys(f"{shard}/part/")}
    w2 = _writer(shard, ckpt)
    msgs = [_stage(w2, range(10, 20), pad=500), _stage(w2, range(20, 30), pad=500)]
    assert len({m.key for m in client.blob.list_keys(f"{shard}/part/")} - before) == 2
    w2.abort(msgs, 1)
    assert {m.key for m in client.blob.list_keys(f"{shard}/part/")} == before
    assert _ids(shard) == [0, 1, 2]


def test_a_tiny_task_stages_no_part_and_its_rows_commit_inline_exactly_once(
    tmp_path: Path,
) -> None:
    """A task with a few rows writes nothing to Blob: its rows ride in its commit message and
    the commit puts them in state; a replay of that micro-batch still applies nothing."""
    shard = f"inline-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    w = _writer(shard, ckpt)
    client = PersistClient.open()
    msg = _stage(w, range(3))
    assert msg.rows == 3 and msg.parts == 1
    assert list(client.blob.list_keys(f"{shard}/part/")) == []
    w.commit([msg], 0)
    _writer(shard, ckpt).commit([msg], 0)  # Spark replays the micro-batch after a crash
    assert _ids(shard) == [0, 1, 2]
    assert [m["outcome"] for m in read_sink_metrics(str(ckpt))] == [
        "committed",
        "already committed",
    ]
    state = client.open_shard(shard, create=False).state()
    assert all(p.key is None for b in state.trace for p in b.parts)
    assert list(client.blob.list_keys(f"{shard}/part/")) == []


def test_commit_times_at_or_after_upper_and_wall_clock(tmp_path: Path) -> None:
    """The time a micro-batch gets is >= the shard's upper and never behind wall-clock ms.

    Protects: reads ``asOf`` a wall-clock time see what was committed before
    it, and a shard whose upper runs ahead of the clock still accepts commits.
    """
    shard = f"times-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    w = _writer(shard, ckpt)
    msg = _stage(w, range(4))
    before_ms = time.time_ns() // 1_000_000
    w.commit([msg], 0)
    after_ms = time.time_ns() // 1_000_000
    handle = PersistClient.open().open_shard(shard, create=False)
    t0 = set(handle.reader().snapshot_table().column("_time").to_pylist())
    assert len(t0) == 1
    (t,) = t0
    assert before_ms <= t <= after_ms
    assert handle.upper == t + 1

    # Another writer moves the upper an hour ahead of the clock: the next batch goes after it.
    ahead = after_ms + 3_600_000
    other = handle.writer()
    res = other.compare_and_append(
        pa.table({"id": pa.array([999], pa.int64()), "name": ["x"]}), handle.upper, ahead
    )
    assert isinstance(res, Committed | AlreadyCommitted)
    w2 = _writer(shard, ckpt)
    w2.commit([_stage(w2, range(10, 12))], 1)
    table = handle.reader().snapshot_table()
    times = {r["id"]: r["_time"] for r in table.select(["id", "_time"]).to_pylist()}
    assert times[10] == times[11] == ahead
    assert handle.upper == ahead + 1


def _batch_write(shard: str, ids: range, **options: str) -> None:
    """What Spark does for one ``df.write.format("persist").options(**options).save(shard)``."""
    opts = PersistOptions.parse({"path": shard, **options}, "write")
    writer = PersistBatchWriter(opts, SCHEMA, False)
    rb = pa.RecordBatch.from_pydict(
        {"id": pa.array(list(ids), pa.int64()), "name": [f"n{i}" for i in ids]}
    )
    writer.commit([writer.write(iter([rb]))])


def test_batch_txn_version_writes_each_version_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Delta's model: the same writerId and txnVersion again is skipped (and logged); a higher
    version is written; a lower one is skipped; txnAppId is Delta's name for writerId.

    Protects issue 13 item 4: a re-run of one logical write applies once.
    """
    shard = f"txn-{uuid.uuid4().hex[:8]}"
    client = PersistClient.open()
    _batch_write(shard, range(0, 3), writerId="app", txnVersion="1")
    with caplog.at_level(logging.INFO, logger="pyspark_persist.writer"):
        _batch_write(shard, range(0, 3), writerId="app", txnVersion="1")
    assert _ids(shard) == [0, 1, 2]
    skipped = [r for r in caplog.records if "persist batch write skipped" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].levelno == logging.INFO
    record = json.loads(skipped[0].getMessage().split(": ", 1)[1])
    assert record["writer_id"] == "app" and record["txn_version"] == 1
    assert record["committed_version"] == 1

    _batch_write(shard, range(10, 12), txnAppId="app", txnVersion="2")
    assert _ids(shard) == [0, 1, 2, 10, 11]
    _batch_write(shard, range(20, 22), writerId="app", txnVersion="0")
    assert _ids(shard) == [0, 1, 2, 10, 11]
    state = client.open_shard(shard, create=False).machine.fetch_latest()
    assert state.writers["app"].last_token == 2


def test_batch_writer_id_without_version_always_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unversioned writes with one writerId all land, even when the clock stands still.

    Protects issue 13 item 4: tokens used to be the wall clock's ms, so two
    writes in one millisecond (simulated by freezing the clock) dropped the
    second as "already committed".
    """
    import pyspark_persist.writer as writer_module

    frozen = time.time_ns()
    monkeypatch.setattr(writer_module.time, "time_ns", lambda: frozen)
    shard = f"untxn-{uuid.uuid4().hex[:8]}"
    _batch_write(shard, range(0, 2), writerId="app")
    _batch_write(shard, range(2, 4), writerId="app")
    _batch_write(shard, range(4, 6))
    assert _ids(shard) == list(range(6))
    # A versioned write of the same writerId is not confused with the unversioned ones.
    _batch_write(shard, range(6, 8), writerId="app", txnVersion="1")
    assert _ids(shard) == list(range(8))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"writerId": "app", "txnVersion": "one"}, "txnVersion='one' must be a whole number"),
        ({"writerId": "app", "txnVersion": "-1"}, "txnVersion='-1' must be at least 0"),
        ({"txnVersion": "3"}, 'txnVersion needs a writer to version: set .option("writerId"'),
        ({"writerId": "app", "txnVersoin": "3"}, "did you mean txnVersion?"),
        ({"txnAppId": "a", "writerId": "b", "txnVersion": "1"}, "set the same thing"),
    ],
)
def test_batch_txn_options_bad_input_fails_before_writing(
    options: dict[str, str], message: str
) -> None:
    """Bad txnVersion input fails while parsing options: no shard is created, nothing written."""
    shard = f"badtxn-{uuid.uuid4().hex[:8]}"
    with pytest.raises(InvalidUsage) as info:
        _batch_write(shard, range(3), **options)
    assert message in str(info.value)
    assert PersistClient.open().consensus.head(shard) is None


def test_txn_version_is_refused_on_stream_writes(tmp_path: Path) -> None:
    """A stream's token is its batchId: txnVersion there is an error saying where it applies."""
    with pytest.raises(InvalidUsage, match="txnVersion applies to batch writes only"):
        PersistOptions.parse(
            {"path": "s", "checkpointLocation": str(tmp_path), "writerId": "a", "txnVersion": "1"},
            "stream_write",
        )


def test_recreated_remote_checkpoint_is_a_new_writer(
    moto_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint on S3 (Hadoop's ``s3a://``) deleted and recreated under the same path is a
    new query: its first batches land. Protects issue 13 item 5: the writer id of a remote
    checkpoint was a hash of its path, so the new query's batch 0 was dropped as a replay."""
    import boto3

    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server)
    s3 = boto3.session.Session().client("s3", endpoint_url=moto_server)
    prefix = f"ckpt-{uuid.uuid4().hex[:8]}"
    ckpt = f"s3a://persist-test/{prefix}"

    def new_checkpoint() -> None:
        # What Spark leaves when a query starts on an empty checkpoint path.
        meta = json.dumps({"id": str(uuid.uuid4())}) + "\n"
        s3.put_object(Bucket="persist-test", Key=f"{prefix}/metadata", Body=meta.encode())

    def commit(ids: range, batch_id: int) -> None:
        opts = PersistOptions.parse({"path": shard, "checkpointLocation": ckpt}, "stream_write")
        w = PersistStreamWriter(opts, SCHEMA, False)
        w.commit([_stage(w, ids)], batch_id)

    shard = f"remote-{uuid.uuid4().hex[:8]}"
    new_checkpoint()
    commit(range(0, 3), 0)
    commit(range(0, 3), 0)  # a replay of batch 0 after a crash: applied once
    commit(range(3, 5), 1)
    s3.delete_object(Bucket="persist-test", Key=f"{prefix}/metadata")
    new_checkpoint()
    commit(range(10, 12), 0)
    commit(range(12, 14), 1)
    assert _ids(shard) == [0, 1, 2, 3, 4, 10, 11, 12, 13]
    record = s3.get_object(Bucket="persist-test", Key=f"{prefix}/{sink.SHARD_RECORD}")
    assert json.loads(record["Body"].read())["shard"] == shard  # the incarnation it writes


def test_unreadable_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    """No metadata to read: an error naming the file and the fix, not a guessed identity."""
    opts = PersistOptions.parse(
        {"path": "s", "checkpointLocation": "nosuchfs://bucket/ckpt"}, "stream_write"
    )
    with pytest.raises(InvalidUsage, match=r"nosuchfs://bucket/ckpt/metadata.*writerId"):
        PersistStreamWriter(opts, SCHEMA, False)


def test_merge_schema_stream_write_evolves_once_and_replays_apply_once(tmp_path: Path) -> None:
    """mergeSchema on a stream: the first commit adds the column, a replayed micro-batch (a new
    writer object, as after a crash) applies neither rows nor schema again, and a shard column
    the DataFrame lacks is written null."""
    shard = f"merge-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    plain = _writer(shard, ckpt)
    plain.commit([_stage(plain, range(0, 3))], 0)
    opts = PersistOptions.parse(
        {"path": shard, "checkpointLocation": str(ckpt), "mergeSchema": "true"}, "stream_write"
    )

    def stage(writer: PersistStreamWriter, ids: range) -> PersistCommitMessage:
        rb = pa.RecordBatch.from_pydict({"id": pa.array(list(ids)), "score": pa.array(list(ids))})
        return writer.write(iter([rb]))

    narrow = StructType([SCHEMA.fields[0], StructField("score", LongType())])
    for _ in range(2):  # the second pass is Spark's replay of micro-batch 1
        merging = PersistStreamWriter(opts, narrow, False)
        merging.commit([stage(merging, range(3, 5))], 1)
    shard_ = PersistClient.open().open_shard(shard)
    assert shard_.schema.names == ["id", "name", "score"]
    table = shard_.reader().snapshot_table()
    got = sorted(
        zip(*(table.column(n).to_pylist() for n in ("id", "name", "score", "_diff")), strict=True)
    )
    assert got == [
        (0, "n0", None, 1),
        (1, "n1", None, 1),
        (2, "n2", None, 1),
        (3, None, 3, 1),
        (4, None, 4, 1),
    ]
    no_merge = PersistOptions.parse(
        {"path": shard, "checkpointLocation": str(ckpt)}, "stream_write"
    )
    extra = StructType([*SCHEMA.fields, StructField("extra", LongType())])
    with pytest.raises(InvalidUsage, match=r"'extra' \(int64\).*mergeSchema"):
        PersistStreamWriter(no_merge, extra, False)


def test_a_null_in_a_non_nullable_shard_column_is_named(tmp_path: Path) -> None:
    """A Python-created shard may declare a column non-nullable: the sink's task names it."""
    shard = f"nonnull-{uuid.uuid4().hex[:8]}"
    schema = pa.schema([pa.field("id", pa.int64(), False), ("name", pa.string())])
    PersistClient.open().open_shard(shard, schema)
    writer = _writer(shard, _checkpoint(tmp_path / "ckpt", str(uuid.uuid4())))
    rb = pa.RecordBatch.from_pydict({"id": pa.array([1, None], pa.int64()), "name": ["a", "b"]})
    with pytest.raises(InvalidUsage, match=r"column 'id' .* non-nullable"):
        writer.write(iter([rb]))


def test_with_pubsub_a_micro_batch_commit_is_one_consensus_round_trip(tmp_path: Path) -> None:
    """While PubSub delivers the shard, a micro-batch's commit is one compare-and-set.

    Spark builds the stream writer twice per micro-batch (to plan the tasks and to
    commit): each build checks the schema against Consensus (one read: a drop is
    no PubSub diff, see the test below), and the commit reads nothing more.
    Protects: the commit's expected upper comes from the PubSub-confirmed state.
    """
    from pyspark_persist.source import client_for

    checkpoint = _checkpoint(tmp_path / "cp", f"q-{uuid.uuid4().hex}")
    raw = {
        "path": f"pushed_{uuid.uuid4().hex[:8]}",
        "blob": f"file://{tmp_path}/blob",
        "consensus": f"sqlite:///{tmp_path}/consensus.db",
        "pubsub": "auto",
        "checkpointLocation": str(checkpoint),
    }
    opts = PersistOptions.parse(raw, "stream_write")
    first = PersistStreamWriter(opts, SCHEMA, False)
    first.commit([_stage(first, range(10))], 0)  # creates the shard
    client = client_for(opts)
    shared = client.machine(opts.shard).shared
    deadline = time.monotonic() + 30
    while not shared.push_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shared.push_healthy, "the PubSub subscription never came up"
    before = client.metrics.snapshot()
    for batch in (1, 2, 3):
        staged = _stage(
            PersistStreamWriter(opts, SCHEMA, False), range(batch * 10, batch * 10 + 10)
        )
        PersistStreamWriter(opts, SCHEMA, False).commit([staged], batch)
    after = client.metrics.snapshot()
    assert after["consensus_fetches"] - before["consensus_fetches"] == 3 * 2  # the builds'
    assert after["cas_attempts"] - before["cas_attempts"] == 3
    assert after["commits"] - before["commits"] == 3
    shard = client.open_shard(opts.shard, create=False)
    table = shard.reader().snapshot_table()
    assert sorted(table.column("id").to_pylist()) == list(range(40))


@pytest.mark.parametrize("new_schema", [False, True], ids=["same-schema", "other-schema"])
def test_with_pubsub_a_new_query_after_a_drop_creates_the_shard_again(
    tmp_path: Path, new_schema: bool
) -> None:
    """A shard dropped by another process, then written by a new query of this session.

    The session's workers hold the old shard's state, confirmed by PubSub, but a
    drop is no PubSub diff: the sink must not check the new query's schema
    against, or commit onto, the dropped shard. Protects: the first micro-batch
    creates the shard again (with the new query's schema), as on a fresh machine.
    """
    from pyspark_persist.source import client_for
    from pyspark_persist.state.drop import drop_shard

    raw = {
        "path": f"dropped_{uuid.uuid4().hex[:8]}",
        "blob": f"file://{tmp_path}/blob",
        "consensus": f"sqlite:///{tmp_path}/consensus.db",
        "pubsub": "auto",
    }
    first_opts = PersistOptions.parse(
        {**raw, "checkpointLocation": str(_checkpoint(tmp_path / "cp1", "q1"))}, "stream_write"
    )
    first = PersistStreamWriter(first_opts, SCHEMA, False)
    first.commit([_stage(first, range(10))], 0)
    shared = client_for(first_opts).machine(first_opts.shard).shared
    deadline = time.monotonic() + 30
    while not shared.push_healthy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert shared.push_healthy, "the PubSub subscription never came up"

    other = PersistClient.open(raw["blob"], raw["consensus"])  # another process's client
    drop_shard(other.consensus, other.blob, first_opts.shard, now_ms=int(time.time() * 1000))

    schema = (
        StructType([StructField("key", StringType()), StructField("n", LongType())])
        if new_schema
        else SCHEMA
    )
    opts = PersistOptions.parse(
        {**raw, "checkpointLocation": str(_checkpoint(tmp_path / "cp2", "q2"))}, "stream_write"
    )
    writer = PersistStreamWriter(opts, schema, False)
    names = [f.name for f in schema.fields]
    rb = pa.RecordBatch.from_pydict(
        {
            names[0]: pa.array([1, 2], pa.int64()) if not new_schema else ["a", "b"],
            names[1]: ["x", "y"] if not new_schema else pa.array([1, 2], pa.int64()),
        }
    )
    PersistStreamWriter(opts, schema, False).commit([writer.write(iter([rb]))], 0)

    shard = other.open_shard(opts.shard, create=False)
    assert shard.schema.names == names
    table = shard.reader().snapshot_table()
    assert sorted(table.column(names[0]).to_pylist()) == (["a", "b"] if new_schema else [1, 2])


def test_spark_batches_take_the_staging_schema_without_a_copy_or_are_cast() -> None:
    """A batch whose types are the target's (Spark marks spark.range's id non-nullable, the
    target has it nullable) gets the target schema over its own buffers; other types are
    cast, and a column the DataFrame lacks reads null."""
    target = pa.schema([("id", pa.int64()), ("s", pa.string()), ("extra", pa.float64())])
    spark_schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("s", pa.string())])
    same_types = pa.table({"id": [1, 2], "s": ["a", None]}, spark_schema)
    got = _in_target(same_types, target)
    assert got.schema.equals(target) and got.to_pylist()[1] == {"id": 2, "s": None, "extra": None}
    before, after = same_types.column("id").chunk(0), got.column("id").chunk(0)
    assert after.buffers()[1].address == before.buffers()[1].address  # no copy
    narrower = pa.table({"id": pa.array([7], pa.int32()), "s": ["b"]})
    cast = _in_target(narrower, target)
    assert cast.schema.equals(target) and cast.to_pylist() == [{"id": 7, "s": "b", "extra": None}]


class HeldConsensus(UnreliableConsensus):
    """Holds the next compare-and-set in flight: the caller hears Indeterminate at once, and the
    attempt reaches the store only when :meth:`land` is called (a slow store, a late retry)."""

    def __init__(self, inner: Consensus) -> None:
        super().__init__(inner, Faults(seed=0), enabled=False)
        self.armed = False
        self.held: tuple[str, SeqNo | None, VersionedData] | None = None

    def compare_and_set(self, key: str, expected: SeqNo | None, new: VersionedData) -> CaSResult:
        """The inner call, or, when armed, nothing yet (once)."""
        if not self.armed:
            return super().compare_and_set(key, expected, new)
        self.armed = False
        self.held = (key, expected, new)
        raise Indeterminate(f"compare-and-set of {key!r} at SeqNo {new.seqno} still in flight")

    def land(self) -> CaSResult:
        """The held attempt reaches the store now."""
        assert self.held is not None
        return self.inner.compare_and_set(*self.held)


def test_sink_abort_keeps_parts_of_a_commit_that_lands_late(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33 item 2: Spark's ``abort`` after a commit with an unknown outcome, whose attempt
    is still in flight and lands afterwards, leaves no state naming a deleted part.

    The commit of micro-batch 1 raises Indeterminate with its compare-and-set
    held in flight; ``abort`` runs (in another planner worker: a client of its
    own); then the held attempt reaches the store, and the restarted query
    stages and commits batch 1 again. The old abort deleted the staged parts
    (no state referenced them yet), the late attempt landed references to
    them, the replay was answered "already committed", and every read failed.
    """
    shard = f"late-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    first = _writer(shard, ckpt)
    first.commit([_stage(first, range(3))], 0)
    msgs = [_stage(first, range(10, 20), pad=500)]
    opts = PersistOptions.parse({"path": shard, "checkpointLocation": str(ckpt)}, "stream_write")
    held = HeldConsensus(open_consensus(opts.consensus))
    committer = PersistClient(
        open_blob(opts.blob),
        held,
        config=PersistConfig(retry_timeout_s=1e-9, maintenance=False),
        cache=StateCache(),
    )
    try:
        with monkeypatch.context() as m:  # the commit's planner worker, over the held store
            m.setattr(sink, "open_shard", lambda o: committer.open_shard(o.shard, create=False))
            held.armed = True
            with pytest.raises(Indeterminate):
                sink.commit_staged(
                    opts, query_writer_id(opts), 1, msgs, False, first._schema.incarnation
                )
        assert held.held is not None
        sink.abort_staged(opts, msgs)  # another worker: knows nothing of the attempt
        held.land()
        replay = _writer(shard, ckpt)
        replay.commit([_stage(replay, range(10, 20), pad=500)], 1)
        assert _ids(shard) == [0, 1, 2, *range(10, 20)]
    finally:
        committer.close()


def _drop(shard: str) -> None:
    """``persist shards drop`` of ``shard`` by another process (its own client)."""
    from pyspark_persist.state.drop import drop_shard

    other = PersistClient.open()
    drop_shard(other.consensus, other.blob, shard, now_ms=int(time.time() * 1000))
    other.close()


@pytest.mark.parametrize("recreated", [True, False], ids=["recreated", "gone"])
def test_a_stream_query_across_a_drop_fails_with_shard_dropped(
    tmp_path: Path, recreated: bool
) -> None:
    """A streaming query's shard is dropped between two micro-batches (and maybe created
    again under its name by someone else).

    Protects: the query's next micro-batch fails with ShardDropped before any task (its
    checkpoint records the incarnation it writes), and never writes into the shard created
    again nor creates it again itself; a new query (new checkpoint) writes the name anew.
    """
    from pyspark_persist.state.errors import ShardDropped, ShardNotFound

    shard = f"dropq-{uuid.uuid4().hex[:8]}"
    ckpt = _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
    first = _writer(shard, ckpt)
    first.commit([_stage(first, range(10))], 0)
    _drop(shard)
    if recreated:
        other = PersistClient.open()
        other.open_shard(shard, pa.schema([("id", pa.int64()), ("name", pa.string())]))
        other.open_shard(shard).writer().append(pa.table({"id": [100], "name": ["new"]}))
    with pytest.raises(ShardDropped, match="new checkpointLocation"):
        _writer(shard, ckpt)
    if recreated:
        assert _ids(shard) == [100]
    else:
        with pytest.raises(ShardNotFound):
            _ids(shard)
    fresh = _writer(shard, _checkpoint(tmp_path / "fresh", str(uuid.uuid4())))
    fresh.commit([_stage(fresh, range(5))], 0)
    assert _ids(shard) == ([*range(5), 100] if recreated else list(range(5)))


@pytest.mark.parametrize("kind", ["stream", "batch"])
def test_a_write_planned_before_a_drop_never_commits_into_the_recreated_shard(
    tmp_path: Path, kind: str
) -> None:
    """The shard is dropped and created again between a write's planning (its tasks staged
    against the old shard) and its commit on the driver.

    Protects: the commit raises ShardDropped and the new shard holds only its own rows.
    """
    from pyspark_persist.state.errors import ShardDropped

    shard = f"dropw-{uuid.uuid4().hex[:8]}"
    PersistClient.open().open_shard(shard, pa.schema([("id", pa.int64()), ("name", pa.string())]))
    if kind == "stream":
        writer: PersistStreamWriter | PersistBatchWriter = _writer(
            shard, _checkpoint(tmp_path / "ckpt", str(uuid.uuid4()))
        )
    else:
        opts = PersistOptions.parse({"path": shard}, "write")
        writer = PersistBatchWriter(opts, SCHEMA, False)
    rb = pa.RecordBatch.from_pydict({"id": pa.array([1, 2], pa.int64()), "name": ["a", "b"]})
    message = writer.write(iter([rb]))
    _drop(shard)
    other = PersistClient.open()
    other.open_shard(shard, pa.schema([("id", pa.int64()), ("name", pa.string())]))
    other.open_shard(shard).writer().append(pa.table({"id": [100], "name": ["new"]}))
    with pytest.raises(ShardDropped, match="was dropped"):
        if isinstance(writer, PersistStreamWriter):
            writer.commit([message], 0)
        else:
            writer.commit([message])
    assert _ids(shard) == [100]
