"""taproom's ZeroMQ transport under supervision (taproom.supervise): a read it fails on
unexpectedly (a bug met by what one peer sent) closes that connection, counted as the
protocol's ``internal_error`` and logged with its traceback; the listener and every other
connection go on. Without it asyncio closed the connection uncounted (an ingest socket) or
logged and left the subscriber in an unknown state (a publisher)."""

from __future__ import annotations

from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from taproom.servers.zmtp import connection as zmtp_connection
from taproom.servers.zmtp import subscriber as zmtp_subscriber
from tests.supervision.support import assert_supervised, first_call, inject, internal_errors, until
from tests.supervision.test_logjam import QUIET, _message, _topics
from tests.support import running_app

pytestmark = pytest.mark.usefixtures("zmq_path")


class TestZmtpReads:
    async def test_a_read_that_fails_closes_that_connection_only(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        def poisoned(conn: zmtp_connection.Connection) -> bool:
            buf = conn.buf
            return buf is not None and b"logs.poison" in buf[conn.start : conn.end]

        raised = inject(monkeypatch, zmtp_connection.Connection, "_walk", poisoned)
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            address = "tcp://" + app.addresses["logjam_pull"]
            first = ctx.socket(zmq.PUSH)
            first.connect(address)
            await first.send_multipart(_message(b"logs.a", b"{}"))
            await until(lambda: _topics(app) == ["logs.a"], 20, "the first message")
            await first.send_multipart(_message(b"logs.poison", b"{}"))
            await until(lambda: raised == [1], 20, "the poisoned read")
            assert internal_errors(app, "logjam") == 1
            second = ctx.socket(zmq.PUSH)  # another connection to the same listener
            second.connect(address)
            await second.send_multipart(_message(b"logs.b", b"{}"))
            await until(lambda: _topics(app) == ["logs.a", "logs.b"], 20, "the other peer's")
            assert_supervised(app, "zmtp.logjam_pull", caplog)

    async def test_a_subscriber_read_that_fails_disconnects_that_subscriber_only(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        # the first subscriber's subscription fails: that subscriber is disconnected
        raised = inject(monkeypatch, zmtp_subscriber.Subscriber, "_frames", first_call())
        async with running_app(tmp_path, enable=["logjam"], logjam=QUIET) as app:
            address = "tcp://" + app.addresses["logjam_pub"]
            first = ctx.socket(zmq.SUB)
            first.setsockopt(zmq.SUBSCRIBE, b"")
            first.connect(address)
            await until(lambda: raised == [1], 20, "the poisoned subscription")
            assert internal_errors(app, "logjam") == 1
            first.close(0)  # libzmq would come back; this test is about the others
            second = ctx.socket(zmq.SUB)
            second.setsockopt(zmq.SUBSCRIBE, b"")
            second.connect(address)
            service = app.services["logjam"]
            await until(lambda: service.subscriber_count() >= 1, 20, "the second subscriber")
            push = ctx.socket(zmq.PUSH)
            push.connect("tcp://" + app.addresses["logjam_pull"])
            await push.send_multipart(_message(b"logs.after", b"{}"))
            assert await second.poll(20_000)
            assert (await second.recv_multipart())[1] == b"logs.after"
            assert_supervised(app, "zmtp.logjam_pub", caplog)
