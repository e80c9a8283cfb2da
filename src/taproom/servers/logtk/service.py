"""Both LogTK listeners (WebSocket and TCP), the idempotency index and the auth checks."""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import http
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.server import ServerConnection as WSServerConnection
from websockets.exceptions import ConnectionClosed, InvalidHeader, PayloadTooBig
from websockets.headers import parse_subprotocol

from ...access import ConnectionGate, access_for
from ...checkpoint import CheckpointSchedule
from ...hub import Hub
from ...protocols.logtk import CloseCode, ServerConnection
from .. import ACCEPT_BATCH, deepen_accept_queue
from .config import APP_NAME, LogTKConfig
from .dedup import DedupIndex, rebuild, write_checkpoint
from .session import InFlight, Session
from .tcp import tcp_connections

__all__ = ["AuthLimiter", "LogTKService", "create_service"]

log = logging.getLogger("taproom.logtk")


class AuthLimiter:
    """A token bucket of failed authentications per peer address."""

    def __init__(self, per_minute: float, burst: int, max_peers: int) -> None:
        self.rate = per_minute / 60
        self.burst = burst
        self.max_peers = max_peers
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _level(self, peer: str, now: float) -> float:
        tokens, last = self._peers.get(peer, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - last) * self.rate)

    def allowed(self, peer: str, now: float) -> bool:
        return self._level(peer, now) >= 1.0

    def failed(self, peer: str, now: float) -> None:
        level = max(0.0, self._level(peer, now) - 1.0)
        self._peers[peer] = (level, now)
        self._peers.move_to_end(peer)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)


# --- the service ----------------------------------------------------------------------------


