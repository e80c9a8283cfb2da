"""Event BUS client: discard rule, gap resync, publish retries, watchdog failover, CLI.

The client's reactions to a misbehaving bus are driven by a scripted bus speaking the seed's
commands over real ZeroMQ sockets; everything else runs against the real taproom server.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import msgpack
import orjson
import pytest
import zmq
import zmq.asyncio

from taproom.cli import build_parser
from taproom.clients.eventbus import EventBusClient, _tail_handler
from taproom.protocols.eventbus import (
    Event,
    broadcast_frames,
    hugz_frames,
    parse_pub,
    parse_syncstart,
    sync_frames,
    syncend_frames,
)
from tests.support import HubProcess, running_app, write_config

TS = "2026-11-22T08:00:00+00:00"


def _event(topic: str, seq: int, value: object) -> Event:
    return Event(topic, seq, "script", TS, str(uuid.uuid4()), msgpack.packb(value))


class ScriptedBus:
    """SNAPSHOT/PUBLISHER/COLLECTOR on three consecutive ports, driven by the test."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        for _ in range(50):
            self.snapshot = self.ctx.socket(zmq.ROUTER)
            self.snapshot.bind("tcp://127.0.0.1:*")
            endpoint = self.snapshot.getsockopt(zmq.LAST_ENDPOINT)
            self.port = int(endpoint.rsplit(b":", 1)[1])
            try:
                self.publisher = self.ctx.socket(zmq.PUB)
                self.publisher.bind(f"tcp://127.0.0.1:{self.port + 1}")
                self.collector = self.ctx.socket(zmq.ROUTER)
                self.collector.bind(f"tcp://127.0.0.1:{self.port + 2}")
                break
            except zmq.ZMQError:
                self.ctx.destroy(0)
                self.ctx = zmq.asyncio.Context()
        self.url = f"tcp://127.0.0.1:{self.port}"

    async def answer_snapshot(self, events: list[Event], cut: int) -> None:
        assert await self.snapshot.poll(5000), "no SYNCSTART"
        identity, *frames = await self.snapshot.recv_multipart()
        request = parse_syncstart(frames)
        for event in events:
            await self.snapshot.send_multipart([identity, *sync_frames(event)])
        await self.snapshot.send_multipart([identity, *syncend_frames(request.subtrees, cut)])

    async def broadcast(self, event: Event) -> None:
        await self.publisher.send_multipart(broadcast_frames(event))

    async def hugz(self, seq: int) -> None:
        await self.publisher.send_multipart(
            hugz_frames(seq, "script", TS, str(uuid.uuid4()), 3, True)
        )

    def close(self) -> None:
        self.ctx.destroy(0)


async def _wait(predicate, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class TestServerToClientUpdates:
    async def test_stale_broadcasts_are_discarded_and_a_gap_resyncs(self) -> None:
        bus = ScriptedBus()
        client = EventBusClient([bus.url], server_timeout=5)
        try:
            starting = asyncio.create_task(client.start())
            await bus.answer_snapshot([_event("/a", 5, "five")], cut=5)
            await starting
            await asyncio.sleep(0.2)  # the SUB has joined
            await bus.broadcast(_event("/a", 4, "stale"))
            await bus.broadcast(_event("/a", 5, "stale too"))
            await bus.broadcast(_event("/a", 6, "six"))
            await _wait(lambda: client.last_seq == 6)
            assert msgpack.unpackb(client.state["/a"].data) == "six"
            assert client.stats["discarded"] == 2
            # 8 after 6: a gap, so the client asks for a fresh snapshot
            await bus.broadcast(_event("/b", 8, "eight"))
            await bus.answer_snapshot([_event("/a", 6, "six"), _event("/b", 8, "eight")], cut=8)
            await _wait(lambda: client.stats["snapshots"] == 2)
            assert client.stats["gaps"] == 1
            assert client.last_seq == 8 and set(client.state) == {"/a", "/b"}
        finally:
            await client.stop()
            bus.close()

    async def test_heartbeat_ahead_of_the_client_is_a_gap(self) -> None:
        bus = ScriptedBus()
        client = EventBusClient([bus.url], server_timeout=5)
        try:
            starting = asyncio.create_task(client.start())
            await bus.answer_snapshot([], cut=3)
            await starting
            await asyncio.sleep(0.2)
            await bus.hugz(3)  # in step: nothing to do
            await bus.hugz(4)  # the bus broadcast 4 and the client never saw it
            await bus.answer_snapshot([_event("/x", 4, 1)], cut=4)
            await _wait(lambda: client.last_seq == 4)
            assert client.stats["gaps"] == 1
        finally:
            await client.stop()
            bus.close()


class TestClientToServerUpdates:
    async def test_unconfirmed_publish_is_retried_under_the_same_uuid(self) -> None:
        bus = ScriptedBus()
        client = EventBusClient([bus.url], server_timeout=5, retry_interval=0.2)
        try:
            starting = asyncio.create_task(client.start())
            await bus.answer_snapshot([], cut=0)
            await starting
            confirmed = await client.publish("/p/1", {"n": 1})
            received = []
            for _ in range(2):  # the bus "loses" the first PUB and keeps the retry
                assert await bus.collector.poll(5000)
                _identity, *frames = await bus.collector.recv_multipart()
                received.append(parse_pub(frames))
            assert received[0].uuid == received[1].uuid
            assert received[0].data == received[1].data
            await bus.broadcast(
                Event(
                    "/p/1",
                    1,
                    received[1].producer,
                    received[1].timestamp,
                    received[1].uuid,
                    received[1].data,
                )
            )
            assert await asyncio.wait_for(confirmed, 5) == 1
            assert client.pending == 0
        finally:
            await client.stop()
            bus.close()

    async def test_events_wait_for_the_connection_in_publication_order(self) -> None:
        # A DEALER with IMMEDIATE refuses to queue before its connection is up: the events
        # published meanwhile must not be overtaken by those published once it is (they were:
        # sent again by the retry tick, they reached the bus after them, and the bus kept
        # their older values as each topic's last; the Binary Star test saw it under load).
        bus = ScriptedBus()
        collector_at = f"tcp://127.0.0.1:{bus.port + 2}"
        bus.collector.close(0)
        await _wait(lambda: _port_free(bus.port + 2))  # libzmq closes its listener later
        client = EventBusClient([bus.url], server_timeout=60, retry_interval=60)
        try:
            starting = asyncio.create_task(client.start())
            await bus.answer_snapshot([], cut=0)
            await starting
            published = []
            for i in range(20):  # nowhere to go yet
                await client.publish(f"/o/{i % 5}", i)
                published.append(i)
            for _attempt in range(100):  # the port is free again once the close is done
                try:
                    bus.collector = bus.ctx.socket(zmq.ROUTER)
                    bus.collector.bind(collector_at)
                    break
                except zmq.ZMQError:
                    bus.collector.close(0)
                    await asyncio.sleep(0.02)
            received: list[int] = []
            seen: set[str] = set()
            i = 20
            async with asyncio.timeout(20):
                while len(received) < len(published) or i < 120:
                    if i < 120:  # keep publishing while the connection comes up
                        await client.publish(f"/o/{i % 5}", i)
                        published.append(i)
                        i += 1
                    while await bus.collector.poll(5 if i < 120 else 1000):
                        _identity, *frames = await bus.collector.recv_multipart()
                        pub = parse_pub(frames)
                        if pub.uuid not in seen:
                            seen.add(pub.uuid)
                            received.append(msgpack.unpackb(pub.data))
            assert received == published
        finally:
            await client.stop()
            bus.close()


class TestCallbackErrors:
    """Issue 16 defect 3: the application's exception is not a server failure."""

    async def test_an_exception_in_on_update_during_the_snapshot_reaches_start(self) -> None:
        bus = ScriptedBus()
        backup = ScriptedBus()  # a failover would send a SYNCSTART here

        def broken(event: Event, source: str) -> None:
            raise ValueError(f"application bug on {event.topic}")

        client = EventBusClient([bus.url, backup.url], on_update=broken, server_timeout=5)
        try:
            starting = asyncio.create_task(client.start(timeout=20))
            await bus.answer_snapshot([_event("/a", 1, "one")], cut=1)
            with pytest.raises(ValueError, match="application bug on /a"):
                await asyncio.wait_for(starting, 10)
            assert client.stats["failovers"] == 0
            assert not await backup.snapshot.poll(300)
        finally:
            await client.stop()
            bus.close()
            backup.close()

    async def test_an_exception_in_on_update_for_a_broadcast_reaches_wait(self) -> None:
        bus = ScriptedBus()
        seen: list[str] = []

        def fails_on_b(event: Event, source: str) -> None:
            if event.topic == "/b":
                raise KeyError("b")
            seen.append(event.topic)

        client = EventBusClient([bus.url], on_update=fails_on_b, server_timeout=5)
        try:
            starting = asyncio.create_task(client.start())
            await bus.answer_snapshot([], cut=0)
            await starting
            await asyncio.sleep(0.2)  # the SUB has joined
            await bus.broadcast(_event("/a", 1, 1))
            await bus.broadcast(_event("/b", 2, 2))
            with pytest.raises(KeyError):
                await asyncio.wait_for(client.wait(), 10)
            assert seen == ["/a"] and client.stats["failovers"] == 0
        finally:
            await client.stop()
            bus.close()

    async def test_no_snapshot_at_all_is_a_timeout_naming_the_servers(self) -> None:
        bus = ScriptedBus()  # never answers
        client = EventBusClient([bus.url], snapshot_timeout=0.3)
        try:
            with pytest.raises(TimeoutError, match=f"no snapshot from {bus.url} within 1 s"):
                await client.start(timeout=1)
        finally:
            await client.stop()
            bus.close()


class TestReliability:
    async def test_silent_server_fails_over_to_the_backup(self, tmp_path: Path) -> None:
        bus = ScriptedBus()
        async with running_app(tmp_path, enable=["eventbus"], eventbus={"heartbeat_ms": 50}) as app:
            real = "tcp://" + app.addresses["eventbus_snapshot"]
            async with EventBusClient([real]) as seeder:
                await (await seeder.publish("/kept", "on the backup"))
            client = EventBusClient([bus.url, real], server_timeout=0.4)
            try:
                starting = asyncio.create_task(client.start())
                await bus.answer_snapshot([], cut=0)
                await starting
                assert client.server_index == 0
                # the scripted bus now says nothing at all: no HUGZ, no BROADCAST
                await _wait(lambda: client.server_index == 1 and "/kept" in client.state, 10)
                assert client.stats["failovers"] == 1
                assert client.last_seq == 1
                value = await asyncio.wait_for(await client.publish("/after", 2), 5)
                assert value == 2
            finally:
                await client.stop()
                bus.close()

    async def test_no_snapshot_reply_moves_on(self, tmp_path: Path) -> None:
        bus = ScriptedBus()  # never answers SYNCSTART
        async with running_app(tmp_path, enable=["eventbus"]) as app:
            real = "tcp://" + app.addresses["eventbus_snapshot"]
            client = EventBusClient([bus.url, real], snapshot_timeout=0.3)
            try:
                await client.start(timeout=10)
                assert client.server_index == 1
            finally:
                await client.stop()
                bus.close()


class TestCommandLine:
    def test_tail_handler_ignores_other_tails(self) -> None:
        args = build_parser().parse_args(["tail", "--limit", "1"])
        assert args.eventbus is None
        assert _tail_handler(args) is None

    def test_send_then_tail(self, tmp_path: Path) -> None:
        config = write_config(tmp_path, enable=["eventbus"])
        with HubProcess(config) as hub:
            url = "tcp://" + hub.addresses["eventbus_snapshot"]
            taproom = [sys.executable, "-m", "taproom"]
            sent = subprocess.run(
                [
                    *taproom,
                    "send",
                    "eventbus",
                    "--server",
                    url,
                    "--topic",
                    "/a/b/",
                    "--data",
                    '{"x": 1}',
                    "--count",
                    "2",
                ],
                capture_output=True,
                timeout=60,
                check=True,
            )
            assert sent.stdout.split() == [b"1", b"2"]
            tail = subprocess.run(
                [*taproom, "tail", "--eventbus", url, "--subtree", "/a/"],
                capture_output=True,
                timeout=60,
                check=True,
            )
            lines = [orjson.loads(line) for line in tail.stdout.splitlines()]
            assert len(lines) == 1
            assert lines[0]["topic"] == "/a/b/" and lines[0]["sequence"] == 2
            assert lines[0]["data"] == {"x": 1}
