"""The console in real headless Chromium, against a real hub process fed by the protocol clients.

One browser for the module. Each page must load without console errors and draw its charts
from real data; the live tail must show an event within 2 s of it being sent, and filter; and
payloads, topics, keys, tap names and action names carrying script must stay text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from playwright.sync_api import Page, sync_playwright

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

XSS = [
    "<script>window.__pwned=1</script>",
    '"><img src=x onerror="window.__pwned=1">',
    "javascript:window.__pwned=1",
]
XSS_TAP = '/"><img_src=x_onerror=window.__pwned=1>/<script>window.__pwned=1<script>/'
XSS_ACTION = '"><img src=x onerror="window.__pwned=1">#<script>window.__pwned=1</script>'
ROLLUP_DATE = "2026-01-02"
# The first series colour of every chart (common.js PALETTE[0]) as canvas pixels.
SERIES_RGB = (224, 160, 48)


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    root = tmp_path_factory.mktemp("console")
    write_rollups(
        root / "rollups", ROLLUP_DATE, {"shop-prod": 20_000}, actions=6, minutes=120,
        action_names=(XSS_ACTION,),
    )  # fmt: skip
    with console_hub(root) as process:
        addresses = process.addresses
        run_async(
            send_lumberjack(
                addresses["lumberjack"],
                [{"message": text, "n": i} for i, text in enumerate(XSS * 5)],
            )
        )
        send_logjam(
            addresses["logjam_router"],
            "shop-prod",
            [{"action": XSS_ACTION, "total_time": 12.5, "code": 200}] * 5,
        )
        run_async(send_bus(addresses["eventbus_snapshot"], {f"/xss/{t}": {"v": t} for t in XSS}))
        send_lager(addresses, XSS_TAP, 200, root / "kegs" / "run.lgr")
        send_lager(addresses, "/Robot/Arm/", 300)
        yield process


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_playwright() as playwright:
        context, _, profile = launch_chromium(playwright)
        try:
            yield context
        finally:
            close_chromium(context, profile)


class PageWatch:
    """Console errors, page errors and dialogs of one page."""

    def __init__(self, page: Page) -> None:
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        page.on(
            "console",
            lambda m: self.errors.append(m.text) if m.type == "error" else None,
        )
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on(
            "response",
            lambda r: self.errors.append(f"{r.status} {r.url}") if r.status >= 400 else None,
        )

        def on_dialog(dialog: Any) -> None:
            self.dialogs.append(dialog.message)
            dialog.dismiss()

        page.on("dialog", on_dialog)


@pytest.fixture
def page(browser: Any) -> Iterator[tuple[Page, PageWatch]]:
    page = browser.new_page()
    watch = PageWatch(page)
    try:
        yield page, watch
    finally:
        page.close()


def open_page(page: Page, hub: Any, path: str) -> None:
    page.goto(f"http://{hub.addresses['web']}{path}", wait_until="load")


def assert_safe(page: Page, watch: PageWatch) -> None:
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert watch.dialogs == []
    assert page.evaluate("document.querySelectorAll('main img').length") == 0
    assert page.evaluate("document.querySelectorAll('main script').length") == 0
    assert watch.errors == [], watch.errors


def wait_until(page: Page, expression: str, timeout_s: float = 20) -> None:
    """Poll ``expression`` from outside the page: Playwright's in-page polling of a string
    predicate needs eval, which the console's CSP rightly forbids."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s}s: {expression}"
        page.wait_for_timeout(100)


def series_pixels(page: Page, selector: str = "canvas") -> list[int]:
    """Per canvas: how many pixels have the first series colour (a drawn data line)."""
    return page.evaluate(
        """([selector, rgb]) => [...document.querySelectorAll(selector)].map((c) => {
            const data = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
            let n = 0;
            for (let i = 0; i < data.length; i += 4) {
              if (Math.abs(data[i] - rgb[0]) < 40 && Math.abs(data[i + 1] - rgb[1]) < 40 &&
                  Math.abs(data[i + 2] - rgb[2]) < 40 && data[i + 3] > 100) n++;
            }
            return n;
        })""",
        [selector, list(SERIES_RGB)],
    )


def wait_for_drawn(page: Page, selector: str, at_least: int, timeout_s: float = 20) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = series_pixels(page, selector)
        if sum(1 for n in counts if n > 0) >= at_least or time.monotonic() > deadline:
            return counts
        page.wait_for_timeout(250)


def test_overview_draws_live_charts(hub: Any, page: Any) -> None:
    page, watch = page
    open_page(page, hub, "/")
    page.wait_for_selector("#ready .ok", timeout=20_000)
    assert "Ready" in page.inner_text("#ready")
    # events/s, bytes/s, journal offset, size, segments, commit latency at least.
    counts = wait_for_drawn(page, ".uplot canvas", 5)
    assert sum(1 for n in counts if n > 0) >= 5, counts
    assert "lumberjack" in page.inner_text("#listeners")
    # Bytes in per protocol: the card's legend names the protocols the hub was fed by.
    bytes_card = page.locator(".card", has_text="Bytes in per second, by protocol")
    legend = bytes_card.locator(".u-legend").inner_text()
    assert "lumberjack" in legend and "logjam" in legend, legend
    assert_safe(page, watch)


