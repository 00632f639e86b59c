"""The benchmarks' one interface (:mod:`pyspark_persist.tools.bench.api`): flags declared once
by the options, checked before anything runs, and one table of benchmarks."""

from __future__ import annotations

import importlib
import shlex
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from pyspark_persist.tools.bench import BENCHMARKS, core, pubsub, report
from pyspark_persist.tools.bench.api import (
    Benchmark,
    Options,
    Result,
    command_line,
    csv,
    flag,
    setting,
)


@dataclass(frozen=True)
class Demo(Options):
    """Options of a made-up benchmark."""

    places: tuple[str, ...] = flag(("a", "b"), "places", parse=csv, choices=("a", "b", "c/d"))
    writes: int = flag(100, "writes", quick=5, positive=True)
    gap_ms: float = flag(20.0, "gap")
    mode: str = flag("x", "mode", choices=("x", "y"))
    workdir: str | None = flag(None, "where")
    dry: bool = flag(False, "change nothing")
    warmup: int = setting(10, quick=1)


def test_quick_sets_the_declared_values_and_an_explicit_flag_wins() -> None:
    bench = core.BENCHMARK  # any benchmark parses the same way; Demo goes through its parser
    assert bench.parse(["--quick"]) == core.BenchConfig.make(quick=True)
    assert core.BenchConfig.make(quick=True).writes == 100
    parse = _parser(Demo)
    assert parse("") == Demo()
    assert parse("--quick") == Demo(writes=5, warmup=1, quick=True)
    assert parse("--quick --writes 7 --dry") == Demo(writes=7, warmup=1, dry=True, quick=True)
    assert parse("--places c-d,a --gap-ms 2.5 --workdir /w") == Demo(
        places=("c/d", "a"), gap_ms=2.5, workdir="/w"
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ("--writes 0", "--writes must be positive"),
        ("--places a,e", "unknown place 'e': use some of a, b, c/d"),
        ("--mode z", "unknown mode 'z': use one of x, y"),
    ],
)
def test_a_value_its_flag_refuses_is_named_before_anything_runs(argv: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        _parser(Demo)(argv)
    assert str(e.value) == message


def test_options_made_in_code_are_checked_as_flags_are() -> None:
    with pytest.raises(ValueError, match="^--samples must be positive$"):
        pubsub.PubSubOptions(samples=0)
    with pytest.raises(ValueError, match="^unknown location 'file/s3': use some of "):
        pubsub.PubSubOptions(locations=("file/s3",))
    with pytest.raises(ValueError, match="^--maintenance-writes must be positive$"):
        report.ReportOptions.make(quick=True, maintenance_writes=-1)


def test_command_line_gives_back_the_options() -> None:
    """The command a report shows reproduces its options: the flags that differ from what
    --quick (or the defaults) would give."""
    options = Demo.make(quick=True, places=("c/d",), dry=True, workdir="/tmp/x y")
    line = command_line("persist bench demo", options)
    assert line == "persist bench demo --quick --places c/d --workdir '/tmp/x y' --dry"
    assert _parser(Demo)(shlex.join(shlex.split(line)[3:])) == options
    assert command_line("persist bench demo", Demo()) == "persist bench demo"


def test_every_benchmark_in_the_table_is_its_modules_benchmark() -> None:
    """The CLI's subcommands and ``persist bench all`` come from one table: each entry names
    a module whose BENCHMARK answers to the entry's name and has options."""
    for name, (module, summary) in BENCHMARKS.items():
        bench = importlib.import_module(f"pyspark_persist.tools.bench.{module}").BENCHMARK
        assert bench.name == name and bench.prog == f"persist bench {name}"
        assert summary and len(bench.about) > 20, name
        assert bench.parse([]) == bench.options() and bench.parse(["--quick"]).quick


def _parser(cls: type[Options]) -> Callable[[str], Options]:
    """Parse a command line into ``cls``, as every benchmark's flags are parsed."""
    bench = Benchmark("demo", cls, lambda o: Result(), str, "Demo.")
    return lambda argv: bench.parse(shlex.split(argv))
