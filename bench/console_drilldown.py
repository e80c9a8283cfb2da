"""``python -m bench console``, part two: the drill-down (issue 30).

1. Rollup throughput with the drill-down tables vs without: a journal of logjam requests over
   one day, each with its own version 1 UUID request id (as logjam_agent sends them) and its
   own start time; 1,000 request documents otherwise (actions, times, codes, lines,
   exceptions). On local[2], after a cold run has filled the parsed-segment cache, warm runs
   alternate: "without" is today's three tables (requests, exceptions without samples, logs),
   "with" all five (exceptions with samples, request_samples, request_ids). Events per second
   of wall time; the ratio compares the best runs (the JVM compiles the hot code over the
   first runs) and the means. The cold run writes the drill-down tables' parts of every
   sealed segment (spark/jobs/parts.py); warm runs reuse them and write only the journal's
   live part, so the cold run's CPU is printed too: that is where the sealed parts' cost went.
2. The Request page by request id over that day's index: a hub over the same journal and
   rollups answers ``/api/requests/find?id=`` (index lookup, then the record read from the
   journal and shaped), cold (the hub's first lookup: no file statistics in memory) and warm
   (further ids, each looked up once: p50 and max).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from tests.hubprocess import HubProcess

from taproom.config import known_sections
from taproom.servers import SERVICE_MODULES

from .common import Figure, percentile

DATE = "2026-01-02"
FULL_EVENTS = 10_000_000
QUICK_EVENTS = 300_000
WARM_ROUNDS = 2
LOOKUPS = 30
_UUID_EPOCH_100NS = 0x01B21DD213814000


def _v1(unix_ns: int, node: int, clock: int) -> str:
    ticks = unix_ns // 100 + _UUID_EPOCH_100NS
    return (
        f"{ticks & 0xFFFFFFFF:08x}{(ticks >> 32) & 0xFFFF:04x}{((ticks >> 48) & 0x0FFF) | 0x1000:04x}"
        f"{(clock & 0x3FFF) | 0x8000:04x}{node:012x}"
    )


def request_journal(path: Path, events: int, segment_bytes: int) -> list[str]:
    """``events`` logjam requests spread over DATE, in start order; returns every 997th id."""
    from taproom.journal import Journal
    from taproom.records import BatchBuilder

    rng = random.Random(5)
    day_ns = int(dt.datetime.fromisoformat(DATE).replace(tzinfo=dt.UTC).timestamp()) * 10**9
    actions = [f"Mod{m}::Things{a}Controller#show" for m in range(5) for a in range(8)] + [
        f"Things{a}Controller#index" for a in range(10)
    ]
    templates = []
    for i in range(1000):
        doc = {
            "action": rng.choice(actions),
            "total_time": round(rng.lognormvariate(4.5, 1.2), 2),
            "code": rng.choice((200, 200, 200, 304, 404, 500)),
            "db_time": 3.5,
            "view_time": 7.25,
            "host": f"web-{i % 7}",
            "lines": [[rng.randint(0, 3), f"{DATE}T00:00:00", "Completed"]],
        }
        if i % 20 == 0:
            doc["exceptions"] = ["Timeout::Error"]
        body = json.dumps(doc).encode()
        templates.append((b'{"request_id":"', b'","started_ms":', b"," + body[1:]))
    journal = Journal(path, fsync="off", segment_bytes=segment_bytes)
    step = 86_400 * 10**9 // events
    node = rng.getrandbits(48)
    ids = []
    try:
        builder = BatchBuilder(received_ns=day_ns)
        for i in range(events):
            head, middle, tail = templates[i % 1000]
            ns = day_ns + i * step
            request_id = _v1(ns, node, i)
            if i % 997 == 0:
                ids.append(request_id)
            app = ("shop", "api", "search")[i % 3]
            builder.add(
                "logjam",
                b"".join((head, request_id.encode(), middle, str(ns // 10**6).encode(), tail)),
                stream=f"{app}-production",
                topic=f"logs.{app}.production",
                content_type="json",
                received_ns=ns,
            )
            if (i + 1) % 1000 == 0:
                journal.commit([builder.build()])
        if events % 1000:
            journal.commit([builder.build()])
    finally:
        journal.close()
    return ids


def rollup_figures(
    journal: Path, out: Path, events: int, rounds: int = WARM_ROUNDS
) -> list[Figure]:
    """A cold run, then ``rounds`` warm rounds, each a run without and a run with the
    drill-down tables; the goal's figure is the CPU of all warm runs (best-of figures beside)."""
    from taproom.spark.jobs.rollup import TABLES, run_rollup
    from taproom.spark.jobs.session import get_session
    from taproom.spark.settings import SparkSettings

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = get_session("bench-console")
    jvm = spark.sparkContext._gateway.proc.pid  # the JVM (spark-submit execs into it)
    without = ("requests", "exceptions", "logs")
    runs = {
        "without": (without, SparkSettings(exception_samples=0)),
        "with": (TABLES, SparkSettings()),
    }
    try:
        cpu = _tree_cpu_seconds(jvm)
        started = time.monotonic()
        stats = run_rollup(spark, [str(journal)], str(out), progress=False, tables=TABLES)
        cold = events / (time.monotonic() - started)
        cold_cpu = _tree_cpu_seconds(jvm) - cpu
        cold_parts = sum(stats.parts_written.values())
        rates: dict[str, list[float]] = {"without": [], "with": []}
        per_cpu: dict[str, list[float]] = {"without": [], "with": []}
        warm_parts = 0
        for _ in range(rounds):
            for name, (tables, settings) in runs.items():
                shutil.rmtree(out / "exceptions", ignore_errors=True)  # its schema differs
                cpu = _tree_cpu_seconds(jvm)
                started = time.monotonic()
                warm = run_rollup(
                    spark, [str(journal)], str(out), progress=False, tables=tables,
                    settings=settings,
                )  # fmt: skip
                warm_parts = max(warm_parts, sum(warm.parts_written.values()))
                rates[name].append(events / (time.monotonic() - started))
                per_cpu[name].append(events / max(_tree_cpu_seconds(jvm) - cpu, 1e-9))
    finally:
        spark.stop()
    best = {k: max(v) for k, v in rates.items()}
    mean = {k: sum(v) / len(v) for k, v in rates.items()}
    cpu_best = {k: max(v) for k, v in per_cpu.items()}
    # events over all the CPU-seconds of a kind's warm runs (each run rolls up ``events``)
    cpu_all = {k: len(v) / sum(1 / x for x in v) for k, v in per_cpu.items()}
    label = f"{events / 1e6:g}M requests"
    return [
        Figure(f"rollup, {label}, cold, with the drill-down tables", cold, "events/s"),
        Figure("  cold run's CPU (JVM + workers)", cold_cpu, "cpu-s"),
        # A warm run writes the drill-down tables' live parts only (jobs/parts.py): what it
        # costs is the live segment's rows, the sealed segments' parts were written cold.
        Figure("  drill-down parts written cold (both tables)", cold_parts, "parts"),
        Figure("  note: warm runs reuse the sealed parts; parts written", warm_parts, "parts"),
        Figure(f"rollup, {label}, warm, without (3 tables), best", best["without"], "events/s"),
        Figure(f"rollup, {label}, warm, with (5 tables), best", best["with"], "events/s"),
        Figure(
            "  ratio with / without, best runs", best["with"] / best["without"], "ratio", ">= 0.8"
        ),
        Figure("  ratio with / without, means", mean["with"] / mean["without"], "ratio", ">= 0.8"),
        Figure(
            "rollup events per CPU-second (JVM + workers), without", cpu_best["without"], "ev/cpu-s"
        ),
        Figure("rollup events per CPU-second (JVM + workers), with", cpu_best["with"], "ev/cpu-s"),
        Figure(
            "  per-CPU-second ratio, best runs", cpu_best["with"] / cpu_best["without"], "ratio"
        ),
        Figure(
            f"  per-CPU-second ratio, all {rounds} warm rounds",
            cpu_all["with"] / cpu_all["without"],
            "ratio",
            ">= 0.8",
        ),
        Figure("  request_ids table size", _size_mib(out / "request_ids"), "MiB"),
        Figure("  request_samples table size", _size_mib(out / "request_samples"), "MiB"),
    ]


