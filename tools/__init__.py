"""The tools around persist: the ``persist`` command line, the reliability checker, benchmarks.

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
