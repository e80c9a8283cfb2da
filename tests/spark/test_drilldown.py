"""From a chart to the one request behind it, end to end (issue 30).

Two hub processes (a fleet of two): real logjam agents send known requests (slow ones, 500s,
exceptions, log lines with severities, backtraces): taproom's own agent (DEALER, sync) to hub
A, a Ruby-shaped DEALER (skaes/logjam_agent's ZMQForwarder, gzip bodies) to hub B. The batch
rollup (the session's SparkSession) reads both journals into hub A's ``[console] rollups``;
hub A's ``[console] hubs`` names hub B for B's journal id. Then the console's API must return
exactly the slow and failed requests and exceptions that were sent, find each request by its
id (A's from A's journal, B's from hub B), and Chromium must go from a chart point to the
Request page, with script in action names, lines and backtraces staying text.
"""

from __future__ import annotations

import datetime as dt
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from taproom.spark.jobs.rollup import run_rollup
from taproom.spark.settings import SparkSettings
from tests.hubprocess import HubProcess
from tests.servers.test_logjam_device import RubyStyleAgent
from tests.support import write_config
from tests.web.console_support import send_logjam

pytestmark = pytest.mark.spark

XSS_ACTION = '"><img src=x onerror="window.__pwned=1">#<script>window.__pwned=1</script>'
XSS_LINE = '<script>window.__pwned=1</script> "><img src=x onerror=window.__pwned=1>'
XSS_TRACE = "<img src=x onerror=window.__pwned=1>\n  app/models/order.rb:12:in `<script>find'"
STREAM = "shop-production"
MINUTE = dt.datetime(2026, 11, 23, 10, 15, tzinfo=dt.UTC)
DATE = MINUTE.date().isoformat()
SLOW, FAILED = 2, 3  # [spark] slow_requests_per_action, failed_requests_per_action


def v1_id(at: dt.datetime, n: int) -> str:
    """A version 1 UUID of time ``at`` as logjam_agent sends it (hex, no dashes)."""
    ticks = int(at.timestamp() * 1e7) + 0x01B21DD213814000
    fields = (ticks & 0xFFFFFFFF, (ticks >> 32) & 0xFFFF, (ticks >> 48) & 0x0FFF | 0x1000,
              0x80 | (n >> 8 & 0x3F), n & 0xFF, 0x00163E5E6C00 + n)  # fmt: skip
    return uuid.UUID(fields=fields).hex


def request(n: int, second: float, action: str, total: float, code: int, **more: Any) -> dict:
    started = MINUTE + dt.timedelta(seconds=second)
    doc = {
        "request_id": more.pop("request_id", None) or v1_id(started, n),
        "action": action,
        "started_at": started.isoformat(timespec="milliseconds"),
        "total_time": total,
        "code": code,
        "host": f"web-{n}",
        "lines": [[1, started.isoformat(), f"Started request {n}"]],
        "db_time": total * 0.5,
        "view_time": total * 0.25,
    }
    doc.update(more)
    return doc


A1, A2 = XSS_ACTION, "Carts#update"
# name -> (hub, document). On hub A unless marked "B".
REQUESTS = {
    "r1": ("A", request(1, 10, A1, 900.0, 200)),
    "r2": ("A", request(2, 11, A1, 700.0, 200)),
    "r3": ("A", request(3, 12, A1, 5.0, 200, request_id="plain-id-r3")),
    "r4": (
        "A",
        request(
            4,
            1,
            A1,
            20.0,
            500,
            exceptions=["ActiveRecord::RecordNotFound"],
            lines=[
                [1, "2026-11-23T10:15:01", XSS_LINE],
                [
                    3,
                    "2026-11-23T10:15:01",
                    "ActiveRecord::RecordNotFound (no order):\n" + XSS_TRACE,
                ],
            ],
        ),
    ),
    "r5": ("A", request(5, 2, A1, 30.0, 200, lines=[[3, "2026-11-23T10:15:02", "cache down"]])),
    "r6": ("A", request(6, 3, A1, 10.0, 503)),
    "r7": ("A", request(7, 4, A1, 8.0, 200, exceptions=["Timeout::Error"])),
    "r8": ("A", request(8, 20, A2, 50.0, 200)),
    "r9": ("A", request(9, 65, A2, 40.0, 500, exceptions=["Timeout::Error"])),
    "r10": (
        "B",
        request(
            10,
            0.5,
            A1,
            1200.0,
            500,
            exceptions=["NoMethodError"],
            lines=[[4, "2026-11-23T10:15:01", "NoMethodError (undefined method):\n  a.rb:1"]],
        ),
    ),
}


