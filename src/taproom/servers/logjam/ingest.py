"""Logjam ingest: the ROUTER (DEALER agents) and PULL (PUSH agents) read loops.

Each loop drains a burst without blocking, validates it with
:class:`~taproom.protocols.logjam.IngestParser`, builds one batch and hands it to the hub. An
empty frame after the ROUTER's routing id asks for a reply: ``202 Accepted`` only after the
commit, ``400 Bad Request`` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from ...errors import HubStopped, ProtocolError
from ...hub import Hub
from ...metrics import Metrics
from ...protocols import logjam as lj
from .config import LogjamConfig
from .zmqio import MAX_FRAMES, NOBLOCK, RCVMORE, SNDMORE, raw_send, rcvmore_reader, readable

__all__ = ["Ingest", "RejectLog"]

log = logging.getLogger("taproom.logjam")

_LOG_PER_SECOND = 20


class RejectLog:
    """Counts every rejected logjam message by reason and logs at most ``_LOG_PER_SECOND``
    of them a second, so a broken agent sending thousands of bad messages cannot flood it."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self._log_window = 0.0
        self._log_count = self._log_suppressed = 0

    def __call__(self, reason: str, detail: str) -> None:
        self.metrics.rejected("logjam", reason)
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


class Ingest:
    """The two ingest loops and the 202s they owe; ``pending`` holds uncommitted bursts."""

    def __init__(self, hub: Hub, config: LogjamConfig, hostname: bytes, reject: RejectLog) -> None:
        self.hub = hub
        self.config = config
        self.relaxed = config.grammar == "relaxed"
        self.hostname = hostname
        self._reject = reject
        self.pending: set[asyncio.Future[Any]] = set()
        self._m_pings = hub.metrics.counter("logjam", "pings", "messages", "Pings answered")

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
        self.pending.add(future)
        return future

    async def pull_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """PUSH agents: no replies. Messages of four frames (all of them, in practice) take
        the unrolled path; any other shape is read whole and refused."""
        hub = self.hub
        parser = self._parser()
        push = parser.pusher()
        recv = sock.recv
        more = rcvmore_reader(sock)
        getopt, handle, flag, size, _ = more
        rcvmore = RCVMORE
        burst = self.config.burst_messages
        while True:
            await hub.wait_capacity()
            await readable(asock, sock)
            parser.start_batch(time.time_ns())
            for _ in range(burst):
                try:
                    a = recv(NOBLOCK)
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
                future.add_done_callback(self.pending.discard)
            # While agents keep the socket full, neither wait above suspends: yield once per
            # burst so commits resolve, 202s and the PUB output go out, /metrics answers.
            await asyncio.sleep(0)

    async def router_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """DEALER agents: an empty frame after the routing id asks for a reply, ``202
        Accepted`` once the burst is durable (``400 Bad Request`` at once)."""
        hub = self.hub
        parser = self._parser()
        push = parser.pusher()
        recv = sock.recv
        getopt, handle, flag, size, _ = rcvmore_reader(sock)
        rcvmore = RCVMORE
        burst = self.config.burst_messages
        content_max = MAX_FRAMES - 1
        while True:
            await hub.wait_capacity()
            await readable(asock, sock)
            parser.start_batch(time.time_ns())
            acks: list[tuple[bytes, bytes]] = []
            for _ in range(burst):
                try:
                    routing_id = recv(NOBLOCK)
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
                    future.add_done_callback(self.pending.discard)
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
        self.pending.discard(future)
        if future.cancelled() or future.exception() is not None:
            return  # not durable: no 202; the agent times out and may resend
        if sock.closed:
            return
        send = functools.partial(raw_send, sock)
        flags = NOBLOCK | SNDMORE
        accepted = lj.ACCEPTED
        for routing_id, first in acks:
            # routing id, "" (the REQ-compatible delimiter), the agent's app-env, the status
            try:
                send(routing_id, flags)
                send(b"", flags)
                send(first, flags)
                send(accepted, NOBLOCK)
            except zmq.ZMQError:
                continue  # the agent went away; ROUTER drops replies to unknown peers

    # --- PUB output -----------------------------------------------------------------------
