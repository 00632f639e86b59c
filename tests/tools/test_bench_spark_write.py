"""``persist bench spark-write``'s options and report, without Spark."""

from __future__ import annotations

from pyspark_persist.tools.bench import spark_write
from pyspark_persist.tools.bench.spark_write import (
    Report,
    SparkWriteOptions,
    WriteFigures,
    render,
)


def _parse(argv: list[str]) -> SparkWriteOptions:
    return spark_write.BENCHMARK.parse(argv)


def test_arrow_batch_rows_defaults_to_sparks_and_is_named_in_the_report() -> None:
    """Without the option the run keeps Spark's Arrow batch size and says so; with it the
    header names the batch size every Python sink of the run was handed."""
    assert _parse([]).arrow_batch_rows is None
    ns = _parse(["--arrow-batch-rows", "65536"])
    assert ns.arrow_batch_rows == spark_write.DEFAULT_BATCH_ROWS == 65536
    figures = [WriteFigures("persist append", 10, 1.0, 10.0, 1.0)]
    default = render(Report(size_mib=1.0, partitions=2, master="local[2]", write=figures))
    assert "Spark's default Arrow batches into Python sinks" in default.splitlines()[0]
    tuned = render(
        Report(size_mib=1.0, partitions=2, master="local[2]", arrow_batch_rows=65536, write=figures)
    )
    assert "65,536-row Arrow batches into Python sinks" in tuned.splitlines()[0]


def test_a_ratio_just_under_its_target_is_not_printed_as_the_target() -> None:
    """0.997 of Parquet's speed misses a 1.0x target, and the line says so in figures that
    show it (it had printed "1.00x NOT met"); a ratio on the target keeps two decimals."""
    figures = [WriteFigures("persist append", 10, 1.0, 10.0, 1.0)]
    ratios = {"persist append": 0.997, "persist overwrite": 1.0}
    text = render(
        Report(size_mib=1.0, partitions=2, master="local[2]", write=figures, mode_ratios=ratios)
    )
    assert "persist append / parquet append = 0.997x (target >= 1.0x: NOT met)" in text
    assert "persist overwrite / parquet = 1.00x (target >= 1.0x: met)" in text


def test_lift_arrow_byte_cap_sets_the_one_value_spark_skips_and_names_it() -> None:
    """Spark skips measuring its Arrow batch row by row only at Java's Integer.MAX_VALUE
    exactly; the flag is off by default (a run as a new user's session is), and a run with it
    says so in its header."""
    assert _parse([]).lift_arrow_byte_cap is False
    assert _parse(["--lift-arrow-byte-cap"]).lift_arrow_byte_cap is True
    assert spark_write.NO_ARROW_BYTE_CAP == 2**31 - 1
    figures = [WriteFigures("persist append", 10, 1.0, 10.0, 1.0)]
    lifted = render(
        Report(
            size_mib=1.0,
            partitions=2,
            master="local[2]",
            arrow_byte_cap_lifted=True,
            write=figures,
        )
    )
    assert "Spark's default Arrow batches not measured row by row" in lifted.splitlines()[0]


def test_a_new_sessions_first_write_is_printed_beside_the_steady_one() -> None:
    """A user's one-off job pays what the warmed rounds do not (Python workers starting, the
    sink's imports, a new shard): the report prints each sink's first write of a new session
    and the next one, and persist's first against the discarding sink's first beside the
    steady-state ratio, so neither figure passes for the other."""
    assert _parse([]).skip_first_write is False
    assert spark_write.FIRST_WRITERS == ("discard", "persist append")
    report = Report(
        size_mib=1.0,
        partitions=2,
        master="local[2]",
        write=[
            WriteFigures("persist append", 10, 1.0, 10.0, 1.0),
            WriteFigures("discard", 10, 1.0, 10.0, 1.0),
        ],
        first_write=[
            WriteFigures("discard first", 10, 4.0, 2.5, 0.25, 3.0, 2.0),
            WriteFigures("discard next", 10, 1.0, 10.0, 1.0, 1.0, 0.5),
            WriteFigures("persist append first", 10, 5.0, 2.0, 0.2, 4.0, 3.0),
            WriteFigures("persist append next", 10, 1.0, 10.0, 1.0, 1.0, 0.5),
        ],
        first_write_ratio=0.8,
    )
    assert report.figures("persist append first").seconds == 5.0
    text = render(report)
    assert "A user's first write" in text
    assert "persist append first" in text and "discard next" in text
    assert (
        "persist append first / discard first = 0.80x "
        "(steady state above: persist append / discard = 1.00x)" in text
    )
