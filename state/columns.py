"""Arrow columns built and measured cheaply, never through pandas.

``pa.scalar``, ``pa.array(ndarray)``, ``Array.to_numpy`` and
``DataType.to_pandas_dtype`` each import pandas: ~0.2 s, holding the GIL, in
every fresh Spark worker, which needs it for nothing else. The helpers here
go through numpy views of Arrow buffers instead. Pure functions.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


@functools.lru_cache(maxsize=16)
def constant_column(value: int, rows: int, typ: pa.DataType) -> pa.Array:
    """``rows`` copies of the integer ``value`` as a ``typ`` array (shared: Arrow arrays are
    immutable, and a read or write asks for a handful of lengths, so each is built a few
    times rather than once per batch). Built with numpy: ``pa.repeat`` of a scalar took
    0.5 ms per 65,536 rows, twenty times ``np.full``."""
    # No pa.scalar, pa.array(ndarray) or DataType.to_pandas_dtype() here: each imports
    # pandas, ~0.2 s in every fresh Spark worker, which needs it for nothing else.
    unsigned = pa.types.is_unsigned_integer(typ)
    lo, hi = (
        (0, 2**typ.bit_width - 1)
        if unsigned
        else (-(2 ** (typ.bit_width - 1)), 2 ** (typ.bit_width - 1) - 1)
    )
    if not lo <= value <= hi:
        raise OverflowError(f"{value} does not fit {typ}")
    kind = "u" if unsigned else "i"
    values = np.full(rows, value, dtype=np.dtype(f"{kind}{typ.bit_width // 8}"))
    return pa.Array.from_buffers(typ, rows, [None, pa.py_buffer(values)])


def int_scalar(value: int, typ: pa.DataType) -> pa.Scalar:
    """The integer ``value`` as a ``typ`` scalar for compute kernels, without pandas (which
    ``pa.scalar`` and a plain Python operand import: ~0.2 s, holding the GIL, in a process
    that needs it for nothing else; a profile of the Spark sink's committer had that import
    in its first compaction at a third of the pipeline's Python CPU)."""
    return constant_column(value, 1, typ)[0]


SMALL_ROWS = 64
"""Up to this many rows, plain Python beats a compute kernel's fixed cost (tiny writes)."""


def bounds(col: pa.ChunkedArray | pa.Array, rows: int) -> tuple[int, int]:
    """The smallest and largest value of a null-free integer column of ``rows`` (> 0) rows."""
    if rows <= SMALL_ROWS:
        values = col.to_pylist()
        return min(values), max(values)
    numbers = numeric_view(col)
    if numbers is not None:
        return int(numbers.min()), int(numbers.max())
    mm = pc.min_max(col)
    return int(mm["min"].as_py()), int(mm["max"].as_py())


def numeric_view(col: pa.ChunkedArray | pa.Array) -> np.ndarray[Any, Any] | None:
    """A numpy view of a null-free, one-chunk integer or float column's values; else None.

    numpy's min and max over the view run in a tenth of the time ``pc.min_max`` takes
    for the same 65,536 values (its kernel call and result struct dominate). No
    ``Array.to_numpy``: it imports pandas (see :func:`constant_column`).
    """
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    if len(chunks) != 1 or chunks[0].null_count:
        return None
    arr = chunks[0]
    typ = arr.type
    if pa.types.is_floating(typ):
        kind = "f"
    elif pa.types.is_signed_integer(typ):
        kind = "i"
    elif pa.types.is_unsigned_integer(typ):
        kind = "u"
    else:
        return None
    width = typ.bit_width // 8
    return np.frombuffer(
        arr.buffers()[1], f"<{kind}{width}", count=len(arr), offset=arr.offset * width
    )
