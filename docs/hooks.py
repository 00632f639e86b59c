"""MkDocs hooks: what the site takes from the project's own files, so that no copy can drift.

- The home page is the README. ``docs/index.md`` holds only a marker, replaced by the
  README's text, whose links into ``docs/`` become the site's own.
- The benchmark report and its history (``bench-report/report.md``, ``history.md``,
  ``report.png``) are written by ``persist bench all`` and kept beside the code, not
  under ``docs/``; they are added to the site under ``bench-report/``. A page links
  them as ``../bench-report/...`` (right when the page is read in the repository) and
  the site resolves that to its own copy.

Everything here reads local files only: a build needs no network.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

ROOT = Path(__file__).resolve().parents[1]
README_MARKER = "<!-- the README -->"
"""The line of ``docs/index.md`` that the README replaces."""
BENCH_REPORT = ("report.md", "history.md", "report.png")
"""The files of ``bench-report/`` that are pages (or images) of the site."""


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
    """Fill the home page with the README, and point links to ``bench-report/`` at the site's."""
    if page.file.src_uri == "index.md":
        if README_MARKER not in markdown:
            raise ValueError(f"docs/index.md lost its marker {README_MARKER!r}")
        markdown = markdown.replace(README_MARKER, readme_as_home())
    elif page.file.src_uri.startswith("bench-report/"):
        return markdown
    return markdown.replace("](../bench-report/", "](bench-report/")
