"""The web listener's live tail under supervision (taproom.supervise): an event whose tail row
cannot be made is skipped (the page is told, as for any skip), counted and logged; the events
around it reach the page."""

from __future__ import annotations

import asyncio
from pathlib import Path

import orjson
import pytest
from aiohttp import ClientSession

from taproom.records import BatchBuilder
from taproom.web import tail
from tests.supervision.support import assert_supervised, inject, output_errors
from tests.support import running_app


class TestWebLoops:
    async def test_tail(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
    ) -> None:
        raised = inject(monkeypatch, tail, "event_json", lambda record: b"poison" in record.payload)
        async with running_app(tmp_path) as app:
            base = f"http://{app.addresses['web']}"
            async with ClientSession() as http, http.ws_connect(f"{base}/api/tail") as ws:
                await asyncio.sleep(0.2)  # the page's subscription starts when it connects
                builder = BatchBuilder()
                for payload in (b'{"n":1}', b'{"poison":1}', b'{"n":3}'):
                    builder.add("test", payload, content_type="json")
                await app.hub.ingest(builder.build())
                events, skipped = [], 0
                while len(events) + skipped < 3:
                    data = orjson.loads((await asyncio.wait_for(ws.receive(), 20)).data)
                    events += data["events"]
                    skipped += data["skipped"]
            assert [e["offset"] for e in events] == [0, 2] and skipped == 1
            assert raised == [1] and output_errors(app, "console_tail") == 1
            assert_supervised(app, "web.tail", caplog)
