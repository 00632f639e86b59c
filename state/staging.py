"""Staging: updates cut into parts of a target size and written to Blob, invisible until a commit.

The first half of a write, which may run in any process that can open the
shard's Blob (a Spark task, say): a :class:`BatchBuilder` checks updates
against the shard's schema and hands them to the strategy of its part format
(:mod:`.part_formats`), which cuts them into parts of about
``part_target_bytes`` and uploads them, at most ``max_outstanding_parts`` at
a time, so memory stays within ``B * (2N + 1)`` whatever the data size. It
never touches Consensus. The result, a :class:`StagedBatch`, is a small
JSON-able value naming the parts; nothing is visible until
:class:`~.write.WriteHandle` commits it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .blob import Blob
from .codec import ARROW_ROWS, PARQUET, PART_FORMATS
from .config import PersistConfig
from .errors import InvalidUpdates, InvalidUsage
from .part_formats import FORMATS, ArrowRowsParts, Stage, Uploads
from .schema import conform_inserts, conform_updates
from .state import PartRef
from .tracing import traced


def delete_staged(blob: Blob, parts: Sequence[PartRef]) -> None:
    """Delete the Blob objects of parts that surely were not committed."""
    for p in parts:
        if p.key is not None:
            blob.delete(p.key)


@dataclass(frozen=True)
class StagedBatch:
    """Parts uploaded (or kept inline) but not yet committed; JSON-able to cross processes."""

    shard_id: str
    parts: tuple[PartRef, ...]
    has_time: bool

    @property
    def rows(self) -> int:
        """Updates staged."""
        return sum(p.rows for p in self.parts)

    @property
    def size_bytes(self) -> int:
        """Encoded bytes staged."""
        return sum(p.size_bytes for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        """Encode for a Spark commit message or any other hop between processes."""
        return {
            "shard": self.shard_id,
            "parts": [p.to_json() for p in self.parts],
            "has_time": self.has_time,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> StagedBatch:
        """Decode what :meth:`to_json` produced."""
        return cls(
            shard_id=str(d["shard"]),
            parts=tuple(PartRef.from_json(p) for p in d["parts"]),
            has_time=bool(d["has_time"]),
        )


class BatchBuilder:
    """Stages updates as parts of a target size with bounded memory. See the module doc.

    Usable from any process that can open the shard's Blob; it never touches
    Consensus. Not thread-safe: one builder per writing thread.
    """

    def __init__(
        self,
        blob: Blob,
        shard_id: str,
        schema: pa.Schema,
        config: PersistConfig,
        *,
        allow_inline: bool = True,
        inline_budget: int | None = None,
        part_format: str = PARQUET,
    ) -> None:
        strategy = FORMATS.get(part_format)
        if strategy is None:
            raise InvalidUsage(
                f"part format {part_format!r} is unknown: use one of {', '.join(PART_FORMATS)}"
            )
        self._blob = blob
        self._shard_id = shard_id
        self._schema = schema
        limit = config.inline_write_max_bytes if allow_inline else 0
        inline_limit = limit if inline_budget is None else min(limit, inline_budget)
        self._uploads = Uploads(config.max_outstanding_parts)
        self._parts = strategy(Stage(blob, shard_id, config, inline_limit, self._uploads))
        self._has_time: bool | None = None
        self._finished = False

    @property
    def queued_s(self) -> float:
        """Seconds ``add``/``finish`` waited for an upload slot (parts queued behind uploads)."""
        return self._uploads.queued_s

    @property
    def upload_s(self) -> float:
        """Seconds spent encoding and uploading parts, summed over the threads doing it (an Arrow
        part is encoded and written as updates are added, and committed on an upload thread)."""
        return self._uploads.upload_s

    def add(self, updates: pa.Table | pa.RecordBatch) -> None:
        """Buffer updates; cut and upload a part whenever ``part_target_bytes`` are buffered.

        Blocks while ``max_outstanding_parts`` uploads are in flight.
        """
        table, has_time = conform_updates(updates, self._schema, self._shard_id)
        self.add_conformed(table, has_time)

    def add_inserts(self, rows: pa.Table) -> None:
        """``add`` for rows of the shard's columns alone, every one an insert at the commit's
        time (a sink's DataFrame without ``_diff``), into an ``arrow-rows`` batch.

        Such a part stores the row columns alone: once it streams (past what may
        still ride inline), the rows go to it as they are, checked by
        ``conform_inserts``, without the constant ``_time`` and ``_diff``
        columns ``add`` would build for the encoder to check and drop again.
        """
        parts = self._parts
        if not isinstance(parts, ArrowRowsParts):
            raise InvalidUsage(f"add_inserts stages {ARROW_ROWS} parts, not {parts.fmt}")
        rows = conform_inserts(rows, self._schema, self._shard_id)
        self._check_open(has_time=False)
        if rows.num_rows:
            parts.add_inserts(rows)

    def add_conformed(self, table: pa.Table, has_time: bool) -> None:
        """``add`` for updates already passed through ``conform_updates`` (no second check)."""
        self._check_open(has_time)
        if table.num_rows:
            self._parts.add(table)

    def _check_open(self, has_time: bool) -> None:
        """Refuse a finished builder, and updates whose ``_time`` presence differs from the
        batch's so far."""
        if self._finished:
            raise InvalidUsage("this batch builder was already finished or aborted")
        if self._has_time is None:
            self._has_time = has_time
        elif self._has_time != has_time:
            raise InvalidUpdates(
                "some updates given to one batch carry a _time column and some do not; "
                "give every update a _time, or none (the commit then assigns one)"
            )

    @traced("BatchBuilder.finish", "_shard_id")
    def finish(self) -> StagedBatch:
        """Upload what is buffered, wait for every upload, and return the staged batch."""
        if self._finished:
            raise InvalidUsage("this batch builder was already finished or aborted")
        try:
            self._parts.finish()
            parts = self._uploads.join()
        except BaseException:
            self.abort()
            raise
        self._finished = True
        self._uploads.shutdown()
        return StagedBatch(self._shard_id, tuple(parts), bool(self._has_time))

    def abort(self) -> None:
        """Delete every part this builder uploaded; the builder cannot be used afterwards.

        After :meth:`finish` it deletes nothing: the parts belong to the
        returned StagedBatch, which a commit may reference (one whose reply was
        lost may have landed); give a batch up with
        :func:`~pyspark_persist.state.write.abandon_staged`.
        """
        if self._finished:
            return
        self._finished = True
        delete_staged(self._blob, self._uploads.abandon())
        self._parts.abort()
        self._uploads.shutdown()
