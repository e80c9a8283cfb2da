"""The console's JSON API over real HTTP: every endpoint, its bounds, and bad parameters."""

from __future__ import annotations

import asyncio

import orjson
import pytest
from aiohttp import ClientSession, WSMsgType

from taproom.records import BatchBuilder
from tests.support import running_app

from .console_support import send_bus, send_lager, send_logjam, send_lumberjack, write_rollups


async def get_json(http: ClientSession, url: str) -> tuple[int, dict]:
    async with http.get(url) as r:
        return r.status, await r.json()


def batch(*payloads: bytes, protocol: str = "lumberjack", stream: str = "app-prod") -> object:
    builder = BatchBuilder()
    for p in payloads:
        builder.add(protocol, p, stream=stream, topic="logs.app.prod", content_type="json")
    return builder.build()


async def test_overview_and_stats_follow_ingest(tmp_path):
    async with running_app(tmp_path, enable=["lumberjack", "logjam"]) as app:
        base = f"http://{app.addresses['web']}"
        await send_lumberjack(app.addresses["lumberjack"], [{"n": i} for i in range(20)])
        logjam = [{"action": "Home#index", "total_time": 5.0, "pad": "x" * 2000}] * 10
        await asyncio.to_thread(send_logjam, app.addresses["logjam_router"], "shop-prod", logjam)
        async with ClientSession() as http:
            events: dict[str, float] = {}
            nbytes: dict[str, float] = {}
            for _ in range(200):  # the sampler runs once a second
                status, stats = await get_json(http, f"{base}/api/stats?seconds=900")
                assert status == 200
                for protocol in ("lumberjack", "logjam"):
                    events[protocol] = sum(
                        filter(None, stats["series"].get(f"events_in/{protocol}", []))
                    )
                    nbytes[protocol] = sum(
                        filter(None, stats["series"].get(f"bytes_in/{protocol}", []))
                    )
                if all(events.values()) and all(nbytes.values()) and len(events) == 2:
                    break
                await asyncio.sleep(0.1)
            assert events["lumberjack"] > 0 and events["logjam"] > 0, stats["series"].keys()
            # Bytes in are each protocol's own: logjam's ten 2 KB bodies outweigh twenty tiny
            # Lumberjack events, and each protocol's bytes are at least its payloads.
            assert nbytes["logjam"] > nbytes["lumberjack"] > 0
            journal = sum(filter(None, stats["series"]["journal_bytes_in"]))
            assert journal > 0
            assert stats["series"]["journal_end_offset"][-1] == 30
            assert len(stats["t"]) == len(stats["series"]["journal_end_offset"])
            status, overview = await get_json(http, f"{base}/api/overview")
            assert status == 200
            assert overview["ready"] == {"ready": True, "reasons": []}
            assert overview["journal"]["end_offset"] == 30
            assert overview["listeners"]["web"] == app.addresses["web"]
            metrics = await (await http.get(f"{base}/metrics")).text()
        counted = {
            line.split("{")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("taproom_ingest_accepted_bytes_total{")
        }
        # Bytes as journal records: a logjam body of 2000+ bytes makes a record bigger than it.
        assert counted["logjam"] > 10 * 2000 and counted["lumberjack"] > 20 * len('{"n":0}')


async def test_events_record_and_filters(tmp_path):
    async with running_app(tmp_path) as app:
        base = f"http://{app.addresses['web']}"
        await app.hub.ingest(batch(b'{"m":"alpha"}', b'{"m":"beta"}'))
        await app.hub.ingest(batch(b'{"m":"gamma"}', protocol="logtk", stream="other"))
        async with ClientSession() as http:
            _, got = await get_json(http, f"{base}/api/events?from=0")
            assert [e["offset"] for e in got["events"]] == [0, 1, 2] and got["next"] == 3
            _, got = await get_json(http, f"{base}/api/events?from=0&q=beta")
            assert [e["preview"] for e in got["events"]] == ['{"m":"beta"}']
            _, got = await get_json(http, f"{base}/api/events?from=0&protocol=logtk")
            assert [e["stream"] for e in got["events"]] == ["other"]
            _, got = await get_json(http, f"{base}/api/events?from=0&stream=app-prod&limit=1")
            assert [e["offset"] for e in got["events"]] == [0] and got["next"] == 1
            status, record = await get_json(http, f"{base}/api/record?offset=2")
            assert status == 200 and record["payload"] == {"m": "gamma"}
            status, missing = await get_json(http, f"{base}/api/record?offset=99")
            assert status == 404 and missing["error"] == "not_found"


