"""The console's access rule: with ``[web] token`` set, every path but ``/health`` needs it.

A script sends ``Authorization: Bearer <token>``; a browser signs in once through the login
form and then carries a session cookie (HttpOnly, SameSite=Strict) whose value is an HMAC of
the token, so the cookie never holds the token itself and changing the token ends every
session. The login page and the static assets (public code, no data) are open so that the
form can load. ``taproom validate`` refuses a non-loopback ``[web] host`` without a token
(:class:`~taproom.config.WebConfig`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .server import WebServer

__all__ = ["COOKIE", "add_routes", "check", "session_value"]

COOKIE = "taproom_session"
_OPEN_PATHS = frozenset({"/health", "/login"})


def session_value(token: str) -> str:
    return hmac.new(token.encode(), b"taproom console session", hashlib.sha256).hexdigest()


def _authorized(token: str, request: web.Request) -> bool:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer ") and hmac.compare_digest(
        header[len("Bearer ") :].encode(), token.encode()
    ):
        return True
    cookie = request.cookies.get(COOKIE, "")
    return bool(cookie) and hmac.compare_digest(cookie.encode(), session_value(token).encode())


def check(server: WebServer, request: web.Request) -> web.StreamResponse | None:
    """None when ``request`` may go on, else the refusal to send."""
    token = server.config.token
    if not token or request.path in _OPEN_PATHS or request.path.startswith("/static/"):
        return None
    if _authorized(token, request):
        return None
    if request.method == "GET" and "text/html" in request.headers.get("Accept", ""):
        raise web.HTTPSeeOther("/login")
    return web.json_response(
        {"error": "unauthorized", "reason": "a bearer token or a session cookie is required"},
        status=401,
        headers={"WWW-Authenticate": "Bearer"},
    )


def add_routes(app: web.Application, server: WebServer) -> None:
    static = server.static_dir

    async def login_page(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(static / "login.html")

    async def login(request: web.Request) -> web.StreamResponse:
        token = server.config.token
        form = await request.post()
        given = form.get("token")
        if not token or not isinstance(given, str):
            raise web.HTTPSeeOther("/")
        if not hmac.compare_digest(given.encode(), token.encode()):
            server.count("login_failed")
            raise web.HTTPSeeOther("/login?failed=1")
        response = web.HTTPSeeOther("/")
        response.set_cookie(
            COOKIE, session_value(token), httponly=True, samesite="Strict", path="/"
        )
        raise response

    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
