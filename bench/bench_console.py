"""The console's cost to the hub, and the Requests page over 10M rolled-up events.

1. Lumberjack ingest (the lumberjack bench's v2 windows, acked) into a hub with the web listener
   on, with no console clients, then with five browsers' worth of them: each polls the Overview
   as the page does (``/api/stats?seconds=5`` and ``/api/overview`` once a second, after one
   full ``/api/stats``) and keeps an unfiltered live tail open, reading every message. Rounds
   alternate (none, with, none, with); the ratio compares the means. The clients run in this
   process, the hub in its own (pinned to one core, as in the lumberjack bench).
2. Overview API latency (``/api/stats?seconds=5`` + ``/api/overview``) p50/p99 under that load.
3. The Requests page's data over a rollup table of 10M requests (one app-env, one day, 50
   actions, 1,440 minutes): written directly with pyarrow in the rollup's shape (running Spark
   over 10M events is the Spark bench's job), then ``/api/requests/apps`` + ``/api/requests/day``
   over HTTP, cold (first read) and warm (the answer cache).
4. The drill-down (bench/console_drilldown.py): rollup throughput with its tables vs without,
   and the Request page by request id over a 10M-request day, cold and warm.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import orjson
from tests.hubprocess import HubProcess

from taproom.config import known_sections
from taproom.servers import SERVICE_MODULES

from . import console_drilldown
from .bench_lumberjack import _drive, _hub_preexec, _window_bytes
from .common import Figure, cpu_seconds_of_pid, percentile

BROWSERS = 5
ROLLUP_EVENTS = 10_000_000
ROLLUP_DATE = "2026-01-02"


class _Hub:
    """``taproom serve`` with Lumberjack and the web listener, in a child process."""

    def __init__(self, workdir: Path, rollups: Path) -> None:
        lines = [
            "[journal]", f'dir = "{workdir / "journal"}"', 'fsync = "always"',
            "[web]", "port = 0",
            "[console]", f'rollups = "{rollups}"',
            "[lumberjack]", "enabled = true", "port = 0",
        ]  # fmt: skip
        sections = known_sections()
        for name in SERVICE_MODULES:
            if name != "lumberjack" and name in sections:
                lines += [f"[{name}]", "enabled = false"]
        config = workdir / "bench.toml"
        config.write_text("\n".join(lines) + "\n")
        self.hub = HubProcess(config, preexec_fn=_hub_preexec).start()
        self.proc = self.hub.proc
        listeners = self.hub.addresses
        host, port = listeners["lumberjack"].rsplit(":", 1)
        self.lumberjack = (host, int(port))
        self.web = f"http://{listeners['web']}"

    def stop(self) -> None:
        self.hub.stop(30)


class _Browsers:
    """``count`` console pages' worth of HTTP and WebSocket traffic, in a thread of its own."""

    def __init__(self, base: str, count: int) -> None:
        self.base = base
        self.count = count
        self.latencies: list[float] = []
        self.tail_events = 0
        self.tail_skipped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    def __enter__(self) -> _Browsers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    async def _main(self) -> None:
        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(self._page(http) for _ in range(self.count)))

    async def _page(self, http: aiohttp.ClientSession) -> None:
        async with http.get(f"{self.base}/api/stats?seconds=900") as r:
            await r.read()
        tail = asyncio.ensure_future(self._tail(http))
        while not self._stop.is_set():
            started = time.perf_counter()
            async with http.get(f"{self.base}/api/stats?seconds=5") as r:
                await r.read()
            async with http.get(f"{self.base}/api/overview") as r:
                await r.read()
            self.latencies.append(time.perf_counter() - started)
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))
        tail.cancel()

    async def _tail(self, http: aiohttp.ClientSession) -> None:
        async with http.ws_connect(f"{self.base}/api/tail") as ws:
            async for message in ws:
                data = orjson.loads(message.data)
                self.tail_events += len(data["events"])
                self.tail_skipped += data["skipped"]


