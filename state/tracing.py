"""OpenTelemetry spans at persist's API boundary, as the persist crate docs describe them.

The policy (persist's, "OpenTelemetry Tracing Spans"):

- every span has one attribute, ``shard`` (the shard id), and no other;
- every public method of the shard API (``PersistClient.open_shard``,
  ``Shard.state``/``compact``/``gc``, ``WriteHandle.compare_and_append``,
  ``ReadHandle.snapshot``/``listen``, ``Listen.next``, ...) opens a span named
  ``Class.method``; sugar such as ``WriteHandle.append`` gets one too, with
  the methods it is built from nested under it;
- every write to an external system is traced: ``Blob.set``/``Blob.delete``
  and ``Consensus.compare_and_set``/``Consensus.truncate``; Blob reads
  (``Blob.get``, S3 round trips) too, Consensus reads are not (too chatty).

Spans go through ``opentelemetry-api``'s public functions only (private
names change between releases), which are a no-op until the application
installs an SDK (``opentelemetry.trace.set_tracer_provider``). Until then
each traced call asks ``get_tracer_provider()`` (about 1 µs, some 5 µs of
a one-row append) and creates no span object; once a provider is set it is
kept, since the API never replaces it. Without ``opentelemetry-api``
installed at all spans are always off. :func:`use_tracer_provider` routes persist's spans to a
provider of your own instead of the global one (tests use it).

Example::

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
    from opentelemetry import trace

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)   # persist's spans now export
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer, TracerProvider

TRACER_NAME = "pyspark_persist"
"""The instrumentation scope of every persist span."""

SHARD_ATTRIBUTE = "shard"
"""The one attribute every persist span carries."""

P = ParamSpec("P")
R = TypeVar("R")

_otel: Any = None
"""``opentelemetry.trace`` once imported; ``False`` when it is not installed."""
_proxy_type: type | None = None
_global: TracerProvider | None = None
"""The global provider, once the application has set one. The API lets it be set only once
(``set_tracer_provider`` refuses to override it), so it is kept and never looked up again;
until then ``get_tracer_provider()`` is asked on each call (under a microsecond)."""
_override: TracerProvider | None = None
_tracers: dict[int, tuple[Any, Tracer]] = {}
"""id(provider) -> (provider, its persist tracer): one ``get_tracer`` per provider."""


def _load() -> Any:
    """Import ``opentelemetry.trace`` on first use (``False`` if it is not installed)."""
    global _otel, _proxy_type
    if _otel is None:
        try:
            from opentelemetry import trace
            from opentelemetry.trace import ProxyTracerProvider
        except ImportError:
            _otel = False
        else:
            _proxy_type = ProxyTracerProvider
            _otel = trace
    return _otel


def _global_provider() -> TracerProvider | None:
    """The application's global provider, or ``None`` while it has set none (the API's
    ``ProxyTracerProvider`` stands in until then, and records nothing)."""
    global _global
    if _global is None:
        otel = _otel if _otel is not None else _load()
        if otel is False:
            return None
        provider = otel.get_tracer_provider()  # also loads $OTEL_PYTHON_TRACER_PROVIDER
        if type(provider) is _proxy_type:
            return None
        _global = provider
    return _global


def use_tracer_provider(provider: TracerProvider | None) -> None:
    """Send persist's spans to ``provider`` (``None``: back to the global provider)."""
    global _override
    _override = provider
    _tracers.clear()


def current_tracer() -> Tracer | None:
    """The tracer persist's spans go to now, or ``None`` when tracing is off (no SDK)."""
    provider = _override or _global or _global_provider()
    if provider is None:
        return None
    entry = _tracers.get(id(provider))
    if entry is None or entry[0] is not provider:
        entry = _tracers[id(provider)] = (provider, provider.get_tracer(TRACER_NAME))
    return entry[1]


class _Untraced(threading.local):
    depth = 0
    """How many traced calls of this thread found tracing off and are still running."""


_untraced = _Untraced()
"""One tracer lookup per operation: the calls a traced call makes while tracing is off
(the machine, the stores, five to ten spans deep) skip the lookup and record nothing,
as they would after it. A provider set meanwhile is used from the next operation."""


def _run_untraced(fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
    _untraced.depth += 1
    try:
        return fn(*args, **kwargs)
    finally:
        _untraced.depth -= 1


def span(name: str, shard: str) -> Any:
    """A context manager: a span ``name`` with ``shard=shard`` (a no-op when tracing is off)."""
    tracer = current_tracer()
    if tracer is None:
        from contextlib import nullcontext

        return nullcontext()
    return tracer.start_as_current_span(name, attributes={SHARD_ATTRIBUTE: shard})


def traced(
    name: str, shard: str | Callable[..., str] = "shard_id"
) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a function so each call runs in a span ``name`` carrying the shard id.

    ``shard`` says where the id comes from: a dotted attribute path of the
    first argument (``self`` of a method, or a ``Machine``; default
    ``"shard_id"``, e.g. ``"name"`` or ``"_machine.shard_id"``), or a function
    called with the call's arguments (``lambda self, name, *a, **k: name``).
    The id is only looked up when a span is recorded.
    """
    if callable(shard):
        get_shard: Callable[..., Any] = shard
    else:
        path = attrgetter(shard)
        get_shard = lambda first, *_a, **_k: path(first)  # noqa: E731

    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            if _untraced.depth:
                return fn(*args, **kwargs)
            tracer = current_tracer()
            if tracer is None:
                return _run_untraced(fn, *args, **kwargs)
            attrs = {SHARD_ATTRIBUTE: str(get_shard(*args, **kwargs))}
            with tracer.start_as_current_span(name, attributes=attrs):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


def _key_shard(key: str) -> str:
    """The shard of a Blob key: its first segment (``{shard}/part/...``, ``{shard}/rollup/N``)."""
    return key.split("/", 1)[0]


def _store_method(name: str, fn: Callable[..., R]) -> Callable[..., R]:
    """Wrap ``fn(self, key, ...)`` of a Blob or Consensus in a span named ``name``."""
    if getattr(fn, "__persist_traced__", False):
        return fn
    shard_of = _key_shard if name.startswith("Blob.") else str

    @functools.wraps(fn)
    def wrapper(self: Any, key: str, *args: Any, **kwargs: Any) -> R:
        if _untraced.depth:
            return fn(self, key, *args, **kwargs)
        tracer = current_tracer()
        if tracer is None:
            return _run_untraced(fn, self, key, *args, **kwargs)
        with tracer.start_as_current_span(name, attributes={SHARD_ATTRIBUTE: shard_of(key)}):
            return fn(self, key, *args, **kwargs)

    wrapper.__persist_traced__ = True  # type: ignore[attr-defined]
    return wrapper


BLOB_TRACED = ("get", "get_view", "set", "delete")
"""Blob methods that open a span (every write, and reads, as persist traces S3 reads)."""
CONSENSUS_TRACED = ("compare_and_set", "compare_and_set_many", "truncate")
"""Consensus methods that open a span (every write; reads would be too chatty)."""


def trace_store_class(cls: type, kind: str, methods: tuple[str, ...]) -> None:
    """Wrap the listed methods ``cls`` defines itself (not inherited) in ``kind.method`` spans.

    Called from ``Blob.__init_subclass__``/``Consensus.__init_subclass__``, so
    every backend (and every wrapper of one) is traced without registration.
    """
    for method in methods:
        fn = cls.__dict__.get(method)
        if fn is not None and callable(fn) and not getattr(fn, "__isabstractmethod__", False):
            setattr(cls, method, _store_method(f"{kind}.{method}", fn))
