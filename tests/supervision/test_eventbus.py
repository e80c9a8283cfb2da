"""Every Event BUS loop under supervision: an exception injected into its per-message handler
refuses that message alone (counted, logged), the rest are kept and the loop goes on; a loop
that dies anyway is restarted and shown on /ready."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.asyncio

from taproom.protocols.eventbus import (
    BStarState,
    SyncEnd,
    hugz_frames,
    kvmsg,
    parse_snapshot_reply,
    replicated_frames,
    syncstart_frames,
)
from taproom.servers.eventbus import accept, bstar, snapshot
from taproom.servers.eventbus.broadcast import Broadcaster
from taproom.servers.eventbus.chp import ChpDialect
from taproom.servers.eventbus.collector import Collector
from taproom.servers.eventbus.state import FRAMES, SEQ
from tests.supervision.support import (
    assert_supervised,
    first_call,
    inject,
    internal_errors,
    output_errors,
    until,
)
from tests.support import running_app

TS = b"2026-11-22T08:00:00Z"


def _pub(topic: str, ts: bytes = TS) -> list[bytes]:
    return [
        topic.encode(),
        struct.pack(">Q", 0),
        b"producer",
        ts,
        str(uuid.uuid4()).encode(),
        msgpack.packb({"t": topic}),
    ]


def _kv(
    key: bytes, body: bytes = b"v", uuid16: bytes | None = None, properties: bytes = b""
) -> list[bytes]:
    return [key, bytes(8), uuid.uuid4().bytes if uuid16 is None else uuid16, properties, body]


# A property the CHP collector's kernel leaves to the Python path (parse_update, _accept_one),
# whose handlers two tests below poison; a plain update goes through the kernel.
PYTHON_PATH = b"note=x\n"


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    context.setsockopt(zmq.LINGER, 0)
    yield context
    context.destroy(0)


def _topics(app: object) -> list[str]:
    return [r.topic for r in app.hub.journal.read(0)]  # type: ignore[attr-defined]


async def _syncstart(ctx: zmq.asyncio.Context, address: str, timeout: float) -> int | None:
    """A SYNCSTART: the SYNCEND's sequence, or None when nothing came back in time."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect("tcp://" + address)
    try:
        await dealer.send_multipart(syncstart_frames((), 0))
        while await dealer.poll(int(timeout * 1000)):
            reply = parse_snapshot_reply(await dealer.recv_multipart())
            if isinstance(reply, SyncEnd):
                return reply.sequence
        return None
    finally:
        dealer.close(0)


