"""The console's access rule: with ``[web] token`` set, every path but ``/health`` needs it.

A script sends ``Authorization: Bearer <token>``; a browser signs in once through the login
form and then carries a session cookie (HttpOnly, SameSite=Strict, ``Secure`` when the request
came over TLS or ``[web] secure_cookies`` says a TLS proxy is in front). The cookie holds a
random session id (:class:`Sessions`), never the token or anything derived from it: a session
ends after ``session_ttl_s``, at ``POST /logout``, and with the process (sessions live in
memory, so the restart that changes the token ends all of them).

Failed sign-ins are throttled per client address (:class:`LoginThrottle`): after
``login_free_failures`` the address must wait, twice as long after each further failure (up to
``login_backoff_max_s``), and a try before that gets 429 without its token being looked at.
Another address is not affected. The login page and the static assets (public code, no data)
are open so that the form can load. ``taproom validate`` refuses a non-loopback ``[web] host``
without a token or an allowlist (:mod:`taproom.access`).
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .server import WebServer

__all__ = ["COOKIE", "LoginThrottle", "Sessions", "add_routes", "check"]

COOKIE = "taproom_session"
_OPEN_PATHS = frozenset({"/health", "/login", "/logout"})


class Sessions:
    """Signed-in browsers: random ids with an absolute expiry, at most ``max_sessions``
    (the oldest goes first). ``clock`` is monotonic seconds."""

    def __init__(
        self, ttl_s: float, max_sessions: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self.clock = clock
        self._expiry: OrderedDict[str, float] = OrderedDict()  # id -> expiry, oldest first

    def __len__(self) -> int:
        return len(self._expiry)

    def create(self) -> str:
        session = secrets.token_urlsafe(32)  # 256 random bits
        self._expiry[session] = self.clock() + self.ttl_s
        while len(self._expiry) > self.max_sessions:
            self._expiry.popitem(last=False)
        return session

    def valid(self, session: str) -> bool:
        expiry = self._expiry.get(session)
        if expiry is None:
            return False
        if self.clock() >= expiry:
            del self._expiry[session]
            return False
        return True

    def end(self, session: str) -> None:
        self._expiry.pop(session, None)


class LoginThrottle:
    """Failed sign-ins per client address, with exponential backoff past a free few."""

    def __init__(
        self,
        free_failures: int,
        backoff_s: float,
        backoff_max_s: float,
        max_addresses: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free_failures = free_failures
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_addresses = max_addresses
        self.clock = clock
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()  # count, last

    def wait_s(self, address: str) -> float:
        """Seconds ``address`` must still wait before its next try is looked at (0: now)."""
        failures, last = self._failures.get(address, (0, 0.0))
        if failures < self.free_failures:
            return 0.0
        # 2 ** exponent overflows nothing: the exponent stops growing at the cap.
        exponent = min(failures - self.free_failures, 64)
        delay = min(self.backoff_s * 2.0**exponent, self.backoff_max_s)
        return max(0.0, last + delay - self.clock())

    def failed(self, address: str) -> None:
        failures, _ = self._failures.pop(address, (0, 0.0))
        self._failures[address] = (failures + 1, self.clock())
        while len(self._failures) > self.max_addresses:
            self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)


def _authorized(server: WebServer, token: str, request: web.Request) -> bool:
    header = request.headers.get("Authorization", "")
    if header.startswith("Bearer ") and hmac.compare_digest(
        header[len("Bearer ") :].encode(), token.encode()
    ):
        return True
    session = request.cookies.get(COOKIE, "")
    return bool(session) and server.sessions.valid(session)


def check(server: WebServer, request: web.Request) -> web.StreamResponse | None:
    """None when ``request`` may go on, else the refusal to send."""
    token = server.config.token
    if not token or request.path in _OPEN_PATHS or request.path.startswith("/static/"):
        return None
    if _authorized(server, token, request):
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
    cfg = server.config
    logins = server.hub.metrics.counter(
        "web", "logins", "calls", "Sign-ins through the login form, by outcome", ("reason",)
    )

    async def login_page(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(static / "login.html")

    async def login(request: web.Request) -> web.StreamResponse:
        token = cfg.token
        address = request.remote or ""
        wait = server.throttle.wait_s(address)
        if token and wait > 0:
            # Refused before the token is read: a guesser learns nothing, and costs nothing.
            logins.labels(reason="throttled").inc()
            seconds = math.ceil(wait)
            return web.Response(
                status=429,
                text=f"too many failed sign-ins from this address: try again in {seconds} s\n",
                headers={"Retry-After": str(seconds)},
            )
        form = await request.post()
        given = form.get("token")
        if not token or not isinstance(given, str):
            raise web.HTTPSeeOther("/")
        if not hmac.compare_digest(given.encode(), token.encode()):
            server.throttle.failed(address)
            logins.labels(reason="failed").inc()
            raise web.HTTPSeeOther("/login?failed=1")
        server.throttle.succeeded(address)
        logins.labels(reason="ok").inc()
        response = web.HTTPSeeOther("/")
        response.set_cookie(
            COOKIE,
            server.sessions.create(),
            httponly=True,
            samesite="Strict",
            path="/",
            max_age=int(cfg.session_ttl_s),
            secure=request.secure or cfg.secure_cookies,
        )
        raise response

    async def logout(request: web.Request) -> web.StreamResponse:
        session = request.cookies.get(COOKIE, "")
        if session:
            server.sessions.end(session)
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        raise response

    app.router.add_get("/login", login_page)
    app.router.add_post("/login", login)
    app.router.add_post("/logout", logout)
