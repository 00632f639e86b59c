"""The randomized checker (``pyspark_persist.tools.checker``) in CI: short budgets, zero violations.

Each run must actually do something (operations checked, faults injected),
and the checker must be able to fail: with a deliberate bug injected it
reports violations. Longer runs: ``python -m pyspark_persist.tools.checker
--seconds 3600 --backend file-sqlite --processes 2`` (see the module doc).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state.errors import StoreUnavailable
from pyspark_persist.tools import checker

BUDGET_S = float(os.environ.get("PERSIST_CHECK_SECONDS", "5"))
"""Workload seconds per CI run; raise it to check harder."""


Expect = Callable[[checker.Report], list[str]]
"""What a clean run must have done: the unmet expectations, by name (empty when all are met)."""

RUNS = 3
"""Runs a clean test may take: each starved run (too little done for its checks to mean
anything) is followed by one twice as long."""


def busy(report: checker.Report) -> list[str]:
    """What every clean run must have done, with every fault kind's piece running."""
    ops, faults = report.ops, report.faults
    need = {
        "writes_checked > 20": ops["writes_checked"] > 20,
        "snapshots_checked": ops["snapshots_checked"] > 0,
        "listen_events": ops["listen_events"] > 0,
        "writes_acked": ops["writes_acked"] > 0,
        "fail_before and fail_after faults": bool(faults["fail_before"] and faults["fail_after"]),
        # Lost replies reached the writers, so the indeterminate path was exercised.
        "write_errors_Indeterminate": ops["write_errors_Indeterminate"] > 0,
    }
    return [name for name, met in need.items() if not met]


def run_clean(expect: Expect, **kwargs: Any) -> checker.Report:
    """Run the checker until a run does what ``expect`` asks, for at most :data:`RUNS` runs
    of ``BUDGET_S`` (or ``duration_s``), doubled each time; assert no run had a violation
    and the last one did it all.

    The runs are of fixed length, and on a loaded machine (CI's neighbours, Spark's JVMs
    beside) a short one may get too few turns: on one core, the file/sqlite run of every
    piece once acknowledged 13 writes in 5 s, none of them after a lost reply. A starved run
    is not a failure of persist; a violation in any run is.
    """
    seconds = kwargs.pop("duration_s", BUDGET_S)
    for _ in range(RUNS):
        report = checker.run(duration_s=seconds, **kwargs)
        print(report.render())
        assert report.ok, report.render()
        unmet = expect(report)
        if not unmet:
            return report
        print(f"... a starved run ({', '.join(unmet)} not met): again for {2 * seconds:.1f} s")
        seconds *= 2
    raise AssertionError(f"{RUNS} runs never met {unmet}:\n{report.render()}")


def _piece(*names: str, expect: Expect = busy) -> Expect:
    """``expect``, plus operation counts of a piece that must be non-zero."""

    def unmet(report: checker.Report) -> list[str]:
        return expect(report) + [n for n in names if not report.ops[n]]

    return unmet


@pytest.mark.slow
def test_checker_mem(tmp_path: Path) -> None:
    """Threads on mem/mem: no violation, faults injected, operations checked, and every
    fault kind of issue 33 at work: drops under load, resends after Indeterminate, aborts
    with an attempt in flight, commits meeting the sweep on a short grace, lost pushes; and
    the keyed piece's upserts."""
    expect = _piece(
        *("drops", "drop_listens_ended_by_drop", "drop_writes_checked"),
        *("resend_after_indeterminate", "resend_snapshots_checked"),
        *("abort_aborts", "abort_snapshots_checked"),
        *("grace_writes_landed", "grace_orphans_swept"),
        *("pushed_writes_checked", "pushes_dropped"),
        *("keyed_commits_checked", "keyed_snapshots_checked"),
    )
    run_clean(expect, seed=101, writers=4, backend="mem")


def _consumers(report: checker.Report) -> list[str]:
    ops = report.ops
    need = {
        "consumers_advances > 20": ops["consumers_advances"] > 20,
        "consumers_acquired > 5": ops["consumers_acquired"] > 5,
        "a fence": ops["consumers_fenced"] + ops["consumers_fenced_seen"] > 0,
        "consumers_resets": ops["consumers_resets"] > 0,
        "consumers_watched > 100": ops["consumers_watched"] > 100,
        "fail_after faults": report.faults["fail_after"] > 0,
    }
    return [name for name, met in need.items() if not met]


@pytest.mark.slow
def test_checker_consumers_piece() -> None:
    """The consumers piece alone: holders fence each other, resets land, lost replies reach a
    holder as Indeterminate, and the watcher checks the consumer throughout; no violation."""
    run_clean(_consumers, seed=404, writers=1, backend="mem", faults=["consumers"])


def _txns(report: checker.Report) -> list[str]:
    ops = report.ops
    need = {
        "txns_committed > 5": ops["txns_committed"] > 5,
        "txns_plain_appends > 5": ops["txns_plain_appends"] > 5,
        "txns_commit_errors_Indeterminate": ops["txns_commit_errors_Indeterminate"] > 0,
        "txns_resent_and_acked": ops["txns_resent_and_acked"] > 0,
        "txns_cuts_checked": ops["txns_cuts_checked"] > 0,
        "txns_listen_events": ops["txns_listen_events"] > 0,
        "txns_since_downgrades": ops["txns_since_downgrades"] > 0,
    }
    return [name for name, met in need.items() if not met]


@pytest.mark.slow
def test_checker_txns_piece() -> None:
    """The txns piece alone: transactions over 2-5 shards commit under store faults, resends
    after lost replies are acknowledged once, cuts are read and checked while their readers
    move since, every plain append is checked; no violation."""
    # 6 s: at load 10 (other tests' Spark JVMs) transactions commit at 2-3 a second.
    report = run_clean(_txns, seed=505, duration_s=6.0, writers=1, backend="mem", faults=["txns"])
    ops = report.ops
    assert ops["txns_commits_checked"] == ops["txns_committed"] + ops["txns_already_committed"]
    assert ops["txns_plain_appends_checked"] == ops["txns_plain_appends"], report.render()


