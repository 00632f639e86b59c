"""The tools around persist: the ``persist`` command line, the reliability checker, benchmarks.

The story
---------
A shard (:mod:`pyspark_persist.state`) lives at a *location*: a Blob URI
for its parts and rollups and a Consensus URI for its versioned state
(``--blob``/``--consensus``, or the embedded default under
``~/.pyspark-persist``). Every tool opens the location through the same
registry the library uses (``open_blob``/``open_consensus``), opens a shard
by name, and from there does what a user program would: ``shards show``
plans a snapshot with the same ``plan_read`` every reader uses and fetches
its parts (without registering a reader, so it writes nothing);
``shards compact``/``gc`` plan and run maintenance exactly as the
background threads, with ``--dry-run`` printing the plan as data. The
checker drives writers and readers against fault-injecting stores and checks
the history it observed; the benchmarks time the public API beside raw
pyarrow, files and Delta in the same run.

They are users of the library, not part of it (persist keeps the same split
between ``persist-client`` and its ``persist-cli`` crate): everything here
imports the public API of :mod:`pyspark_persist.state`,
:mod:`pyspark_persist.pubsub` and the Spark connector, and nothing in those
imports this package.

- :mod:`.cli`: ``persist`` (``python -m pyspark_persist``): list, inspect,
  read and maintain shards; serve PubSub; run benchmarks and the checker.
- :mod:`.checker`: a Jepsen-style randomized checker over fault-injecting stores.
- :mod:`.bench`: benchmarks of the core, PubSub, maintenance and the Spark path,
  each beside its peers measured in the same run.
"""
