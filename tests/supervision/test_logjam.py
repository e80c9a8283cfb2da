"""Every logjam loop under supervision (taproom.supervise): an exception injected into a
loop's per-message handler refuses that message alone (a 400 where the agent asked for a
reply, a 500 for a replay request), counted and logged; the rest are kept."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from taproom.protocols import logjam as lj
from taproom.protocols.logjam import ingest as lj_ingest
from taproom.servers.logjam.pub import PubOutput
from taproom.servers.logjam.replay import ReplayChannel
from tests.supervision.support import (
    assert_supervised,
    first_call,
    inject,
    internal_errors,
    output_errors,
    until,
)
from tests.support import running_app

# Both ingest paths: the compiled one hands a compressed message to the Python code, which is
# where the injected error is raised.
pytestmark = pytest.mark.usefixtures("zmq_path")

QUIET = {"heartbeat_interval_s": 3600.0, "hostname": "hub.example"}
POISON = b'{"poison": true}'


def _message(topic: bytes, body: bytes, compression: int = 0) -> list[bytes]:
    return lj.encode_message(
        b"app-production",
        topic,
        body,
        compression=compression,
        device=1,
        created_ms=1_700_000_000_000,
        sequence=1,
    )


def _decompress_poisoned(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Make the poisoned body (sent zlib-compressed) raise where the ingest path inflates it."""
    compressed = lj.compress(lj.Compression.ZLIB, POISON)
    return inject(
        monkeypatch, lj_ingest, "decompress", lambda method, body, *_: bytes(body) == compressed
    )


def _topics(app: object) -> list[str]:
    return [r.topic for r in app.hub.journal.read(0)]  # type: ignore[attr-defined]


class TestLogjamLoops:
    async def test_router(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = _decompress_poisoned(monkeypatch)
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["logjam_router"])
            for frames in (
                _message(b"logs.a", b"{}"),
                _message(b"logs.poison", POISON, lj.Compression.ZLIB),
                _message(b"logs.b", b"{}"),
            ):
                await dealer.send_multipart([b"", *frames])
            replies = []
            while len(replies) < 3:
                assert await dealer.poll(20_000), f"replies so far: {replies}"
                replies.append(await dealer.recv_multipart())
            statuses = sorted(reply[-1] for reply in replies)
            assert statuses == [lj.ACCEPTED, lj.ACCEPTED, lj.BAD_REQUEST]
            assert _topics(app) == ["logs.a", "logs.b"] and raised == [1]
            assert internal_errors(app, "logjam") == 1
            assert_supervised(app, "logjam.router", caplog)

    async def test_pull(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = _decompress_poisoned(monkeypatch)
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            push = ctx.socket(zmq.PUSH)
            push.connect("tcp://" + app.addresses["logjam_pull"])
            await push.send_multipart(_message(b"logs.a", b"{}"))
            await push.send_multipart(_message(b"logs.poison", POISON, lj.Compression.ZLIB))
            await push.send_multipart(_message(b"logs.b", b"{}"))
            await until(lambda: len(_topics(app)) == 2, 20, "the two valid messages")
            assert _topics(app) == ["logs.a", "logs.b"] and raised == [1]
            assert internal_errors(app, "logjam") == 1
            assert_supervised(app, "logjam.pull", caplog)

    async def test_pub(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        def poisoned(_self: object, batch: object) -> bool:
            return any(r.topic == "logs.poison" for r in batch.records())  # type: ignore[attr-defined]

        raised = inject(monkeypatch, PubOutput, "_publish_batch", poisoned)
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect("tcp://" + app.addresses["logjam_pub"])
            service = app.services["logjam"]
            await until(lambda: service.subscriber_count() >= 1, 20, "the subscription")
            push = ctx.socket(zmq.PUSH)
            push.connect("tcp://" + app.addresses["logjam_pull"])
            await push.send_multipart(_message(b"logs.poison", b"{}"))
            await until(lambda: raised == [1], 20, "the poisoned batch")
            await push.send_multipart(_message(b"logs.after", b"{}"))
            assert await sub.poll(20_000)
            assert (await sub.recv_multipart())[1] == b"logs.after"
            assert output_errors(app, "logjam_pub") == 1
            assert_supervised(app, "logjam.pub", caplog)

    async def test_replay(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = inject(monkeypatch, ReplayChannel, "_answer_replay", first_call())
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["logjam_replay"])
            for _ in range(2):
                await dealer.send_multipart([b"offset", b"0", b"10"])
            assert await dealer.poll(20_000)
            assert (await dealer.recv_multipart())[0] == b"500 Internal Server Error"
            assert await dealer.poll(20_000)
            assert (await dealer.recv_multipart())[0] == b"200 OK"
            assert raised == [1] and internal_errors(app, "logjam") == 1
            assert_supervised(app, "logjam.replay", caplog)
