"""The web listener: one aiohttp server in the hub's event loop for the ops endpoints and the console.

aiohttp parses HTTP; this module bounds what a peer can make it hold and counts what it refuses,
by reason, in ``taproom_web_requests_calls_total``:

* connections: ``[web] max_connections`` open. Past it, a moment later (so that reset
  connections of a burst are gone and requests already sent are read), the oldest connections
  that have not sent a whole request head for ``EVICT_AFTER_S`` are closed (``evicted``): a
  flood of idle or reset connections cannot lock clients out. ``max_connections +
  accept_batch`` is the hard limit: past it a new connection is closed at once
  (``too_many_connections``). Under a connect/RST flood of this port /health still answers
  within 1 s: the kernel's accept queue (``listen_backlog``, 4096) holds a burst instead of
  dropping SYNs (a 1 s retry), a connection reaches the loop only with its first bytes
  (TCP_DEFER_ACCEPT: a reset one never does), asyncio accepts ``accept_batch`` (100) a wakeup
  so resets and requests are read between batches, and a connection costs an aiohttp handler
  only once it sends bytes (:class:`_Slot`);
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

from ..access import ConnectionGate, access_for
from ..config import ConsoleConfig, WebConfig
from ..hub import Hub
from ..servers import deepen_accept_queue, defer_accept
from . import auth, journalapi, ops
from .auth import LoginThrottle, Sessions

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
# Only a connection open this long without a whole request head is evicted: under a connect
# flood the loop accepts a burst at once and reads a client's head (sent with its connect) some
# iterations later; evicting young connections cut /health off (seen in the probe).
EVICT_AFTER_S = 0.5
# The login form carries one token; nothing else has a body.
MAX_BODY_BYTES = 4096

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# What a connection the gate refuses reads (written at once, its request never read): the
# JSON error every /api/ refusal has.
_GATE_RESPONSES = {
    reason: (
        f"HTTP/1.1 {status} {phrase}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"Retry-After: 1\r\n\r\n{body}"
    ).encode()
    for reason, status, phrase in (
        ("max_connections_per_peer", 503, "Service Unavailable"),
        ("peer_connection_rate", 429, "Too Many Requests"),
    )
    for body in (f'{{"error": "too_many_connections", "reason": "{reason}"}}\n',)
}


class _Refused(asyncio.Protocol):
    """Stands in for a connection over the limit: closed at once, never read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


