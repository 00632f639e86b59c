"""Every option name ``format("persist")`` takes, aliases included, is in the docs' table."""

from __future__ import annotations

from pathlib import Path

from pyspark_persist.options import OPTIONS

PAGE = Path(__file__).resolve().parents[2] / "docs" / "spark-options.md"
SPARKS = {"path", "paths", "checkpointLocation", "queryName"}
"""Names Spark passes itself: the paragraph under the table covers them."""


def test_every_option_and_alias_has_a_row_with_an_example() -> None:
    """The options table names each spelling in backticks, in a row with an example."""
    text = PAGE.read_text()
    start = text.index("| option (peer name) |")
    table = text[start : text.index("\n\n", start)].splitlines()[2:]
    for option in OPTIONS:
        if option.spelling in SPARKS:
            continue
        rows = [r for r in table if f"`{option.spelling}`" in r.split(" | ")[0]]
        assert rows, f"docs/spark-options.md has no row for {option.spelling}"
        assert any("e.g." in r for r in rows), f"{option.spelling}: no example"
