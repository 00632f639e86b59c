"""The promised layering: state <- pubsub <- connector <- tools, and no Spark below the connector.

Each layer may import only the layers to its left: ``state`` imports no other
part of pyspark_persist and never Spark; ``pubsub`` imports ``state`` only;
the connector (the package root, ``pyspark_persist``) never imports ``tools``.
Checked by importing every module of a layer in a fresh interpreter and
looking at what got loaded.
"""

from __future__ import annotations

import json
import subprocess
import sys

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
