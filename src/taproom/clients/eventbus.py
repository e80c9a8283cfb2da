"""Event BUS client: snapshot, then live updates, publish with retries, failover; CLI plug-ins.

The client follows the Clone pattern's client (zguide clonecli6) with the seed's commands:

1. connect a SUB to the server's PUBLISHER (P+1) first, so nothing broadcast after the
   snapshot's cut is missed, then send SYNCSTART to the SNAPSHOT port (P) and apply SYNC
   commands until SYNCEND, whose sequence becomes the last applied sequence;
2. apply BROADCASTs in order: one at or below the last applied sequence is discarded (the
   seed's rule), one above ``last + 1`` is a gap and triggers a fresh snapshot. To see every
   sequence the SUB takes the whole stream and filters subtrees locally;
3. publish PUB commands on a DEALER to the COLLECTOR (P+2). An event stays pending, and is
   sent again under the same UUID, until its BROADCAST is seen; the bus drops the repeats and
   names them, with their sequences, in its next HUGZ (which also confirms them). Events go
   out in the order they were published: while one waits for the connection, the later ones
   wait behind it (sent before it, they would reach the bus first, and its older value would
   then replace theirs as the topic's last);
4. a server is alive while it broadcasts or sends HUGZ in the active state. Silence longer than
   ``server_timeout`` (or a snapshot that does not come) moves the client to the next server
   of its list (the Binary Star backup), where it takes a full snapshot and re-sends what is
   still pending.

``taproom send eventbus`` and ``taproom tail --eventbus`` are thin wrappers around it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys
import time
import uuid as uuid_mod
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgpack
import orjson
import zmq
import zmq.asyncio

from ..protocols.eventbus import (
    BStarState,
    Event,
    EventBusError,
    Heartbeat,
    Limits,
    SyncEnd,
    matches,
    parse_broadcast,
    parse_snapshot_reply,
    pub_frames,
    syncstart_frames,
)
from ..zmqaccess import Curve, add_curve_arguments, curve_client, curve_from_args
from ..zmqframes import recv_frames

__all__ = ["EventBusClient", "register_send", "register_tail"]

log = logging.getLogger("taproom.clients.eventbus")


def _split(server: str) -> tuple[str, int]:
    """``tcp://host:P`` or ``host:P`` -> (host, P)."""
    address = server.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected tcp://host:port, got {server!r}")
    return host.strip("[]"), int(port)


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# The most frames of a snapshot reply (SYNC + 6 event frames): longer messages are refused
# before their frames are kept.
_MAX_FRAMES = 16


