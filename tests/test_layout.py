"""The promised layering: state <- pubsub <- connector <- tools, and no Spark below the connector.

Each layer may import only the layers to its left: ``state`` imports no other
part of pyspark_persist and never Spark; ``pubsub`` imports ``state`` only;
the connector (the package root, ``pyspark_persist``) never imports ``tools``.
Checked by importing every module of a layer in a fresh interpreter and
looking at what got loaded, and by reading every import in the source (deferred ones too).
And no module-level import cycles, read from the source; in state and pubsub none at all.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CHECK = """
import importlib, json, pkgutil, sys
root = sys.argv[1]
pkg = importlib.import_module(root)
skip = ("pyspark_persist.state", "pyspark_persist.pubsub", "pyspark_persist.tools")
todo = [root]
while todo:  # walk by hand: pkgutil.walk_packages imports every subpackage it descends into
    name = todo.pop()
    if name == "pyspark_persist.__main__":
        continue  # the console entry point: it runs the CLI in tools by design
    if root == "pyspark_persist" and name.startswith(skip):
        continue
    module = importlib.import_module(name)
    if hasattr(module, "__path__"):
        todo.extend(m.name for m in pkgutil.iter_modules(module.__path__, name + "."))
print(json.dumps(sorted(
    n for n in sys.modules
    if n == "pyspark" or n.startswith(("pyspark.", "pyspark_persist"))
)))
"""


def _loaded(root: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", CHECK, root],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return list(json.loads(out.stdout.strip().splitlines()[-1]))


def _layer(module: str) -> str:
    if module == "pyspark" or module.startswith("pyspark."):
        return "spark"
    for layer in ("state", "pubsub", "tools"):
        if module == f"pyspark_persist.{layer}" or module.startswith(f"pyspark_persist.{layer}."):
            return layer
    return "connector"


ALLOWED = {
    "pyspark_persist.state": {"state"},
    "pyspark_persist.pubsub": {"state", "pubsub"},
    "pyspark_persist": {"state", "pubsub", "connector", "spark"},
}


@pytest.mark.parametrize("root", sorted(ALLOWED))
def test_layer_imports_only_the_layers_below(root: str) -> None:
    """Importing every module of a layer loads nothing from a layer above it (nor Spark below
    the connector)."""
    loaded = _loaded(root)
    bad = sorted(m for m in loaded if _layer(m) not in ALLOWED[root] and m != "pyspark_persist")
    assert bad == [], f"{root} pulls in {bad}"


# The folders of the source tree and the import names they install as (setup.cfg's package_dir).
FOLDERS = {
    "state": "pyspark_persist.state",
    "pubsub": "pyspark_persist.pubsub",
    "tools": "pyspark_persist.tools",
    "connector": "pyspark_persist",
}


def _modules(top: Path) -> dict[str, Path]:
    """Every module of the tree by import name."""
    modules: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        for path in (top / folder).rglob("*.py"):
            parts = list(path.relative_to(top / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _load_time_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is loaded: module level, including under ``if``/``try``,
    but not ``if TYPE_CHECKING:`` blocks nor imports deferred into functions."""

    def walk(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
        for stmt in body:
            if isinstance(stmt, ast.Import | ast.ImportFrom):
                yield stmt
            elif isinstance(stmt, ast.If):
                test = stmt.test
                name = test.id if isinstance(test, ast.Name) else getattr(test, "attr", "")
                if name != "TYPE_CHECKING":
                    yield from walk(stmt.body)
                yield from walk(stmt.orelse)
            elif isinstance(stmt, ast.Try):
                yield from walk(stmt.body)
                for handler in stmt.handlers:
                    yield from walk(handler.body)
                yield from walk(stmt.orelse)
                yield from walk(stmt.finalbody)

    yield from walk(tree.body)


def _every_import(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import a module names, deferred into functions and under ``TYPE_CHECKING`` too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def import_graph(top: Path, *, load_time_only: bool = True) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports at load time (or, with ``load_time_only``
    false, anywhere: what a reader of the module has to know about).

    A module's own ancestor packages are not edges (Python loads them first whatever the module
    says), so ``from ..errors import X`` is an edge to ``state.errors`` alone."""
    modules = _modules(top)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    imports = _load_time_imports if load_time_only else _every_import
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: up (level - 1) packages from this module's package
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                pieces = target.split(".")
                for i in range(1, len(pieces) + 1):
                    imported = ".".join(pieces[:i])
                    if (
                        imported in modules
                        and imported != name
                        and not name.startswith(imported + ".")
                    ):
                        graph[name].add(imported)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles() -> None:
    """No two modules import each other, directly or round a longer loop, when they load: each
    module can be read after the ones it imports."""
    assert cycles(import_graph(Path(__file__).resolve().parents[1])) == []


def test_no_circular_references_in_state_or_pubsub() -> None:
    """In the shard core and PubSub no two modules refer to each other even through deferred or
    ``TYPE_CHECKING`` imports: each can be read knowing only the modules it imports."""
    graph = import_graph(Path(__file__).resolve().parents[1], load_time_only=False)
    core = ("pyspark_persist.state", "pyspark_persist.pubsub")
    assert [c for c in cycles(graph) if any(m.startswith(core) for m in c)] == []


def test_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    """The check above can fail: a planted loop through a relative and an absolute import is found,
    while a ``TYPE_CHECKING`` import and one deferred into a function are not edges."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "state" / "a.py").write_text("from .b import B\nA = 1\n")
    (tmp_path / "state" / "b.py").write_text("import pyspark_persist.state.c\nB = 1\n")
    (tmp_path / "state" / "c.py").write_text("from pyspark_persist.state import a\n")
    (tmp_path / "state" / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .e import E\n"
    )
    (tmp_path / "state" / "e.py").write_text("def f() -> None:\n    from .d import D\n")
    found = cycles(import_graph(tmp_path))
    assert found == [
        ["pyspark_persist.state.a", "pyspark_persist.state.b", "pyspark_persist.state.c"]
    ]
    # Counting every import, the TYPE_CHECKING/deferred loop of d and e is one too.
    assert cycles(import_graph(tmp_path, load_time_only=False)) == [
        *found,
        ["pyspark_persist.state.d", "pyspark_persist.state.e"],
    ]


LAYERS = ("state", "pubsub", "connector", "tools")
"""Bottom to top: a module may import its own layer and the layers before it, never after."""

ENTRY_POINTS = {"pyspark_persist.__main__"}
"""``python -m pyspark_persist`` runs the CLI in tools by design: the one arrow pointing up."""


def _layer_of(module: str) -> str | None:
    """The layer an imported name belongs to: one of LAYERS, ``spark``, or None (outside)."""
    if module == "pyspark" or module.startswith("pyspark."):
        return "spark"
    if module != "pyspark_persist" and not module.startswith("pyspark_persist."):
        return None
    return _layer(module)


def layer_violations(top: Path) -> list[str]:
    """Every import, wherever it sits (module level, in a function, under ``TYPE_CHECKING``),
    that points up the layers, or reaches Spark from state or pubsub: ``module -> name``."""
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    found = []
    for name, path in sorted(_modules(top).items()):
        if name in ENTRY_POINTS:
            continue
        own = _layer(name)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [base]
            else:
                continue
            for target in targets:
                layer = _layer_of(target)
                if layer is None:
                    continue
                spark_below = layer == "spark" and own in ("state", "pubsub")
                if spark_below or (layer in rank and rank[layer] > rank[own]):
                    found.append(f"{name} -> {target} (line {node.lineno})")
    return found


def test_every_import_points_down_the_layers() -> None:
    """state imports none of pubsub/connector/tools/pyspark; pubsub none of connector/tools/
    pyspark; the connector not tools: read from the source, deferred imports included."""
    assert layer_violations(Path(__file__).resolve().parents[1]) == []


def test_layer_check_sees_an_import_pointing_up(tmp_path: Path) -> None:
    """The check above can fail: planted upward imports (relative, absolute, deferred into a
    function, under TYPE_CHECKING, Spark in state) are each found; downward ones are not."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "state" / "a.py").write_text("from ..pubsub import server\n")
    (tmp_path / "state" / "b.py").write_text("def f() -> None:\n    import pyspark.sql\n")
    (tmp_path / "pubsub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pyspark_persist import x\n"
    )
    (tmp_path / "connector" / "d.py").write_text("import pyspark_persist.tools.cli\n")
    (tmp_path / "tools" / "e.py").write_text(
        "import pyspark.sql\nfrom pyspark_persist.state import a\nfrom pyspark_persist import d\n"
    )
    (tmp_path / "connector" / "f.py").write_text("import pyspark.sql\nfrom .state import a\n")
    assert layer_violations(tmp_path) == [
        "pyspark_persist.d -> pyspark_persist.tools.cli (line 1)",
        "pyspark_persist.pubsub.c -> pyspark_persist (line 3)",
        "pyspark_persist.state.a -> pyspark_persist.pubsub (line 1)",
        "pyspark_persist.state.b -> pyspark.sql (line 2)",
    ]
