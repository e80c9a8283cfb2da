"""Operations endpoints over HTTP/1.1: ``/metrics``, ``/health``, ``/ready``.

A deliberately small asyncio server: GET only, one request per connection, request head bounded
to 8 KiB and read within 5 s. Anything else gets the proper 4xx and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

import orjson

from ..metrics import Metrics

__all__ = ["OpsServer"]

# A scraper's request head is a few hundred bytes; 8 KiB leaves room for long headers.
MAX_HEAD_BYTES = 8192
HEAD_TIMEOUT_S = 5.0


class OpsServer:
    def __init__(
        self,
        metrics: Metrics,
        readiness: Callable[[], list[str]],
        host: str,
        port: int,
        max_connections: int = 64,
    ) -> None:
        self.metrics = metrics
        self.readiness = readiness
        self.host = host
        self.port = port
        self._slots = asyncio.Semaphore(max_connections)
        self._server: asyncio.Server | None = None
        self._m_requests = metrics.counter(
            "web", "requests", "calls", "HTTP requests by outcome", ("reason",)
        )

    async def start(self) -> dict[str, str]:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        host, port = self._server.sockets[0].getsockname()[:2]
        return {"web": f"{host}:{port}"}

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            writer.close()
            self._m_requests.labels(reason="too_many_connections").inc()
            return
        async with self._slots:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_S)
            except (
                asyncio.LimitOverrunError,
                asyncio.IncompleteReadError,
                TimeoutError,
                ConnectionError,
            ):
                self._m_requests.labels(reason="bad_request").inc()
                await self._reply(writer, 400, b"bad request\n", "text/plain")
                return
            if len(head) > MAX_HEAD_BYTES:
                self._m_requests.labels(reason="head_too_large").inc()
                await self._reply(writer, 431, b"request header too large\n", "text/plain")
                return
            parts = head.split(b"\r\n", 1)[0].split(b" ")
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
                self._m_requests.labels(reason="bad_request").inc()
                await self._reply(writer, 400, b"bad request\n", "text/plain")
                return
            method, target = parts[0], parts[1].split(b"?", 1)[0]
            if method not in (b"GET", b"HEAD"):
                self._m_requests.labels(reason="method_not_allowed").inc()
                await self._reply(writer, 405, b"method not allowed\n", "text/plain")
                return
            if target == b"/metrics":
                self._m_requests.labels(reason="ok").inc()
                await self._reply(writer, 200, self.metrics.render(), "text/plain; version=0.0.4")
            elif target == b"/health":
                self._m_requests.labels(reason="ok").inc()
                await self._reply(writer, 200, b'{"status":"alive"}\n', "application/json")
            elif target == b"/ready":
                reasons = self.readiness()
                self._m_requests.labels(reason="ok").inc()
                body = orjson.dumps({"ready": not reasons, "reasons": reasons}) + b"\n"
                await self._reply(writer, 503 if reasons else 200, body, "application/json")
            else:
                self._m_requests.labels(reason="not_found").inc()
                await self._reply(writer, 404, b"not found\n", "text/plain")

    @staticmethod
    async def _reply(writer: asyncio.StreamWriter, status: int, body: bytes, ctype: str) -> None:
        phrase = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            431: "Request Header Fields Too Large",
            503: "Service Unavailable",
        }[status]
        head = (
            f"HTTP/1.1 {status} {phrase}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with contextlib.suppress(ConnectionError):
            writer.write(head + body)
            await writer.drain()
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
