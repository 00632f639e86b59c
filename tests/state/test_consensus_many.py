"""compare_and_set_many, the contract a transaction across shards stands on, on every backend:
every row or none, a mismatch naming the keys that moved, and racers on overlapping keys that
never both land (no lost update, nothing applied twice)."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from pyspark_persist.state.consensus import (
    CaSCommitted,
    CaSManyMismatch,
    Consensus,
    VersionedData,
    open_consensus,
)
from pyspark_persist.state.errors import InvalidUsage


def new_key() -> str:
    """A key no other test (or earlier run on the shared PostgreSQL table) has used."""
    return f"txn-{uuid.uuid4()}"


def row(seqno: int, data: bytes = b"x") -> VersionedData:
    return VersionedData(seqno, data)


def test_every_row_lands_at_once(consensus: Consensus) -> None:
    """Two new keys and one existing one: all three rows appended by one call."""
    a, b, c = new_key(), new_key(), new_key()
    assert consensus.compare_and_set(c, None, row(1, b"c1")) == CaSCommitted()
    ops = [(a, None, row(1, b"a1")), (b, None, row(1, b"b1")), (c, 1, row(2, b"c2"))]
    assert consensus.compare_and_set_many(ops) == CaSCommitted()
    assert consensus.head(a) == row(1, b"a1")
    assert consensus.head(b) == row(1, b"b1")
    assert [r.data for r in consensus.scan(c, 0)] == [b"c1", b"c2"]


def test_one_moved_key_lands_nothing_and_is_named(consensus: Consensus) -> None:
    """A key whose head moved fails the whole call: no row anywhere, and the reply names it."""
    a, b, c = new_key(), new_key(), new_key()
    for key in (a, b):
        assert consensus.compare_and_set(key, None, row(1)) == CaSCommitted()
    assert consensus.compare_and_set(b, 1, row(2)) == CaSCommitted()  # b moved on
    ops = [(a, 1, row(2, b"mine")), (b, 1, row(2, b"mine")), (c, None, row(1, b"mine"))]
    assert consensus.compare_and_set_many(ops) == CaSManyMismatch({b: 2})
    assert consensus.head(a) == row(1)
    assert consensus.head(b) == row(2)
    assert consensus.head(c) is None


def test_a_new_key_that_exists_is_named(consensus: Consensus) -> None:
    """Expecting no rows where there are some is a mismatch too (the other key stays unwritten)."""
    a, b = new_key(), new_key()
    assert consensus.compare_and_set(a, None, row(1)) == CaSCommitted()
    assert consensus.compare_and_set_many([(a, None, row(1)), (b, None, row(1))]) == (
        CaSManyMismatch({a: 1})
    )
    assert consensus.head(b) is None


@pytest.mark.parametrize(
    "ops",
    [
        [],
        [("k", None, row(1)), ("k", None, row(1))],
        [("k", None, row(2))],
        [("k", 3, row(5))],
    ],
    ids=["empty", "repeated", "seqno-from-nothing", "seqno-skips"],
)
def test_bad_calls_are_refused_before_anything_is_written(
    consensus: Consensus, ops: list[tuple[str, int | None, VersionedData]]
) -> None:
    key = new_key()
    fixed = [(key, expected, new) for _, expected, new in ops]
    with pytest.raises(InvalidUsage):
        consensus.compare_and_set_many(fixed)
    assert consensus.head(key) is None


def test_racers_on_overlapping_keys_never_both_land(consensus_uri: str) -> None:
    """Threads (each with its own store handle) bump random pairs of three counters by
    compare_and_set_many; every committed call's rows are there exactly once, so each key's
    rows number the commits that named it (a lost update or a half commit would break that)."""
    keys = [new_key() for _ in range(3)]
    seed = open_consensus(consensus_uri)
    assert seed.compare_and_set_many([(k, None, row(1, b"seed")) for k in keys]) == CaSCommitted()
    per_thread = 25

    def worker(i: int) -> list[str]:
        store = open_consensus(consensus_uri)
        landed: list[str] = []
        try:
            pair = [keys[i % 3], keys[(i + 1) % 3]]
            done = 0
            while done < per_thread:
                heads = {k: store.head(k) for k in pair}
                ops = []
                for k in pair:
                    head = heads[k]
                    assert head is not None
                    ops.append((k, head.seqno, row(head.seqno + 1, f"{i}-{done}".encode())))
                if store.compare_and_set_many(ops) == CaSCommitted():
                    landed.extend(pair)
                    done += 1
        finally:
            store.close()
        return landed

    with ThreadPoolExecutor(4) as pool:
        landed = [k for got in pool.map(worker, range(4)) for k in got]
    for k in keys:
        rows = seed.scan(k, 0)
        assert [r.seqno for r in rows] == list(range(1, len(rows) + 1))
        assert len(rows) - 1 == landed.count(k)
    # Every committed payload is in both of its keys, or in neither.
    payloads = {k: {r.data for r in seed.scan(k, 2)} for k in keys}
    for i in range(4):
        a, b = keys[i % 3], keys[(i + 1) % 3]
        for done in range(per_thread):
            p = f"{i}-{done}".encode()
            assert (p in payloads[a]) == (p in payloads[b])
    seed.close()
