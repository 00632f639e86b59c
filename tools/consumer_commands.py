"""``persist consumers list|show|reset|drop SHARD``: a shard's named consumers (issue 36).

A named consumer (``.option("consumer", NAME)`` on a stream,
:mod:`pyspark_persist.state.consumers`) is a durable position in a shard, like
a Kafka consumer group's committed offset. These commands show where each one
is and how far behind the shard's upper, who holds it and whether that query
is still live, and move or remove one by hand:

- ``list``: one line per consumer, flagged ``expired`` (idle past its expiry:
  it no longer holds data) or ``past-retention`` (its hold is older than
  ``now - retention``: it keeps data the shard's retention would have
  dropped, so a forgotten consumer is seen before it costs storage);
- ``show [NAME]``: every field of one consumer (or of each);
- ``reset NAME --to-time T | --to-seqno N [--force]``: the consumer reads on
  from the changes at times from ``T`` on (``--to-seqno N``: from the upper
  SeqNo ``N`` left, i.e. the changes committed after it); refused while a live
  query holds it unless ``--force`` (that query is then fenced), and when the
  changes from there were compacted away;
- ``drop NAME [--force]``: remove it and its hold.

Every command reads the state from Consensus once; ``reset`` and ``drop``
write one compare-and-set, refused (nothing written) for an unknown consumer.
The click commands (:data:`COMMANDS`) are the ``persist consumers`` group's,
imported when one runs.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING, Any

import click

from pyspark_persist.tools import cli as base

if TYPE_CHECKING:
    from pyspark_persist.state.client import Shard
    from pyspark_persist.state.state import ConsumerState, ShardState


FLAG_EXPIRED = "expired"
"""Idle past its expiry: it no longer holds data (what it had not consumed may be gone)."""
FLAG_PAST_RETENTION = "past-retention"
"""Its hold is older than ``now - retention``: it keeps data retention would have dropped."""


def _phase(position: str) -> str:
    """The phase of a consumer's position (``snapshot`` or ``listen``; ``none`` before its
    first commit), read from the offset JSON the connector recorded."""
    if not position:
        return "none"
    try:
        return str(json.loads(position).get("phase", "?"))
    except (ValueError, AttributeError):
        return "?"


def _utc(t: int) -> str | None:
    """``t`` as a UTC instant when it is plausibly epoch milliseconds (else None)."""
    lo, hi = base._EPOCH_MS_RANGE
    return base._iso(t) if lo <= t < hi else None


def consumer_info(state: ShardState, name: str, c: ConsumerState, now_ms: int) -> dict[str, Any]:
    """Everything ``list`` and ``show`` report of consumer ``name``, as JSON-able values."""
    from pyspark_persist.state.consumers import consumer_lag, is_held

    flags = []
    if c.expired:
        flags.append(FLAG_EXPIRED)
    elif state.retention_ms > 0 and c.since < now_ms - state.retention_ms:
        flags.append(FLAG_PAST_RETENTION)
    return {
        "name": name,
        "upper": c.upper,
        "upper_utc": _utc(c.upper),
        "phase": _phase(c.position),
        "position": c.position,
        "since": c.since,
        "behind": consumer_lag(state, name).to_dict(),
        "planned": len(c.planned),
        "committed_ms": c.committed_ms,
        "committed_utc": _utc(c.committed_ms) if c.committed_ms else None,
        "holder": c.holder,
        "live": is_held(state, c, now_ms),
        "reader": c.reader,
        "epoch": c.epoch,
        "created_ms": c.created_ms,
        "expiry_ms": c.expiry_ms,
        "expires_at_ms": c.active_ms + c.expiry_ms if c.expiry_ms and not c.expired else None,
        "expired": c.expired,
        "flags": flags,
    }


def list_consumers(
    where: base.Location, shard_name: str, name: str | None = None
) -> dict[str, Any]:
    """The shard's consumers (only ``name`` when given: UnknownConsumer when absent)."""
    from pyspark_persist.state.errors import UnknownConsumer

    with base._shard(where, shard_name) as (_client, shard):
        state = shard.machine.fetch_latest()
        now = shard.machine.clock_ms()
    if name is not None and name not in state.consumers:
        raise UnknownConsumer(shard_name, name, tuple(sorted(state.consumers)))
    names = [name] if name is not None else sorted(state.consumers)
    return {
        "shard": shard_name,
        "upper": state.upper,
        "since": state.since,
        "retention_ms": state.retention_ms,
        "now_ms": now,
        "consumers": [consumer_info(state, n, state.consumers[n], now) for n in names],
    }


