"""The console: five static pages and the JSON API under ``/api/`` they (and scripts) use.

Pages are plain HTML (``static/pages/<name>.html`` inside ``static/shell.html``, put together
once at start) with their own scripts (no inline script: the CSP forbids it); every
value a page shows is inserted as text, never as markup. The API is read-only, every parameter
bounded (:mod:`.params`); anything that touches files (journal scans, kegs, Parquet) runs in a
worker thread so the event loop keeps serving ingest. The routes are listed in docs/console.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from string import Template
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import WSMsgType, web

from ..records import Record
from . import kegs, params, services
from .stats import StatsRing
from .tail import TailClient, TailFilter, TailHub, event_json

if TYPE_CHECKING:
    from .rollups import Rollups
    from .server import WebServer

__all__ = ["add_routes"]

# path -> (page name: static/pages/<name>.html and static/<name>.js, title)
PAGES = {
    "/": ("overview", "Overview"),
    "/tail": ("tail", "Live tail"),
    "/requests": ("requests", "Requests"),
    "/telemetry": ("telemetry", "Telemetry"),
    "/bus": ("bus", "Event BUS"),
}
PROTOCOLS = ("", "lumberjack", "logtk", "logjam", "eventbus", "lager")
SCAN_LIMIT = 50_000  # records one journal scan of an API call may decode
TAIL_INTERVAL_S = 0.2  # a page gets at most five messages a second
TAIL_MESSAGE_EVENTS = 500


def json_response(value: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=orjson.dumps(value, option=orjson.OPT_SERIALIZE_NUMPY, default=str),
        status=status,
        content_type="application/json",
    )


def _filter(request: web.Request) -> TailFilter:
    protocol = request.query.get("protocol", "")
    if protocol not in PROTOCOLS:
        raise params.bad_request(f"protocol must be one of {', '.join(PROTOCOLS[1:])}")
    return TailFilter(
        protocol=protocol,
        stream=params.text(request, "stream"),
        topic=params.text(request, "topic"),
        text=params.text(request, "q").encode(),
    )


def _same_origin(request: web.Request) -> bool:
    """A WebSocket opened by another site's page carries its Origin: refuse it."""
    origin = request.headers.get("Origin")
    return origin is None or origin.split("://", 1)[-1] == request.host


