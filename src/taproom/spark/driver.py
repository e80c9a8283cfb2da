"""The file to give ``spark-submit``: ``spark-submit [options] <this file> rollup --hub ...``.

``spark-submit`` runs a Python application from a file, not a module (``-m``), and a file run
as a script cannot use relative imports; this one imports ``taproom`` absolutely, so it works
wherever taproom is installed in the driver's Python. Its arguments are those of
``taproom spark`` (``rollup``, ``stream``, ``kegs``, ``report``). Find the file with
``python -m taproom.spark.driver`` (prints its path).
"""

from __future__ import annotations

import sys


def main() -> int:
    from taproom.cli import main as taproom

    if len(sys.argv) == 1:  # `python -m taproom.spark.driver`: where spark-submit finds it
        print(__file__)
        return 0
    return taproom(["spark", *sys.argv[1:]])


if __name__ == "__main__":
    sys.exit(main())
