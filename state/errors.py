"""Every exception persist raises, in one flat module.

The classes say *whether the thing could have happened*, because that is what
a caller needs to decide what to do next (the habit comes from persist's
``ExternalError``):

- :class:`Determinate`: the operation surely did not take effect. Retrying
  anything is safe.
- :class:`Indeterminate`: the operation may or may not have taken effect (a
  timeout, a lost reply). Retry only idempotent work; a compare-and-append
  carries an idempotency token for exactly this reason.
- :class:`InvalidUsage`: the caller's bug (bad URI, bad frontier, schema
  mismatch). Nothing was written; fix the call.

Losing a race is *not* an error: it is a returned value
(:class:`pyspark_persist.state.consensus.CaSMismatch`,
:class:`pyspark_persist.state.write.UpperMismatch`, and a fenced critical
reader's :class:`pyspark_persist.state.commands.CriticalSince` with
``ok=False``, which carries the newer fencing token).

Every class below is public and named on the docs' Errors page (``docs/errors.md``). The
connector, PubSub and the tools raise these too, never bare ``ValueError``.
"""

from __future__ import annotations


class PersistError(Exception):
    """Base class of every error raised by pyspark_persist."""


class Determinate(PersistError):
    """An external call surely did not take effect; retrying is safe."""


class Indeterminate(PersistError):
    """An external call may or may not have taken effect; retry only idempotent work."""


class InvalidUsage(PersistError):
    """The caller asked for something that cannot be done; nothing was written."""


class InvalidUri(InvalidUsage):
    """A Blob or Consensus URI is malformed or names an unknown scheme."""


class StoreUnavailable(Determinate):
    """A Blob or Consensus store could not be reached or opened.

    ``transient`` is False when the store knows retrying cannot help (bad
    credentials, no privilege, no such bucket): callers then fail at once.
    """

    def __init__(self, message: str, *, transient: bool = True) -> None:
        super().__init__(message)
        self.transient = transient


class StagedPartsExpired(Determinate):
    """A commit named staged parts that are gone from Blob, or old enough that GC's orphan
    sweep may delete them any moment; nothing was committed.

    Parts must be committed within ``staged_part_grace_s`` (half of it, as the
    writer measures) of their upload: stage them again and commit.
    """


class ShardNotFound(InvalidUsage):
    """The named shard does not exist in this Consensus."""


class ShardDropped(ShardNotFound):
    """The shard a handle, reader, listen, lease or Spark query was opened on has been dropped.

    Each creation of a shard is a new incarnation, with an id of its own in
    its state; a handle stays bound to the incarnation it opened and never
    reads from or writes to one created later under the same name. Open the
    shard again (a streaming query: restart it with a new checkpointLocation).
    """


class ShardInUse(InvalidUsage):
    """Readers hold the shard (a live lease or a critical since), so it was not dropped."""


class ShardExists(InvalidUsage):
    """The named shard already exists and the caller asked to create it fresh."""


class SchemaMismatch(InvalidUsage):
    """The schema given does not match the schema the shard was created with."""


class KeysMismatch(InvalidUsage):
    """A call names other key columns than the shard's (keys are fixed when a shard is created)."""


class SchemaChanged(SchemaMismatch):
    """A write added columns to the shard after a streaming query fixed its schema at start.

    Spark fixes a query's columns when it starts, so the query stops rather
    than drop the new columns. Nothing was read past the change: restart the
    query from the same checkpoint and it goes on exactly once with them.
    """


class InvalidFrontier(InvalidUsage):
    """A time or frontier is outside what the shard allows (before since, at or past upper)."""


class InvalidUpdates(InvalidUsage):
    """Updates passed to a write are malformed (columns, types, times outside the batch)."""


class DataLoss(InvalidFrontier):
    """A stream's next offsets were compacted away, so it cannot go on exactly once.

    The Spark source raises it when ``failOnDataLoss`` is true (the default)
    and the times it must read next are before the shard's since. Nothing was
    read or written; restart the query from a new checkpoint, or set
    ``failOnDataLoss=false`` to skip ahead to what is still readable.
    """


class PartNotFound(PersistError):
    """A part key named in the shard's state (or by the caller) is missing from Blob."""


class CorruptData(PersistError):
    """Bytes read from Blob or Consensus could not be decoded: data corruption or a bug."""


class IncompatibleVersion(CorruptData):
    """State was written in an encoding format this version of pyspark_persist cannot read."""


class LeaseExpired(InvalidUsage):
    """A reader's lease expired (it stopped heartbeating); open a new reader."""


class ConsumerFenced(InvalidUsage):
    """Another holder acquired the named consumer (or it was reset) after this one did.

    Two live queries with one consumer name: the newer one holds it, and the
    older one's next micro-batch stops here, before it plans or commits
    anything, so never do both move the consumer's position. Stop one of the
    queries, or give each its own consumer name.
    """

    def __init__(self, shard: str, consumer: str, holder_now: str, holder_self: str) -> None:
        now = holder_now or "nobody (it was reset or released)"
        super().__init__(
            f"consumer {consumer!r} of shard {shard!r} is fenced: it is now held by {now}, "
            f"not by this holder, {holder_self}; nothing was planned or committed by this one. "
            "Two queries must not share one consumer name: stop one of them, or give each "
            "its own .option('consumer', ...)"
        )
        self.shard, self.consumer = shard, consumer
        self.holder_now, self.holder_self = holder_now, holder_self

    def __reduce__(self) -> tuple[type, tuple[str, str, str, str]]:
        """Pickle by the constructor's arguments (Spark ships errors between processes)."""
        return (type(self), (self.shard, self.consumer, self.holder_now, self.holder_self))


class UnknownConsumer(InvalidUsage):
    """The shard has no consumer of that name (never created, or dropped); nothing changed."""

    def __init__(self, shard: str, consumer: str, known: tuple[str, ...]) -> None:
        names = ", ".join(repr(k) for k in known) if known else "none"
        super().__init__(
            f"shard {shard!r} has no consumer {consumer!r} (its consumers: {names}); check the "
            "name (persist consumers list SHARD), or start a query with "
            f".option('consumer', {consumer!r}) to create it"
        )
        self.shard, self.consumer, self.known = shard, consumer, known

    def __reduce__(self) -> tuple[type, tuple[str, str, tuple[str, ...]]]:
        """Pickle by the constructor's arguments."""
        return (type(self), (self.shard, self.consumer, self.known))


class ConsumerInUse(InvalidUsage):
    """A query holds the named consumer, so it was not reset or dropped; nothing changed.

    Stop the query first, or pass ``force`` (``--force``): the query is then
    fenced and fails at its next micro-batch.
    """


class SinkDiverged(Determinate):
    """An external table a sink delivers a shard to (``sinks.postgres``) lacks rows a
    micro-batch retracts: it no longer equals what the sink wrote (another writer changed it,
    or its tokens were deleted). Nothing of the micro-batch was applied."""
