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