class LogTKService:
    """Both listeners, the dedup index and the auth checks."""

    def __init__(self, hub: Hub, config: LogTKConfig) -> None:
        self.hub = hub
        self.config = config
        self.settings = config.server_settings()
        self.dedup = DedupIndex(config.dedup_window_s, config.dedup_max_entries)
        self._checkpoint_path = os.path.join(hub.config.journal.dir, "logtk", "dedup.checkpoint")
        self._schedule = CheckpointSchedule(
            hub.metrics,
            "logtk",
            interval_s=config.dedup_checkpoint_interval_s,
            after_events=config.dedup_checkpoint_after_events,
            size_ratio=config.dedup_checkpoint_size_ratio,
            min_gap_s=min(1.0, config.dedup_checkpoint_interval_s),
        )
        self.pending: dict[int, InFlight] = {}  # key -> its batch, until committed
        self.limiter = AuthLimiter(
            config.auth_failures_per_minute, config.auth_failure_burst, config.max_tracked_peers
        )
        self._tokens = {
            name: bytes.fromhex(app.token_sha256.lower()) for name, app in config.apps.items()
        }
        self.sessions: set[Session] = set()
        self._tcp_server: asyncio.Server | None = None
        self._ws_server: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._finishing: set[asyncio.Task[Any]] = set()  # TCP connections' ends (tcp.py)
        # One connection gate per listener (allowlist, max_connections, per peer: count and
        # rate), applied at TCP accept, before a byte is read.
        self.gates = {
            name: ConnectionGate(
                access_for(hub.config, name, hub.metrics),
                max_connections=config.max_connections,
                max_per_peer=config.max_connections_per_peer,
                per_peer_per_s=config.peer_connections_per_s,
                per_peer_burst=config.peer_connection_burst,
                max_tracked_peers=hub.config.access.max_tracked_peers,
            )
            for name in ("logtk_ws", "logtk_tcp")
        }
        m = hub.metrics
        self.m_duplicates = m.counter(
            "logtk", "duplicates", "events", "Data frames already stored, acked again"
        )
        self.m_truncated_bytes = m.counter(
            "logtk",
            "truncated",
            "bytes",
            "Bytes cut from entries over max_data_bytes (each entry is stored cut and acked)",
        )
        self.m_auth_failed = m.counter(
            "logtk", "auth_failed", "attempts", "Failed authentications (rate-limited included)"
        )
        m.gauge_fn("logtk", "dedup_index", "entries", "Idempotency keys remembered", self._size)
        m.gauge_fn(
            "logtk",
            "dedup_evicted",
            "entries",
            "Idempotency keys dropped before their window ended (dedup_max_entries)",
            lambda: float(self.dedup.evicted),
        )
        self._gauges = {name: m.connections("logtk", name) for name in ("logtk_ws", "logtk_tcp")}
        # Per-message supervision of the connections' read loops (taproom.supervise): a data
        # entry that fails is refused alone; a read the state machine fails on closes that
        # connection with 0xf8 (internal error).
        self.guards = {
            transport: hub.supervisor.guard(f"logtk.{transport}", protocol="logtk", logger=log)
            for transport in ("tcp", "ws")
        }

    def _size(self) -> float:
        return float(len(self.dedup))

    # --- authentication -------------------------------------------------------------------

    def _match(self, token: bytes, only: str | None) -> str | None:
        """Constant-time comparison against every candidate (no early exit)."""
        digest = hashlib.sha256(token).digest()
        found = None
        for name, expected in self._tokens.items():
            if only is not None and name != only:
                continue
            if hmac.compare_digest(digest, expected) and found is None:
                found = name
        return found

    def authenticate(self, token: bytes, peer: str, only: str | None = None) -> str | None:
        now = time.monotonic()
        if not self.limiter.allowed(peer, now):
            self.m_auth_failed.inc()
            self.hub.metrics.rejected("logtk", "auth_rate_limited")
            return None
        app = self._match(token, only) if token else None
        if app is None:
            self.limiter.failed(peer, now)
            self.m_auth_failed.inc()
            self.hub.metrics.rejected("logtk", "bad_token" if token else "missing_token")
        return app

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        began = time.monotonic()
        count, checkpointed = await asyncio.to_thread(
            rebuild,
            self.dedup,
            self.hub.journal,
            self._checkpoint_path if self.config.dedup_checkpoint_interval_s else None,
            self.config.dedup_rebuild_max_records,
            time.time(),
        )
        self._schedule.started(
            seconds=time.monotonic() - began, replayed=count, covered=checkpointed
        )
        self.dedup.added = 0  # the keys read at start are in the state a checkpoint saves
        log.info(
            "logtk: idempotency index of %d keys from %s%d journal records in %.2f s",
            len(self.dedup),
            "" if checkpointed is None else "a checkpoint and ",
            count,
            time.monotonic() - began,
        )
        from websockets.asyncio.server import serve

        c = self.config
        loop = asyncio.get_running_loop()
        self._tcp_server = await loop.create_server(
            tcp_connections(self, self.gates["logtk_tcp"]),
            c.host,
            c.tcp_port,
            backlog=ACCEPT_BATCH,
        )
        if logging.getLogger("websockets.server").level == logging.NOTSET:
            # It logs INFO per connection opened and closed; taproom logs what matters.
            logging.getLogger("websockets.server").setLevel(logging.WARNING)
        self._ws_server = await serve(
            self._on_ws,
            c.host,
            c.ws_port,
            process_request=self._process_request,
            process_response=self._process_response,
            subprotocols=["logtk"],  # type: ignore[list-item]
            max_size=c.max_frame_bytes,
            ping_interval=None,  # the sessions ping themselves: a pong is activity
            compression="deflate" if c.ws_compression else None,
            open_timeout=c.handshake_timeout_s,
            close_timeout=2,
            backlog=ACCEPT_BATCH,
            create_connection=_ws_connections(self._message_too_big, self.gates["logtk_ws"]),
        )
        deepen_accept_queue(self._tcp_server.sockets, c.listen_backlog)
        deepen_accept_queue(self._ws_server.sockets, c.listen_backlog)
        tcp = self._tcp_server.sockets[0].getsockname()
        ws = next(iter(self._ws_server.sockets)).getsockname()
        # Supervised (taproom.supervise): restarted if they die, shown on /ready.
        self._expire_task = self.hub.supervisor.spawn("logtk.expire", self._expire_loop)
        self._checkpoint_task = self.hub.supervisor.spawn("logtk.checkpoint", self._checkpoint_loop)
        return {"logtk_ws": f"{ws[0]}:{ws[1]}", "logtk_tcp": f"{tcp[0]}:{tcp[1]}"}

    async def stop(self) -> None:
        if self._tcp_server is not None:
            self._tcp_server.close()
        if self._ws_server is not None:
            self._ws_server.close(close_connections=False)
        grace = min(5.0, self.hub.config.hub.grace_period_s)
        await asyncio.gather(
            *(s.shutdown(grace) for s in list(self.sessions)), return_exceptions=True
        )
        for task in list(self._tasks):
            task.cancel()
        self._expire_task.cancel()
        self._checkpoint_task.cancel()
        if self.config.dedup_checkpoint_interval_s:
            try:
                await self.checkpoint()
            except OSError as exc:
                log.warning("logtk: idempotency checkpoint at stop failed: %s", exc)
        if self._ws_server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._ws_server.wait_closed(), timeout=grace)
        if self._tcp_server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._tcp_server.wait_closed(), timeout=grace)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(max(1.0, self.dedup.window_s / DedupIndex.BUCKETS))
            self.dedup.expire(time.time())

    def _covered(self) -> int:
        """The journal offset the index covers: the journal's end while no LogTK batch is in
        flight (every LogTK record committed so far is indexed)."""
        dedup = self.dedup
        if not self.pending:
            dedup.covered_offset = max(dedup.covered_offset, self.hub.journal.end_offset)
        return dedup.covered_offset

    async def checkpoint(self) -> None:
        """Save the index beside the journal (nothing when nothing changed since)."""
        schedule = self._schedule
        schedule.applied = self.dedup.added
        if not schedule.unsaved and not schedule.applied and self._covered() == schedule.covered:
            return
        self._covered()
        snapshot = self.dedup.snapshot()
        self.dedup.added = 0
        taken = schedule.taken()
        began = time.monotonic()
        try:
            keys = await asyncio.to_thread(write_checkpoint, self._checkpoint_path, snapshot)
        except BaseException:
            self.dedup.added += taken
            schedule.failed(taken)
            raise
        schedule.written(snapshot.covered_offset, time.monotonic() - began)
        log.debug("logtk: checkpoint of %d keys in %.2f s", keys, time.monotonic() - began)

    async def _checkpoint_loop(self) -> None:
        """Checkpoints by progress (CheckpointSchedule): checked about once a second."""
        interval = self.config.dedup_checkpoint_interval_s
        if not interval:
            return
        await self._schedule.run(
            check_s=min(1.0, interval),
            applied=lambda: self.dedup.added,
            covered=self._covered,
            size=lambda: len(self.dedup),
            save=self.checkpoint,
            what="logtk idempotency index",
        )

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _enter(self, listener: str) -> None:
        self._gauges[listener].inc()

    def _leave(self, listener: str) -> None:
        self._gauges[listener].dec()

    # --- WebSocket ------------------------------------------------------------------------

    def _message_too_big(self, peer: str) -> None:
        """websockets itself refused a message over max_frame_bytes (closed 1009)."""
        self.hub.metrics.rejected("logtk", "ws_message_too_big")
        log.warning("ws %s: a message over max_frame_bytes; closed 1009", peer)

    def _reject(self, connection: Any, status: http.HTTPStatus, reason: str) -> Any:
        self.hub.metrics.rejected("logtk", reason)
        return connection.respond(status, f"{status.phrase}\n")

    def _process_request(self, connection: Any, request: Any) -> Any:
        """404/503/429/401/400 before the 101 (the seed's upgrade section), each counted."""
        c = self.config
        path = request.path.split("?", 1)[0]
        if not path.startswith(c.path_prefix):
            return self._reject(connection, http.HTTPStatus.NOT_FOUND, "unknown_namespace")
        namespace = path[len(c.path_prefix) :]
        known = namespace in self._tokens
        if not known and not (c.wildcard_namespace and APP_NAME.match(namespace)):
            return self._reject(connection, http.HTTPStatus.NOT_FOUND, "unknown_namespace")
        peer = connection.remote_address[0] if connection.remote_address else "?"
        header = request.headers.get("X-LogTK-Auth")
        token = b""
        if header:
            with contextlib.suppress(binascii.Error, ValueError):
                token = base64.b64decode(header.strip(), validate=True)
        if not self.limiter.allowed(peer, time.monotonic()):
            self.authenticate(token, peer)  # counts the refusal
            return connection.respond(http.HTTPStatus.TOO_MANY_REQUESTS, "Too Many Requests\n")
        if self.authenticate(token, peer, namespace if known else None) is None:
            return connection.respond(http.HTTPStatus.UNAUTHORIZED, "Unauthorized\n")
        try:
            offered = [
                name
                for header in request.headers.get_all("Sec-WebSocket-Protocol")
                for name in parse_subprotocol(header)
            ]
        except InvalidHeader:
            return None  # the library's own negotiation answers 400 (counted in _process_response)
        if not offered:
            return self._reject(connection, http.HTTPStatus.BAD_REQUEST, "missing_subprotocol")
        if "logtk" not in offered:
            return self._reject(connection, http.HTTPStatus.BAD_REQUEST, "wrong_subprotocol")
        return None

    def _process_response(self, connection: Any, request: Any, response: Any) -> None:
        """Counts the refusals the library makes itself (a malformed upgrade request)."""
        if response.status_code != http.HTTPStatus.SWITCHING_PROTOCOLS and (
            connection.protocol.handshake_exc is not None
        ):
            self.hub.metrics.rejected("logtk", "bad_handshake")

    async def _on_ws(self, ws: Any) -> None:
        c = self.config
        path = ws.request.path.split("?", 1)[0]
        namespace = path[len(c.path_prefix) :]
        remote = ws.remote_address or ("?", 0)
        peer = f"{remote[0]}:{remote[1]}"
        self._enter("logtk_ws")
        try:
            await self._serve_ws(ws, namespace, peer)
        finally:
            self._leave("logtk_ws")

    async def _serve_ws(self, ws: Any, namespace: str, peer: str) -> None:
        c = self.config
        loop = asyncio.get_running_loop()
        conn = ServerConnection(self.settings, now=loop.time(), app=namespace)

        async def close() -> None:
            await ws.close()

        session = Session(self, conn, ws.send, "ws", peer)
        self.sessions.add(session)
        sender = self._spawn(session.sender(close))
        ticker = self._spawn(session.ticker())
        keepalive = (
            self._spawn(session.ws_keepalive(ws, c.ws_ping_interval_s, c.ws_ping_timeout_s))
            if c.ws_ping_interval_s
            else None
        )
        try:
            while not conn.closed:
                await session.wait_room()
                if conn.closed:
                    break
                try:
                    message = await ws.recv()
                except ConnectionClosed:
                    break  # over max_frame_bytes: counted by _WSConnection
                if isinstance(message, str):
                    # LogTK is binary; a text message cannot be a frame stream.
                    self.hub.metrics.rejected("logtk", "text_message")
                    conn.close(CloseCode.MALFORMED, "malformed frame received")
                    session.wake.set()
                    break
                session.handle(conn.receive_data(message, loop.time()))
        except Exception as exc:
            self.guards["ws"].failed(exc, f"message from {peer}")
            conn.close(CloseCode.INTERNAL_ERROR, "internal error")
        finally:
            session.wake.set()
            if not conn.closed:
                conn.close(CloseCode.NO_ACK, None)
                conn.data_to_send()
                session.wake.set()
            ticker.cancel()
            if keepalive is not None:
                keepalive.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(sender), timeout=5)
            self.sessions.discard(session)
            session.finish()


