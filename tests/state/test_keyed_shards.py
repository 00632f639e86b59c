"""Keyed shards: keys are part of the shard's durable state, checked before anything is written."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.diff import decode, encode, full_diff
from pyspark_persist.state.errors import InvalidUsage, KeysMismatch, ShardNotFound
from pyspark_persist.state.state import EMPTY_STATE

SCHEMA = pa.schema([("region", pa.string()), ("id", pa.int64()), ("name", pa.string())])


@pytest.fixture
def mem() -> PersistClient:
    return PersistClient.open("mem://", "mem://", config=PersistConfig(maintenance=False))


def test_keys_survive_reopening_from_another_client(client: PersistClient, shard_name: str) -> None:
    client.open_shard(shard_name, SCHEMA, keys=["region", "id"])
    other = PersistClient.open(client.blob.uri, client.consensus.uri)
    try:
        assert other.open_shard(shard_name).keys == ("region", "id")
        assert other.open_shard(shard_name, SCHEMA, keys=["region", "id"]).keys == ("region", "id")
    finally:
        other.close()


def test_other_keys_are_refused_naming_both(mem: PersistClient) -> None:
    mem.open_shard("customers", SCHEMA, keys=["id"])
    with pytest.raises(KeysMismatch, match=r"keys \['id'\].*names keys \['region', 'id'\]"):
        mem.open_shard("customers", SCHEMA, keys=["region", "id"])
    mem.open_shard("plain", SCHEMA)
    with pytest.raises(KeysMismatch, match=r"no keys \(an unkeyed shard\).*\['id'\]"):
        mem.open_shard("plain", SCHEMA, keys=["id"])
    assert mem.open_shard("plain").keys == ()


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            ["nope"],
            r"'nope' of shard 'bad' is not a column of its schema \(region, id, name, score\)",
        ),
        (["score"], r"key column 'score' .* has type double, which cannot be a key"),
        ([], r"keys of shard 'bad' is empty"),
        (["id", "id"], r"name a column twice"),
        ("id", r"must be a list"),
    ],
)
def test_bad_keys_are_refused_before_anything_is_written(
    mem: PersistClient, keys: object, message: str
) -> None:
    schema = SCHEMA.append(pa.field("score", pa.float64()))
    with pytest.raises(InvalidUsage, match=message):
        mem.open_shard("bad", schema, keys=keys)  # type: ignore[arg-type]
    with pytest.raises(ShardNotFound):
        mem.open_shard("bad")
    assert mem.consensus.list_keys() == []


def test_keys_round_trip_through_diffs_and_rollups_and_old_states_read_unkeyed(
    mem: PersistClient,
) -> None:
    shard = mem.open_shard("k", SCHEMA, keys=["id"])
    state = shard.state()
    rolled = EMPTY_STATE.apply(decode(encode(full_diff(state)), where="test"))
    assert rolled.keys == ("id",)
    unkeyed = mem.open_shard("u", SCHEMA).state()
    body = encode(full_diff(unkeyed))
    assert b'"keys"' not in body  # a rollup of an unkeyed shard reads as before keys existed
    assert EMPTY_STATE.apply(decode(body, where="test")).keys == ()
