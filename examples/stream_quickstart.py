"""A changelog stream on the embedded default, no Spark needed: one writer, one subscriber.

The writer appends a batch of page views every few milliseconds, retracting
some earlier rows (``_diff = -1``); the subscriber reads the snapshot, then
follows every new batch as it is committed, and at the end checks that what
it saw consolidates to exactly the shard's contents.

Run:  python examples/stream_quickstart.py [--batches 50] [--shard quickstart]
Data goes under $PERSIST_HOME (default ~/.pyspark-persist).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid
from collections import Counter

import pyarrow as pa

from pyspark_persist.state import DIFF, PersistClient, WriteHandle, default_home

SCHEMA = pa.schema([("page", pa.string()), ("user", pa.int64())])


def write(shard_writer: WriteHandle, batches: int) -> None:
    """Append ``batches`` micro-batches; every third one retracts a row of the previous one."""
    last: pa.Table | None = None
    for i in range(batches):
        rows = pa.table({"page": [f"/p{i % 7}", f"/p{(i + 3) % 7}"], "user": [i, i + 1000]})
        if last is not None and i % 3 == 0:
            retract = last.slice(0, 1).append_column(DIFF, pa.array([-1], pa.int64()))
            rows = pa.concat_tables(
                [rows.append_column(DIFF, pa.array([1, 1], pa.int64())), retract]
            )
        shard_writer.append(rows)
        last = rows.select(["page", "user"])
        done = i + 1
        bar = "#" * (30 * done // batches)
        print(f"\rwriting [{bar:<30}] {done}/{batches} batches", end="", file=sys.stderr)
        time.sleep(0.005)
    print(file=sys.stderr)


def multiset(tables: list[pa.Table]) -> Counter[tuple[str, int]]:
    """Sum the diffs of each row across ``tables``, ignoring time: the collection they denote."""
    counts: Counter[tuple[str, int]] = Counter()
    for t in tables:
        for row in t.to_pylist():
            counts[(row["page"], row["user"])] += row[DIFF]
    return +counts


def main() -> int:
    """Run the writer and the subscriber; exit 0 when the subscriber saw exactly the shard."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=50)
    parser.add_argument("--shard", default=f"quickstart-{uuid.uuid4().hex[:8]}")
    args = parser.parse_args()

    client = PersistClient.open()
    shard = client.open_shard(args.shard, SCHEMA)
    print(f"shard {shard.name!r} under {default_home()}")
    reader = shard.reader()
    listen = reader.listen(shard.upper - 1) if shard.upper > 0 else reader.listen(0)
    seen: list[pa.Table] = []

    writer = threading.Thread(target=write, args=(shard.writer(), args.batches))
    writer.start()
    final_upper = None
    while writer.is_alive() or final_upper is None or listen.frontier < final_upper:
        if not writer.is_alive() and final_upper is None:
            final_upper = shard.upper
        event = listen.next(timeout_s=0.5)
        if event is None or not event.parts:
            continue
        updates = reader.fetch(event.parts)
        seen.append(updates)
        for row in updates.to_pylist():
            sign = "+" if row[DIFF] > 0 else "-"
            print(f"  t={row['_time']} {sign} {row['page']:<4} user={row['user']}")
    writer.join()

    expected = reader.snapshot_table()
    exact = multiset(seen) == multiset([expected])
    print(
        f"subscriber saw {sum(t.num_rows for t in seen)} updates; shard holds "
        f"{expected.num_rows} rows at upper {shard.upper}; consolidated match: {exact}"
    )
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
