"""Dependency hygiene: the wheel a user installs builds, installs cleanly, and works on its own.

A new user runs ``pip install ".[spark]"`` and then the README's main job;
neither may print a warning (PySpark's Python workers warn that it does not
fully support pandas >= 3, so the extras keep pandas below 3). The wheel must
work without the source tree: every check runs from a directory holding only
a copy of ``examples/``, with the package imported from the new venv.
"""

from __future__ import annotations

import re
import zipfile

import pytest
from distribution import JVM_START_NOTICES, Built, FreshInstall, alarming

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def test_build_makes_an_sdist_and_a_complete_wheel(built: Built) -> None:
    """``python -m build`` succeeds and the wheel carries every layer and its data files."""
    names = set(zipfile.ZipFile(built.wheel).namelist())
    for module in (
        "pyspark_persist/__init__.py",
        "pyspark_persist/state/__init__.py",
        "pyspark_persist/pubsub/persist_pubsub_pb2.py",
        "pyspark_persist/pubsub/persist_pubsub.proto",
        "pyspark_persist/tools/cli.py",
        "pyspark_persist/py.typed",
    ):
        assert module in names, f"{module} missing from {built.wheel.name}"
    assert not any(n.startswith(("tests/", "examples/")) for n in names)
    assert built.sdist.name.startswith("pyspark_persist-")


def test_fresh_install_prints_no_warning_and_pip_check_is_clean(
    fresh_install: FreshInstall,
) -> None:
    """``pip install "<wheel>[spark]"`` in a new venv: no warning, and ``pip check`` passes."""
    install = fresh_install.steps["install"]
    assert install.returncode == 0, install.stdout[-4000:]
    assert alarming(install.stdout) == [], install.stdout[-4000:]
    assert re.search(r"^pandas==2\.", fresh_install.steps["freeze"].stdout, re.M)
    check = fresh_install.steps["check"]
    assert check.returncode == 0 and "No broken requirements found." in check.stdout, check.stdout


def test_installed_package_works_without_the_source_tree(fresh_install: FreshInstall) -> None:
    """Imports and the ``persist`` command come from the venv, and see what the main job wrote."""
    where = fresh_install.steps["import"]
    assert where.returncode == 0, where.stdout
    assert where.stdout.strip().startswith(str(fresh_install.venv / "lib")), where.stdout
    cli = fresh_install.steps["cli"]
    assert cli.returncode == 0, cli.stdout
    assert re.search(r"^rates\s+\d+", cli.stdout, re.M), cli.stdout


def test_main_example_prints_no_warning(fresh_install: FreshInstall) -> None:
    """The README's main job, right after the install: it works and prints no warning."""
    example = fresh_install.steps["example"]
    assert example.returncode == 0, example.stdout[-4000:]
    assert re.search(r"exactly once: True", example.stdout), example.stdout[-4000:]
    assert alarming(example.stdout, JVM_START_NOTICES) == [], example.stdout[-6000:]
