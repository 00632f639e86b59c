"""Benchmarks of persist itself (no Spark): see :mod:`pyspark_persist.tools.bench.core`."""

import sys


def step(msg: str) -> None:
    """One step of a long benchmark, as a line on stderr (stdout carries only its report,
    which ``--json`` keeps parseable)."""
    print(f"... {msg}", file=sys.stderr, flush=True)


def ratio_text(value: float, target: float) -> str:
    """``value`` as a ratio beside ``target``: two decimals, or three where two would round
    it onto the target and hide which side it is on (0.997 printed "1.00x NOT met")."""
    shown = f"{value:.2f}"
    if float(shown) == target and value != target:
        shown = f"{value:.3f}"
    return f"{shown}x"
