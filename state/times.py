"""Times as users write them, and the frontiers a time must fall between.

A shard's times are unsigned integers; Spark writes stamp each micro-batch
with milliseconds since the epoch, so that is what a time means to a user
everywhere one is taken (``asOf``, the starting positions, the change-feed
range, ``--as-of``). People coming from Delta Lake or Kafka write times as
text, so :func:`parse_time` takes all three forms:

- a whole number: the time itself (epoch milliseconds for Spark-written shards);
- ``YYYY-MM-DD``: midnight UTC of that day;
- ISO-8601 (``2026-11-23T15:04:05``, with optional fraction and ``Z`` or
  ``+01:00`` offset): that instant; without an offset the time is UTC.

:func:`check_readable` is the one range check: a time is answerable when it
lies in ``[since, upper)``, and the error names both frontiers (as numbers and
as UTC instants) so the user sees at once which side they missed.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from .errors import InvalidFrontier, InvalidUsage
from .state import Time

_DATE_RE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
MAX_TIME = (1 << 64) - 1
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def parse_time(raw: str | int, what: str) -> Time:
    """The time ``raw`` names (see the module doc); ``what`` names the setting in errors."""
    if isinstance(raw, int):
        value = raw
    else:
        text = raw.strip()
        if re.fullmatch(r"\d+", text):
            value = int(text)
        else:
            value = _parse_instant(text, what)
    if not 0 <= value <= MAX_TIME:
        raise InvalidUsage(f"{what}={raw!r} must be a time from 0 to {MAX_TIME}")
    return value


def _parse_instant(text: str, what: str) -> Time:
    candidate = text[:-1] + "+00:00" if text.endswith(("Z", "z")) else text
    try:
        if _DATE_RE.match(candidate):
            moment = datetime.strptime(candidate, "%Y-%m-%d")
        else:
            moment = datetime.fromisoformat(candidate)
    except ValueError:
        raise InvalidUsage(
            f"{what}={text!r} is not a time: give epoch milliseconds (1763910245000), "
            "a date (2026-11-23, midnight UTC) or an ISO-8601 instant (2026-11-23T15:04:05Z)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    millis = (moment - _EPOCH) // timedelta(milliseconds=1)
    if millis < 0:
        raise InvalidUsage(f"{what}={text!r} is before 1970-01-01, the first time there is")
    return int(millis)


def describe(t: Time) -> str:
    """``t`` as a number, and as a UTC instant when it is plausibly epoch milliseconds."""
    if 10**11 <= t < 10**14:  # 1973 .. 5138: a Spark-written time, not a small test counter
        when = datetime.fromtimestamp(t / 1000, tz=UTC).isoformat(timespec="milliseconds")
        return f"{t} ({when.replace('+00:00', 'Z')})"
    return str(t)


def check_readable(t: Time, since: Time, upper: Time, what: str, shard: str) -> Time:
    """``t`` when it lies in ``[since, upper)``; else InvalidFrontier naming both frontiers."""
    if since <= t < upper:
        return t
    if t < since:
        side = f"before the since {describe(since)}"
    else:
        side = f"at or past the upper {describe(upper)}"
    if upper <= since:
        fix = "no time is readable until writes pass the since"
    else:
        fix = f"pick a time from {describe(since)} to {describe(upper - 1)}"
    raise InvalidFrontier(
        f"{what} {describe(t)} is {side} of shard {shard!r}: the readable times are "
        f"[since, upper) = [{since}, {upper}) (times before since were compacted away, times "
        f"from upper on are not written yet); {fix}"
    )
