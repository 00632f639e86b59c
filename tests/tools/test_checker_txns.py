"""The ``txns`` piece's cut check (:func:`checker_txns.check_cut`) on hand-made cuts: it
passes a consistent one and names each way a cut can break a transaction."""

from __future__ import annotations

import pyarrow as pa

from pyspark_persist.tools import checker_txns as ct

A, B = ct.ID_STRIDE + 1, ct.ID_STRIDE + 2
"""The first two transactions of writer group 1."""


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
    """Transaction A wrote one row to s0 and two to s1 and key 0, acknowledged at 5;
    transaction B (same writer, next) wrote s1 and key 0, acknowledged at 12."""
    b = ct.TxnBook()
    a = ct.TxnSpec(A, {"s0": 1, "s1": 2}, 0)
    b.plan(a)
    b.plan(ct.TxnSpec(B, {"s1": 1}, 0))
    b.ack(A, 5)
    b.ack(B, 12)
    return b


def test_a_consistent_cut_passes() -> None:
    cut = {"s0": plain((A, 0, 1)), "s1": plain((A, 0, 1), (A, 1, 1))}
    assert ct.check_cut(9, cut, keyed((0, A)), book()) == []


def test_half_a_transaction_a_duplicate_and_a_missing_one_are_named() -> None:
    half = {"s0": plain((A, 0, 1)), "s1": plain()}
    text = " ".join(ct.check_cut(9, half, keyed((0, A)), book()))
    assert "shows in ['s0'] but not in ['s1'] (half a transaction)" in text
    twice = {"s0": plain((A, 0, 2)), "s1": plain((A, 0, 1), (A, 1, 1))}
    assert any("diff 2" in v for v in ct.check_cut(9, twice, keyed((0, A)), book()))
    none = {"s0": plain(), "s1": plain()}
    assert ct.check_cut(9, none, keyed(), book()) == [
        f"txns: cut at 9: transaction {A} acknowledged at 5 is missing"
    ]


def test_a_keyed_share_without_its_plain_ones_or_a_stale_key_is_named() -> None:
    alone = {"s0": plain(), "s1": plain()}
    text = " ".join(ct.check_cut(3, alone, keyed((0, A)), book()))
    assert f"holds key 0 = transaction {A}, but the newest committed" in text
    cut = {"s0": plain((A, 0, 1)), "s1": plain((A, 0, 1), (A, 1, 1), (B, 0, 1))}
    # At 13 transaction B shows, so key 0 must hold it, not A.
    text = " ".join(ct.check_cut(13, cut, keyed((0, A)), book()))
    assert f"holds key 0 = transaction {A}" in text and f"upserting it is {B}" in text


def test_a_retraction_missing_or_landed_early_is_named() -> None:
    """Transactions 1..LIVE_TXNS + 1 of one writer, each one row in s0; the last retracts
    the first. A cut shows exactly the newest LIVE_TXNS of them."""
    b = ct.TxnBook()
    specs: list[ct.TxnSpec] = []
    for n in range(ct.LIVE_TXNS + 1):
        retracts = specs[n - ct.LIVE_TXNS] if n >= ct.LIVE_TXNS else None
        specs.append(ct.TxnSpec(A + n, {"s0": 1}, None, retracts))
        b.plan(specs[-1])
        b.ack(A + n, 5 + n)
    newest = plain(*((s.txn, 0, 1) for s in specs[1:]))
    assert ct.check_cut(20, {"s0": newest}, keyed(), b) == []
    kept = plain(*((s.txn, 0, 1) for s in specs))
    text = " ".join(ct.check_cut(20, {"s0": kept}, keyed(), b))
    assert f"transaction {A} shows, yet {A + ct.LIVE_TXNS}" in text
    early = plain(*((s.txn, 0, 1) for s in specs[2:]))
    text = " ".join(ct.check_cut(20, {"s0": early}, keyed(), b))
    assert f"transaction {A + 1} is missing" in text


def test_the_final_cut_holds_exactly_the_live_plain_appends() -> None:
    b = book()
    b.plain_live.update({7, 8})
    cut = {"s0": plain((A, 0, 1), (-7, 0, 1), (-9, 0, 1)), "s1": plain((A, 0, 1), (A, 1, 1))}
    text = " ".join(ct.check_cut(9, cut, keyed((0, A)), b, final=True))
    assert "acknowledged plain append 8 is missing" in text
    assert "plain append 9 shows, but it was never acknowledged or its retraction was" in text