@pytest.mark.parametrize(
    "path",
    [
        "/api/stats?seconds=0",
        "/api/stats?seconds=100000",
        "/api/stats?seconds=1e3",
        "/api/events?limit=0",
        "/api/events?limit=999999999",
        "/api/events?from=-5",
        "/api/events?protocol=smtp",
        "/api/events?q=" + "x" * 300,
        "/api/events?stream=%01",
        "/api/record",
        "/api/record?offset=abc",
        "/api/bus?limit=0",
        "/api/lager/samples?tap=/Not/Registered/",
        "/api/kegs/preview?name=../../etc/passwd",
        "/api/kegs/preview?name=missing.lgr",
        "/api/requests/apps?date=yesterday",
        "/api/requests/day?date=2026-01-02",
        "/api/requests/day?date=2026-1-2&stream=a-b",
        "/api/requests/day?date=2026-01-02&stream=a-b&actions=5000",
        "/api/requests/samples?date=2026-01-02",
        "/api/requests/samples?date=2026-01-02&stream=a-b&minute=x",
        "/api/requests/samples?date=2026-01-02&stream=a-b&limit=0",
        "/api/requests/samples?date=2026-01-02&stream=a-b",
        "/api/requests/errors?stream=a-b",
        "/api/requests/errors?date=2026-01-02&stream=a-b&status=99",
        "/api/exceptions?date=2026-01-02",
        "/api/exceptions?date=2026-01-02&stream=a-b&limit=99999999",
        "/api/requests/find",
        "/api/requests/find?id=" + "x" * 300,
        "/api/requests/find?journal=j&offset=abc",
        "/api/requests/find?id=a&date=today",
        "/api/tail?protocol=nope",
        "/api/tail?from=x",
    ],
)
async def test_bad_parameters_get_400_with_a_reason(tmp_path, path):
    async with running_app(tmp_path) as app:
        async with ClientSession() as http:
            status, body = await get_json(http, f"http://{app.addresses['web']}{path}")
        assert status == 400, body
        assert body["error"] == "bad_request" and body["reason"]
        counted = app.hub.metrics.registry.get_sample_value(
            "taproom_web_requests_calls_total", {"reason": "bad_params"}
        )
        assert counted == 1


async def test_tail_streams_committed_events_and_reports_skips(tmp_path):
    async with running_app(tmp_path, console={"tail_queue_events": 10}) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http, http.ws_connect(f"{base}/api/tail?q=keep") as ws:
            await asyncio.sleep(0.2)  # the page's subscription starts when it connects
            await app.hub.ingest(batch(*[b'{"keep":%d}' % i for i in range(50)], b'{"drop":1}'))
            events, skipped = [], 0
            while len(events) + skipped < 50:
                message = await asyncio.wait_for(ws.receive(), 10)
                assert message.type == WSMsgType.BINARY
                data = orjson.loads(message.data)
                events += data["events"]
                skipped += data["skipped"]
            assert [e["offset"] for e in events] == list(range(10))  # the page's queue: 10
            assert skipped == 40  # never silent: the rest are counted and sent
            assert all("keep" in e["preview"] for e in events)
        counted = app.hub.metrics.registry.get_sample_value(
            "taproom_web_tail_skipped_events_total", {"reason": "page_queue_full"}
        )
        assert counted == 40


async def test_tail_decodes_within_its_budget_and_reports_the_rest(tmp_path):
    async with running_app(tmp_path, console={"tail_events_per_s": 10}) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http, http.ws_connect(f"{base}/api/tail") as ws:
            await asyncio.sleep(0.2)
            await app.hub.ingest(batch(*[b'{"n":%d}' % i for i in range(50)]))
            events, skipped = [], 0
            while len(events) + skipped < 50:
                data = orjson.loads((await asyncio.wait_for(ws.receive(), 10)).data)
                events += data["events"]
                skipped += data["skipped"]
            assert [e["offset"] for e in events] == list(range(10))  # the batch's front
            assert skipped == 40
        counted = app.hub.metrics.registry.get_sample_value(
            "taproom_web_tail_skipped_events_total", {"reason": "decode_budget"}
        )
        assert counted == 40


