"""The token rule: bearer header or login cookie for all but /health; validate refuses exposure."""

from __future__ import annotations

import subprocess
import sys

import pytest
from aiohttp import ClientSession, CookieJar

from taproom.config import load_config
from taproom.errors import ConfigError
from tests.support import running_app

TOKEN = "s3cret-token"


async def test_token_required_except_health(tmp_path):
    async with running_app(tmp_path, web={"token": TOKEN}) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession() as http:
            async with http.get(f"{base}/health") as r:
                assert r.status == 200
            for path in ("/metrics", "/ready", "/api/overview"):
                async with http.get(f"{base}{path}") as r:
                    assert r.status == 401, path
                    assert (await r.json())["error"] == "unauthorized"
            async with http.get(f"{base}/metrics", headers={"Authorization": "Bearer nope"}) as r:
                assert r.status == 401
            bearer = {"Authorization": f"Bearer {TOKEN}"}
            async with http.get(f"{base}/metrics", headers=bearer) as r:
                assert r.status == 200
            async with http.get(
                f"{base}/", headers={"Accept": "text/html"}, allow_redirects=False
            ) as r:
                assert r.status == 303 and r.headers["Location"] == "/login"
        registry = app.hub.metrics.registry
        assert (
            registry.get_sample_value(
                "taproom_web_requests_calls_total", {"reason": "unauthorized"}
            )
            == 4
        )


async def test_login_form_sets_a_session_cookie(tmp_path):
    async with running_app(tmp_path, web={"token": TOKEN}) as app:
        base = f"http://{app.addresses['web']}"
        async with ClientSession(cookie_jar=CookieJar(unsafe=True)) as http:  # jar: IP hosts too
            async with http.post(
                f"{base}/login", data={"token": "wrong"}, allow_redirects=False
            ) as r:
                assert r.status == 303 and r.headers["Location"] == "/login?failed=1"
            async with http.get(f"{base}/metrics") as r:
                assert r.status == 401
            async with http.post(
                f"{base}/login", data={"token": TOKEN}, allow_redirects=False
            ) as r:
                assert r.status == 303
                cookie = r.cookies["taproom_session"]
                assert cookie["httponly"] and cookie["samesite"] == "Strict"
                assert TOKEN not in cookie.value
            async with http.get(f"{base}/metrics") as r:  # the jar sends the cookie now
                assert r.status == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "example.org"])
def test_non_loopback_host_needs_a_token(host):
    with pytest.raises(ConfigError) as caught:
        load_config(text=f'[web]\nhost = "{host}"\n', env={})
    assert "token" in str(caught.value)
    load_config(text=f'[web]\nhost = "{host}"\ntoken = "t"\n', env={})


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost", "127.0.0.5"])
def test_loopback_host_needs_no_token(host):
    load_config(text=f'[web]\nhost = "{host}"\n', env={})


def test_validate_refuses_an_exposed_console_without_a_token(tmp_path):
    config = tmp_path / "taproom.toml"
    config.write_text('[web]\nhost = "0.0.0.0"\n')
    done = subprocess.run(
        [sys.executable, "-m", "taproom", "validate", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 78
    assert "token" in done.stderr + done.stdout


def _logins(app, reason):  # type: ignore[no-untyped-def]
    value = app.hub.metrics.registry.get_sample_value(
        "taproom_web_logins_calls_total", {"reason": reason}
    )
    return value or 0


def _from(address: str) -> ClientSession:
    """A client whose connections come from ``address`` (loopback has all of 127/8)."""
    from aiohttp import TCPConnector

    connector = TCPConnector(local_addr=(address, 0), force_close=True)
    return ClientSession(connector=connector, cookie_jar=CookieJar(unsafe=True))


async def test_50_wrong_logins_from_one_address_are_throttled(tmp_path):
    """Issue 27: the form took ~1,400 wrong tokens a second. Past a few failures an address
    waits, twice as long each time (429 before that, its token not even read); another
    address signs in at once."""
    async with running_app(tmp_path, web={"token": TOKEN}) as app:
        base = f"http://{app.addresses['web']}"
        statuses = []
        async with _from("127.0.0.2") as guesser:
            for i in range(50):
                async with guesser.post(
                    f"{base}/login", data={"token": f"guess-{i}"}, allow_redirects=False
                ) as r:
                    statuses.append(r.status)
                    if r.status == 429:
                        assert int(r.headers["Retry-After"]) >= 1
            assert statuses[:5] == [303] * 5  # typos are free
            assert statuses.count(429) >= 40
            assert _logins(app, "failed") + _logins(app, "throttled") == 50
            assert _logins(app, "throttled") == statuses.count(429)
            # The right token from the throttled address waits too.
            async with guesser.post(
                f"{base}/login", data={"token": TOKEN}, allow_redirects=False
            ) as r:
                assert r.status == 429
        async with _from("127.0.0.3") as operator:
            async with operator.post(
                f"{base}/login", data={"token": TOKEN}, allow_redirects=False
            ) as r:
                assert r.status == 303 and r.headers["Location"] == "/"
            async with operator.get(f"{base}/metrics") as r:
                assert r.status == 200
        assert _logins(app, "ok") == 1


async def test_sessions_are_random_expire_and_end_at_logout(tmp_path):
    async with running_app(tmp_path, web={"token": TOKEN, "session_ttl_s": 60}) as app:
        base = f"http://{app.addresses['web']}"
        cookies = []
        for _ in range(2):
            async with (
                ClientSession(cookie_jar=CookieJar(unsafe=True)) as http,
                http.post(f"{base}/login", data={"token": TOKEN}, allow_redirects=False) as r,
            ):
                cookie = r.cookies["taproom_session"]
                assert cookie["max-age"] == "60" and not cookie["secure"]
                cookies.append(cookie.value)
        assert cookies[0] != cookies[1]  # not a fixed function of the token
        async with ClientSession() as http:

            async def status(session: str) -> int:
                async with http.get(f"{base}/metrics", cookies={"taproom_session": session}) as r:
                    return r.status

            assert await status(cookies[0]) == 200 and await status(cookies[1]) == 200
            assert await status("made-up") == 401
            # Logging out ends that session only.
            async with http.post(
                f"{base}/logout", cookies={"taproom_session": cookies[0]}, allow_redirects=False
            ) as r:
                assert r.status == 303 and r.headers["Location"] == "/login"
            assert await status(cookies[0]) == 401 and await status(cookies[1]) == 200
            # An hour later (the store's clock moved on past the 60 s) the other has expired.
            sessions = app._web.sessions
            real = sessions.clock
            sessions.clock = lambda: real() + 3600
            assert await status(cookies[1]) == 401
            assert len(sessions) == 0


async def test_secure_cookies_behind_a_tls_proxy(tmp_path):
    async with running_app(tmp_path, web={"token": TOKEN, "secure_cookies": True}) as app:
        base = f"http://{app.addresses['web']}"
        async with (
            ClientSession(cookie_jar=CookieJar(unsafe=True)) as http,
            http.post(f"{base}/login", data={"token": TOKEN}, allow_redirects=False) as r,
        ):
            assert r.cookies["taproom_session"]["secure"]
