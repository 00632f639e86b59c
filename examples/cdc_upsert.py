"""CDC into a keyed shard: a Debezium-like change feed upserted by key, tailed with change types.

The job writes a deterministic change feed of a `customers` table (inserts
`c`, updates `u` and deletes `d`, each with a log sequence number `lsn`) as
JSON files, one file per delivery, some events late (in a later file than
their `lsn` says), some replayed, and each file in shuffled order.

Query 1: a file stream (one file per micro-batch) -> keyed persist shard
(`upsertKeys=id`, `sequenceColumn=lsn`, `deleteColumn=is_deleted`), run
twice from one checkpoint: the first half of the files, then, once the rest
have arrived, the rest (a restart that must neither skip nor repeat a file).
Query 2: tails the shard with `changeTypes` (insert, update_preimage,
update_postimage, delete, as Delta's Change Data Feed) and folds the
changes into a view.

At the end the shard, and the tailed view, must equal the feed applied with
pandas (per key the event of the highest `lsn` wins, a delete removes the
key), and the change types the tail saw must be those the deliveries imply,
each exactly once. Exits non-zero on any difference.

    spark-submit examples/cdc_upsert.py [--events 2000] [--keys 200] [--files 8]

Data and checkpoints go under $PERSIST_HOME (default ~/.pyspark-persist).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import uuid
from collections import Counter
from typing import Any

import pandas as pd
from common import follow, session, stop, wait_for_rows
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from pyspark_persist.state import default_home

ROW = "struct<id: long, name: string, balance: long>"
EVENT = f"op string, lsn long, ts_ms long, before {ROW}, after {ROW}"
COLUMNS = ["id", "name", "balance", "lsn"]  # the shard's columns
Event = dict[str, Any]
Row = tuple[int, str, int, int]


def generate_feed(events: int, keys: int, files: int, seed: int = 35) -> list[list[Event]]:
    """The feed as deliveries (one list of events per file), deterministic for a seed.

    Events are generated in `lsn` order against the table they describe
    (a key's first event is its insert; later ones update or delete it). About
    5% are delivered one to three files late, 3% are delivered a second time,
    and every delivery is shuffled, so only `lsn` tells the order.
    """
    rng = random.Random(seed)
    live: dict[int, dict[str, Any]] = {}
    deliveries: list[list[Event]] = [[] for _ in range(files)]
    for lsn in range(1, events + 1):
        key = rng.randrange(keys)
        before = live.get(key)
        after: dict[str, Any] | None = None
        if before is None:
            op = "c"
        elif rng.random() < 0.2:
            op = "d"
        else:
            op = "u"
        if op != "d":
            after = {"id": key, "name": f"customer-{key}-v{lsn}", "balance": rng.randrange(10_000)}
            live[key] = after
        else:
            del live[key]
        event = {"op": op, "lsn": lsn, "ts_ms": 1_700_000_000_000 + lsn, "before": before}
        event["after"] = after
        due = (lsn - 1) * files // events
        if rng.random() < 0.05:
            due = min(files - 1, due + rng.randint(1, 3))  # late
        deliveries[due].append(event)
        if rng.random() < 0.03:
            deliveries[min(files - 1, due + rng.randint(0, 3))].append(event)  # replayed
    for delivery in deliveries:
        rng.shuffle(delivery)
    return deliveries


def deliver(deliveries: list[list[Event]], first: int, directory: str) -> None:
    """Write deliveries as files `first`, `first+1`, ...: each appears whole, in order by mtime.

    The file source takes the oldest files first, so each file gets its own
    modification time, and appears by an atomic rename from a staging name
    the source ignores (names starting with `_`).
    """
    for i, delivery in enumerate(deliveries, start=first):
        staging = os.path.join(directory, f"_{i:04d}.json")
        with open(staging, "w") as f:
            f.writelines(json.dumps(e) + "\n" for e in delivery)
        os.utime(staging, (1_700_000_000 + i, 1_700_000_000 + i))
        os.replace(staging, os.path.join(directory, f"{i:04d}.json"))


def apply_with_pandas(deliveries: list[list[Event]]) -> pd.DataFrame:
    """The table the feed describes: per key its highest-`lsn` event, deleted keys removed."""
    events = pd.DataFrame(
        [
            {"op": e["op"], "lsn": e["lsn"], **(e["after"] or e["before"])}
            for delivery in deliveries
            for e in delivery
        ]
    )
    latest = events.sort_values("lsn").groupby("id").tail(1)
    table = latest[latest["op"] != "d"][COLUMNS]
    return table.sort_values("id").reset_index(drop=True).astype({"balance": "int64"})


def expected_changes(deliveries: list[list[Event]], snapshot_after: int) -> Counter[str]:
    """The change types a tail started after delivery `snapshot_after - 1` sees, each once.

    Replays the sink's rule per delivery (one micro-batch, one commit): per
    key the highest `lsn` wins unless the key already saw a higher one
    (deletes included). The tail's snapshot is all inserts; every later
    commit shows, per key whose row changed, its old and new row.
    """
    seen: dict[int, int] = {}  # key -> highest lsn applied (a delete's too)
    rows: dict[int, Row] = {}
    counts: Counter[str] = Counter()
    for n, delivery in enumerate(deliveries):
        newest: dict[int, Event] = {}
        for e in delivery:
            key = (e["after"] or e["before"])["id"]
            if key not in newest or e["lsn"] >= newest[key]["lsn"]:
                newest[key] = e
        for key, e in newest.items():
            if e["lsn"] < seen.get(key, 0):
                continue
            seen[key] = e["lsn"]
            old = rows.pop(key, None)
            if e["op"] != "d":
                a = e["after"]
                rows[key] = (key, a["name"], a["balance"], e["lsn"])
            new = rows.get(key)
            if n >= snapshot_after and old != new:
                if old is not None and new is not None:
                    counts.update(["update_preimage", "update_postimage"])
                elif old is not None:
                    counts["delete"] += 1
                else:
                    counts["insert"] += 1
        if n == snapshot_after - 1:
            counts["insert"] += len(rows)
    return counts


def upsert_feed(spark: SparkSession, feed_dir: str, shard: str, checkpoint: str) -> None:
    """Run the CDC query over the files in `feed_dir` not yet taken, one file per micro-batch."""
    events = (
        spark.readStream.schema(EVENT)
        .option("maxFilesPerTrigger", 1)
        .json(feed_dir)
        .select(
            F.coalesce("after.id", "before.id").alias("id"),
            F.col("after.name").alias("name"),
            F.col("after.balance").alias("balance"),
            "lsn",
            (F.col("op") == "d").alias("is_deleted"),
        )
    )
    query = (
        events.writeStream.format("persist")
        .option("upsertKeys", "id")
        .option("sequenceColumn", "lsn")
        .option("deleteColumn", "is_deleted")
        .option("checkpointLocation", checkpoint)
        .trigger(availableNow=True)
        .start(shard)
    )
    follow(query, 600, "cdc")
    query.awaitTermination()
    done = [p for p in query.recentProgress if p["numInputRows"] > 0]
    print(
        f"[cdc] run done: {len(done)} micro-batches, {sum(p['numInputRows'] for p in done)} events",
        file=sys.stderr,
    )


def main() -> int:
    """Upsert the feed, tail it; exit 0 when shard, tail and pandas agree exactly."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--keys", type=int, default=200)
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--shard", default=f"customers-{uuid.uuid4().hex[:6]}")
    args = ap.parse_args()
    spark = session("persist: CDC upsert")
    checkpoints = os.path.join(default_home(), "checkpoints", args.shard)
    feed_dir = tempfile.mkdtemp(prefix="cdc-feed-")
    deliveries = generate_feed(args.events, args.keys, args.files)
    half = args.files // 2
    print(
        f"feed: {sum(map(len, deliveries))} deliveries of {args.events} events over "
        f"{args.keys} keys in {args.files} files"
    )

    deliver(deliveries[:half], 0, feed_dir)
    upsert_feed(spark, feed_dir, args.shard, os.path.join(checkpoints, "cdc"))

    view: Counter[Row] = Counter()
    kinds: Counter[str] = Counter()
    lock = threading.Lock()

    def fold(batch: DataFrame, batch_id: int) -> None:
        changes = batch.select(*COLUMNS, "_diff", "_change_type").collect()
        with lock:
            for r in changes:
                view[(r["id"], r["name"], r["balance"], r["lsn"])] += r["_diff"]
            kinds.update(r["_change_type"] for r in changes)
        print(f"[tail] micro-batch {batch_id}: {dict(Counter(r['_change_type'] for r in changes))}")

    tail = (
        spark.readStream.format("persist")
        .option("changeTypes", "true")
        .load(args.shard)
        .writeStream.foreachBatch(fold)
        .option("checkpointLocation", os.path.join(checkpoints, "tail"))
        .trigger(processingTime="500 milliseconds")
        .start()
    )
    wait_for_rows(tail, "tail")  # the snapshot of the first half, before the rest arrives

    deliver(deliveries[half:], half, feed_dir)
    upsert_feed(spark, feed_dir, args.shard, os.path.join(checkpoints, "cdc"))
    tail.processAllAvailable()
    stop(tail)
    shutil.rmtree(feed_dir)

    stored: pd.DataFrame = spark.read.format("persist").load(args.shard).select(*COLUMNS).toPandas()
    shard = stored.sort_values("id").reset_index(drop=True)
    expected = apply_with_pandas(deliveries)
    with lock:
        tailed = sorted(k for k, n in view.items() for _ in range(n))
        negative = [k for k, n in view.items() if n < 0]
        saw = dict(kinds)
    want = dict(expected_changes(deliveries, half))
    print(shard.to_string(index=False, max_rows=20))
    table_ok = shard.equals(expected)
    tail_ok = not negative and tailed == list(expected.itertuples(index=False, name=None))
    kinds_ok = saw == want
    print(f"change types seen by the tail: {saw} (expected {want})")
    print(
        f"shard '{args.shard}': {len(shard)} live keys; equals the feed applied with pandas: "
        f"{table_ok}; tailed view equals it: {tail_ok}; each change exactly once: {kinds_ok}"
    )
    spark.stop()
    return 0 if table_ok and tail_ok and kinds_ok else 1


if __name__ == "__main__":
    sys.exit(main())