async def test_tail_from_an_offset_then_live(tmp_path):
    async with running_app(tmp_path) as app:
        await app.hub.ingest(batch(b'{"old":0}', b'{"old":1}', b'{"old":2}'))
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http, http.ws_connect(f"{base}/api/tail?from=1") as ws:
            data = orjson.loads((await asyncio.wait_for(ws.receive(), 10)).data)
            assert [e["offset"] for e in data["events"]] == [1, 2]
            await app.hub.ingest(batch(b'{"new":3}'))
            seen = []
            while 3 not in seen:
                seen += [
                    e["offset"] for e in orjson.loads((await ws.receive(timeout=10)).data)["events"]
                ]
            assert seen == [3]


async def test_tail_refuses_other_origins(tmp_path):
    async with running_app(tmp_path) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http, http.get(
            f"{base}/api/tail",
            headers={"Origin": "http://evil.example", "Upgrade": "websocket",
                     "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
                     "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="},
        ) as r:  # fmt: skip
            assert r.status == 403


async def test_bus_and_lager_pages_read_the_running_services(tmp_path):
    async with running_app(
        tmp_path, enable=["eventbus", "lager"], lager={"hugz_interval_s": 0.2}
    ) as app:
        base = f"http://{app.addresses['web']}"
        await send_bus(app.addresses["eventbus_snapshot"], {"/a/x": {"v": 1}, "/b/y": [1, 2]})
        await asyncio.to_thread(send_lager, app.addresses, "/Robot/Arm/", 30)
        async with ClientSession() as http:
            _, bus = await get_json(http, f"{base}/api/bus?subtree=/a/")
            assert bus["enabled"] and bus["total"] == 1
            (entry,) = bus["entries"]
            assert (
                entry["topic"] == "/a/x" and entry["value"] == '{"v":1}' and entry["sequence"] >= 1
            )
            _, taps = await get_json(http, f"{base}/api/lager/taps")
            (tap,) = taps["taps"]
            assert tap["key"] == "/Robot/Arm/"
            assert [i["name"] for i in tap["items"]] == ["speed", "temp", "label"]
            for _ in range(100):
                _, samples = await get_json(
                    http, f"{base}/api/lager/samples?tap=/Robot/Arm/&after=0"
                )
                if len(samples["t"]) == 30:
                    break
                await asyncio.sleep(0.1)
            assert samples["columns"]["speed"] == [float(i % 50) for i in range(30)]
            assert set(samples["columns"]) == {"speed", "temp"}  # numeric scalars only


async def test_services_absent_read_as_disabled(tmp_path):
    async with running_app(tmp_path) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http:
            assert (await get_json(http, f"{base}/api/bus"))[1]["enabled"] is False
            assert (await get_json(http, f"{base}/api/lager/taps"))[1]["enabled"] is False


async def test_kegs_listing_and_preview(tmp_path):
    kegs = tmp_path / "kegs"
    kegs.mkdir()
    async with running_app(
        tmp_path, enable=["lager"], lager={"hugz_interval_s": 0.2}, console={"kegs": str(kegs)}
    ) as app:
        await asyncio.to_thread(send_lager, app.addresses, "/Robot/Leg/", 25, kegs / "run.lgr")
        (kegs / "broken.lgr").write_bytes(b"xx")
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http:
            _, listing = await get_json(http, f"{base}/api/kegs")
            by_name = {k["name"]: k for k in listing["kegs"]}
            assert by_name["run.lgr"]["rows"] == 25 and by_name["run.lgr"]["taps"] == 1
            assert by_name["run.lgr"]["first_ns"] < by_name["run.lgr"]["last_ns"]
            assert by_name["broken.lgr"]["problem"]
            _, preview = await get_json(http, f"{base}/api/kegs/preview?name=run.lgr&rows=3")
            assert [r["values"]["speed"] for r in preview["rows"]] == [0.0, 1.0, 2.0]


