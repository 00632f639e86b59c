"""Failures between and around the two halves of a write: exactly-once survives them.

- A process that staged parts and died before committing changes nothing
  visible: the shard is untouched, the orphaned parts sit unreferenced.
- A compare-and-set whose reply is lost (it landed, the caller was told
  Indeterminate) is retried by the machine, or by the caller with the same
  token, and answered AlreadyCommitted: the rows appear once.
- A randomized run through fault-injecting stores: every acknowledged write
  appears exactly once, every write whose outcome was an error at most once.
"""

from __future__ import annotations

import collections
import json
import multiprocessing
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pytest

from pyspark_persist.state import (
    AlreadyCommitted,
    Committed,
    PersistClient,
    PersistConfig,
    UpperMismatch,
    WriteHandle,
)
from pyspark_persist.state.blob import Blob, open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import Consensus, open_consensus
from pyspark_persist.state.errors import Indeterminate, PersistError, StoreUnavailable
from pyspark_persist.state.state import ShardState
from pyspark_persist.state.unreliable import Faults, UnreliableBlob, UnreliableConsensus

SCHEMA = pa.schema([("v", pa.int64())])
TIMEOUT_S = 60.0
STAGED_ROWS = 50_000
SMALL_PARTS = 128 * 1024
"""part_target_bytes for the staging child, so its 50,000 rows become several parts."""


def rows(values: list[int] | range) -> pa.Table:
    """A table of the test schema."""
    return pa.table({"v": list(values)}, schema=SCHEMA)


def values_of(table: pa.Table) -> collections.Counter[int]:
    """The multiset of ``v`` a consolidated table denotes (each row counted ``_diff`` times)."""
    counts: collections.Counter[int] = collections.Counter()
    for v, d in zip(table.column("v").to_pylist(), table.column("_diff").to_pylist(), strict=True):
        counts[v] += d
    return counts


def referenced_keys(state: ShardState) -> set[str]:
    """Every Blob part key the state's batches reference."""
    return {p.key for b in state.batches.values() for p in b.parts if p.key is not None}


class Stores(NamedTuple):
    """The reliable stores of a location and fault-injecting wrappers around them."""

    blob: Blob
    consensus: Consensus
    unreliable_blob: UnreliableBlob
    unreliable_consensus: UnreliableConsensus


def open_stores(location: tuple[str, str], blob_faults: Faults, cons_faults: Faults) -> Stores:
    """Open the location's stores and wrap them, with faults initially off."""
    blob = open_blob(location[0])
    consensus = open_consensus(location[1])
    return Stores(
        blob,
        consensus,
        UnreliableBlob(blob, blob_faults, enabled=False),
        UnreliableConsensus(consensus, cons_faults, enabled=False),
    )


def verify_client(location: tuple[str, str]) -> PersistClient:
    """A client straight on the reliable stores, sharing no cached state with the test's."""
    return PersistClient(open_blob(location[0]), open_consensus(location[1]), cache=StateCache())


# --- the fault injectors themselves ---------------------------------------------------------


def test_unreliable_wrappers_semantics() -> None:
    """fail_before never reaches the store; fail_after does and then loses the reply."""
    from pyspark_persist.state.blob.mem import MemBlob
    from pyspark_persist.state.consensus import CaSCommitted, VersionedData
    from pyspark_persist.state.consensus.mem import MemConsensus

    blob = UnreliableBlob(MemBlob.from_uri("mem://"), Faults(seed=1, fail_before=1.0))
    with pytest.raises(StoreUnavailable):
        blob.set("a", b"1")
    blob.enabled = False
    assert blob.get("a") is None and blob.injected["fail_before"] == 1

    blob = UnreliableBlob(MemBlob.from_uri("mem://"), Faults(seed=1, fail_after=1.0))
    with pytest.raises(Indeterminate):
        blob.set("a", b"1")
    with pytest.raises(StoreUnavailable):  # a read has no effect to lose: refused up front
        blob.get("a")
    assert blob.inner.get("a") == b"1"

    cons = UnreliableConsensus(
        MemConsensus.from_uri("mem://"),
        Faults(seed=1, timeout=1.0, slow_s=0.001, max_faults=1, ops=frozenset({"compare_and_set"})),
    )
    assert cons.head("k") is None  # not in ops
    with pytest.raises(Indeterminate, match="timed out"):
        cons.compare_and_set("k", None, VersionedData(1, b"x"))
    assert cons.head("k") == VersionedData(1, b"x")
    assert cons.compare_and_set("k", 1, VersionedData(2, b"y")) == CaSCommitted()  # budget spent
    assert cons.injected == {"fail_before": 0, "fail_after": 0, "timeout": 1, "slow": 0}