def test_tail_shows_a_new_event_within_2s_and_filters(hub: Any, page: Any) -> None:
    page, watch = page
    open_page(page, hub, "/tail")
    wait_until(page, "document.getElementById('state').textContent.startsWith('following')")
    marker = f"marker-{time.time_ns()}"
    sent = time.monotonic()
    run_async(send_lumberjack(hub.addresses["lumberjack"], [{"message": marker}]))
    page.wait_for_selector(f"#events td.preview:has-text('{marker}')", timeout=10_000)
    assert time.monotonic() - sent < 2.0
    # Filter by payload text: only the matching event of the next two shows.
    page.fill("input[name=q]", "keep-")
    page.click("#filters button[type=submit]")
    wait_until(page, "document.getElementById('state').textContent.startsWith('following')")
    run_async(
        send_lumberjack(
            hub.addresses["lumberjack"],
            [{"message": "drop-one"}, {"message": "keep-two"}],
        )
    )
    page.wait_for_selector("#events td.preview:has-text('keep-two')", timeout=10_000)
    rows = page.locator("#events tbody tr").all_inner_texts()
    assert len(rows) == 1 and "drop-one" not in rows[0]
    # One click shows the decoded record.
    page.click("#events tbody tr")
    page.wait_for_selector("#record:not([hidden])")
    assert '"message": "keep-two"' in page.inner_text("#record")
    assert_safe(page, watch)


def test_tail_from_offset_shows_script_payloads_as_text(hub: Any, page: Any) -> None:
    page, watch = page
    open_page(page, hub, "/tail")
    page.fill("input[name=from]", "0")
    page.select_option("select[name=protocol]", "lumberjack")
    page.click("#filters button[type=submit]")
    page.wait_for_selector("#events tbody tr", timeout=10_000)
    wait_until(page, "document.querySelectorAll('#events tbody tr').length >= 15")
    text = page.inner_text("#events")
    for payload in XSS:  # as the JSON text of the payload, escapes and all
        assert orjson.dumps(payload).decode()[1:-1] in text
    page.click("#events tbody tr >> nth=-1")
    page.wait_for_selector("#record:not([hidden])")
    assert_safe(page, watch)


def test_requests_page_charts_heatmap_and_actions(hub: Any, page: Any) -> None:
    page, watch = page
    open_page(page, hub, "/requests")
    page.wait_for_selector("#actions tbody tr", timeout=20_000)
    assert page.input_value("#date") == ROLLUP_DATE
    assert page.input_value("#stream") == "shop-prod"
    counts = wait_for_drawn(page, ".uplot canvas", 5)
    assert sum(1 for n in counts if n > 0) >= 5, counts  # one per chart
    heat = page.evaluate(
        """() => { const c = document.getElementById('heatmap');
                   const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                   let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i] > 60) n++; return n; }"""
    )
    assert heat > 0
    assert series_pixels(page, "#stack")[0] > 0
    assert XSS_ACTION in page.inner_text("#actions")
    assert_safe(page, watch)


def test_telemetry_page_plots_a_tap_and_lists_kegs(hub: Any, page: Any) -> None:
    page, watch = page
    open_page(page, hub, "/telemetry")
    page.wait_for_selector("#taps tbody tr", timeout=20_000)
    assert XSS_TAP in page.inner_text("#taps")
    page.select_option("#tap", "/Robot/Arm/")
    counts = wait_for_drawn(page, ".uplot canvas", 1)
    assert counts and counts[0] > 0, counts
    page.wait_for_selector("#kegs tbody tr", timeout=20_000)
    assert "run.lgr" in page.inner_text("#kegs")
    page.click("#kegs tbody tr")
    page.wait_for_selector("#preview tbody tr")
    assert "speed" in page.inner_text("#preview thead")
    assert_safe(page, watch)


def test_bus_page_lists_keys_as_text(hub: Any, page: Any) -> None:
    page, watch = page
    open_page(page, hub, "/bus")
    wait_until(page, "document.querySelectorAll('#keys tbody tr').length >= 3")
    text = page.inner_text("#keys")
    for payload in XSS:
        assert f"/xss/{payload}" in text
    page.fill("input[name=subtree]", "/xss/javascript")
    page.click("#filters button[type=submit]")
    wait_until(page, "document.querySelectorAll('#keys tbody tr').length === 1")
    run_async(send_bus(hub.addresses["eventbus_snapshot"], {"/xss/javascript:x": {"v": 2}}))
    page.wait_for_selector("#keys tr.fresh", timeout=10_000)  # a live update is highlighted
    assert_safe(page, watch)


def test_login_form_then_pages(tmp_path: Path, browser: Any) -> None:
    with console_hub(tmp_path, token="t0ken-for-the-browser") as hub:
        page = browser.new_page()
        watch = PageWatch(page)
        try:
            open_page(page, hub, "/")
            page.wait_for_url("**/login")
            page.fill("input[name=token]", "wrong")
            page.click("button[type=submit]")
            page.wait_for_selector("#failed:not([hidden])")
            page.fill("input[name=token]", "t0ken-for-the-browser")
            page.click("button[type=submit]")
            page.wait_for_selector("#ready .ok", timeout=20_000)
            assert_safe(page, watch)
        finally:
            page.close()