def _duration(ms: int) -> str:
    """A span of milliseconds for people: 850ms, 42s, 12m, 3.5h, 2.0d."""
    s = ms / 1000
    if ms < 1000:
        return f"{ms}ms"
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h" if s < 172_800 else f"{s / 86400:.1f}d"


def _behind_time(c: dict[str, Any], shard_upper: int) -> str:
    """Times behind: a duration when the shard's times are epoch ms, else a count of times."""
    times = c["behind"]["times"]
    if c["upper"] == 0:
        return "all (nothing committed)"
    return _duration(times) if _utc(shard_upper) else str(times)


def _held(c: dict[str, Any]) -> str:
    if not c["holder"]:
        return "no"
    return "live" if c["live"] else "stale (its query is gone)"


def format_list(result: dict[str, Any]) -> str:
    """The readable form of :func:`list_consumers`: one line per consumer, then the flags."""
    rows = result["consumers"]
    shard = result["shard"]
    if not rows:
        return f"shard {shard!r} has no consumers (start a query with .option('consumer', NAME))"
    table = base._table(
        ["CONSUMER", "UPPER", "PHASE", "BEHIND", "TIME BEHIND", "LAST COMMIT", "HELD", "EPOCH"]
        + ["FLAGS"],
        [
            [
                c["name"],
                base._time(c["upper"]),
                c["phase"],
                f"{c['behind']['rows']} rows, {base._size(c['behind']['bytes'])}",
                _behind_time(c, result["upper"]),
                c["committed_utc"] or (c["committed_ms"] or "never"),
                _held(c),
                c["epoch"],
                ", ".join(c["flags"]),
            ]
            for c in rows
        ],
    )
    from pyspark_persist.state.retention import format_retention

    lines = [
        table,
        f"{len(rows)} consumer(s) of shard {shard!r}, upper {base._time(result['upper'])}",
    ]
    for c in rows:
        if FLAG_EXPIRED in c["flags"]:
            lines.append(
                f"  {c['name']}: expired (idle past {_duration(c['expiry_ms'])}): it holds no "
                "data; a query using it again resumes from its position if that is still readable"
            )
        if FLAG_PAST_RETENTION in c["flags"]:
            lines.append(
                f"  {c['name']}: holds since at {base._time(c['since'])}, older than the "
                f"retention ({format_retention(result['retention_ms'])}): it keeps data "
                "retention would have dropped; resume its query, reset it, or drop it"
            )
    return "\n".join(lines)


def format_show(result: dict[str, Any]) -> str:
    """The readable form of :func:`list_consumers` for ``show``: every field, one per line."""
    blocks = []
    now = result["now_ms"]
    for c in result["consumers"]:
        b = c["behind"]
        expiry = "never" if not c["expiry_ms"] else f"after {_duration(c['expiry_ms'])} idle"
        if c["expires_at_ms"] is not None:
            expiry += f" (expires {base._relative(c['expires_at_ms'] - now)})"
        committed = (
            base._time(c["committed_ms"]) + f", {base._relative(c['committed_ms'] - now)}"
            if c["committed_ms"]
            else "never"
        )
        blocks.append(
            "\n".join(
                [
                    f"consumer     {c['name']} of shard {result['shard']!r}",
                    f"upper        {base._time(c['upper'])} (phase {c['phase']})",
                    f"since hold   {base._time(c['since'])}",
                    f"behind       {b['rows']} rows, {base._size(b['bytes'])}, {b['parts']} parts, "
                    f"{_behind_time(c, result['upper'])} of times (shard upper "
                    f"{base._time(result['upper'])})",
                    f"last commit  {committed}",
                    f"holder       {c['holder'] or 'none'}"
                    + (f" ({_held(c)})" if c["holder"] else ""),
                    f"epoch        {c['epoch']}",
                    f"planned      {c['planned']} micro-batch(es) past the position",
                    f"expiry       {expiry}",
                    f"flags        {', '.join(c['flags']) or '-'}",
                ]
            )
        )
    return "\n\n".join(blocks)


def _reset_target(
    shard: Shard, state: ShardState, *, to_time: int | None, to_seqno: int | None
) -> tuple[int, int, str]:
    """The time the consumer reads on from, the SeqNo it was found at, and what the user asked
    (for messages): ``--to-time T`` as given, ``--to-seqno N`` the upper SeqNo N left."""
    from pyspark_persist.state.history import state_at

    if to_seqno is None:
        assert to_time is not None  # reset() takes exactly one
        return to_time, state.seqno, f"--to-time {to_time}"
    if base._progress_enabled():
        print(f"reading the history of {shard.name} ...", end="", file=sys.stderr, flush=True)
    past = shard.replay()
    if base._progress_enabled():
        print(" done", file=sys.stderr, flush=True)
    at = state_at(past, to_seqno, "--to-seqno")
    return at.upper, to_seqno, f"--to-seqno {to_seqno} (its upper, {at.upper})"


