"""Lumberjack v1/v2 server: asyncio glue around :class:`taproom.protocols.lumberjack.ServerConnection`.

One listener speaks both versions (the version byte of each frame decides). Each connection is
an :class:`asyncio.Protocol` (cheaper than streams for 10,000 idle connections): bytes go to the
sans-I/O parser, every batch it hands over goes to ``hub.submit`` at once (pipelining), and acks
go out in order once the commit covering them resolves (v2: a partial ack per committed part of
a large window).

Memory comes from the hub's budget (``taproom.budget``), reserved before the parser makes it:
journal room from ``pending`` (a step at a time; the batches it builds are handed to the hub
with their reservation), inflated bytes from ``inflate``, and an incomplete frame's bytes past
a small allowance from ``connection_buffers``. A connection stops reading (``pause_reading``)
while any hold is on: the hub is out of capacity; the parser has more buffered (the rest runs
on the next loop turn, so a large window or a zlib bomb never holds the loop for long); or it
waits for room in one of those holders (FIFO). One sweep task per listener closes connections
that completed no frame for ``idle_timeout_s``; a connection owns a timer only while a v2
window waits for its commit (keepalives).

When a connection ends in the middle of a window, the fingerprints of what of it was committed
are remembered per sender (``resend_memory_events``), and the sender's resend skips them: a
refused or cut-off window is stored once even when the sender resends it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..access import ConnectionGate, access_for
from ..budget import CONNECTION_BUFFERS
from ..config import Config, config_check, config_section, setting
from ..errors import ConfigError, HubStopped, ProtocolError
from ..eventtime import TIME_OUT_OF_RANGE
from ..hub import Commit, Hub
from ..protocols.lumberjack import (
    PROTOCOL,
    STALL_INFLATE,
    STALL_ROOM,
    Limits,
    LumberjackError,
    LumberjackLimit,
    ServerConnection,
    Window,
    encode_ack,
)
from .lumberjack_kernel import WindowKernels
from .lumberjack_resend import Remembered, ResendMemory
from .tlsaccept import start_server_tls, tls_refusal

__all__ = ["LumberjackConfig", "LumberjackServer", "create_service", "server_ssl_context"]

log = logging.getLogger("taproom.lumberjack")

_CLIENT_AUTH = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}

_FRAME_HEAD = 10  # the longest frame header (D and J: version, type, seq, length)
# An incomplete frame up to this size is held without a reservation: it costs less than one
# socket read (256 KiB), and most single events are smaller.
_UNRESERVED_FRAME_BYTES = 64 * 1024
# Journal room a connection reserves at a time: a Filebeat window of 2048 ordinary events
# (~0.8 MB of records) in one step; larger windows take more steps, each granted in turn.
_ROOM_STEP = 1024 * 1024

# Why a connection is not reading (bits of _Connection.holds).
_HOLD_CAPACITY = 1  # the hub is out of capacity
_HOLD_PARSE = 2  # complete frames are still buffered in the parser
_HOLD_BUFFER = 4  # waiting for connection_buffers to reserve its incomplete frame
_HOLD_ROOM = 8  # waiting for journal room (the pending holder)
_HOLD_INFLATE = 16  # waiting for room to inflate (the inflate holder)


@config_section(
    "lumberjack",
    retired={
        "max_frame_bytes": "frames are read as a stream now; max_event_bytes bounds one event",
        "max_decompressed_bytes": "inflating is bounded by the memory budget's inflate share "
        "and max_event_bytes, not per window",
        "max_buffered_bytes": "unfinished frames reserve from the memory budget's "
        "connection_buffers share",
    },
)
@dataclass(frozen=True)
class LumberjackConfig:
    enabled: bool = setting(True, "Filebeat-style shippers are the most common source")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    port: int = setting(5044, "the Beats/Logstash convention", min=0, max=65535)
    tls_cert: str = setting(
        "", "PEM certificate (chain); empty serves plain TCP like Beats' default"
    )
    tls_key: str = setting("", "PEM private key, PKCS#8 or PKCS#1 (Logstash users have both)")
    tls_ca: str = setting("", "PEM CA bundle that client certificates must chain to")
    tls_client_auth: str = setting(
        "none",
        "Logstash's default; 'required' is for fleets with client certificates",
        choices=("none", "optional", "required"),
    )
    max_window: int = setting(
        10_000, "go-lumber closes on a larger W; Filebeat sends at most 2048", min=1, max=1 << 24
    )
    max_event_bytes: int = setting(
        12 * 1024 * 1024,
        "one event (a J payload or a D frame): the journal stores it whole, so it is the one "
        "size bound; Filebeat caps a message at 10 MiB (max_bytes) and adds ~1 KiB of fields "
        "and its JSON escaping. Windows and C frames have no size bound: they are streamed",
        min=1024,
        max=63 * 1024 * 1024,  # under the journal's bound on one record's payload
    )
    max_pairs: int = setting(
        1024, "logstash-forwarder sends ~5 pairs per D frame; thousands is an attack", min=1
    )
    max_nesting: int = setting(
        3, "real senders nest C at most once; recursion must stay bounded", min=1, max=16
    )
    max_batch_bytes: int = setting(
        8 * 1024 * 1024,
        "a window larger than this is journaled in parts (its ack waits for the last part)",
        min=64 * 1024,
    )
    max_connections: int = setting(
        4096, "one or a few connections per shipper; an idle one costs ~5 KiB (bench)", min=1
    )
    accept_backlog: int = setting(
        128,
        "asyncio accepts this many in one go: 1024 let a connect/RST flood hold the loop long "
        "enough that /health took over 1 s; the kernel's SYN retries pace the flood instead",
        min=16,
        max=65535,
    )
    max_connections_per_peer: int = setting(
        256,
        "Filebeat opens one per worker; room for a NAT gateway in front of a fleet, while one "
        "host can hold at most 1/16 of max_connections",
        min=1,
    )
    peer_connections_per_s: float = setting(
        64.0,
        "new connections one address may open a second once its burst is spent: shippers "
        "reconnect after errors with backoff; a connect loop costs a TLS handshake each",
        min=0.01,
    )
    peer_connection_burst: int = setting(
        256,
        "new connections one address may open at once: a NAT gateway's whole fleet "
        "reconnecting after a restart of the hub (max_connections_per_peer)",
        min=1,
    )
    resend_memory_events: int = setting(
        100_000,
        "events remembered (8 bytes each) of windows whose connection ended before they were "
        "complete, so the sender's resend of them is stored once: 48 of Filebeat's 2048-event "
        "windows",
        min=0,
        max=10_000_000,
    )
    idle_timeout_s: float = setting(
        60.0,
        "no complete frame for this long: Filebeat's default client timeout is 30 s; twice that "
        "is surely dead (a trickle of bytes does not count as alive)",
        min=0.1,
    )
    handshake_timeout_s: float = setting(
        10.0, "a TLS handshake that takes longer is a stuck or hostile peer", min=0.1
    )
    tls_shutdown_timeout_s: float = setting(
        2.0,
        "closing TLS flushes our acks, then waits for close_notify, which go-lumber and "
        "logstash-forwarder never send (asyncio waits 30 s)",
        min=0.1,
        max=60,
    )
    idle_ack_s: float = setting(
        0.2,
        "streaming v1 senders (npm lumberjack-protocol) never finish a window: ack when quiet",
        min=0.001,
        max=60,
    )
    keepalive_s: float = setting(
        3.0, "v2 only: go-lumber sends keepalive acks every 3 s while a commit is pending", min=0.1
    )
    stream_fields: tuple[str, ...] = setting(
        ("fields.app", "beat.name", "agent.name"),
        "Beats put the app in fields.app by convention; else the shipper's name",
    )
    topic_fields: tuple[str, ...] = setting(
        ("type", "fields.type"), "logstash-forwarder and old Beats set type; new ones fields.type"
    )

    def validate(self) -> None:
        """Check the limits fit together and the TLS files load (``taproom validate``)."""
        if self.tls_key and not self.tls_cert:
            raise ConfigError("tls_key given without tls_cert", key="tls_cert")
        if self.tls_ca and not self.tls_cert:
            raise ConfigError("tls_ca given without tls_cert", key="tls_cert")
        if self.tls_client_auth != "none" and not self.tls_ca:
            raise ConfigError(
                f"client auth {self.tls_client_auth!r} needs tls_ca", key="tls_client_auth"
            )
        if not self.tls_cert:
            return
        if not self.tls_key:
            raise ConfigError("tls_cert given without tls_key", key="tls_key")
        for key in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, key)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{path}: no such file", key=key)
        server_ssl_context(self)

    @property
    def limits(self) -> Limits:
        return Limits(
            max_window=self.max_window,
            max_event_bytes=self.max_event_bytes,
            max_pairs=self.max_pairs,
            max_nesting=self.max_nesting,
            max_batch_bytes=self.max_batch_bytes,
        )


@config_check
def _event_fits_the_budget(config: Config) -> None:
    """One event must fit in the holders it passes through, or it could never be received."""
    try:
        section = config.section("lumberjack")
        hub = config.section("hub")
    except KeyError:
        return
    if not section.enabled:
        return
    need = section.max_event_bytes + _FRAME_HEAD
    for key in ("connection_buffer_bytes", "max_inflate_bytes"):
        if getattr(hub, key) < need:
            raise ConfigError(
                f"{section.max_event_bytes} does not fit in hub.{key} ({getattr(hub, key)}) "
                "with its frame header: raise that or lower this",
                key="lumberjack.max_event_bytes",
            )


def server_ssl_context(config: LumberjackConfig) -> ssl.SSLContext:
    """TLS 1.2+ server context; raises :class:`ConfigError` naming the key at fault."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except ssl.SSLError as exc:
        raise ConfigError(
            f"certificate and key do not load together: {exc}", key="tls_key"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot read: {exc}", key="tls_cert") from None
    if config.tls_ca:
        try:
            ctx.load_verify_locations(cafile=config.tls_ca)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"not a PEM CA bundle: {exc}", key="tls_ca") from None
    ctx.verify_mode = _CLIENT_AUTH[config.tls_client_auth]
    return ctx


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


