"""The ``txns`` piece's cut check (:func:`checker_txns.check_cut`) on hand-made cuts: it
passes a consistent one and names each way a cut can break a transaction."""

from __future__ import annotations

import pyarrow as pa

from pyspark_persist.tools import checker_txns as ct


def plain(*rows: tuple[int, int, int]) -> pa.Table:
    """(txn, row, diff) rows of a plain member, consolidated at time 9."""
    return pa.table(
        {
            "txn": [r[0] for r in rows],
            "row": [r[1] for r in rows],
            "_time": [9] * len(rows),
            "_diff": [r[2] for r in rows],
        }
    )


def keyed(*rows: tuple[int, int]) -> pa.Table:
    """(k, txn) rows of the keyed member."""
    return pa.table(
        {
            "k": [r[0] for r in rows],
            "txn": [r[1] for r in rows],
            "_time": [9] * len(rows),
            "_diff": [1] * len(rows),
        }
    )


def book() -> ct.TxnBook:
    """Transaction 1 wrote one row to s0 and two to s1 and key 0, acknowledged at 5;
    transaction 2 (same writer, later) wrote s1 and key 0, acknowledged at 12."""
    b = ct.TxnBook()
    b.specs[1] = ct.TxnSpec(1, {"s0": 1, "s1": 2}, 0)
    b.specs[2] = ct.TxnSpec(2, {"s1": 1}, 0)
    b.acked.update({1: 5, 2: 12})
    return b


def test_a_consistent_cut_passes() -> None:
    cut = {"s0": plain((1, 0, 1)), "s1": plain((1, 0, 1), (1, 1, 1))}
    assert ct.check_cut(9, cut, keyed((0, 1)), book()) == []


def test_half_a_transaction_a_duplicate_and_a_missing_one_are_named() -> None:
    half = {"s0": plain((1, 0, 1)), "s1": plain()}
    text = " ".join(ct.check_cut(9, half, keyed(), book()))
    assert "shows in ['s0'] but not in ['s1'] (half a transaction)" in text
    assert "holds key 0 = transaction None" in text  # the keyed share is missing too
    twice = {"s0": plain((1, 0, 2)), "s1": plain((1, 0, 1), (1, 1, 1))}
    assert any("diff 2" in v for v in ct.check_cut(9, twice, keyed((0, 1)), book()))
    none = {"s0": plain(), "s1": plain()}
    assert ct.check_cut(9, none, keyed(), book()) == [
        "txns: cut at 9: transaction 1 acknowledged at 5 is missing"
    ]


def test_a_keyed_share_without_its_plain_ones_or_a_stale_key_is_named() -> None:
    cut = {"s0": plain((1, 0, 1)), "s1": plain((1, 0, 1), (1, 1, 1), (2, 0, 1))}
    # At 13 transaction 2 shows in s1, so key 0 must hold it, not transaction 1.
    text = " ".join(ct.check_cut(13, cut, keyed((0, 1)), book()))
    assert "holds key 0 = transaction 1" in text and "newest" in text
