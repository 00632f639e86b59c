"""Every public error class is in the taxonomy and named on the docs' Errors page."""

from __future__ import annotations

import inspect
from pathlib import Path

from pyspark_persist.state import errors

PAGE = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def public_errors() -> list[type[Exception]]:
    return [
        cls
        for name, cls in vars(errors).items()
        if inspect.isclass(cls) and issubclass(cls, Exception) and not name.startswith("_")
    ]


def test_every_error_is_a_persist_error_named_in_the_docs() -> None:
    page = PAGE.read_text(encoding="utf-8")
    for cls in public_errors():
        assert issubclass(cls, errors.PersistError), cls
        assert f"`{cls.__name__}`" in page, f"{cls.__name__} is not in docs/errors.md"


def test_the_taxonomy_says_what_happened() -> None:
    """Every error but data loss or damage says whether the operation could have happened."""
    kinds = (errors.Determinate, errors.Indeterminate, errors.InvalidUsage)
    neither = {errors.PersistError, errors.PartNotFound, errors.CorruptData}
    for cls in public_errors():
        if cls in neither or issubclass(cls, errors.CorruptData):
            continue
        assert issubclass(cls, kinds), cls
    assert issubclass(errors.DataLoss, errors.InvalidFrontier)
    assert not hasattr(errors, "FencedOut")  # never raised: a fenced critical reader gets a value
