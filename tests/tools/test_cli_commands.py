"""The commands issue 18 added to ``persist``: --version, inspect, --dry-run, drop, tail, check.

Each runs on the populated embedded default of ``test_cli`` (shard ``events``:
9 commits, a leased reader ``r1``, a critical reader ``crit``) and checks what
a user would: the output, the exit status, and what is stored afterwards.
"""

# ruff: noqa: F811 - ``home`` is test_cli's fixture, imported so pytest finds it here too

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from test_cli import SHARD, home, run, stored  # noqa: F401 - home is a fixture

from pyspark_persist.state import PersistClient, PersistConfig
from pyspark_persist.state.diff import TOMBSTONE
from pyspark_persist.tools import cli


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "--version")
    assert status == 0 and out.strip() == "persist 0.1.0"


def test_every_command_says_what_it_does(capsys: pytest.CaptureFixture[str]) -> None:
    commands = [
        ("shards", "list"),
        ("shards", "inspect"),
        ("inspect",),
        ("shards", "show"),
        ("shards", "tail"),
        ("shards", "compact"),
        ("shards", "gc"),
        ("shards", "drop"),
        ("shards", "alter"),
        ("consumers", "list"),
        ("consumers", "show"),
        ("consumers", "reset"),
        ("consumers", "drop"),
        ("pubsub", "serve"),
        ("check",),
        ("bench", "core"),
    ]
    status, out, _ = run(capsys, "--help")
    assert status == 0 and all(f"  {c[0]} " in out for c in commands)
    for command in commands:
        status, out, err = run(capsys, *command, "--help")
        assert status == 0, (command, err)
        description = out.split("\n\n")[1].strip()  # the paragraph after the usage line
        assert len(description) > 20, (command, out)


