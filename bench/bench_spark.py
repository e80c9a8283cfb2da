"""Spark: the ``taproom`` source and ``taproom spark rollup`` over generated logjam requests.

A journal of logjam request events is written: 1,000 different request documents (apps,
actions, start times over an hour, codes, lines, exceptions) encoded into one batch body with
BatchBuilder and committed again and again, so generating does not dominate. On local[2]: the rollup job (all three tables, Parquet by date)
cold (the first run in a fresh session, 1M events) and warm (10M events, or fewer when the
warm rate says 10M would not fit the bench's time budget: the figure's name says how many),
then the data source alone (rows/s into Spark's ``noop`` sink). Rates are journal events per
second of wall time.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.common import Figure

FULL_EVENTS = 10_000_000
WARMUP_EVENTS = 1_000_000  # cold and first warm run; sizes the main run
QUICK_EVENTS = 300_000
WARM_BUDGET_S = 60.0
BATCH = 1000
BATCH_MILLION = 1_000_000


def _journal(path: Path, events: int) -> None:
    from taproom.journal import Journal
    from taproom.records import BatchBuilder

    rng = random.Random(1)
    base = dt.datetime(2026, 11, 22, 8, 0, tzinfo=dt.UTC)
    actions = [f"Mod{m}::Things{a}Controller#show" for m in range(5) for a in range(8)] + [
        f"Things{a}Controller#index" for a in range(10)
    ]
    builder = BatchBuilder(received_ns=int(base.timestamp() * 1e9))
    for i in range(BATCH):
        started = base + dt.timedelta(seconds=rng.uniform(0, 3600))
        doc = {
            "action": rng.choice(actions),
            "started_at": started.isoformat(timespec="milliseconds"),
            "total_time": round(rng.lognormvariate(4.5, 1.2), 2),
            "code": rng.choice((200, 200, 200, 304, 404, 500)),
            "lines": [[rng.randint(0, 3), started.isoformat(), "Completed"]],
            "request_id": f"{rng.getrandbits(64):016x}",
        }
        if i % 20 == 0:
            doc["exceptions"] = ["Timeout::Error"]
        app = ("shop", "api", "search")[i % 3]
        builder.add(
            "logjam",
            json.dumps(doc).encode(),
            stream=f"{app}-production",
            topic=f"logs.{app}.production",
            producer="10.1.2.3:9605",
            seq=i,
            content_type="json",
        )
    batch = builder.build()
    journal = Journal(path, fsync="off")
    try:
        for _ in range(events // BATCH):
            journal.commit([batch])
    finally:
        journal.close()


def run(quick: bool) -> list[Figure]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    first = QUICK_EVENTS if quick else WARMUP_EVENTS
    work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    figures: list[Figure] = []
    try:
        from taproom.spark.jobs.rollup import read_events, run_rollup
        from taproom.spark.jobs.session import get_session

        small = work / "journal-small"
        _journal(small, first)
        started = time.monotonic()
        spark = get_session("bench-spark")
        figures.append(
            Figure("spark session start (JVM, local[2])", time.monotonic() - started, "s")
        )

        def rollup(journal: Path, events: int, out: str) -> float:
            t0 = time.monotonic()
            run_rollup(spark, [str(journal)], out, progress=False)
            return events / (time.monotonic() - t0)

        def label(events: int) -> str:
            return f"{events / 1e6:g}M events"

        cold = rollup(small, first, str(work / "out-cold"))
        figures.append(Figure(f"spark rollup, {label(first)}, cold (first run)", cold, "events/s"))
        warm = rollup(small, first, str(work / "out-warm"))
        journal, events = small, first
        if not quick:
            # The full bench must stay within about 4 minutes: take 10M events only if the
            # warm rate says the run fits in WARM_BUDGET_S, else fewer (named in the figure).
            fit = int(warm * WARM_BUDGET_S) // BATCH_MILLION * BATCH_MILLION
            events = max(first, min(FULL_EVENTS, fit))
            if events > first:
                journal = work / "journal-big"
                _journal(journal, events)
                warm = rollup(journal, events, str(work / "out-big"))
        figures.append(
            Figure(
                f"spark rollup, {label(events)}, warm (3 tables, Parquet)",
                warm,
                "events/s",
                ">= 1000000",
            )
        )
        t0 = time.monotonic()
        read_events(spark, [str(journal)]).write.format("noop").mode("overwrite").save()
        figures.append(
            Figure(
                f"taproom data source alone, {label(events)}, warm",
                events / (time.monotonic() - t0),
                "rows/s",
            )
        )
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures
