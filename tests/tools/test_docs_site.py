"""The docs site builds with ``mkdocs build --strict``: a broken link or anchor, a page missing
from the nav or a nav entry without a page fails the test run (and so CI), not a reader."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    # Material's notice about its successor is advice, not a warning about the site.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", site],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    # The README is the home page, with its links into docs/ made the site's own.
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "pyspark-persist" in home and 'href="docs/' not in home
    assert (site / "bench-report" / "report" / "index.html").exists()