def test_inspect_is_shards_inspect(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, long, _ = run(capsys, "shards", "inspect", SHARD, "--json")
    status, short, _ = run(capsys, "inspect", SHARD, "--json")
    assert status == 0
    a, b = json.loads(long), json.loads(short)
    for info in (a, b):
        for reader in info["leased_readers"]:
            reader.pop("expires_in_ms")
    assert a == b


def test_compact_dry_run_changes_nothing_and_names_the_merges(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = stored(home)
    status, out, err = run(capsys, "shards", "compact", SHARD, "--dry-run", "--json")
    assert status == 0, err
    plan = json.loads(out)
    assert plan["dry_run"] and plan["batches"] == 9
    assert [(m["batches"], m["rows"]) for m in plan["merges"]] == [(9, 17)]
    assert stored(home) == before
    status, out, _ = run(capsys, "shards", "compact", SHARD, "--dry-run")
    assert "would run 1 merge(s)" in out and "merge 9 batches [0, 90)" in out
    status, out, _ = run(capsys, "shards", "compact", SHARD, "--json")
    done = json.loads(out)
    assert (done["rounds"], done["batches_after"]) == (1, 1)


def test_gc_dry_run_changes_nothing_and_names_what_gc_deletes(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run(capsys, "shards", "compact", SHARD)
    before = stored(home)
    status, out, err = run(capsys, "shards", "gc", SHARD, "--dry-run", "--json")
    assert status == 0, err
    plan = json.loads(out)
    assert stored(home) == before
    assert plan["dry_run"] and plan["readers_expired"] == []
    status, out, _ = run(capsys, "shards", "gc", SHARD, "--dry-run")
    assert "would delete" in out and "nothing changed" in out
    status, out, _ = run(capsys, "shards", "gc", SHARD, "--json")
    done = json.loads(out)
    deleted = {k for k, _ in before["blob"]} - {k for k, _ in stored(home)["blob"]}
    assert deleted == set(plan["parts"]) | set(plan["orphans"])
    assert done["parts_deleted"] == len(plan["parts"])


def test_alter_retention_is_shown_and_readers_still_hold_since(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = stored(home)
    status, out, err = run(capsys, "shards", "alter", SHARD, "--retention", "7 days")
    assert status == 2 and "--retention" in err and "7d" in err
    assert stored(home) == before  # a bad period is refused before anything is written
    status, out, err = run(capsys, "shards", "alter", SHARD, "--retention", "12h", "--json")
    assert status == 0, err
    assert json.loads(out) == {
        "shard": SHARD,
        "retention_ms": 12 * 3_600_000,
        "previous_retention_ms": 0,
        "since": 0,
    }
    status, out, _ = run(capsys, "shards", "show", SHARD)
    assert status == 0 and out.splitlines()[-1].startswith("retention 12h (since follows")
    _, out, _ = run(capsys, "shards", "inspect", SHARD, "--json")
    assert json.loads(out)["retention_ms"] == 12 * 3_600_000
    # The clock is far past every time of the shard, but its readers hold since at 0.
    run(capsys, "shards", "gc", SHARD)
    _, out, _ = run(capsys, "shards", "inspect", SHARD)
    assert (
        "retention  12h" in out
        and json.loads(run(capsys, "inspect", SHARD, "--json")[1])["since"] == 0
    )
    status, out, _ = run(capsys, "shards", "alter", SHARD, "--retention", "0")
    assert status == 0 and "retention none" in out and "was 12h" in out


def _answer(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))


def _events_gone(home: Path) -> bool:
    """Nothing of the shard is left but the drop's tombstone row."""
    after = stored(home)
    return [data for _, data in after["consensus"][SHARD]] == [TOMBSTONE] and not any(
        k.startswith(f"{SHARD}/") for k, _ in after["blob"]
    )


def test_drop_refuses_while_readers_hold_the_shard(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    before = stored(home)
    _answer(monkeypatch, "y\n")
    status, out, err = run(capsys, "shards", "drop", SHARD)
    assert (status, out) == (1, "") and len(err.splitlines()) == 1
    assert "in use by reader(s) r1, crit" in err and "--force" in err
    assert stored(home) == before


@pytest.mark.parametrize("answer", ["n\n", "", "maybe\nno\n"])
def test_drop_without_a_yes_drops_nothing(
    home: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    answer: str,
) -> None:
    before = stored(home)
    _answer(monkeypatch, answer)
    status, out, err = run(capsys, "shards", "drop", SHARD, "--force")
    assert (status, out) == (1, "")
    assert f"Drop shard {SHARD!r}" in err and "9 batches, 17 rows" in err
    assert err.splitlines()[-1] == (
        f"persist: error: shard {SHARD!r} was not dropped: answer y, or pass --yes"
    )
    assert stored(home) == before


def test_drop_after_yes_deletes_everything(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _answer(monkeypatch, "y\n")
    status, out, err = run(capsys, "shards", "drop", SHARD, "--force")
    assert status == 0, err
    assert out.startswith(f"dropped shard {SHARD!r}: deleted") and "r1, crit lost it" in out
    assert _events_gone(home)
    status, out, _ = run(capsys, "shards", "list", "--json")
    assert json.loads(out)["shards"] == []
    status, _, err = run(capsys, "shards", "drop", SHARD, "--yes")
    assert status == 1 and "does not exist" in err


def test_drop_yes_json_and_an_unheld_shard(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with PersistClient.open(config=PersistConfig(maintenance=False)) as client:
        shard = client.open_shard("other", pa.schema([("id", pa.int64())]))
        shard.writer().append(pa.table({"id": [1, 2]}))
    _answer(monkeypatch, "")  # --yes never reads the answer
    status, out, err = run(capsys, "shards", "drop", "other", "--yes", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["shard"] == "other" and report["readers"] == []
    assert report["consensus_rows_deleted"] >= 2
    names = [s["name"] for s in json.loads(run(capsys, "shards", "list", "--json")[1])["shards"]]
    assert names == [SHARD]


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C's default, so Python turns SIGINT into
    KeyboardInterrupt even when this run ignores it (a shell starts a background job with
    SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _tail(home: Path, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PERSIST_HOME": str(home)}
    return subprocess.Popen(
        [sys.executable, "-m", "pyspark_persist", "shards", "tail", SHARD, *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,  # noqa: PLW1509 - signal.signal only, no locks taken
    )


def _read_json_lines(proc: subprocess.Popen[str], n: int) -> list[dict[str, Any]]:
    assert proc.stdout is not None
    return [json.loads(proc.stdout.readline()) for _ in range(n)]


@pytest.mark.parametrize("pubsub", ["off", "auto"])
def test_tail_follows_commits_and_stops_cleanly_on_ctrl_c(
    home: Path, capsys: pytest.CaptureFixture[str], pubsub: str
) -> None:
    proc = _tail(home, "--as-of", "79", "--json", "--pubsub", pubsub)
    try:
        # Already committed after time 79: the retraction of id 0 at time 80.
        assert _read_json_lines(proc, 1) == [{"id": 0, "name": "a", "_time": 80, "_diff": -1}]
        config = PersistConfig(maintenance=False)
        with PersistClient.open(config=config) as client:
            writer = client.open_shard(SHARD).writer("w2")
            for t in (90, 100):
                writer.compare_and_append(pa.table({"id": [t], "name": ["new"]}), t, t + 10)
                (line,) = _read_json_lines(proc, 1)  # each commit, as it lands
                assert line == {"id": t, "name": "new", "_time": t, "_diff": 1}
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    status, out, _ = run(capsys, "shards", "inspect", SHARD, "--json")
    assert [r["id"] for r in json.loads(out)["leased_readers"]] == ["r1"]  # its reader is gone


def test_tail_text_lines_and_a_bad_as_of(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _tail(home, "--as-of", "79")
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "80 -1 id=0 name='a'\n"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    before = stored(home)
    status, out, err = run(capsys, "shards", "tail", SHARD, "--as-of", "95")
    assert (status, out) == (1, "")
    assert "--as-of 95 is at or past the upper 90" in err and len(err.splitlines()) == 1
    assert stored(home) == before


def test_check_runs_the_documented_command(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(capsys, "check", "--backend", "mem-mem", "--seconds", "1", "--json")
    assert status == 0, err
    report = json.loads(out)
    assert report["backend"] == "mem" and report["violation_count"] == 0


def test_check_honours_blob_and_consensus(capsys: pytest.CaptureFixture[str]) -> None:
    where = ["--blob", "mem://checked", "--consensus", "mem://checked"]
    for argv in (["check", *where], [*where, "check"]):
        status, out, err = run(capsys, *argv, "--seconds", "1", "--json")
        assert status == 0, err
        assert json.loads(out)["backend"] == "mem://checked + mem://checked"
    status, out, err = run(capsys, "check", "--blob", "mem://x", "--seconds", "1")
    assert (status, out) == (1, "") and "give --blob and --consensus together" in err
    status, _, err = run(capsys, "check", "--blob", "nope://x", "--consensus", "mem://x")
    assert status == 1 and "unknown blob scheme 'nope'" in err


def test_main_module_is_cli() -> None:
    assert cli.main(["--version"]) == 0


def test_inspect_and_show_name_a_keyed_shards_keys(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    client = PersistClient.open(config=PersistConfig(maintenance=False))
    shard = client.open_shard("customers", pa.schema([("id", pa.int64())]), keys=["id"])
    shard.writer().upsert(pa.table({"id": [1]}))
    client.close()
    _, text, _ = run(capsys, "shards", "inspect", "customers")
    assert "keys       id (every write upserts by them)" in text
    _, shown, _ = run(capsys, "shards", "show", "customers", "--json")
    assert json.loads(shown)["keys"] == ["id"]
    _, plain, _ = run(capsys, "shards", "inspect", SHARD, "--json")
    assert json.loads(plain)["keys"] == []