@pytest.mark.slow
def test_checker_file_sqlite_with_processes(tmp_path: Path) -> None:
    """Threads and spawned writer processes on file/sqlite: no violation."""
    report = run_clean(
        busy,
        seed=202,
        writers=2,
        processes=2,
        backend="file-sqlite",
        root=str(tmp_path),
    )
    assert report.ops["writer_processes"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("sabotage", checker.SABOTAGE)
def test_checker_detects_bugs(sabotage: str) -> None:
    """A checker that cannot fail proves nothing: deliberate bugs are reported as violations.

    Each bug gets its menu entry's budget, seeds and fault kinds: several seeds, each a run
    of its own, one of which must catch it. A run ends at the first violation it shows, so a
    bug the workload meets live costs a second or so, not the budget (those found only by
    the final verification, as a lost push's or a late commit's, still take it).
    """
    entry = checker.SABOTAGE[sabotage]
    for seed in range(303, 303 + entry.attempts):
        report = checker.run(
            seed=seed,
            duration_s=entry.seconds,
            writers=3,
            backend="mem",
            sabotage=sabotage,
            faults=entry.faults,
            stop_at_violation=True,
        )
        print(report.render())
        if not report.ok:
            break
    assert not report.ok
    text = "\n".join(report.violations).lower()
    assert any(sign in text for sign in entry.caught_by), text


def test_report_and_main_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    """The report names the seed, ops, faults and violations; main exits 1 on a violation."""
    report = checker.Report(seed=5, backend="mem")
    report.ops.update({"writes_checked": 3})
    assert report.ok and "seed=5" in report.render() and "violations: 0" in report.render()
    rec = checker.Recorder(report)
    for i in range(checker.MAX_DETAILS + 5):
        rec.violation(f"v{i}")
    assert not report.ok and "... and 5 more" in report.render()
    assert checker.main(
        ["--seconds", "1", "--seed", "9", "--writers", "1", "--readers", "1", "--json"]
    ) in (0, 1)
    out = capsys.readouterr().out
    assert '"seed": 9' in out and '"faults_injected"' in out


def test_write_encoding_is_unique() -> None:
    """Row values name their write, and sizes are a function of the write key."""
    a = checker.write_values(checker.KEY_PER_WRITER + 4)
    b = checker.write_values(2 * checker.KEY_PER_WRITER + 4)
    assert len(a) == 600 and not set(a) & set(b)
    assert {checker.key_of(v) for v in a} == {checker.KEY_PER_WRITER + 4}


def _event(*writes: tuple[int, int, int]) -> pa.Table:
    """A listen event's updates: every row of each (write key, time, diff)."""
    rows = [(v, t, d) for key, t, d in writes for v in checker.write_values(key)]
    return pa.table(
        {
            "v": pa.array([r[0] for r in rows], pa.int64()),
            "_time": pa.array([r[1] for r in rows], pa.uint64()),
            "_diff": pa.array([r[2] for r in rows], pa.int64()),
        }
    )


def _history() -> tuple[checker.History, checker.Report]:
    report = checker.Report(seed=0, backend="mem")
    return checker.History(checker.Recorder(report)), report


def test_history_answers_at_every_held_time_with_retractions() -> None:
    """The reference collection at an as_of undoes the later inserts and retractions, and
    a snapshot that matches it passes while one that lags behind a write fails."""
    history, report = _history()
    history.hold("reader", 0)
    history.add_event(1, 3, _event((1, 1, 1), (2, 2, 1)))
    history.add_event(3, 5, _event((3, 3, 1), (1, 3, -1), (4, 4, 1), (2, 4, -1)))
    assert history.live == {3, 4}
    assert history.expected_at(1) == {1} and history.expected_at(2) == {1, 2}
    assert history.expected_at(3) == {2, 3} and history.expected_at(4) == {3, 4}
    history.add_snapshot(3, frozenset({2, 3}), "reader")
    assert report.ok and report.ops["snapshots_checked"] == 1
    history.add_snapshot(3, frozenset({1, 2}), "reader")  # misses write 3, still has write 1
    assert report.violation_count == 1 and "missing writes [3]" in report.violations[0]


def test_history_keeps_what_a_pending_snapshot_needs_past_its_readers_hold() -> None:
    """A snapshot taken ahead of the listen is compared once the listen passes it, against
    the collection at its own time, even after its reader's hold (and so the history's
    floor) moved past that time. The first version forgot those events and reported the
    snapshot wrong."""
    history, report = _history()
    history.hold("reader", 0)
    history.add_event(1, 3, _event((1, 1, 1), (2, 2, 1)))
    history.add_snapshot(4, frozenset({2, 3}), "reader")  # ahead of the frontier (3)
    history.hold("reader", 6)  # the reader moves on before the listen gets there
    history.add_event(3, 7, _event((3, 3, 1), (1, 3, -1), (4, 5, 1), (2, 5, -1)))
    assert report.ok, report.violations
    assert report.ops["snapshots_checked"] == 1
    history.add_event(7, 9, _event((5, 8, 1), (3, 8, -1)))
    history.add_snapshot(5, frozenset({3, 4}), "reader")  # below its own hold: a checker bug
    assert report.violation_count == 1 and "below its hold" in report.violations[0]


def test_history_flags_bad_listen_events() -> None:
    """Duplicates, partial writes, retractions of what is not there, and gaps are
    violations of the listen."""
    history, report = _history()
    big = checker.KEY_PER_WRITER + 4  # 600 rows
    partial = _event((big, 2, 1)).slice(0, 10)
    history.add_event(1, 3, pa.concat_tables([_event((1, 1, 1)), partial]))
    history.add_event(3, 5, _event((1, 3, 1), (7, 4, -1)))
    history.add_event(6, 7, _event((2, 6, 1), (1, 6, -1)))
    history.add_event(7, 8, _event((1, 7, -1)))
    text = "\n".join(report.violations)
    assert "appears partially (10 of 600 rows)" in text
    assert "write 1 emitted twice" in text
    assert "write 7 retracted at time 4 but not in the shard" in text
    assert "event [6, 7) does not follow frontier 5" in text
    assert "write 1 retracted twice" in text


def test_history_settles_unknown_writes_once_the_listen_passed_them() -> None:
    """A writer learns whether an abandoned write landed only once the listen has passed
    every time it was attempted at."""
    history, _ = _history()
    landed = checker.WriteRecord(1, candidates=[1, 2])
    lost = checker.WriteRecord(2, candidates=[2])
    history.add_event(1, 2, _event((1, 1, 1)))
    assert history.landed(landed) is None and history.landed(lost) is None
    history.add_event(2, 3, _event())
    assert history.landed(landed) is True and history.landed(lost) is False


def test_write_verification_ties_each_retraction_to_its_write() -> None:
    """A write must land with the retraction it asked for, at its own time; an acknowledged
    write the listen never saw is lost."""
    report = checker.Report(seed=0, backend="mem")
    rec = checker.Recorder(report)
    ctx = checker.Context(checker.Location("mem://x", "mem://x"), "s", 0, rec, checker.History(rec))
    ctx.history.add_event(1, 4, _event((1, 1, 1), (2, 2, 1), (3, 3, 1), (1, 3, -1)))
    ctx.add_records(
        [
            checker.WriteRecord(1, acked=True, landed_at=1, candidates=[1]),
            checker.WriteRecord(2, acked=True, landed_at=2, candidates=[2]),
            checker.WriteRecord(3, retracts=2, acked=True, landed_at=3, candidates=[3]),
            checker.WriteRecord(4, acked=True, candidates=[3]),
        ]
    )
    checker._verify_writes(ctx, listen_done=True)
    text = "\n".join(report.violations)
    assert "write 3 landed at time 3 but its retraction of write 2 is at None" in text
    assert "write 1 retracted at time 3, where write 3 landed" in text
    assert "acknowledged write 4 is lost" in text
    assert report.violation_count == 3 and report.ops["writes_checked"] == 4


def _keyed_changes(
    *updates: tuple[int, int, int, int],
) -> dict[int, collections.Counter[tuple[int, int]]]:
    """The keyed listen's updates ((time, key, value, diff)) summed per time."""
    out: dict[int, collections.Counter[tuple[int, int]]] = collections.defaultdict(
        collections.Counter
    )
    for t, k, v, d in updates:
        out[t][(k, v)] += d
    return out


def test_keyed_check_applies_the_landed_writes_serially_in_commit_order() -> None:
    """Writes settle by their marker rows (a delete: its writer's marker gone with no new
    one); the shard's change at each commit time must be its write applied to the state
    before it; snapshots must equal that state at their as_of. A commit that keeps a
    key's old row, a lost acknowledged write and a stale snapshot are violations."""
    up = checker.KeyedWrite
    writes = [
        up(0, 1, False, {1: 100, -1: 115}, 115, acked=True),
        up(1, 1, False, {1: 200, 2: None, -2: 215}, 215, acked=True),
        up(0, 2, True, {1: None, -1: None}, 115, acked=False, indeterminate=True),
        up(1, 2, False, {2: 300, -2: 315}, 315, acked=False, indeterminate=True),
    ]
    good = _keyed_changes(
        (10, 1, 100, 1), (10, -1, 115, 1),
        (20, 1, 100, -1), (20, 1, 200, 1), (20, -2, 215, 1),
        (30, 1, 200, -1), (30, -1, 115, -1),
    )  # fmt: skip
    report = checker.Report(seed=0, backend="mem")
    snapshots = [(15, {1: 100, -1: 115}), (29, {1: 200, -1: 115, -2: 215}), (40, {-2: 215})]
    checker.check_keyed(writes, good, snapshots, checker.Recorder(report))
    assert report.ok, report.violations
    assert report.ops["keyed_commits_checked"] == 3
    assert report.ops["keyed_unacked_writes_that_landed"] == 1  # the delete; 1/2 did not land

    bad = _keyed_changes(
        (10, 1, 100, 1), (10, -1, 115, 1),
        (20, 1, 200, 1), (20, -2, 215, 1),  # the retraction of (1, 100) is missing
    )  # fmt: skip
    report = checker.Report(seed=0, backend="mem")
    checker.check_keyed(writes[:2], bad, [(25, {1: 100, -1: 115})], checker.Recorder(report))
    text = "\n".join(report.violations)
    assert "two live rows of key 1 at time 20" in text
    assert "at time 20 the shard changed by" in text and "serial application" in text
    assert "snapshot as_of 25" in text

    report = checker.Report(seed=0, backend="mem")
    checker.check_keyed(writes[:1], _keyed_changes(), [], checker.Recorder(report))
    assert "acknowledged write is lost" in "\n".join(report.violations)


def test_keyed_listen_retries_a_failed_fetch_of_an_event_it_was_handed() -> None:
    """Once the keyed piece's listen hands out an event it is past it: a store error fetching
    the event's parts must be retried, not dropped (the long run of seed 20261129 dropped
    one, and then reported a listen that skipped times and the writes of the lost event as
    lost acknowledged writes)."""
    loc = checker.make_location("mem")
    report = checker.Report(seed=1, backend="mem")
    rec = checker.Recorder(report)
    ctx = checker.Context(loc, "check-keyed-fetch", 1, rec, checker.History(rec))
    piece = checker.KeyedShard(ctx)
    piece.setup()
    failures = [StoreUnavailable("injected: the fetch of a listen event's parts failed")]
    fetch = piece.listen_reader.fetch

    def failing_fetch(parts: Any) -> pa.Table:
        """The reader's fetch, failing once first."""
        if failures:
            raise failures.pop()
        return fetch(parts)

    piece.listen_reader.fetch = failing_fetch  # type: ignore[method-assign]
    try:
        with checker.reliable_client(loc) as client:
            writer = client.open_shard(piece.shard_name).writer("w")
            for token, value in enumerate((100, 200), start=1):
                w = checker.KeyedWrite(0, token, False, {1: value, -1: value + 15}, value + 15)
                rows = pa.table({"k": list(w.rows), "v": list(w.rows.values())})
                w.acked = writer.upsert(rows, token=token) is not None
                piece.writes.append(w)
                for _ in range(3):  # an event, or the injected error and then the event
                    if piece._next(1.0):
                        break
        piece.verify()
    finally:
        for fc in ctx.clients:
            fc.close()
    assert not failures and report.ops["keyed_listen_errors"] == 1
    assert report.ok, report.violations
    assert report.ops["keyed_commits_checked"] == 2