def _tree_cpu_seconds(pid: int) -> float:
    """CPU time of ``pid`` and its live descendants (the Python workers), each with what its
    reaped children used (Linux /proc)."""
    from tests.support import descendants

    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for proc in [pid, *descendants(pid)]:
        try:
            with open(f"/proc/{proc}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue
        # utime, stime, and cutime, cstime (children it reaped: a worker that exited)
        total += sum(int(v) for v in fields[11:15])
    return total / ticks


def _size_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / (1 << 20)


def _lookup_figures(workdir: Path, journal: Path, out: Path, ids: list[str]) -> list[Figure]:
    lines = [
        "[journal]", f'dir = "{journal}"', 'fsync = "off"',
        "[web]", "port = 0",
        "[console]", f'rollups = "{out}"',
    ]  # fmt: skip
    sections = known_sections()
    for name in SERVICE_MODULES:
        if name in sections:
            lines += [f"[{name}]", "enabled = false"]
    config = workdir / "lookup.toml"
    config.write_text("\n".join(lines) + "\n")
    hub = HubProcess(config).start(timeout=300)
    base = f"http://{hub.addresses['web']}"

    async def lookups() -> tuple[float, list[float], int]:
        async with aiohttp.ClientSession() as http:

            async def one(request_id: str) -> float:
                started = time.perf_counter()
                async with http.get(f"{base}/api/requests/find?id={request_id}") as r:
                    body = await r.json()
                    assert r.status == 200 and body["request_id"] == request_id, body
                return time.perf_counter() - started

            cold = await one(ids[0])
            picks = random.Random(9).sample(ids[1:], min(LOOKUPS, len(ids) - 1))
            warm = [await one(i) for i in picks]
            return cold, sorted(warm), len(picks)

    try:
        cold, warm, count = asyncio.run(lookups())
    finally:
        hub.stop()
    return [
        Figure("request page by id (find), cold: the hub's first lookup", cold * 1e3, "ms"),
        Figure(
            f"request page by id, warm: p50 of {count} other ids",
            percentile(warm, 50) * 1e3,
            "ms",
            "<= 100",
        ),
        Figure("request page by id, warm: slowest", warm[-1] * 1e3, "ms"),
    ]


def run(quick: bool) -> list[Figure]:
    events = QUICK_EVENTS if quick else FULL_EVENTS
    workdir = Path(tempfile.mkdtemp(prefix="taproom-bench-drilldown-"))
    try:
        journal, out = workdir / "journal", workdir / "rollups"
        started = time.monotonic()
        ids = request_journal(journal, events, (16 if quick else 128) << 20)
        figures = [Figure("writing the journal", time.monotonic() - started, "s")]
        figures += rollup_figures(journal, out, events)
        figures += _lookup_figures(workdir, journal, out, ids)
        return figures
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
