"""Spark: the ``taproom`` source and ``taproom spark rollup`` over generated logjam requests.

A journal of N logjam request events (10 million in the full run) is written once: 1,000
different request documents (apps, actions, start times over an hour, codes, lines,
exceptions) encoded into one batch body with BatchBuilder and committed again and again, so
generating does not dominate. Then on local[2]: the data source alone (rows/s into Spark's
``noop`` sink), and the rollup job (all three tables, Parquet by date) cold (the first run in
a fresh session) and warm. Rates are events of the journal per second of wall time.
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
QUICK_EVENTS = 300_000
BATCH = 1000


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
    events = QUICK_EVENTS if quick else FULL_EVENTS
    label = f"{events / 1e6:g}M events"
    work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    figures: list[Figure] = []
    try:
        journal = work / "journal"
        started = time.monotonic()
        _journal(journal, events)
        print(f"  (journal of {label} written in {time.monotonic() - started:.1f}s)", flush=True)

        from taproom.spark.jobs.rollup import read_events, run_rollup
        from taproom.spark.jobs.session import get_session

        started = time.monotonic()
        spark = get_session("bench-spark")
        figures.append(
            Figure("spark session start (JVM, local[2])", time.monotonic() - started, "s")
        )

        def rollup(out: str) -> float:
            t0 = time.monotonic()
            run_rollup(spark, [str(journal)], out, progress=False)
            return events / (time.monotonic() - t0)

        figures.append(
            Figure(
                f"spark rollup, {label}, cold (first run)", rollup(str(work / "out1")), "events/s"
            )
        )
        figures.append(
            Figure(
                f"spark rollup, {label}, warm (3 tables, Parquet)",
                rollup(str(work / "out2")),
                "events/s",
                ">= 1000000",
            )
        )
        t0 = time.monotonic()
        read_events(spark, [str(journal)]).write.format("noop").mode("overwrite").save()
        figures.append(
            Figure(
                f"taproom data source alone, {label}, warm",
                events / (time.monotonic() - t0),
                "rows/s",
            )
        )
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures
