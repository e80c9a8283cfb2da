"""LogTK client (asyncio and sync), a ``logging.Handler``, and ``taproom send logtk``.

:class:`LogTKClient` speaks LogTK over WebSocket or raw TCP with
:class:`taproom.protocols.logtk.ClientConnection`: the full handshake, pongs, a resend of
every unacknowledged data frame each second with the same idempotency token, reconnection,
and an optional on-disk cache (``cache_path``) of unacknowledged data replayed with the same
tokens after a restart. The cache also keeps the client id and the next idem, so a restarted
client never reuses a token the hub still remembers for earlier data.

Adopting taproom from an application is one line::

    logging.getLogger().addHandler(LogTKHandler("tcp", "127.0.0.1", 7081, token=TOKEN))
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import logging
import os
import random
import struct
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import orjson

from ..protocols.logtk import (
    TOKEN_BYTES,
    AckReceived,
    AuthDenied,
    ClientConnection,
    CloseReceived,
    Ready,
    encode_log_entry,
)

__all__ = ["LogTKClient", "LogTKHandler", "SyncLogTKClient", "load_token", "register_send"]

log = logging.getLogger("taproom.clients.logtk")

_REC = struct.Struct("<cII")  # op, idem (or value), length of what follows


def load_token(path: str | os.PathLike[str]) -> bytes:
    """A token file holds the 64-byte token raw, as base64 or as hex (one line)."""
    raw = Path(path).read_bytes()
    if len(raw) == TOKEN_BYTES:
        return raw
    text = raw.strip()
    for decode in (bytes.fromhex, lambda t: base64.b64decode(t, validate=True)):
        with contextlib.suppress(ValueError, binascii.Error):
            token = decode(text.decode("ascii"))
            if len(token) == TOKEN_BYTES:
                return token
    raise ValueError(f"{path}: not a {TOKEN_BYTES}-byte token (raw, hex or base64)")


class _DiskCache:
    """Append-only record of sent (D) and acked (A) frames plus the next idem (N)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.client_id: int | None = None
        self.next_idem: int | None = None
        self.entries: OrderedDict[int, bytes] = OrderedDict()
        self._appended = 0
        if os.path.exists(path):
            self._load()
        self._file = open(path, "ab")  # noqa: SIM115 -- lives as long as the client

    def _load(self) -> None:
        data = Path(self.path).read_bytes()
        pos = 0
        while pos + _REC.size <= len(data):
            op, value, length = _REC.unpack_from(data, pos)
            body = data[pos + _REC.size : pos + _REC.size + length]
            if len(body) < length:
                break  # a torn last record: everything before it stands
            pos += _REC.size + length
            if op == b"D":
                self.entries[value] = body
            elif op == b"A":
                self.entries.pop(value, None)
            elif op == b"N":
                self.next_idem = value
            elif op == b"C":
                self.client_id = value

    def add(self, idem: int, data: bytes) -> None:
        self._file.write(_REC.pack(b"D", idem, len(data)) + data)

    def acked(self, idems: tuple[int, ...]) -> None:
        self._file.write(b"".join(_REC.pack(b"A", idem, 0) for idem in idems))
        self._appended += len(idems)

    def meta(self, client_id: int, next_idem: int) -> None:
        self._file.write(_REC.pack(b"C", client_id, 0) + _REC.pack(b"N", next_idem, 0))

    def flush(self) -> None:
        self._file.flush()

    def compact(self, client_id: int, next_idem: int, unacked: dict[int, bytes]) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_REC.pack(b"C", client_id, 0) + _REC.pack(b"N", next_idem, 0))
            for idem, data in unacked.items():
                f.write(_REC.pack(b"D", idem, len(data)) + data)
            f.flush()
            os.fsync(f.fileno())
        self._file.close()
        os.replace(tmp, self.path)
        self._file = open(self.path, "ab")  # noqa: SIM115
        self._appended = 0

    @property
    def needs_compaction(self) -> bool:
        return self._appended > 100_000

    def close(self) -> None:
        self._file.close()


