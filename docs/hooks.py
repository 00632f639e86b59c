"""MkDocs hooks: what the site takes from the project's own files, so that no copy can drift.

- The Spark options reference (``docs/spark-options.md``) is built from the connector's
  one table of options, ``OPTIONS`` in ``connector/options.py`` (each setting's names,
  where it applies, its default, what it does), and ``PEER_NAMES`` (other systems'
  names persist refuses, with the hint its error gives). Adding an option is one entry
  there: its row here follows.
- The home page is the README. ``docs/index.md`` holds only a marker, replaced by the
  README's text, whose links into ``docs/`` become the site's own.
- The benchmark report and its history (``bench-report/report.md``, ``history.md``,
  ``report.png``) are written by ``persist bench all`` and kept beside the code, not
  under ``docs/``; they are added to the site under ``bench-report/``. A page links
  them as ``../bench-report/...`` (right when the page is read in the repository) and
  the site resolves that to its own copy; their links into ``../docs/`` likewise.

Everything here reads local files only: a build needs no network.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pyspark_persist.options import OPTIONS, PEER_NAMES, OptionName

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
README_MARKER = "<!-- the README -->"
"""The line of ``docs/index.md`` that the README replaces."""
BENCH_REPORT = ("report.md", "history.md", "report.png")
"""The files of ``bench-report/`` that are pages (or images) of the site."""
OPTIONS_MARKER = "<!-- generated: options -->"
"""The line of ``docs/spark-options.md`` that the options table replaces."""
PEERS_MARKER = "<!-- generated: peer names -->"
"""The line of ``docs/spark-options.md`` that the table of refused peer names replaces."""
APPLIES = {
    frozenset({"read", "stream_read", "write", "stream_write"}): "all",
    frozenset({"read", "stream_read"}): "reads",
    frozenset({"read"}): "batch read",
    frozenset({"stream_read"}): "stream read",
    frozenset({"write", "stream_write"}): "writes",
    frozenset({"write"}): "batch write",
    frozenset({"stream_write"}): "stream write",
}
"""How the table names an option's operations (``OptionName.purposes``)."""


def _names(main: OptionName) -> str:
    """The first cell of a setting's row: persist's name, then each other system's names of
    it, grouped by system: "the same" (it shares persist's), its own (an alias persist takes),
    or one persist refuses with a hint naming this option (→)."""
    by_system: dict[str, list[str]] = {}
    if main.peers:
        by_system.setdefault(main.peers, []).append("the same")
    for alias in OPTIONS:
        if alias is main or alias.setting != main.setting or not alias.peers:
            continue
        name = f"`{alias.spelling}`"
        if alias.purposes != main.purposes:
            name += f" in a {APPLIES[alias.purposes]}"
        by_system.setdefault(alias.peers, []).append(name)
    for peer in PEER_NAMES:
        if peer.setting == main.setting:
            by_system.setdefault(peer.system, []).append(f"`{peer.spelling}` →")
    others = "; ".join(f"{system}: {', '.join(names)}" for system, names in by_system.items())
    return f"`{main.spelling}`" + (f" ({others})" if others else "")


def _row(cells: list[str]) -> str:
    """One row of a Markdown table; a ``|`` in a cell would end it early, so none may hold one."""
    for cell in cells:
        if "|" in cell:
            raise ValueError(f"a table cell holds '|', which Markdown reads as a column: {cell}")
    return "| " + " | ".join(cells) + " |"


def options_table() -> str:
    """The options reference: one row per setting, in ``OPTIONS``' order."""
    rows = [
        "| option (peer name) | applies to | default | meaning, example |",
        "|---|---|---|---|",
    ]
    for option in OPTIONS:
        doc = option.doc
        if doc is None:  # an alias, or a name Spark passes itself
            continue
        applies = doc.applies or APPLIES[option.purposes]
        rows.append(_row([_names(option), applies, doc.default, doc.meaning]))
    return "\n".join(rows)


def peer_names_table() -> str:
    """Every other system's option name persist refuses, and what its error says to do."""
    rows = ["| name | system | what persist's error says |", "|---|---|---|"]
    for peer in PEER_NAMES:
        rows.append(_row([f"`{peer.spelling}`", peer.system, peer.hint]))
    return "\n".join(rows)


def options_page(markdown: str) -> str:
    """``docs/spark-options.md`` with its two tables filled in."""
    for marker in (OPTIONS_MARKER, PEERS_MARKER):
        if marker not in markdown:
            raise ValueError(f"docs/spark-options.md lost its marker {marker!r}")
    return markdown.replace(OPTIONS_MARKER, options_table()).replace(
        PEERS_MARKER, peer_names_table()
    )


def readme_as_home() -> str:
    """The README as the site's home page: its links into ``docs/`` made relative to it."""
    return (ROOT / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the benchmark report and its history to the site."""
    from mkdocs.structure.files import File

    for name in BENCH_REPORT:
        path = ROOT / "bench-report" / name
        files.append(File.generated(config, f"bench-report/{name}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    """Fill in the generated pages, and point links to ``bench-report/`` at the site's."""
    if page.file.src_uri == "spark-options.md":
        markdown = options_page(markdown)
    elif page.file.src_uri == "index.md":
        if README_MARKER not in markdown:
            raise ValueError(f"docs/index.md lost its marker {README_MARKER!r}")
        markdown = markdown.replace(README_MARKER, readme_as_home())
    elif page.file.src_uri.startswith("bench-report/"):
        return markdown.replace("](../docs/", "](../")
    return markdown.replace("](../bench-report/", "](bench-report/")