class Console:
    """The state behind the API: the stats ring, the live tail, the keg index."""

    def __init__(self, server: WebServer) -> None:
        self.server = server
        self.hub = server.hub
        config = server.console
        self.max_rows = config.max_rows
        self.stats = StatsRing(
            server.hub, config.stats_seconds, lambda: {"web_connections": server.open_connections}
        )
        self.tail = TailHub(server.hub, config.tail_events_per_s, config.max_tail_clients)
        self.kegs = kegs.KegIndex(config.kegs)
        self._rollups: Rollups | None = None

    @property
    def rollups(self) -> Rollups:
        # pyarrow (and the pandas it pulls in) costs ~95 MB of RSS: a hub loads it only when
        # somebody opens the Requests page, not at start.
        if self._rollups is None:
            from .rollups import Rollups

            self._rollups = Rollups(self.server.console.rollups)
        return self._rollups

    async def start(self, app: web.Application) -> None:
        self.stats.start()

    async def stop(self) -> None:
        await self.tail.stop()
        await self.stats.stop()

    # --- overview ----------------------------------------------------------------------

    async def overview(self, request: web.Request) -> web.Response:
        reasons = self.server.readiness()
        journal = self.hub.journal
        return json_response(
            {
                "time": time.time(),
                "name": self.hub.config.hub.name,
                "ready": {"ready": not reasons, "reasons": reasons},
                "listeners": dict(self.server.addresses),
                "services": sorted(self.server.services),
                "journal": {
                    "id": journal.id,
                    "first_offset": journal.first_offset,
                    "end_offset": journal.end_offset,
                },
                "latest": self.stats.latest(),
            }
        )

    async def stats_series(self, request: web.Request) -> web.Response:
        seconds = params.integer(
            request, "seconds", self.server.console.stats_seconds, 1,
            self.server.console.stats_seconds,
        )  # fmt: skip
        return json_response(self.stats.series(seconds))

    # --- events ------------------------------------------------------------------------

    async def events(self, request: web.Request) -> web.Response:
        """Committed events from an offset, filtered: the tail without a WebSocket."""
        tail_filter = _filter(request)
        journal = self.hub.journal
        limit = params.integer(request, "limit", 100, 1, self.max_rows)
        start = params.integer(request, "from", max(0, journal.end_offset - limit), 0, 2**62)

        def scan() -> tuple[list[dict[str, Any]], int]:
            rows: list[dict[str, Any]] = []
            next_offset = max(start, journal.first_offset)
            for scanned, record in enumerate(journal.read(next_offset), start=1):
                next_offset = record.offset + 1
                if tail_filter.matches(record):
                    rows.append(event_json(record))
                if len(rows) >= limit or scanned >= SCAN_LIMIT:
                    break
            return rows, next_offset

        rows, next_offset = await asyncio.to_thread(scan)
        return json_response({"events": rows, "next": next_offset})

    async def record(self, request: web.Request) -> web.Response:
        offset = params.integer(request, "offset", -1, 0, 2**62)
        if offset < 0:
            raise params.bad_request("offset is required")
        journal = self.hub.journal

        def find() -> Record | None:
            for record in journal.read(offset, offset + 1):
                return record
            return None

        record = await asyncio.to_thread(find)
        if record is None:
            return json_response({"error": "not_found", "reason": "no such offset"}, 404)
        view = record.to_json_dict()
        if record.protocol == "lager" and "payload" in view:
            fmt = services.lager_format(self.server.services, record.stream)
            if fmt is not None and len(record.payload) == fmt.row_size:
                view["payload"] = fmt.decode_row(record.payload)
        return json_response(view)

    async def tail_socket(self, request: web.Request) -> web.StreamResponse:
        tail_filter = _filter(request)
        start = params.integer(request, "from", -1, -1, 2**62)
        if not _same_origin(request):
            raise web.HTTPForbidden(text="cross-origin WebSocket refused")
        if self.tail.full:
            return json_response({"error": "busy", "reason": "too many live-tail pages"}, 503)
        ws = web.WebSocketResponse(heartbeat=20, max_msg_size=4096)
        await ws.prepare(request)
        client = TailClient(
            tail_filter,
            self.server.console.tail_queue_events,
            self.hub.budget.holder("console_tail"),
        )
        self.tail.add(client)
        sender = asyncio.get_running_loop().create_task(self._send_tail(ws, client))
        try:
            if start >= 0:
                await self.tail.backlog(client, start)
            async for message in ws:  # the page sends nothing; this notices its close
                if message.type == WSMsgType.ERROR:
                    break
        finally:
            self.tail.remove(client)
            sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sender
        return ws

    async def _send_tail(self, ws: web.WebSocketResponse, client: TailClient) -> None:
        journal = self.hub.journal
        while not ws.closed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(client.wakeup.wait(), 2.0)
            rows, skipped = client.take(TAIL_MESSAGE_EVENTS)
            message = {
                "events": rows,
                "skipped": skipped,
                "end_offset": journal.end_offset,
            }
            try:
                await asyncio.wait_for(ws.send_bytes(orjson.dumps(message)), 10)
            except (TimeoutError, ConnectionError):
                await ws.close()
                return
            await asyncio.sleep(TAIL_INTERVAL_S)

    # --- Event BUS, Lager, kegs --------------------------------------------------------

    async def bus(self, request: web.Request) -> web.Response:
        subtree = params.text(request, "subtree")
        limit = params.integer(request, "limit", 1000, 1, self.max_rows)
        found = services.bus_entries(self.server.services, subtree, limit)
        if found is None:
            return json_response({"enabled": False, "entries": [], "total": 0})
        entries, total = found
        return json_response({"enabled": True, "entries": entries, "total": total})

    async def lager_taps(self, request: web.Request) -> web.Response:
        taps = services.lager_taps(self.server.services)
        return json_response({"enabled": taps is not None, "taps": taps or []})

    async def lager_samples(self, request: web.Request) -> web.Response:
        """Decoded numeric rows of one tap from the journal (the forwarder's committed data)."""
        key = params.text(request, "tap")
        fmt = services.lager_format(self.server.services, key)
        if fmt is None:
            raise params.bad_request("tap is not registered")
        limit = params.integer(request, "limit", 1000, 1, self.max_rows)
        journal = self.hub.journal
        # Without ``after``: the tap's latest rows among the last SCAN_LIMIT records.
        latest = "after" not in request.query
        after = params.integer(request, "after", max(0, journal.end_offset - SCAN_LIMIT), 0, 2**62)
        numeric = [i.name for i in fmt.items if i.type.name != "string" and i.count == 1]

        def scan() -> dict[str, Any]:
            rows: deque[tuple[int, dict[str, Any]]] = deque(maxlen=limit)
            next_offset = max(after, journal.first_offset)
            for scanned, record in enumerate(journal.read(next_offset), start=1):
                next_offset = record.offset + 1
                if (
                    record.protocol == "lager"
                    and record.stream == key
                    and len(record.payload) == fmt.row_size
                ):
                    rows.append((record.ts_ns // 1_000_000, fmt.decode_row(record.payload)))
                if (len(rows) >= limit and not latest) or scanned >= SCAN_LIMIT:
                    break
            return {
                "t": [t for t, _ in rows],
                "columns": {name: [row[name] for _, row in rows] for name in numeric},
                "next": next_offset,
            }

        return json_response(await asyncio.to_thread(scan))

    async def keg_list(self, request: web.Request) -> web.Response:
        return json_response(await asyncio.to_thread(self.kegs.listing))

    async def keg_preview(self, request: web.Request) -> web.Response:
        name = params.text(request, "name")
        rows = params.integer(request, "rows", 20, 1, 200)
        try:
            preview = await asyncio.to_thread(self.kegs.preview, name, rows)
        except kegs.UnknownKeg as exc:
            raise params.bad_request(str(exc)) from None
        return json_response(preview)

    # --- requests (logjam rollups) -----------------------------------------------------

    async def request_apps(self, request: web.Request) -> web.Response:
        date = params.date(request)
        return json_response(await asyncio.to_thread(self.rollups.apps, date))

    async def request_day(self, request: web.Request) -> web.Response:
        date = params.date(request)
        app_env = params.text(request, "stream")
        if not date or not app_env:
            raise params.bad_request("date and stream (app-env) are required")
        limit = params.integer(request, "actions", 50, 1, 1000)
        return json_response(await asyncio.to_thread(self.rollups.day, app_env, date, limit))


def add_routes(app: web.Application, server: WebServer) -> None:
    console = Console(server)
    app.on_startup.append(console.start)
    server.on_stop(console.stop)
    static = server.static_dir
    shell = Template((static / "shell.html").read_text(encoding="utf-8"))

    def page(name: str, title: str) -> Any:
        # Built once from the package's own files (no request data): the shared head, nav
        # and scripts around the page's main content.
        html = shell.substitute(
            name=name, title=title, main=(static / "pages" / f"{name}.html").read_text("utf-8")
        ).encode()

        async def handler(request: web.Request) -> web.Response:
            return web.Response(body=html, content_type="text/html", charset="utf-8")

        return handler

    for path, (name, title) in PAGES.items():
        app.router.add_get(path, page(name, title))
    app.router.add_static("/static/", static, follow_symlinks=False, show_index=False)
    routes = {
        "/api/overview": console.overview,
        "/api/stats": console.stats_series,
        "/api/events": console.events,
        "/api/record": console.record,
        "/api/tail": console.tail_socket,
        "/api/bus": console.bus,
        "/api/lager/taps": console.lager_taps,
        "/api/lager/samples": console.lager_samples,
        "/api/kegs": console.keg_list,
        "/api/kegs/preview": console.keg_preview,
        "/api/requests/apps": console.request_apps,
        "/api/requests/day": console.request_day,
    }
    for path, handler in routes.items():
        app.router.add_get(path, handler)