class LogTKClient:
    """asyncio LogTK client. ``await send(data)`` queues; ``await flush()`` waits for acks."""

    def __init__(
        self,
        transport: str,
        host: str,
        port: int,
        *,
        token: bytes,
        app: str = "",
        client_id: int | None = None,
        format: str = "json",
        cache_path: str | None = None,
        resend_interval: float = 1.0,
        max_in_flight: int = 1024,
        ping_min_delta_ms: int = 1000,
        path_prefix: str = "/logging/",
        reconnect_delay: float = 0.2,
    ) -> None:
        if transport not in ("ws", "tcp"):
            raise ValueError("transport is 'ws' or 'tcp'")
        if len(token) != TOKEN_BYTES and transport == "tcp":
            raise ValueError(f"the token must be {TOKEN_BYTES} bytes")
        self.transport = transport
        self.host = host
        self.port = port
        self.token = token
        self.app = app
        self.format = format
        self.resend_interval = resend_interval
        self.max_in_flight = max_in_flight
        self.ping_min_delta_ms = ping_min_delta_ms
        self.path_prefix = path_prefix
        self.reconnect_delay = reconnect_delay
        self._cache = _DiskCache(cache_path) if cache_path else None
        cached_id = self._cache.client_id if self._cache else None
        self.client_id = client_id if client_id is not None else cached_id or random.getrandbits(32)
        self.unacked: OrderedDict[int, tuple[bytes, float]] = OrderedDict()
        start = self._cache.next_idem if self._cache else None
        self._next_idem = start if start is not None else random.getrandbits(32)
        if self._cache is not None:
            for idem, data in self._cache.entries.items():
                self.unacked[idem] = (data, 0.0)
            self._cache.compact(self.client_id, self._next_idem, self._cache.entries)
            self._cache.entries.clear()
        self.acked = 0
        self.connects = 0
        self.auth_denied = False
        self._conn: ClientConnection | None = None
        self._write: Any = None
        self._room = asyncio.Event()
        self._all_acked = asyncio.Event()
        self._ready = asyncio.Event()
        self._closing = False
        self._runner: asyncio.Task[None] | None = None
        self._update_events()

    # --- public ---------------------------------------------------------------------------

    async def start(self) -> LogTKClient:
        self._runner = asyncio.create_task(self._run())
        return self

    async def wait_ready(self, timeout: float = 10.0) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    async def send(self, data: bytes) -> int:
        """Queue one serialized entry; waits while ``max_in_flight`` frames are unacked."""
        while not self._room.is_set():
            await self._room.wait()
        idem = self._next_idem
        while idem in self.unacked:
            idem = (idem + 1) & 0xFFFFFFFF
        self._next_idem = (idem + 1) & 0xFFFFFFFF
        self.unacked[idem] = (data, time.monotonic())
        if self._cache is not None:
            self._cache.add(idem, data)
        self._update_events()
        conn = self._conn
        if conn is not None and conn.ready:
            conn.send(idem, data)
            self._flush_soon()
        return idem

    async def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued entry has been acknowledged."""
        await asyncio.wait_for(self._all_acked.wait(), timeout)

    async def close(self, timeout: float = 5.0) -> None:
        """Flush (up to ``timeout``), send ``close 0x80 "client exiting"``, stop."""
        with contextlib.suppress(TimeoutError):
            await self.flush(timeout)
        self._closing = True
        conn = self._conn
        if conn is not None and not conn.closed:
            conn.close()
            await self._write_pending()
        if self._runner is not None:
            self._runner.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._runner
        if self._cache is not None:
            self._cache.compact(
                self.client_id, self._next_idem, {i: d for i, (d, _) in self.unacked.items()}
            )
            self._cache.close()

    async def __aenter__(self) -> LogTKClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- internals ------------------------------------------------------------------------

    def _update_events(self) -> None:
        if len(self.unacked) < self.max_in_flight:
            self._room.set()
        else:
            self._room.clear()
        if self.unacked:
            self._all_acked.clear()
        else:
            self._all_acked.set()

    def _flush_soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(
                lambda: asyncio.ensure_future(self._write_pending())
            )

    _flush_scheduled = False
    _closer: asyncio.Future[None] | None = None

    async def _write_pending(self) -> None:
        self._flush_scheduled = False
        conn = self._conn
        if conn is None or self._write is None:
            return
        out = conn.data_to_send()
        if out:
            if self._cache is not None:
                self._cache.flush()
            with contextlib.suppress(Exception):
                await self._write(out)

    async def _run(self) -> None:
        while not self._closing:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                status = getattr(getattr(exc, "response", None), "status_code", None)
                if status in (401, 404):
                    self.auth_denied = True  # the upgrade was refused: retrying cannot help
                    log.error("logtk client: WebSocket upgrade refused with %s", status)
                log.debug("logtk client: connection lost: %r", exc)
            self._conn = None
            self._write = None
            self._ready.clear()
            if self.auth_denied or self._closing:
                return
            await asyncio.sleep(self.reconnect_delay)

    async def _session(self) -> None:
        loop = asyncio.get_running_loop()
        if self.transport == "tcp":
            reader, writer = await asyncio.open_connection(self.host, self.port)

            async def write(data: bytes) -> None:
                writer.write(data)
                await writer.drain()

            async def read() -> bytes:
                return await reader.read(65536)

            def close() -> None:
                writer.close()

        else:
            from websockets.asyncio.client import connect

            ws = await connect(
                f"ws://{self.host}:{self.port}{self.path_prefix}{self.app}",
                subprotocols=["logtk"],  # type: ignore[list-item]
                additional_headers={"X-LogTK-Auth": base64.b64encode(self.token).decode()},
                max_size=None,
            )

            async def write(data: bytes) -> None:
                await ws.send(data)

            async def read() -> bytes:
                try:
                    message = await ws.recv()
                except Exception:
                    return b""
                return message if isinstance(message, bytes) else message.encode()

            def close() -> None:
                self._closer = asyncio.ensure_future(ws.close())

        self.connects += 1
        conn = ClientConnection(
            self.transport,
            self.client_id,
            now=loop.time(),
            token=self.token if self.transport == "tcp" else None,
            format=self.format,
            ping_min_delta_ms=self.ping_min_delta_ms,
        )
        self._conn = conn
        self._write = write
        resender = asyncio.create_task(self._resend_loop(conn, close))
        try:
            await write(conn.data_to_send())
            while not conn.closed:
                data = await read()
                if not data:
                    break
                for event in conn.receive_data(data, loop.time()):
                    if isinstance(event, AckReceived):
                        self._on_acks(event.idems)
                    elif isinstance(event, Ready):
                        self._ready.set()
                        for idem, (payload, _) in self.unacked.items():
                            conn.send(idem, payload)
                            self.unacked[idem] = (payload, loop.time())
                    elif isinstance(event, AuthDenied):
                        self.auth_denied = True
                        log.error("logtk client: authentication refused")
                    elif isinstance(event, CloseReceived):
                        log.debug("logtk client: server closed (%s %s)", event.code, event.reason)
                await self._write_pending()
        finally:
            resender.cancel()
            close()

    def _on_acks(self, idems: tuple[int, ...]) -> None:
        done = []
        for idem in idems:
            if self.unacked.pop(idem, None) is not None:
                done.append(idem)
        self.acked += len(done)
        if self._cache is not None and done:
            self._cache.acked(tuple(done))
            if self._cache.needs_compaction:
                self._cache.compact(
                    self.client_id,
                    self._next_idem,
                    {i: d for i, (d, _) in self.unacked.items()},
                )
        self._update_events()

    async def _resend_loop(self, conn: ClientConnection, close: Any) -> None:
        """Every unacked frame older than ``resend_interval`` goes out again, same idem."""
        loop = asyncio.get_running_loop()
        while not conn.closed:
            await asyncio.sleep(min(self.resend_interval, 0.25))
            now = loop.time()
            if conn.tick(now):  # ConnectionDead: no ping in twice the interval
                log.info("logtk client: no ping from the server; reconnecting")
                close()
                return
            if not conn.ready:
                continue
            cutoff = now - self.resend_interval
            for idem, (payload, sent) in list(self.unacked.items()):
                if sent <= cutoff:
                    conn.send(idem, payload)
                    self.unacked[idem] = (payload, now)
            await self._write_pending()


# --- sync wrapper and logging handler -------------------------------------------------------


class SyncLogTKClient:
    """:class:`LogTKClient` on its own event loop thread, for code without asyncio."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()

        async def make() -> LogTKClient:
            return await LogTKClient(*args, **kwargs).start()

        self.client = asyncio.run_coroutine_threadsafe(make(), self._loop).result()
        self.max_queued = 10 * self.client.max_in_flight
        self._queued = 0
        self.dropped = 0
        self._lock = threading.Lock()

    def send(self, data: bytes, wait: bool = True) -> bool:
        """Queue ``data``. With ``wait=False`` (the logging handler) never block: while the
        hub is unreachable and ``max_queued`` entries already wait for room, drop and count
        (``dropped``) rather than stall the application."""
        if not wait:
            with self._lock:
                if self._queued >= self.max_queued:
                    self.dropped += 1
                    return False
                self._queued += 1
        future = asyncio.run_coroutine_threadsafe(self.client.send(data), self._loop)
        if wait:
            future.result()
        else:
            future.add_done_callback(self._sent)
        return True

    def _sent(self, _future: object) -> None:
        with self._lock:
            self._queued -= 1

    def flush(self, timeout: float | None = None) -> None:
        asyncio.run_coroutine_threadsafe(self.client.flush(timeout), self._loop).result()

    def close(self, timeout: float = 5.0) -> None:
        async def shutdown() -> None:
            await self.client.close(timeout)
            # Sends still waiting for room (the hub was unreachable) are abandoned here: they
            # never entered the unacked set or the disk cache.
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()


