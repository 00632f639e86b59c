"""The typed faces of state diffs and metrics cover exactly the fields they stand for (no I/O).

``DiffBuilder.set`` takes each scalar of ShardState as a keyword and
``Metrics.incr`` a :class:`Count`; these tests fail when a field is added on
one side and forgotten on the other.
"""

from __future__ import annotations

import inspect
from dataclasses import fields

import pytest

from pyspark_persist.state.diff import DiffBuilder, decode, encode
from pyspark_persist.state.machine import Count, Metrics
from pyspark_persist.state.state import EMPTY_STATE, MAP_CODECS, SCALARS


def test_set_takes_every_scalar_of_the_state() -> None:
    """Every scalar a diff may carry is a keyword of ``set``, and nothing else is."""
    params = inspect.signature(DiffBuilder.set).parameters
    assert sorted(n for n in params if n != "self") == sorted(SCALARS)


def test_every_map_has_a_typed_put_and_delete() -> None:
    """Each map-valued field of the state (and rollups) can be edited through a typed method."""
    singular = {
        "batches": "batch",
        "writers": "writer",
        "leased_readers": "leased_reader",
        "critical_readers": "critical_reader",
        "consumers": "consumer",
        "rollups": "rollup",
    }
    assert sorted(singular) == sorted([*MAP_CODECS, "rollups"])
    for one in singular.values():
        assert callable(getattr(DiffBuilder, f"put_{one}"))
        assert callable(getattr(DiffBuilder, f"delete_{one}"))


def test_set_records_only_changes_and_keeps_the_wire_format() -> None:
    """``None`` leaves a field alone, an unchanged value adds nothing, and the diff encodes to
    the same JSON keys as before the builder was typed."""
    assert DiffBuilder(EMPTY_STATE).set(since=EMPTY_STATE.since, upper=None).is_empty
    diff = DiffBuilder(EMPTY_STATE).set(shard_id="s", schema=b"x", created_ms=7).build()
    assert dict(diff.scalars) == {"shard_id": "s", "schema": b"x", "created_ms": 7}
    assert b'"s":{"shard_id":"s","schema":"eA==","created_ms":7}' in encode(diff)
    state = EMPTY_STATE.apply(decode(encode(diff), where="test"))
    edited = DiffBuilder(state).put_rollup(1, "s/rollup/1").set(upper=5).build()
    assert edited.maps["rollups"] == ({1: "s/rollup/1"}, frozenset())
    assert state.apply(edited).upper == 5


def test_every_metrics_counter_has_a_count() -> None:
    """``Count`` names each public counter of ``Metrics`` exactly once."""
    counters = [f.name for f in fields(Metrics) if not f.name.startswith("_")]
    assert sorted(c.value for c in Count) == sorted(counters)


@pytest.mark.parametrize("count", list(Count))
def test_incr_adds_to_the_named_counter_only(count: Count) -> None:
    """``incr(count, by)`` adds to that counter and leaves the others at zero."""
    metrics = Metrics()
    metrics.incr(count, 3)
    snapshot = metrics.snapshot()
    assert snapshot.pop(count.value) == 3
    assert set(snapshot.values()) == {0}
