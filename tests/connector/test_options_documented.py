"""Every option name ``format("persist")`` takes is documented, from the one table the parser reads.

``docs/spark-options.md`` is built from ``OPTIONS`` and ``PEER_NAMES`` (``docs/hooks.py``):
each setting carries its documentation, and the page built from them names every spelling.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from pyspark_persist.options import OPTIONS, PEER_NAMES, OptionDoc, OptionName

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "spark-options.md"
SPARKS = {"path", "paths", "checkpointLocation", "queryName"}
"""Names Spark passes itself: the paragraph under the table covers them."""


def hooks() -> ModuleType:
    """``docs/hooks.py``, the site's build hooks, which is no package of its own."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_setting_has_its_documentation() -> None:
    """persist's own name of each setting says where it applies, its default and what it does,
    with an example; an alias says whose name it is instead, and documents nothing itself."""
    settings = {o.setting for o in OPTIONS if o.spelling not in SPARKS}
    for option in OPTIONS:
        if option.spelling in SPARKS:
            continue
        if option.spelling.lower() == option.setting:
            assert option.doc is not None, f"{option.spelling}: no doc"
            assert option.doc.default and option.doc.meaning, option.spelling
            assert "e.g." in option.doc.meaning, f"{option.spelling}: no example"
        else:
            assert option.doc is None, f"{option.spelling}: document its setting instead"
            assert option.peers, f"{option.spelling}: an alias says whose name it is"
    for peer in PEER_NAMES:
        assert peer.setting is None or peer.setting in settings, peer.spelling


def test_the_page_lists_every_spelling() -> None:
    """The built page has a row for each setting naming every spelling of it, and lists
    every refused peer name, beside the option that does its job where there is one."""
    page = hooks().options_page(PAGE.read_text(encoding="utf-8"))
    start = page.index("| option (peer name) |")
    table = page[start : page.index("\n\n", start)].splitlines()[2:]
    first_cells = {row.split(" | ")[0] for row in table}
    for option in OPTIONS:
        if option.spelling in SPARKS:
            continue
        rows = [c for c in first_cells if f"`{option.spelling}`" in c]
        assert len(rows) == 1, f"docs/spark-options.md: {option.spelling} in {len(rows)} rows"
    for peer in PEER_NAMES:
        assert f"| `{peer.spelling}` | {peer.system} | {peer.hint} |" in page, peer.spelling
        if peer.setting is not None:
            assert any(f"`{peer.spelling}` →" in c for c in first_cells), peer.spelling


def test_a_new_option_is_one_entry_in_options(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding an option takes its entry in OPTIONS (and its test): the page's row follows."""
    module = hooks()
    knob = OptionName(
        "exampleKnob", "exampleknob", frozenset({"stream_read"}), doc=OptionDoc("1", "e.g. `2`")
    )
    alias = OptionName("exampleAlias", "exampleknob", frozenset({"stream_read"}), peers="Kafka")
    monkeypatch.setattr(module, "OPTIONS", (*OPTIONS, knob, alias))
    rows = module.options_table().splitlines()
    assert rows[-1] == "| `exampleKnob` (Kafka: `exampleAlias`) | stream read | 1 | e.g. `2` |"
    as_of = next(r for r in rows if r.startswith("| `asOf`"))
    assert as_of.startswith("| `asOf` (Delta: `timestampAsOf`, `versionAsOf` →) | batch read |")
