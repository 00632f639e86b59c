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


KERNEL: dict[str, str] = {
    "state/errors.py": "the error taxonomy: exception classes and nothing else",
    "state/state.py": "the frozen ShardState and the values in it (parts, batches, holds)",
    "state/diff.py": "state diffs encoded, checked and applied: bytes and states in, states out",
    "state/commands.py": "every state transition: (state, arguments) -> diff or refusal; the "
    "caller passes the time",
    "state/retention.py": "the since retention allows, a command of the state and the caller's now",
    "state/consumers.py": "named consumers' transitions: (state, arguments) -> diff or refusal",
    "state/config.py": "the knobs: a validated frozen value",
    "state/times.py": "times parsed and checked against frontiers; it never reads the clock",
    "state/planning.py": "which parts answer a read (plan_read), split over tasks; LeasedPart",
    "state/changes.py": "which change ranges can be read, and what is left to read",
    "state/schema.py": "the row schema, the part layout, a write conformed, the schema evolved",
    "state/columns.py": "Arrow columns built and measured without pandas",
    "state/stats.py": "a part's time, diff and column ranges, gathered from its rows",
    "state/codec.py": "part bytes encoded and decoded; encoders write only to a sink handed in",
    "state/keys.py": "how a part key is spelled and read back; the caller passes the time",
    "state/updates.py": "a leased part's updates shaped to a read, and consolidated",
    "state/keyed.py": "key columns checked, one row per key chosen, an upsert's updates built",
    "state/txn.py": "a transaction across shards: every participant's diff at one time, or why "
    "not (already committed, a keyed share to plan again)",
    "state/maintenance_policy.py": "what to compact, what GC may delete, where to truncate: "
    "maintenance decided from state, run elsewhere",
}
"""The pure kernel of the shard: the modules that decide and never do I/O. Each is a function
of its arguments: no store, no clock, no threads, no environment, no randomness (the shell
modules around them read the clock, draw the nonces and talk to Blob and Consensus, and pass
the results in). The one list the kernel checks read: edit it here when a module is split,
renamed or joins."""

NOT_IN_KERNEL: dict[str, str] = {
    "pyspark_persist.state.blob": "Blob",
    "pyspark_persist.state.consensus": "Consensus",
    "threading": "threads",
    "concurrent": "thread pools",
    "asyncio": "an event loop",
    "time": "the clock",
    "os": "the environment and the file system",
    "pyarrow.fs": "file systems",
    "socket": "the network",
    "subprocess": "other processes",
    "logging": "output",
    "uuid": "randomness",
    "random": "randomness",
    "secrets": "randomness",
    "boto3": "S3",
    "sqlalchemy": "SQL",
    "psycopg": "PostgreSQL",
    "grpc": "the network",
}
"""What a kernel module may not import, anywhere in it (deferred and type-checking imports
too), and why: each does I/O, keeps time, or draws randomness."""

MAX_STATE_LINES = 600
"""No file under state/ is longer: one concern per module."""

LONG_FILES_ALLOWED = {"state/consensus/sql.py": "the SQL backend: SQLite and PostgreSQL in one"}


def kernel_violations(top: Path, kernel: dict[str, str]) -> list[str]:
    """Every import of a kernel module (wherever it sits) of something in NOT_IN_KERNEL, or of
    a module of the tree outside the kernel; and every listed module the tree lacks."""
    modules = _modules(top)
    by_path = {path.relative_to(top).as_posix(): name for name, path in modules.items()}
    names = {by_path[p] for p in kernel if p in by_path}
    found = [f"{p}: listed in the kernel but not in the tree" for p in kernel if p not in by_path]
    for rel in sorted(p for p in kernel if p in by_path):
        name = by_path[rel]
        path = modules[name]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _every_import(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package):
                why = next((w for m, w in NOT_IN_KERNEL.items() if _within(target, m)), None)
                if why is not None:
                    found.append(f"{rel}: imports {target} ({why}) on line {node.lineno}")
                elif (
                    target in modules
                    and target not in names
                    and target != name
                    and not name.startswith(target + ".")
                ):
                    found.append(
                        f"{rel}: imports {target}, not in the kernel, on line {node.lineno}"
                    )
    return sorted(set(found))


def _within(target: str, module: str) -> bool:
    """Whether ``target`` is ``module`` or inside it."""
    return target == module or target.startswith(module + ".")


def _targets(node: ast.Import | ast.ImportFrom, package: str) -> list[str]:
    """The dotted names an import statement loads (for ``from x import y``: ``x`` and
    ``x.y``, which may be a module), relative ones resolved against ``package``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [base] + [f"{base}.{alias.name}" for alias in node.names]


def test_the_kernel_does_no_io() -> None:
    """The pure modules (KERNEL) import nothing that does I/O, keeps time or draws randomness,
    and no module of the tree outside the kernel: what they decide depends on their arguments."""
    assert kernel_violations(Path(__file__).resolve().parents[1], KERNEL) == []


def test_kernel_check_sees_io(tmp_path: Path) -> None:
    """The check above can fail: a kernel module importing the clock at load time, Blob in a
    function, a shell module under TYPE_CHECKING, or a thread pool is found, as is a listed
    module the tree lacks; a kernel module importing another, or numpy, is not."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "state" / "blob").mkdir()
    (tmp_path / "state" / "blob" / "__init__.py").write_text("import os\n")
    (tmp_path / "state" / "shell.py").write_text("import time\n")
    (tmp_path / "state" / "a.py").write_text("import time\nfrom . import b\n")
    (tmp_path / "state" / "b.py").write_text(
        "import numpy\n\n\ndef f() -> None:\n    from .blob import Blob\n"
    )
    (tmp_path / "state" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .shell import S\n"
        "from concurrent.futures import Future\n"
    )
    kernel = {f"state/{m}.py": "planted" for m in ("a", "b", "c", "gone")}
    assert kernel_violations(tmp_path, kernel) == [
        "state/a.py: imports time (the clock) on line 1",
        "state/b.py: imports pyspark_persist.state.blob (Blob) on line 5",
        "state/b.py: imports pyspark_persist.state.blob.Blob (Blob) on line 5",
        "state/c.py: imports concurrent.futures (thread pools) on line 4",
        "state/c.py: imports concurrent.futures.Future (thread pools) on line 4",
        "state/c.py: imports pyspark_persist.state.shell, not in the kernel, on line 3",
        "state/gone.py: listed in the kernel but not in the tree",
    ]


