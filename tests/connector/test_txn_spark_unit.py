"""``pyspark_persist.txn``'s refusals, JVM-free: each raises before any Spark job or store write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import pyspark_persist
from pyspark_persist.state.errors import InvalidUsage


class NoFrame:
    """Stands for a DataFrame the helper must not touch (it refuses first)."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the DataFrame was used ({name}) before the refusal")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"writerId": ""}, "give writerId="),
        ({"writerId": "etl", "txnVersion": -1}, "must be an integer 0 or more"),
        ({"writerId": "etl", "txnVersion": True}, "must be an integer 0 or more"),
    ],
)
def test_bad_identity_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidUsage, match=message):
        pyspark_persist.txn(None, **kwargs)  # type: ignore[arg-type]


def test_merge_schema_and_an_empty_transaction_are_refused(tmp_path: Path) -> None:
    location = {"blob": f"file://{tmp_path}/blob", "consensus": f"sqlite:///{tmp_path}/c.db"}
    t = pyspark_persist.txn(None, writerId="etl", txnVersion=0, **location)  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match="mergeSchema is not offered in a transaction"):
        t.append(NoFrame(), "orders", mergeSchema="true")  # type: ignore[arg-type]
    with pytest.raises(InvalidUsage, match="names no shard"), t:
        pass
    assert not (tmp_path / "blob").exists()
