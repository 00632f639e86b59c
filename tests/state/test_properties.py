"""Property-based tests (hypothesis) of the pure pieces every guarantee rests on.

- state diffs: encode/decode round-trips, applying a decoded diff equals
  applying the original, a rollup reproduces the state, and any single-byte
  corruption or truncation is CorruptData (never a different state);
- consolidation: idempotent, preserves each row's diff sum, drops zeros;
- a corrupt or truncated Parquet part is CorruptData naming the part, not a
  wrong answer.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_persist.state import DIFF, TIME, PersistClient, PersistConfig, consolidate
from pyspark_persist.state.diff import DiffBuilder, decode, encode, full_diff
from pyspark_persist.state.errors import CorruptData, PersistError
from pyspark_persist.state.state import (
    EMPTY_STATE,
    Batch,
    CriticalReaderState,
    LeasedReaderState,
    PartRef,
    ShardState,
    StateDiff,
    WriterState,
)

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

u32 = st.integers(0, 2**32)
i64 = st.integers(-(2**63), 2**63 - 1)
names = st.text("abcdefghij0123456789-_", min_size=1, max_size=12)


@st.composite
def part_refs(draw: st.DrawFn) -> PartRef:
    inline = draw(st.booleans())
    tmin = draw(u32)
    return PartRef(
        key=None if inline else f"s/part/{draw(names)}.parquet",
        inline=draw(st.binary(min_size=1, max_size=40)) if inline else None,
        size_bytes=draw(u32),
        rows=draw(u32),
        min_time=tmin,
        max_time=tmin + draw(u32),
        ts_rewrite=draw(st.none() | u32),
        negate=draw(st.booleans()),
        dmin=draw(st.none() | i64),
        dmax=draw(st.none() | i64),
        stats=draw(
            st.none()
            | st.dictionaries(names, st.tuples(st.integers(-5, 5), st.integers(-5, 5)), max_size=2)
        )
        or None,
    )


@st.composite
def batches(draw: st.DrawFn) -> Batch:
    lower = draw(u32)
    return Batch(
        lower,
        lower + draw(st.integers(1, 1000)),
        draw(u32),
        tuple(draw(st.lists(part_refs(), max_size=3))),
    )


VALUES: dict[str, Any] = {
    "batches": batches(),
    "writers": st.builds(WriterState, u32, u32),
    "leased_readers": st.builds(LeasedReaderState, u32, u32, u32, u32),
    "critical_readers": st.builds(CriticalReaderState, u32, i64),
}


EDITS: dict[str, tuple[Callable[[DiffBuilder, str, Any], object], Callable[..., object]]] = {
    "batches": (lambda b, _key, v: b.put_batch(v), DiffBuilder.delete_batch),
    "writers": (DiffBuilder.put_writer, DiffBuilder.delete_writer),
    "leased_readers": (DiffBuilder.put_leased_reader, DiffBuilder.delete_leased_reader),
    "critical_readers": (DiffBuilder.put_critical_reader, DiffBuilder.delete_critical_reader),
}
"""Each map's typed put (builder, key, value; a batch is keyed by its interval) and delete."""


@st.composite
def diff_steps(draw: st.DrawFn, state: ShardState) -> StateDiff:
    """A random diff from ``state``: scalar sets, map puts, deletes of existing keys."""
    b = DiffBuilder(state)
    for name, strat in (
        ("since", u32),
        ("upper", u32),
        ("last_gc_seqno", u32),
        ("created_ms", u32),
    ):
        if draw(st.booleans()):
            b.set(**{name: draw(strat)})
    if draw(st.booleans()):
        b.set(schema=draw(st.binary(max_size=20)))
    for name, strat in VALUES.items():
        put, delete = EDITS[name]
        for _ in range(draw(st.integers(0, 2))):
            value = strat if name != "batches" else batches()
            put(b, draw(names), draw(value))
        existing = sorted(getattr(state, name))
        if existing and draw(st.booleans()):
            delete(b, draw(st.sampled_from(existing)))
    if draw(st.booleans()):
        b.put_rollup(draw(st.integers(1, 10**6)), f"s/rollup/{draw(names)}")
    return b.build()


@st.composite
def histories(draw: st.DrawFn) -> list[StateDiff]:
    """A creation diff followed by a few random diffs, each from the state before it."""
    state = EMPTY_STATE
    out = []
    first = DiffBuilder(state).set(shard_id=draw(names), schema=b"x").build()
    out.append(first)
    state = state.apply(first)
    for _ in range(draw(st.integers(0, 5))):
        d = draw(diff_steps(state))
        out.append(d)
        state = state.apply(d)
    return out


def replay(diffs: list[StateDiff]) -> ShardState:
    state = EMPTY_STATE
    for d in diffs:
        state = state.apply(d)
    return state


@FAST
@given(histories())
def test_diff_roundtrip_and_apply(diffs: list[StateDiff]) -> None:
    """decode(encode(d)) == d, and applying decoded diffs builds the same state."""
    decoded = [decode(encode(d), where="test") for d in diffs]
    assert decoded == diffs
    direct = replay(diffs)
    assert replay(decoded) == direct
    # A rollup (the full state as one diff from empty) reproduces the state too.
    rollup = decode(encode(full_diff(direct)), where="rollup")
    assert EMPTY_STATE.apply(rollup) == direct