def test_unreliable_is_reproducible_from_seed() -> None:
    """The same seed injects the same faults on the same sequence of calls."""
    from pyspark_persist.state.blob.mem import MemBlob

    def kinds(seed: int) -> list[str]:
        blob = UnreliableBlob(
            MemBlob.from_uri("mem://"), Faults(seed=seed, fail_before=0.3, fail_after=0.3)
        )
        out = []
        for i in range(200):
            try:
                blob.set(f"k{i}", b"v")
                out.append("ok")
            except PersistError as e:
                out.append(type(e).__name__)
        return out

    assert kinds(5) == kinds(5)
    assert kinds(5) != kinds(6)
    assert {"ok", "StoreUnavailable", "Indeterminate"} == set(kinds(5))


# --- crash between staging and commit -------------------------------------------------------


def _stage_and_crash(blob_uri: str, consensus_uri: str, shard_name: str, keys_path: str) -> None:
    """Child process: stage STAGED_ROWS rows in several parts, record their keys, then die."""
    client = PersistClient.open(
        blob_uri, consensus_uri, config=PersistConfig(part_target_bytes=SMALL_PARTS)
    )
    builder = client.open_shard(shard_name).writer().builder()
    builder.add(rows(range(1_000, 1_000 + STAGED_ROWS)))
    staged = builder.finish()
    with open(keys_path, "w") as f:
        json.dump([p.key for p in staged.parts], f)
        f.flush()
        os.fsync(f.fileno())
    os._exit(1)  # no commit, no cleanup, no atexit: a crash


@pytest.mark.slow
def test_crash_between_stage_and_commit(
    client: PersistClient, location: tuple[str, str], shard_name: str, tmp_path: Path
) -> None:
    """A writer dying after staging leaves the shard untouched and its parts unreferenced."""
    if location[0].startswith("mem://"):
        pytest.skip("mem:// stores are private to one process")
    shard = client.open_shard(shard_name, SCHEMA)
    shard.writer().compare_and_append(rows(range(10)), 0, 1)
    before = shard.state()
    snap_before = shard.reader().snapshot_table()

    keys_path = tmp_path / "staged-keys.json"
    proc = multiprocessing.get_context("spawn").Process(
        target=_stage_and_crash, args=(*location, shard_name, str(keys_path))
    )
    proc.start()
    proc.join(timeout=TIMEOUT_S)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the staging child did not finish")
    assert proc.exitcode == 1
    staged_keys = json.loads(keys_path.read_text())
    assert len(staged_keys) > 1 and all(staged_keys), "expected several Blob parts, none inline"

    after = shard.state()
    assert after.upper == before.upper == 1
    # (Readers may register leases in state; the data and the writers must not change.)
    assert dict(after.batches) == dict(before.batches), "staging must not change the trace"
    assert dict(after.writers) == dict(before.writers)
    assert shard.reader().snapshot_table().equals(snap_before)
    for key in staged_keys:
        assert client.blob.get(key) is not None, f"staged part {key} vanished"
    assert not set(staged_keys) & referenced_keys(after), "state references uncommitted parts"
    listed = {m.key for m in client.blob.list_keys(f"{shard_name}/")}
    assert set(staged_keys) <= listed


# --- unknown outcome of a compare-and-set ---------------------------------------------------


