"""Spark: ``taproom spark rollup`` and the ``taproom`` source over generated logjam requests.

A journal of logjam request events is written: 1,000 different request documents (apps,
actions, start times over an hour, codes, lines, exceptions) encoded into one batch body with
BatchBuilder and committed again and again, so generating does not dominate. Segments are the
hub's default 128 MiB. On local[2], over the same 10M events (300k and 16 MiB segments with
--quick), in one session:

* cold: the first rollup run (all three tables, Parquet by date) with an empty parsed-segment
  cache: every payload is parsed, sealed segments are written to the cache;
* warm: the same run again (four times; the first and the best are printed, since the JVM
  compiles the hot code over the first runs): sealed segments come from the cache, the last
  one is parsed live;
* the data source alone (rows/s into Spark's ``noop`` sink, every column the rollup reads).

Rates are journal events per second of wall time. Note that 1,000 distinct documents repeat,
so the cache's Parquet compresses better than real traffic would (sizes are printed).
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
QUICK_SEGMENT_BYTES = 16 << 20
BATCH = 1000
# The JVM compiles the scan and aggregation code over the first runs: the steady state is
# the best of these.
WARM_RUNS = 4


def _journal(path: Path, events: int, segment_bytes: int = 128 << 20) -> None:
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
    journal = Journal(path, fsync="off", segment_bytes=segment_bytes)
    try:
        for _ in range(events // BATCH):
            journal.commit([batch])
    finally:
        journal.close()


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / (1 << 20)


def run(quick: bool) -> list[Figure]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    events = QUICK_EVENTS if quick else FULL_EVENTS
    work = Path(tempfile.mkdtemp(prefix="bench-spark-"))
    figures: list[Figure] = []
    label = f"{events / 1e6:g}M events"
    try:
        from taproom.spark.jobs.rollup import ROLLUP_COLUMNS, read_events, run_rollup
        from taproom.spark.jobs.session import get_session

        journal = work / "journal"
        _journal(journal, events, QUICK_SEGMENT_BYTES if quick else 128 << 20)
        started = time.monotonic()
        spark = get_session("bench-spark")
        figures.append(
            Figure("spark session start (JVM, local[2])", time.monotonic() - started, "s")
        )
        out = work / "out"
        rates = []
        runs = []
        for _ in range(1 + WARM_RUNS):
            t0 = time.monotonic()
            runs.append(run_rollup(spark, [str(journal)], str(out), progress=False))
            rates.append(events / (time.monotonic() - t0))
        stats = runs[0]
        detail = f"{stats.built} sealed segments parsed into the cache, {stats.live} live"
        figures.append(Figure(f"spark rollup, {label}, cold: {detail}", rates[0], "events/s"))
        stats = runs[1]
        detail = f"{stats.cached} segments from the cache, {stats.live} live"
        figures.append(
            Figure(f"spark rollup, {label}, warm, first run: {detail}", rates[1], "events/s")
        )
        figures.append(
            Figure(
                f"spark rollup, {label}, warm, best of {WARM_RUNS} (JIT warm)",
                max(rates[1:]),
                "events/s",
                ">= 1000000",
            )
        )
        figures.append(Figure("  journal size", _size_mib(journal), "MiB"))
        figures.append(Figure("  parsed-segment cache size", _size_mib(out / "_cache"), "MiB"))
        t0 = time.monotonic()
        read_events(spark, [str(journal)], columns=ROLLUP_COLUMNS).write.format("noop").mode(
            "overwrite"
        ).save()
        figures.append(
            Figure(
                f"taproom data source alone, {label} (rollup columns)",
                events / (time.monotonic() - t0),
                "rows/s",
            )
        )
        spark.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return figures
