"""``persist consumers list|show|reset|drop``: a shard's named consumers from the command line.

On the populated embedded default of ``test_cli`` (shard ``events``, upper 90),
its readers' holds moved to 40, with three consumers: ``to-pg`` held by a live
query at upper 60, ``stale`` whose query's leased reader is gone (so nobody
live holds it) at upper 50, and ``fresh`` that never committed. Each test
checks what a user sees, the exit status, and what is stored afterwards
(nothing, for every refusal).
"""

# ruff: noqa: F811 - ``home`` is test_cli's fixture, imported so pytest finds it here too

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_cli import SHARD, home, run, stored  # noqa: F401 - home is a fixture

from pyspark_persist.offsets import LISTEN, Offset, offset_json
from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.errors import ConsumerFenced
from pyspark_persist.state.history import state_at

HOLDER = "query A pid 1 on host since 2026-11-27T00:00:00+00:00"


def _client() -> PersistClient:
    return PersistClient.open(config=PersistConfig(maintenance=False))


def _advance(shard: Any, name: str, epoch: int, upper: int) -> None:
    """What the source's commit records once Spark committed every change below ``upper``."""
    position = offset_json(Offset(SHARD, 1, upper, LISTEN))
    shard.advance_consumer(name, epoch, position=position, upper=upper, since=upper - 1)


@pytest.fixture
def consumers(home: Path) -> Iterator[Path]:
    """``home`` with since at 40 and consumers ``to-pg`` (live, 60), ``stale`` (50), ``fresh``."""
    client = _client()
    try:
        shard = client.open_shard(SHARD, create=False)
        shard.critical_reader("crit").compare_and_downgrade_since(0, 0, 40)
        shard.reader("r1").close()
        live = shard.acquire_consumer("to-pg", HOLDER)
        _advance(shard, "to-pg", live.epoch, 60)
        gone = shard.acquire_consumer("stale", "query B", reader_id="reader-long-gone")
        _advance(shard, "stale", gone.epoch, 50)
        shard.acquire_consumer("fresh", "query C", reader_id="reader-long-gone")
        assert shard.machine.fetch_latest().since == 40
    finally:
        client.close()
    yield home


def _listing(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, dict[str, Any]]:
    status, out, err = run(capsys, "consumers", "list", SHARD, "--json", *args)
    assert status == 0, err
    return {c["name"]: c for c in json.loads(out)["consumers"]}


def test_list_shows_position_lag_and_holder(
    consumers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = _listing(capsys)
    assert sorted(listed) == ["fresh", "stale", "to-pg"]
    pg = listed["to-pg"]
    # Batches [60,70), [70,80) of 2 rows each and [80,90) of 1 lie past upper 60.
    assert (pg["upper"], pg["phase"], pg["since"]) == (60, "listen", 59)
    assert pg["behind"]["rows"] == 5 and pg["behind"]["times"] == 30 and pg["behind"]["parts"] == 3
    assert pg["holder"] == HOLDER and pg["live"] and pg["epoch"] == 1 and pg["committed_ms"] > 0
    assert listed["stale"]["holder"] == "query B" and not listed["stale"]["live"]
    assert listed["fresh"]["phase"] == "none" and listed["fresh"]["committed_ms"] == 0
    assert all(c["flags"] == [] for c in listed.values())

    status, out, err = run(capsys, "consumers", "list", SHARD)
    assert status == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["CONSUMER", "UPPER", "PHASE"]
    row = next(line for line in lines if line.startswith("to-pg"))
    assert "listen" in row and "5 rows" in row and "live" in row
    assert "stale (its query is gone)" in next(line for line in lines if line.startswith("stale"))
    assert lines[-1].startswith(f"3 consumer(s) of shard '{SHARD}', upper 90")


def test_show_one_consumer_in_full(consumers: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "consumers", "show", SHARD, "to-pg")
    assert status == 0, err
    for needle in (
        "consumer     to-pg of shard 'events'",
        "upper        60 (phase listen)",
        "since hold   59",
        "behind       5 rows",
        f"holder       {HOLDER} (live)",
        "epoch        1",
        "expiry       never",
    ):
        assert needle in out, needle
    status, out, _ = run(capsys, "consumers", "show", SHARD, "--json")
    assert status == 0 and len(json.loads(out)["consumers"]) == 3


def test_list_flags_consumers_older_than_retention_and_expired_ones(
    consumers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = _client()
    try:
        client.open_shard(SHARD, create=False).acquire_consumer("idle", "query D", expiry_ms=1)
    finally:
        client.close()
    time.sleep(0.01)
    status, out, err = run(capsys, "shards", "gc", SHARD, "--dry-run", "--json")
    assert status == 0 and json.loads(out)["consumers_expired"] == ["idle"], err
    status, out, err = run(capsys, "shards", "gc", SHARD)
    assert status == 0 and "1 idle consumer(s) (idle stops holding data)" in out, err
    assert _listing(capsys)["idle"]["flags"] == ["expired"]
    assert _listing(capsys)["to-pg"]["flags"] == []  # no retention: nothing is too old

    # The times are small counters, so a day's retention is far past every hold.
    assert run(capsys, "shards", "alter", SHARD, "--retention", "1d")[0] == 0
    listed = _listing(capsys)
    assert listed["to-pg"]["flags"] == ["past-retention"]
    assert listed["idle"]["flags"] == ["expired"]  # it holds nothing, so it is not flagged twice
    _, out, _ = run(capsys, "consumers", "list", SHARD)
    assert "to-pg: holds since at 59, older than the retention (1d)" in out
    assert "idle: expired" in out


def test_reset_is_refused_while_a_live_query_holds_it(
    consumers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = stored(consumers)
    status, out, err = run(capsys, "consumers", "reset", SHARD, "to-pg", "--to-time", "45")
    assert status == 1 and out == ""
    assert err.startswith("persist: error: consumer 'to-pg' of shard 'events' is held by query A")
    assert "--force" in err and "nothing changed" in err
    assert stored(consumers) == before


def test_reset_with_force_fences_the_query(
    consumers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ("consumers", "reset", SHARD, "to-pg", "--to-time", "45", "--force", "--json")
    status, out, err = run(capsys, *args)
    assert status == 0, err
    result = json.loads(out)
    after = result["after"]
    assert (after["upper"], after["since"], after["phase"], after["holder"]) == (
        45,
        44,
        "listen",
        "",
    )
    assert after["epoch"] == 2 and result["fenced"] == HOLDER
    assert after["behind"]["rows"] > result["before"]["behind"]["rows"]
    assert json.loads(after["position"])["upper"] == 45
    client = _client()
    try:  # the query that held it can no longer move it
        with pytest.raises(ConsumerFenced):
            _advance(client.open_shard(SHARD, create=False), "to-pg", 1, 70)
    finally:
        client.close()
    assert _listing(capsys)["to-pg"]["upper"] == 45


def test_reset_to_a_seqno_and_of_a_consumer_whose_query_is_gone(
    consumers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = _client()
    try:
        shard = client.open_shard(SHARD, create=False)
        seqno = next(c.seqno for c in shard.history() if c.upper == 70)
        assert state_at(shard.replay(), seqno, "test").upper == 70
    finally:
        client.close()
    # Nobody live holds "stale" (its query's reader is gone): no --force needed.
    status, out, err = run(capsys, "consumers", "reset", SHARD, "stale", "--to-seqno", str(seqno))
    assert status == 0, err
    assert "consumer 'stale' of shard 'events' reset: upper 50 -> 70" in out
    stale = _listing(capsys)["stale"]
    assert (stale["upper"], stale["since"], stale["epoch"]) == (70, 69, 2)
    assert json.loads(stale["position"])["seqno"] == seqno


@pytest.mark.parametrize(
    ("args", "status", "message"),
    [
        (("reset", SHARD, "nope", "--to-time", "50"), 1, "shard 'events' has no consumer 'nope'"),
        (("drop", SHARD, "nope"), 1, "its consumers: 'fresh', 'stale', 'to-pg'"),
        (("show", SHARD, "nope"), 1, "has no consumer 'nope'"),
        (("reset", SHARD, "stale", "--to-time", "10"), 1, "before the shard's since 40"),
        (("reset", SHARD, "stale", "--to-time", "1000"), 1, "past the upper 90"),
        (("reset", SHARD, "stale", "--to-seqno", "999"), 1, "--to-seqno"),
        (("reset", SHARD, "stale"), 2, "exactly one of --to-time T and --to-seqno N"),
        (("reset", SHARD, "stale", "--to-time", "50", "--to-seqno", "3"), 2, "exactly one"),
        (("reset", SHARD, "stale", "--to-time", "yesterday"), 2, "--to-time='yesterday'"),
        (("drop", SHARD, "bad name"), 2, "use 1 to 128 letters"),
        (("list", "nosuchshard"), 1, "shard 'nosuchshard' does not exist"),
    ],
)
def test_bad_input_is_one_line_and_changes_nothing(
    consumers: Path,
    capsys: pytest.CaptureFixture[str],
    args: tuple[str, ...],
    status: int,
    message: str,
) -> None:
    before = stored(consumers)
    got, out, err = run(capsys, "consumers", *args)
    assert (got, out) == (status, "")
    assert err.startswith("persist: error: ") and message in err and err.count("\n") == 1, err
    assert stored(consumers) == before


def test_drop_refused_while_held_then_forced(
    consumers: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = stored(consumers)
    status, _, err = run(capsys, "consumers", "drop", SHARD, "to-pg")
    assert status == 1 and "so it was not dropped" in err and stored(consumers) == before
    status, out, err = run(capsys, "consumers", "drop", SHARD, "stale")
    assert status == 0 and "dropped consumer 'stale'" in out, err
    status, out, err = run(capsys, "consumers", "drop", SHARD, "to-pg", "--force", "--json")
    assert status == 0, err
    result = json.loads(out)
    assert result["fenced"] == HOLDER and result["dropped"]["upper"] == 60
    assert sorted(_listing(capsys)) == ["fresh"]
