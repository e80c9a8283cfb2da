"""What the console's tests, screenshots and bench share: a hub process with every service, real
protocol clients sending data to it, rollup tables, kegs, and a headless Chromium.

The rollup tables written here have the columns of ``REQUEST_ROLLUP_SCHEMA`` (without Spark:
tests/spark/test_jobs.py checks the console against tables the real job wrote).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from taproom.clients.eventbus import EventBusClient
from taproom.clients.lager import KegWriter, Tap
from taproom.clients.logjam import LogjamAgent
from taproom.clients.lumberjack import AsyncLumberjackClient
from taproom.spark.buckets import LOG_GAMMA
from tests.support import HubProcess, write_config

__all__ = [
    "CHROMIUM",
    "CHROMIUM_ARGS",
    "TAP_FORMAT",
    "TIME_RESOURCES",
    "console_hub",
    "launch_chromium",
    "run_async",
    "send_bus",
    "send_lager",
    "send_logjam",
    "send_lumberjack",
    "write_rollups",
]

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TAP_FORMAT = (
    '<format version="BEERR01"><item name="speed" type="double" size="8" offset="0"/>'
    '<item name="temp" type="double" size="8" offset="8"/>'
    '<item name="label" type="string" size="8" offset="16"/></format>'
)
TIME_RESOURCES = ("db_time", "view_time", "api_time", "gc_time")
_SEVERITIES = ("debug", "info", "warn", "error", "fatal", "unknown")


@contextlib.contextmanager
def console_hub(root: Path, **web: Any) -> Iterator[HubProcess]:
    """``taproom serve`` with every service on port 0, kegs and rollups under ``root``."""
    config = write_config(
        root,
        enable=["lumberjack", "logjam", "eventbus", "lager"],
        web=web,
        console={"rollups": str(root / "rollups"), "kegs": str(root / "kegs")},
        lager={"hugz_interval_s": 0.2},
    )
    (root / "kegs").mkdir(exist_ok=True)
    with HubProcess(config) as hub:
        yield hub


def run_async(coroutine: Any) -> Any:
    """Run ``coroutine`` to its end from synchronous code, even where an event loop is already
    running in this thread (Playwright's sync API keeps one)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def launch_chromium(playwright: Any) -> tuple[Any, Any, str]:
    """(context, browser-or-None, user-data-dir): a fresh profile each time."""
    if not os.path.exists(CHROMIUM):
        raise RuntimeError(
            f"{CHROMIUM} is missing: the console's browser tests need Debian's chromium "
            "(make test installs it with apt-get install -y chromium)"
        )
    profile = tempfile.mkdtemp(prefix="taproom-chromium-")
    context = playwright.chromium.launch_persistent_context(
        profile,
        executable_path=CHROMIUM,
        headless=True,
        args=CHROMIUM_ARGS,
        viewport={"width": 1400, "height": 1000},
    )
    return context, None, profile


def close_chromium(context: Any, profile: str) -> None:
    context.close()
    shutil.rmtree(profile, ignore_errors=True)


async def send_lumberjack(address: str, events: list[dict[str, Any]]) -> None:
    host, port = address.rsplit(":", 1)
    client = AsyncLumberjackClient(host, int(port), version=2)
    await client.connect()
    try:
        await client.send(events)
        await client.flush()
    finally:
        await client.close()


def send_logjam(address: str, app_env: str, requests: list[dict[str, Any]]) -> None:
    app = app_env.rsplit("-", 1)[0]
    agent = LogjamAgent(f"tcp://{address}", app_env=app_env, topic=f"logs.{app}.x")
    try:
        for request in requests:
            agent.send(request)
    finally:
        agent.close()


async def send_bus(address: str, events: dict[str, Any]) -> None:
    client = EventBusClient([f"tcp://{address}"], server_timeout=5)
    await client.start()
    try:
        futures = [await client.publish(topic, data) for topic, data in events.items()]
        await asyncio.wait_for(asyncio.gather(*futures), 20)
    finally:
        await client.stop()


def send_lager(
    addresses: dict[str, str],
    key: str,
    rows: int,
    keg: Path | None = None,
    pause_s: float = 0.01,
) -> None:
    """Register tap ``key`` and send ``rows`` rows through the forwarder, pausing ``pause_s``
    every 50 rows; with ``keg``, a keg writer (a real mug) records them into that file."""
    where = {
        "registrar": addresses["lager_registrar_snapshot"],
        "forwarder": addresses["lager_forwarder_in"],
    }
    tap = Tap(key, TAP_FORMAT, **where).register()
    writer = KegWriter(keg, **where, taps=[key]).start() if keg is not None else None
    try:
        start = time.time_ns()
        for i in range(rows):
            speed, temp = float(i % 50), 20.0 + 5 * math.sin(i / 40)
            tap.log(start + i * 10_000_000, speed=speed, temp=temp, label=b"ok")
            if i % 50 == 49:
                time.sleep(pause_s)
    finally:
        tap.close()
        if writer is not None:
            deadline = time.monotonic() + 10
            while writer.records < rows and time.monotonic() < deadline:
                time.sleep(0.05)
            writer.stop()


def write_rollups(
    directory: Path,
    date: str,
    streams: dict[str, int],
    *,
    actions: int = 12,
    minutes: int = 1440,
    seed: int = 7,
    action_names: tuple[str, ...] = (),
) -> int:
    """``requests/date=<date>/part-N.parquet`` with ``streams[app_env]`` requests each, spread
    over ``minutes`` and ``actions`` (``action_names`` name the first ones), with histograms
    whose counts add up to each row's count; returns the number of rows written. Vectorised:
    10M requests take seconds (the console bench uses it at that scale)."""
    rng = np.random.default_rng(seed)
    day = np.datetime64(dt.datetime.fromisoformat(date), "us")
    names = np.array(
        [action_names[a] if a < len(action_names) else f"Api{a}#show" for a in range(actions)],
        dtype=object,
    )
    out = directory / "requests" / f"date={date}"
    out.mkdir(parents=True, exist_ok=True)
    rows = 0
    for part, (stream, total) in enumerate(streams.items()):
        app, _, env = stream.rpartition("-")
        cells = minutes * actions
        counts = rng.multinomial(total, rng.dirichlet(np.ones(cells)))
        keep = np.flatnonzero(counts)
        counts = counts[keep]
        minute, action = np.divmod(keep, actions)
        # Up to 32 sampled durations per row stand for its requests (log-normal per action).
        samples = np.minimum(counts, 32)
        row_of = np.repeat(np.arange(len(keep)), samples)
        times = rng.lognormal(np.log(20.0 * (action[row_of] + 1)), 0.6)
        weights = counts[row_of] / samples[row_of]
        time_sum = np.bincount(row_of, weights=times * weights, minlength=len(keep))
        time_max = np.zeros(len(keep))
        np.maximum.at(time_max, row_of, times)
        buckets = np.ceil(np.log(np.maximum(times, 0.001)) / LOG_GAMMA).astype(np.int64)
        key, index = np.unique(row_of * 100_000 + (buckets + 50_000), return_inverse=True)
        mass = np.bincount(index, weights=weights)
        entry_row = key // 100_000
        entry_bucket = (key % 100_000 - 50_000).astype(np.int32)
        # Integer counts per bucket that add up to the row's count: floors, then one more for
        # the first few buckets of each row.
        floors = np.floor(mass).astype(np.int64)
        short = counts - np.bincount(entry_row, weights=floors, minlength=len(keep)).astype(int)
        starts = np.searchsorted(entry_row, np.arange(len(keep)))
        rank = np.arange(len(key)) - starts[entry_row]
        n = floors + (rank < short[entry_row])
        offsets = np.concatenate(([0], np.cumsum(np.bincount(entry_row, minlength=len(keep)))))
        histogram = pa.ListArray.from_arrays(
            pa.array(offsets, pa.int32()),
            pa.StructArray.from_arrays(
                [pa.array(entry_bucket), pa.array(n, pa.int64())], names=["b", "n"]
            ),
        )
        satisfied = (counts * 0.8).astype(np.int64)
        tolerating = (counts * 0.15).astype(np.int64)
        table = pa.table(
            {
                "minute": pa.array(
                    day + minute.astype("timedelta64[m]"), pa.timestamp("us", "UTC")
                ),
                "app": pa.array([app] * len(keep)),
                "env": pa.array([env] * len(keep)),
                "action": pa.array(names[action]),
                "module": pa.array(["Others"] * len(keep)),
                "frontend": pa.array(np.zeros(len(keep), np.int64)),
                "count": pa.array(counts.astype(np.int64)),
                "total_time_sum": pa.array(time_sum),
                "total_time_max": pa.array(time_max),
                "apdex_satisfied": pa.array(satisfied),
                "apdex_tolerating": pa.array(tolerating),
                "apdex": pa.array((satisfied + tolerating / 2) / counts),
                "status_4xx": pa.array((counts * 0.02).astype(np.int64)),
                "status_5xx": pa.array((counts * 0.005).astype(np.int64)),
                "exceptions": pa.array((counts * 0.01).astype(np.int64)),
                **{
                    f"severity_{s}": pa.array(counts if s == "info" else np.zeros_like(counts))
                    for s in _SEVERITIES
                },
                **{
                    f"{r}_sum": pa.array(time_sum * share)
                    for r, share in zip(TIME_RESOURCES, (0.4, 0.3, 0.1, 0.05), strict=True)
                },
                "db_calls_sum": pa.array(counts * 3.0),
                "total_time_histogram": histogram,
            }
        )
        pq.write_table(table, out / f"part-{part}.parquet")
        rows += table.num_rows
    return rows