def reset(
    where: base.Location,
    shard_name: str,
    name: str,
    *,
    to_time: int | None,
    to_seqno: int | None,
    force: bool,
) -> dict[str, Any]:
    """Move consumer ``name`` so that it reads on from the changes at the target time.

    Its position becomes the ``listen`` offset at that time (what a query
    started with ``startingTime`` there records), its hold the time before it.
    Refused, nothing written: an unknown consumer, a target past the upper or
    whose changes were compacted away (InvalidFrontier), a live holder without
    ``force`` (ConsumerInUse).
    """
    from pyspark_persist.offsets import LISTEN, Offset, consumed_upper, offset_json, since_after
    from pyspark_persist.state.consumers import is_held
    from pyspark_persist.state.errors import InvalidFrontier, UnknownConsumer

    if (to_time is None) == (to_seqno is None):
        raise base.UsageError(
            "persist consumers reset: give exactly one of --to-time T and --to-seqno N "
            "(see persist consumers reset --help)"
        )
    with base._shard(where, shard_name) as (_client, shard):
        state = shard.machine.fetch_latest()
        before = state.consumers.get(name)
        if before is None:
            raise UnknownConsumer(shard_name, name, tuple(sorted(state.consumers)))
        at, seqno, what = _reset_target(shard, state, to_time=to_time, to_seqno=to_seqno)
        if at > state.upper:
            raise InvalidFrontier(
                f"cannot reset consumer {name!r} of shard {shard_name!r} to {what}: past the "
                f"upper {base._time(state.upper)}; give a time up to it; nothing changed"
            )
        offset = Offset(shard_name, seqno, at, LISTEN, None, state.incarnation)
        hold = since_after(offset) or 0
        if hold < state.since:
            raise InvalidFrontier(
                f"cannot reset consumer {name!r} of shard {shard_name!r} to {what}: reading the "
                f"changes from there needs the collection at {hold}, before the shard's since "
                f"{state.since} (older times were compacted together); reset it to a time from "
                f"{state.since + 1} on; nothing changed"
            )
        now = shard.machine.clock_ms()
        fenced = before.holder if is_held(state, before, now) else ""
        shard.reset_consumer(
            name,
            position=offset_json(offset),
            upper=consumed_upper(offset),
            since=hold,
            force=force,
        )
        after = shard.machine.fetch_latest()
        now = shard.machine.clock_ms()
    return {
        "shard": shard_name,
        "consumer": name,
        "before": consumer_info(state, name, before, now),
        "after": consumer_info(after, name, after.consumers[name], now),
        "fenced": fenced,
    }


def format_reset(result: dict[str, Any]) -> str:
    """The readable form of :func:`reset`."""
    b, a = result["before"], result["after"]
    fenced = f"; its holder ({result['fenced']}) is fenced" if result["fenced"] else ""
    return (
        f"consumer {result['consumer']!r} of shard {result['shard']!r} reset: upper "
        f"{base._time(b['upper'])} -> {base._time(a['upper'])}, behind {b['behind']['rows']} -> "
        f"{a['behind']['rows']} rows, epoch {b['epoch']} -> {a['epoch']}{fenced}; its next query "
        "reads on from there"
    )


def drop(where: base.Location, shard_name: str, name: str, *, force: bool) -> dict[str, Any]:
    """Remove consumer ``name`` and its hold (ConsumerInUse while a live query holds it unless
    ``force``; UnknownConsumer when absent; nothing written either way)."""
    from pyspark_persist.state.consumers import is_held
    from pyspark_persist.state.errors import UnknownConsumer

    with base._shard(where, shard_name) as (_client, shard):
        state = shard.machine.fetch_latest()
        before = state.consumers.get(name)
        if before is None:
            raise UnknownConsumer(shard_name, name, tuple(sorted(state.consumers)))
        now = shard.machine.clock_ms()
        fenced = before.holder if is_held(state, before, now) else ""
        shard.drop_consumer(name, force=force)
        since = shard.machine.fetch_latest().since
    return {
        "shard": shard_name,
        "consumer": name,
        "dropped": consumer_info(state, name, before, now),
        "fenced": fenced,
        "since": since,
    }