class _TLSAccept(asyncio.Protocol):
    """A TLS listener's new connection: the gate first, then the handshake (tlsaccept), then
    a :class:`_Connection` takes over."""

    __slots__ = ("server",)

    def __init__(self, server: LumberjackServer) -> None:
        self.server = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        server = self.server
        peer = transport.get_extra_info("peername")
        if not server.admit(None, peer):
            transport.abort()
            return
        host = peer[0] if peer else ""
        where = f"{peer[0]}:{peer[1]}" if peer else "?"
        task = server.loop.create_task(server.handshake(transport, host, where))
        server.handshaking.add(task)
        task.add_done_callback(server.handshaking.discard)


class LumberjackServer:
    """The listener: accepts, limits connections (in total and per peer), sweeps idle
    connections and failed TLS handshakes, and remembers cut-off windows for their resend."""

    def __init__(self, hub: Hub, config: LumberjackConfig) -> None:
        self.hub = hub
        self.config = config
        self.limits = config.limits
        self.connections: set[_Connection] = set()
        self.access = access_for(hub.config, "lumberjack", hub.metrics)
        self.gate = ConnectionGate(
            self.access,
            max_connections=config.max_connections,
            max_per_peer=config.max_connections_per_peer,
            per_peer_per_s=config.peer_connections_per_s,
            per_peer_burst=config.peer_connection_burst,
            max_tracked_peers=hub.config.access.max_tracked_peers,
        )
        self.loop = asyncio.get_event_loop()
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.pending = hub.budget.holder("pending")
        self.inflate = hub.budget.holder("inflate")
        self.buffers = hub.budget.holder(CONNECTION_BUFFERS)
        # A step of journal room: a Filebeat window's worth, or less under a small bound (a
        # step is granted beyond the bound when nothing else is held).
        self.room_step = min(_ROOM_STEP, max(self.pending.bound // 8, 16 * 1024))
        # Per-read supervision of the connections (taproom.supervise): a read the decoder
        # fails on unexpectedly closes that connection, counted and logged rate-limited.
        self.guard = hub.supervisor.guard("lumberjack.connection", protocol=PROTOCOL, logger=log)
        m = hub.metrics
        self.m_connections = m.connections(PROTOCOL, "lumberjack")
        self.resend = ResendMemory(config.resend_memory_events, m)
        # Runs of J frames in C while the compiled path is selected (issue 32), else None.
        self.kernels = WindowKernels.create()
        # TLS handshakes under way (tlsaccept: each failure is counted with its cause at once).
        self.handshaking: set[asyncio.Task[None]] = set()
        self._tls: ssl.SSLContext | None = None

    def _accept(self) -> asyncio.Protocol:
        return _Connection(self) if self._tls is None else _TLSAccept(self)

    async def handshake(self, transport: asyncio.BaseTransport, host: str, peer: str) -> None:
        """TLS on a connection the gate let in; a failure is counted and logged with its
        cause at once, and frees the gate's slot."""
        assert self._tls is not None
        cfg = self.config
        conn = _Connection(self, admitted=host)
        try:
            await start_server_tls(
                transport,
                self._tls,
                conn,
                handshake_timeout=cfg.handshake_timeout_s,
                shutdown_timeout=cfg.tls_shutdown_timeout_s,
            )
        except Exception as exc:
            reason, detail = tls_refusal(exc)
            self.access.refused(peer, reason, detail)
            self.gate.leave(host)

    # -- connection accounting ---------------------------------------------------------------

    def admit(self, conn: _Connection | None, peer: Any) -> bool:
        """The connection gate (allowlist, max_connections, per peer: count and rate):
        True and counted in, or False, counted and logged (rate-limited) by reason."""
        host, port = (peer[0], peer[1]) if peer else ("", None)
        if self.gate.admit(host, port):
            return False
        if conn is not None:
            conn.peer_host = host
        return True

    def forget(self, conn: _Connection) -> None:
        """The connection is gone: its slot and its peer count are free."""
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        self.m_connections.dec()
        self.gate.leave(conn.peer_host)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        self.loop = asyncio.get_running_loop()
        cfg = self.config
        ssl_ctx = server_ssl_context(cfg) if cfg.tls_cert else None
        self._tls = ssl_ctx
        # TLS is started per connection after the gate (tlsaccept), not by the server.
        self._server = await self.loop.create_server(
            self._accept, cfg.host, cfg.port, backlog=cfg.accept_backlog
        )
        self._sweeper = self.hub.supervisor.spawn("lumberjack.sweep", self._sweep)
        host, port = self._server.sockets[0].getsockname()[:2]
        log.info("lumberjack listening on %s:%d (%s)", host, port, "TLS" if ssl_ctx else "TCP")
        return {"lumberjack": f"{host}:{port}"}

    async def _sweep(self) -> None:
        """Idle timeouts, one wake-up per second at most."""
        cfg = self.config
        period = min(1.0, cfg.idle_timeout_s / 2)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for conn in [c for c in self.connections if c.idle(now, cfg.idle_timeout_s)]:
                # Counted and logged once: the abort drops the socket at once, TLS included
                # (nothing is owed to an idle sender, so there is nothing to flush).
                self.hub.metrics.rejected(PROTOCOL, "idle_timeout")
                log.info(
                    "%s: no complete frame for %.0fs, closing", conn.producer, cfg.idle_timeout_s
                )
                conn._closing = True
                conn.transport.abort()

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self.handshaking):
            task.cancel()
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        # Stop reading, let in-flight commits finish so their acks go out, then close.
        for conn in list(self.connections):
            conn._closing = True
            with contextlib.suppress(Exception):
                conn.transport.pause_reading()
        deadline = time.monotonic() + self.hub.config.hub.grace_period_s
        while any(c._pending for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        for conn in list(self.connections):
            conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


def create_service(hub: Hub, section: LumberjackConfig) -> LumberjackServer:
    return LumberjackServer(hub, section)
