"""The fleet: Spark reading hubs over the network, and what that costs a hub's ingest.

Three journals of logjam requests (the generator of ``bench_spark``: 1,000 documents committed
again and again), 10M events in all (300k with --quick), each served by its own
``taproom serve`` process. In one local[2] Spark session:

* the ``taproom`` source into Spark's ``noop`` sink (the rollup's columns), reading the three
  journals from their directories and from their hubs over HTTP; each twice, alternating, and
  the better of the two is kept (the JVM compiles the decode path over the first run). Goal:
  the network read keeps at least 0.8 of the local rate;
* a hub's ingest rate (logjam PUSH agent, 300 B requests, fsync=always) idle, and while a
  Spark job reads that hub over the network at full speed, over and over. Goal: at least 0.9.

On a 2-core machine everything here shares the cores: the hubs, Spark's JVM and its two Python
workers, the agent, and whatever else runs. The network read therefore also pays for the hub
processes' CPU (reading, CRC-checking and sending frames), which the local read does not; and
ingest during a full-speed read competes with it for the same two cores. So the bench prints,
beside wall-clock rates, what survives sharing: the hub's CPU-seconds per ingested message
idle and busy, and the cores the whole machine was busy.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.hubprocess import HubProcess

from bench.bench_logjam import _committed, _config_text, _push_agent, _Usage
from bench.bench_spark import QUICK_EVENTS, QUICK_SEGMENT_BYTES, _journal
from bench.common import Figure

FULL_EVENTS = 10_000_000
HUBS = 3
INGEST_MESSAGES = 200_000
QUICK_INGEST_MESSAGES = 30_000
_CTX = mp.get_context("spawn")


def _serve(work: Path, journal: Path) -> HubProcess:
    """``taproom serve`` over an existing journal, logjam PULL on for the ingest figure."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "taproom.toml"
    config.write_text(_config_text(str(journal)))
    return HubProcess(config).start(timeout=120)


def _read_rate(spark: Any, events: int, **options: str) -> float:
    from taproom.spark.jobs.rollup import ROLLUP_COLUMNS

    started = time.monotonic()
    (
        spark.read.format("taproom")
        .options(**options)
        .option("columns", ROLLUP_COLUMNS)
        .load()
        .write.format("noop")
        .mode("overwrite")
        .save()
    )
    return events / (time.monotonic() - started)


def _ingest(hub: HubProcess, n: int) -> tuple[float, float, float]:
    """(messages/s wall, hub CPU-seconds per 1k messages, cores busy on the machine)."""
    started = _CTX.Value("d", 0.0)
    base = _committed(hub)
    usage = _Usage(hub.pid)
    agent = _CTX.Process(
        target=_push_agent, args=("tcp://" + hub.addresses["logjam_pull"], n, started)
    )
    agent.start()
    while _committed(hub) < base + n:
        time.sleep(0.2)
    done = time.time()
    cpu, _hub_cores, machine = usage.stop()
    agent.join()
    return n / (done - started.value), cpu / n * 1000, machine


def run(quick: bool) -> list[Figure]:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    events = QUICK_EVENTS if quick else FULL_EVENTS
    per_hub = events // HUBS
    events = per_hub * HUBS
    work = Path(tempfile.mkdtemp(prefix="bench-fleet-"))
    figures: list[Figure] = []
    hubs: list[HubProcess] = []
    label = f"{events / 1e6:g}M events, {HUBS} journals"
    try:
        from taproom.spark.jobs.session import get_session

        journals = [work / f"journal{i}" for i in range(HUBS)]
        for journal in journals:
            _journal(journal, per_hub, QUICK_SEGMENT_BYTES if quick else 128 << 20)
        hubs = [_serve(work / f"hub{i}", j) for i, j in enumerate(journals)]
        spark = get_session("bench-fleet")
        local_options = {"journals": ",".join(str(j) for j in journals)}
        hub_options = {"hubs": ",".join(h.addresses["web"] for h in hubs)}
        local_rates, hub_rates = [], []
        for _ in range(2):
            local_rates.append(_read_rate(spark, events, **local_options))
            hub_rates.append(_read_rate(spark, events, **hub_options))
        local, net = max(local_rates), max(hub_rates)
        figures += [
            Figure(f"spark read, {label}, from directories (best of 2)", local, "rows/s"),
            Figure(f"spark read, {label}, from hubs over HTTP (best of 2)", net, "rows/s"),
            Figure("  hubs / directories", net / local, "ratio", ">= 0.8"),
        ]

        n = QUICK_INGEST_MESSAGES if quick else INGEST_MESSAGES
        target = hubs[0]
        idle_rate, idle_cpu, idle_machine = _ingest(target, n)
        stop = threading.Event()
        reads = [0]

        def read_forever() -> None:
            while not stop.is_set():
                _read_rate(spark, per_hub, hubs=target.addresses["web"])
                reads[0] += 1

        reader = threading.Thread(target=read_forever, daemon=True)
        reader.start()
        time.sleep(5)  # the read is under way: Spark's tasks are pulling from the hub
        busy_rate, busy_cpu, busy_machine = _ingest(target, n)
        stop.set()
        reader.join()
        figures += [
            Figure("hub ingest, logjam PUSH 300 B, fsync=always, idle", idle_rate, "msg/s"),
            Figure("  while Spark reads the hub at full speed", busy_rate, "msg/s"),
            Figure("  busy / idle", busy_rate / idle_rate, "ratio", ">= 0.9"),
            Figure("  hub CPU-seconds per 1k messages, idle", idle_cpu, "s"),
            Figure("  hub CPU-seconds per 1k messages, while read", busy_cpu, "s"),
            Figure(
                f"  cores busy on the machine (of {os.cpu_count()}), idle", idle_machine, "cores"
            ),
            Figure("  cores busy on the machine, while read", busy_machine, "cores"),
            Figure("  full reads of the hub finished meanwhile", reads[0], "reads"),
        ]
        spark.stop()
    finally:
        for hub in hubs:
            hub.stop()
        shutil.rmtree(work, ignore_errors=True)
    return figures