# What a WebSocket client refused by the connection gate reads instead of a 101: HTTP's own
# refusal (websockets and browsers report the status), written at accept, without reading the
# request. An address outside the allowlist is told nothing.
_GATE_RESPONSES = {
    reason: (
        f"HTTP/1.1 {status.value} {status.phrase}\r\nConnection: close\r\n"
        f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\nRetry-After: 1\r\n"
        f"\r\n{body}"
    ).encode()
    for reason, status, body in (
        ("max_connections", http.HTTPStatus.SERVICE_UNAVAILABLE, "too many connections\n"),
        (
            "max_connections_per_peer",
            http.HTTPStatus.SERVICE_UNAVAILABLE,
            "too many connections from this address\n",
        ),
        ("peer_connection_rate", http.HTTPStatus.TOO_MANY_REQUESTS, "too many connections\n"),
    )
}


class _WSConnection(WSServerConnection):
    """websockets' connection, behind the listener's connection gate; reports a message it
    refused over ``max_size`` when the connection ends. The handler cannot see them all: bytes
    that came with the upgrade request in one read fail the connection during the handshake
    (websockets then sends neither the 101 nor a 1009 close frame, and never calls the
    handler)."""

    def __init__(
        self, too_big: Callable[[str], None], gate: ConnectionGate, *args: Any, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self._too_big = too_big
        self._gate = gate
        self._admitted: str | None = None  # the peer's host while it holds a gate slot
        self._refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        host = peer[0] if peer else ""
        reason = self._gate.admit(host, peer[1] if peer else None)
        if reason:
            # Neither websockets nor a handler ever sees it: no task, no parser.
            self._refused = True
            response = _GATE_RESPONSES.get(reason)
            if response is None:
                transport.abort()  # type: ignore[attr-defined]
            else:
                transport.write(response)  # type: ignore[attr-defined]
                transport.close()
            return
        self._admitted = host
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    def eof_received(self) -> None:
        if not self._refused:
            super().eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        if self._admitted is not None:
            self._gate.leave(self._admitted)
            self._admitted = None
        if isinstance(self.protocol.parser_exc, PayloadTooBig):
            remote = self.remote_address
            self._too_big(f"{remote[0]}:{remote[1]}" if remote else "?")
        super().connection_lost(exc)


def _ws_connections(
    too_big: Callable[[str], None], gate: ConnectionGate
) -> type[WSServerConnection]:
    """``serve(create_connection=)`` takes a class: one that reports to ``too_big`` and is
    admitted by ``gate``."""
    return functools.partial(_WSConnection, too_big, gate)  # type: ignore[return-value]


def create_service(hub: Hub, section: LogTKConfig) -> LogTKService:
    return LogTKService(hub, section)
