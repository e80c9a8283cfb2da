"""``make bench``: run every benchmark (or the ones named) and print their figures.

Each ``bench/bench_<name>.py`` defines ``run(quick: bool) -> list[Figure]``. Figures are printed,
never asserted. ``python -m bench --quick lumberjack journal`` runs a short version of two.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import time
import traceback

from .common import print_figures


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench")
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    parser.add_argument(
        "--quick", action="store_true", help="short runs, for checking a bench works"
    )
    args = parser.parse_args()
    import bench

    available = sorted(
        m.name[len("bench_") :]
        for m in pkgutil.iter_modules(bench.__path__)
        if m.name.startswith("bench_")
    )
    names = args.names or available
    failed = 0
    for name in names:
        if name not in available:
            print(f"unknown benchmark {name!r}; available: {', '.join(available)}")
            return 2
        module = importlib.import_module(f"bench.bench_{name}")
        print(f"\n== {name} ==", flush=True)
        started = time.monotonic()
        try:
            figures = module.run(args.quick)
        except Exception:
            traceback.print_exc()
            failed += 1
            continue
        print_figures(figures)
        print(f"({name}: {time.monotonic() - started:.0f}s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