def _requests_page(base: str, events: int) -> float:
    async def load() -> float:
        async with aiohttp.ClientSession() as http:
            started = time.perf_counter()
            async with http.get(f"{base}/api/requests/apps?date={ROLLUP_DATE}") as r:
                streams = (await r.json())["streams"]
            query = f"date={ROLLUP_DATE}&stream={streams[0]['stream']}&actions=50"
            async with http.get(f"{base}/api/requests/day?{query}") as r:
                day = await r.json()
            assert sum(day["requests"]) == events, "the page must see every request"
            return time.perf_counter() - started

    return asyncio.run(load())


def run(quick: bool) -> list[Figure]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.web for the table
    from tests.web.console_support import write_rollups

    seconds = 3.0 if quick else 10.0
    rounds = 1 if quick else 2
    workdir = Path(tempfile.mkdtemp(prefix="taproom-bench-console-"))
    rollups = workdir / "rollups"
    events = 1_000_000 if quick else ROLLUP_EVENTS
    write_rollups(rollups, ROLLUP_DATE, {"shop-prod": events}, actions=50)
    hub = _Hub(workdir, rollups)
    figures: list[Figure] = []
    try:
        window = _window_bytes(2)
        _drive(hub.lumberjack, window, 2.0)  # warm-up
        without, with_console = [], []
        last: _Browsers | None = None
        cpu: dict[str, float] = {"none": 0.0, "with": 0.0}
        for _ in range(rounds):
            before = cpu_seconds_of_pid(hub.proc.pid)
            without.append(_drive(hub.lumberjack, window, seconds)[0])
            cpu["none"] += cpu_seconds_of_pid(hub.proc.pid) - before
            with _Browsers(hub.web, BROWSERS) as browsers:
                time.sleep(1.5)  # pages open and tails subscribed
                before = cpu_seconds_of_pid(hub.proc.pid)
                with_console.append(_drive(hub.lumberjack, window, seconds)[0])
                cpu["with"] += cpu_seconds_of_pid(hub.proc.pid) - before
            last = browsers
        rate0 = sum(without) / len(without)
        rate1 = sum(with_console) / len(with_console)
        figures += [
            Figure("Lumberjack v2 events/s, no console clients", rate0, "ev/s"),
            Figure(f"Lumberjack v2 events/s, {BROWSERS} browsers' console clients", rate1, "ev/s"),
            Figure("ratio with / without", rate1 / rate0 if rate0 else 0.0, "ratio", ">= 0.95"),
            Figure(
                "hub events per CPU-second, without",
                rate0 * seconds * rounds / max(cpu["none"], 1e-9),
                "ev/cpu-s",
            ),
            Figure(
                "hub events per CPU-second, with console clients",
                rate1 * seconds * rounds / max(cpu["with"], 1e-9),
                "ev/cpu-s",
            ),
            Figure(
                "per-CPU-second ratio with / without (robust on a loaded machine)",
                (rate1 / max(cpu["with"], 1e-9)) / max(rate0 / max(cpu["none"], 1e-9), 1e-9),
                "ratio",
                ">= 0.95",
            ),
        ]
        assert last is not None
        latencies = sorted(last.latencies)
        figures += [
            Figure("overview API (stats + overview) p50 under load", percentile(latencies, 50) * 1e3, "ms"),
            Figure("overview API (stats + overview) p99 under load", percentile(latencies, 99) * 1e3, "ms"),
            Figure("live-tail events delivered to the 5 pages (last round)", last.tail_events, "events"),
            Figure("live-tail events skipped and reported (last round)", last.tail_skipped, "events"),
        ]  # fmt: skip
        cold = _requests_page(hub.web, events)
        warm = _requests_page(hub.web, events)
        label = f"{events / 1e6:.0f}M"
        figures += [
            Figure(f"requests page data over {label} rolled-up events, cold", cold * 1e3, "ms"),
            Figure(f"requests page data over {label} rolled-up events, warm", warm * 1e3, "ms"),
        ]
    finally:
        hub.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return figures + console_drilldown.run(quick)
