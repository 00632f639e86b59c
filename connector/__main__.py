"""``python -m pyspark_persist ...``: the ``persist`` command line, without the console script."""

from __future__ import annotations

import sys

from pyspark_persist.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
