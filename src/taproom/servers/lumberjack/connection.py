"""One Lumberjack connection: bytes to the parser, batches to the hub, acks in order once
durable, reading paused while memory or the hub says so (see the package docstring)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from ...errors import HubStopped, ProtocolError
from ...eventtime import TIME_OUT_OF_RANGE
from ...hub import Commit
from ...protocols.lumberjack import (
    PROTOCOL,
    STALL_INFLATE,
    STALL_ROOM,
    LumberjackError,
    LumberjackLimit,
    ServerConnection,
    Window,
    encode_ack,
)
from .resend import Remembered

if TYPE_CHECKING:
    from .service import LumberjackServer

log = logging.getLogger("taproom.lumberjack")


# An incomplete frame up to this size is held without a reservation: it costs less than one
# socket read (256 KiB), and most single events are smaller.
_UNRESERVED_FRAME_BYTES = 64 * 1024

# Why a connection is not reading (bits of _Connection.holds).
_HOLD_CAPACITY = 1  # the hub is out of capacity
_HOLD_PARSE = 2  # complete frames are still buffered in the parser
_HOLD_BUFFER = 4  # waiting for connection_buffers to reserve its incomplete frame
_HOLD_ROOM = 8  # waiting for journal room (the pending holder)
_HOLD_INFLATE = 16  # waiting for room to inflate (the inflate holder)


class _Connection(asyncio.Protocol):
    """One Lumberjack connection. Acks are written in window order only after their commit."""

    __slots__ = (
        "_ack_timer",
        "_closing",
        "_keepalive_timer",
        "_pending",
        "_wait",
        "buffer_held",
        "holds",
        "last_frame",
        "parser",
        "peer_host",
        "pending_held",
        "producer",
        "sender",
        "server",
        "transport",
        "window_fps",
    )

    def __init__(self, server: LumberjackServer, admitted: str | None = None) -> None:
        self.server = server
        self.transport: Any = None
        self.parser: ServerConnection | None = None
        self._pending: deque[tuple[asyncio.Future[Commit] | None, Window]] = deque()
        self._ack_timer: asyncio.TimerHandle | None = None
        self._keepalive_timer: asyncio.TimerHandle | None = None
        self._closing = False
        self.holds = 0  # _HOLD_* bits: reading is paused while any is set
        # What this connection holds of the budget: journal room (unused, plus the batch the
        # parser is building), and connection_buffers for its incomplete frame. The inflate
        # reservation is the parser's inflate_room.
        self.pending_held = 0
        self.buffer_held = 0
        self._wait: tuple[Any, object] | None = None  # (holder, handle) of a queued reservation
        self.last_frame = time.monotonic()  # the last complete frame (idleness)
        self.producer = ""
        # The peer's address, once the connection gate counted it in (TLS connections pass
        # the gate before their handshake: they arrive admitted).
        self.peer_host: str | None = admitted
        self.sender = ""  # who resends: the TLS subject CN, else the peer's address
        self.window_fps: Remembered | None = None  # the committed start of an open window

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        assert isinstance(transport, asyncio.Transport)
        server = self.server
        peer = transport.get_extra_info("peername")
        if self.peer_host is None and not server.admit(self, peer):
            transport.abort()
            return
        server.connections.add(self)
        server.m_connections.inc()
        producer = f"{peer[0]}:{peer[1]}" if peer else ""
        sender = peer[0] if peer else ""
        cert = transport.get_extra_info("peercert")
        if cert:
            for rdn in cert.get("subject", ()):
                for name, value in rdn:
                    if name == "commonName":
                        producer = sender = value
        self.producer = producer
        self.sender = sender
        cfg = server.config
        parser = ServerConnection(
            producer,
            limits=server.limits,
            stream_fields=cfg.stream_fields,
            topic_fields=cfg.topic_fields,
            kernels=server.kernels,
        )
        parser.room = 0  # granted from the budget before each step
        parser.inflate_room = 0
        if cfg.resend_memory_events:
            parser.resend = server.resend.view(sender)
        self.parser = parser

    def data_received(self, data: bytes) -> None:
        if self.parser is None or self._closing:
            return
        try:
            self._receive(data)
        except Exception as exc:  # a bug after the parse: drop this connection, nothing more
            self.server.guard.failed(exc, f"read from {self.producer}")
            self._abort("internal error")

    def eof_received(self) -> bool:
        # The sender half-closed: flush, let pending acks go out, then close.
        if self.parser is not None and not self._closing:
            self._idle_flush(ending=True)
        self._closing = True
        self._close_when_acked()
        # Keep the write side open for the acks; asyncio's TLS transport closes regardless
        # (and warns if asked not to).
        return self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._ack_timer, self._keepalive_timer):
            if timer is not None:
                timer.cancel()
        self._ack_timer = self._keepalive_timer = None
        self._closing = True
        self._remember_open_window()
        self._pending.clear()
        self._give_back()
        self.server.forget(self)

    # -- reading ------------------------------------------------------------------------------

    def _receive(self, data: bytes) -> None:
        parser = self.parser
        assert parser is not None
        self._top_up_room()
        held_before = parser.buffered_bytes + len(data)
        try:
            windows = parser.receive_data(data, time.time_ns())
        except (LumberjackError, LumberjackLimit) as exc:
            self._submit(exc.windows)
            self._violation(exc)
            return
        except ProtocolError as exc:  # records-level limits (over-long fields)
            self._violation(exc)
            return
        except Exception as exc:  # a bug: close without leaking detail (taproom.supervise)
            # Counted (internal_error) and logged rate-limited by the guard; Lumberjack's only
            # refusal is the close, after the windows already complete are acked.
            self.server.guard.failed(exc, f"read from {self.producer}")
            self._violation(ProtocolError("internal error", reason=""))
            return
        if parser.buffered_bytes < held_before:
            # The parser consumes whole frames only: a trickle of bytes is not activity.
            self.last_frame = time.monotonic()
        if windows:
            self._submit(windows)
        if parser.pending_events:
            if self._ack_timer is not None:
                self._ack_timer.cancel()
            self._ack_timer = self.server.loop.call_later(
                self.server.config.idle_ack_s, self._idle_flush
            )
        self._settle()
        self._decide_reading()

    def _top_up_room(self) -> None:
        """Reserve a step of journal room if it is there at once (nobody waits for it)."""
        parser = self.parser
        assert parser is not None
        step = self.server.room_step
        if parser.room < step:
            want = step - parser.room
            if self.server.pending.try_reserve(want):
                parser.room += want
                self.pending_held += want

    def _settle(self) -> None:
        """After a step: give back the room and inflate room not used, keep what is held."""
        parser = self.parser
        assert parser is not None
        server = self.server
        if parser.room:
            server.pending.release(parser.room)
            self.pending_held -= parser.room
            parser.room = 0
        # Kept: what it holds, and the rest of a frame it was granted room to complete.
        extra = parser.inflate_room - min(parser.inflate_needed, parser.inflate_room)
        if extra > 0:
            server.inflate.release(extra)
            parser.inflate_room -= extra

    def _decide_reading(self) -> None:
        """After a step: reserve the incomplete frame's bytes, ask for what the parser stalled
        on, and hold while the hub is full or the parser has more; the rest of a read is
        parsed on a later loop turn."""
        if self._closing or self._wait is not None:
            return
        parser = self.parser
        assert parser is not None
        server = self.server
        # Received bytes held past the allowance: reserved (the whole incomplete frame, as its
        # header tells, so an admitted frame can always complete).
        held = max(parser.incomplete_frame_bytes, parser.raw_bytes)
        target = held if held > _UNRESERVED_FRAME_BYTES else 0
        if target > self.buffer_held:
            extra = target - self.buffer_held
            if server.buffers.try_reserve(extra):
                self.buffer_held = target
            else:
                self._queue(server.buffers, extra, self.buffer_held, _HOLD_BUFFER)
                return
        elif target < self.buffer_held:
            server.buffers.release(self.buffer_held - target)
            self.buffer_held = target
        if parser.stalled == STALL_ROOM:
            want = max(parser.room_wanted, server.room_step)
            if server.pending.try_reserve(want):
                parser.room += want
                self.pending_held += want
                self._again()
            else:
                # Hand over the batch being built before waiting: commits then free room.
                part = parser.hand_over()
                if part is not None:
                    self._submit([part])
                self._queue(server.pending, want, 0, _HOLD_ROOM)
            return
        if parser.stalled == STALL_INFLATE:
            want = parser.inflate_wanted - parser.inflate_room
            if server.inflate.try_reserve(want):
                parser.inflate_room += want
                self._again()
            else:
                # It waits holding the start of a frame: said so, a deadlock is broken.
                self._queue(server.inflate, want, parser.inflate_room, _HOLD_INFLATE)
            return
        if not server.hub.has_capacity:
            if not self.holds & _HOLD_CAPACITY:
                self._hold(_HOLD_CAPACITY)
                server.loop.create_task(self._wait_capacity())
        elif parser.more_buffered:
            self._again()

    def _again(self) -> None:
        """Parse what is buffered on the next loop turn (other connections and /health run
        in between: one step is at most a batch or an inflate piece)."""
        if not self.holds & _HOLD_PARSE:
            self._hold(_HOLD_PARSE)
            self.server.loop.call_soon(self._parse_buffered)

    def _parse_buffered(self) -> None:
        if not self.holds & _HOLD_PARSE:
            return
        self._unhold(_HOLD_PARSE)
        self.data_received(b"")  # supervised as a read is

    def _queue(self, holder: Any, n: int, holding: int, hold: int) -> None:
        """Wait (not reading) for ``n`` bytes of ``holder``; go on once granted."""
        self._hold(hold)

        def granted() -> None:
            self._wait = None
            parser = self.parser
            if self._closing or parser is None:
                holder.release(n)
                return
            if holder is self.server.pending:
                parser.room += n
                self.pending_held += n
            elif holder is self.server.inflate:
                parser.inflate_room += n
            else:
                self.buffer_held += n
            self.server.loop.call_soon(self._resume, hold)

        self._wait = (holder, holder.wait(n, granted, holding=holding))

    def _resume(self, hold: int) -> None:
        self._unhold(hold)
        if self._closing or self.parser is None:
            return
        if hold == _HOLD_BUFFER:
            self._decide_reading()
        else:
            self.data_received(b"")  # supervised as a read is

    async def _wait_capacity(self) -> None:
        try:
            await self.server.hub.wait_capacity()
        finally:
            self._unhold(_HOLD_CAPACITY)
            if not self._closing:
                self._decide_reading()

    def _hold(self, hold: int) -> None:
        if not self.holds and not self._closing:
            self.transport.pause_reading()
        self.holds |= hold

    def _unhold(self, hold: int) -> None:
        if not self.holds & hold:
            return
        self.holds &= ~hold
        if not self.holds and not self._closing and not self.transport.is_closing():
            self.transport.resume_reading()

    def _give_back(self) -> None:
        """The connection is gone: every reservation it holds or waits for is returned."""
        server = self.server
        if self._wait is not None:
            holder, handle = self._wait
            holder.cancel(handle)
            self._wait = None
        if self.pending_held:
            server.pending.release(self.pending_held)
            self.pending_held = 0
        if self.buffer_held:
            server.buffers.release(self.buffer_held)
            self.buffer_held = 0
        parser = self.parser
        if parser is not None and parser.inflate_room:
            server.inflate.release(parser.inflate_room)
            parser.inflate_room = 0
            parser.room = 0

    # -- windows and acks ---------------------------------------------------------------------

    def _submit(self, windows: list[Window]) -> None:
        hub = self.server.hub
        parser = self.parser
        out_of_range = parser.times.take() if parser is not None else 0
        if out_of_range:  # @timestamp the journal cannot hold: stored absent (eventtime)
            hub.metrics.odd(PROTOCOL, TIME_OUT_OF_RANGE, out_of_range)
        events = nbytes = 0
        for window in windows:
            future: asyncio.Future[Commit] | None = None
            size = len(window.batch.body)
            self.pending_held -= size  # the hub takes the reservation over with the batch
            if window.batch.count:
                try:
                    future = hub.submit(window.batch, reserved=True)
                except HubStopped:
                    self.server.pending.release(size)
                    self._abort("hub stopping")
                    return
                events += window.batch.count
                nbytes += size
                future.add_done_callback(self._on_commit)
            if window.skipped:
                self.server.resend.m_skipped.inc(len(window.skipped))
            self._pending.append((future, window))
        if events:
            hub.metrics.accepted(PROTOCOL, events, nbytes)
        self._on_commit(None)

    def _on_commit(self, _future: object) -> None:
        """Write the acks of every leading window whose commit is done, in one write."""
        pending = self._pending
        acks: list[bytes] = []
        while pending:
            future, window = pending[0]
            if future is not None:
                if not future.done():
                    break
                if future.cancelled() or future.exception() is not None:
                    # Not durable: no ack; the sender resends after reconnecting.
                    self._abort("commit failed")
                    return
            pending.popleft()
            self._committed(window)
            if window.ack_seq is not None:
                acks.append(encode_ack(window.version, window.ack_seq))
        if acks and self.transport is not None and not self.transport.is_closing():
            self.transport.write(b"".join(acks) if len(acks) > 1 else acks[0])
            if self._keepalive_timer is not None:  # the sender just heard from us
                self._keepalive_timer.cancel()
                self._keepalive_timer = None
        if pending and self._keepalive_timer is None:
            self._keepalive_timer = self.server.loop.call_later(
                self.server.config.keepalive_s, self._keepalive
            )
        if self._closing:
            self._close_when_acked()

    def _committed(self, window: Window) -> None:
        """Keep the fingerprints of what is committed of a window not yet complete."""
        if window.done:
            self.window_fps = None
            if window.resent_of:
                self.server.resend.forget(self.sender, window.resent_of)
            return
        if self.server.config.resend_memory_events:
            if self.window_fps is None:
                self.window_fps = Remembered(self.server.resend, self.sender)
            self.window_fps.add(window)  # kept by the memory only if the connection ends

    def _remember_open_window(self) -> None:
        """The connection ends inside a window: remember what of it is committed (and what
        will be, for parts whose commit is still on its way) for the sender's resend."""
        if not self.server.config.resend_memory_events:
            return
        remembered = self.window_fps or Remembered(self.server.resend, self.sender)
        self.window_fps = None
        remembered.keep()
        for future, window in self._pending:
            if window.done:
                break
            if future is None:
                remembered.add(window)
                remembered.keep()
            else:
                future.add_done_callback(remembered.add_when_durable(window))

    def _keepalive(self) -> None:
        """v2 only: the oldest pending window has waited ``keepalive_s`` since it was read or
        since our last ack: tell the sender it is being worked on (seq 0). Never on v1: a v1
        client takes the first ack it reads as its window's."""
        self._keepalive_timer = None
        if not self._pending or self.transport is None or self.transport.is_closing():
            return
        if self._pending[0][1].version == 0x32:
            self.transport.write(encode_ack(0x32, 0))
        self._keepalive_timer = self.server.loop.call_later(
            self.server.config.keepalive_s, self._keepalive
        )

    def _idle_flush(self, *, ending: bool = False) -> None:
        self._ack_timer = None
        parser = self.parser
        if parser is None or self._closing:
            return
        window = parser.flush(ending=ending)
        if window is not None:
            self._submit([window])

    # -- closing ------------------------------------------------------------------------------

    def idle(self, now: float, timeout: float) -> bool:
        """No complete frame for ``timeout``, nothing owed to the sender, not held by us."""
        return (
            not self._closing
            and not self._pending
            and not self.holds
            and self.parser is not None
            and now - self.last_frame > timeout
        )

    def _violation(self, exc: ProtocolError) -> None:
        reason = exc.reason
        if reason:  # "": counted already (an internal error, by the guard)
            self.server.hub.metrics.rejected(PROTOCOL, reason)
            log.warning("%s: closing connection: %s (%s)", self.producer, exc, reason)
        self._closing = True
        self.transport.pause_reading()
        self._close_when_acked()

    def _close_when_acked(self) -> None:
        """Close once every window already complete is committed and acknowledged."""
        if not self._pending and self.transport is not None:
            self.transport.close()

    def _abort(self, why: str) -> None:
        """Drop the connection at once: nothing owed is sent (and on TLS no close_notify is
        awaited)."""
        log.info("%s: closing connection: %s", self.producer, why)
        self._closing = True
        self._remember_open_window()
        self._pending.clear()
        if self.transport is not None:
            self.transport.abort()
