"""The project as users get it: built distributions, a fresh install, and a user's environment.

pip runs with ``PIP_CONFIG_FILE`` set to the null device, as on a machine
without a pip configuration: this machine's own configuration names index
locations that pip warns about for every package, which says nothing about
this project.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEP_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Built:
    """The distributions ``python -m build`` made."""

    sdist: Path
    wheel: Path


@dataclass(frozen=True)
class FreshInstall:
    """A new virtual environment with ``<wheel>[spark]`` installed, and each step's output."""

    venv: Path
    home: Path
    """``PERSIST_HOME`` of everything run in it."""
    workdir: Path
    """A directory outside the source tree holding a copy of ``examples/``."""
    steps: dict[str, subprocess.CompletedProcess[str]]
    base_env: Mapping[str, str] = field(default_factory=lambda: os.environ)
    """The environment the user's is made from: the test run's, as it was at the install."""

    def env(self) -> dict[str, str]:
        """A user's environment: this venv first on PATH, nothing of the test run's Spark."""
        return user_env(self.venv, self.home, self.base_env)

    def run(
        self, *argv: str | Path, timeout: float = STEP_TIMEOUT_S
    ) -> subprocess.CompletedProcess[str]:
        """Run a command as that user, in the work directory; output merged, never raises."""
        return run([str(a) for a in argv], self.env(), self.workdir, timeout)


def user_env(venv: Path, home: Path, base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A user who installed into ``venv``: none of this run's PYTHONPATH, Spark or AWS settings."""
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "SPARK_HOME", "PERSIST_HOME")
    env = {
        k: v
        for k, v in dict(base).items()
        if k not in dropped and not k.startswith(("PYSPARK_", "AWS_"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PERSIST_HOME"] = str(home)
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run(
    argv: list[str], env: dict[str, str], cwd: Path, timeout: float = STEP_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with stdout and stderr merged (the order a user sees them)."""
    return subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        check=False,
    )


WARNING = re.compile(r"warn|error|deprecat|traceback", re.IGNORECASE)
"""What a user would read as something gone wrong."""

JVM_START_NOTICES = (
    # The JVM's note that Spark enables its vector module (every Spark 4 start on Java 17).
    "WARNING: Using incubator modules: jdk.incubator.vector",
    # This machine's hostname resolves to 127.0.0.1, so Spark picks another interface.
    "WARN Utils: Your hostname, ",
    "WARN Utils: Set SPARK_LOCAL_IP if you need to bind to another address",
    # Hadoop's optional native code is not shipped in the pyspark package.
    "WARN NativeCodeLoader: Unable to load native-hadoop library",
)
"""Spark's JVM prints these before any application code runs, whatever the application."""


def alarming(output: str, allowed: tuple[str, ...] = ()) -> list[str]:
    """The lines of ``output`` that look like a warning or an error, except ``allowed`` ones."""
    return [
        line
        for line in output.splitlines()
        if WARNING.search(line) and not any(a in line for a in allowed)
    ]
