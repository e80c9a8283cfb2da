"""The allowlist and the per-address limits at accept on every TCP listener (Lumberjack, LogTK
over TCP and WebSocket, web), over real sockets from loopback source addresses: the listener
allows 127.0.0.2 only; a client from 127.0.0.3 is cut off before any byte is read, counted and
logged; the allowed one is served (issue 27)."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from taproom.servers.logtk import hash_token
from tests.support import running_app

TOKEN = bytes(range(64))
LOGTK = {"apps": {"myapp": {"token_sha256": hash_token(TOKEN)}}}
UPGRADE = (
    b"GET /logging/myapp HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
    b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
    b"Sec-WebSocket-Protocol: logtk\r\nX-LogTK-Auth: " + base64.b64encode(TOKEN) + b"\r\n\r\n"
)
# What each listener's client sends first, and how its answer starts when it is served.
HELLO: dict[str, tuple[bytes, bytes]] = {
    "lumberjack": (b"2W" + struct.pack(">I", 1) + b"2J" + struct.pack(">II", 1, 2) + b"{}", b"2A"),
    "logtk_tcp": (b"\x01\x01" + TOKEN + b"\x00", bytes.fromhex("01020100")),
    "logtk_ws": (UPGRADE, b"HTTP/1.1 101"),
    "web": (b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n", b"HTTP/1.1 200"),
}
SECTION = {"lumberjack": "lumberjack", "logtk_tcp": "logtk", "logtk_ws": "logtk", "web": "web"}


def refused(app: Any, listener: str, reason: str) -> float:
    value = app.hub.metrics.registry.get_sample_value(
        "taproom_access_refused_connections_total", {"listener": listener, "reason": reason}
    )
    return value or 0.0


def exchange(address: tuple[str, int], source: str, hello: bytes, want: int) -> bytes:
    """Connect from ``source``, send ``hello``, read ``want`` bytes (or until closed)."""
    with socket.create_connection(address, timeout=10, source_address=(source, 0)) as sock:
        got = b""
        try:
            sock.sendall(hello)
            while len(got) < want:
                chunk = sock.recv(want - len(got))
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            pass
        return got


def address_of(app: Any, listener: str) -> tuple[str, int]:
    host, port = app.addresses[listener].rsplit(":", 1)
    return host, int(port)


@pytest.mark.parametrize("listener", sorted(HELLO))
async def test_allowlist_at_accept(tmp_path: Path, listener: str) -> None:
    section = SECTION[listener]
    tables: dict[str, Any] = {"access": {listener: {"allow": ["127.0.0.2"]}}}
    if section == "logtk":
        tables["logtk"] = LOGTK
    enable = [] if section == "web" else [section]
    async with running_app(tmp_path, enable=enable, **tables) as app:
        hello, answer = HELLO[listener]
        address = address_of(app, listener)
        denied = await asyncio.to_thread(exchange, address, "127.0.0.3", hello, len(answer))
        served = await asyncio.to_thread(exchange, address, "127.0.0.2", hello, len(answer))
        assert denied == b"" and served == answer
        assert refused(app, listener, "address_not_allowed") == 1


async def test_web_per_address_cap(tmp_path: Path) -> None:
    """Idle connections from one address fill its share only: its next one gets 503, while
    another address's /health is answered."""
    async with running_app(tmp_path, web={"max_connections_per_peer": 3}) as app:
        address = address_of(app, "web")

        def run() -> tuple[bytes, bytes]:
            held = []
            try:
                for _ in range(3):  # a request head begun, never finished
                    sock = socket.create_connection(address, source_address=("127.0.0.4", 0))
                    sock.sendall(b"GET /health HTTP/1.1\r\n")
                    held.append(sock)
                over = exchange(address, "127.0.0.4", HELLO["web"][0], 12)
                other = exchange(address, "127.0.0.5", HELLO["web"][0], 12)
                return over, other
            finally:
                for sock in held:
                    sock.close()

        over, other = await asyncio.to_thread(run)
        assert over == b"HTTP/1.1 503" and other == b"HTTP/1.1 200"
        assert refused(app, "web", "max_connections_per_peer") == 1
