"""Lumberjack's loops under supervision (taproom.supervise): a read the decoder fails on
unexpectedly closes that connection (Lumberjack's only refusal), counted and logged; the
listener and every other connection go on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest

from taproom.protocols.lumberjack import JsonFrame, WindowSizeFrame, decoder
from tests.supervision.support import assert_supervised, inject, internal_errors
from tests.support import running_app


def _window(seq: int, doc: dict[str, object]) -> bytes:
    return WindowSizeFrame(1).serialize() + JsonFrame(seq, orjson.dumps(doc)).serialize()


async def _send(app: object, data: bytes) -> bytes:
    """Send ``data``; what the server answers until it closes or 6 bytes (one ack) came."""
    host, port = app.addresses["lumberjack"].rsplit(":", 1)  # type: ignore[attr-defined]
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    out = b""
    try:
        while len(out) < 6:
            chunk = await asyncio.wait_for(reader.read(64), 20)
            if not chunk:
                break
            out += chunk
    finally:
        writer.close()
    return out


class TestLumberjackLoops:
    async def test_a_read_that_fails_closes_that_connection_only(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = inject(
            monkeypatch,
            decoder.ServerConnection,
            "receive_data",
            lambda _self, data, *_: b"poison" in data,
        )
        async with running_app(tmp_path, enable=["lumberjack"]) as app:
            assert await _send(app, _window(1, {"message": "poison"})) == b""  # closed, no ack
            assert raised == [1] and internal_errors(app, "lumberjack") == 1
            ack = await _send(app, _window(7, {"message": "fine"}))
            assert ack == b"2A\x00\x00\x00\x07"
            assert [r.seq for r in app.hub.journal.read(0)] == [7]
            assert_supervised(app, "lumberjack.connection", caplog)
