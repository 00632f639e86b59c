"""Persist's logs: quiet by default, structured when asked for.

Every module logs to its own logger, ``logging.getLogger(__name__)``, so each
layer has one parent: ``pyspark_persist.state``, ``pyspark_persist.pubsub``,
``pyspark_persist.tools``, and ``pyspark_persist`` itself for the connector.
Persist never configures logging unless asked: with no handler set up by the
application, Python prints only WARNING and above (a store that has been
failing for 5 s, a PubSub server that stopped), and a normal run prints nothing.

Asked means ``PERSIST_LOG_LEVEL`` (``DEBUG``, ``INFO``, ``WARNING``, ``ERROR``)
in the environment, read when ``pyspark_persist.state`` is imported (so Spark's
Python workers honour it too), or ``persist -v``/``-vv`` on the command line, or
:func:`configure` from Python. Then persist's records go to stderr, one line
each, as ``key=value`` pairs (``PERSIST_LOG_FORMAT=json``: one JSON object), e.g. (one
line, wrapped here)::

    time=2026-11-23T16:04:05.123Z level=DEBUG logger=pyspark_persist.state.maintenance
        msg="shard events: gc to SeqNo 6 deleted 0 parts, 0 rollups, 5 rows, 0 orphans"

An application that configures logging itself needs none of this: the
``pyspark_persist`` loggers propagate to its handlers as usual.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings
from datetime import UTC, datetime

from .errors import InvalidUsage

LOGGER = "pyspark_persist"
"""The parent of every persist logger."""
LEVEL_ENV = "PERSIST_LOG_LEVEL"
"""Environment variable naming the level from which persist's records are printed."""
FORMAT_ENV = "PERSIST_LOG_FORMAT"
"""``kv`` (default) or ``json``."""
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("kv", "json")


def _fields(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, str]:
    when = datetime.fromtimestamp(record.created, UTC)
    fields = {
        "time": when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z",
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
    }
    if record.exc_info:
        fields["exc"] = formatter.formatException(record.exc_info)
    return fields


class KeyValueFormatter(logging.Formatter):
    """One line of ``key=value`` pairs; values with spaces, quotes or ``=`` are quoted."""

    def format(self, record: logging.LogRecord) -> str:
        """``time=... level=... logger=... msg="..."`` (and ``exc=...`` with a traceback)."""
        return " ".join(f"{k}={_quote(v)}" for k, v in _fields(record, self).items())


class JsonFormatter(logging.Formatter):
    """One JSON object per record, with the same keys as :class:`KeyValueFormatter`."""

    def format(self, record: logging.LogRecord) -> str:
        """The record's fields as one line of JSON."""
        return json.dumps(_fields(record, self), ensure_ascii=False)


def _quote(value: str) -> str:
    if value and not any(c in value for c in ' "=\n\t'):
        return value
    return json.dumps(value, ensure_ascii=False)


class _PersistHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The stderr handler :func:`configure` installs (one at a time)."""


def configure(level: str | int, fmt: str = "kv") -> logging.Handler:
    """Print persist's records from ``level`` on, to stderr, in ``fmt`` (``kv`` or ``json``).

    Replaces a handler an earlier call installed; records still propagate to the
    application's own handlers. Raises :class:`InvalidUsage` for an unknown level or format.
    """
    if isinstance(level, str):
        name = level.strip().upper()
        if name not in LEVELS:
            raise InvalidUsage(
                f"unknown log level {level!r}: use one of {', '.join(LEVELS)} "
                f"(in ${LEVEL_ENV} or with -v/-vv)"
            )
        level = logging.getLevelName(name)
    if fmt not in FORMATS:
        raise InvalidUsage(f"unknown log format {fmt!r} (${FORMAT_ENV}): use kv or json")
    logger = logging.getLogger(LOGGER)
    for old in [h for h in logger.handlers if isinstance(h, _PersistHandler)]:
        logger.removeHandler(old)
    handler = _PersistHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else KeyValueFormatter())
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler


def configure_from_environment() -> logging.Handler | None:
    """:func:`configure` from ``$PERSIST_LOG_LEVEL`` and ``$PERSIST_LOG_FORMAT``; nothing when
    the level is unset. A bad value is a warning here (this runs at import), not an error."""
    level = os.environ.get(LEVEL_ENV, "").strip()
    if not level:
        return None
    try:
        return configure(level, os.environ.get(FORMAT_ENV, "kv").strip().lower() or "kv")
    except InvalidUsage as e:
        warnings.warn(f"pyspark_persist: {e}; logs stay at the default", stacklevel=2)
        return None
