"""Every entry point that takes a Blob or Consensus URI accepts the same set and refuses a bad
one with the same error: the state API, ``PersistClient.open``, the connector's options,
PubSub's ``connect``, the ``persist`` CLI and the checker. Table-driven; nothing is written."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from pyspark_persist import pubsub
from pyspark_persist.options import PersistOptions
from pyspark_persist.state import PersistClient
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.consensus import open_consensus
from pyspark_persist.state.errors import InvalidUri
from pyspark_persist.tools import cli

BAD_BLOBS = ["no-scheme", "nope://x", "sqlite:///x.db", "gs://bucket/p"]
BAD_CONSENSUS = ["no-scheme", "s3://bucket", "postgresql+asyncpg://h/db", "file:///x"]


def expected(store: str, uri: str) -> str:
    """The registry's message for ``uri``: what every entry point must say."""
    from pyspark_persist.state.registry import resolve

    with pytest.raises(InvalidUri) as info:
        resolve(store, uri)  # type: ignore[arg-type]
    return str(info.value)


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert cli.main(list(argv)) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    return err


def entry_points(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> dict[str, Callable[[str, str], str]]:
    """name -> f(store, bad uri) -> the error message that entry point gives."""
    good = {"blob": f"mem://{tmp_path.name}", "consensus": f"mem://{tmp_path.name}"}

    def raised(fn: Callable[[], object]) -> str:
        with pytest.raises(InvalidUri) as info:
            fn()
        return str(info.value)

    def pair(store: str, uri: str) -> tuple[str, str]:
        return (uri, good["consensus"]) if store == "blob" else (good["blob"], uri)

    return {
        "open_*": lambda store, uri: raised(
            lambda: (open_blob if store == "blob" else open_consensus)(uri)
        ),
        "PersistClient.open": lambda store, uri: raised(
            lambda: PersistClient.open(*pair(store, uri))
        ),
        "connector options": lambda store, uri: raised(
            lambda: PersistOptions.parse({"shard": "s", store: uri}, "read")
        ),
        "pubsub.connect": lambda store, uri: (
            raised(lambda: pubsub.connect("auto", uri))
            if store == "consensus"
            else expected(store, uri)
        ),
        "persist shards list": lambda store, uri: _cli(capsys, "shards", "list", f"--{store}", uri),
        "persist shards list, both": lambda store, uri: _cli(
            capsys,
            "shards",
            "list",
            "--blob",
            pair(store, uri)[0],
            "--consensus",
            pair(store, uri)[1],
        ),
        "persist check": lambda store, uri: _cli(
            capsys,
            "check",
            "--seconds",
            "0.1",
            *(["--blob", pair(store, uri)[0], "--consensus", pair(store, uri)[1]]),
        ),
    }


@pytest.mark.parametrize(
    ("store", "uri"),
    [("blob", u) for u in BAD_BLOBS] + [("consensus", u) for u in BAD_CONSENSUS],
)
def test_every_entry_point_refuses_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store: str, uri: str
) -> None:
    message = expected(store, uri)
    for name, refuse in entry_points(tmp_path, capsys).items():
        assert message in refuse(store, uri), name


@pytest.mark.parametrize(
    ("blob", "consensus"),
    [("MEM://ok", "mem://ok"), ("mem://ok", "MEM://ok"), ("file:///tmp/x", "SQLITE:////tmp/x.db")],
)
def test_every_entry_point_accepts_alike(blob: str, consensus: str) -> None:
    opts = PersistOptions.parse({"shard": "s", "blob": blob, "consensus": consensus}, "read")
    assert (opts.blob, opts.consensus) == (blob, consensus)
    publisher = pubsub.connect("auto", consensus)
    getattr(publisher, "close", lambda: None)()  # off (mem://) has nothing to close
    if blob.lower().startswith("mem"):
        PersistClient.open(blob, consensus).close()
