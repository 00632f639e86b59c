"""One interface for every benchmark: an options dataclass in, a result dataclass out, one render.

A benchmark is a :class:`Benchmark`: its options are a frozen dataclass deriving from
:class:`Options`, whose fields declare their command-line flags once (:func:`flag`), and
its ``run(options)`` returns a :class:`Result` that ``render`` turns into the text people
read. From that one declaration come the flags of ``persist bench NAME`` and of
``python -m pyspark_persist.tools.bench.MODULE``, what ``--quick`` shrinks (explicit flags
still win), the checks a value must pass before anything runs, and the command line that
reproduces a set of options. ``persist bench all`` builds the options of each benchmark in
code, calls ``run`` and reads the result's fields: no argument lists, no scraped stdout.

A result leaves room for named variants (the Spark benchmarks name each reader and writer
they time, and look them up by name), so a measurement can be added beside the others
without a new field.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Generic, Self, TypeVar

FLAG = "persist.bench.flag"
"""The metadata key of a field's :class:`Flag`."""
QUICK = "persist.bench.quick"
"""The metadata key of a field's value under ``--quick``."""


@dataclass(frozen=True)
class Flag:
    """How an options field is given on the command line: ``--field-name VALUE``."""

    help: str
    parse: Callable[[str], Any] | None = None
    """Text to value; by default the field's type (``int``, ``float``, ``str``; a ``bool``
    field is a switch)."""
    choices: tuple[str, ...] = ()
    """The values allowed (each item of a tuple value)."""
    positive: bool = False
    """The value must be above zero."""


_NO_QUICK = object()


def flag(
    default: Any,
    help: str,
    *,
    quick: Any = _NO_QUICK,
    parse: Callable[[str], Any] | None = None,
    choices: Sequence[str] = (),
    positive: bool = False,
) -> Any:
    """An options field that is also the flag ``--NAME`` (the field's name, ``_`` as ``-``),
    with ``quick`` its value under ``--quick`` when that differs from ``default``."""
    metadata: dict[str, Any] = {FLAG: Flag(help, parse, tuple(choices), positive)}
    if quick is not _NO_QUICK:
        metadata[QUICK] = quick
    return field(default=default, metadata=metadata)


def setting(default: Any, *, quick: Any) -> Any:
    """An options field with no flag whose value ``--quick`` changes."""
    return field(default=default, metadata={QUICK: quick})


@dataclass(frozen=True)
class Options:
    """The base of every benchmark's options: checked when made (see :class:`Flag`)."""

    quick: bool = field(default=False, kw_only=True)
    """A smoke run: the fields' ``quick`` values where given no other."""

    def __post_init__(self) -> None:
        for f in fields(self):
            spec = f.metadata.get(FLAG)
            if spec is not None:
                _check(f.name, spec, getattr(self, f.name))

    @classmethod
    def make(cls, quick: bool = False, **given: Any) -> Self:
        """Options with ``--quick``'s values when ``quick``, and ``given`` over everything."""
        values = {f.name: f.metadata[QUICK] for f in fields(cls) if quick and QUICK in f.metadata}
        values.update(given)
        return cls(quick=quick, **values)


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _check(name: str, spec: Flag, value: Any) -> None:
    """Refuse a value its flag does not allow, naming the flag and what it takes."""
    if spec.positive and value is not None and value <= 0:
        raise ValueError(f"{_flag_name(name)} must be positive")
    if spec.choices:
        many = isinstance(value, tuple)
        for item in value if many else (value,):
            if item not in spec.choices:
                noun = name.removesuffix("s") if many else name
                raise ValueError(
                    f"unknown {noun} {item!r}: use {'some' if many else 'one'} of "
                    + ", ".join(spec.choices)
                )


def csv(text: str) -> tuple[str, ...]:
    """A comma list (``a,b``) as a tuple; ``-`` stands for ``/`` (``file-sqlite``)."""
    return tuple(v.strip().replace("-", "/") for v in text.split(",") if v.strip())


def _shown(value: Any) -> str:
    """A value as a flag takes it."""
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, float) and float(f"{value:g}") == value:
        return f"{value:g}"
    return str(value)


def _flag_fields(cls: type[Options]) -> list[tuple[dataclasses.Field[Any], Flag, Any]]:
    """Each flag field of ``cls`` with its :class:`Flag` and its resolved type."""
    hints = typing.get_type_hints(cls)
    return [(f, f.metadata[FLAG], hints[f.name]) for f in fields(cls) if FLAG in f.metadata]