async def test_requests_day_from_rollup_tables(tmp_path):
    rollups = tmp_path / "rollups"
    rows = write_rollups(
        rollups, "2026-01-02", {"shop-prod": 50_000, "blog-dev": 1000}, actions=5, minutes=60
    )
    assert rows > 0
    async with running_app(tmp_path, console={"rollups": str(rollups)}) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http:
            _, apps = await get_json(http, f"{base}/api/requests/apps")
            assert apps["dates"] == ["2026-01-02"] and apps["date"] == "2026-01-02"
            assert apps["streams"] == [
                {"stream": "shop-prod", "requests": 50_000},
                {"stream": "blog-dev", "requests": 1000},
            ]
            status, day = await get_json(
                http, f"{base}/api/requests/day?date=2026-01-02&stream=shop-prod&actions=3"
            )
            assert status == 200
            assert sum(day["requests"]) == 50_000 and len(day["minutes"]) == 60
            assert all(p50 <= p99 for p50, p99 in zip(day["p50"], day["p99"], strict=True))
            assert sum(map(sum, day["heatmap"]["counts"])) == 50_000
            assert len(day["actions"]) == 3 and day["action_count"] == 5
            shares = [a["share"] for a in day["actions"]]
            assert shares == sorted(shares, reverse=True)
            top = day["actions"][0]
            assert set(top["breakdown"]) == {"db_time", "view_time", "api_time", "other_time"}
            assert "gc_time" not in top["breakdown"]  # part of the others' time, as in logjam
            assert top["breakdown"]["db_time"] == pytest.approx(0.4 * top["time_sum"], rel=1e-3)
            _, other = await get_json(http, f"{base}/api/requests/day?date=2026-01-03&stream=x-y")
            assert other["minutes"] == [] and other["actions"] == []
            # A rewritten day (a re-run of the job) is read again, not served from the cache.
            write_rollups(rollups, "2026-01-02", {"shop-prod": 60_000}, actions=5, minutes=60)
            _, again = await get_json(
                http, f"{base}/api/requests/day?date=2026-01-02&stream=shop-prod&actions=3"
            )
            assert sum(again["requests"]) == 60_000


async def test_drilldown_without_tables_answers_empty_or_not_found(tmp_path):
    """No rollup run yet: the drill-down endpoints answer empty, a lookup 404 with a reason."""
    async with running_app(tmp_path, console={"rollups": str(tmp_path / "none")}) as app:
        base = f"http://{app.addresses['web']}"
        day = "date=2026-01-02&stream=shop-prod"
        async with ClientSession() as http:
            status, samples = await get_json(http, f"{base}/api/requests/samples?{day}&minute=60")
            assert status == 200 and samples["slow"] == samples["failed"] == []
            status, errors = await get_json(http, f"{base}/api/requests/errors?{day}")
            assert status == 200 and errors["requests"] == [] and errors["failed_count"] == 0
            status, exceptions = await get_json(http, f"{base}/api/exceptions?{day}")
            assert status == 200 and exceptions["classes"] == []
            status, missing = await get_json(http, f"{base}/api/requests/find?id=abc")
            assert status == 404 and missing["error"] == "not_found"
            # A place in this hub's journal that holds no logjam request.
            await app.hub.ingest(batch(b'{"m":1}'))
            journal = app.hub.journal.id
            status, other = await get_json(
                http, f"{base}/api/requests/find?journal={journal}&offset=0"
            )
            assert status == 404 and "not a logjam request" in other["reason"]


def test_a_hub_loads_pyarrow_only_when_the_requests_page_is_read(tmp_path):
    """pyarrow (with pandas) adds ~95 MB to a hub's RSS, which counts against the memory bound
    (issue 19's 2 x max_pending_bytes + 100 MB): a hub pays for it only once somebody reads the
    Requests page."""
    import subprocess
    import sys

    script = f"""
import asyncio, pathlib, sys, urllib.request
from tests.support import running_app
async def main():
    async with running_app(pathlib.Path({str(tmp_path)!r}),
                           enable=["lumberjack", "logtk", "logjam", "eventbus", "lager"]) as app:
        before = "pyarrow" in sys.modules
        url = f"http://{{app.addresses['web']}}/api/requests/apps"
        await asyncio.to_thread(lambda: urllib.request.urlopen(url).read())
        print(before, "pyarrow" in sys.modules)
asyncio.run(main())
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "True"], out.stderr
