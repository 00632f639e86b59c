"""Fixtures of the operations tests: the project built as users get it, and a fresh install of it.

``built`` runs ``python -m build`` once per run: an sdist, then a wheel
built from that sdist, as a package index would serve them. ``fresh_install``
then does what the README tells a new user, in a new virtual environment and
outside the source tree: ``pip install "<wheel>[spark]"``, ``pip check``, and
the README's main example. Each step's output is kept for the tests to judge.
"""

from __future__ import annotations

import shutil
import sys

import early
import pytest
from distribution import ROOT, Built, FreshInstall, run


def _built(factory: pytest.TempPathFactory, env: dict[str, str]) -> Built:
    out = factory.mktemp("dist")
    result = run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], env, ROOT)
    assert result.returncode == 0, result.stdout[-4000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Built(sdist, wheel)


def _fresh_install(factory: pytest.TempPathFactory, env: dict[str, str]) -> FreshInstall:
    """The venv, the install and the checks: no Spark job (the fixture runs those)."""
    built: Built = early.result("built", factory)
    base = factory.mktemp("fresh")
    venv, home, workdir = base / "venv", base / "home", base / "work"
    workdir.mkdir()
    shutil.copytree(ROOT / "examples", workdir / "examples")
    made = run([sys.executable, "-m", "venv", str(venv)], env, base)
    assert made.returncode == 0, made.stdout
    install = FreshInstall(venv, home, workdir, {}, env)
    pip = venv / "bin" / "pip"
    install.steps["install"] = install.run(pip, "install", f"{built.wheel}[spark]")
    install.steps["check"] = install.run(pip, "check")
    install.steps["freeze"] = install.run(pip, "freeze")
    install.steps["import"] = install.run(
        venv / "bin" / "python",
        "-c",
        "import pyspark_persist, pyspark_persist.tools.cli; print(pyspark_persist.__file__)",
    )
    return install


# Started early, in the background, while the JVM-free tests run (``tests/early.py``).
early.register("built", _built)
early.register("fresh_install", _fresh_install, needs=("built",))


@pytest.fixture(scope="session")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build`` of the source tree: an sdist and a wheel built from it."""
    result: Built = early.result("built", tmp_path_factory)
    return result


@pytest.fixture(scope="session")
def fresh_install(built: Built, tmp_path_factory: pytest.TempPathFactory) -> FreshInstall:
    """A new venv, ``pip install "<wheel>[spark]"``, ``pip check``, then the README's main job.

    The main job (``spark-submit examples/rate_to_persist.py``) runs for 3
    seconds of streaming instead of its default 20: what it prints at start-up
    and per micro-batch is the same.
    """
    install: FreshInstall = early.result("fresh_install", tmp_path_factory)
    # Spark jobs run here, in the foreground: a starved background JVM could miss Spark's
    # deadline for its Python workers to connect back.
    install.steps["example"] = install.run(
        "spark-submit", "examples/rate_to_persist.py", "--seconds", "3", "--shard", "rates"
    )
    install.steps["cli"] = install.run(install.venv / "bin" / "persist", "shards", "list")
    return install