def _parser_of(kind: Any) -> Callable[[str], Any]:
    """The text-to-value function of a field type (``int | None`` parses as ``int``)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is tuple:
        return csv
    if args:
        return _parser_of(args[0])
    if kind in (int, float, str):
        return typing.cast(Callable[[str], Any], kind)
    raise TypeError(f"no flag parser for a field of type {kind!r}: give flag(parse=...)")


def add_arguments(parser: argparse.ArgumentParser, cls: type[Options]) -> None:
    """``--quick``, ``--json`` and one flag per flag field of ``cls``, each unset by default
    (so an explicit flag is told apart from ``--quick``'s value)."""
    quick = [
        f"{_flag_name(f.name)} {_shown(f.metadata[QUICK])}"
        for f, _, _ in _flag_fields(cls)
        if QUICK in f.metadata
    ]
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run" + (f": {', '.join(quick)}" if quick else "") + " (explicit flags win)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    for f, spec, kind in _flag_fields(cls):
        text = spec.help
        if kind is not bool and f.default is not None:
            text += f" (default {_shown(f.default)}"
            text += f"; {_shown(f.metadata[QUICK])} with --quick)" if QUICK in f.metadata else ")"
        text = text.replace("%", "%%")  # argparse formats help with %
        if kind is bool:
            parser.add_argument(_flag_name(f.name), action="store_true", default=None, help=text)
        else:
            parse = spec.parse or _parser_of(kind)
            parser.add_argument(_flag_name(f.name), type=parse, default=None, help=text)


OptionsT = TypeVar("OptionsT", bound=Options)


def options_from_args(cls: type[OptionsT], ns: argparse.Namespace) -> OptionsT:
    """``cls``'s options from flags parsed by :func:`add_arguments`."""
    given = {f.name: getattr(ns, f.name) for f, _, _ in _flag_fields(cls)}
    return cls.make(bool(ns.quick), **{k: v for k, v in given.items() if v is not None})


def command_line(prog: str, options: Options) -> str:
    """The command that runs with ``options``: ``prog`` and the flags that differ from what
    ``--quick`` (when set) or the defaults would give."""
    base = type(options).make(options.quick)
    words = ["--quick"] if options.quick else []
    for f, _, kind in _flag_fields(type(options)):
        value = getattr(options, f.name)
        if value == getattr(base, f.name):
            continue
        words.append(_flag_name(f.name))
        if kind is not bool:
            words.append(_shown(value))
    return " ".join([prog, *(shlex.quote(w) for w in words)])


def json_value(x: Any) -> Any:
    """``x`` as plain JSON values: a dataclass as its fields, and a figure's derived
    properties beside them (options are what was asked: their fields alone)."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        out = {f.name: json_value(getattr(x, f.name)) for f in fields(x)}
        for name in () if isinstance(x, Options) else dir(type(x)):
            if isinstance(getattr(type(x), name, None), property):
                out[name] = json_value(getattr(x, name))
        return out
    if isinstance(x, dict):
        return {str(k): json_value(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_value(v) for v in x]
    return x


class Result:
    """The base of a benchmark's result (a dataclass): its JSON and its exit status."""

    def to_json(self) -> dict[str, Any]:
        """The result as plain JSON values: fields and derived properties."""
        value: dict[str, Any] = json_value(self)
        return value

    def exit_status(self) -> int:
        """0, or non-zero when the run found a fault (a target missed is not one)."""
        return 0


ResultT = TypeVar("ResultT", bound=Result)


@dataclass(frozen=True)
class Benchmark(Generic[OptionsT, ResultT]):
    """A benchmark: ``persist bench NAME``, its options, how it runs and how it reads."""

    name: str
    """``persist bench NAME``; the key of :data:`pyspark_persist.tools.bench.BENCHMARKS`."""
    options: type[OptionsT]
    run: Callable[[OptionsT], ResultT]
    render: Callable[[ResultT], str]
    doc: str | None
    """The module's docstring: its first paragraph is the ``--help`` description."""

    @property
    def prog(self) -> str:
        """How people call it."""
        return f"persist bench {self.name}"

    @property
    def about(self) -> str:
        """One paragraph saying what it measures."""
        return (self.doc or "").split("\n\n")[0]

    def _parse_args(
        self, argv: Sequence[str], parser: argparse.ArgumentParser | None
    ) -> argparse.Namespace:
        parser = parser or argparse.ArgumentParser(prog=self.prog, description=self.about)
        add_arguments(parser, self.options)
        return parser.parse_args(list(argv))

    def parse(self, argv: Sequence[str], parser: argparse.ArgumentParser | None = None) -> OptionsT:
        """Options from command-line words (``--json`` aside)."""
        return options_from_args(self.options, self._parse_args(argv, parser))

    def main(
        self, argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
    ) -> int:
        """Parse ``argv`` (default: the process's; ``parser`` to parse with, e.g. the CLI's),
        run, print the rendered result (or its JSON with ``--json``); the exit status is the
        result's."""
        ns = self._parse_args(sys.argv[1:] if argv is None else argv, parser)
        result = self.run(options_from_args(self.options, ns))
        print(
            json.dumps(result.to_json(), indent=2, default=str) if ns.json else self.render(result)
        )
        return result.exit_status()
