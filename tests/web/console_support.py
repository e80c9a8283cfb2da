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
from taproom.spark.buckets import bucket_of
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
    """``requests/date=<date>/part.parquet`` with ``streams[app_env]`` requests each, spread over
    ``minutes`` and ``actions`` (``action_names`` name the first ones); returns the number of
    rows written."""
    rng = np.random.default_rng(seed)
    day = dt.datetime.fromisoformat(date).replace(tzinfo=dt.UTC)
    columns: dict[str, list[Any]] = {}

    def add(name: str, values: Any) -> None:
        columns.setdefault(name, []).extend(values)

    for stream, total in streams.items():
        app, _, env = stream.rpartition("-")
        cells = minutes * actions
        counts = rng.multinomial(total, rng.dirichlet(np.ones(cells)))
        for cell in range(cells):
            minute, action = divmod(cell, actions)
            count = int(counts[cell])
            if not count:
                continue
            scale = 20.0 * (action + 1)
            times = rng.lognormal(np.log(scale), 0.6, size=min(count, 64))
            weights = np.full(len(times), count / len(times))
            buckets: dict[int, float] = {}
            for t, w in zip(times.tolist(), weights.tolist(), strict=True):
                buckets[bucket_of(t)] = buckets.get(bucket_of(t), 0.0) + w
            histogram = _integer_histogram(buckets, count)
            time_sum = float(np.mean(times) * count)
            add("minute", [day + dt.timedelta(minutes=minute)])
            add("app", [app])
            add("env", [env])
            name = action_names[action] if action < len(action_names) else f"Api{action}#show"
            add("action", [name])
            add("module", ["Others"])
            add("frontend", [0])
            add("count", [count])
            add("total_time_sum", [time_sum])
            add("total_time_max", [float(times.max())])
            satisfied = int(count * 0.8)
            add("apdex_satisfied", [satisfied])
            add("apdex_tolerating", [int(count * 0.15)])
            add("apdex", [(satisfied + count * 0.075) / count])
            add("status_4xx", [int(count * 0.02)])
            add("status_5xx", [int(count * 0.005)])
            add("exceptions", [int(count * 0.01)])
            for name in _SEVERITIES:
                add(f"severity_{name}", [count if name == "info" else 0])
            for i, name in enumerate(TIME_RESOURCES):
                add(f"{name}_sum", [time_sum * (0.4, 0.3, 0.1, 0.05)[i]])
            add("db_calls_sum", [float(count * 3)])
            add("total_time_histogram", [histogram])
    table = pa.table(
        {
            **{k: v for k, v in columns.items() if k != "total_time_histogram"},
            "total_time_histogram": pa.array(
                columns.get("total_time_histogram", []),
                pa.list_(pa.struct([("b", pa.int32()), ("n", pa.int64())])),
            ),
        }
    )
    table = table.set_column(
        table.schema.get_field_index("minute"),
        "minute",
        pa.array(columns.get("minute", []), pa.timestamp("us", tz="UTC")),
    )
    out = directory / "requests" / f"date={date}"
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / "part-0.parquet")
    return table.num_rows


def _integer_histogram(buckets: dict[int, float], count: int) -> list[dict[str, int]]:
    """Round weighted bucket counts to integers that add up to ``count``."""
    items = sorted(buckets.items())
    rounded = [int(w) for _, w in items]
    for i in range(count - sum(rounded)):
        rounded[i % len(rounded)] += 1
    return [{"b": b, "n": n} for (b, _), n in zip(items, rounded, strict=True) if n]
