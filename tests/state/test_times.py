"""Times as users write them (no JVM): every accepted form, every refusal, the frontier check."""

from __future__ import annotations

import pytest

from pyspark_persist.state.errors import InvalidFrontier, InvalidUsage
from pyspark_persist.state.times import check_readable, describe, parse_time

DAY = 86_400_000


@pytest.mark.parametrize(
    ("raw", "millis"),
    [
        ("0", 0),
        (" 42 ", 42),
        (1763910245000, 1763910245000),
        ("1970-01-02", DAY),
        ("2026-11-23", 1795392000000),
        ("2026-11-23T15:04:05Z", 1795392000000 + (15 * 3600 + 4 * 60 + 5) * 1000),
        ("2026-11-23T15:04:05z", 1795392000000 + (15 * 3600 + 4 * 60 + 5) * 1000),
        ("2026-11-23T15:04:05", 1795392000000 + (15 * 3600 + 4 * 60 + 5) * 1000),
        ("2026-11-23 15:04:05.250", 1795392000000 + (15 * 3600 + 4 * 60 + 5) * 1000 + 250),
        ("2026-11-23T16:04:05+01:00", 1795392000000 + (15 * 3600 + 4 * 60 + 5) * 1000),
        ("2026-11-23T10:04:05.5-05:00", 1795392000000 + (15 * 3600 + 4 * 60 + 5) * 1000 + 500),
    ],
)
def test_accepted_forms(raw: str | int, millis: int) -> None:
    """Epoch ms, a date (midnight UTC), ISO-8601 with or without an offset (naive is UTC)."""
    assert parse_time(raw, "asOf") == millis


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("yesterday", "asOf='yesterday' is not a time: give epoch milliseconds"),
        ("2026-13-01", "asOf='2026-13-01' is not a time"),
        ("2026-11-23T25:00", "is not a time"),
        ("-5", "is not a time"),
        ("1969-12-31", "before 1970-01-01"),
        (str(1 << 64), "must be a time from 0 to"),
    ],
)
def test_refused_forms_name_the_setting_and_the_accepted_forms(raw: str, message: str) -> None:
    """A bad time names the option as written and what would have been accepted."""
    with pytest.raises(InvalidUsage, match=message):
        parse_time(raw, "asOf")


@pytest.mark.parametrize(
    ("t", "since", "upper", "message"),
    [
        (1, 2, 5, r"asOf 1 is before the since 2 of shard 's'.*\[2, 5\).*from 2 to 4"),
        (5, 2, 5, r"asOf 5 is at or past the upper 5 of shard 's'.*\[2, 5\).*from 2 to 4"),
        (9, 7, 7, r"at or past the upper 7.*no time is readable until writes pass the since"),
    ],
)
def test_out_of_range_names_both_frontiers(t: int, since: int, upper: int, message: str) -> None:
    """Before since or at/after upper: one error naming since and upper, and the fix."""
    assert check_readable(since, since, max(upper, since + 1), "asOf", "s") == since
    with pytest.raises(InvalidFrontier, match=message):
        check_readable(t, since, upper, "asOf", "s")


def test_describe_shows_epoch_millis_as_utc_instants_only() -> None:
    """A Spark-written time reads as an instant too; a small counter stays a number."""
    assert describe(1795392000000) == "1795392000000 (2026-11-23T00:00:00.000Z)"
    assert describe(17) == "17"
