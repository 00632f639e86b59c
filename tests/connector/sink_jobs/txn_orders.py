"""Child job of the Spark transaction kill test: orders and their items, one transaction a
micro-batch, run by ``spark-submit``.

Usage: ``spark-submit txn_orders.py BLOB CONSENSUS CHECKPOINT ORDERS ITEMS UNTIL_BATCH``.

A ``rate-micro-batch`` stream (:data:`ROWS_PER_BATCH` values a micro-batch, the same values
when Spark replays a micro-batch from its offset log) feeds ``foreachBatch``: each value v is
an order (shard ORDERS: ``order_id, customer, amount, batch``) with two items (shard ITEMS:
``order_id, line, sku, qty, batch``), written in one ``pyspark_persist.txn`` whose
``txnVersion`` is the micro-batch id. The run ends once micro-batch UNTIL_BATCH is done: the
next one raises before it writes anything, which ends the query, and the job exits 0.

Test hooks, all in this file (the library is run as users run it): each micro-batch's
commit appends ``committed <batch> <time> <applied|already>`` to ``$TXN_TEST_MARKERS`` once
its ``with`` block is left. ``$TXN_TEST_HOLD`` names a step at which the driver stops (after
writing ``held <step> <batch>``) until the parent's SIGKILL, in the run's second micro-batch
or later (so the kill never lands on the first micro-batch of a run, which is mostly a
replay of the one the kill before interrupted):

* ``before-cas``: the executors staged both shards' rows and the driver planned the commit;
  the held call is its one ``compare_and_set_many`` (the driver client's Consensus method,
  wrapped here). Nothing landed: the restart replays the micro-batch and commits it.
* ``committed``: the transaction committed in both shards and ``foreachBatch`` has not
  returned, so Spark's commit log lacks the micro-batch: the restart replays it and must
  apply nothing.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import pyspark_persist
from pyspark_persist.options import PersistOptions
from pyspark_persist.source import client_for
from pyspark_persist.state.consensus import CaSOp

ROWS_PER_BATCH = 200
"""Orders a micro-batch: with their padded columns each task's rows encode well past
``inline_write_max_bytes``, so the executors stage parts in Blob (a kill before the commit
leaves some for GC's orphan sweep)."""
HOLD_S = 600.0
"""How long a held step waits for its kill: bounded, so a job whose parent died ends."""
WRITER = "txn-orders"


class Hooks:
    """The markers and the hold of one run (see the module doc)."""

    def __init__(self) -> None:
        self.markers = os.environ.get("TXN_TEST_MARKERS", "")
        self.hold_at = os.environ.get("TXN_TEST_HOLD", "")
        self.batch = -1
        """The micro-batch the driver is committing."""
        self.committed = 0
        """Micro-batches this run committed (or found committed)."""

    def mark(self, line: str) -> None:
        """Append ``line`` to the markers file, on disk before the parent may read it."""
        if not self.markers:
            return
        with open(self.markers, "a") as f:
            f.write(f"{line}\n")
            f.flush()
            os.fsync(f.fileno())

    def step(self, name: str) -> None:
        """Hold here until killed when this run is to be killed at ``name``."""
        if name == self.hold_at and self.committed >= 1:
            self.mark(f"held {name} {self.batch}")
            time.sleep(HOLD_S)


def hold_before_cas(hooks: Hooks, location: dict[str, str], shard: str) -> None:
    """Wrap the driver client's ``compare_and_set_many`` (the transaction's one commit call)
    with the ``before-cas`` step. ``pyspark_persist.txn`` commits through the client
    ``client_for`` caches for the location, so this is the instance it will use."""
    consensus = client_for(PersistOptions.parse({**location, "shard": shard}, "write")).consensus
    real: Callable[[list[CaSOp]], object] = consensus.compare_and_set_many

    def held(ops: list[CaSOp]) -> object:
        hooks.step("before-cas")
        return real(ops)

    consensus.compare_and_set_many = held  # type: ignore[method-assign]


DONE = "txn-orders: past UNTIL_BATCH"


class Done(Exception):
    """Raised by the micro-batch after UNTIL_BATCH: the run's normal end."""

    def __init__(self, batch_id: int) -> None:
        super().__init__(f"{DONE} ({batch_id})")


def main(argv: list[str]) -> int:
    """Run the stream until micro-batch UNTIL_BATCH is done."""
    blob, consensus, checkpoint, orders, items, until = argv
    location = {"blob": blob, "consensus": consensus}
    spark = SparkSession.builder.appName("txn-kill-child").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    hooks = Hooks()
    hold_before_cas(hooks, location, orders)

    def load(df: DataFrame, batch_id: int) -> None:
        if batch_id > int(until):
            # Ends the query before this micro-batch writes anything (stopping it from the
            # main thread would interrupt a micro-batch in the middle), without Spark's ERROR
            # log of a failed query: this end is the expected one.
            spark.sparkContext.setLogLevel("FATAL")
            raise Done(batch_id)
        hooks.batch = batch_id
        df = df.select(F.col("value").alias("order_id"), F.lit(batch_id).alias("batch"))
        order_rows = df.select(
            "order_id",
            F.concat(F.lit("customer-"), F.col("order_id"), F.lit("-" + "c" * 40)).alias(
                "customer"
            ),
            (F.col("order_id") * 1.5).alias("amount"),
            "batch",
        )
        item_rows = df.select(
            "order_id",
            F.explode(F.array(F.lit(0), F.lit(1))).alias("line"),
            "batch",
        ).select(
            "order_id",
            "line",
            F.concat(F.lit("sku-"), F.col("order_id"), F.lit("-"), F.col("line")).alias("sku"),
            (F.col("line") + 1).alias("qty"),
            "batch",
        )
        with pyspark_persist.txn(spark, writerId=WRITER, txnVersion=batch_id, **location) as t:
            t.append(order_rows, orders)
            t.append(item_rows, items)
        outcome = "already" if t.already_committed else "applied"
        hooks.mark(f"committed {batch_id} {t.commit_time} {outcome}")
        hooks.step("committed")
        hooks.committed += 1

    query = (
        spark.readStream.format("rate-micro-batch")
        .option("rowsPerBatch", ROWS_PER_BATCH)
        .load()
        .writeStream.foreachBatch(load)
        .option("checkpointLocation", checkpoint)
        .start()
    )
    try:
        query.awaitTermination()
    except Exception as e:  # the query's failure, a Py4J/Spark error naming Done's
        if DONE not in str(e):
            raise
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
