"""The write->listen probe that ``persist bench core`` and ``persist bench pubsub`` share
(:mod:`pyspark_persist.tools.bench.listen`); nothing here is timed against a figure."""

from __future__ import annotations

import pyarrow as pa
import pytest

from pyspark_persist.tools.bench.core import open_client
from pyspark_persist.tools.bench.listen import probe_listen

SCHEMA = pa.schema([("id", pa.int64())])


def _row(i: int) -> pa.Table:
    return pa.table({"id": [i]}, schema=SCHEMA)


@pytest.mark.parametrize("same_client", [True, False], ids=["same-client", "polling"])
def test_probe_sees_every_write_and_times_it_from_before_and_after_the_append(
    same_client: bool,
) -> None:
    """Every row reaches the listener (woken in-process, or polling from a client with its
    own state cache), and each row's write->listen span holds its commit->listen span (it
    adds the append itself)."""
    uris = ("mem://probe", "mem://probe")
    with open_client(uris) as writer:
        listener = writer if same_client else open_client(uris)
        try:
            seen = probe_listen(writer, listener, SCHEMA, _row, 5, (0.0, 1.0))
        finally:
            if listener is not writer:
                listener.close()
    assert seen.missed == 0 and len(seen.write_s) == len(seen.commit_s) == 5
    assert all(w >= c >= 0 for w, c in zip(seen.write_s, seen.commit_s, strict=True))


def test_probe_raises_the_listeners_error_at_once() -> None:
    """A listener that fails stops the probe with its error, rather than each row waiting out
    the timeout and being counted missed. Here the listener cannot find the ``id`` column the
    probe reads (the rows are keyed ``key``)."""
    keyed = pa.schema([("key", pa.int64())])
    with open_client(("mem://probe-error", "mem://probe-error")) as client:
        with pytest.raises(KeyError):
            probe_listen(
                client,
                client,
                keyed,
                lambda i: pa.table({"key": [i]}, schema=keyed),
                3,
                (0.0, 0.0),
                timeout_s=600.0,
            )