def rid(name: str) -> str:
    return REQUESTS[name][1]["request_id"]


@pytest.fixture(scope="module")
def fleet(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("drilldown")
    (root / "b").mkdir()
    (root / "a").mkdir()
    hub_b = HubProcess(write_config(root / "b", enable=["logjam"])).start()
    try:
        # Hub A's config names hub B by its journal id: B had to start first to have one.
        hubs = {hub_b.journal_id: hub_b.addresses["web"]}
        hub_a = HubProcess(
            write_config(
                root / "a",
                enable=["logjam"],
                console={"rollups": str(root / "rollups"), "hubs": hubs},
                # The console merges the job's parts with the bounds it ran with: the same
                # [spark] section (docs/spark.md, the drill-down tables per segment).
                spark={"slow_requests_per_action": SLOW, "failed_requests_per_action": FAILED},
            )
        ).start()
        try:
            on_a = [doc for hub, doc in REQUESTS.values() if hub == "A"]
            send_logjam(hub_a.addresses["logjam_router"], STREAM, on_a)
            ruby = RubyStyleAgent(f"tcp://{hub_b.addresses['logjam_router']}", "shop", "production")
            try:
                for hub, doc in REQUESTS.values():
                    if hub == "B":
                        assert ruby.forward(doc) == b"202 Accepted"
            finally:
                ruby.close()
            run_rollup(
                spark,
                [str(root / "a" / "journal"), str(root / "b" / "journal")],
                str(root / "rollups"),
                progress=False,
                settings=SparkSettings(
                    slow_requests_per_action=SLOW, failed_requests_per_action=FAILED
                ),
            )
            yield {"a": hub_a, "b": hub_b, "root": root}
        finally:
            hub_a.stop()
    finally:
        hub_b.stop()


def get(hub: HubProcess, path: str, **query: Any) -> tuple[int, Any]:
    import urllib.error
    import urllib.parse
    import urllib.request

    url = f"http://{hub.addresses['web']}{path}?{urllib.parse.urlencode(query)}"
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status, orjson.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, orjson.loads(exc.read())


NAME_OF = {doc["request_id"]: name for name, (_, doc) in REQUESTS.items()}


def ids(rows: list[dict[str, Any]]) -> list[str]:
    return [NAME_OF[r["request_id"]] for r in rows]


def test_api_returns_exactly_the_slow_and_failed_requests(fleet: dict[str, Any]) -> None:
    a = fleet["a"]
    minute = int(MINUTE.timestamp())
    status, one = get(a, "/api/requests/samples", stream=STREAM, date=DATE, minute=minute,
                      action=A1)  # fmt: skip
    assert status == 200, one
    # The two slowest of the minute and action (r10 came through hub B), slowest first.
    assert ids(one["slow"]) == ["r10", "r1"]
    # The first three failed by start time; r6 and r7 failed too but were not kept.
    assert ids(one["failed"]) == ["r10", "r4", "r5"]
    assert (one["failed_count"], one["failed_kept"]) == (5, 3)
    r4 = next(r for r in one["failed"] if r["request_id"] == rid("r4"))
    assert (r4["code"], r4["total_time"], r4["host"], r4["exceptions"]) == (
        500, 20.0, "web-4", ["ActiveRecord::RecordNotFound"],
    )  # fmt: skip
    assert r4["times"] == {"db_time": 10.0, "view_time": 5.0}
    assert r4["journal"] == a.journal_id and r4["failed"] and not r4["slow"]
    assert next(r for r in one["slow"] if r["request_id"] == rid("r10"))["journal"] == (
        fleet["b"].journal_id
    )
    # The whole minute: every action's slowest; the whole day of an action: its minutes'.
    _, whole_minute = get(a, "/api/requests/samples", stream=STREAM, date=DATE, minute=minute)
    assert ids(whole_minute["slow"]) == ["r10", "r1", "r8"]
    _, action_day = get(a, "/api/requests/samples", stream=STREAM, date=DATE, action=A2)
    assert ids(action_day["slow"]) == ["r8", "r9"] and ids(action_day["failed"]) == ["r9"]

    # Errors: the failed requests of the day, newest first; filters; the overflow counted.
    _, errors = get(a, "/api/requests/errors", stream=STREAM, date=DATE)
    assert ids(errors["requests"]) == ["r9", "r5", "r4", "r10"]
    assert (errors["failed_count"], errors["failed_kept"]) == (6, 4)
    assert dict(map(tuple, errors["facets"]["statuses"])) == {200: 1, 500: 3}
    assert dict(map(tuple, errors["facets"]["exceptions"])) == {
        "ActiveRecord::RecordNotFound": 1, "NoMethodError": 1, "Timeout::Error": 1,
    }  # fmt: skip
    _, by_status = get(a, "/api/requests/errors", stream=STREAM, date=DATE, status=500)
    assert ids(by_status["requests"]) == ["r9", "r4", "r10"]
    _, by_class = get(a, "/api/requests/errors", stream=STREAM, date=DATE,
                      exception="Timeout::Error", action=A2)  # fmt: skip
    assert ids(by_class["requests"]) == ["r9"] and by_class["matched"] == 1

    # Exceptions: classes by count, samples pointing at the requests, a count per minute.
    status, exceptions = get(a, "/api/exceptions", stream=STREAM, date=DATE)
    assert status == 200
    classes = {c["exception"]: c for c in exceptions["classes"]}
    assert {k: c["count"] for k, c in classes.items()} == {
        "Timeout::Error": 2, "ActiveRecord::RecordNotFound": 1, "NoMethodError": 1,
    }  # fmt: skip
    assert exceptions["classes"][0]["exception"] == "Timeout::Error"
    assert {s["request_id"] for s in classes["Timeout::Error"]["samples"]} == {rid("r7"), rid("r9")}
    assert exceptions["minutes"] == [minute, minute + 60]
    assert classes["Timeout::Error"]["series"] == [1, 1]
    assert dict(map(tuple, classes["Timeout::Error"]["actions"])) == {A1: 1, A2: 1}


def test_browser_from_a_chart_point_to_the_request_page(
    fleet: dict[str, Any], tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    from tests.web.console_support import close_chromium, launch_chromium
    from tests.web.test_browser import PageWatch, assert_safe, wait_until

    base = f"http://{fleet['a'].addresses['web']}"
    with sync_playwright() as playwright:
        context, _, profile = launch_chromium(playwright)
        try:
            page = context.new_page()
            watch = PageWatch(page)
            page.goto(f"{base}/requests?date={DATE}&stream={STREAM}")
            page.wait_for_selector("#actions tbody tr", timeout=30_000)
            # The chart's first minute (of two): a click near the left edge picks it.
            over = page.locator(".u-over").first
            box = over.bounding_box()
            assert box is not None
            over.click(position={"x": box["width"] * 0.1, "y": box["height"] / 2})
            wait_until(page, "document.querySelectorAll('#failed tbody tr').length === 3")
            assert "10:15" in page.inner_text("#drill-title")
            slow = page.inner_text("#slow")
            assert all(rid(n) in slow for n in ("r10", "r1", "r8")) and rid("r2") not in slow
            assert XSS_ACTION in slow
            assert "2 not kept" in page.inner_text("#drill-note")
            page.screenshot(path=str(tmp_path / "drill.png"), full_page=True)
            # Open the failed request with script in its lines and backtrace.
            page.click(f"#failed a:has-text('{rid('r4')}')")
            page.wait_for_selector("#request:not([hidden])", timeout=30_000)
            assert page.inner_text("#r-action") == XSS_ACTION
            assert page.inner_text("#r-code") == "500"
            lines = page.inner_text("#lines")
            assert XSS_LINE in lines and "error" in lines
            assert XSS_TRACE in page.inner_text("#backtraces")
            assert page.locator("#timebar .segment").count() == 3  # db, view, unaccounted
            assert "this hub" in page.inner_text("#facts")
            page.screenshot(path=str(tmp_path / "request.png"), full_page=True)
            assert_safe(page, watch)
            # The search box on every page: a request stored on hub B.
            page.fill("header input[name=id]", rid("r10"))
            page.click("header form.search button")
            page.wait_for_selector("#request:not([hidden])", timeout=30_000)
            assert f"hub {fleet['b'].addresses['web']}" in page.inner_text("#facts")
            # Exceptions -> a class -> its failed requests on the Errors page.
            page.goto(f"{base}/exceptions?date={DATE}&stream={STREAM}")
            wait_until(page, "document.querySelectorAll('#classes tbody tr').length === 3")
            page.screenshot(path=str(tmp_path / "exceptions.png"), full_page=True)
            page.click("#classes a:has-text('Timeout::Error')")
            wait_until(page, "document.querySelectorAll('#errors tbody tr').length === 1")
            assert page.input_value("#exception") == "Timeout::Error"
            assert rid("r9") in page.inner_text("#errors")
            page.select_option("#exception", "")
            wait_until(page, "document.querySelectorAll('#errors tbody tr').length === 4")
            assert XSS_ACTION in page.inner_text("#errors")
            page.screenshot(path=str(tmp_path / "errors.png"), full_page=True)
            assert_safe(page, watch)
        finally:
            close_chromium(context, profile)


def test_find_a_request_by_id_here_and_on_the_fleet_hub(fleet: dict[str, Any]) -> None:
    a, b = fleet["a"], fleet["b"]
    status, r4 = get(a, "/api/requests/find", id=rid("r4"))
    assert status == 200, r4
    assert (r4["hub"], r4["journal"], r4["action"], r4["code"]) == ("local", a.journal_id, A1, 500)
    assert r4["stream"] == STREAM and r4["date"] == DATE and r4["request_id"] == rid("r4")
    assert [(line["level"], line["message"]) for line in r4["lines"]] == [
        ("info", XSS_LINE), ("error", "ActiveRecord::RecordNotFound (no order):\n" + XSS_TRACE),
    ]  # fmt: skip
    assert r4["backtraces"] == [
        {"n": 1, "exception": "ActiveRecord::RecordNotFound", "text": r4["lines"][1]["message"]}
    ]
    assert r4["times"] == {"db_time": 10.0, "view_time": 5.0}
    assert r4["unaccounted_time"] == 5.0 and r4["severity"] == 3
    assert r4["fields"]["host"] == "web-4" and "lines" not in r4["fields"]

    # Stored on hub B: read from B over its read API, as hub A's [console] hubs says.
    status, r10 = get(a, "/api/requests/find", id=rid("r10"))
    assert status == 200, r10
    assert (r10["hub"], r10["journal"]) == (b.addresses["web"], b.journal_id)
    assert r10["exceptions"] == ["NoMethodError"] and r10["level"] == "fatal"
    assert r10["backtraces"][0]["exception"] == "NoMethodError"

    # An id that is no version 1 UUID is found by reading the newest dates' index.
    status, r3 = get(a, "/api/requests/find", id="plain-id-r3")
    assert status == 200 and r3["total_time"] == 5.0
    # By its place (a drill-down row): the id must match what is stored there.
    status, by_place = get(a, "/api/requests/find", journal=a.journal_id, offset=r4["offset"])
    assert status == 200 and by_place["request_id"] == rid("r4")
    status, checked = get(a, "/api/requests/find", id=rid("r1"), journal=a.journal_id,
                          offset=r4["offset"])  # fmt: skip
    assert status == 200 and checked["request_id"] == rid("r1")  # the index, not the hint

    status, missing = get(a, "/api/requests/find", id=v1_id(MINUTE, 999))
    assert status == 404 and missing["error"] == "not_found"
    status, foreign = get(a, "/api/requests/find", journal=str(uuid.uuid4()), offset=0)
    assert status == 404 and "[console] hubs" in foreign["reason"]
    for bad in ({}, {"id": "x" * 300}, {"id": "a\x01"}, {"journal": "j", "offset": "-1"}):
        status, body = get(a, "/api/requests/find", **bad)
        assert status == 400 and body["error"] == "bad_request", bad

    # Hub B gone: its requests are unavailable (502), never wrong.
    b.stop()
    status, gone = get(a, "/api/requests/find", id=rid("r10"))
    assert status == 502 and gone["error"] == "hub_unavailable", gone
    import urllib.request

    with urllib.request.urlopen(f"http://{a.addresses['web']}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    counted = {
        kind: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("taproom_web_request_lookups_calls_total{")
        for kind in [line.split('"')[1]]
    }
    assert counted["fleet"] >= 1 and counted["local"] >= 4
    assert counted["not_found"] >= 2 and counted["hub_unavailable"] == 1
