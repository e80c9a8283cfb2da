"""Operations endpoints: ``/metrics``, ``/health``, ``/ready``.

Their bodies, status codes and content types are those of the first, hand-written server, byte
for byte, and each reply still closes its connection (``Connection: close``) so the simple
scripts that read a reply to EOF keep working.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web

if TYPE_CHECKING:
    from .server import WebServer

__all__ = ["add_routes"]

HEALTH_BODY = b'{"status":"alive"}\n'


def _reply(status: int, body: bytes, content_type: str) -> web.Response:
    response = web.Response(status=status, body=body, headers={"Content-Type": content_type})
    response.force_close()
    return response


def add_routes(app: web.Application, server: WebServer) -> None:
    async def metrics(request: web.Request) -> web.Response:
        return _reply(200, server.hub.metrics.render(), "text/plain; version=0.0.4")

    async def health(request: web.Request) -> web.Response:
        return _reply(200, HEALTH_BODY, "application/json")

    async def ready(request: web.Request) -> web.Response:
        reasons = server.readiness()
        # degraded: what an operator must see that does not make the hub unready (quarantined
        # journal damage, with its offsets).
        degraded = server.hub.degraded()
        body = orjson.dumps({"ready": not reasons, "reasons": reasons, "degraded": degraded})
        body += b"\n"
        return _reply(503 if reasons else 200, body, "application/json")

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
