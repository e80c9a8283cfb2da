"""The web listener: one aiohttp server in the hub's event loop for the ops endpoints and the console.

aiohttp parses HTTP; this module bounds what a peer can make it hold and counts what it refuses,
by reason, in ``taproom_web_requests_calls_total``:

* connections: ``[web] max_connections`` open. Past it, a moment later (so that reset
  connections of a burst are gone and requests already sent are read), the oldest connections
  that have not sent a whole request head are closed (``evicted``): a flood of idle or reset
  connections cannot lock clients out. ``max_connections + listen_backlog`` is the hard
  limit: past it a new connection is closed at once (``too_many_connections``);
* request heads: a line or header field longer than ``[web] max_header_bytes``, or more than
  ``max_headers`` fields, gets 431 (``head_too_large``); other unparsable heads get 400
  (``bad_request``);
* time: a connection that has not completed its first request head within
  ``[web] head_timeout_s`` is closed (``timeout``); idle keep-alive connections are closed after
  ``keepalive_timeout_s``;
* bodies: only the login form has one, bounded to 4 KiB.

Every response carries the console's security headers (strict Content-Security-Policy: no inline
script, no eval). When a token is configured, everything except ``/health`` needs it
(:mod:`.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from ..config import ConsoleConfig, WebConfig
from ..hub import Hub
from . import auth, journalapi, ops

__all__ = ["SECURITY_HEADERS", "STATIC_DIR", "WebServer"]

log = logging.getLogger("taproom.web")

STATIC_DIR = Path(__file__).parent / "static"
# The pages load their own scripts and styles only; inline script, eval, plugins, framing and
# foreign connections are all refused by the browser even if an escaping bug slipped through.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cross-Origin-Opener-Policy": "same-origin",
}
# Time between passing max_connections and evicting: enough for reset connections of a burst
# to be noticed and for a client's request, already sent, to be read.
ENFORCE_AFTER_S = 0.05
# The login form carries one token; nothing else has a body.
MAX_BODY_BYTES = 4096

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class _Refused(asyncio.Protocol):
    """Stands in for a connection over the limit: closed at once, never read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Connection(web.RequestHandler):
    """aiohttp's request handler with taproom's head timeout, limit and 431 mapping."""

    def __init__(self, owner: WebServer, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.owner = owner
        self.answered = False  # a request head was complete (see mark_answered)
        self._counted = False  # in owner.open_connections
        self._head_timer: asyncio.TimerHandle | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.owner.open_connections += 1
        self._counted = True
        self.owner.waiting[self] = None
        self._transport = transport  # type: ignore[assignment]
        self._head_timer = asyncio.get_running_loop().call_later(
            self.owner.config.head_timeout_s, self._head_timeout
        )
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._uncount()
        if self._head_timer is not None:
            self._head_timer.cancel()
        super().connection_lost(exc)

    def _uncount(self) -> None:
        self.owner.waiting.pop(self, None)
        if self._counted:
            self._counted = False
            self.owner.open_connections -= 1

    def mark_answered(self) -> None:
        if not self.answered:
            self.answered = True
            self.owner.waiting.pop(self, None)

    def evict(self) -> None:
        """Make room for a new connection: this one has not sent a whole request yet."""
        self._uncount()
        if self._transport is not None:
            self._transport.abort()

    def _head_timeout(self) -> None:
        if not self.answered and self._transport is not None:
            self.owner.count("timeout")
            self._transport.abort()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Parse errors: 431 for oversized heads, 400 for the rest; counted, not logged."""
        if isinstance(exc, BadHttpMessage):
            too_large = isinstance(exc, LineTooLong) or "Too many headers" in str(exc)
            reason, status, text = (
                ("head_too_large", 431, "request header too large\n")
                if too_large
                else ("bad_request", 400, "bad request\n")
            )
            self.owner.count(reason)
            resp = web.Response(status=status, text=text, headers=SECURITY_HEADERS)
            resp.force_close()
            return resp
        self.owner.count("internal_error")
        return super().handle_error(request, status, exc, message)


class WebServer:
    """The ops endpoints and the console on ``[web] host:port``, in the hub's event loop.

    ``services`` is the live mapping of running protocol services (``App.services``); the
    console reads the Lager registrar and the Event BUS hashmap from it, never writes.
    ``addresses`` is the live listener map (``App.addresses``) shown on the Overview.
    """

    def __init__(
        self,
        hub: Hub,
        readiness: Callable[[], list[str]],
        config: WebConfig,
        console: ConsoleConfig,
        services: Mapping[str, Any] | None = None,
        addresses: Mapping[str, str] | None = None,
    ) -> None:
        self.hub = hub
        self.readiness = readiness
        self.config = config
        self.console = console
        self.services: Mapping[str, Any] = services if services is not None else {}
        self.addresses: Mapping[str, str] = addresses if addresses is not None else {}
        self.static_dir = STATIC_DIR
        self.open_connections = 0
        # Open connections without a complete request head yet, oldest first.
        self.waiting: dict[_Connection, None] = {}
        self._enforce: asyncio.TimerHandle | None = None
        self._m_requests = hub.metrics.counter(
            "web", "requests", "calls", "HTTP requests by outcome", ("reason",)
        )
        self._runner: web.AppRunner | None = None
        self._server: asyncio.Server | None = None
        self._on_stop: list[Callable[[], Awaitable[None]]] = []

    def count(self, reason: str) -> None:
        self._m_requests.labels(reason=reason).inc()

    def on_stop(self, fn: Callable[[], Awaitable[None]]) -> None:
        self._on_stop.append(fn)

    def build_app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._middleware],
            client_max_size=MAX_BODY_BYTES,
        )
        ops.add_routes(app, self)
        auth.add_routes(app, self)
        from . import console  # the pages and /api/: a module of their own

        console.add_routes(app, self)
        journalapi.add_routes(app, self)
        return app

    async def start(self) -> dict[str, str]:
        self._runner = web.AppRunner(self.build_app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        manager = self._runner.server
        assert manager is not None
        loop = asyncio.get_running_loop()
        limits = {
            "loop": loop,
            "keepalive_timeout": self.config.keepalive_timeout_s,
            "max_line_size": self.config.max_header_bytes,
            "max_field_size": self.config.max_header_bytes,
            "max_headers": self.config.max_headers,
            "access_log": None,
        }

        def connection() -> asyncio.Protocol:
            limit = self.config.max_connections
            if self.open_connections >= limit + self.config.listen_backlog:
                self.count("too_many_connections")
                return _Refused()
            if self.open_connections >= limit and self._enforce is None:
                self._enforce = loop.call_later(ENFORCE_AFTER_S, self._enforce_limit)
            return _Connection(self, manager, **limits)

        self._server = await loop.create_server(
            connection,
            self.config.host,
            self.config.port,
            reuse_address=True,
            backlog=self.config.listen_backlog,
        )
        sock = self._server.sockets[0]
        host, port = sock.getsockname()[:2]
        if sock.family == socket.AF_INET6:
            host = f"[{host}]"
        return {"web": f"{host}:{port}"}

    def _enforce_limit(self) -> None:
        """Back to ``max_connections``: the oldest connections without a request go.

        Run a moment after the limit was passed, not while accepting: asyncio accepts a
        whole burst at once, and connections that were reset (a connect flood) are still
        counted then; by now they are gone, and a client that sent its request is served.
        """
        self._enforce = None
        while self.open_connections > self.config.max_connections and self.waiting:
            self.count("evicted")
            next(iter(self.waiting)).evict()

    async def stop(self) -> None:
        if self._enforce is not None:
            self._enforce.cancel()
        if self._server is not None:
            self._server.close()
        for fn in self._on_stop:
            with contextlib.suppress(Exception):
                await fn()
        if self._runner is not None:
            await self._runner.cleanup()
        if self._server is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, _Connection):
            protocol.mark_answered()
        try:
            response = auth.check(self, request) or await handler(request)
        except web.HTTPException as exc:
            self._finish(exc)
            raise
        return self._finish(response)

    def _finish(self, response: web.StreamResponse) -> web.StreamResponse:
        self.count(_reason(response.status))
        if response.status >= 400:
            response.force_close()  # a peer that erred gets no second request on this socket
        if not response.prepared:
            response.headers.update(SECURITY_HEADERS)
        return response


def _reason(status: int) -> str:
    return {
        400: "bad_params",
        401: "unauthorized",
        403: "forbidden",
        404: "not_found",
        405: "method_not_allowed",
        413: "body_too_large",
    }.get(status, "ok" if status < 400 or status == 503 else f"status_{status // 100}xx")
