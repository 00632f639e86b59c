"""Smoke test of ``persist bench all`` (:mod:`pyspark_persist.tools.bench.report`).

Runs the whole report at ``--quick`` sizes without Spark and checks its shape:
every section header, a table of positive figures in each section that ran,
Spark reported as not run, a real PNG. No timed assertions: targets are for
people reading a full run on a quiet machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

pytest.importorskip("deltalake")
pytest.importorskip("matplotlib")

from pyspark_persist.tools.bench import report  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FIGURE = re.compile(r"^(-?[\d,]+(?:\.\d+)?(?:e[-+]?\d+)?|inf) ?(.*)$")


def _sections(md: str) -> dict[str, str]:
    """Section title -> its Markdown body."""
    parts = re.split(r"^## (.+)$", md, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _table(body: str) -> list[list[str]]:
    """The cells of every data row of the first table in ``body``."""
    rows = [line for line in body.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in rows[2:]]


def _figure(cell: str) -> tuple[float, str]:
    m = FIGURE.match(cell)
    assert m, f"not a figure: {cell!r}"
    return float(m.group(1).replace(",", "")), m.group(2)


@pytest.mark.slow
def test_bench_all_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The whole report runs in one go and writes report.md, report.png and report.json."""
    out = tmp_path / "report"
    argv = ["--quick", "--skip-spark", "--out", str(out), "--workdir", str(tmp_path)]
    status = report.BENCHMARK.main(argv)
    assert status == 0, capsys.readouterr().err

    md = (out / "report.md").read_text()
    assert md.startswith("# persist benchmark report")
    assert f"Command: `persist bench all --quick --out {out} --skip-spark --workdir " in md
    assert re.search(r"\d+ CPUs .*RAM.*Python 3\.\d+.*pyarrow .*pyspark .*deltalake ", md)

    sections = _sections(md)
    assert list(sections) == list(report.TITLES.values())
    spark = sections[report.TITLES["spark"]]
    assert "**not run**" in spark and "--skip-spark" in spark

    for key in ("core", "delta", "pubsub", "maintenance"):
        body = sections[report.TITLES[key]]
        rows = _table(body)
        assert rows, f"section {key} has no table:\n{body}"
        for cells in rows:
            assert len(cells) == 7, cells
            value, unit = _figure(cells[1])
            assert math.isfinite(value) and value >= 0, cells
            if unit != "reads/s":  # a push-woken idle listener may well make no reads
                assert value > 0, cells
            if cells[2] != "-":
                peer, _ = _figure(cells[3])
                assert peer >= 0, cells
    core_rows = {c[0].split(" (")[0]: c for c in _table(sections[report.TITLES["core"]])}
    assert "small write p50, file/sqlite" in core_rows
    assert any(k.startswith("write goodput") for k in core_rows)
    delta_rows = {c[0]: c for c in _table(sections[report.TITLES["delta"]])}
    assert delta_rows["one-row append p50"][2] == "Delta one-row append"
    assert any(c[2] == "Delta scan" for c in delta_rows.values())

    png = (out / "report.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000

    data = json.loads((out / "report.json").read_text())
    assert [s["key"] for s in data["sections"]] == list(report.TITLES)

    captured = capsys.readouterr()
    assert "| metric | persist | peer |" in captured.out
    assert f"... wrote {out / 'report.md'}" in captured.err  # steps on stderr, not in the report


def test_spark_rows_pair_persist_with_spark_parquet() -> None:
    """The Spark section puts persist's figures next to Spark Parquet's, with targets judged,
    and the API's own ceiling and floor beside them as unjudged scale rows."""
    from pyspark_persist.tools.bench import spark_freshness, spark_read, spark_write

    figures = [
        ("persist append", 40.0),
        ("persist overwrite", 45.0),
        ("parquet", 95.0),
        ("parquet append", 80.0),
        ("discard", 90.0),
    ]
    write = spark_write.Report(
        size_mib=256.0,
        partitions=2,
        master="local[2]",
        write=[spark_write.WriteFigures(w, 10, 1.0, 10.0, mib) for w, mib in figures],
    )
    rows = report.spark_write_rows(write)
    assert [(r.persist, r.peer_value, r.met) for r in rows] == [
        (40.0, 80.0, False),
        (90.0, 80.0, None),
    ]
    assert all(r.note.startswith("not persist") for r in rows if r.metric.startswith("(scale)"))
    fresh = spark_freshness.Report(
        seconds=40.0,
        steady_seconds=10.0,
        rows_per_second=50,
        pubsub="auto",
        pipelines=[
            spark_freshness.Pipeline("persist", 10, 180.0, 300.0, 400.0),
            spark_freshness.Pipeline("file", 10, 258.0, 361.0, 400.0),
            spark_freshness.Pipeline("floor", 0, 0.0, 0.0, 0.0),
        ],
        sink_floor_ms=154.0,
    )
    p50, p95, floor = report.spark_freshness_rows(fresh)
    # Lower is better: p50 180 <= 0.7 * 258 = 180.6 is met; p95 300 > 0.8 * 361 = 288.8 is not.
    assert (p50.persist, p50.peer_value, p50.met) == (180.0, 258.0, True)
    assert p50.target == "<= 0.7x file pipeline"
    assert (p95.persist, p95.peer_value, p95.met) == (300.0, 361.0, False)
    assert p50.advantage == 258.0 / 180.0
    assert (floor.persist, floor.peer_value, floor.met) == (154.0, 258.0, None)
    assert floor.note.startswith("not persist")
    timings = [
        ("persist default", 4, 170.0),
        ("persist 1/core", 2, 100.0),
        ("persist 2/core", 4, 180.0),
        ("persist sink-written default", 4, 140.0),
        ("spark parquet", 5, 150.0),
        ("python source, no I/O", 2, 200.0),
    ]
    read = spark_read.Report(
        spark_read.SparkReadOptions(),
        rows=10,
        arrow_mib=1.0,
        write_s=1.0,
        timings=[spark_read.Timing(n, parts, 1.0 / mib, mib) for n, parts, mib in timings],
    )
    default, sink, tuned, ceiling = report.spark_read_rows(read)
    assert (default.persist, default.peer_value, default.met) == (170.0, 150.0, True)
    assert (sink.persist, sink.peer_value, sink.met) == (140.0, 150.0, False)
    # 180 / 170 = 1.06: the default read within 1.1x of the better tuned split (2/core).
    assert (tuned.persist, tuned.peer_value, tuned.met) == (170.0, 180.0, True)
    assert tuned.peer == "persist, 2/core (4 tasks)"
    assert (ceiling.persist, ceiling.peer_value, ceiling.met) == (200.0, 150.0, None)


def test_spark_section_runs_each_benchmark_with_options_and_reads_its_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``persist bench all`` hands each Spark benchmark its options (``--quick``'s, and
    spark-write without its latency pipelines) and builds its rows from the result the
    benchmark returns: no argument lists, no stdout. One that raises is a note; the others
    still count."""
    pytest.importorskip("pyspark")
    from pyspark_persist.tools.bench import spark_read, spark_write

    seen: dict[str, object] = {}

    def fake_write(options: spark_write.SparkWriteOptions) -> spark_write.Report:
        seen["spark-write"] = options
        writers = ("persist append", "parquet append", "discard")
        return spark_write.Report(
            size_mib=options.size_mib,
            partitions=2,
            master=options.master,
            write=[spark_write.WriteFigures(w, 10, 1.0, 10.0, 50.0) for w in writers],
        )

    def fake_read(options: spark_read.SparkReadOptions) -> spark_read.Report:
        raise RuntimeError("no JVM here\nsecond line")

    fakes = {"spark-write": fake_write, "spark-read": fake_read}
    runs = tuple(
        dataclasses.replace(r, benchmark=dataclasses.replace(r.benchmark, run=fakes[name]))
        for r in report.SPARK_RUNS
        if (name := r.benchmark.name) in fakes
    )
    monkeypatch.setattr(report, "SPARK_RUNS", runs)
    opts = report.ReportOptions.make(quick=True)
    sec, raw = report.run_spark_section(opts, lambda _m: None)
    assert seen["spark-write"] == spark_write.SparkWriteOptions.make(True, skip_latency=True)
    assert sec.status == "ok" and list(raw) == ["spark-write"]
    assert raw["spark-write"]["write"][0]["writer"] == "persist append"
    assert [r.persist for r in sec.rows] == [50.0, 50.0]
    assert sec.notes == [
        "ran `persist bench spark-write --quick --skip-latency`",
        "spark-read failed: RuntimeError: no JVM here",
    ]


def test_a_whole_number_figure_from_a_benchmark_prints() -> None:
    """Spark reports micro-batch phases in whole ms, so a sum of their medians (the Python
    sink's floor) can be an int: its row prints like any other figure (the report used to
    stop there, after every benchmark had run, on ``int.is_integer``)."""
    sec = report.Section("spark", "Spark", rows=[report.Row("floor", 141, "ms", "file", 258)])
    table = _table("\n".join(report.section_markdown(sec)))
    assert [cells[1] for cells in table] == ["141 ms"]
    assert [cells[3] for cells in table] == ["258 ms"]