@pytest.fixture
def lossy(location: tuple[str, str]) -> Iterator[tuple[PersistClient, UnreliableConsensus]]:
    """A client whose Consensus will lose the reply of exactly one compare_and_set."""
    faults = Faults(seed=7, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set"}))
    stores = open_stores(location, Faults(seed=0), faults)
    c = PersistClient(stores.blob, stores.unreliable_consensus, cache=StateCache())
    yield c, stores.unreliable_consensus
    c.close()


@pytest.mark.parametrize("n_rows", [3, 2_000], ids=["inline", "blob-part"])
def test_lost_cas_reply_retried_by_machine(
    lossy: tuple[PersistClient, UnreliableConsensus],
    location: tuple[str, str],
    shard_name: str,
    n_rows: int,
) -> None:
    """The machine retries a CaS that landed but reported Indeterminate: AlreadyCommitted, once."""
    client, consensus = lossy
    shard = client.open_shard(shard_name, SCHEMA)
    writer = shard.writer()
    consensus.enabled = True
    res = writer.compare_and_append(rows(range(n_rows)), 0, 1)
    assert isinstance(res, AlreadyCommitted | Committed)
    assert res == AlreadyCommitted(token=1, upper=1), "the retry should find its own token"
    assert consensus.injected["fail_after"] == 1
    assert client.metrics.cas_retries_after_error == 1

    # The writer moves on to its next token; the landed parts were not deleted.
    assert isinstance(writer.compare_and_append(rows([-1]), 1, 2), Committed)
    consensus.enabled = False
    with verify_client(location) as check:
        table = check.open_shard(shard_name).reader().snapshot_table()
        assert values_of(table) == collections.Counter([*range(n_rows), -1])
        assert check.open_shard(shard_name).upper == 2


@pytest.mark.parametrize("fault", ["fail_after", "fail_before"])
def test_caller_retries_with_same_token(
    location: tuple[str, str], shard_name: str, fault: str
) -> None:
    """A caller that got an error retries with its explicit token: applied exactly once."""
    faults = Faults(seed=3, max_faults=1, ops=frozenset({"compare_and_set"}), **{fault: 1.0})
    stores = open_stores(location, Faults(seed=0), faults)
    # A retry budget that is over before the first retry: the error reaches the caller.
    config = PersistConfig(retry_timeout_s=1e-9)
    with PersistClient(
        stores.blob, stores.unreliable_consensus, config=config, cache=StateCache()
    ) as client:
        shard = client.open_shard(shard_name, SCHEMA)
        writer = shard.writer("caller")
        stores.unreliable_consensus.enabled = True
        data = rows(range(100, 2_100))
        expected_error = Indeterminate if fault == "fail_after" else StoreUnavailable
        with pytest.raises(expected_error):
            writer.compare_and_append(data, 0, 1, token=41)
        assert stores.unreliable_consensus.injected[fault] == 1
        again = writer.compare_and_append(data, 0, 1, token=41)
        if fault == "fail_after":
            assert again == AlreadyCommitted(token=41, upper=1)
        else:
            assert isinstance(again, Committed) and again.upper == 1
        # A third attempt, even at the now-current upper, is still recognised.
        assert writer.compare_and_append(data, 1, 2, token=41) == AlreadyCommitted(41, 1)
        assert values_of(shard.reader().snapshot_table()) == collections.Counter(range(100, 2_100))
        assert shard.upper == 1


# --- randomized faults ----------------------------------------------------------------------

WRITERS = 4
WRITES_PER_WRITER = 15
ATTEMPTS_PER_WRITE = 2
BIG_ROWS = 600
"""Rows of every third write: too big to ride inline, so it goes through Blob."""


class Outcome(NamedTuple):
    """What a writer learned about one of its writes."""

    values: tuple[int, ...]
    acknowledged: bool
    errors: int


def random_writer(writer: WriteHandle, tag: int) -> list[Outcome]:
    """Write WRITES_PER_WRITER batches with explicit tokens, retrying errors with the same token."""
    outcomes = []
    for i in range(WRITES_PER_WRITER):
        n = BIG_ROWS if i % 3 == 2 else 2
        values = tuple(tag * 1_000_000 + i * 1_000 + k for k in range(n))
        data = rows(list(values))
        token = i + 1
        errors = 0
        acknowledged = False
        upper = writer.upper
        while errors < ATTEMPTS_PER_WRITE:
            try:
                res = writer.compare_and_append(data, upper, upper + 1, token=token)
            except PersistError as e:
                assert isinstance(e, StoreUnavailable | Indeterminate), repr(e)
                errors += 1
                upper = writer.upper
                continue
            if isinstance(res, UpperMismatch):
                upper = res.current
                continue
            assert isinstance(res, Committed | AlreadyCommitted)
            acknowledged = True
            break
        outcomes.append(Outcome(values, acknowledged, errors))
    return outcomes


@pytest.mark.parametrize(
    ("seed", "retry_timeout_s", "timeout"),
    [(11, 0.05, 0.0), (12, 1e-9, 0.0), (13, 0.05, 0.05)],
    ids=["machine-retries", "caller-retries", "with-timeouts"],
)
def test_randomized_faults_exactly_once(
    location: tuple[str, str],
    shard_name: str,
    seed: int,
    retry_timeout_s: float,
    timeout: float,
) -> None:
    """Random lost and refused calls: acknowledged writes land once, failed ones at most once.

    ``retry_timeout_s=1e-9`` hands every Consensus error straight to the caller,
    so caller-level retries with the same token (and writes that landed but
    were reported failed) are exercised, not only the machine's own retries.
    """
    stores = open_stores(
        location,
        Faults(seed=seed, fail_before=0.05, fail_after=0.05),
        Faults(
            seed=seed + 1000,
            fail_before=0.1,
            fail_after=0.1,
            timeout=timeout,
            slow=timeout,
            slow_s=0.002,
        ),
    )
    config = PersistConfig(retry_timeout_s=retry_timeout_s)
    client = PersistClient(
        stores.unreliable_blob, stores.unreliable_consensus, config=config, cache=StateCache()
    )
    try:
        shard = client.open_shard(shard_name, SCHEMA)
        writers = [shard.writer(f"writer-{t}") for t in range(WRITERS)]
        stores.unreliable_blob.enabled = True
        stores.unreliable_consensus.enabled = True
        results: list[list[Outcome]] = [[] for _ in range(WRITERS)]
        failures: list[BaseException] = []

        def run(t: int) -> None:
            try:
                results[t] = random_writer(writers[t], t + 1)
            except BaseException as e:  # noqa: BLE001 - surfaced below
                failures.append(e)

        threads = [threading.Thread(target=run, args=(t,)) for t in range(WRITERS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=TIMEOUT_S)
        stores.unreliable_blob.enabled = False
        stores.unreliable_consensus.enabled = False
        assert not failures, failures
        assert not any(th.is_alive() for th in threads)
    finally:
        client.close()

    assert sum(stores.unreliable_consensus.injected.values()) > 0
    assert sum(stores.unreliable_blob.injected.values()) > 0
    outcomes = [o for per_writer in results for o in per_writer]
    assert len(outcomes) == WRITERS * WRITES_PER_WRITER
    assert any(o.acknowledged for o in outcomes)

    with verify_client(location) as check:
        shard = check.open_shard(shard_name)
        state = shard.state()
        state.check_invariants()
        got = values_of(shard.reader().snapshot_table())
        for key in referenced_keys(state):
            assert check.blob.get(key) is not None, f"committed part {key} was deleted"
    assert set(got.values()) <= {1}, "some row was applied twice"
    for o in outcomes:
        present = [got[v] for v in o.values]
        if o.acknowledged:
            assert present == [1] * len(o.values), f"acknowledged write lost: {o}"
        else:
            assert present in ([0] * len(o.values), [1] * len(o.values)), (
                f"a failed write must land whole or not at all: {o}"
            )
    expected_keys = {v for o in outcomes for v in o.values}
    assert set(got) <= expected_keys, "rows nobody wrote"
