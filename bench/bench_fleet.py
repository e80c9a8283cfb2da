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
beside wall-clock rates, what survives sharing: the hubs' CPU-seconds per GiB of frames served
(measured while they do nothing else), the hub's CPU per ingested message idle and
while read (serving subtracted at that cost), the cores the hub got and the cores the whole
machine was busy.
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
from bench.common import Figure, cpu_seconds_of_pid

FULL_EVENTS = 10_000_000
HUBS = 3
INGEST_MESSAGES = 1_000_000  # a few seconds at full speed
QUICK_INGEST_MESSAGES = 200_000
_CTX = mp.get_context("spawn")


def _serve(work: Path, journal: Path) -> HubProcess:
    """``taproom serve`` over an existing journal, logjam PULL on for the ingest figure."""
    work.mkdir(parents=True, exist_ok=True)
    config = work / "taproom.toml"
    config.write_text(_config_text(str(journal)))
    return HubProcess(config).start(timeout=120)


def _served(hubs: list[HubProcess]) -> float:
    """Frame bytes the hubs have sent to network readers so far."""
    return sum(h.metric("taproom_journal_remote_read_bytes_total") for h in hubs)


def _hubs_cpu(hubs: list[HubProcess]) -> float:
    return sum(cpu_seconds_of_pid(h.pid) for h in hubs)


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


def _ingest(hub: HubProcess, n: int) -> tuple[float, float, float, float, float]:
    """(messages/s wall, hub CPU-seconds, cores the hub had, cores busy on the machine, frame
    bytes the hub sent to readers meanwhile), from the agent's first send to the commit of
    its last message."""
    started = _CTX.Value("d", 0.0)
    base = _committed(hub)
    agent = _CTX.Process(
        target=_push_agent, args=("tcp://" + hub.addresses["logjam_pull"], n, started)
    )
    agent.start()
    while not started.value:  # connected, about to send (starting Python is not measured)
        time.sleep(0.01)
    served = _served([hub])
    usage = _Usage(hub.pid)
    while _committed(hub) < base + n:
        time.sleep(0.2)
    done = time.time()
    cpu, hub_cores, machine = usage.stop()
    served = _served([hub]) - served
    agent.join()
    return n / (done - started.value), cpu, hub_cores, machine, served


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
        cpu0, served0 = _hubs_cpu(hubs), _served(hubs)
        for _ in range(2):
            local_rates.append(_read_rate(spark, events, **local_options))
            hub_rates.append(_read_rate(spark, events, **hub_options))
        # The hubs do nothing but serve these reads: their CPU per byte sent is the read API's
        # cost, a figure CPU sharing does not distort.
        serve_cpu_per_gib = (_hubs_cpu(hubs) - cpu0) / ((_served(hubs) - served0) / (1 << 30))
        local, net = max(local_rates), max(hub_rates)
        figures += [
            Figure(f"spark read, {label}, from directories (best of 2)", local, "rows/s"),
            Figure(f"spark read, {label}, from hubs over HTTP (best of 2)", net, "rows/s"),
            Figure("  hubs / directories", net / local, "ratio", ">= 0.8"),
            Figure("  hub CPU-seconds per GiB of frames served", serve_cpu_per_gib, "s"),
        ]

        n = QUICK_INGEST_MESSAGES if quick else INGEST_MESSAGES
        target = hubs[0]
        idle_rate, idle_cpu, idle_cores, idle_machine, _ = _ingest(target, n)
        stop = threading.Event()

        def read_forever() -> None:
            while not stop.is_set():
                _read_rate(spark, per_hub, hubs=target.addresses["web"])

        reader = threading.Thread(target=read_forever, daemon=True)
        reader.start()
        time.sleep(5)  # the read is under way: Spark's tasks are pulling from the hub
        busy_rate, busy_cpu, busy_cores, busy_machine, served = _ingest(target, n)
        stop.set()
        reader.join()
        # What the hub spent on ingest while read: its CPU less serving at the measured cost.
        ingest_cpu = busy_cpu - served / (1 << 30) * serve_cpu_per_gib
        figures += [
            Figure("hub ingest, logjam PUSH 300 B, fsync=always, idle", idle_rate, "msg/s"),
            Figure("  while Spark reads the hub at full speed", busy_rate, "msg/s"),
            Figure("  busy / idle", busy_rate / idle_rate, "ratio", ">= 0.9"),
            Figure("  hub CPU per message, idle", idle_cpu / n * 1e6, "us"),
            Figure(
                "  hub CPU per message, while read (serving subtracted)", ingest_cpu / n * 1e6, "us"
            ),
            Figure("  MiB served to Spark meanwhile", served / (1 << 20), "MiB"),
            Figure("  cores the hub had, idle", idle_cores, "cores"),
            Figure("  cores the hub had, while read", busy_cores, "cores"),
            Figure(
                f"  cores busy on the machine (of {os.cpu_count()}), idle", idle_machine, "cores"
            ),
            Figure("  cores busy on the machine, while read", busy_machine, "cores"),
        ]
        spark.stop()
    finally:
        for hub in hubs:
            hub.stop()
        shutil.rmtree(work, ignore_errors=True)
    return figures
