"""Property-based tests (hypothesis) of the connector's pure pieces.

- streaming offsets: to_dict/from_dict round-trip, foreign shards refused;
- option parsing: case-insensitive keys, unknown keys named, size suffixes.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspark_persist.state.errors import InvalidUsage

FAST = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

names = st.text("abcdefghij0123456789-_", min_size=1, max_size=12)


# --- offsets and options ------------------------------------------------------------------------


@FAST
@given(
    names,
    st.integers(0, 2**40),
    st.integers(0, 2**63),
    st.sampled_from(["snapshot", "listen"]),
    st.none() | st.integers(0, 2**63),
)
def test_offset_roundtrip(
    shard: str, seqno: int, upper: int, phase: str, as_of: int | None
) -> None:
    """An offset survives Spark's JSON checkpoint, and another shard's offset is refused."""
    pytest.importorskip("pyspark")
    import json

    from pyspark_persist.stream_reader import Offset

    off = Offset(shard, seqno, upper, phase, as_of)
    back = Offset.from_dict(json.loads(json.dumps(off.to_dict())), shard)
    assert back == off
    with pytest.raises(InvalidUsage, match="checkpoint"):
        Offset.from_dict(off.to_dict(), shard + "x")


def test_offset_malformed_is_clear() -> None:
    """A damaged checkpoint names the offset instead of a KeyError deep inside."""
    pytest.importorskip("pyspark")
    from pyspark_persist.stream_reader import Offset

    with pytest.raises(InvalidUsage, match="malformed offset"):
        Offset.from_dict({"shard": "s", "seqno": "x", "upper": 1, "phase": "listen"}, "s")
    with pytest.raises(InvalidUsage, match="malformed offset"):
        Offset.from_dict({"shard": "s", "seqno": 1, "upper": 1, "phase": "later"}, "s")


def _case(draw: st.DrawFn, text: str) -> str:
    return "".join(c.upper() if draw(st.booleans()) else c.lower() for c in text)


@FAST
@given(st.data())
def test_options_case_insensitive(data: st.DataObject) -> None:
    """Spark may pass any case: the parse is the same."""
    from pyspark_persist.options import PersistOptions

    opts = {
        "shard": "events",
        "maxRowsPerTrigger": "7",
        "startingPosition": "LATEST",
        "failOnDataLoss": "False",
    }
    mixed = {_case(data.draw, k): v for k, v in opts.items()}
    assert PersistOptions.parse(mixed, "stream_read") == PersistOptions.parse(opts, "stream_read")


@FAST
@given(st.text("abcdefghijklmnopqrstuvwxyz", min_size=3, max_size=12))
def test_options_unknown_key_named(key: str) -> None:
    """An unknown option is refused and named, never ignored."""
    from pyspark_persist.options import SPELLING, PersistOptions

    if key in SPELLING:
        return
    with pytest.raises(InvalidUsage, match=key):
        PersistOptions.parse({"shard": "s", key: "1"}, "read")


@FAST
@given(
    st.integers(1, 2**20),
    st.sampled_from(["", "k", "m", "g", "K", "M", "G"]),
    st.sampled_from(["", "b", "B", "ib", "iB"]),
    st.sampled_from(["", " "]),
)
def test_options_sizes(n: int, unit: str, suffix: str, pad: str) -> None:
    """Sizes accept k/m/g (binary) with optional b/ib, any case; garbage is refused."""
    from pyspark_persist.options import PersistOptions

    raw = f"{pad}{n}{pad}{unit}{suffix}{pad}"
    shift = {"": 0, "k": 10, "m": 20, "g": 30}[unit.lower()]
    assert (
        PersistOptions.parse({"shard": "s", "splitSizeBytes": raw}, "read").split_size_bytes
        == n << shift
    )


@pytest.mark.parametrize("bad", ["-1", "1.5m", "12 q", "m", "0"])
def test_options_bad_sizes(bad: str) -> None:
    """Malformed sizes name the option."""
    from pyspark_persist.options import PersistOptions

    with pytest.raises(InvalidUsage, match="splitSizeBytes"):
        PersistOptions.parse({"shard": "s", "splitSizeBytes": bad}, "read")


# What Spark 4.3 itself passes to a Python data source (recorded with a source that logs its
# options): load(path) -> path, load([p1, p2]) -> paths, save(path) -> path, and for a stream
# write .queryName(q).option("checkpointLocation", c).start(path) -> queryname,
# checkpointlocation, path, every key lower-cased.
SPARK_INJECTED = {
    "read": {"path": "events"},
    "stream_read": {"path": "events"},
    "write": {"path": "events"},
    "stream_write": {"queryname": "q", "checkpointlocation": "/tmp/ck", "path": "events"},
}


@pytest.mark.parametrize("purpose", sorted(SPARK_INJECTED))
def test_options_spark_injects_are_accepted(purpose: str) -> None:
    """Every option Spark adds on its own is accepted; ``path`` is the shard name."""
    from pyspark_persist.options import PersistOptions

    opts = PersistOptions.parse(SPARK_INJECTED[purpose], purpose)  # type: ignore[arg-type]
    assert opts.shard == "events"
    if purpose == "stream_write":
        assert opts.checkpoint_location == "/tmp/ck"


@pytest.mark.parametrize(
    ("key", "purpose", "suggestion"),
    [
        ("startingpositon", "stream_read", "startingPosition"),
        ("maxrowpertrigger", "stream_read", "maxRowsPerTrigger"),
        ("writerid_", "stream_write", "writerId"),
        ("splitsizebyte", "read", "splitSizeBytes"),
        ("partsizebytess", "write", "partSizeBytes"),
    ],
)
def test_options_typo_suggests_the_option(key: str, purpose: str, suggestion: str) -> None:
    """A real typo is still refused, naming it and the option it was probably meant to be."""
    from pyspark_persist.options import PersistOptions

    with pytest.raises(InvalidUsage, match=f"{key}: did you mean {suggestion}\\?"):
        PersistOptions.parse({"path": "events", key: "1"}, purpose)  # type: ignore[arg-type]


def test_options_misplaced_and_multi_path_errors_say_where_they_belong() -> None:
    from pyspark_persist.options import PersistOptions

    with pytest.raises(InvalidUsage, match="maxRowsPerTrigger applies to stream reads only"):
        PersistOptions.parse({"path": "e", "maxrowspertrigger": "5"}, "stream_write")
    with pytest.raises(InvalidUsage, match="queryName applies to stream writes only"):
        PersistOptions.parse({"path": "e", "queryname": "q"}, "read")
    with pytest.raises(InvalidUsage, match=r"one shard, not several paths"):
        PersistOptions.parse({"paths": '["a","b"]'}, "read")
    # An invalid name given as the load()/save() path is reported as the path.
    with pytest.raises(InvalidUsage, match="option path: invalid shard name 'a/b'"):
        PersistOptions.parse({"path": "a/b"}, "write")
    # shard and path may both be given if they agree.
    assert PersistOptions.parse({"shard": "e", "path": "e"}, "write").shard == "e"
