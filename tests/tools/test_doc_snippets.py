"""Every snippet of the README and the docs runs as written, so they cannot drift from the code.

The fenced blocks of the README and of every page of ``docs/`` are extracted and run the
way a reader would paste them: ``bash``/``shell`` blocks with ``bash -euo pipefail``,
``console`` blocks one ``$ `` command at a time, ``python`` blocks with this interpreter.
The README is read on its own, as a newcomer reads it; the site's pages are read in the
order of its ``nav`` (``mkdocs.yml``), one after another in one working directory, so a
page may use what an earlier one made (the command line page reads the shard the Python
API page wrote). Each reading starts in a fresh working directory under a fresh ``HOME``
(so the embedded default is ``~/.pyspark-persist`` there). A ``python`` block that uses
``spark.`` runs in the run's shared SparkSession instead, with ``df`` a small DataFrame, as
the Spark pages assume; its one absolute path, a checkpoint under ``/tmp/ck``, moves into
the test's temporary directory (one per document), so that two runs on one machine never
share a checkpoint.

A block that cannot run here (it needs a cluster, S3 credentials, a Connect server, runs a
server until interrupted, or is the install command itself) says so just before it, where a
reader sees it in the source: ``<!-- not run: REASON -->``. Output and synopses are
``text`` blocks, never run. Anything else is a failure of this test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
RUNNABLE = {"python", "bash", "shell", "console"}
NOT_RUN = re.compile(r"^\s*<!--\s*not run\b:?(?P<reason>.*?)-->\s*$")
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)\s*$")
SNIPPET_TIMEOUT_S = 120
"""A snippet that takes longer has hung (the old Python API example's endless listen loop)."""


def nav_pages(nav: list[Any]) -> list[str]:
    """The pages of an ``mkdocs.yml`` nav, in reading order."""
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


SITE = [DOCS / page for page in nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])]
"""The site's pages in the order a reader meets them."""


@dataclass(frozen=True)
class Block:
    """One fenced code block of a document."""

    line: int
    """1-based line of its opening fence."""
    lang: str
    code: str
    not_run: str | None
    """The reason given by a ``<!-- not run: ... -->`` marker just before it (``""``: a marker
    without a reason), or ``None`` when it is unmarked."""
    path: str = ""
    """The document, relative to the repository."""

    @property
    def uses_spark(self) -> bool:
        """A Python snippet that needs the SparkSession ``spark``."""
        return self.lang == "python" and "spark." in self.code


def doc_blocks(text: str, path: str = "") -> list[Block]:
    """The fenced blocks of ``text`` (nested in a list item or not), with their markers."""
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent = len(opening["indent"])
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        code = "\n".join(line[indent:] for line in lines[i + 1 : end]) + "\n"
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = NOT_RUN.match(before)
        reason = None if marker is None else marker["reason"].strip()
        blocks.append(Block(i + 1, opening["lang"], code, reason, path))
        i = end + 1
    return blocks


def blocks_of(paths: list[Path]) -> list[Block]:
    """The blocks of ``paths``, in that order."""
    return [
        block
        for path in paths
        for block in doc_blocks(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
    ]


READINGS = {"README": [README], "docs": SITE}
"""Each reading: the documents it runs, in order, in one working directory and HOME."""
BLOCKS = blocks_of([README, *SITE])


def describe(block: Block) -> str:
    first = block.code.strip().splitlines()[0] if block.code.strip() else ""
    return f"{block.path}:{block.line} ({block.lang}: {first[:60]})"


def test_every_page_is_in_the_nav() -> None:
    """A page left out of ``nav`` would have its snippets left out of these tests."""
    assert sorted(p.name for p in SITE) == sorted(p.name for p in DOCS.glob("*.md"))


def test_every_block_is_run_or_says_why() -> None:
    problems = []
    for block in BLOCKS:
        if block.lang not in RUNNABLE | {"text"}:
            problems.append(f"{describe(block)}: tag it python, bash, console or text")
        elif block.lang == "text" and block.not_run is not None:
            problems.append(f"{describe(block)}: a text block is never run; drop the marker")
        elif block.not_run == "":
            problems.append(f"{describe(block)}: say why it is not run (<!-- not run: ... -->)")
    assert problems == []
    run = [b for b in BLOCKS if b.lang in RUNNABLE and b.not_run is None]
    # The examples a new user pastes first must be among those run.
    assert any("reader.listen(" in b.code for b in run)
    assert any(b.uses_spark for b in run)
    assert any(b.lang in {"bash", "console"} for b in run)


def test_parser_sees_markers_and_nested_blocks() -> None:
    text = (
        "intro\n\n<!-- not run: needs a cluster -->\n```bash\nspark-submit job.py\n```\n"
        "- item:\n\n  ```python\n  print(1)\n  ```\n<!-- not run -->\n```console\n$ x\n```\n"
    )
    assert doc_blocks(text, "x.md") == [
        Block(4, "bash", "spark-submit job.py\n", "needs a cluster", "x.md"),
        Block(9, "python", "print(1)\n", None, "x.md"),
        Block(13, "console", "$ x\n", "", "x.md"),
    ]


def console_commands(code: str) -> str:
    """The commands of a console block: its ``$ `` lines (the rest is their output)."""
    return "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ ")) + "\n"


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    if block.lang == "python":
        argv = [sys.executable, "-c", block.code]
    else:
        code = console_commands(block.code) if block.lang == "console" else block.code
        argv = ["bash", "-euo", "pipefail", "-c", code]
    return subprocess.run(
        argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S
    )


@pytest.mark.parametrize("reading", sorted(READINGS))
def test_snippets_run_as_written(reading: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIST_")}
    # `persist` is the console script installed beside this interpreter.
    bindir = str(Path(sys.executable).parent)
    env.update(HOME=str(home), PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}")
    blocks = blocks_of(READINGS[reading])
    outputs: dict[Block, str] = {}
    for block in blocks:
        if block.lang not in RUNNABLE or block.not_run is not None or block.uses_spark:
            continue
        done = run_block(block, work, env)
        assert done.returncode == 0, f"{describe(block)} failed:\n{done.stdout}\n{done.stderr}"
        outputs[block] = done.stdout
    # The Python examples print what their comments say.
    for block, output in outputs.items():
        if block.lang == "python" and "reader.listen(" in block.code:
            check_python_example(block, output.splitlines())


def check_python_example(block: Block, printed: list[str]) -> None:
    """The README's Python example and the Python API page's print what their comments say."""
    if block.path == "README.md":
        assert printed[0].startswith("[{'id': 1, 'name': 'a', '_time': "), printed
        assert printed[0].endswith("'_diff': 1}]") and printed[0].count("'_diff': 1") == 2
        assert printed[1].startswith("[{'id': 3, 'name': 'c', '_time': "), printed
        return
    assert block.path == "docs/python-api.md", describe(block)
    assert printed[0].startswith("[{'id': 2, 'name': 'b', '_time': "), printed
    assert printed[0].endswith("'_diff': 1}]")
    assert printed[1] == "3"
    assert printed[2].startswith("[{'id': 3, 'name': 'c', '_time': ")


@pytest.mark.spark
def test_spark_snippets_run_as_written(spark: SparkSession, tmp_path: Path) -> None:
    for block in BLOCKS:
        if not block.uses_spark or block.not_run is not None:
            continue
        before = {q.id for q in spark.streams.active}
        confs = dict(spark.conf.getAll)
        df = spark.createDataFrame([(1, "a"), (2, "b")], "id long, name string")
        try:
            ck = tmp_path / Path(block.path).stem / "ck"
            code = block.code.replace('"/tmp/ck/', f'"{ck}/')
            exec(compile(code, describe(block), "exec"), {"spark": spark, "df": df})
            # Every stream it starts is running (one that failed at once is no longer active).
            # Waiting for their progress too is left to tests/connector: two Python streaming
            # queries at once on 2 busy cores have timed out Spark's Python worker connect-back
            # here (load average 20), failing a check of the docs for a reason not in them.
            started = [q for q in spark.streams.active if q.id not in before]
            assert len(started) == block.code.count(".start("), describe(block)
        finally:
            for query in spark.streams.active:
                if query.id not in before:
                    query.stop()
            # A snippet's session confs (the bulk-write tuning) stay out of later tests.
            for key, value in dict(spark.conf.getAll).items():
                if key not in confs:
                    spark.conf.unset(key)
                elif value != confs[key]:
                    spark.conf.set(key, confs[key])
