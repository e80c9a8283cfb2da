"""LogTK server glue: WebSocket (``websockets``) and raw TCP (asyncio) around the sans-I/O core.

Both listeners feed :class:`taproom.protocols.logtk.ServerConnection`. Each read's data frames
become one journal batch; a frame is acknowledged only once the commit covering it resolved.
Exactly-once by idempotency: every stored event carries ``event_id = "<app>:<client id
hex>:<idem hex>"`` and a :class:`DedupIndex` keyed by (app, client id, idem) remembers every
committed token for ``dedup_window_s``. A token seen again is acknowledged again and counted,
never stored twice; one whose first copy is still being committed is acknowledged when that
commit resolves. On start the index is rebuilt from the journal's LogTK records within the
window (in a thread, bounded by ``dedup_rebuild_max_records``), so the guarantee survives
restarts and SIGKILL without a second file to keep consistent with the journal.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import hmac
import http
import logging
import re
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
from websockets.exceptions import ConnectionClosed, InvalidHeader
from websockets.frames import CloseCode as WSCloseCode
from websockets.headers import parse_subprotocol

from ..config import config_section, setting
from ..errors import ConfigError, HubStopped
from ..hub import Hub
from ..hub.core import Commit
from ..protocols.logtk import (
    Authenticated,
    AuthFailed,
    CloseCode,
    CloseReceived,
    Data,
    Initialized,
    OversizeData,
    PongPolicy,
    ServerConnection,
    ServerSettings,
    Violation,
    time_reader,
)
from ..records import BatchBuilder

__all__ = ["DedupIndex", "LogTKApp", "LogTKConfig", "LogTKService", "create_service"]

log = logging.getLogger("taproom.logtk")

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_APP_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


@dataclass(frozen=True)
class LogTKApp:
    """One application allowed to log: ``[logtk.apps.<name>]``."""

    token_sha256: str = setting(
        "", "hex SHA-256 of the app's 64-byte token: the hub never stores the token itself"
    )

    def validate(self) -> None:
        if not _HEX64.match(self.token_sha256):
            raise ConfigError("must be 64 hex digits (sha256 of the token)", key="token_sha256")


@config_section("logtk")
@dataclass(frozen=True)
class LogTKConfig:
    enabled: bool = setting(True, "browser and app loggers speak LogTK")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    ws_port: int = setting(7080, "LogTK over WebSocket", min=0, max=65535)
    tcp_port: int = setting(7081, "LogTK over raw TCP", min=0, max=65535)
    apps: dict[str, LogTKApp] = setting(  # noqa: RUF009 -- a factory, not a shared default
        None, "apps and their hashed tokens; none configured means nobody can log", factory=dict
    )
    path_prefix: str = setting("/logging/", "the reference client's convention: /logging/<app>")
    wildcard_namespace: bool = setting(
        False,
        "accept any /logging/<name> whose token matches some app (stream = <name>); off: 404",
    )
    formats: tuple[str, ...] = setting(
        ("protobuf", "bson", "json"), "the formats taproom can decode for tail and outputs"
    )
    max_frame_bytes: int = setting(
        1024 * 1024, "one log entry per frame; a megabyte is a bug, not a log line", min=64
    )
    max_data_bytes: int = setting(
        512 * 1024,
        "the serialized entry inside a data frame; a longer one is stored cut to this and acked",
        min=16,
        max=64 * 1024 * 1024,
    )
    max_auth_frame_bytes: int = setting(
        256,
        "TCP: an auth frame is 67 bytes; an unauthenticated peer gets no more room than this",
        min=69,
        max=65536,
    )
    max_unacked: int = setting(
        4096, "data frames read but not yet acked per connection before reading pauses", min=1
    )
    max_connections: int = setting(
        1024, "per listener; each costs a task and buffers", min=1, max=1_000_000
    )
    handshake_timeout_s: float = setting(
        10.0, "auth and init take one round trip each; slow handshakes hold slots", min=0.1
    )
    idle_timeout_s: float = setting(
        600.0, "the reference client never pongs: silence this long ends a connection", min=1
    )
    ping_enabled: bool = setting(True, "the server's ping_recv: LogTK pings find dead TCP peers")
    ping_min_delta_ms: int = setting(
        1000, "the server's side of max(client, server)/2 (the seed's example value)", min=1
    )
    pong_policy: str = setting(
        "after_first_pong",
        "two missed pongs close a connection once it has ponged (taproom's client does); "
        "the reference client never pongs and is tolerated",
        choices=("always", "after_first_pong", "never"),
    )
    ws_ping_interval_s: float = setting(
        20.0,
        "WebSocket pings (websockets' default): an answer counts as activity, so an app that "
        "logs rarely keeps its connection; 0 disables them",
        min=0,
    )
    ws_ping_timeout_s: float = setting(
        20.0, "a WebSocket ping unanswered this long means the peer is gone", min=0.1
    )
    ws_compression: bool = setting(
        False,
        "permessage-deflate costs CPU on the hub's one core; LogTK entries are compact binary",
    )
    dedup_window_s: float = setting(
        3600.0,
        "idempotency tokens remembered this long: covers 1 s resends and cache replays after "
        "a client restart within the hour",
        min=1,
    )
    dedup_max_entries: int = setting(
        4_000_000, "bounds the index's memory (~60 B each); the oldest bucket goes first", min=1000
    )
    dedup_rebuild_max_records: int = setting(
        10_000_000, "journal records scanned at start to rebuild the index", min=0
    )
    auth_failures_per_minute: float = setting(
        10.0, "failed authentications refill this fast per peer address", min=0.1
    )
    auth_failure_burst: int = setting(
        20, "failed authentications a peer may make at once before being refused", min=1
    )
    max_tracked_peers: int = setting(10_000, "rate-limiter memory bound (oldest dropped)", min=1)

    def validate(self) -> None:
        for name in self.apps:
            if not _APP_NAME.match(name):
                raise ConfigError("app names are 1-64 of [A-Za-z0-9_.-]", key=f"apps.{name}")
        if not self.path_prefix.startswith("/") or not self.path_prefix.endswith("/"):
            raise ConfigError("must start and end with '/'", key="path_prefix")

    def server_settings(self) -> ServerSettings:
        return ServerSettings(
            formats=tuple(self.formats),
            max_frame_bytes=self.max_frame_bytes,
            max_data_bytes=min(self.max_data_bytes, self.max_frame_bytes),
            max_auth_frame_bytes=self.max_auth_frame_bytes,
            ping_recv=self.ping_enabled,
            ping_min_delta_ms=self.ping_min_delta_ms,
            pong_policy=PongPolicy(self.pong_policy),
            handshake_timeout_s=self.handshake_timeout_s,
            idle_timeout_s=self.idle_timeout_s,
        )


def hash_token(token: bytes) -> str:
    """What goes into ``token_sha256``."""
    return hashlib.sha256(token).hexdigest()


# --- idempotency ----------------------------------------------------------------------------


class DedupIndex:
    """Committed (app, client id, idem) keys seen within ``window_s``.

    Keys are ints (``slot << 32 | idem``, one slot per app and client id) in one set for
    lookups, and listed in time buckets for expiry: a whole bucket expires at once, and over
    ``max_entries`` the oldest bucket is dropped early (``evicted`` counts those keys).
    """

    BUCKETS = 16

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._bucket_s = window_s / self.BUCKETS
        self._keys: set[int] = set()
        self._buckets: deque[tuple[float, list[int]]] = deque()
        self._slots: dict[tuple[str, int], int] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def slot(self, app: str, client_id: int) -> int:
        """The key prefix of one (app, client id): ``slot << 32``."""
        key = (app, client_id)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = len(self._slots) + 1
        return slot << 32

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def add(self, key: int, when: float) -> None:
        """Remember ``key`` as committed at wall-clock ``when`` (seconds)."""
        if key in self._keys:
            return
        start = when - when % self._bucket_s
        if not self._buckets or self._buckets[-1][0] < start:
            self._buckets.append((start, []))
        self._buckets[-1][1].append(key)
        self._keys.add(key)
        while len(self._keys) > self.max_entries and len(self._buckets) > 1:
            self.evicted += self._drop_oldest()

    def add_many(self, keys: list[int], when: float) -> None:
        """:meth:`add` for a commit's worth of keys."""
        before = len(self._keys)
        self._keys.update(keys)
        if len(self._keys) - before != len(keys):
            # Some were known already (a rebuild racing a resend): keep one entry per key.
            self._keys.difference_update(keys)
            self._keys.update(keys)
            for key in keys:
                self.add(key, when)
            return
        start = when - when % self._bucket_s
        if not self._buckets or self._buckets[-1][0] < start:
            self._buckets.append((start, []))
        self._buckets[-1][1].extend(keys)
        while len(self._keys) > self.max_entries and len(self._buckets) > 1:
            self.evicted += self._drop_oldest()

    def _drop_oldest(self) -> int:
        _, dropped = self._buckets.popleft()
        self._keys.difference_update(dropped)
        return len(dropped)

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s - self._bucket_s
        while self._buckets and self._buckets[0][0] < cutoff:
            self._drop_oldest()


