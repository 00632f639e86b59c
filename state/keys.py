"""Part keys: how a part's Blob key is spelled, and what GC reads back from it.

A part is written once under a key nobody used before:
``<shard>/part/<created ms, 13 digits>-<nonce>.<format>``. The creation time
leads the name so GC can tell a part staged moments ago (its commit may be on
the way) from one a crashed writer left behind, with no Blob metadata. Pure:
the caller supplies the time and the nonce (:func:`~.staging.new_part_key`
reads the clock and draws the nonce).
"""

from __future__ import annotations


def part_key(shard_id: str, fmt: str, created_ms: int, nonce: str) -> str:
    """The Blob key of a part of ``shard_id`` in format ``fmt``, created at ``created_ms``.

    ``nonce`` makes it unique (a random hex string): two parts staged in the
    same millisecond never share a key.
    """
    return f"{shard_id}/part/{created_ms:013d}-{nonce}.{fmt}"


def part_key_created_ms(key: str) -> int | None:
    """The creation time encoded in a part key, or None for a key of another form."""
    name = key.rsplit("/", 1)[-1]
    stamp, sep, _ = name.partition("-")
    return int(stamp) if sep and stamp.isdigit() else None
