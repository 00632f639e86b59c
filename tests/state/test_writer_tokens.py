"""Idempotency tokens of the Python API: no write is silently dropped or applied twice.

Issue 13, items 6 to 8. Faults come from the unreliable Consensus wrapper:
a lost reply is a compare-and-set that landed but raised Indeterminate.

- Two live handles of one ``writer_id`` number their automatic tokens under
  identities of their own, so neither drops the other's writes.
- A token is spent when a commit is attempted: after a lost reply the next,
  different write gets a new token and lands.
- An unknown outcome that the machine could not resolve before its deadline
  is raised as Indeterminate, never as a Determinate StoreUnavailable.
- Idempotency across handles and restarts is explicit: the caller passes the
  token it will resend.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator

import pyarrow as pa
import pytest

from pyspark_persist.state import AlreadyCommitted, Committed, PersistClient, PersistConfig
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import Indeterminate
from pyspark_persist.state.unreliable import Faults, UnreliableConsensus

SCHEMA = pa.schema([("v", pa.int64())])
LOSE_ONE_CAS_REPLY = Faults(
    seed=5, fail_after=1.0, max_faults=1, ops=frozenset({"compare_and_set"})
)
"""The next compare_and_set lands, and its caller is told Indeterminate."""


def rows(values: list[int] | range) -> pa.Table:
    """A table of the test schema."""
    return pa.table({"v": list(values)}, schema=SCHEMA)


def values(client: PersistClient, shard: str) -> collections.Counter[int]:
    """The multiset of ``v`` in the shard, read with a fresh cache and no faults."""
    with PersistClient(
        open_blob(client.blob.uri), open_consensus(client.consensus.uri), cache=StateCache()
    ) as check:
        table = check.open_shard(shard).reader().snapshot_table()
    counts: collections.Counter[int] = collections.Counter()
    for v, d in zip(table.column("v").to_pylist(), table.column("_diff").to_pylist(), strict=True):
        counts[v] += d
    return +counts


class Lossy:
    """A client whose Consensus loses replies (``inner``) and, optionally, refuses reads."""

    def __init__(self, config: PersistConfig, reads: Faults | None = None) -> None:
        tag = uuid.uuid4().hex
        self.inner = UnreliableConsensus(
            open_consensus(f"mem://{tag}"), LOSE_ONE_CAS_REPLY, enabled=False
        )
        self.reads = UnreliableConsensus(self.inner, reads or Faults(seed=0), enabled=False)
        self.client = PersistClient(
            open_blob(f"mem://{tag}"), self.reads, config=config, cache=StateCache()
        )


@pytest.fixture
def lossy() -> Iterator[Lossy]:
    """A Lossy client whose retry budget is over before the first retry."""
    stores = Lossy(PersistConfig(retry_timeout_s=1e-9))
    yield stores
    stores.client.close()


def test_two_live_handles_of_one_writer_id_both_land() -> None:
    """Item 6: two handles of one writer_id interleave automatic-token writes; none is dropped,
    and a lost reply on one of them is still resolved by its own token (applied once)."""
    stores = Lossy(PersistConfig())
    shard = stores.client.open_shard("s", SCHEMA)
    first, second = shard.writer("app"), shard.writer("app")
    assert isinstance(first.append(rows([1])), Committed)
    assert isinstance(second.append(rows([2])), Committed)
    stores.inner.enabled = True
    third = first.append(rows([3]))
    assert isinstance(third, AlreadyCommitted) and third.token == 2
    assert stores.inner.injected["fail_after"] == 1
    u = first.fetch_upper()
    assert isinstance(second.compare_and_append(rows([4]), u, u + 1), Committed)
    assert values(stores.client, "s") == collections.Counter([1, 2, 3, 4])
    stores.client.close()


@pytest.mark.parametrize("call", ["compare_and_append", "append"])
def test_write_after_lost_reply_never_reuses_its_token(lossy: Lossy, call: str) -> None:
    """Item 7: a write whose reply was lost (it landed; the caller saw Indeterminate) spends its
    token: the next, different write of the handle lands instead of being dropped."""
    shard = lossy.client.open_shard("s", SCHEMA)
    writer = shard.writer("app")

    def write(data: pa.Table) -> object:
        if call == "append":
            return writer.append(data)
        upper = writer.fetch_upper()
        return writer.compare_and_append(data, upper, upper + 1)

    lossy.inner.enabled = True
    with pytest.raises(Indeterminate):
        write(rows([10, 11]))
    assert lossy.inner.injected["fail_after"] == 1
    assert isinstance(write(rows([20])), Committed)
    assert values(lossy.client, "s") == collections.Counter([10, 11, 20])


def test_unknown_outcome_past_the_deadline_is_indeterminate() -> None:
    """Item 7: the reply of a commit that landed is lost, then every read fails until the retry
    deadline. The caller gets Indeterminate (it may have landed), not StoreUnavailable; resending
    with the same token then answers AlreadyCommitted, and the rows are there once."""
    refuse_reads = Faults(seed=9, fail_before=1.0, ops=frozenset({"head", "scan"}))
    stores = Lossy(PersistConfig(retry_timeout_s=0.3), reads=refuse_reads)
    shard = stores.client.open_shard("s", SCHEMA)
    writer = shard.writer("app")
    stores.inner.enabled = stores.reads.enabled = True
    with pytest.raises(Indeterminate, match="outcome is unknown"):
        writer.compare_and_append(rows([7]), 0, 1, token=1)
    assert stores.inner.injected["fail_after"] == 1
    assert stores.reads.injected["fail_before"] >= 1
    stores.inner.enabled = stores.reads.enabled = False
    assert writer.compare_and_append(rows([7]), 0, 1, token=1) == AlreadyCommitted(1, 1)
    assert values(stores.client, "s") == collections.Counter([7])
    stores.client.close()


def test_resend_with_the_callers_token_applies_once(lossy: Lossy) -> None:
    """Item 8: idempotency is explicit. A resend through a new handle (a restarted process) with
    the token the caller used is AlreadyCommitted; a write without a token claims nothing and a
    resend of it lands again, as the idempotency contract (docs/idempotency.md) says."""
    shard = lossy.client.open_shard("s", SCHEMA)
    lossy.inner.enabled = True
    with pytest.raises(Indeterminate):
        shard.writer("app").append(rows([1, 2]), token=7)
    restarted = shard.writer("app")
    assert isinstance(restarted.append(rows([1, 2]), token=7), AlreadyCommitted)
    assert isinstance(restarted.append(rows([3]), token=8), Committed)
    assert values(lossy.client, "s") == collections.Counter([1, 2, 3])

    shard.writer("app").append(rows([9]))
    shard.writer("app").append(rows([9]))
    assert values(lossy.client, "s")[9] == 2
