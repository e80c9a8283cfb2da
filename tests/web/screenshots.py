"""``make screenshots``: every console page in headless Chromium, with data the protocol clients
sent to a real hub, written to ``docs/console/<page>.png``.

    python -m tests.web.screenshots docs/console
"""

from __future__ import annotations

import datetime as dt
import math
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from playwright.sync_api import sync_playwright

from .console_support import (
    close_chromium,
    console_hub,
    launch_chromium,
    run_async,
    send_bus,
    send_lager,
    send_logjam,
    send_lumberjack,
    write_rollups,
)

ACTIONS = (
    "Orders#index", "Orders#show", "Api::Search#query", "Carts#update", "Users#login",
    "Reports#daily", "Health#check", "Api::Prices#list",
)  # fmt: skip


def _traffic(addresses: dict[str, str], stop: threading.Event, logjam: threading.Event) -> None:
    """A few hundred events a second over Lumberjack and (once ``logjam`` is set) logjam,
    varying, until ``stop``."""
    n = 0
    while not stop.is_set():
        burst = 50 + int(150 * (1 + math.sin(n / 5)))
        run_async(
            send_lumberjack(
                addresses["lumberjack"],
                [{"message": f"GET /orders/{i} 200", "level": "info"} for i in range(burst)],
            )
        )
        if logjam.is_set():
            send_logjam(
                addresses["logjam_router"],
                "shop-prod",
                [{"action": random.choice(ACTIONS), "total_time": random.lognormvariate(4, 0.7),
                  "code": 200} for _ in range(20)],
            )  # fmt: skip
        n += 1
        time.sleep(0.5)


EXCEPTIONS = ("ActiveRecord::RecordNotFound", "Timeout::Error", "Redis::CannotConnectError")


def _requests_to_drill_into(addresses: dict[str, str], minutes: int = 20) -> None:
    """Logjam requests of the last ``minutes`` minutes with the whole of a request: ids, hosts,
    time by resource, log lines, some failing with exceptions and backtraces."""
    rng = random.Random(30)
    now = dt.datetime.now(dt.UTC)
    docs = []
    for i in range(600):
        started = now - dt.timedelta(seconds=rng.uniform(30, minutes * 60))
        total = rng.lognormvariate(4, 0.9)
        action = rng.choice(ACTIONS)
        doc = {
            "request_id": uuid.uuid1().hex,
            "action": action,
            "started_at": started.isoformat(timespec="milliseconds"),
            "total_time": round(total, 2),
            "code": 200,
            "host": f"web-{rng.randint(1, 4)}.example",
            "db_time": round(total * 0.45, 2),
            "view_time": round(total * 0.3, 2),
            "api_time": round(total * 0.1, 2),
            "db_calls": rng.randint(1, 30),
            "lines": [
                [1, started.isoformat(), f"Started GET /orders/{i} for 10.0.0.{i % 250}"],
                [1, started.isoformat(), f"Processing by {action} as HTML"],
                [0, started.isoformat(), "  Order Load (1.2ms)  SELECT * FROM orders WHERE id = ?"],
                [1, started.isoformat(), f"Completed 200 OK in {total:.0f}ms"],
            ],
        }
        if rng.random() < 0.08:
            name = rng.choice(EXCEPTIONS)
            doc.update(code=500, exceptions=[name])
            doc["lines"][-1] = [
                3, started.isoformat(),
                f"{name} (lookup failed):\n  app/models/order.rb:41:in `find'\n"
                "  app/controllers/orders_controller.rb:12:in `show'",
            ]  # fmt: skip
        elif rng.random() < 0.04:
            doc["lines"].append([2, started.isoformat(), "Slow query: 812ms"])
            doc["lines"].append([3, started.isoformat(), "cache unavailable, fell back to db"])
        docs.append(doc)
    send_logjam(addresses["logjam_router"], "shop-prod", docs)


