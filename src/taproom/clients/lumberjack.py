"""Lumberjack v1/v2 clients (blocking and asyncio) and ``taproom send lumberjack``.

Both clients drive :class:`taproom.protocols.lumberjack.ClientSession`: events are cut into
windows of ``window_size``, each sent as ``W`` + one zlib ``C`` (or bare frames at level 0), up
to ``pipeline`` windows in flight; ``send`` blocks (backpressure) while that many are
unacknowledged and returns once every event is acknowledged. When the connection drops, the
client reconnects and resends every unacknowledged window (``resent_events`` counts them): the
server may then hold duplicates of windows it committed but could not acknowledge.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import ssl
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import orjson

from ..protocols.lumberjack import ClientSession, LumberjackError, Version, windows_of

__all__ = ["AsyncLumberjackClient", "LumberjackClient", "client_ssl_context", "register_send"]


def client_ssl_context(
    ca: str | None = None,
    cert: str | None = None,
    key: str | None = None,
    *,
    verify: bool = True,
) -> ssl.SSLContext:
    """A TLS 1.2+ client context; ``verify=False`` skips server verification (testing only)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class _Base:
    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5044,
        *,
        version: int = 2,
        window_size: int = 2048,
        compression_level: int = 3,
        pipeline: int = 2,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str | None = None,
        timeout: float = 30.0,
        reconnect_attempts: int = 10,
        reconnect_delay: float = 0.5,
    ) -> None:
        if version not in (1, 2):
            raise ValueError("version must be 1 or 2")
        if window_size < 1 or pipeline < 1:
            raise ValueError("window_size and pipeline must be at least 1")
        self.host = host
        self.port = port
        self.window_size = window_size
        self.pipeline = pipeline
        self.ssl_context = ssl_context
        self.server_hostname = server_hostname or (host if ssl_context else None)
        self.timeout = timeout
        self.reconnect_attempts = reconnect_attempts
        self.reconnect_delay = reconnect_delay
        self.session = ClientSession(
            Version.V1 if version == 1 else Version.V2, compression_level=compression_level
        )
        self.resent_events = 0
        self.reconnects = 0
        self._failures = 0

    @property
    def acked_events(self) -> int:
        return self.session.acked_events


class LumberjackClient(_Base):
    """Blocking client: ``with LumberjackClient(host, port) as c: c.send(events)``.

    v2 events are mappings (sent as JSON), ``bytes``/``str`` (sent as given, must be a JSON
    object); v1 events are mappings of strings (``D`` frames).
    """

    _sock: socket.socket | None = None

    def connect(self) -> None:
        if self._sock is not None:
            return
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_hostname)
        self._sock = sock

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def __enter__(self) -> LumberjackClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def send(self, events: Iterable[Any]) -> int:
        """Send ``events``; return once all are acknowledged (the count sent)."""
        total = 0
        for chunk in windows_of(events, self.window_size):
            while len(self.session.in_flight) >= self.pipeline:
                self._with_retry(self._read_acks)
            self._with_retry(lambda c=chunk: self._write(self.session.encode_window(c).data))
            total += len(chunk)
        self.flush()
        return total

    def flush(self) -> None:
        """Wait until every window in flight is acknowledged."""
        while self.session.in_flight:
            self._with_retry(self._read_acks)

    def _write(self, data: bytes) -> None:
        self.connect()
        assert self._sock is not None
        self._sock.sendall(data)

    def _read_acks(self) -> None:
        self.connect()
        assert self._sock is not None
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionResetError("server closed the connection")
        if self.session.receive_data(data):
            self._failures = 0

    def _with_retry(self, op: Any) -> None:
        """Run ``op``; on a broken connection reconnect and resend every unacked window.

        After a successful resend the caller's loop re-checks its condition: a failed write is
        covered because the window was already in flight, a failed read is simply repeated.
        """
        try:
            op()
            return
        except (OSError, LumberjackError):
            self.close()
            # Failures without an ack in between are bounded: a server that accepts the
            # connection but always drops it (bad client certificate) must not loop forever.
            self._failures += 1
            if self._failures > self.reconnect_attempts:
                raise
        for attempt in range(self.reconnect_attempts + 1):
            time.sleep(self.reconnect_delay)
            try:
                self.connect()
                self._resend()
                return
            except OSError:
                self.close()
                if attempt == self.reconnect_attempts:
                    raise

    def _resend(self) -> None:
        self.reconnects += 1
        self.resent_events += self.session.unacked_events()
        assert self._sock is not None
        for data in self.session.reconnected():
            self._sock.sendall(data)