class _Slot(asyncio.Protocol):
    """One open connection, counted in ``owner.open_connections`` from made to lost.

    Until its first bytes it is only this: no aiohttp handler, no task, no timer of its own,
    so a connect/RST flood costs the loop little and a reset connection frees its slot as soon
    as the loop sees the reset. The first bytes hand the transport to a :class:`_Connection`.
    Until its first request head is whole it is in ``owner.waiting`` (head timeout, eviction).
    """

    __slots__ = ("handler", "host", "owner", "transport")

    def __init__(self, owner: WebServer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None
        self.handler: _Connection | None = None
        self.host: str | None = None  # set once the connection gate let it in

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        host = peer[0] if peer else ""
        reason = self.owner.gate.admit(host, peer[1] if peer else None)
        if reason:
            # Counted and logged by the gate; HTTP's own refusal, unless the address is not
            # allowed at all (told nothing).
            response = _GATE_RESPONSES.get(reason)
            assert isinstance(transport, asyncio.Transport)
            if response is None:
                transport.abort()
            else:
                transport.write(response)
                transport.close()
            return
        self.host = host
        self.owner.admit(self)

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        if self.host is None:
            return  # refused by the gate, closing
        handler = self.handler = self.owner.make_handler(self)
        self.transport.set_protocol(handler)
        handler.connection_made(self.transport)
        handler.data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.owner.release(self)

    def head_complete(self) -> None:
        self.owner.waiting.pop(self, None)

    def close(self, reason: str) -> None:
        """Evicted or timed out: counted, slot freed now, connection aborted."""
        self.owner.count(reason)
        self.owner.release(self)
        if self.transport is not None:
            self.transport.abort()


class _Connection(web.RequestHandler):
    """aiohttp's request handler for a :class:`_Slot` that sent bytes: taproom's head
    tracking and 431 mapping."""

    def __init__(self, slot: _Slot, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.slot = slot
        self.answered = False  # a request head was complete
        self._tail = b""  # the last bytes before a whole head (its end may straddle reads)

    def data_received(self, data: bytes) -> None:
        if not self.answered:
            # A whole head is in: no longer evicted or timed out, even before the handler
            # task gets to it (that can be many loop iterations later under a flood).
            seen = self._tail + data
            if b"\r\n\r\n" in seen:
                self.mark_answered()
            else:
                self._tail = seen[-3:]
        super().data_received(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.slot.owner.release(self.slot)
        super().connection_lost(exc)

    def mark_answered(self) -> None:
        if not self.answered:
            self.answered = True
            self.slot.head_complete()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Parse errors: 431 for oversized heads, 400 for the rest; counted, not logged."""
        owner = self.slot.owner
        if isinstance(exc, BadHttpMessage):
            too_large = isinstance(exc, LineTooLong) or "Too many headers" in str(exc)
            reason, status, text = (
                ("head_too_large", 431, "request header too large\n")
                if too_large
                else ("bad_request", 400, "bad request\n")
            )
            owner.count(reason)
            resp = web.Response(status=status, text=text, headers=SECURITY_HEADERS)
            resp.force_close()
            return resp
        owner.count("internal_error")
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
        self._open: set[_Slot] = set()
        # Open connections without a whole request head yet, oldest first: when each was made
        # (loop time). One timer for all of them (head timeout, eviction), not one each.
        self.waiting: dict[_Slot, float] = {}
        self._enforce: asyncio.TimerHandle | None = None
        self._sweep: asyncio.TimerHandle | None = None
        self._limits: dict[str, Any] = {}
        self._manager: web.Server | None = None
        self._m_requests = hub.metrics.counter(
            "web", "requests", "calls", "HTTP requests by outcome", ("reason",)
        )
        self.sessions = Sessions(config.session_ttl_s, config.max_sessions)
        self.throttle = LoginThrottle(
            config.login_free_failures,
            config.login_backoff_s,
            config.login_backoff_max_s,
            hub.config.access.max_tracked_peers,
        )
        # The allowlist and the per-address limits; the total is this listener's own
        # (max_connections with eviction, then the hard limit).
        self.gate = ConnectionGate(
            access_for(hub.config, "web", hub.metrics),
            max_connections=0,
            max_per_peer=config.max_connections_per_peer,
            per_peer_per_s=config.peer_connections_per_s,
            per_peer_burst=config.peer_connection_burst,
            max_tracked_peers=hub.config.access.max_tracked_peers,
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
        self._manager = manager
        self._limits = {
            "loop": loop,
            "keepalive_timeout": self.config.keepalive_timeout_s,
            "max_line_size": self.config.max_header_bytes,
            "max_field_size": self.config.max_header_bytes,
            "max_headers": self.config.max_headers,
            "access_log": None,
        }

        def connection() -> asyncio.Protocol:
            limit = self.config.max_connections
            if self.open_connections >= limit + self.config.accept_batch:
                self.count("too_many_connections")
                return _Refused()
            if self.open_connections >= limit and self._enforce is None:
                self._enforce = loop.call_later(ENFORCE_AFTER_S, self._enforce_limit)
            return _Slot(self)

        self._server = await loop.create_server(
            connection,
            self.config.host,
            self.config.port,
            reuse_address=True,
            backlog=self.config.accept_batch,
        )
        deepen_accept_queue(self._server.sockets, self.config.listen_backlog)
        defer_accept(self._server.sockets, self.config.head_timeout_s)
        sock = self._server.sockets[0]
        host, port = sock.getsockname()[:2]
        if sock.family == socket.AF_INET6:
            host = f"[{host}]"
        return {"web": f"{host}:{port}"}

    def admit(self, slot: _Slot) -> None:
        self.open_connections += 1
        self._open.add(slot)
        self.waiting[slot] = asyncio.get_running_loop().time()
        if self._sweep is None:
            self._arm_sweep()

    def release(self, slot: _Slot) -> None:
        """Idempotent: a slot is freed once, whichever of lost, evicted, timed out comes first."""
        if slot in self._open:
            self._open.discard(slot)
            self.open_connections -= 1
            self.waiting.pop(slot, None)
            self.gate.leave(slot.host)

    def make_handler(self, slot: _Slot) -> _Connection:
        assert self._manager is not None
        return _Connection(slot, self._manager, **self._limits)

    def _arm_sweep(self) -> None:
        if self.waiting:
            made = next(iter(self.waiting.values()))
            loop = asyncio.get_running_loop()
            self._sweep = loop.call_at(made + self.config.head_timeout_s, self._timeouts)
        else:
            self._sweep = None

    def _timeouts(self) -> None:
        """Connections that have not sent a whole request head in ``head_timeout_s`` go."""
        deadline = asyncio.get_running_loop().time() - self.config.head_timeout_s
        while self.waiting:
            slot, made = next(iter(self.waiting.items()))
            if made > deadline:
                break
            slot.close("timeout")
        self._arm_sweep()

    def _enforce_limit(self) -> None:
        """Back to ``max_connections``: the oldest connections without a request go, once
        they have been open ``EVICT_AFTER_S`` (if none has yet, this runs again then).

        Run a moment after the limit was passed, not while accepting: asyncio accepts a
        whole burst at once, and connections that were reset (a connect flood) are still
        counted then; by now they are gone, and a client that sent its request is served.
        """
        self._enforce = None
        loop = asyncio.get_running_loop()
        while self.open_connections > self.config.max_connections and self.waiting:
            slot, made = next(iter(self.waiting.items()))
            if loop.time() - made < EVICT_AFTER_S:
                self._enforce = loop.call_at(made + EVICT_AFTER_S, self._enforce_limit)
                return
            slot.close("evicted")

    async def stop(self) -> None:
        for timer in (self._enforce, self._sweep):
            if timer is not None:
                timer.cancel()
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
            protocol.mark_answered()  # a head whose end data_received did not see (bare LFs)
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
        429: "throttled",
    }.get(status, "ok" if status < 400 or status == 503 else f"status_{status // 100}xx")
