"""Failed TLS handshakes on the Lumberjack listener (servers/tlsaccept.py), over real TLS: each
is counted by cause and logged with the peer's address at once (issue 27)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

from taproom.clients.lumberjack import LumberjackClient, client_ssl_context
from taproom.servers.tlsaccept import tls_refusal
from tests.support import running_app
from tests.tlsutil import TLSFiles, make_tls


def _client_context(tls: TLSFiles, case: str, other: TLSFiles) -> ssl.SSLContext | None:
    if case == "plaintext":
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(cafile=tls.ca)
    if case == "wrong_ca":
        ctx.load_cert_chain(other.client_cert, other.client_key)
    elif case == "expired":
        ctx.load_cert_chain(tls.client_expired_cert, tls.client_key)
    elif case == "tls_1_0":
        ctx.load_cert_chain(tls.client_cert, tls.client_key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            ctx.minimum_version = ctx.maximum_version = ssl.TLSVersion.TLSv1
        ctx.set_ciphers("ALL:@SECLEVEL=0")  # OpenSSL 3 offers TLS 1.0 only at level 0
    return ctx


def _attempt(address: tuple[str, int], ctx: ssl.SSLContext | None) -> int:
    """One connection that fails its handshake; returns its local port (the peer's port in
    the hub's log line)."""
    sock = socket.create_connection(address, timeout=10)
    port = int(sock.getsockname()[1])
    try:
        if ctx is None:
            sock.sendall(b"2W\x00\x00\x00\x01")  # plain Lumberjack on the TLS port
            sock.recv(10)
        else:
            with ctx.wrap_socket(sock, server_hostname="localhost") as tls:
                tls.sendall(b"2W\x00\x00\x00\x01")
                tls.recv(10)  # TLS 1.3: a refused client certificate shows here
    except (OSError, ssl.SSLError):
        pass
    finally:
        sock.close()
    return port


CASES = {
    "no_certificate": "tls_no_certificate",
    "wrong_ca": "tls_unknown_ca",
    "expired": "tls_expired_certificate",
    "tls_1_0": "tls_protocol_version",
    "plaintext": "tls_plaintext",
}


async def test_tls_failures_are_logged_with_peer_and_cause_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tls = make_tls(tmp_path)
    other = make_tls(tmp_path / "other")
    cfg = {
        "tls_cert": str(tls.cert),
        "tls_key": str(tls.key_pkcs8),
        "tls_ca": str(tls.ca),
        "tls_client_auth": "required",
    }
    caplog.set_level(logging.WARNING, logger="taproom.access")
    async with running_app(tmp_path, enable=["lumberjack"], lumberjack=cfg) as app:
        host, port = app.addresses["lumberjack"].rsplit(":", 1)
        address = (host, int(port))
        registry = app.hub.metrics.registry
        late = {}
        for case, reason in CASES.items():
            ctx = _client_context(tls, case, other)
            local_port = await asyncio.to_thread(_attempt, address, ctx)
            expected = f"lumberjack: refused 127.0.0.1:{local_port}: {reason}"
            done = time.monotonic()
            while not any(r.getMessage().startswith(expected) for r in caplog.records):
                if time.monotonic() - done > 1.0:
                    late[case] = [r.getMessage() for r in caplog.records]
                    break
                await asyncio.sleep(0.01)
            labels = {"listener": "lumberjack", "reason": reason}
            assert (
                registry.get_sample_value("taproom_access_refused_connections_total", labels) == 1
            ), case
        assert late == {}

        # The gate's slots of the failed handshakes are free, and a good client is served.
        def good() -> int:
            ctx = client_ssl_context(str(tls.ca), str(tls.client_cert), str(tls.client_key))
            with LumberjackClient(
                host, int(port), ssl_context=ctx, server_hostname="localhost"
            ) as c:
                return c.send([{"m": i} for i in range(10)])

        assert await asyncio.to_thread(good) == 10
        service: Any = app.services["lumberjack"]
        assert service.gate.open_connections <= 1 and service.handshaking == set()


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (TimeoutError(), "tls_handshake_timeout"),
        (
            ConnectionAbortedError("SSL handshake is taking longer than 1 seconds"),
            "tls_handshake_timeout",
        ),
        (ConnectionResetError(), "tls_peer_closed"),
        (ValueError("?"), "tls_handshake_failed"),
    ],
)
def test_refusal_reasons_of_other_failures(exc: BaseException, reason: str) -> None:
    assert tls_refusal(exc)[0] == reason
