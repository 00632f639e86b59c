"""Fixtures of the operations tests: the project built as users get it, and a fresh install of it.

``built`` runs ``python -m build`` once per run: an sdist, then a wheel
built from that sdist, as a package index would serve them. ``fresh_install``
then does what the README tells a new user, in a new virtual environment and
outside the source tree: ``pip install "<wheel>[spark]"``, ``pip check``, and
the README's main example. Each step's output is kept for the tests to judge.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from distribution import ROOT, Built, FreshInstall, run


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build`` of the source tree: an sdist and a wheel built from it."""
    out = tmp_path_factory.mktemp("dist")
    result = run(
        [sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], dict(os.environ), ROOT
    )
    assert result.returncode == 0, result.stdout[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Built(sdist, wheel)


@pytest.fixture(scope="session")
def fresh_install(built: Built, tmp_path_factory: pytest.TempPathFactory) -> FreshInstall:
    """A new venv, ``pip install "<wheel>[spark]"``, ``pip check``, then the README's main job.

    The main job (``spark-submit examples/rate_to_persist.py``) runs for 3
    seconds of streaming instead of its default 20: what it prints at start-up
    and per micro-batch is the same.
    """
    base = tmp_path_factory.mktemp("fresh")
    venv, home, workdir = base / "venv", base / "home", base / "work"
    workdir.mkdir()
    shutil.copytree(ROOT / "examples", workdir / "examples")
    made = run([sys.executable, "-m", "venv", str(venv)], dict(os.environ), base)
    assert made.returncode == 0, made.stdout
    install = FreshInstall(venv, home, workdir, {})
    pip = venv / "bin" / "pip"
    install.steps["install"] = install.run(pip, "install", f"{built.wheel}[spark]")
    install.steps["check"] = install.run(pip, "check")
    install.steps["freeze"] = install.run(pip, "freeze")
    install.steps["import"] = install.run(
        venv / "bin" / "python",
        "-c",
        "import pyspark_persist, pyspark_persist.tools.cli; print(pyspark_persist.__file__)",
    )
    install.steps["example"] = install.run(
        "spark-submit", "examples/rate_to_persist.py", "--seconds", "3", "--shard", "rates"
    )
    install.steps["cli"] = install.run(venv / "bin" / "persist", "shards", "list")
    return install