def parse_event_id(event_id: str) -> tuple[str, int, int] | None:
    """``"<app>:<client id hex>:<idem hex>"`` back to its parts."""
    parts = event_id.rsplit(":", 2)
    if len(parts) != 3:
        return None
    try:
        return parts[0], int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None


# --- failed-auth rate limiting --------------------------------------------------------------


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


# --- one connection -------------------------------------------------------------------------


class _Session:
    """One connection: the state machine, its acks, its window, its sender."""

    def __init__(
        self,
        service: LogTKService,
        conn: ServerConnection,
        send: Callable[[bytes], Awaitable[None]],
        transport: str,
        peer: str,
    ) -> None:
        self.service = service
        self.conn = conn
        self._send = send
        self.transport = transport
        self.peer = peer
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.room = asyncio.Event()
        self.room.set()
        self.inflight: set[asyncio.Future[Commit]] = set()
        self.done = asyncio.Event()
        self.stream = conn.app or ""
        self._slot = 0
        self._producer = ""
        self._id_prefix = ""
        self._time_of = time_reader("")
        self._attrs = orjson.dumps({"peer": peer, "transport": transport})

    def handle(self, events: list[Any]) -> None:
        datas: list[Data | OversizeData] = []
        for event in events:
            if type(event) is Data or type(event) is OversizeData:
                datas.append(event)
            elif isinstance(event, Initialized):
                app = self.conn.app or ""
                self._slot = self.service.dedup.slot(app, event.client_id)
                self._producer = f"{event.client_id:08x}"
                self._id_prefix = f"{app}:{event.client_id:08x}:"
                self._time_of = time_reader(event.format)
            elif isinstance(event, Violation):
                self.service.hub.metrics.rejected("logtk", event.reason)
                log.info("%s %s: closing: %s", self.transport, self.peer, event.message)
            elif isinstance(event, AuthFailed):
                log.info("%s %s: authentication failed", self.transport, self.peer)
            elif isinstance(event, Authenticated):
                self.stream = event.app
            elif isinstance(event, CloseReceived):
                log.debug("%s %s: peer closed (%s)", self.transport, self.peer, event.code)
        if datas:
            self._ingest(datas)
        if self.conn.unacked >= self.service.config.max_unacked:
            self.room.clear()
        self.wake.set()

    def _ingest(self, datas: list[Data | OversizeData]) -> None:
        svc = self.service
        dedup = svc.dedup
        pending = svc.pending
        builder = BatchBuilder()
        stored: list[int] = []  # keys to store
        batch_idems: list[int] = []  # idems acked with this batch (new ones and in-batch repeats)
        seen_here: set[int] = set()
        at_once: list[int] = []
        waits: dict[asyncio.Future[Commit], list[int]] = {}
        slot = self._slot
        prefix = self._id_prefix
        fmt = self.conn.format
        time_of = self._time_of
        duplicates = 0
        for frame in datas:
            idem = frame.idem
            key = slot | idem
            if key in seen_here:
                batch_idems.append(idem)
                duplicates += 1
                continue
            first = pending.get(key)
            if first is not None:
                waits.setdefault(first, []).append(idem)
                duplicates += 1
                continue
            if key in dedup:
                at_once.append(idem)
                duplicates += 1
                continue
            builder.add(
                "logtk",
                frame.data,
                stream=self.stream,
                producer=self._producer,
                seq=idem,
                event_id=f"{prefix}{idem:08x}",
                ts_ns=time_of(frame.data),
                content_type=fmt,
                attrs=self._attrs if isinstance(frame, Data) else self._cut(frame),
            )
            seen_here.add(key)
            stored.append(key)
            batch_idems.append(idem)
        if duplicates:
            svc.m_duplicates.inc(duplicates)
        if at_once:
            self.ack(at_once)
        for future, idems in waits.items():
            self._after(future, idems, ())
        if stored:
            try:
                future = svc.hub.submit(builder.build())
            except HubStopped:
                self.settle(len(batch_idems))
                self.conn.close(CloseCode.SHUTTING_DOWN, "server shutting down")
                return
            svc.hub.metrics.accepted("logtk", len(stored))
            for key in stored:
                pending[key] = future
            self._after(future, batch_idems, stored)

    def _cut(self, frame: OversizeData) -> bytes:
        """An entry over max_data_bytes is stored cut to its first max_data_bytes and acked
        like any other (docs/compat.md): counted, logged with the client id, and marked in the
        record's attrs with its whole size."""
        svc = self.service
        svc.hub.metrics.rejected("logtk", "data_truncated")
        svc.m_truncated_bytes.inc(frame.size - len(frame.data))
        log.warning(
            "%s %s: entry %s%08x (app:client:idem) of %d bytes is over max_data_bytes; "
            "stored its first %d bytes and acked it",
            self.transport,
            self.peer,
            self._id_prefix,
            frame.idem,
            frame.size,
            len(frame.data),
        )
        return orjson.dumps(
            {"peer": self.peer, "transport": self.transport, "truncated_from": str(frame.size)}
        )

    def _after(self, future: asyncio.Future[Commit], idems: list[int], keys: Any) -> None:
        self.inflight.add(future)

        def done(fut: asyncio.Future[Commit]) -> None:
            self.inflight.discard(fut)
            ok = not fut.cancelled() and fut.exception() is None
            svc = self.service
            if keys:
                pop = svc.pending.pop
                for key in keys:
                    pop(key, None)
                if ok:
                    svc.dedup.add_many(keys, time.time())
            if ok:
                self.ack(idems)
            else:
                # Not acked: the client resends with the same idem and the hub stores it then.
                self.settle(len(idems))
                if not self.conn.closed:
                    log.warning("%s %s: commit failed; closing", self.transport, self.peer)
                    self.conn.close(CloseCode.INTERNAL_ERROR, "internal error")
                    self.wake.set()

        future.add_done_callback(done)

    def ack(self, idems: list[int]) -> None:
        self.conn.ack(idems)
        self.settle(len(idems))
        self.wake.set()

    def settle(self, count: int) -> None:
        self.conn.settled(count)
        if self.conn.unacked < self.service.config.max_unacked:
            self.room.set()

    async def sender(self, close_transport: Callable[[], Awaitable[None]]) -> None:
        """Writes what the state machine queued; closes the transport once it is closed."""
        try:
            while True:
                await self.wake.wait()
                self.wake.clear()
                out = self.conn.data_to_send()
                if out:
                    await self._send(out)
                if self.conn.closed:
                    break
        except Exception as exc:  # the peer went away mid-write
            log.debug("%s %s: send failed: %r", self.transport, self.peer, exc)
        finally:
            self.done.set()
            self.room.set()
            with contextlib.suppress(Exception):
                await close_transport()

    async def ticker(self) -> None:
        while not self.conn.closed:
            interval = self.conn.ping_interval_s
            await asyncio.sleep(min(0.5, interval / 2) if interval else 0.5)
            events = self.conn.tick(self.loop.time())
            if events:
                self.handle(events)
            elif self.conn.closed:
                self.wake.set()
            self.wake.set()

    async def ws_keepalive(self, ws: Any, interval: float, timeout: float) -> None:
        """WebSocket pings: an answered one keeps an idle connection open (logtkjs owes no
        LogTK pongs over WebSocket), one unanswered within ``timeout`` closes it."""
        while not self.conn.closed:
            await asyncio.sleep(interval)
            try:
                pong = await ws.ping()
                await asyncio.wait_for(pong, timeout)
            except ConnectionClosed:
                return
            except TimeoutError:
                if not self.conn.closed:
                    self.service.hub.metrics.rejected("logtk", "ws_ping_timeout")
                    log.info("ws %s: no pong in %.1f s; closing", self.peer, timeout)
                    self.conn.close(CloseCode.PING_TIMEOUT, "ping timeout")
                    self.wake.set()
                return
            self.conn.alive(self.loop.time())

    async def wait_room(self) -> None:
        """Backpressure: the hub's capacity and this connection's unacked window."""
        await self.service.hub.wait_capacity()
        while not self.room.is_set():
            await self.room.wait()

    async def shutdown(self, grace: float) -> None:
        if self.inflight:
            await asyncio.wait(list(self.inflight), timeout=grace)
        self.conn.close(CloseCode.SHUTTING_DOWN, "server shutting down")
        self.wake.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.done.wait(), timeout=grace)