class LogTKHandler(logging.Handler):
    """Ships log records as ``LogEntry`` protobufs (or JSON) through a LogTK client."""

    def __init__(
        self,
        transport: str,
        host: str,
        port: int,
        *,
        token: bytes,
        app: str = "",
        format: str = "protobuf",
        level: int = logging.NOTSET,
        **client_kwargs: Any,
    ) -> None:
        super().__init__(level)
        self.format_name = format
        self.client = SyncLogTKClient(
            transport, host, port, token=token, app=app, format=format, **client_kwargs
        )

    def serialize(self, record: logging.LogRecord) -> bytes:
        message = self.format(record)
        fields = {"logger": record.name, "thread": record.threadName or ""}
        trace = {"file": record.pathname, "line": record.lineno, "col": 0}
        time_ms = int(record.created * 1000)
        if self.format_name == "json":
            return orjson.dumps(
                {
                    "time": time_ms,
                    "level": record.levelno,
                    "message": message,
                    "trace": trace,
                    "fields": fields,
                }
            )
        return encode_log_entry(
            time_ms=time_ms, level=record.levelno, message=message, trace=trace, fields=fields
        )

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.client.send(self.serialize(record), wait=False)
        except Exception:
            self.handleError(record)

    def flush(self) -> None:
        with contextlib.suppress(Exception):
            self.client.flush(5.0)

    def close(self) -> None:
        self.client.close()
        super().close()


