"""A Clone client as the ØMQ Guide's model 5 and 6 clients behave, written for these tests from
the protocol (the Guide's kvmsg wire and clone agent flows), not copied from the Guide.

It speaks only raw ZeroMQ frames: it does not use taproom's kvmsg codec, so it checks the
server against the protocol rather than against taproom's own reading of it.

* snapshot: a DEALER to P sends ``ICANHAZ?`` + subtree and stores every kvmsg until
  ``KTHXBAI``, whose sequence becomes the client's;
* updates: a SUB to P+1 subscribed to the subtree and ``HUGZ``; a kvmsg whose sequence is above
  the client's is stored (an empty body deletes the key), anything else is dropped;
* unlike the Guide's clients, it asks for a second snapshot once the SUB has received something
  (a HUGZ at the latest), and only then counts as synced: a SUB's subscription reaches the
  server some time after the connect (ZeroMQ's slow joiner), and an update published after the
  first snapshot but before the subscription arrived is lost to that client for good, while it
  keeps receiving everything after it. The Guide's clients have that gap. The first request
  stays as the Guide sends it, at once: it is what makes a passive Binary Star server take over
  (a passive server sends no HUGZ to wait for).
* a server silent for ``server_ttl`` (no update, no HUGZ, no snapshot reply) is dead: the client
  asks the next server for a snapshot (the Binary Star vote);
* publishing: a kvmsg with sequence 0 and a fresh uuid4, sent once, from a PUSH to the current
  server's P+2 (model 5) or from a PUB connected to every server's P+2 (model 6; an XPUB here,
  which waits for a server's subscription before the first update).
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
import uuid
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

SEQ = struct.Struct(">q")  # network order, as both of the Guide's kvmsg classes write it


@dataclass
class Value:
    sequence: int
    body: bytes
    properties: dict[str, str]
    uuid: bytes


def properties(frame: bytes) -> dict[str, str]:
    pairs = {}
    for line in frame.decode().split("\n"):
        if line:
            name, _, value = line.partition("=")
            pairs[name] = value
    return pairs


@dataclass
class CloneClient:
    servers: list[tuple[str, int]]  # (host, P) in failover order
    subtree: bytes = b""
    model: int = 6
    server_ttl: float = 2.0
    kvmap: dict[bytes, Value] = field(default_factory=dict)
    sequence: int = 0
    current: int = 0
    snapshots: int = 0
    failovers: int = 0
    received: list[tuple[int, bytes]] = field(default_factory=list)  # (sequence, key) applied
    heard_at: float = 0.0  # monotonic time of the last message on the SUB (an update or HUGZ)

    def __post_init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.synced = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Model 6 publishes from a PUB; here an XPUB (the same wire to the server's SUB) so that
        # start() can wait for a server's subscription: a PUB drops what it sends before one
        # arrives (ZeroMQ's slow joiner), which under load lost the test's first updates.
        self.publisher = self.ctx.socket(zmq.XPUB if self.model == 6 else zmq.PUSH)
        self.publisher.setsockopt(zmq.LINGER, 0)
        self.subscriptions = 0  # model 6: servers' subscriptions seen (each server's, verbose)
        if self.model == 6:
            self.publisher.setsockopt(zmq.XPUB_VERBOSE, 1)
        if self.model == 6:
            for host, port in self.servers:
                self.publisher.connect(f"tcp://{host}:{port + 2}")
        else:
            host, port = self.servers[0]
            self.publisher.connect(f"tcp://{host}:{port + 2}")

    async def start(self, timeout: float = 20.0) -> CloneClient:
        self._task = asyncio.create_task(self._agent())
        await asyncio.wait_for(self.synced.wait(), timeout)
        if self.model == 6:  # a subscription from a server, before the first update
            await self.subscribed(1, timeout)
        return self

    async def subscribed(self, servers: int, timeout: float = 20.0) -> None:
        """Model 6: wait until ``servers`` servers' collectors have subscribed to the PUB."""
        while self.subscriptions < servers:
            await asyncio.wait_for(self.publisher.recv(), timeout)
            self.subscriptions += 1

    async def stop(self) -> None:
        """Stop the agent and close the context; again is a no-op."""
        try:
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
        finally:
            self.ctx.destroy(0)

    async def set(self, key: bytes, body: bytes, ttl: int = 0) -> bytes:
        """Send one update, once; returns its uuid."""
        event_uuid = uuid.uuid4().bytes
        props = b"ttl=%d\n" % ttl if ttl else b""
        await self.publisher.send_multipart([key, SEQ.pack(0), event_uuid, props, body])
        return event_uuid

    def _store(self, frames: list[bytes]) -> None:
        key, seq, event_uuid, props, body = frames
        sequence = SEQ.unpack(seq)[0]
        if body:
            self.kvmap[key] = Value(sequence, body, properties(props), event_uuid)
        else:
            self.kvmap.pop(key, None)

    async def _agent(self) -> None:
        while True:
            host, port = self.servers[self.current]
            snapshot = self.ctx.socket(zmq.DEALER)
            subscriber = self.ctx.socket(zmq.SUB)
            try:
                for sock in (snapshot, subscriber):
                    sock.setsockopt(zmq.LINGER, 0)
                subscriber.setsockopt(zmq.SUBSCRIBE, self.subtree)
                subscriber.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
                subscriber.connect(f"tcp://{host}:{port + 1}")
                snapshot.connect(f"tcp://{host}:{port}")
                if await self._snapshot(snapshot):
                    early = await self._subscribed(subscriber)
                    if early is not None and await self._snapshot(snapshot):
                        self.synced.set()
                        await self._updates(subscriber, early)
            finally:
                snapshot.close(0)
                subscriber.close(0)
            # The server gave no hugz: fail over to the next one.
            self.synced.clear()
            self.current = (self.current + 1) % len(self.servers)
            self.failovers += 1
            if self.model == 5:
                host, port = self.servers[self.current]
                self.publisher.connect(f"tcp://{host}:{port + 2}")

    async def _subscribed(self, subscriber: zmq.asyncio.Socket) -> list[list[bytes]] | None:
        """The first message on the SUB (proof that the server holds its subscriptions, which
        went before it on the same connection), or None when the server is silent for
        server_ttl."""
        if not await subscriber.poll(int(self.server_ttl * 1000)):
            return None
        self.heard_at = time.monotonic()
        return [await subscriber.recv_multipart()]

    def describe(self) -> str:
        """What a test's failed wait prints: was the server heard, what came, from which server."""
        silent = time.monotonic() - self.heard_at if self.heard_at else None
        return (
            f"server {self.current}, sequence {self.sequence}, {len(self.kvmap)} keys, "
            f"{len(self.received)} updates applied (last {self.received[-3:]}), "
            f"{self.snapshots} snapshots, {self.failovers} failovers, SUB silent for "
            f"{'ever' if silent is None else f'{silent:.2f} s'}"
        )

    async def _snapshot(self, snapshot: zmq.asyncio.Socket) -> bool:
        await snapshot.send_multipart([b"ICANHAZ?", self.subtree])
        fresh: dict[bytes, Value] = {}
        while True:
            if not await snapshot.poll(int(self.server_ttl * 1000)):
                return False
            frames = await snapshot.recv_multipart()
            assert len(frames) == 5, frames
            if frames[0] == b"KTHXBAI":
                assert frames[4] == self.subtree
                self.kvmap = fresh
                self.sequence = SEQ.unpack(frames[1])[0]
                self.snapshots += 1
                return True
            key, seq, event_uuid, props, body = frames
            assert key.startswith(self.subtree) and len(event_uuid) == 16 and body
            fresh[key] = Value(SEQ.unpack(seq)[0], body, properties(props), event_uuid)

    async def _updates(self, subscriber: zmq.asyncio.Socket, early: list[list[bytes]]) -> None:
        """Apply ``early`` (received before the snapshot) and then live updates, until the
        server is silent for server_ttl."""
        alive_at = time.monotonic()
        while time.monotonic() - alive_at < self.server_ttl:
            if early:
                frames = early.pop(0)
            elif not await subscriber.poll(100):
                continue
            else:
                frames = await subscriber.recv_multipart()
            assert len(frames) == 5, frames
            alive_at = self.heard_at = time.monotonic()
            sequence = SEQ.unpack(frames[1])[0]
            if frames[0] == b"HUGZ" or sequence <= self.sequence:
                continue  # "Discard out-of-sequence updates, incl. hugz"
            self.sequence = sequence
            self._store(frames)
            self.received.append((sequence, frames[0]))