# --- the service ----------------------------------------------------------------------------


class LogTKService:
    """Both listeners, the dedup index and the auth checks."""

    def __init__(self, hub: Hub, config: LogTKConfig) -> None:
        self.hub = hub
        self.config = config
        self.settings = config.server_settings()
        self.dedup = DedupIndex(config.dedup_window_s, config.dedup_max_entries)
        self.pending: dict[int, asyncio.Future[Commit]] = {}
        self.limiter = AuthLimiter(
            config.auth_failures_per_minute, config.auth_failure_burst, config.max_tracked_peers
        )
        self._tokens = {
            name: bytes.fromhex(app.token_sha256.lower()) for name, app in config.apps.items()
        }
        self.sessions: set[_Session] = set()
        self._tcp_server: asyncio.Server | None = None
        self._ws_server: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._counts = {"logtk_ws": 0, "logtk_tcp": 0}
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
        await asyncio.to_thread(self._rebuild_dedup)
        from websockets.asyncio.server import serve

        c = self.config
        self._tcp_server = await asyncio.start_server(
            self._on_tcp, c.host, c.tcp_port, limit=c.max_frame_bytes
        )
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
        )
        tcp = self._tcp_server.sockets[0].getsockname()
        ws = next(iter(self._ws_server.sockets)).getsockname()
        self._expire_task = asyncio.create_task(self._expire_loop())
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

    def _rebuild_dedup(self) -> None:
        """Every LogTK event id committed within the window, read back from the journal."""
        journal = self.hub.journal
        cutoff_ns = int((time.time() - self.config.dedup_window_s) * 1e9)
        end = journal.end_offset
        start = max(journal.first_offset, end - self.config.dedup_rebuild_max_records)
        # Skip whole segments that end before the window: their newest record is older.
        for seg in reversed(journal.segments()):
            if seg.base_offset <= start:
                break
            first = next(journal.read(seg.base_offset, seg.base_offset + 1), None)
            if first is not None and first.received_ns < cutoff_ns:
                start = max(start, seg.base_offset)
                break
        count = 0
        for record in journal.read(start, end):
            if record.protocol != "logtk" or record.received_ns < cutoff_ns:
                continue
            parsed = parse_event_id(record.event_id)
            if parsed is None:
                continue
            app, client_id, idem = parsed
            self.dedup.add(self.dedup.slot(app, client_id) | idem, record.received_ns / 1e9)
            count += 1
        log.info("logtk: idempotency index rebuilt from %d journal records", count)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _enter(self, listener: str) -> bool:
        if self._counts[listener] >= self.config.max_connections:
            self.hub.metrics.rejected("logtk", "too_many_connections")
            return False
        self._counts[listener] += 1
        self._gauges[listener].inc()
        return True

    def _leave(self, listener: str) -> None:
        self._counts[listener] -= 1
        self._gauges[listener].dec()

    # --- TCP ------------------------------------------------------------------------------

    async def _on_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peername = writer.get_extra_info("peername") or ("?", 0)
        peer = f"{peername[0]}:{peername[1]}"
        if not self._enter("logtk_tcp"):
            writer.close()
            return
        loop = asyncio.get_running_loop()
        conn = ServerConnection(
            self.settings,
            now=loop.time(),
            authenticate=lambda token: self.authenticate(token, peername[0]),
        )

        async def send(data: bytes) -> None:
            writer.write(data)
            await writer.drain()

        async def close() -> None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

        session = _Session(self, conn, send, "tcp", peer)
        self.sessions.add(session)
        sender = self._spawn(session.sender(close))
        ticker = self._spawn(session.ticker())
        try:
            while not conn.closed:
                await session.wait_room()
                if conn.closed:
                    break
                try:
                    data = await reader.read(256 * 1024)
                except (ConnectionError, OSError):
                    break
                if not data:
                    break
                session.handle(conn.receive_data(data, loop.time()))
        except Exception:
            log.exception("tcp %s: internal error", peer)
            conn.close(CloseCode.INTERNAL_ERROR, "internal error")
        finally:
            session.wake.set()
            if not conn.closed:
                conn.close(CloseCode.NO_ACK, None)  # the peer is gone: stop the sender
                conn.data_to_send()
                session.wake.set()
            ticker.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(sender), timeout=5)
            self.sessions.discard(session)
            self._leave("logtk_tcp")

    # --- WebSocket ------------------------------------------------------------------------

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
        if not known and not (c.wildcard_namespace and _APP_NAME.match(namespace)):
            return self._reject(connection, http.HTTPStatus.NOT_FOUND, "unknown_namespace")
        if self._counts["logtk_ws"] >= c.max_connections:
            return self._reject(
                connection, http.HTTPStatus.SERVICE_UNAVAILABLE, "too_many_connections"
            )
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
        if not self._enter("logtk_ws"):
            await ws.close()
            return
        loop = asyncio.get_running_loop()
        conn = ServerConnection(self.settings, now=loop.time(), app=namespace)

        async def close() -> None:
            await ws.close()

        session = _Session(self, conn, ws.send, "ws", peer)
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
                except ConnectionClosed as exc:
                    if exc.sent is not None and exc.sent.code == WSCloseCode.MESSAGE_TOO_BIG:
                        # Over max_frame_bytes the WebSocket layer itself refuses the message.
                        self.hub.metrics.rejected("logtk", "ws_message_too_big")
                        log.warning("ws %s: a message over max_frame_bytes; closed 1009", peer)
                    break
                if isinstance(message, str):
                    # LogTK is binary; a text message cannot be a frame stream.
                    self.hub.metrics.rejected("logtk", "text_message")
                    conn.close(CloseCode.MALFORMED, "malformed frame received")
                    session.wake.set()
                    break
                session.handle(conn.receive_data(message, loop.time()))
        except Exception:
            log.exception("ws %s: internal error", peer)
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
            self._leave("logtk_ws")


def create_service(hub: Hub, section: LogTKConfig) -> LogTKService:
    return LogTKService(hub, section)