class AsyncLumberjackClient(_Base):
    """asyncio client with the same behaviour: ``async with AsyncLumberjackClient(...)``."""

    _reader: asyncio.StreamReader | None = None
    _writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        if self._writer is not None:
            return
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(
                self.host,
                self.port,
                ssl=self.ssl_context,
                server_hostname=self.server_hostname,
            ),
            self.timeout,
        )

    async def close(self) -> None:
        writer, self._writer, self._reader = self._writer, None, None
        if writer is not None:
            writer.close()
            try:
                await writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass

    async def __aenter__(self) -> AsyncLumberjackClient:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def send(self, events: Iterable[Any]) -> int:
        total = 0
        for chunk in windows_of(events, self.window_size):
            while len(self.session.in_flight) >= self.pipeline:
                await self._retry_read()
            window = self.session.encode_window(chunk)
            try:
                await self.connect()
                assert self._writer is not None
                self._writer.write(window.data)
                await self._writer.drain()
            except OSError:
                await self._reconnect()  # resends this window too
            total += len(chunk)
        await self.flush()
        return total

    async def flush(self) -> None:
        while self.session.in_flight:
            await self._retry_read()

    async def _retry_read(self) -> None:
        try:
            await self.connect()
            assert self._reader is not None
            data = await asyncio.wait_for(self._reader.read(65536), self.timeout)
            if not data:
                raise ConnectionResetError("server closed the connection")
            if self.session.receive_data(data):
                self._failures = 0
        except (OSError, LumberjackError, TimeoutError):
            self._failures += 1
            if self._failures > self.reconnect_attempts:
                await self.close()
                raise
            await self._reconnect()

    async def _reconnect(self) -> None:
        await self.close()
        for attempt in range(self.reconnect_attempts + 1):
            await asyncio.sleep(self.reconnect_delay)
            try:
                await self.connect()
                assert self._writer is not None
                self.reconnects += 1
                self.resent_events += self.session.unacked_events()
                for data in self.session.reconnected():
                    self._writer.write(data)
                await self._writer.drain()
                return
            except OSError:
                await self.close()
                if attempt == self.reconnect_attempts:
                    raise


# --- taproom send lumberjack -------------------------------------------------------------------


def _stdin_events(version: int, fields: Mapping[str, str]) -> Iterator[Any]:
    for raw in sys.stdin.buffer:
        line = raw.rstrip(b"\r\n")
        if not line:
            continue
        if version == 2:
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                obj = None
            if not isinstance(obj, dict):
                obj = {"message": line.decode("utf-8", "replace")}
            if fields:
                obj.setdefault("fields", {}).update(fields)
            yield obj
        else:
            yield {"line": line.decode("utf-8", "replace"), **fields}


def _generated_events(
    count: int, version: int, size: int, fields: Mapping[str, str]
) -> Iterator[Any]:
    pad = "x" * max(0, size - 60)
    for i in range(count):
        if version == 2:
            yield {"message": f"event {i} {pad}", "n": i, "fields": dict(fields)}
        else:
            yield {"line": f"event {i} {pad}", "n": str(i), **fields}


def _cmd_send(args: argparse.Namespace) -> int:
    version = 1 if args.v1 else 2
    ctx = None
    if args.tls or args.ca or args.cert:
        ctx = client_ssl_context(args.ca, args.cert, args.key, verify=not args.insecure)
    fields = dict(f.split("=", 1) for f in args.field)
    if args.count is not None:
        events: Iterable[Any] = _generated_events(args.count, version, args.size, fields)
    else:
        events = _stdin_events(version, fields)
    started = time.monotonic()
    with LumberjackClient(
        args.host,
        args.port,
        version=version,
        window_size=args.window,
        compression_level=args.level,
        pipeline=args.pipeline,
        ssl_context=ctx,
    ) as client:
        sent = client.send(events)
    elapsed = time.monotonic() - started
    print(
        f"acked {client.acked_events} of {sent} events (v{version}) in {elapsed:.2f}s"
        f"; resent {client.resent_events}",
        file=sys.stderr,
    )
    return 0 if client.acked_events == sent else 1


def register_send(subparsers: Any) -> None:
    """``taproom send lumberjack [--v1|--v2] [--tls ...] [--count N]`` (stdin without --count)."""
    p = subparsers.add_parser(
        "lumberjack", help="send events over Lumberjack v1/v2 (stdin lines, or --count N)"
    )
    ver = p.add_mutually_exclusive_group()
    ver.add_argument("--v1", action="store_true", help="v1: D frames of string pairs")
    ver.add_argument("--v2", action="store_true", help="v2 (default): J frames of JSON")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=5044)
    p.add_argument("--count", type=int, metavar="N", help="send N generated events, not stdin")
    p.add_argument("--size", type=int, default=300, help="bytes per generated event")
    p.add_argument("--window", type=int, default=2048, help="events per window")
    p.add_argument("--level", type=int, default=3, help="zlib level, 0 = no C frames")
    p.add_argument("--pipeline", type=int, default=2, help="windows in flight")
    p.add_argument("--field", action="append", default=[], metavar="K=V", help="extra field")
    p.add_argument("--tls", action="store_true", help="connect with TLS")
    p.add_argument("--ca", metavar="PEM", help="CA bundle to verify the server")
    p.add_argument("--cert", metavar="PEM", help="client certificate")
    p.add_argument("--key", metavar="PEM", help="client key")
    p.add_argument("--insecure", action="store_true", help="do not verify the server (tests)")
    p.set_defaults(func=_cmd_send)