class _CallbackFailed(Exception):
    """The application's ``on_update`` / ``on_resync`` raised: not a server failure."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass(slots=True)
class _Pending:
    frames: list[bytes]
    future: asyncio.Future[int]
    sent_at: float = 0.0


class EventBusClient:
    """A Clone client over one server or a Binary Star pair (``servers`` in failover order).

    ``state`` holds the latest event per topic of the subscribed ``subtrees``. ``on_update``
    is called with ``(event, source)`` for every applied SYNC (``"sync"``) and BROADCAST
    (``"broadcast"``); ``on_resync`` when a new snapshot starts replacing the state. An
    exception from either is the application's, not the server's: the client stops and the
    exception is raised by :meth:`start` (before the first snapshot) or :meth:`wait`.
    """

    def __init__(
        self,
        servers: Sequence[str],
        subtrees: Sequence[str] = (),
        *,
        producer: str | None = None,
        server_timeout: float = 3.0,
        snapshot_timeout: float = 5.0,
        retry_interval: float = 2.0,
        max_pending: int = 10_000,
        limits: Limits | None = None,
        on_update: Callable[[Event, str], None] | None = None,
        on_resync: Callable[[], None] | None = None,
        curve: Curve | None = None,
    ) -> None:
        if not servers:
            raise ValueError("at least one server")
        self.servers = [_split(s) for s in servers]
        self.subtrees = tuple(subtrees)
        self.producer = producer or f"taproom-client-{uuid_mod.uuid4().hex[:8]}"
        self.server_timeout = server_timeout
        self.snapshot_timeout = snapshot_timeout
        self.retry_interval = retry_interval
        self.max_pending = max_pending
        self.limits = limits or Limits()
        self.on_update = on_update
        self.on_resync = on_resync
        self.curve = curve  # every server of a Binary Star pair has the same key pair
        self.state: dict[str, Event] = {}
        self.last_seq = 0
        self.server_index = 0
        self.synced = asyncio.Event()
        self.stats = {"snapshots": 0, "gaps": 0, "failovers": 0, "discarded": 0, "resent": 0}
        self._pending: dict[str, _Pending] = {}  # by UUID, in the order published
        self._backlog = False  # an event waits for the connection: the later ones wait too
        self._room = asyncio.Event()
        self._room.set()
        self._ctx = zmq.asyncio.Context()
        self._collector: zmq.Socket[bytes] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self, wait: bool = True, timeout: float = 30.0) -> EventBusClient:
        """Start the client; with ``wait``, return once the first snapshot is applied.

        Raises ``TimeoutError`` when no server gave a snapshot within ``timeout`` seconds, or
        the callback's own exception; the client is stopped in both cases.
        """
        task = self._task = asyncio.create_task(self._run())
        if not wait:
            return self
        synced = asyncio.ensure_future(self.synced.wait())
        try:
            await asyncio.wait((synced, task), timeout=timeout, return_when=FIRST_COMPLETED)
            if task.done() and not task.cancelled():
                task.result()  # the callback's exception
            if not self.synced.is_set():
                servers = ", ".join(f"tcp://{h}:{p}" for h, p in self.servers)
                raise TimeoutError(f"no snapshot from {servers} within {timeout:g} s")
        except BaseException:
            await self.stop()
            raise
        finally:
            synced.cancel()
        return self

    async def wait(self) -> None:
        """Until the client stops: returns after :meth:`stop`, raises a callback's exception."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._task)

    async def stop(self) -> None:
        self._closed = True
        task = self._task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for pending in self._pending.values():
            if not pending.future.done():
                pending.future.cancel()
        self._ctx.destroy(linger=0)

    async def __aenter__(self) -> EventBusClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def server(self) -> str:
        host, port = self.servers[self.server_index]
        return f"tcp://{host}:{port}"

    # --- publishing -------------------------------------------------------------------------

    async def publish(
        self, topic: str, data: Any, *, event_uuid: str | None = None, packed: bool = False
    ) -> asyncio.Future[int]:
        """Queue an event; the future gives its bus sequence once it has been broadcast.

        ``data`` is MessagePack-encoded unless ``packed``. Waits while ``max_pending`` events
        are unconfirmed (backpressure).
        """
        while len(self._pending) >= self.max_pending:
            self._room.clear()
            await self._room.wait()
        payload = data if packed else msgpack.packb(data, use_bin_type=True)
        key = (event_uuid or str(uuid_mod.uuid4())).lower()
        timestamp = datetime.now(UTC).isoformat(timespec="microseconds")
        event = Event(topic, 0, self.producer, timestamp, key, payload)
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        existing = self._pending.get(key)
        if existing is not None:
            return existing.future
        pending = _Pending(pub_frames(event), future)
        self._pending[key] = pending
        if not self._backlog:
            self._backlog = not self._send(pending)
        return future

    def _send(self, pending: _Pending) -> bool:
        """False when it cannot go now (no connection yet: IMMEDIATE; or a full queue): the
        retry tick sends it, and the events published after it, in order."""
        if self._collector is None:
            return False
        try:
            self._collector.send_multipart(pending.frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        pending.sent_at = time.monotonic()
        return True

    def _resend(self, older_than: float) -> None:
        """In publication order, the events never sent and those sent ``older_than`` seconds
        ago or more and still not confirmed; stops at the first that cannot go."""
        now = time.monotonic()
        for pending in list(self._pending.values()):
            if now - pending.sent_at >= older_than:
                resent = pending.sent_at != 0.0
                if not self._send(pending):
                    self._backlog = True
                    return
                if resent:
                    self.stats["resent"] += 1
        self._backlog = False

    def _confirm(self, key: str, sequence: int) -> None:
        pending = self._pending.pop(key, None)
        if pending is not None:
            if not pending.future.done():
                pending.future.set_result(sequence)
            if len(self._pending) < self.max_pending:
                self._room.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    # --- the session loop ----------------------------------------------------------------------

    async def _run(self) -> None:
        while not self._closed:
            try:
                await self._session(*self.servers[self.server_index])
            except asyncio.CancelledError:
                raise
            except _CallbackFailed as failed:
                self._closed = True
                raise failed.error from None
            except Exception:  # never let one bad session end the client
                log.exception("eventbus client: session error")
                await asyncio.sleep(0.1)
            if self._closed:
                return
            # Silence or no snapshot: try the next server (the Binary Star backup).
            self.server_index = (self.server_index + 1) % len(self.servers)
            self.stats["failovers"] += 1
            log.info("eventbus client: moving to %s", self.server)

    async def _session(self, host: str, base: int) -> None:
        ctx = self._ctx
        sub = ctx.socket(zmq.SUB)
        snap = ctx.socket(zmq.DEALER)
        col = ctx.socket(zmq.DEALER)
        sockets = (sub, snap, col)
        for sock in sockets:
            sock.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 1_000_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        snap.setsockopt(zmq.RCVHWM, 1_000_000)
        col.setsockopt(zmq.IMMEDIATE, 1)
        col.setsockopt(zmq.SNDHWM, 100_000)
        if self.curve is not None:
            for sock in sockets:
                curve_client(sock, *self.curve)
        try:
            sub.connect(_endpoint(host, base + 1))
            snap.connect(_endpoint(host, base))
            col.connect(_endpoint(host, base + 2))
            self._collector = zmq.Socket.shadow(col.underlying)
            while not self._closed:
                if not await self._snapshot(snap):
                    return
                self._resend(0)
                if not await self._live(sub):
                    return  # the server went silent
                # else: a gap; take a fresh snapshot from the same server
        finally:
            self._collector = None
            for sock in sockets:
                sock.close(0)

    async def _snapshot(self, snap: zmq.asyncio.Socket) -> bool:
        await snap.send_multipart(syncstart_frames(self.subtrees, 0))
        fresh: dict[str, Event] = {}
        timeout_ms = int(self.snapshot_timeout * 1000)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(snap.underlying)
        end: SyncEnd | None = None
        while end is None:
            if not await snap.poll(timeout_ms):
                log.warning("eventbus client: no snapshot from %s", self.server)
                return False
            while True:  # drain what is there without a future per message
                try:
                    frames = recv_frames(raw, _MAX_FRAMES)
                except zmq.Again:
                    break
                if frames is None:
                    log.warning("eventbus client: snapshot message over %d frames", _MAX_FRAMES)
                    continue
                try:
                    reply = parse_snapshot_reply(frames, self.limits)
                except EventBusError as exc:
                    log.warning("eventbus client: bad snapshot command: %s", exc)
                    continue
                if isinstance(reply, SyncEnd):
                    end = reply
                    break
                fresh[reply.topic] = reply
        reply = end
        if reply.sequence < self.last_seq:
            log.warning(
                "eventbus client: %s is behind (sequence %d < %d)",
                self.server,
                reply.sequence,
                self.last_seq,
            )
        try:
            if self.on_resync is not None:
                self.on_resync()
            self.state = fresh
            self.last_seq = reply.sequence
            self.stats["snapshots"] += 1
            if self.on_update is not None:
                for event in fresh.values():
                    self.on_update(event, "sync")
        except Exception as exc:
            raise _CallbackFailed(exc) from exc
        self.synced.set()
        return True

    async def _live(self, sub: zmq.asyncio.Socket) -> bool:
        """Apply broadcasts; False when the server went silent, True on a gap (resync)."""
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
        alive_at = time.monotonic()
        retry_at = alive_at
        tick = min(self.server_timeout, self.retry_interval, 0.25)
        while not self._closed:
            if not await sub.poll(int(tick * 1000)):
                now = time.monotonic()
            else:
                for _ in range(10_000):  # then yield to the loop, even under a flood
                    try:
                        frames = recv_frames(raw, _MAX_FRAMES)
                    except zmq.Again:
                        break
                    if frames is None:
                        log.warning("eventbus client: broadcast over %d frames", _MAX_FRAMES)
                        continue
                    try:
                        message = parse_broadcast(frames, self.limits)
                    except EventBusError as exc:
                        log.warning("eventbus client: bad broadcast: %s", exc)
                        continue
                    if isinstance(message, Heartbeat):
                        if message.state != BStarState.ACTIVE:
                            continue  # a passive server is not serving us
                        alive_at = time.monotonic()
                        for key, sequence in message.acks:  # our retries the bus already had
                            self._confirm(key, sequence)
                        if message.sequence > self.last_seq:
                            self.stats["gaps"] += 1
                            return True
                        continue
                    alive_at = time.monotonic()
                    if message.sequence <= self.last_seq:
                        # Not applied (the seed's rule), but it proves the bus has the event.
                        self.stats["discarded"] += 1
                        self._confirm(message.uuid, message.sequence)
                        continue
                    if message.sequence != self.last_seq + 1:
                        self.stats["gaps"] += 1
                        log.info(
                            "eventbus client: gap (%d after %d); resyncing",
                            message.sequence,
                            self.last_seq,
                        )
                        return True
                    self.last_seq = message.sequence
                    self._confirm(message.uuid, message.sequence)
                    if matches(message.topic, self.subtrees):
                        if message.data:
                            self.state[message.topic] = message
                        else:  # an empty data frame deletes the topic (CHP, ttl)
                            self.state.pop(message.topic, None)
                        if self.on_update is not None:
                            try:
                                self.on_update(message, "broadcast")
                            except Exception as exc:
                                raise _CallbackFailed(exc) from exc
                now = time.monotonic()
            if now - alive_at > self.server_timeout:
                log.warning("eventbus client: %s silent for %.1fs", self.server, now - alive_at)
                return False
            if now >= retry_at:
                # Every tick: events never sent (no connection yet) go at once, the others
                # once they have waited retry_interval for their BROADCAST.
                self._resend(self.retry_interval)
                retry_at = now + tick
        return False


# --- CLI -------------------------------------------------------------------------------------


def _event_json(event: Event) -> dict[str, Any]:
    from ..payloads import decode_payload

    return {
        "topic": event.topic,
        "sequence": event.sequence,
        "producer": event.producer,
        "timestamp": event.timestamp,
        "uuid": event.uuid,
        "data": decode_payload("msgpack", event.data),
    }


def _cmd_send(args: argparse.Namespace) -> int:
    try:
        data = orjson.loads(args.data)
    except orjson.JSONDecodeError as exc:
        print(f"taproom send eventbus: --data is not JSON: {exc}", file=sys.stderr)
        return 2
    if not args.topic.startswith("/"):
        print("taproom send eventbus: --topic must start with '/'", file=sys.stderr)
        return 2

    async def go() -> int:
        client = EventBusClient(
            args.server,
            producer=args.producer,
            server_timeout=args.timeout,
            subtrees=["/"],
            curve=curve_from_args(args),
        )
        await client.start(timeout=args.timeout * 2)
        try:
            futures = [await client.publish(args.topic, data) for _ in range(args.count)]
            sequences = await asyncio.wait_for(asyncio.gather(*futures), args.timeout * 2)
        finally:
            await client.stop()
        for seq in sequences:
            print(seq)
        return 0

    try:
        return asyncio.run(go())
    except TimeoutError as exc:
        print(f"taproom send eventbus: {exc or 'no confirmation from the bus'}", file=sys.stderr)
        return 1


def register_send(subparsers: Any) -> None:
    p = subparsers.add_parser("eventbus", help="publish events on an Event BUS")
    p.add_argument(
        "--server",
        action="append",
        default=None,
        metavar="URL",
        help="tcp://host:P (SNAPSHOT port); repeat for the Binary Star backup",
    )
    p.add_argument("--topic", required=True, help="e.g. /orders/eu/")
    p.add_argument("--data", required=True, help="JSON value, sent as MessagePack")
    p.add_argument("--count", type=int, default=1)
    p.add_argument("--producer", default=None)
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    add_curve_arguments(p)
    p.set_defaults(func=_cmd_send_default)


def _cmd_send_default(args: argparse.Namespace) -> int:
    if not args.server:
        args.server = ["tcp://127.0.0.1:5556"]
    return _cmd_send(args)


def register_tail(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int | None]:
    parser.add_argument(
        "--eventbus",
        action="append",
        metavar="URL",
        help="tail an Event BUS (tcp://host:P): snapshot, then live with --follow; "
        "repeat for the backup",
    )
    parser.add_argument(
        "--subtree", action="append", default=None, metavar="/A/", help="with --eventbus"
    )
    parser.add_argument(
        "--eventbus-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="with --eventbus: give up when no server sends a snapshot within S seconds",
    )
    add_curve_arguments(parser)
    return _tail_handler


def _tail_handler(args: argparse.Namespace) -> int | None:
    """``taproom tail --eventbus``. A closed stdout (``| head -1``) raises BrokenPipeError out
    of the callback, through the client, to ``taproom.cli.main``, which exits quietly."""
    if not getattr(args, "eventbus", None):
        return None
    out = sys.stdout.buffer
    limit = args.limit
    done = asyncio.Event()
    count = 0

    def emit(event: Event, source: str) -> None:
        nonlocal count
        if limit is not None and count >= limit:
            done.set()
            return
        out.write(orjson.dumps(_event_json(event), option=orjson.OPT_APPEND_NEWLINE))
        count += 1
        if args.follow:
            out.flush()
        if limit is not None and count >= limit:
            done.set()

    async def go() -> None:
        client = EventBusClient(
            args.eventbus, args.subtree or (), on_update=emit, curve=curve_from_args(args)
        )
        await client.start(timeout=args.eventbus_timeout)
        try:
            if args.follow:
                limit_reached = asyncio.ensure_future(done.wait())
                stopped = asyncio.ensure_future(client.wait())
                await asyncio.wait((limit_reached, stopped), return_when=FIRST_COMPLETED)
                limit_reached.cancel()
                if stopped.done():
                    stopped.result()  # the callback's exception (a closed stdout)
                stopped.cancel()
        finally:
            await client.stop()

    try:
        asyncio.run(go())
    except KeyboardInterrupt:
        pass
    except TimeoutError as exc:
        print(f"taproom tail --eventbus: {exc}", file=sys.stderr)
        return 1
    out.flush()
    return 0
