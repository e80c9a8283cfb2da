"""LogTK's loops under supervision (taproom.supervise): a data entry whose handling fails is
refused alone (LogTK has no refusal for one entry: it is neither stored nor acked, and the
client resends it), counted and logged; the connection and the entries around it go on. A
read the state machine itself fails on closes that connection with 0xf8, not the listener."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from taproom.eventtime import EventTimes
from taproom.protocols.logtk import Ack, Close, Data, FrameDecoder, Init, encode_frame
from taproom.protocols.logtk import session as logtk_session
from taproom.servers.logtk import hash_token, session
from tests.supervision.support import INJECTED, assert_supervised, internal_errors
from tests.support import running_app

TOKEN = bytes(range(64))
APPS = {"apps": {"myapp": {"token_sha256": hash_token(TOKEN)}}}
POISON = b'{"poison": 1}'


async def _open(
    app: object, transport_init: bytes
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = app.addresses["logtk_tcp"].rsplit(":", 1)  # type: ignore[attr-defined]
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"\x01\x01" + TOKEN + b"\x00" + transport_init)
    return reader, writer


async def _until_frames(
    reader: asyncio.StreamReader, done: Callable[[list[object]], bool]
) -> list[object]:
    decoder = FrameDecoder()
    frames: list[object] = []
    while not done(frames):
        chunk = await asyncio.wait_for(reader.read(4096), 20)
        if not chunk:
            break
        frames += decoder.feed(chunk)
    return frames


class TestLogtkLoops:
    async def test_a_data_entry_that_fails_is_refused_alone(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        real_reader = session.time_reader
        raised = [0]

        def poisoned_reader(content_type: str) -> Callable[[bytes, EventTimes], int]:
            read = real_reader(content_type)

            def reader(payload: bytes, times: EventTimes) -> int:
                if payload == POISON:
                    raised[0] += 1
                    raise RuntimeError(INJECTED)
                return read(payload, times)

            return reader

        monkeypatch.setattr(session, "time_reader", poisoned_reader)
        async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
            init = encode_frame(Init("json", 0x1234, None, False))
            entries = [Data(b'{"n": 1}', 1), Data(POISON, 2), Data(b'{"n": 3}', 3)]
            reader, writer = await _open(app, init + b"".join(map(encode_frame, entries)))
            frames = await _until_frames(reader, lambda f: Ack(1) in f and Ack(3) in f)
            assert Ack(2) not in frames and not any(isinstance(f, Close) for f in frames)
            writer.write(encode_frame(Data(b'{"n": 4}', 4)))  # the connection goes on
            frames = await _until_frames(reader, lambda f: Ack(4) in f)
            writer.close()
            stored = sorted(r.seq for r in app.hub.journal.read(0))
            assert stored == [1, 3, 4] and raised == [1]
            assert internal_errors(app, "logtk") == 1
            assert_supervised(app, "logtk.tcp", caplog)

    async def test_a_read_the_state_machine_fails_on_closes_that_connection_only(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        real_receive = logtk_session.ServerConnection.receive_data

        def receive(self: object, data: bytes, now: float) -> list[object]:
            if POISON in data:
                raise RuntimeError(INJECTED)
            return real_receive(self, data, now)  # type: ignore[arg-type]

        monkeypatch.setattr(logtk_session.ServerConnection, "receive_data", receive)
        async with running_app(tmp_path, enable=["logtk"], logtk=APPS) as app:
            init = encode_frame(Init("json", 0x1234, None, False))
            bad, bad_writer = await _open(app, init + encode_frame(Data(POISON, 1)))
            frames = await _until_frames(bad, lambda f: any(isinstance(x, Close) for x in f))
            assert Close(0xF8, "internal error") in frames
            bad_writer.close()
            good, good_writer = await _open(app, init + encode_frame(Data(b"{}", 1)))
            await _until_frames(good, lambda f: Ack(1) in f)
            good_writer.close()
            assert internal_errors(app, "logtk") == 1
            assert_supervised(app, "logtk.tcp", caplog)
