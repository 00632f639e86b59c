"""Fetching a part: its stored bytes out of Blob, checked against its CRC-32.

The I/O half of reading a part (the decoding is :mod:`.codec`'s, the shaping
:mod:`.updates`'); and handing Arrow's freed memory back once a part is done with.
"""

from __future__ import annotations

import pyarrow as pa

from .blob import Blob
from .codec import part_checksum
from .errors import CorruptData, PartNotFound
from .state import PartRef


def fetch_part_bytes(blob: Blob, part: PartRef, shard_id: str) -> memoryview:
    """The stored bytes of a part, checked against its CRC; PartNotFound when Blob no longer
    has it. A view (``Blob.get_view``): a file part is mapped, not copied."""
    if part.inline is not None:
        return memoryview(part.inline)
    assert part.key is not None
    data = blob.get_view(part.key)
    if data is None:
        raise PartNotFound(
            f"part {part.key!r} of shard {shard_id!r} is missing from blob {blob.uri}: it was "
            "deleted by GC (read with a lease, or from a newer as_of) or the blob store is wrong"
        )
    if part.crc is not None and part_checksum(data) != part.crc:
        raise CorruptData(
            f"part {part.key!r} of shard {shard_id!r} in blob {blob.uri} does not match its "
            "checksum: the object is corrupt (restore it from a backup of the blob store)"
        )
    return data


def release_memory() -> None:
    """Hand Arrow's freed pages back to the OS after a part is done with.

    Arrow's allocator otherwise keeps them cached, so a writer or reader that
    handled many parts shows an RSS far above what it holds (the memory model
    counts what is held: B per part in flight).
    """
    pa.default_memory_pool().release_unused()
