"""The Lumberjack listener: accept (plain or TLS), admit, sweep idle connections, stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from typing import Any

from ...access import ConnectionGate, access_for
from ...budget import CONNECTION_BUFFERS
from ...hub import Hub
from ...protocols.lumberjack import (
    PROTOCOL,
)
from ..tlsaccept import start_server_tls, tls_refusal
from .config import LumberjackConfig, server_ssl_context
from .connection import _Connection
from .kernel import WindowKernels
from .resend import ResendMemory

log = logging.getLogger("taproom.lumberjack")


# Journal room a connection reserves at a time: a Filebeat window of 2048 ordinary events
# (~0.8 MB of records) in one step; larger windows take more steps, each granted in turn.
_ROOM_STEP = 1024 * 1024


class _TLSAccept(asyncio.Protocol):
    """A TLS listener's new connection: the gate first, then the handshake (tlsaccept), then
    a :class:`_Connection` takes over."""

    __slots__ = ("server",)

    def __init__(self, server: LumberjackServer) -> None:
        self.server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        server = self.server
        peer = transport.get_extra_info("peername")
        if not server.admit(None, peer):
            transport.abort()
            return
        host = peer[0] if peer else ""
        where = f"{peer[0]}:{peer[1]}" if peer else "?"
        task = server.loop.create_task(server.handshake(transport, host, where))
        server.handshaking.add(task)
        task.add_done_callback(server.handshaking.discard)


class LumberjackServer:
    """The listener: accepts, limits connections (in total and per peer), sweeps idle
    connections and failed TLS handshakes, and remembers cut-off windows for their resend."""

    def __init__(self, hub: Hub, config: LumberjackConfig) -> None:
        self.hub = hub
        self.config = config
        self.limits = config.limits
        self.connections: set[_Connection] = set()
        self.access = access_for(hub.config, "lumberjack", hub.metrics)
        self.gate = ConnectionGate(
            self.access,
            max_connections=config.max_connections,
            max_per_peer=config.max_connections_per_peer,
            per_peer_per_s=config.peer_connections_per_s,
            per_peer_burst=config.peer_connection_burst,
            max_tracked_peers=hub.config.access.max_tracked_peers,
        )
        self.loop = asyncio.get_event_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.pending = hub.budget.holder("pending")
        self.inflate = hub.budget.holder("inflate")
        self.buffers = hub.budget.holder(CONNECTION_BUFFERS)
        # A step of journal room: a Filebeat window's worth, or less under a small bound (a
        # step is granted beyond the bound when nothing else is held).
        self.room_step = min(_ROOM_STEP, max(self.pending.bound // 8, 16 * 1024))
        # Per-read supervision of the connections (taproom.supervise): a read the decoder
        # fails on unexpectedly closes that connection, counted and logged rate-limited.
        self.guard = hub.supervisor.guard("lumberjack.connection", protocol=PROTOCOL, logger=log)
        m = hub.metrics
        self.m_connections = m.connections(PROTOCOL, "lumberjack")
        self.resend = ResendMemory(config.resend_memory_events, m)
        # Runs of J frames in C while the compiled path is selected (issue 32), else None.
        self.kernels = WindowKernels.create()
        # TLS handshakes under way (tlsaccept: each failure is counted with its cause at once).
        self.handshaking: set[asyncio.Task[None]] = set()
        self._tls: ssl.SSLContext | None = None

    def _accept(self) -> asyncio.Protocol:
        return _Connection(self) if self._tls is None else _TLSAccept(self)

    async def handshake(self, transport: asyncio.BaseTransport, host: str, peer: str) -> None:
        """TLS on a connection the gate let in; a failure is counted and logged with its
        cause at once, and frees the gate's slot."""
        assert self._tls is not None
        cfg = self.config
        conn = _Connection(self, admitted=host)
        try:
            await start_server_tls(
                transport,
                self._tls,
                conn,
                handshake_timeout=cfg.handshake_timeout_s,
                shutdown_timeout=cfg.tls_shutdown_timeout_s,
            )
        except Exception as exc:
            reason, detail = tls_refusal(exc)
            self.access.refused(peer, reason, detail)
            self.gate.leave(host)

    # -- connection accounting ---------------------------------------------------------------

    def admit(self, conn: _Connection | None, peer: Any) -> bool:
        """The connection gate (allowlist, max_connections, per peer: count and rate):
        True and counted in, or False, counted and logged (rate-limited) by reason."""
        host, port = (peer[0], peer[1]) if peer else ("", None)
        if self.gate.admit(host, port):
            return False
        if conn is not None:
            conn.peer_host = host
        return True

    def forget(self, conn: _Connection) -> None:
        """The connection is gone: its slot and its peer count are free."""
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        self.m_connections.dec()
        self.gate.leave(conn.peer_host)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        self.loop = asyncio.get_running_loop()
        cfg = self.config
        ssl_ctx = server_ssl_context(cfg) if cfg.tls_cert else None
        self._tls = ssl_ctx
        # TLS is started per connection after the gate (tlsaccept), not by the server.
        self._server = await self.loop.create_server(
            self._accept, cfg.host, cfg.port, backlog=cfg.accept_backlog
        )
        self._sweeper = self.hub.supervisor.spawn("lumberjack.sweep", self._sweep)
        host, port = self._server.sockets[0].getsockname()[:2]
        log.info("lumberjack listening on %s:%d (%s)", host, port, "TLS" if ssl_ctx else "TCP")
        return {"lumberjack": f"{host}:{port}"}

    async def _sweep(self) -> None:
        """Idle timeouts, one wake-up per second at most."""
        cfg = self.config
        period = min(1.0, cfg.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [c for c in self.connections if c.idle(now, cfg.idle_timeout_s)]:
                # Counted and logged once: the abort drops the socket at once, TLS included
                # (nothing is owed to an idle sender, so there is nothing to flush).
                self.hub.metrics.rejected(PROTOCOL, "idle_timeout")
                log.info(
                    "%s: no complete frame for %.0fs, closing", conn.producer, cfg.idle_timeout_s
                )
                conn._closing = True
                conn.transport.abort()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.handshaking):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        # Stop reading, let in-flight commits finish so their acks go out, then close.
        for conn in list(self.connections):
            conn._closing = True
            with contextlib.suppress(Exception):
                conn.transport.pause_reading()
        deadline = time.monotonic() + self.hub.config.hub.grace_period_s
        while any(c._pending for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


def create_service(hub: Hub, section: LumberjackConfig) -> LumberjackServer:
    return LumberjackServer(hub, section)
