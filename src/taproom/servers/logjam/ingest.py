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
from collections.abc import Callable, Sequence
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

Pusher = Callable[[bytes, bytes, bytes, bytes], lj.Pushed]


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
    """The two ingest loops and the 202s they owe; ``pending`` holds uncommitted bursts.

    A burst ends when the socket has nothing queued, after ``burst_messages`` messages, or once
    its records reach ``burst_bytes`` (bodies are counted decompressed, so a burst of small
    compressed bodies cannot inflate without bound). Before each burst the loop waits for hub
    capacity: while the hub is full nothing is read, and libzmq's ``rcv_hwm`` pushes back on
    the agents.
    """

    def __init__(self, hub: Hub, config: LogjamConfig, hostname: bytes, reject: RejectLog) -> None:
        self.hub = hub
        self.config = config
        self.hostname = hostname
        self._reject = reject
        self.pending: set[asyncio.Future[Any]] = set()
        m = hub.metrics
        self._m_pings = m.counter(
            "logjam", "pings", "messages", "Pings received (answered when the agent asked)"
        )
        self._m_not_json = m.counter(
            "ingest",
            "odd",
            "events",
            "Events accepted and stored with a caveat, by reason",
            ("protocol", "reason"),
        ).labels(protocol="logjam", reason="not_json")

    def _parser(self) -> lj.IngestParser:
        cfg = self.config
        return lj.IngestParser(
            max_body=cfg.max_message_bytes,
            max_decompressed=cfg.max_decompressed_bytes,
            grammar=cfg.grammar,
        )

    def _submit(self, parser: lj.IngestParser, not_json_before: int) -> asyncio.Future[Any] | None:
        """One burst's records to the hub as one batch; None if the hub is stopping."""
        batch = parser.take_batch()
        try:
            future = self.hub.submit(batch)
        except HubStopped:
            return None
        self.hub.metrics.accepted("logjam", batch.count)
        if parser.not_json != not_json_before:
            self._m_not_json.inc(parser.not_json - not_json_before)
        self.pending.add(future)
        return future

    async def pull_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """PUSH agents: no replies. Messages of four frames (all of them, in practice) take
        the unrolled path; three frames are an old agent's message without meta, stored as
        logjam-device stores it; any other shape is read whole and refused."""
        hub = self.hub
        parser = self._parser()
        push = parser.pusher()
        recv = sock.recv
        more = rcvmore_reader(sock)
        getopt, handle, flag, size, _ = more
        rcvmore = RCVMORE
        burst, burst_bytes = self.config.burst_messages, self.config.burst_bytes
        burst_full, empty_meta = lj.BURST_FULL, lj.EMPTY_META
        while True:
            await hub.wait_capacity()
            await readable(asock, sock)
            parser.start_batch(time.time_ns(), burst_bytes)
            not_json = parser.not_json
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
                                    pushed = push(a, b, c, d)
                                except ProtocolError as exc:
                                    self._refuse(sock, exc.reason, str(exc), None, ())
                                    continue
                                except Exception:  # a bug must not stop ingest
                                    log.exception("logjam: internal error on a message")
                                    self._refuse(sock, "internal_error", "", None, ())
                                    continue
                                if pushed is None:
                                    continue
                                if pushed is burst_full:
                                    break
                                self._m_pings.inc()
                                continue
                            count = 5
                            recv(0)
                            while more():  # read and drop the rest of an over-long message
                                recv(0)
                                count += 1
                        else:
                            # logjam-device's read_zmq_message_and_forward takes 3 or 4 frames
                            if self._take_legacy(sock, push, a, b, c, empty_meta):
                                break
                            continue
                    else:
                        count = 2
                else:
                    count = 1
                self._refuse(sock, "bad_frame_count", f"{count} frames, expected 4", None, ())
            if parser.pending():
                future = self._submit(parser, not_json)
                if future is None:
                    return
                future.add_done_callback(self.pending.discard)
            # While agents keep the socket full, neither wait above suspends: yield once per
            # burst so commits resolve, 202s and the PUB output go out, /metrics answers.
            await asyncio.sleep(0)

    def _take_legacy(
        self, sock: zmq.Socket, push: Pusher, a: bytes, b: bytes, c: bytes, empty_meta: bytes
    ) -> bool:
        """Three frames on the PULL: an old agent's message without meta. True: burst full."""
        try:
            pushed = push(a, b, c, empty_meta)
        except ProtocolError as exc:
            self._refuse(sock, exc.reason, str(exc), None, ())
            return False
        except Exception:  # a bug must not stop ingest
            log.exception("logjam: internal error on a message")
            self._refuse(sock, "internal_error", "", None, ())
            return False
        if pushed is lj.BURST_FULL:
            return True
        if pushed is not None:
            self._m_pings.inc()
        return False

    async def router_loop(self, asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
        """DEALER agents: an empty frame after the routing id asks for a reply, ``202
        Accepted`` once the burst is durable (``400 Bad Request`` at once)."""
        hub = self.hub
        parser = self._parser()
        push = parser.pusher()
        recv = sock.recv
        getopt, handle, flag, size, _ = rcvmore_reader(sock)
        rcvmore = RCVMORE
        burst, burst_bytes = self.config.burst_messages, self.config.burst_bytes
        burst_full = lj.BURST_FULL
        content_max = MAX_FRAMES - 1
        while True:
            await hub.wait_capacity()
            await readable(asock, sock)
            parser.start_batch(time.time_ns(), burst_bytes)
            not_json = parser.not_json
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
                                        if self._take_reply_message(
                                            sock, push, routing_id, a, b, c, d, acks
                                        ):
                                            break
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
                # logjam-device replies when the frame after the routing id is empty
                wants_reply = bool(content) and content[0] == b""
                if wants_reply:
                    del content[0]
                reply_to = routing_id if wants_reply else None
                try:
                    if overflow:
                        raise lj.LogjamError("too many frames", reason="bad_frame_count")
                    if len(content) != 4:
                        raise lj.LogjamError(
                            f"{len(content)} frames, expected 4", reason="bad_frame_count"
                        )
                    pushed = push(content[0], content[1], content[2], content[3])
                except ProtocolError as exc:
                    self._refuse(sock, exc.reason, str(exc), reply_to, content)
                    continue
                except Exception:  # a bug must not stop ingest; nothing of this one is stored
                    log.exception("logjam: internal error on a message")
                    self._refuse(sock, "internal_error", "", reply_to, content)
                    continue
                if isinstance(pushed, lj.PingMessage):
                    self._answer_ping(sock, reply_to)
                    continue
                if wants_reply:
                    acks.append((routing_id, content[0]))
                if pushed is burst_full:
                    break
            if parser.pending():
                future = self._submit(parser, not_json)
                if future is None:
                    return
                if acks:
                    # 202s go out only once the batch is durable; reading the next burst
                    # overlaps with this commit's fsync (hub.wait_capacity bounds what is in
                    # flight).
                    future.add_done_callback(functools.partial(self._send_acks, sock, acks))
                else:
                    future.add_done_callback(self.pending.discard)
            await asyncio.sleep(0)  # let commits resolve and 202s go out (see pull_loop)

    def _take_reply_message(
        self,
        sock: zmq.Socket,
        push: Pusher,
        routing_id: bytes,
        a: bytes,
        b: bytes,
        c: bytes,
        d: bytes,
        acks: list[tuple[bytes, bytes]],
    ) -> bool:
        """``routing-id "" app-env topic body meta``: store it and queue its 202, answer a
        ping, or refuse it with a 400 at once (same handling as the general path). True: the
        burst has reached its byte budget."""
        try:
            pushed = push(a, b, c, d)
        except ProtocolError as exc:
            self._refuse(sock, exc.reason, str(exc), routing_id, (a,))
            return False
        except Exception:  # a bug must not stop ingest; nothing of this one is stored
            log.exception("logjam: internal error on a message")
            self._refuse(sock, "internal_error", "", routing_id, (a,))
            return False
        if isinstance(pushed, lj.PingMessage):
            self._answer_ping(sock, routing_id)
            return False
        acks.append((routing_id, a))
        return pushed is lj.BURST_FULL

    def _answer_ping(self, sock: zmq.Socket, reply_to: bytes | None) -> None:
        """``ping`` ``200 OK`` host, as logjam-device answers a ping whose meta decodes."""
        self._m_pings.inc()
        if reply_to is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(
                    lj.reply_frames(reply_to, (lj.PING,), lj.PING_OK, self.hostname),
                    zmq.NOBLOCK,
                )

    def _refuse(
        self,
        sock: zmq.Socket,
        reason: str,
        detail: str,
        reply_to: bytes | None,
        content: Sequence[bytes],
    ) -> None:
        """Count and log a bad message; DEALERs that asked get ``400 Bad Request``."""
        self._reject(reason, detail)
        if reply_to is not None:
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart(lj.reply_frames(reply_to, content, lj.BAD_REQUEST), zmq.NOBLOCK)

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
        for routing_id, app_env in acks:
            # as logjam-device: routing id, the agent's app-env, the status
            try:
                send(routing_id, flags)
                send(app_env, flags)
                send(accepted, NOBLOCK)
            except zmq.ZMQError:
                continue  # the agent went away; ROUTER drops replies to unknown peers