# --- CLI ------------------------------------------------------------------------------------


def register_send(subparsers: Any) -> None:
    p = subparsers.add_parser("logtk", help="send events over LogTK (WebSocket or TCP)")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--ws", action="store_true", help="WebSocket (default port 7080)")
    mode.add_argument("--tcp", action="store_true", help="raw TCP (default port 7081)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--app", required=True, help="the app (WebSocket path /logging/<app>)")
    p.add_argument("--token-file", required=True, help="64-byte token: raw, hex or base64")
    p.add_argument("--count", type=int, default=1, help="events to send")
    p.add_argument("--format", default="json", choices=("json", "protobuf", "bson"))
    p.add_argument("--message", default="hello from taproom send logtk")
    p.add_argument("--client-id", type=lambda s: int(s, 0), default=None)
    p.add_argument("--cache", default=None, help="on-disk cache of unacked data")
    p.add_argument("--timeout", type=float, default=30.0)
    p.set_defaults(func=_cmd_send)


def _payload(fmt: str, i: int, message: str) -> bytes:
    now_ms = int(time.time() * 1000)
    if fmt == "protobuf":
        return encode_log_entry(time_ms=now_ms, level=20, message=f"{message} #{i}")
    if fmt == "bson":
        import datetime

        import bson

        return bson.encode(
            {
                "$level": 20,
                "$message": f"{message} #{i}",
                "$time": datetime.datetime.now(datetime.UTC),
            }
        )
    return orjson.dumps({"time": now_ms, "level": 20, "message": f"{message} #{i}", "n": i})


def _cmd_send(args: argparse.Namespace) -> int:
    transport = "ws" if args.ws else "tcp"
    port = args.port if args.port is not None else (7080 if args.ws else 7081)
    token = load_token(args.token_file)

    async def main() -> int:
        client = LogTKClient(
            transport,
            args.host,
            port,
            token=token,
            app=args.app,
            format=args.format,
            client_id=args.client_id,
            cache_path=args.cache,
        )
        await client.start()
        started = time.monotonic()
        for i in range(args.count):
            await client.send(_payload(args.format, i, args.message))
            if client.auth_denied:
                break
        try:
            await client.flush(args.timeout)
        except TimeoutError:
            pass
        acked = client.acked
        await client.close(0)
        elapsed = time.monotonic() - started
        if client.auth_denied:
            print("taproom: logtk: authentication refused", file=sys.stderr)
            return 1
        print(f"sent {args.count}, acked {acked} in {elapsed:.2f}s")
        return 0 if acked == args.count else 1

    return asyncio.run(main())
