"""``make screenshots``: every console page in headless Chromium, with data the protocol clients
sent to a real hub, written to ``docs/console/<page>.png``.

    python -m tests.web.screenshots docs/console
"""

from __future__ import annotations

import datetime as dt
import math
import random
import sys
import tempfile
import threading
import time
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


def _traffic(addresses: dict[str, str], stop: threading.Event) -> None:
    """A few hundred events a second over Lumberjack and logjam, varying, until ``stop``."""
    n = 0
    while not stop.is_set():
        burst = 50 + int(150 * (1 + math.sin(n / 5)))
        run_async(
            send_lumberjack(
                addresses["lumberjack"],
                [{"message": f"GET /orders/{i} 200", "level": "info"} for i in range(burst)],
            )
        )
        send_logjam(
            addresses["logjam_router"],
            "shop-prod",
            [{"action": random.choice(ACTIONS), "total_time": random.lognormvariate(4, 0.7),
              "code": 200} for _ in range(20)],
        )  # fmt: skip
        n += 1
        time.sleep(0.5)


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
        stop = threading.Event()
        traffic = threading.Thread(target=_traffic, args=(addresses, stop), daemon=True)
        traffic.start()
        lager = threading.Thread(
            target=send_lager, args=(addresses, "/RobotB/Arm/", 3000, None, 0.4), daemon=True
        )
        lager.start()
        context, _, profile = launch_chromium(playwright)
        try:
            page = context.new_page()
            base = f"http://{addresses['web']}"
            time.sleep(20)  # twenty seconds of history on the Overview
            shots = [
                ("overview", "/", ".uplot"),
                ("tail", "/tail", "#events tbody tr"),
                ("requests", "/requests", "#actions tbody tr"),
                ("telemetry", "/telemetry", "#kegs tbody tr"),
                ("bus", "/bus", "#keys tbody tr"),
            ]
            for name, path, ready in shots:
                page.goto(base + path)
                page.wait_for_selector(ready, timeout=30_000)
                if name == "telemetry":
                    page.select_option("#tap", "/RobotB/Arm/")
                    page.click("#kegs tbody tr")
                    page.wait_for_selector("#preview tbody tr")
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