class TestEventBusLoops:
    @pytest.mark.usefixtures("zmq_path")
    async def test_collector(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        # the admission runs per message on both paths (the compiled one never calls
        # parse_pub for a command its kernel validates)
        raised = inject(
            monkeypatch, Collector, "_admit", lambda _self, topic, *_: topic == b"/poison/1"
        )
        async with running_app(tmp_path, enable=["eventbus"]) as app:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["eventbus_collector"])
            for topic in ("/ok/a", "/poison/1", "/ok/b"):
                await dealer.send_multipart(_pub(topic))
            await until(lambda: len(_topics(app)) == 2, 20, "the two valid PUBs")
            assert _topics(app) == ["/ok/a", "/ok/b"] and raised == [1]
            assert internal_errors(app, "eventbus") == 1
            await dealer.send_multipart(_pub("/ok/c"))  # still serving
            await until(lambda: len(_topics(app)) == 3, 20, "a PUB after the poison")
            assert_supervised(app, "eventbus.collector", caplog)

    async def test_chp_collector(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = inject(
            monkeypatch, kvmsg, "parse_update", lambda frames, *_: frames[0] == b"/poison/1"
        )
        async with running_app(
            tmp_path, enable=["eventbus"], eventbus={"chp": True, "chp_collector": "pull"}
        ) as app:
            push = ctx.socket(zmq.PUSH)
            push.connect("tcp://" + app.addresses["eventbus_chp_collector"])
            for key in (b"/ok/a", b"/poison/1", b"/ok/b"):
                await push.send_multipart(_kv(key, properties=PYTHON_PATH))
            await until(lambda: len(_topics(app)) == 2, 20, "the two valid updates")
            assert _topics(app) == ["/ok/a", "/ok/b"] and raised == [1]
            assert internal_errors(app, "eventbus") == 1
            assert_supervised(app, "eventbus.chp_collector", caplog)

    async def test_chp_collector_kernel_run(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """The CHP kernel's run: one update whose admission fails is refused alone."""
        raised = inject(
            monkeypatch, ChpDialect, "_admit", lambda _self, topic, *_: topic == b"/poison/1"
        )
        async with running_app(
            tmp_path, enable=["eventbus"], eventbus={"chp": True, "chp_collector": "pull"}
        ) as app:
            push = ctx.socket(zmq.PUSH)
            push.connect("tcp://" + app.addresses["eventbus_chp_collector"])
            for key in (b"/ok/a", b"/poison/1", b"/ok/b"):
                await push.send_multipart(_kv(key))
            await until(lambda: len(_topics(app)) == 2, 20, "the two valid updates")
            assert _topics(app) == ["/ok/a", "/ok/b"] and raised == [1]
            assert internal_errors(app, "eventbus") == 1
            await push.send_multipart(_kv(b"/ok/c"))  # still serving
            await until(lambda: len(_topics(app)) == 3, 20, "an update after the poison")
            assert_supervised(app, "eventbus.chp_collector", caplog)

    async def test_accept_undoes_the_admission_of_an_update_that_fails(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """Updates admitted through _accept_events (CHP, held, expiries): one whose journal
        record fails is refused after its admission, which is undone."""
        raised = inject(
            monkeypatch, accept, "journal_event", lambda _b, event, *_: event.topic == "/poison/1"
        )
        async with running_app(
            tmp_path, enable=["eventbus"], eventbus={"chp": True, "chp_collector": "pull"}
        ) as app:
            push = ctx.socket(zmq.PUSH)
            push.connect("tcp://" + app.addresses["eventbus_chp_collector"])
            for key in (b"/ok/a", b"/poison/1", b"/ok/b"):
                await push.send_multipart(_kv(key, properties=PYTHON_PATH))
            await until(lambda: len(_topics(app)) == 2, 20, "the two valid updates")
            assert _topics(app) == ["/ok/a", "/ok/b"] and raised == [1]
            service = app.services["eventbus"]
            assert b"/poison/1" not in service._accepted  # type: ignore[attr-defined]
            assert [e[SEQ] for e in service.hashmap.values()] == [1, 2]  # type: ignore[attr-defined]
            assert internal_errors(app, "eventbus") == 1
            assert_supervised(app, "eventbus.accept", caplog)

    async def test_snapshot(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = inject(monkeypatch, snapshot, "parse_syncstart", first_call())
        async with running_app(tmp_path, enable=["eventbus"]) as app:
            address = app.addresses["eventbus_snapshot"]
            # The poisoned request goes unanswered (the seed has no refusal for it)...
            assert await _syncstart(ctx, address, 1.0) is None
            assert raised == [1] and internal_errors(app, "eventbus") == 1
            # ...and the next one is served.
            assert await _syncstart(ctx, address, 20.0) == 0
            assert_supervised(app, "eventbus.snapshot", caplog)

    async def test_chp_snapshot(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        raised = inject(
            monkeypatch, kvmsg, "parse_icanhaz", lambda frames, *_: frames[-1] == b"/poison"
        )
        async with running_app(tmp_path, enable=["eventbus"], eventbus={"chp": True}) as app:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["eventbus_chp_snapshot"])
            await dealer.send_multipart([b"ICANHAZ?", b"/poison"])
            await dealer.send_multipart([b"ICANHAZ?", b"/ok"])
            assert await dealer.poll(20_000)
            reply = await dealer.recv_multipart()
            assert reply[0] == b"KTHXBAI" and reply[-1] == b"/ok"  # only the valid one
            assert raised == [1] and internal_errors(app, "eventbus") == 1
            assert_supervised(app, "eventbus.chp_snapshot", caplog)

    async def test_broadcast(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        def poisoned(_self: object, burst: object, *_: object) -> bool:
            return any(e[FRAMES][0] == b"/poison/1" for e in burst.entries)  # type: ignore[attr-defined]

        raised = inject(monkeypatch, Broadcaster, "_apply", poisoned)
        async with running_app(tmp_path, enable=["eventbus"]) as app:
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"/")
            sub.connect("tcp://" + app.addresses["eventbus_publisher"])
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["eventbus_collector"])
            await dealer.send_multipart(_pub("/poison/1"))
            await until(lambda: raised == [1], 20, "the poisoned burst")
            assert output_errors(app, "eventbus_broadcast") == 1
            # The next burst is applied and broadcast (the SUB may have joined late, so ask
            # until one arrives).
            received: list[bytes] = []
            deadline = time.monotonic() + 20
            while not received and time.monotonic() < deadline:
                await dealer.send_multipart(_pub("/ok/a"))
                if await sub.poll(500):
                    received.append((await sub.recv_multipart())[0])
            assert received == [b"/ok/a"]
            assert_supervised(app, "eventbus.broadcast", caplog)

    async def test_a_collector_that_dies_is_restarted_and_shown_on_ready(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        """A bug outside the per-message guard: the loop dies, /ready lists it under
        degraded (still 200), and the restarted loop serves the messages still queued."""
        real = Collector._drain_collector
        died = [0]

        def drain_once_broken(self: Collector, reader: object) -> None:
            if not died[0]:
                died[0] += 1
                raise RuntimeError("a bug in the burst loop")
            real(self, reader)  # type: ignore[arg-type]

        monkeypatch.setattr(Collector, "_drain_collector", drain_once_broken)
        async with running_app(tmp_path, enable=["eventbus"], hub={"loop_settle_s": 3600}) as app:
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["eventbus_collector"])
            await dealer.send_multipart(_pub("/ok/a"))
            await until(lambda: _topics(app) == ["/ok/a"], 20, "the PUB after the restart")
            status = app.hub.supervisor.loops["eventbus.collector"]
            assert status.total_deaths == 1
            assert app.readiness() == []
            (line,) = app.hub.degraded()
            assert line.startswith("loop eventbus.collector died at")
            assert "RuntimeError: a bug in the burst loop" in line
            assert any(
                r.getMessage().startswith("eventbus.collector died") and r.exc_info
                for r in caplog.records
            )


def _free_pair() -> int:
    """P such that P+1 and P+2 are free now (the fake peer's PUBLISHER and COLLECTOR)."""
    for _ in range(100):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            base = a.getsockname()[1] - 1
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", base + 2))
                except OSError:
                    continue
                return int(base)
    raise RuntimeError("no two consecutive free ports")


class TestPeerLoops:
    """The Binary Star peer link's two loops, against a fake backup: a PUB that sends its
    HUGZ and a ROUTER that answers REPLICATE with REPLICATED."""

    async def test_peer_hugz_and_peer_ack(
        self,
        tmp_path: Path,
        ctx: zmq.asyncio.Context,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        hugz_seen = [0]

        def first_hugz(frames: list[bytes], *_: object) -> bool:
            hugz_seen[0] += frames[0] == b"HUGZ"
            return hugz_seen[0] == 1

        raised_hugz = inject(monkeypatch, bstar, "parse_broadcast", first_hugz)
        acks = [0]

        def first_ack(*_: object) -> bool:
            acks[0] += 1
            return acks[0] == 1

        raised_ack = inject(monkeypatch, bstar, "parse_replicated", first_ack)
        base = _free_pair()
        peer_pub = ctx.socket(zmq.PUB)
        peer_pub.bind(f"tcp://127.0.0.1:{base + 1}")
        peer_router = ctx.socket(zmq.ROUTER)
        peer_router.bind(f"tcp://127.0.0.1:{base + 2}")
        settings = {
            "role": "primary",
            "peer": f"127.0.0.1:{base}",
            "heartbeat_ms": 100,
            "peer_timeout_ms": 60_000,
            "replicate_timeout_ms": 60_000,
        }
        async with running_app(tmp_path, enable=["eventbus"], eventbus=settings) as app:
            service = app.services["eventbus"]

            async def beat() -> None:
                state = int(BStarState.BACKUP)  # a backup not yet serving: the primary goes active
                frames = hugz_frames(0, "peer", TS.decode(), str(uuid.uuid4()), state, True)
                await peer_pub.send_multipart(frames)

            # HUGZ until the primary has applied one: the first one it reads is poisoned.
            deadline = time.monotonic() + 20
            while service._peer_state != BStarState.BACKUP:  # type: ignore[attr-defined]
                assert time.monotonic() < deadline, "the peer's HUGZ never applied"
                await beat()
                await asyncio.sleep(0.1)
            assert raised_hugz == [1]
            await until(lambda: service.fsm.active, 20, "the primary to be active")  # type: ignore[attr-defined]
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect("tcp://" + app.addresses["eventbus_collector"])
            await dealer.send_multipart(_pub("/ok/a"))
            assert await peer_router.poll(20_000), "no REPLICATE from the primary"
            identity, *_ = await peer_router.recv_multipart()
            for _ in range(2):  # the first REPLICATED is poisoned, the second applied
                await peer_router.send_multipart([identity, *replicated_frames(1)])
            await until(lambda: service.peer_acked == 1, 20, "the peer's REPLICATED")  # type: ignore[attr-defined]
            assert raised_ack == [1]
            assert internal_errors(app, "eventbus") == 2
            assert_supervised(app, "eventbus.peer_hugz", caplog)
            assert_supervised(app, "eventbus.peer_ack", caplog)