def long_files(top: Path) -> list[str]:
    """Every file under state/ longer than MAX_STATE_LINES but those LONG_FILES_ALLOWED."""
    found = []
    for path in sorted((top / "state").rglob("*.py")):
        rel = path.relative_to(top).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > MAX_STATE_LINES and rel not in LONG_FILES_ALLOWED:
            found.append(f"{rel}: {lines} lines")
    return found


def test_no_file_under_state_is_over_600_lines() -> None:
    """Modules of one concern each stay short enough to read whole (the SQL backend aside)."""
    assert long_files(Path(__file__).resolve().parents[1]) == []


def test_long_file_check_sees_a_long_file(tmp_path: Path) -> None:
    """The check above can fail: a file of 601 lines under state/ is found, in a subpackage too;
    one of 600 lines is not, nor the SQL backend."""
    (tmp_path / "state" / "consensus").mkdir(parents=True)
    (tmp_path / "state" / "ok.py").write_text("x = 1\n" * MAX_STATE_LINES)
    (tmp_path / "state" / "consensus" / "sql.py").write_text("x = 1\n" * 900)
    (tmp_path / "state" / "consensus" / "long.py").write_text("x = 1\n" * 601)
    assert long_files(tmp_path) == ["state/consensus/long.py: 601 lines"]


def _public_names(top: Path) -> set[str]:
    """``pyspark_persist.state.__all__``, read from the source."""
    tree = ast.parse((top / "state" / "__init__.py").read_text())
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets
        ):
            return set(ast.literal_eval(stmt.value))
    return set()


def public_name_sources(top: Path) -> dict[str, str]:
    """Each name ``pyspark_persist.state`` re-exports -> the file it comes from (``state/x.py``,
    or a subpackage's ``__init__.py``), read from the package's imports (lazy ones too)."""
    sources = {}
    for node in _every_import(ast.parse((top / "state" / "__init__.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            path = top / "state" / node.module.replace(".", "/")
            rel = f"state/{node.module.replace('.', '/')}"
            rel = f"{rel}/__init__.py" if path.is_dir() else f"{rel}.py"
            sources.update({alias.name: rel for alias in node.names})
    return sources


PUBLIC_STATE_MODULES = {"pyspark_persist.state", "pyspark_persist.state.errors"}
"""The state modules the connector may import from: the package's public names, and the
documented home of every exception."""


def private_state_imports(top: Path) -> list[str]:
    """Every import in the connector (wherever it sits) of the state layer other than a public
    name of ``pyspark_persist.state`` or an exception of ``pyspark_persist.state.errors``."""
    public = _public_names(top)
    found = []
    for name, path in sorted(_modules(top).items()):
        if _layer(name) != "connector":
            continue
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _every_import(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                bad = [a.name for a in node.names if _layer(a.name) == "state"]
            else:
                base = _targets(node, package)[0]
                if _layer(base) != "state":
                    continue
                if base == "pyspark_persist.state":
                    bad = [f"{base}.{a.name}" for a in node.names if a.name not in public]
                else:
                    bad = [] if base in PUBLIC_STATE_MODULES else [base]
            found += [f"{name} -> {b} (line {node.lineno})" for b in bad]
    return sorted(found)


def test_the_connector_uses_only_public_names_of_state() -> None:
    """The Spark source and sink use the shard through ``pyspark_persist.state``'s public names
    (and its errors), so the core's modules can move without touching them."""
    assert private_state_imports(Path(__file__).resolve().parents[1]) == []


def test_public_name_check_sees_a_private_import(tmp_path: Path) -> None:
    """The check above can fail: an internal module imported from or by name, and a name the
    package does not export, are found; public names and errors are not."""
    for folder in FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "state" / "__init__.py").write_text('__all__ = ["Shard"]\n')
    (tmp_path / "connector" / "__init__.py").write_text("")
    (tmp_path / "connector" / "a.py").write_text(
        "from pyspark_persist.state import Shard\n"
        "from pyspark_persist.state.errors import ShardDropped\n"
        "from pyspark_persist.state import Machine\n"
        "def f() -> None:\n    from pyspark_persist.state.machine import Machine\n"
        "import pyspark_persist.state.read\n"
    )
    assert private_state_imports(tmp_path) == [
        "pyspark_persist.a -> pyspark_persist.state.Machine (line 3)",
        "pyspark_persist.a -> pyspark_persist.state.machine (line 5)",
        "pyspark_persist.a -> pyspark_persist.state.read (line 6)",
    ]
