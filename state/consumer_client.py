"""The :class:`~pyspark_persist.state.client.Shard` methods of named consumers.

Thin: each runs one pure command of :mod:`pyspark_persist.state.consumers`
through the shard's machine and raises the error a refusal carries. A
retry after an unknown outcome is safe because each command recognises its
own landed effect; the one it cannot (a drop whose first attempt landed
finds the consumer gone) is told apart here by the machine's ``RunInfo``.
"""

from __future__ import annotations

from collections.abc import Callable

from . import consumers as cmds
from .changes import Behind
from .commands import Outcome
from .errors import UnknownConsumer
from .machine import Machine, RunInfo
from .state import ConsumerState, ShardState, Time
from .tracing import traced


class ConsumerMethods:
    """Named consumers of one shard (mixed into ``Shard``, whose ``machine`` it uses)."""

    machine: Machine

    def _run(self, cmd: Callable[[ShardState], Outcome[cmds.ConsumerResult]]) -> ConsumerState:
        return cmds.raise_refusal(self.machine.run(cmd))

    @traced("Shard.consumers", "machine.shard_id")
    def consumers(self) -> dict[str, ConsumerState]:
        """Every named consumer of the shard, by name (read from Consensus now)."""
        return dict(self.machine.fetch_latest().consumers)

    def consumer_lag(self, name: str) -> Behind:
        """How far consumer ``name`` is behind the shard's upper (read from Consensus now)."""
        return cmds.consumer_lag(self.machine.fetch_latest(), name)

    @traced("Shard.acquire_consumer", "machine.shard_id")
    def acquire_consumer(
        self, name: str, holder: str, expiry_ms: int = 0, *, reader_id: str = ""
    ) -> ConsumerState:
        """Hold consumer ``name`` (created when absent) for ``holder``, fencing any older holder.

        The returned ``epoch`` is what :meth:`plan_consumer_batch` and
        :meth:`advance_consumer` must name; ``expiry_ms`` > 0: the consumer
        stops holding data once idle that long. ``reader_id``: the holder's leased reader;
        once its lease is gone the holder no longer counts as live (reset and drop go ahead).
        """
        now = self.machine.clock_ms()
        return self._run(
            lambda s: cmds.acquire_consumer(
                s, name=name, holder=holder, now_ms=now, expiry_ms=expiry_ms, reader_id=reader_id
            )
        )

    def plan_consumer_batch(
        self, name: str, epoch: int, start: str, end: str, *, holder: str = ""
    ) -> ConsumerState:
        """Record the micro-batch ``[start, end)`` planned past the position; ConsumerFenced when
        ``epoch`` is no longer the consumer's (``holder``: this caller, for the message)."""
        return self._run(
            lambda s: cmds.plan_consumer_batch(
                s, name=name, epoch=epoch, holder=holder, start=start, end=end
            )
        )

    def advance_consumer(
        self,
        name: str,
        epoch: int,
        *,
        position: str,
        upper: Time,
        since: Time,
        holder: str = "",
        plan: tuple[str, str] | None = None,
    ) -> ConsumerState:
        """Record that everything up to ``position`` was consumed (times below ``upper``), hold
        ``since``, and plan the micro-batch ``plan`` in the same step; ConsumerFenced when
        ``epoch`` is no longer the consumer's."""
        now = self.machine.clock_ms()
        return self._run(
            lambda s: cmds.advance_consumer(
                s,
                name=name,
                epoch=epoch,
                holder=holder,
                position=position,
                upper=upper,
                since=since,
                now_ms=now,
                plan=plan,
            )
        )

    def release_consumer(self, name: str, epoch: int) -> ConsumerState:
        """Let go of the consumer (its position and hold stay); nothing when fenced."""
        return self._run(lambda s: cmds.release_consumer(s, name=name, epoch=epoch))

    @traced("Shard.reset_consumer", "machine.shard_id")
    def reset_consumer(
        self, name: str, *, position: str, upper: Time, since: Time, force: bool = False
    ) -> ConsumerState:
        """Move the consumer to ``position``; ConsumerInUse while a live query holds it (unless
        ``force``: that query is fenced), InvalidFrontier when ``since`` was compacted away."""
        now = self.machine.clock_ms()
        return self._run(
            lambda s: cmds.reset_consumer(
                s,
                name=name,
                position=position,
                upper=upper,
                since=since,
                force=force,
                now_ms=now,
            )
        )

    @traced("Shard.drop_consumer", "machine.shard_id")
    def drop_consumer(self, name: str, force: bool = False) -> None:
        """Remove the consumer and its hold; ConsumerInUse while held (unless ``force``),
        UnknownConsumer when the shard has none of that name."""
        info, now = RunInfo(), self.machine.clock_ms()
        result = self.machine.run(
            lambda s: cmds.drop_consumer(s, name=name, force=force, now_ms=now), info=info
        )
        if isinstance(result, UnknownConsumer) and info.uncertain:
            return  # an attempt whose reply was lost dropped it
        cmds.raise_refusal(result)