def _rollup(journal: Path, rollups: Path) -> None:
    """The drill-down tables of the real journal (the Requests page's charts stay those of the
    bigger table written beside them)."""
    taproom = str(Path(sys.executable).with_name("taproom"))
    subprocess.run(
        [taproom, "spark", "rollup", "--journal", str(journal), "--out", str(rollups),
         "--tables", "exceptions,request_samples,request_ids", "--quiet"],
        check=True, env=dict(os.environ, PYSPARK_PYTHON=sys.executable), timeout=900,
    )  # fmt: skip


def main(out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="taproom-screens-"))
    today = dt.date.today().isoformat()
    write_rollups(root / "rollups", today, {"shop-prod": 2_000_000, "blog-prod": 150_000},
                  actions=len(ACTIONS), action_names=ACTIONS)  # fmt: skip
    with console_hub(root) as hub, sync_playwright() as playwright:
        addresses = hub.addresses
        run_async(
            send_bus(
                addresses["eventbus_snapshot"],
                {f"/fleet/{r}/{k}": {"value": random.random()} for r in ("r1", "r2", "r3")
                 for k in ("battery", "position", "mode")},
            )
        )  # fmt: skip
        send_lager(addresses, "/RobotA/Motion/", 600, root / "kegs" / "robot-a.lgr")
        # Lumberjack and Lager traffic from the start (the Overview's history), logjam's only
        # after the rollup: its id-less requests would crowd the drill-down's slowest.
        stop, logjam = threading.Event(), threading.Event()
        traffic = threading.Thread(target=_traffic, args=(addresses, stop, logjam), daemon=True)
        traffic.start()
        lager = threading.Thread(
            target=send_lager, args=(addresses, "/RobotB/Arm/", 3000, None, 0.4), daemon=True
        )
        lager.start()
        _requests_to_drill_into(addresses)
        _rollup(root / "journal", root / "rollups")
        logjam.set()
        context, _, profile = launch_chromium(playwright)
        try:
            page = context.new_page()
            base = f"http://{addresses['web']}"
            time.sleep(20)  # twenty seconds of history on the Overview
            day = f"date={today}&stream=shop-prod"
            shots = [
                ("overview", "/", ".uplot"),
                ("tail", "/tail", "#events tbody tr"),
                ("requests", "/requests", "#actions tbody tr"),
                ("request", "", ""),
                ("errors", f"/errors?{day}", "#errors tbody tr"),
                ("exceptions", f"/exceptions?{day}", "#classes tbody tr"),
                ("telemetry", "/telemetry", "#kegs tbody tr"),
                ("bus", "/bus", "#keys tbody tr"),
            ]
            for name, path, ready in shots:
                if path:
                    page.goto(base + path)
                    page.wait_for_selector(ready, timeout=30_000)
                if name == "telemetry":
                    page.select_option("#tap", "/RobotB/Arm/")
                    page.click("#kegs tbody tr")
                    page.wait_for_selector("#preview tbody tr")
                if name == "requests":  # an action's slowest and failed requests
                    page.click("#actions tbody tr >> nth=1")
                    page.wait_for_selector("#failed tbody tr", timeout=30_000)
                if name == "request":  # a request that raised, opened from the Errors page
                    query = f"{day}&exception={EXCEPTIONS[0]}"
                    page.goto(f"{base}/errors?{query}")
                    page.wait_for_selector("#errors tbody tr", timeout=30_000)
                    page.click("#errors tbody tr >> nth=0 >> a")
                    page.wait_for_selector("#request:not([hidden])", timeout=30_000)
                page.wait_for_timeout(3000)
                if name == "tail":  # a record opened; the table grows without end: one screen
                    page.click("#events tbody tr >> nth=3")
                    page.wait_for_selector("#record:not([hidden])")
                page.screenshot(path=str(out / f"{name}.png"), full_page=name != "tail")
                print(f"wrote {out / f'{name}.png'}")
        finally:
            stop.set()
            close_chromium(context, profile)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/console")))
