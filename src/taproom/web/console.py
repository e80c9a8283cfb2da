"""The console: its static pages and the JSON API under ``/api/`` they (and scripts) use.

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
    from .drilldown import Drilldown
    from .requestindex import RequestIndex
    from .requestview import RequestSource
    from .rollups import Rollups
    from .server import WebServer
    from .tables import TableFiles

__all__ = ["add_routes"]

# path -> (page name: static/pages/<name>.html and static/<name>.js, title)
PAGES = {
    "/": ("overview", "Overview"),
    "/tail": ("tail", "Live tail"),
    "/requests": ("requests", "Requests"),
    "/errors": ("errors", "Errors"),
    "/exceptions": ("exceptions", "Exceptions"),
    "/request": ("request", "Request"),
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
        self._tables: TableFiles | None = None
        self._rollups: Rollups | None = None
        self._drilldown: Drilldown | None = None
        self._index: RequestIndex | None = None
        self._source: RequestSource | None = None
        self._m_lookups = server.hub.metrics.counter(
            "web",
            "request_lookups",
            "calls",
            "Request pages asked for (/api/requests/find), by how they ended: local, fleet "
            "(read from another hub), not_found, hub_unavailable, gone (retention deleted it)",
            ("kind",),
        )

    # pyarrow (and the pandas it pulls in) costs ~95 MB of RSS: a hub loads it only when
    # somebody opens a page of the rollup tables, not at start.

    @property
    def tables(self) -> TableFiles:
        if self._tables is None:
            from .tables import TableFiles

            self._tables = TableFiles(self.server.console.rollups)
        return self._tables

    @property
    def rollups(self) -> Rollups:
        if self._rollups is None:
            from .rollups import Rollups

            self._rollups = Rollups(self.tables)
        return self._rollups

    @property
    def drilldown(self) -> Drilldown:
        if self._drilldown is None:
            from .drilldown import Drilldown

            # The bounds the rollup kept per group are those the drill-down merges parts to:
            # the hub's configuration file is the one the jobs read ([spark]).
            config = self.hub.config
            spark = config.section("spark") if "spark" in config.names else None
            self._drilldown = Drilldown(self.tables, spark)
        return self._drilldown

    @property
    def index(self) -> RequestIndex:
        if self._index is None:
            from .requestindex import RequestIndex

            self._index = RequestIndex(self.tables, self.server.console.find_dates)
        return self._index

    @property
    def source(self) -> RequestSource:
        if self._source is None:
            from .requestview import RequestSource

            config = self.server.console
            token = config.hubs_token or self.server.config.token
            self._source = RequestSource(self.hub.journal, config.hubs, token, config.hub_timeout_s)
        return self._source

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

    # --- the drill-down: from a chart to the one request ---------------------------------

    def _stream_date(self, request: web.Request) -> tuple[str, str]:
        date = params.date(request)
        app_env = params.text(request, "stream")
        if not date or not app_env:
            raise params.bad_request("date and stream (app-env) are required")
        return app_env, date

    async def request_samples(self, request: web.Request) -> web.Response:
        """The slow and failed requests of a minute and/or an action of one app-env's day."""
        app_env, date = self._stream_date(request)
        minute = params.integer(request, "minute", -1, 0, 2**40)
        action = params.text(request, "action")
        limit = params.integer(request, "limit", 100, 1, self.max_rows)
        if minute < 0 and not action:
            # A minute (every action's) or an action (every minute's) bounds what is read.
            raise params.bad_request("minute or action is required")
        minute_ms = (minute - minute % 60) * 1000 if minute >= 0 else None
        return json_response(
            await asyncio.to_thread(self.drilldown.samples, app_env, date, minute_ms, action, limit)
        )

    async def request_errors(self, request: web.Request) -> web.Response:
        """The failed requests of one app-env's day, filtered by action, status, exception."""
        app_env, date = self._stream_date(request)
        action = params.text(request, "action")
        status = params.integer(request, "status", -1, 100, 999)
        exception = params.text(request, "exception")
        limit = params.integer(request, "limit", 500, 1, self.max_rows)
        return json_response(
            await asyncio.to_thread(
                lambda: self.drilldown.errors(
                    app_env, date, action=action, status=None if status < 0 else status,
                    exception=exception, limit=limit,
                )
            )
        )  # fmt: skip

    async def exceptions(self, request: web.Request) -> web.Response:
        """Exception classes of one app-env's day by count, with samples and minutes."""
        app_env, date = self._stream_date(request)
        limit = params.integer(request, "limit", 100, 1, self.max_rows)
        return json_response(
            await asyncio.to_thread(self.drilldown.exceptions, app_env, date, limit)
        )

    async def find_request(self, request: web.Request) -> web.Response:
        """One request whole, by its id (the request-id index says where it is stored), or
        by ``journal`` and ``offset`` (a row of the drill-down tables; checked against the id
        when both are given)."""
        from .requestview import LookupFailed, request_view

        request_id = params.text(request, "id")
        date = params.date(request)
        journal = params.text(request, "journal", 64)
        offset = params.integer(request, "offset", -1, 0, 2**62)
        if not request_id and not (journal and offset >= 0):
            raise params.bad_request("id (a request id), or journal and offset, are required")
        max_lines = self.max_rows

        def find() -> dict[str, Any]:
            if journal and offset >= 0:
                try:
                    record, where = self.source.read(journal, offset)
                    view = request_view(record, journal, where, max_lines)
                    if not request_id or view["request_id"] == request_id:
                        return view
                except LookupFailed:
                    if not request_id:
                        raise
            hit = self.index.find(request_id, date)
            if hit is None:
                raise LookupFailed(404, "not_found", "no request with this id in the index")
            record, where = self.source.read(hit.journal, hit.offset)
            view = request_view(record, hit.journal, where, max_lines)
            view["date"] = hit.date
            return view

        try:
            view = await asyncio.to_thread(find)
        except LookupFailed as exc:
            self._m_lookups.labels(exc.error).inc()
            return json_response({"error": exc.error, "reason": exc.reason}, exc.status)
        self._m_lookups.labels("local" if view["hub"] == "local" else "fleet").inc()
        return json_response(view)


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
        "/api/requests/samples": console.request_samples,
        "/api/requests/errors": console.request_errors,
        "/api/requests/find": console.find_request,
        "/api/exceptions": console.exceptions,
    }
    for path, handler in routes.items():
        app.router.add_get(path, handler)