@FAST
@given(histories(), st.data())
def test_corrupt_or_truncated_diff_is_corrupt_data(
    diffs: list[StateDiff], data: st.DataObject
) -> None:
    """Any single-byte change or truncation is CorruptData: never a different state."""
    raw = encode(diffs[-1])
    pos = data.draw(st.integers(0, len(raw) - 1))
    flip = data.draw(st.integers(1, 255))
    corrupted = raw[:pos] + bytes([raw[pos] ^ flip]) + raw[pos + 1 :]
    with pytest.raises(CorruptData):
        decode(corrupted, where="row")
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CorruptData, match="row"):
        decode(raw[:cut], where="row")


def test_diff_not_following_state_is_refused() -> None:
    """A diff from the wrong SeqNo never applies silently."""
    d = DiffBuilder(EMPTY_STATE).set(shard_id="s").build()
    state = EMPTY_STATE.apply(d)
    with pytest.raises(CorruptData):
        state.apply(d)


# --- consolidation ------------------------------------------------------------------------------

updates = st.lists(
    st.tuples(
        st.integers(0, 5), st.sampled_from(["a", "b", None]), st.integers(0, 3), st.integers(-3, 3)
    ),
    max_size=40,
)


def as_table(rows: list[tuple[int, str | None, int, int]]) -> pa.Table:
    schema = pa.schema(
        [("k", pa.int64()), ("s", pa.string()), (TIME, pa.uint64()), (DIFF, pa.int64())]
    )
    cols = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
    return pa.table([list(c) for c in cols], schema=schema)


def sums(table: pa.Table) -> collections.Counter[tuple[Any, ...]]:
    """Per (row, time) diff sums, zeros dropped."""
    out: collections.Counter[tuple[Any, ...]] = collections.Counter()
    for r in table.to_pylist():
        out[(r["k"], r["s"], r[TIME])] += r[DIFF]
    return collections.Counter({k: v for k, v in out.items() if v})


@FAST
@given(updates)
def test_consolidate_properties(rows: list[tuple[int, str | None, int, int]]) -> None:
    """Idempotent, per-(row, time) diff sums preserved, no zero diffs, no repeated rows."""
    table = as_table(rows)
    once = consolidate(table, ["k", "s"])
    assert sums(once) == sums(table)
    assert all(d != 0 for d in once.column(DIFF).to_pylist())
    keys = [(r["k"], r["s"], r[TIME]) for r in once.to_pylist()]
    assert len(keys) == len(set(keys))
    twice = consolidate(once, ["k", "s"])
    assert sorted(map(str, twice.to_pylist())) == sorted(map(str, once.to_pylist()))
    assert once.schema == table.schema


# --- corrupt parts ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored_part(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str, str, bytes]:
    """A file/sqlite shard with one Blob part: (blob uri, consensus uri, part key, bytes)."""
    root = tmp_path_factory.mktemp("corrupt")
    blob, cons = f"file://{root}/blob", f"sqlite:///{root}/c.db"
    with PersistClient.open(blob, cons, config=PersistConfig(inline_write_max_bytes=1)) as c:
        shard = c.open_shard("corrupt", pa.schema([("v", pa.int64()), ("s", pa.string())]))
        shard.writer().compare_and_append(
            pa.table({"v": list(range(300)), "s": [f"r{i}" for i in range(300)]}), 0, 1
        )
        (part,) = [p for b in shard.state().batches.values() for p in b.parts]
        assert part.key is not None
        return blob, cons, part.key, c.blob.get(part.key) or b""


def _read_with(stored: tuple[str, str, str, bytes], data: bytes) -> pa.Table:
    blob, cons, key, _ = stored
    with PersistClient.open(blob, cons) as c:
        c.blob.set(key, data)
        return c.open_shard("corrupt").reader().snapshot_table()


@pytest.mark.parametrize("mode", ["snapshot_table", "iter_snapshot"])
def test_truncated_part_is_corrupt_data(
    stored_part: tuple[str, str, str, bytes], mode: str
) -> None:
    """A truncated part is CorruptData naming the part, on every read path."""
    blob, cons, key, good = stored_part
    try:
        with PersistClient.open(blob, cons) as c:
            c.blob.set(key, good[: len(good) // 2])
            reader = c.open_shard("corrupt").reader()
            with pytest.raises(CorruptData, match=key.rsplit("/", 1)[1]):
                if mode == "snapshot_table":
                    reader.snapshot_table()
                else:
                    list(reader.iter_snapshot())
    finally:
        _read_with(stored_part, good)


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_corrupt_part_never_silently_wrong(
    stored_part: tuple[str, str, str, bytes], data: st.DataObject
) -> None:
    """A flipped byte anywhere in a part gives CorruptData or the right answer, never another."""
    good = stored_part[3]
    pos = data.draw(st.integers(0, len(good) - 1))
    bad = good[:pos] + bytes([good[pos] ^ data.draw(st.integers(1, 255))]) + good[pos + 1 :]
    try:
        try:
            table = _read_with(stored_part, bad)
        except CorruptData as e:
            assert stored_part[2].rsplit("/", 1)[1] in str(e)
            return
        except PersistError:
            raise
        rows = sorted((r["v"], r["s"]) for r in table.to_pylist())
        assert rows == [(i, f"r{i}") for i in range(300)], f"byte {pos}: a wrong answer"
    finally:
        _read_with(stored_part, good)
