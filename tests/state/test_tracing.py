"""Tracing as the persist crate docs describe it, seen through an in-memory exporter.

Every public shard API method opens a span named ``Class.method`` whose only
attribute is ``shard``; Blob and Consensus writes are spans too. Without an
SDK nothing is recorded. Logs stay quiet at INFO on the normal path.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from pyspark_persist.state import PersistClient, PersistConfig, tracing
from pyspark_persist.state.blob import open_blob
from pyspark_persist.state.cache import StateCache
from pyspark_persist.state.consensus import open_consensus

sdk_trace = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

SCHEMA = pa.schema([("id", pa.int64()), ("payload", pa.string())])


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    """Persist's spans go to an in-memory exporter for the test (the global provider is
    left alone, so other tests are not traced)."""
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_tracer_provider(None)
        provider.shutdown()


def mem_client(**config: Any) -> PersistClient:
    name = uuid.uuid4().hex
    return PersistClient(
        open_blob(f"mem://{name}"),
        open_consensus(f"mem://{name}"),
        config=PersistConfig(maintenance=False, **config),
        cache=StateCache(),
    )


def rows(start: int, n: int = 50) -> pa.Table:
    return pa.table({"id": list(range(start, start + n)), "payload": ["x" * 40] * n})


def cycle(client: PersistClient, name: str) -> None:
    """Write, snapshot, listen; then compaction and GC (Blob deletes, Consensus truncation)."""
    shard = client.open_shard(name, SCHEMA)
    writer = shard.writer("w")
    writer.append(rows(0))
    reader = shard.reader()
    assert reader.snapshot_table().num_rows == 50
    listen = reader.listen(reader.latest_as_of())
    writer.append(rows(50))
    event = listen.next(timeout_s=5)
    assert event is not None and reader.fetch(event.parts).num_rows == 50
    listen.close()
    for i in range(2, 12):
        writer.append(rows(50 * i))
    reader.close()
    shard.compact()
    shard.gc()


def test_api_and_store_writes_are_spans_with_only_the_shard(
    exporter: InMemorySpanExporter,
) -> None:
    client = mem_client(inline_write_max_bytes=1, rollup_interval=4, compaction_fan_in=4)
    cycle(client, "traced")
    client.close()
    spans = exporter.get_finished_spans()
    names = {s.name for s in spans}
    for expected in (
        "PersistClient.open_shard",
        "Shard.reader",
        "Shard.compact",
        "Shard.gc",
        "WriteHandle.append",
        "WriteHandle.compare_and_append_batches",
        "BatchBuilder.finish",
        "ReadHandle.snapshot_table",
        "ReadHandle.snapshot",
        "ReadHandle.latest_as_of",
        "ReadHandle.listen",
        "Listen.next",
        "ReadHandle.fetch",
        "ReadHandle.close",
        "compact",
        "gc",
        "Blob.set",
        "Blob.get",
        "Blob.delete",
        "Consensus.compare_and_set",
        "Consensus.truncate",
    ):
        assert expected in names, (expected, sorted(names))
    for s in spans:  # persist's policy: a shard attribute and no other
        assert dict(s.attributes or {}) == {"shard": "traced"}, (s.name, s.attributes)
        assert s.instrumentation_scope is not None
        assert s.instrumentation_scope.name == "pyspark_persist"
    # Store writes nest under the API call that made them.
    by_id = {s.context.span_id: s for s in spans}
    append = next(s for s in spans if s.name == "WriteHandle.append")
    cas = [
        s
        for s in spans
        if s.name == "Consensus.compare_and_set" and s.context.trace_id == append.context.trace_id
    ]
    assert cas, "the append's compare-and-set is in the append's trace"
    chain, span = [], cas[0]
    while span.parent is not None:
        span = by_id[span.parent.span_id]
        chain.append(span.name)
    assert "WriteHandle.append" in chain


def test_spans_name_the_shard_of_each_call(exporter: InMemorySpanExporter) -> None:
    client = mem_client()
    a = client.open_shard("alpha", SCHEMA)
    b = client.open_shard("beta", SCHEMA)
    a.writer().append(rows(0, 1))
    b.writer().append(rows(0, 1))
    client.close()
    shards = {
        (s.name, s.attributes["shard"]) for s in exporter.get_finished_spans() if s.attributes
    }
    assert {
        ("WriteHandle.append", "alpha"),
        ("WriteHandle.append", "beta"),
        ("Consensus.compare_and_set", "alpha"),
        ("Consensus.compare_and_set", "beta"),
    } <= shards


def test_off_without_an_sdk() -> None:
    from opentelemetry import trace

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("another test installed a global tracer provider")
    assert tracing.current_tracer() is None
    client = mem_client()
    client.open_shard("quiet", SCHEMA).writer().append(rows(0, 1))
    client.close()


GLOBAL_PROVIDER_CHILD = """
import json, sys
import pyarrow as pa
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from pyspark_persist.state import PersistClient

