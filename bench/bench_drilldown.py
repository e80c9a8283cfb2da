"""``python -m bench drilldown``: the drill-down's rollup ratio alone (issue 30), quick to run.

The first part of ``python -m bench console``'s drill-down (bench/console_drilldown.py) on
fewer requests and without the Request page lookups: the same journal of logjam requests over
one day, a cold run, then four warm rounds, each a run without (requests, exceptions without
samples, logs) and one with the drill-down tables (exceptions with samples, request_samples,
request_ids); the goal's figure is the CPU of all warm runs. Warm runs reuse the sealed
segments' parts of the drill-down tables (the cold run wrote them, its CPU is printed).
1M requests (``--quick``: 300k; ``TAPROOM_BENCH_DRILLDOWN_EVENTS`` sets another number): a
few minutes on local[2], where the whole drill-down half of the console bench takes ~22.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

from . import console_drilldown
from .common import Figure

EVENTS = 1_000_000


def run(quick: bool) -> list[Figure]:
    default = console_drilldown.QUICK_EVENTS if quick else EVENTS
    events = int(os.environ.get("TAPROOM_BENCH_DRILLDOWN_EVENTS", default))
    workdir = Path(tempfile.mkdtemp(prefix="taproom-bench-drilldown-"))
    try:
        journal, out = workdir / "journal", workdir / "rollups"
        started = time.monotonic()
        console_drilldown.request_journal(journal, events, 16 << 20)
        figures = [Figure("writing the journal", time.monotonic() - started, "s")]
        # four warm rounds: two moved the ratio more than the changes measured (issue 30)
        return figures + console_drilldown.rollup_figures(journal, out, events, rounds=4)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