def format_drop(result: dict[str, Any]) -> str:
    """The readable form of :func:`drop`."""
    d = result["dropped"]
    fenced = f"; its holder ({result['fenced']}) loses it" if result["fenced"] else ""
    return (
        f"dropped consumer {result['consumer']!r} of shard {result['shard']!r} (it was at upper "
        f"{base._time(d['upper'])}, {d['behind']['rows']} rows behind){fenced}; the shard's since "
        f"is {base._time(result['since'])}"
    )


# --------------------------------------------------------------------------- the commands


def _consumer_name(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """A consumer name Consensus keys can hold, or click's usage error (exit 2) naming the rule."""
    from pyspark_persist.state.consumers import validate_consumer_name
    from pyspark_persist.state.errors import InvalidUsage

    if value is None:
        return None
    try:
        return validate_consumer_name(value)
    except InvalidUsage as e:
        raise click.BadParameter(str(e), ctx, param) from None


@click.command(
    "list",
    context_settings=base.CONTEXT,
    short_help="List a shard's consumers: position, lag, holder.",
)
@base._location_options
@click.argument("shard", metavar="SHARD")
@click.option("--json", "as_json", is_flag=True, help=base.JSON_HELP)
@base._bounded
def consumers_list(shard: str, as_json: bool) -> int:
    """List a shard's named consumers, one line each: position (upper, phase), rows, bytes and
    time behind the shard's upper, last commit, whether a live query holds it, epoch; flags
    the expired ones and those holding data older than the shard's retention."""
    return base._emit(list_consumers(base._where(), shard), as_json, format_list)


@click.command(
    "show", context_settings=base.CONTEXT, short_help="Show every field of a shard's consumers."
)
@base._location_options
@click.argument("shard", metavar="SHARD")
@click.argument("name", metavar="[NAME]", required=False, callback=_consumer_name)
@click.option("--json", "as_json", is_flag=True, help=base.JSON_HELP)
@base._bounded
def consumers_show(shard: str, name: str | None, as_json: bool) -> int:
    """Show consumer NAME of SHARD (default: each one) in full: position, hold, lag, last
    commit, holder and whether its query is live, epoch, planned micro-batches, expiry."""
    return base._emit(list_consumers(base._where(), shard, name), as_json, format_show)


@click.command(
    "reset", context_settings=base.CONTEXT, short_help="Move a consumer to a time or SeqNo."
)
@base._location_options
@click.argument("shard", metavar="SHARD")
@click.argument("name", metavar="NAME", callback=_consumer_name)
@click.option(
    "--to-time",
    type=base._TimeParam(),
    default=None,
    metavar="T",
    help="read on from the changes at times from T on; epoch ms, YYYY-MM-DD or ISO-8601",
)
@click.option(
    "--to-seqno",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="read on from the changes committed after SeqNo N (from its upper)",
)
@click.option(
    "--force", is_flag=True, help="reset even while a live query holds it (that query is fenced)"
)
@click.option("--json", "as_json", is_flag=True, help=base.JSON_HELP)
@base._bounded
def consumers_reset(
    shard: str, name: str, to_time: int | None, to_seqno: int | None, force: bool, as_json: bool
) -> int:
    """Move consumer NAME of SHARD: the next query using it reads on from the changes at --to-time
    T (or after SeqNo --to-seqno N). Refused while a live query holds it (--force fences that
    query), and when those changes were compacted away."""
    result = reset(base._where(), shard, name, to_time=to_time, to_seqno=to_seqno, force=force)
    return base._emit(result, as_json, format_reset)


@click.command("drop", context_settings=base.CONTEXT, short_help="Remove a consumer and its hold.")
@base._location_options
@click.argument("shard", metavar="SHARD")
@click.argument("name", metavar="NAME", callback=_consumer_name)
@click.option(
    "--force", is_flag=True, help="drop even while a live query holds it (that query fails)"
)
@click.option("--json", "as_json", is_flag=True, help=base.JSON_HELP)
@base._bounded
def consumers_drop(shard: str, name: str, force: bool, as_json: bool) -> int:
    """Remove consumer NAME of SHARD: its position and its hold on the shard's data. Refused
    while a live query holds it (--force: that query fails at its next micro-batch)."""
    return base._emit(drop(base._where(), shard, name, force=force), as_json, format_drop)


COMMANDS: dict[str, click.Command] = {
    c.name or "": c for c in (consumers_list, consumers_show, consumers_reset, consumers_drop)
}
"""The ``persist consumers`` commands, by name, in the order ``--help`` lists them."""