client = PersistClient.open(f"file://{sys.argv[1]}/blob", f"sqlite:///{sys.argv[1]}/c.db")
shard = client.open_shard("before", pa.schema([("id", pa.int64())]))
shard.writer().append(pa.table({"id": [0]}))  # no provider yet: nothing is recorded

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # the application's global provider, set once

shard = client.open_shard("orders", pa.schema([("id", pa.int64())]))
shard.writer().append(pa.table({"id": [1, 2]}))
reader = shard.reader()
assert reader.snapshot_table().num_rows == 2
reader.close()
client.close()
print(json.dumps([[s.name, dict(s.attributes or {}), s.instrumentation_scope.name]
                  for s in exporter.get_finished_spans()]))
"""


def test_spans_of_a_write_and_a_read_reach_the_global_provider(tmp_path: Path) -> None:
    """The application's way: ``trace.set_tracer_provider`` (public API), here after persist
    already ran untraced, in a fresh interpreter since the global provider is set once."""
    done = subprocess.run(
        [sys.executable, "-c", GLOBAL_PROVIDER_CHILD, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    spans = json.loads(done.stdout)
    names = [name for name, _, _ in spans]
    for expected in (
        "PersistClient.open_shard",
        "WriteHandle.append",
        "WriteHandle.compare_and_append_batches",
        "Consensus.compare_and_set",
        "Shard.reader",
        "ReadHandle.snapshot_table",
        "ReadHandle.snapshot",
        "ReadHandle.fetch",
        "ReadHandle.close",
    ):
        assert expected in names, (expected, names)
    assert {(str(attrs), scope) for _, attrs, scope in spans} == {
        (str({"shard": "orders"}), "pyspark_persist")
    }, "only the shard written after the provider was set, and only its name"


def test_no_logs_at_info_on_the_normal_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pyspark_persist")
    client = PersistClient.open(
        f"file://{tmp_path}/blob",
        f"sqlite:///{tmp_path}/consensus.db",
        config=PersistConfig(inline_write_max_bytes=1, rollup_interval=4, compaction_fan_in=4),
    )
    cycle(client, "logs")
    assert client.maintenance.wait_idle(30)
    client.close()
    loud = [
        f"{r.name}: {r.getMessage()}"
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name.startswith("pyspark_persist")
    ]
    assert loud == []


def test_only_the_public_opentelemetry_api_is_used() -> None:
    """No ``_private`` name of opentelemetry is read: they change between releases."""
    repo = Path(__file__).resolve().parents[2]
    private = re.compile(r"\b(?:otel|trace|opentelemetry(?:\.\w+)*)\._\w+")
    used = [
        f"{path.relative_to(repo)}: {m.group(0)}"
        for layer in ("state", "pubsub", "connector", "tools")
        for path in sorted((repo / layer).rglob("*.py"))
        for m in private.finditer(path.read_text())
    ]
    assert used == []


def test_tracing_turned_on_between_writes_traces_the_next_write_whole() -> None:
    """Whether a write is traced is decided once, when it starts: a provider set between two
    writes traces every span of the second (the stores' included), none of the first, and
    once it is taken away the next write records nothing."""
    client = mem_client()
    writer = client.open_shard("switch", SCHEMA).writer()
    writer.append(rows(0, 1))
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        writer.append(rows(1, 1))
    finally:
        tracing.use_tracer_provider(None)
    writer.append(rows(2, 1))
    client.close()
    names = Counter(s.name for s in exporter.get_finished_spans())
    assert names["WriteHandle.append"] == 1
    assert names["Consensus.compare_and_set"] == 1
    provider.shutdown()
