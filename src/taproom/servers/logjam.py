"""Logjam over ZeroMQ: taproom as a logjam-device, on the hub's event loop.

Ingest: a ROUTER (DEALER agents; an empty frame before the four frames asks for a
``202 Accepted`` reply, sent only after the commit) and a PULL (PUSH agents). Each read loop
drains a burst without blocking, validates it with :mod:`taproom.protocols.logjam`, builds one
batch and hands it to the hub.

Output: an XPUB socket (consumers connect SUB sockets) fed from ``hub.subscribe("logjam_pub")``,
so only committed events go out, in journal order, renumbered from 1 under taproom's device
number, plus a heartbeat every ``heartbeat_interval_s``. Sends never block. ``ZMQ_XPUB_NODROP``
makes a send fail with EAGAIN when any matching subscriber's queue is full; that message is then
counted in ``taproom_logjam_pub_dropped_messages_total`` (a lower bound: libzmq then stops
offering messages to the full subscriber until it drains) and sent once more in lossy mode, so
it still reaches every subscriber with room and only the full ones miss it. A slow subscriber
never costs a fast one a message; consumers see their own gaps in sequence numbers (see
docs/protocols/logjam.md).

Replay: a ROUTER side channel answers ``offset``/``seq`` requests from the journal (read in a
thread), so a consumer that saw a gap can fill it.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import functools
import logging
import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
import zmq
import zmq.asyncio
import zmq.backend

from ..config import config_section, setting
from ..errors import ConfigError, HubStopped, ProtocolError
from ..hub import CommittedBatch, Hub
from ..payloads import decode_payload
from ..protocols import logjam as lj
from ..records import RECORD_HEAD, Record

__all__ = ["LogjamConfig", "LogjamService", "create_service"]

log = logging.getLogger("taproom.logjam")

# routing id + empty delimiter + four frames; anything longer is refused without keeping it.
_MAX_FRAMES = 6
_LOG_PER_SECOND = 20


@config_section("logjam")
@dataclass(frozen=True)
class LogjamConfig:
    enabled: bool = setting(True, "logjam agents and consumers")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    router_port: int = setting(
        9604, "logjam-device's ROUTER port for DEALER agents", min=0, max=65535
    )
    pull_port: int = setting(9605, "logjam-device's PULL port for PUSH agents", min=0, max=65535)
    pub_port: int = setting(9606, "logjam-device's PUB port for consumers", min=0, max=65535)
    replay_port: int = setting(
        9607, "replay side channel: the port after logjam-device's three", min=0, max=65535
    )
    rcv_hwm: int = setting(
        100_000,
        "messages ZeroMQ queues per agent connection before PUSH agents block (logjam-device)",
        min=1,
    )
    snd_hwm: int = setting(
        100_000,
        "messages queued per subscriber (about 50 MB of logjam requests) before drops",
        min=1,
    )
    max_message_bytes: int = setting(
        4 * 1024 * 1024,
        "ZMQ_MAXMSGSIZE per frame: logjam request bodies are KBs; bigger means a broken agent",
        min=1024,
        max=1 << 30,
    )
    max_decompressed_bytes: int = setting(
        16 * 1024 * 1024,
        "a body may inflate to at most this (zlib bombs), checked before allocating",
        min=1024,
        max=64 * 1024 * 1024,
    )
    burst_messages: int = setting(
        4096, "messages drained per read before one batch goes to the journal", min=1
    )
    device_number: int = setting(
        1,
        "non-zero so importers track gaps; must be unique across logjam producers (seed)",
        min=0,
        max=(1 << 32) - 1,
    )
    heartbeat_interval_s: float = setting(
        5.0, "logjam-device publishes a heartbeat every 5 s", min=0.01, max=3600
    )
    sequence_wrap: int = setting(
        (1 << 64) - 1,
        "the last sequence number before restarting at 1 (seed); lower only for tests",
        min=2,
        max=(1 << 64) - 1,
    )
    output_compression: str = setting(
        "none",
        "logjam-device forwards uncompressed by default; consumers decompress any method",
        choices=("none", "zlib", "snappy", "lz4"),
    )
    meta_size: int = setting(
        24, "24-byte meta is what logjam-tools reads; 22 is the seed's form", choices=(22, 24)
    )
    grammar: str = setting(
        "seed",
        "the seed's app-env/topic grammar; 'relaxed' also allows digits, '_' and '-'",
        choices=("seed", "relaxed"),
    )
    routes: tuple[str, ...] = setting(
        ("*",), "protocols whose events reach the PUB output; '*' is every protocol"
    )
    default_app_env: str = setting(
        "taproom-{protocol}",
        "app-env for events whose stream is not a valid app-env",
    )
    event_protocols: tuple[str, ...] = setting(
        ("eventbus", "lager"), "protocols mapped to events.* topics (others to logs.*)"
    )
    replay_max_count: int = setting(
        10_000, "events examined per replay request: bounds one reply's memory", min=1
    )
    replay_index_size: int = setting(
        1_000_000,
        "sequence numbers remembered for 'seq' replay requests (8 bytes each)",
        min=16,
        max=100_000_000,
    )
    hostname: str = setting("", "heartbeat and ping replies; empty means this host's name")

    def validate(self) -> None:
        if self.meta_size == 22 and self.device_number > 0xFFFF:
            raise ConfigError("the 22-byte meta holds a 16-bit device number", key="device_number")
        try:
            sample = self.default_app_env.format(protocol="lumberjack")
        except (KeyError, IndexError, ValueError):
            raise ConfigError("only {protocol} may be filled in", key="default_app_env") from None
        if not lj.is_valid_app_env(sample.encode(), relaxed=self.grammar == "relaxed"):
            raise ConfigError(
                f"gives {sample!r}, not an app-env (application-environment)",
                key="default_app_env",
            )


# The record header of records.py's batch layout, read here to publish logjam records without
# decoding them into Record objects (the PUB output's hot path).
_RECORD_HEAD = RECORD_HEAD

# pyzmq's Socket.send is a Python wrapper (routing ids, groups) around the Cython send; the hot
# loops call the Cython method directly, which halves the cost of a frame (DESIGN.md decision 3).
_raw_send = zmq.backend.Socket.send
# Plain ints: pyzmq's IntFlag constants cost an __index__ call per use on the hot paths.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_ZMQ_TYPE = int(zmq.TYPE)


def _libzmq() -> Any:
    """pyzmq's own libzmq through cffi (ABI mode), or None.

    Why: a frame's "more" flag is the one thing the ingest loops need per frame, and pyzmq
    makes it expensive: ``getsockopt(RCVMORE)`` builds a SocketOption enum (~1.5 us) and
    ``recv(copy=False)`` builds a Frame object (~1 us). ``zmq_getsockopt`` through cffi is
    ~0.5 us. The library must be the very one pyzmq loaded (the socket handle is a pointer
    into it), so it is found in this process's memory map; with no cffi, no /proc, or any
    doubt, the loops use pyzmq's getsockopt (slower, same results).
    """
    try:
        import cffi  # installed with cryptography (a dependency); optional here
    except ImportError:
        return None
    paths = set()
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if os.path.basename(name).startswith("libzmq"):
                    paths.add(name)
    except OSError:
        return None
    if len(paths) != 1:
        return None
    ffi = cffi.FFI()
    ffi.cdef("int zmq_getsockopt(void *s, int option, void *optval, size_t *optvallen);")
    try:
        return ffi, ffi.dlopen(paths.pop())
    except OSError:
        return None


_LIBZMQ: Any = None
_LIBZMQ_LOADED = False


class _RcvMore(NamedTuple):
    """ZMQ_RCVMORE of one socket, for the ingest loops: they call
    ``getsockopt(handle, _RCVMORE, flag, size)`` inline and read ``flag[0]`` (a Python call
    fewer per frame than calling this object, which does the same)."""

    getsockopt: Callable[[Any, int, Any, Any], int]
    handle: Any
    flag: Any  # cffi int* or a one-item list: flag[0] is the answer
    size: Any
    fast: bool  # zmq_getsockopt through cffi; False: pyzmq's getsockopt

    def __call__(self) -> int:
        self.getsockopt(self.handle, _RCVMORE, self.flag, self.size)
        return int(self.flag[0])


def _rcvmore_reader(sock: zmq.Socket[bytes]) -> _RcvMore:
    """The cheapest way to read ZMQ_RCVMORE of ``sock`` after each recv."""
    global _LIBZMQ, _LIBZMQ_LOADED
    if not _LIBZMQ_LOADED:
        _LIBZMQ, _LIBZMQ_LOADED = _libzmq(), True

    def pyzmq_getsockopt(_handle: Any, option: int, out: list[int], _size: Any) -> int:
        out[0] = int(sock.get(option))
        return 0

    slow = _RcvMore(pyzmq_getsockopt, None, [0], None, False)
    if _LIBZMQ is None:
        return slow
    ffi, lib = _LIBZMQ
    fast = _RcvMore(
        lib.zmq_getsockopt,
        ffi.cast("void *", sock.underlying),
        ffi.new("int *"),
        ffi.new("size_t *", ffi.sizeof("int")),
        True,
    )
    # The same socket seen both ways, or the slow path: the handle must be pyzmq's.
    kind = ffi.new("int *")
    if (
        lib.zmq_getsockopt(fast.handle, _ZMQ_TYPE, kind, ffi.new("size_t *", ffi.sizeof("int")))
        != 0
        or kind[0] != sock.get(_ZMQ_TYPE)
        or fast() != slow()
    ):
        return slow
    return fast


_META_OUT = {24: struct.Struct("!HBBIQQ"), 22: struct.Struct("!HBBHQQ")}


class LogjamService:
    """The logjam ROUTER/PULL ingest, XPUB output and replay channel."""

    def __init__(self, hub: Hub, config: LogjamConfig) -> None:
        self.hub = hub
        self.config = config
        self.relaxed = config.grammar == "relaxed"
        self.hostname = (config.hostname or socket.getfqdn() or "localhost").encode()
        self.compression = lj.compression_by_name(config.output_compression)
        self.mapper = lj.OutputMapper(
            routes=config.routes,
            default_app_env=config.default_app_env,
            event_protocols=config.event_protocols,
            payload_decoder=decode_payload,
        )
        self._meta = _META_OUT[config.meta_size]
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.asyncio.Socket] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: set[asyncio.Future[Any]] = set()
        self.addresses: dict[str, str] = {}
        self.pub_endpoint = ""
        # Output numbering: the k-th message sent carries sequence ((k - 1) % wrap) + 1.
        self.published = 0
        self._next_publish = 0  # journal offset after the last record handled
        self._index = array.array("q", [-1]) * config.replay_index_size
        self.subscriptions = 0
        self._log_window = 0.0
        self._log_count = self._log_suppressed = 0
        m = hub.metrics
        self._m_published = m.counter(
            "logjam", "published", "messages", "Messages sent on the PUB output", ("kind",)
        )
        self._m_pub_data = self._m_published.labels(kind="data")
        self._m_pub_heartbeat = self._m_published.labels(kind="heartbeat")
        self._m_dropped = m.counter(
            "logjam",
            "pub_dropped",
            "messages",
            "PUB messages refused because a matching subscriber was at its HWM",
            ("reason",),
        ).labels(reason="hwm")
        self._m_pings = m.counter("logjam", "pings", "messages", "Pings answered")
        self._m_replay = m.counter(
            "logjam", "replay_requests", "requests", "Replay requests by outcome", ("kind",)
        )
        m.gauge_fn(
            "logjam", "pub_subscriptions", "count", "Live SUB prefixes", lambda: self.subscriptions
        )

    # --- lifecycle ------------------------------------------------------------------------

    def _bind(self, kind: int, port: int, name: str) -> tuple[zmq.asyncio.Socket, zmq.Socket]:
        assert self._ctx is not None
        cfg = self.config
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, cfg.rcv_hwm)
        sock.setsockopt(zmq.SNDHWM, cfg.snd_hwm)
        if kind == zmq.XPUB:
            sock.setsockopt(zmq.XPUB_NODROP, 1)
        self._sockets.append(sock)
        sock.bind(f"tcp://{cfg.host}:{port or '*'}")
        endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.addresses[name] = endpoint.removeprefix("tcp://")
        return sock, zmq.Socket.shadow(sock.underlying)

    async def start(self) -> dict[str, str]:
        cfg = self.config
        self._ctx = zmq.asyncio.Context()
        try:
            router, router_sync = self._bind(zmq.ROUTER, cfg.router_port, "logjam_router")
            pull, pull_sync = self._bind(zmq.PULL, cfg.pull_port, "logjam_pull")
            pub, pub_sync = self._bind(zmq.XPUB, cfg.pub_port, "logjam_pub")
            replay, replay_sync = self._bind(zmq.ROUTER, cfg.replay_port, "logjam_replay")
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self.pub_endpoint = (
            f"tcp://{self.hostname.decode()}:{self.addresses['logjam_pub'].rsplit(':', 1)[1]}"
        )
        self._pub = pub_sync
        self._xpub = pub
        self._sub = self.hub.subscribe("logjam_pub")
        self._tasks = [
            asyncio.create_task(self._router_loop(router, router_sync), name="logjam-router"),
            asyncio.create_task(self._pull_loop(pull, pull_sync), name="logjam-pull"),
            asyncio.create_task(self._publish_loop(), name="logjam-pub"),
            asyncio.create_task(self._heartbeat_loop(), name="logjam-heartbeat"),
            asyncio.create_task(self._replay_loop(replay, replay_sync), name="logjam-replay"),
        ]
        return dict(self.addresses)

    async def stop(self) -> None:
        """Stop reading; let submitted batches commit so their 202s go out; close."""
        for task in self._tasks[:2]:
            task.cancel()
        if self._pending:
            await asyncio.wait(set(self._pending), timeout=self.hub.config.hub.grace_period_s)
        for task in self._tasks[2:]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._sub.close()
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets = []
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    # --- ingest ---------------------------------------------------------------------------

    @staticmethod
    def _recv(sock: zmq.Socket) -> tuple[list[bytes], bool]:
        """One multipart message without blocking; frames past the bound are read and dropped."""
        frames = [sock.recv(zmq.NOBLOCK)]
        overflow = False
        while sock.get(zmq.RCVMORE):
            frame = sock.recv()
            if len(frames) < _MAX_FRAMES:
                frames.append(frame)
            else:
                overflow = True
        return frames, overflow

    @staticmethod
    async def _readable(asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """Return when ``sock`` has input. ZMQ_FD is edge-triggered and replies sent on the
        same socket (acks) can consume the edge, so the wait re-checks every 100 ms."""
        while not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
            await asock.poll(100, zmq.POLLIN)  # type: ignore[call-arg]

    def _reject(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected("logjam", reason)
        # Every reject is counted; the log gets at most _LOG_PER_SECOND lines a second so a
        # broken agent sending thousands of bad messages cannot flood it.
        now = time.monotonic()
        if now - self._log_window >= 1.0:
            if self._log_suppressed:
                log.info("logjam: %d more rejected messages not logged", self._log_suppressed)
            self._log_window, self._log_count, self._log_suppressed = now, 0, 0
        if self._log_count < _LOG_PER_SECOND:
            self._log_count += 1
            log.info("logjam: rejected message (%s): %s", reason, detail)
        else:
            self._log_suppressed += 1

    def _parser(self) -> lj.IngestParser:
        cfg = self.config
        return lj.IngestParser(
            max_body=cfg.max_message_bytes,
            max_decompressed=cfg.max_decompressed_bytes,
            relaxed=self.relaxed,
        )

    def _submit(self, parser: lj.IngestParser) -> asyncio.Future[Any] | None:
        """One burst's records to the hub as one batch; None if the hub is stopping."""
        batch = parser.take_batch()
        try:
            future = self.hub.submit(batch)
        except HubStopped:
            return None
        self.hub.metrics.accepted("logjam", batch.count)
        self._pending.add(future)
        return future

    async def _pull_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """PUSH agents: no replies. Messages of four frames (all of them, in practice) take
        the unrolled path; any other shape is read whole and refused."""
        hub = self.hub
        parser = self._parser()
        push = parser.pusher()
        recv = sock.recv
        more = _rcvmore_reader(sock)
        getopt, handle, flag, size, _ = more
        rcvmore = _RCVMORE
        burst = self.config.burst_messages
        while True:
            await hub.wait_capacity()
            await self._readable(asock, sock)
            parser.start_batch(time.time_ns())
            for _ in range(burst):
                try:
                    a = recv(_NOBLOCK)
                except zmq.Again:
                    break
                # A message arrives whole, so after its first frame the rest is already here.
                getopt(handle, rcvmore, flag, size)
                if flag[0]:
                    b = recv(0)
                    getopt(handle, rcvmore, flag, size)
                    if flag[0]:
                        c = recv(0)
                        getopt(handle, rcvmore, flag, size)
                        if flag[0]:
                            d = recv(0)
                            getopt(handle, rcvmore, flag, size)
                            if not flag[0]:
                                try:
                                    if push(a, b, c, d) is not None:
                                        self._m_pings.inc()
                                except ProtocolError as exc:
                                    self._refuse(sock, exc.reason, str(exc), None, b"")
                                except Exception:  # a bug must not stop ingest
                                    log.exception("logjam: internal error on a message")
                                    self._refuse(sock, "internal_error", "", None, b"")
                                continue
                            count = 5
                            recv(0)
                            while more():  # read and drop the rest of an over-long message
                                recv(0)
                                count += 1
                        else:
                            count = 3
                    else:
                        count = 2
                else:
                    count = 1
                self._refuse(sock, "bad_frame_count", f"{count} frames, expected 4", None, b"")
            if parser.pending():
                future = self._submit(parser)
                if future is None:
                    return
                future.add_done_callback(self._pending.discard)
            # While agents keep the socket full, neither wait above suspends: yield once per
            # burst so commits resolve, 202s and the PUB output go out, /metrics answers.
            await asyncio.sleep(0)

    async def _router_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """DEALER agents: an empty frame after the routing id asks for a reply, ``202
        Accepted`` once the burst is durable (``400 Bad Request`` at once)."""
        hub = self.hub
        parser = self._parser()
        push = parser.pusher()
        recv = sock.recv
        getopt, handle, flag, size, _ = _rcvmore_reader(sock)
        rcvmore = _RCVMORE
        burst = self.config.burst_messages
        content_max = _MAX_FRAMES - 1
        while True:
            await hub.wait_capacity()
            await self._readable(asock, sock)
            parser.start_batch(time.time_ns())
            acks: list[tuple[bytes, bytes]] = []
            for _ in range(burst):
                try:
                    routing_id = recv(_NOBLOCK)
                except zmq.Again:
                    break
                # The routing id, then [""] app-env topic body meta (a message is delivered
                # whole, so the rest is already here). The usual shape, a reply wanted, is
                # unrolled; whatever else arrives is read in the loop below, with flag[0]
                # telling whether frames are left.
                getopt(handle, rcvmore, flag, size)
                if not flag[0]:
                    content: list[bytes] = []
                else:
                    e = recv(0)
                    getopt(handle, rcvmore, flag, size)
                    if not (flag[0] and not e):
                        content = [e]
                    else:
                        a = recv(0)
                        getopt(handle, rcvmore, flag, size)
                        if not flag[0]:
                            content = [e, a]
                        else:
                            b = recv(0)
                            getopt(handle, rcvmore, flag, size)
                            if not flag[0]:
                                content = [e, a, b]
                            else:
                                c = recv(0)
                                getopt(handle, rcvmore, flag, size)
                                if not flag[0]:
                                    content = [e, a, b, c]
                                else:
                                    d = recv(0)
                                    getopt(handle, rcvmore, flag, size)
                                    if not flag[0]:
                                        self._take_reply_message(
                                            sock, push, routing_id, a, b, c, d, acks
                                        )
                                        continue
                                    content = [e, a, b, c, d]
                # Frames past the bound are read and dropped.
                overflow = False
                while flag[0]:
                    frame = recv(0)
                    if len(content) < content_max:
                        content.append(frame)
                    else:
                        overflow = True
                    if getopt(handle, rcvmore, flag, size) != 0:
                        break  # cannot happen on an open socket; never loop on it
                wants_reply = bool(content) and content[0] == b""
                if wants_reply:
                    del content[0]
                first = content[0] if content and len(content[0]) <= 255 else b""
                try:
                    if overflow:
                        raise lj.LogjamError("too many frames", reason="bad_frame_count")
                    if len(content) != 4:
                        raise lj.LogjamError(
                            f"{len(content)} frames, expected 4", reason="bad_frame_count"
                        )
                    ping = push(content[0], content[1], content[2], content[3])
                except ProtocolError as exc:
                    self._refuse(
                        sock, exc.reason, str(exc), routing_id if wants_reply else None, first
                    )
                    continue
                except Exception:  # a bug must not stop ingest; nothing of this one is stored
                    log.exception("logjam: internal error on a message")
                    self._refuse(
                        sock, "internal_error", "", routing_id if wants_reply else None, first
                    )
                    continue
                if ping is not None:
                    self._m_pings.inc()
                    if wants_reply:
                        with contextlib.suppress(zmq.ZMQError):
                            sock.send_multipart(
                                lj.reply_frames(routing_id, lj.PING, lj.PING_OK, self.hostname),
                                zmq.NOBLOCK,
                            )
                elif wants_reply:
                    acks.append((routing_id, first))
            if parser.pending():
                future = self._submit(parser)
                if future is None:
                    return
                if acks:
                    # 202s go out only once the batch is durable; reading the next burst
                    # overlaps with this commit's fsync (hub.wait_capacity bounds what is in
                    # flight).
                    future.add_done_callback(functools.partial(self._send_acks, sock, acks))
                else:
                    future.add_done_callback(self._pending.discard)
            await asyncio.sleep(0)  # let commits resolve and 202s go out (see _pull_loop)

    def _take_reply_message(
        self,
        sock: zmq.Socket,
        push: Callable[[bytes, bytes, bytes, bytes], lj.PingMessage | None],
        routing_id: bytes,
        a: bytes,
        b: bytes,
        c: bytes,
        d: bytes,
        acks: list[tuple[bytes, bytes]],
    ) -> None:
        """``routing-id "" app-env topic body meta``: store it and queue its 202, answer a
        ping, or refuse it with a 400 at once (same handling as the general path)."""
        try:
            ping = push(a, b, c, d)
        except ProtocolError as exc:
            self._refuse(sock, exc.reason, str(exc), routing_id, a if len(a) <= 255 else b"")
            return
        except Exception:  # a bug must not stop ingest; nothing of this one is stored
            log.exception("logjam: internal error on a message")
            self._refuse(sock, "internal_error", "", routing_id, a if len(a) <= 255 else b"")
            return
        if ping is None:
            acks.append((routing_id, a if len(a) <= 255 else b""))
            return
        self._m_pings.inc()
        with contextlib.suppress(zmq.ZMQError):
            sock.send_multipart(
                lj.reply_frames(routing_id, lj.PING, lj.PING_OK, self.hostname), zmq.NOBLOCK
            )

    def _refuse(
        self, sock: zmq.Socket, reason: str, detail: str, reply_to: bytes | None, first: bytes
    ) -> None:
        """Count and log a bad message; DEALERs that asked get ``400 Bad Request``."""
        self._reject(reason, detail)
        if reply_to is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(lj.reply_frames(reply_to, first, lj.BAD_REQUEST), zmq.NOBLOCK)

    def _send_acks(
        self, sock: zmq.Socket, acks: list[tuple[bytes, bytes]], future: asyncio.Future[Any]
    ) -> None:
        self._pending.discard(future)
        if future.cancelled() or future.exception() is not None:
            return  # not durable: no 202; the agent times out and may resend
        if sock.closed:
            return
        send = functools.partial(_raw_send, sock)
        flags = _NOBLOCK | _SNDMORE
        accepted = lj.ACCEPTED
        for routing_id, first in acks:
            # routing id, "" (the REQ-compatible delimiter), the agent's app-env, the status
            try:
                send(routing_id, flags)
                send(b"", flags)
                send(first, flags)
                send(accepted, _NOBLOCK)
            except zmq.ZMQError:
                continue  # the agent went away; ROUTER drops replies to unknown peers

    # --- PUB output -----------------------------------------------------------------------

    def _emit(
        self,
        app_env: bytes,
        topic: bytes,
        body: bytes,
        created_ms: int,
        offset: int,
        compression: int,
    ) -> bool:
        """Number and send one message; a subscriber that was full misses it (counted)."""
        k = self.published + 1
        self.published = k
        seq = (k - 1) % self.config.sequence_wrap + 1
        index = self._index
        index[k % len(index)] = offset
        meta = self._meta.pack(
            lj.META_TAG, compression, lj.META_VERSION, self.config.device_number, created_ms, seq
        )
        pub = self._pub
        try:
            _raw_send(pub, app_env, zmq.NOBLOCK | zmq.SNDMORE)
        except zmq.Again:
            self._m_dropped.inc()
            self._send_past_full(app_env, topic, body, meta)
            return True  # sent: only the full subscribers miss it
        # With XPUB_NODROP only the first frame can hit the HWM (pipes count whole messages).
        _raw_send(pub, topic, zmq.SNDMORE)
        _raw_send(pub, body, zmq.SNDMORE)
        _raw_send(pub, meta, 0)
        return True

    def _send_past_full(self, app_env: bytes, topic: bytes, body: bytes, meta: bytes) -> None:
        """Some matching subscriber's queue is full: send this one message in lossy mode, so
        every subscriber with room gets it and only the full ones miss it (their sequence
        numbers show the gap; replay fills it)."""
        pub = self._pub
        pub.setsockopt(zmq.XPUB_NODROP, 0)
        try:
            _raw_send(pub, app_env, zmq.NOBLOCK | zmq.SNDMORE)
            _raw_send(pub, topic, zmq.SNDMORE)
            _raw_send(pub, body, zmq.SNDMORE)
            _raw_send(pub, meta, 0)
        finally:
            pub.setsockopt(zmq.XPUB_NODROP, 1)

    async def _publish_loop(self) -> None:
        async for batch in self._sub:
            self._drain_subscriptions()
            try:
                self._publish_batch(batch)
            except Exception:  # a bug must not stop the output; the next batch goes out
                log.exception("logjam: publishing a batch failed")

    def _publish_batch(self, batch: CommittedBatch) -> None:
        """Send one committed batch. Logjam records take a fast path straight off the batch
        body (layout in records.py); other protocols are decoded and mapped."""
        now_ms = int(time.time() * 1000)
        mapper = self.mapper
        compression = int(self.compression)
        emit = self._emit
        start = self._next_publish
        if batch._records is not None or compression or batch.base_offset < start:
            sent = 0
            for record in batch.records():
                if record.offset < start or not mapper.routed(record.protocol):
                    continue
                app_env, topic, body, created = mapper.map(record, now_ms)
                if compression:
                    body = lj.compress(compression, body)
                sent += emit(app_env, topic, body, created, record.offset, compression)
            self._next_publish = batch.end_offset
            self._m_pub_data.inc(sent)
            return
        if type(batch.body) is lj.IngestedBody:
            if mapper.routed("logjam"):
                self._publish_ingested(batch, now_ms)
            self._next_publish = batch.end_offset
            return
        body = batch.body
        unpack = _RECORD_HEAD.unpack_from
        head_size = _RECORD_HEAD.size
        routed_logjam = mapper.routed("logjam")
        pub_send = functools.partial(_raw_send, self._pub)
        pack_meta = self._meta.pack
        index = self._index
        index_size = len(index)
        wrap = self.config.sequence_wrap
        device = self.config.device_number
        tag, version = lj.META_TAG, lj.META_VERSION
        first_flags = _NOBLOCK | _SNDMORE
        more = _SNDMORE
        k = self.published
        seq = (k - 1) % wrap + 1 if k else 0  # the last number handed out
        sent = dropped = 0
        others: list[int] = []
        pos = 0
        end = len(body)
        offset = batch.base_offset
        try:
            while pos < end:
                (length, _recv, ts_ns, _seq, lp, lc, ls, lt, _lr, _le, _la, ll) = unpack(body, pos)
                q = pos + head_size
                if body[q : q + lp] != b"logjam":
                    others.append(offset)  # mapped below, after this run of logjam records
                else:
                    if routed_logjam:
                        q += lp + lc
                        app_env = body[q : q + ls]
                        q += ls
                        topic = body[q : q + lt]
                        q = pos + 4 + length - ll
                        k += 1
                        seq = seq + 1 if seq < wrap else 1
                        index[k % index_size] = offset
                        meta = pack_meta(
                            tag,
                            0,
                            version,
                            device,
                            ts_ns // 1_000_000 if ts_ns > 0 else now_ms,
                            seq,
                        )
                        try:
                            pub_send(app_env, first_flags)
                        except zmq.Again:
                            dropped += 1
                            self._send_past_full(app_env, topic, body[q : q + ll], meta)
                            sent += 1
                        else:
                            pub_send(topic, more)
                            pub_send(body[q : q + ll], more)
                            pub_send(meta, 0)
                            sent += 1
                pos += 4 + length
                offset += 1
                if others and (
                    pos >= end or body[pos + head_size : pos + head_size + 6] == b"logjam"
                ):
                    # keep journal order: flush the non-logjam records before the next logjam one
                    self.published = k
                    sent += self._publish_others(batch, others, now_ms)
                    k = self.published
                    seq = (k - 1) % wrap + 1 if k else 0
                    others = []
        finally:
            self.published = k
            self._next_publish = batch.end_offset
            if dropped:
                self._m_dropped.inc(dropped)
            self._m_pub_data.inc(sent)

    def _publish_ingested(self, batch: CommittedBatch, now_ms: int) -> None:
        """A batch the ingest loops built (its body is an :class:`lj.IngestedBody`, which the
        hub hands on as it is; read back from the journal it is plain bytes): logjam records
        only, so no protocol checks. With no subscriber at all the messages are numbered (and
        indexed for replay) exactly as if sent, but not handed to libzmq, which would drop
        every one."""
        count = batch.count
        k = self.published
        if self.subscriptions == 0:
            self._index_run(k + 1, batch.base_offset, count)
            self.published = k + count
            self._m_pub_data.inc(count)
            return
        body = batch.body
        unpack = _RECORD_HEAD.unpack_from
        skip = _RECORD_HEAD.size + 10  # protocol "logjam" and content type "json" come first
        send = functools.partial(_raw_send, self._pub)
        pack_meta = self._meta.pack
        wrap = self.config.sequence_wrap
        seq = (k - 1) % wrap + 1 if k else 0  # the last number handed out
        device = self.config.device_number
        tag, version = lj.META_TAG, lj.META_VERSION
        first_flags = _NOBLOCK | _SNDMORE
        more = _SNDMORE
        dropped = 0
        pos = 0
        first_k = k
        try:
            for _ in range(count):
                (length, _recv, ts_ns, _seq, _lp, _lc, ls, lt, _lr, _le, _la, ll) = unpack(
                    body, pos
                )
                q = pos + skip
                app_env = body[q : q + ls]
                q += ls
                topic = body[q : q + lt]
                pos += 4 + length
                k += 1
                seq = seq + 1 if seq < wrap else 1
                meta = pack_meta(
                    tag, 0, version, device, ts_ns // 1_000_000 if ts_ns > 0 else now_ms, seq
                )
                try:
                    send(app_env, first_flags)
                except zmq.Again:
                    dropped += 1
                    self._send_past_full(app_env, topic, body[pos - ll : pos], meta)
                    continue
                send(topic, more)
                send(body[pos - ll : pos], more)
                send(meta, 0)
        finally:
            # the replay index learns the whole run at once (offsets follow k one to one)
            self._index_run(first_k + 1, batch.base_offset, k - first_k)
            self.published = k
            if dropped:
                self._m_dropped.inc(dropped)
            self._m_pub_data.inc(k - first_k)

    def _index_run(self, k_first: int, offset: int, count: int) -> None:
        """Remember offsets ``offset ..`` for messages ``k_first ..`` in the replay ring."""
        index = self._index
        size = len(index)
        if count > size:  # only the last ``size`` fit in the ring
            k_first, offset, count = k_first + count - size, offset + count - size, size
        start = k_first % size
        head = min(count, size - start)
        index[start : start + head] = array.array("q", range(offset, offset + head))
        if count > head:
            index[: count - head] = array.array("q", range(offset + head, offset + count))

    def _publish_others(self, batch: CommittedBatch, offsets: list[int], now_ms: int) -> int:
        wanted = set(offsets)
        mapper = self.mapper
        sent = 0
        for record in batch.records():
            if record.offset in wanted and mapper.routed(record.protocol):
                app_env, topic, body, created = mapper.map(record, now_ms)
                sent += self._emit(app_env, topic, body, created, record.offset, 0)
        return sent

    def _drain_subscriptions(self) -> None:
        """Read XPUB subscription messages: the count is a gauge, and libzmq queues them."""
        while True:
            try:
                msg = self._pub.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if msg[:1] == b"\x01":
                self.subscriptions += 1
            elif msg[:1] == b"\x00":
                self.subscriptions = max(0, self.subscriptions - 1)

    def subscriber_count(self) -> int:
        """Live SUB subscriptions (prefixes) the XPUB has seen, after reading pending ones."""
        self._drain_subscriptions()
        return self.subscriptions

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        topic = self.pub_endpoint.encode()
        while True:
            await asyncio.sleep(interval)
            self._drain_subscriptions()
            body = orjson.dumps(
                {
                    "device": self.config.device_number,
                    "hostname": self.hostname.decode(),
                    "next_offset": self._sub.next_offset,
                }
            )
            if self._emit(
                lj.HEARTBEAT_APP_ENV, topic, body, int(time.time() * 1000), -1, lj.Compression.NONE
            ):
                self._m_pub_heartbeat.inc()

    # --- replay ---------------------------------------------------------------------------

    def _seq_offsets(self, first_seq: int, last_seq: int) -> dict[int, int] | None:
        """Journal offset per data sequence number in ``first..last``; None if forgotten."""
        k_now = self.published
        if k_now == 0:
            return None
        wrap = self.config.sequence_wrap
        seq_now = (k_now - 1) % wrap + 1
        if first_seq < 1 or last_seq > wrap:
            return None
        back = (seq_now - first_seq) % wrap
        k_first = k_now - back
        size = len(self._index)
        if k_first < 1 or k_now - k_first >= size:
            return None
        # Numbers not handed out yet are simply not there (the reply's "next" says so).
        count = min(last_seq - first_seq + 1, k_now - k_first + 1)
        result = {}
        for i in range(count):
            offset = self._index[(k_first + i) % size]
            if offset >= 0:
                result[offset] = first_seq + i
        return result

    def _replay_read(
        self, start: int, end: int, prefixes: Sequence[bytes], seqs: dict[int, int] | None
    ) -> list[bytes]:
        """Runs in a thread: the matching events of ``[start, end)`` as reply frames."""
        frames: list[bytes] = []
        count = 0
        now_ms = int(time.time() * 1000)
        mapper = self.mapper
        device = self.config.device_number
        compression = int(self.compression)
        record: Record
        for record in self.hub.journal.read(start, end):
            if seqs is not None:
                seq = seqs.get(record.offset)
                if seq is None:
                    continue
            else:
                seq = 0  # replayed by offset: not part of the live numbering
                if not mapper.routed(record.protocol):
                    continue
            app_env, topic, body, created = mapper.map(record, now_ms)
            if not lj.matches_prefixes(app_env, prefixes):
                continue
            frames += (
                str(record.offset).encode(),
                app_env,
                topic,
                lj.compress(compression, body) if compression else body,
                self._meta.pack(lj.META_TAG, compression, lj.META_VERSION, device, created, seq),
            )
            count += 1
        return frames

    async def _answer_replay(self, content: Sequence[bytes]) -> list[bytes]:
        req = lj.parse_replay_request(content, max_count=self.config.replay_max_count)
        journal = self.hub.journal
        if req.mode == lj.ReplayMode.OFFSET:
            start = req.start
            if start < journal.first_offset:
                self._m_replay.labels(kind="gone").inc()
                return lj.replay_error(b"410 Gone", f"journal starts at {journal.first_offset}")
            end = min(start + req.limit, self._sub.next_offset)
            end = max(end, start)
            frames = await asyncio.to_thread(self._replay_read, start, end, req.prefixes, None)
            self._m_replay.labels(kind="offset").inc()
            return [b"200 OK", str(end).encode(), str(len(frames) // 5).encode(), *frames]
        seqs = self._seq_offsets(req.start, req.limit)
        if seqs is None:
            self._m_replay.labels(kind="gone").inc()
            return lj.replay_error(b"410 Gone", "sequence numbers not in the replay index")
        nxt = str(req.limit + 1).encode()
        if not seqs:
            self._m_replay.labels(kind="seq").inc()
            return [b"200 OK", nxt, b"0"]
        lo, hi = min(seqs), max(seqs) + 1
        if lo < journal.first_offset:
            self._m_replay.labels(kind="gone").inc()
            return lj.replay_error(b"410 Gone", f"journal starts at {journal.first_offset}")
        frames = await asyncio.to_thread(self._replay_read, lo, hi, req.prefixes, seqs)
        self._m_replay.labels(kind="seq").inc()
        return [b"200 OK", nxt, str(len(frames) // 5).encode(), *frames]

    async def _replay_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        while True:
            await self._readable(asock, sock)
            try:
                frames, overflow = self._recv(sock)
            except zmq.Again:
                continue
            if len(frames) < 2:
                continue
            routing_id = frames[0]
            # REQ clients put an empty delimiter first; DEALER clients may leave it out.
            has_delim = frames[1] == b""
            content = frames[2:] if has_delim else frames[1:]
            try:
                if overflow:
                    raise lj.LogjamError("too many frames", reason="bad_replay_request")
                reply = await self._answer_replay(content)
            except ProtocolError as exc:
                self._reject(exc.reason, str(exc))
                self._m_replay.labels(kind="bad").inc()
                reply = lj.replay_error(lj.BAD_REQUEST, str(exc))
            except Exception:
                log.exception("logjam replay failed")
                reply = lj.replay_error(b"500 Internal Server Error", "replay failed")
            envelope = [routing_id, b""] if has_delim else [routing_id]
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(envelope + reply, zmq.NOBLOCK)


def create_service(hub: Hub, config: LogjamConfig) -> LogjamService:
    return LogjamService(hub, config)
