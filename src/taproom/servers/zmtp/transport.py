"""taproom's own ZeroMQ sockets for what it binds: ZMTP 3.x over asyncio (issue 26).

A :class:`ZmtpSocket` is one bound port of one ZeroMQ socket type (ROUTER, PULL, SUB so far).
Each accepted connection is a :class:`_Connection`, an ``asyncio.BufferedProtocol``: the kernel
copies bytes straight into the connection's buffer, and the frame scanner
(``protocols.zmtp.scan``, or ``zt_scan`` in C) walks their headers in place. Whole messages
stay where they landed until the service takes a burst of them (``reader(...).recv``), which
copies them out in :mod:`taproom.zmqburst`'s ``Burst`` shape (one buffer plus frame offsets in
C, frame lists in Python), so the compiled kernels (``lj_build``) read them as they read
libzmq's.

What a peer can make the hub hold is bounded three ways:

* a message is at most ``max_message_bytes`` on the wire: the scanner checks every frame
  header against it *before* the body arrives, and the peer is disconnected and counted
  (``message_too_large``, its address in a rate-limited log);
* every byte of a connection's buffer is reserved from the process budget (its
  ``connection_buffers`` holder): a connection whose bytes do not fit stops being read (TCP
  pushes back on that peer alone) until the holder has room; idle connections give their
  buffer back;
* a connection stops being read while its whole messages wait for the service (the hub is
  full, ``wait_capacity``), so nothing piles up behind a full journal either.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any

from ... import zmqburst
from ...access import ListenerAccess, access_for
from ...hub import Hub
from ...protocols import zmtp as zp
from ...protocols.zmtp.curve import CurveServer
from ...protocols.zmtp.wire import ScanStatus
from .. import ACCEPT_BATCH, deepen_accept_queue
from .config import ZmtpConfig
from .holder import Holder, buffer_holder
from .readers import ExtReader, PyReader

__all__ = ["ZmtpSocket", "zmtp_config"]

log = logging.getLogger("taproom.zmtp")

_STUB = 256  # bytes a connection reads into while it has no buffer (handshake, waiting for room)
_CURVE_CHUNK = 65536  # what a CURVE connection reads at a time (MESSAGE boxes, then opened)
# the handshake's refusals of a CURVE listener, as taproom.access names them
_CURVE_REASONS = {
    "mechanism": "mechanism_mismatch",
    "handshake_failed": "handshake_failed",
    "curve_key_not_allowed": "curve_key_not_allowed",
    "bad_handshake": "handshake_failed",
}
_SWEEP_S = 1.0  # timeouts and idle buffers are looked at this often
_LOG_PER_SECOND = 10
_KINDS = (b"ROUTER", b"PULL", b"SUB")


def zmtp_config(hub: Hub) -> ZmtpConfig:
    try:
        return hub.config.zmtp
    except AttributeError:
        return ZmtpConfig()


class _RateLimitedLog:
    def __init__(self) -> None:
        self._window = 0.0
        self._count = self._suppressed = 0

    def __call__(self, msg: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._window >= 1.0:
            if self._suppressed:
                log.info("zmtp: %d more refusals not logged", self._suppressed)
            self._window, self._count, self._suppressed = now, 0, 0
        if self._count < _LOG_PER_SECOND:
            self._count += 1
            log.info(msg, *args)
        else:
            self._suppressed += 1


def handshake_refusal(exc: zp.ZmtpError, curve: bool) -> tuple[str, bool]:
    """The reason a failed handshake is counted under, and whether it is an access refusal
    (a CURVE listener's: counted by the access policy, as the ZAP handler counts them)."""
    if curve and exc.reason in _CURVE_REASONS:
        return _CURVE_REASONS[exc.reason], True
    return exc.reason, False


def listening(
    hub: Hub,
    name: str,
    host: str,
    bound: int,
    sweep: Callable[[], Coroutine[Any, Any, None]],
    loop: asyncio.AbstractEventLoop,
) -> tuple[str, asyncio.Task[None]]:
    """A bound listener's ``host:port`` and its sweep loop, supervised when the hub has a
    supervisor (restarted if it ever dies: taproom.supervise)."""
    address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
    supervisor = getattr(hub, "supervisor", None)
    if supervisor is not None:
        return address, supervisor.spawn(f"zmtp.{name}", sweep)
    return address, loop.create_task(sweep(), name=f"zmtp.{name}")


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class _Connection(asyncio.BufferedProtocol):
    """One peer: the handshake, then its receive buffer (see the module docstring).

    Buffer positions: ``start`` .. ``complete`` whole messages (and commands between them)
    not yet taken, ``complete`` .. ``scan`` frames of the message in progress, ``scan`` ..
    ``end`` bytes not yet walked (an incomplete frame)."""

    def __init__(self, sock: ZmtpSocket) -> None:
        self.sock = sock
        self.transport: asyncio.Transport | None = None
        self.address = "?"
        keys = sock.access.curve
        self.curve: CurveServer | None = None
        if keys is not None:
            self.curve = CurveServer(keys.public, keys.secret, sock.kind, sock.access.curve_allows)
        self.handshake = zp.Handshake(
            sock.kind, max_bytes=sock.config.max_handshake_bytes, mechanism=self.curve
        )
        # CURVE: what is read (MESSAGE commands), and an opened frame that waits for room
        self.chunk = b"" if self.curve is None else bytearray(_CURVE_CHUNK)
        self.wire = bytearray()
        self.plain_pending = b""
        self.peer: zp.Peer | None = None
        self.denied = False  # refused by the allowlist: told so (ERROR "400") after greetings
        self.prefix: bytes | None = None  # a ROUTER's routing id for this peer
        self.stub = bytearray(_STUB)
        self.in_stub = 0
        self.buf: bytearray | None = None
        self.cbuf: Any = None  # the compiled path's view of buf
        self.cap = self.reserved = 0
        self.start = self.end = self.scan = self.complete = self.partial = self.want = 0
        self.paused = False
        self.waiting: asyncio.Task[None] | None = None
        self.closed = False
        self.ready = False  # in the socket's deque of connections with whole messages
        now = time.monotonic()
        self.connected_at = now
        self.partial_since = 0.0  # when the unfinished message began (0: none)
        self.active = True  # received since the last sweep

    # --- asyncio callbacks -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peername = transport.get_extra_info("peername")
        host = None
        if isinstance(peername, tuple):
            host = peername[0]
            self.address = f"{host}:{peername[1]}"
        transport.set_write_buffer_limits(high=self.sock.config.max_reply_bytes)
        if not self.sock._adopt(self, host):
            return
        transport.write(self.handshake.initial)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed and self.peer is None and (self.curve or self.handshake.received):
            # a libzmq peer that reads a greeting it cannot take (another mechanism: a NULL
            # peer of a CURVE listener) hangs up without a word, with LINGER 0 by a reset
            # that can take its own greeting with it before it is read
            if self.curve is not None:
                self.sock.access.refused(self.address, "handshake_failed", "hung up")
            else:
                self.sock._refused("handshake_failed", f"{self.address}: hung up")
        elif (
            not self.closed and self.peer is not None and (self.end > self.complete or self.in_stub)
        ):
            # the peer went away in the middle of a message: what it sent of it is dropped
            # (also when it is still in the stub, waiting for buffer room)
            self.sock._refused("unfinished_message", f"{self.address}: closed mid-message")
        self._close()

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.curve is not None and self.peer is not None:
            return memoryview(self.chunk)
        if self.buf is None and self.peer is not None and self.waiting is None:
            self._alloc(self.sock.config.read_buffer_bytes, reserve=True)
        if self.buf is None:
            return memoryview(self.stub)[self.in_stub :]
        return memoryview(self.buf)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            return
        try:
            self._received(nbytes)
        except Exception as exc:  # a bug, met by what this peer sent: this connection only
            self.sock._failed(exc, self)

    def _received(self, nbytes: int) -> None:
        self.active = True
        if self.peer is None:
            self._handshake(bytes(self.stub[:nbytes]))
        elif self.curve is not None:
            self.wire += memoryview(self.chunk)[:nbytes]
            self._pump()
        elif self.buf is None:  # no room was reserved: hold these bytes, wait for room
            self.in_stub += nbytes
            self._wait_room(self.sock.config.read_buffer_bytes)
        else:
            self.end += nbytes
            self._walk()

    def eof_received(self) -> bool:
        return False  # close: a ZeroMQ peer never half-closes

    # --- handshake ---------------------------------------------------------------------------

    def _handshake(self, data: bytes) -> None:
        hs = self.handshake
        try:
            out = hs.receive_data(data)
        except zp.ZmtpError as exc:
            reason, access = handshake_refusal(exc, self.curve is not None)
            self.refuse(reason, str(exc), tell=hs.greeted, access=access)
            return
        assert self.transport is not None
        if self.denied and hs.greeted:
            # as libzmq answers a ZAP refusal: ERROR "400" where READY (or WELCOME) was due,
            # so a libzmq peer reports an authentication failure and does not come back
            self.transport.write(zp.error_command("400"))
            self.transport.close()
            self._close()
            return
        if out:
            self.transport.write(out)
        if hs.peer is None:
            return
        self.peer = hs.peer
        if not self.sock._peer_ready(self):
            return
        leftover = hs.leftover
        if self.curve is not None:
            self.wire += leftover
            self._pump()
            return
        if leftover:  # traffic in the same read as READY: it fits the stub it came in
            self.stub[: len(leftover)] = leftover
            self.in_stub = len(leftover)
            if self._alloc(self.sock.config.read_buffer_bytes, reserve=True):
                self._walk()
            else:
                self._wait_room(self.sock.config.read_buffer_bytes)

    # --- the buffer --------------------------------------------------------------------------

    def _alloc(self, cap: int, *, reserve: bool) -> bool:
        """A buffer of ``cap`` bytes holding what is held now; with ``reserve`` the extra is
        reserved first (False: the holder has no room, nothing changed)."""
        extra = cap - self.reserved
        if reserve and extra > 0 and not self.sock.holder.try_reserve(extra):
            return False
        if extra > 0:
            self.reserved += extra
        buf = bytearray(cap)
        if self.buf is not None:
            held = self.end - self.start
            buf[:held] = memoryview(self.buf)[self.start : self.end]
            self._shift(self.start)
        else:
            buf[: self.in_stub] = self.stub[: self.in_stub]
            self.start = self.scan = self.complete = self.partial = 0
            self.end, self.in_stub = self.in_stub, 0
        self.buf, self.cap = buf, cap
        self.cbuf = self.sock._cbuf(buf)
        self.sock.buffered += extra
        if extra < 0:  # shrinking: give back what this buffer no longer needs
            self.reserved += extra
            self.sock.holder.release(-extra)
        return True

    def _shift(self, by: int) -> None:
        self.start -= by
        self.end -= by
        self.scan -= by
        self.complete -= by
        self.want -= by

    def _compact(self) -> None:
        buf = self.buf
        assert buf is not None
        held = self.end - self.start
        buf[:held] = buf[self.start : self.end]  # same-size slice assignment: no resize
        self._shift(self.start)

    def _free(self) -> None:
        """Drop the buffer and its reservation (drained and idle, or closed)."""
        self.buf = self.cbuf = None
        self.cap = 0
        self.start = self.end = self.scan = self.complete = self.partial = self.want = 0
        if self.reserved:
            self.sock.buffered -= self.reserved
            self.sock.holder.release(self.reserved)
            self.reserved = 0

    def _pause(self) -> None:
        if not self.paused and not self.closed:
            assert self.transport is not None
            self.transport.pause_reading()
            self.paused = True

    def _resume(self) -> None:
        if self.paused and not self.closed and self.waiting is None:
            assert self.transport is not None
            self.paused = False
            if self.partial_since:
                self.partial_since = time.monotonic()  # not read meanwhile: not its fault
            self.transport.resume_reading()
            if self.curve is not None:  # frames opened before the pause go first
                asyncio.get_running_loop().call_soon(self._pump)

    # --- CURVE: MESSAGE boxes opened into the buffer ------------------------------------------

    def _pump(self) -> None:
        """Open the MESSAGE commands read so far, each into the buffer as a plain frame (then
        scanned as any connection's bytes); stops when the buffer has no room (the connection
        is paused then, so the wire holds at most one box and one read more)."""
        curve = self.curve
        assert curve is not None
        wire = self.wire
        limit = self.sock.max_message_bytes + 128  # one frame's box, nonce and command head
        while not self.closed:
            if self.plain_pending:
                if self.paused or self.waiting is not None:
                    return
                self.plain_pending = self._inject(self.plain_pending)
                continue
            if len(wire) < 2:
                return
            flags = wire[0]
            if flags & 0x02:
                if len(wire) < 9:
                    return
                size, head = int.from_bytes(wire[1:9], "big"), 9
            else:
                size, head = wire[1], 2
            # libzmq sends each MESSAGE as a frame without the COMMAND flag (its body says
            # what it is): both forms are taken, the outer MORE flag is not looked at
            if size > limit:
                self.refuse("message_too_large", f"a {size}-byte MESSAGE")
                return
            if len(wire) < head + size:
                return
            body = bytes(wire[head : head + size])
            del wire[: head + size]
            try:
                name, data = zp.parse_command(body)
                if name != b"MESSAGE":
                    if name == b"ERROR":
                        self.close()
                        return
                    if not flags & 0x04:
                        raise zp.ZmtpError(
                            "a plain frame on a CURVE connection", reason="bad_frame"
                        )
                    continue  # PING/PONG travel inside MESSAGE boxes under CURVE
                frame_flags, frame = curve.open_message(data)
            except zp.ZmtpError as exc:
                self.refuse(exc.reason, str(exc))
                return
            if frame_flags & 0x04:
                self._command(frame)
            else:
                self.plain_pending = zp.encode_frame(frame, frame_flags & 0x01)

    def _inject(self, data: bytes) -> bytes:
        """Opened bytes into the buffer as if received; what did not fit is returned."""
        cfg = self.sock.config
        if self.buf is None and not self._alloc(cfg.read_buffer_bytes, reserve=True):
            self._wait_room(cfg.read_buffer_bytes)
            return data
        assert self.buf is not None
        n = min(len(data), self.cap - self.end)
        self.buf[self.end : self.end + n] = data[:n]
        self.end += n
        self._walk()
        return data[n:]

    def _wait_room(self, cap: int) -> None:
        """Stop reading until ``cap`` bytes of buffer are reserved, then go on."""
        self._pause()
        if self.waiting is not None:
            return
        extra = cap - self.reserved

        async def wait() -> None:
            await self.sock.holder.reserve(extra)
            self.waiting = None
            if self.closed:
                self.sock.holder.release(extra)
                return
            self.reserved += extra
            self.sock.buffered += extra
            self._alloc(cap, reserve=False)
            self._walk()
            if not self.closed and self.waiting is None and self._make_room():
                self._resume()

        self.waiting = asyncio.get_running_loop().create_task(wait())

    # --- frames ------------------------------------------------------------------------------

    def _walk(self) -> None:
        """Scan what arrived; handle commands; make room for what is still to come."""
        sock = self.sock
        while True:
            status, pos, complete, messages, partial, want, body, size = sock._scan(self)
            self.scan, self.complete, self.partial = pos, complete, partial
            if messages and not self.ready:
                sock._mark_ready(self)
            if status == ScanStatus.COMMAND:
                after = body + size
                if partial:  # inside a message: its commands count towards its bound
                    self.partial += after - pos
                elif complete == pos:  # between messages: consumed with them
                    if self.start == complete:
                        self.start = after
                    self.complete = after
                self.scan = after
                assert self.buf is not None
                self._command(bytes(self.buf[body:after]))
                if self.closed:
                    return
                continue
            if status == ScanStatus.TOO_LARGE:
                self.refuse(
                    "message_too_large",
                    f"a message over {sock.max_message_bytes} bytes (a {size}-byte frame)",
                )
                return
            if status == ScanStatus.BAD_COMMAND:
                self.refuse("bad_command", f"a {size}-byte command, or one flagged MORE")
                return
            break
        holding = self.end > self.complete
        if holding and not self.partial_since:
            self.partial_since = time.monotonic()
        elif not holding:
            self.partial_since = 0.0
        self.want = want
        self._make_room()

    def _make_room(self) -> bool:
        """Keep room to read into: compact, grow (reserved), or stop reading (False). Reading
        never goes on with a full buffer (asyncio would take an empty read for EOF)."""
        cfg = self.sock.config
        low = min(4096, self.cap // 4)
        if self.cap - self.end >= low:
            return True
        if self.start:
            self._compact()
            if self.cap - self.end >= low:
                return True
        if self.complete > self.start:
            # whole messages wait for the service; it makes room as it takes them
            if self.cap < cfg.busy_buffer_bytes:
                self._alloc(cfg.busy_buffer_bytes, reserve=True)
            if self.cap - self.end >= low:
                return True
            self._pause()
            return False
        # only the message in progress is here and it may need more room than there is
        want = self.want
        if want <= self.cap and self.end < self.cap:
            return True
        limit = self.sock.max_message_bytes + 16
        cap = min(max(_next_pow2(want + 16), min(2 * self.cap, cfg.busy_buffer_bytes)), limit)
        cap = max(cap, want, self.end + 1)
        if self._alloc(cap, reserve=True):
            return True
        self._wait_room(cap)
        return False

    def consumed(self, pos: int) -> None:
        """The service took the whole messages before ``pos``."""
        self.start = pos
        if pos >= self.complete:
            self.sock._unmark_ready(self)
            if self.closed:
                self._free()
                return
        if self.start == self.end:
            self.start = self.end = self.scan = self.complete = self.want = 0
            if self.cap > self.sock.config.busy_buffer_bytes:
                self._free()  # a big message's room goes back at once
        if self.paused and self.waiting is None and (self.buf is None or self._make_room()):
            self._resume()

    def _command(self, body: bytes) -> None:
        try:
            name, data = zp.parse_command(body)
        except zp.ZmtpError as exc:
            self.refuse(exc.reason, str(exc))
            return
        if name == b"PING":
            self.write(zp.pong_command(data))
        elif name == b"ERROR":
            reason = data[1 : 1 + data[0]].decode("utf-8", "replace") if data else ""
            self.sock._rlog("zmtp: %s: %s sent ERROR %r", self.sock.name, self.address, reason)
            self.close()
        # PONG needs nothing; SUBSCRIBE / CANCEL to a socket that publishes nothing and
        # commands of later versions are ignored, as 23/ZMTP asks.

    # --- ends --------------------------------------------------------------------------------

    def refuse(self, reason: str, detail: str, *, tell: bool = True, access: bool = False) -> None:
        """Count, log (rate-limited, with the peer's address) and disconnect; ``access``: a
        refusal of the access policy (taproom.access counts and logs it by listener)."""
        if self.closed:
            return
        if access:
            self.sock.access.refused(self.address, reason, detail)
        else:
            self.sock._refused(reason, f"{self.address}: {detail}")
        if tell and self.transport is not None:
            with contextlib.suppress(Exception):
                self.transport.write(zp.error_command(reason))
        self.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.waiting is not None:
            self.waiting.cancel()
            self.waiting = None
        if self.ready:
            # whole messages that arrived before the peer went are still delivered, as libzmq
            # delivers them; the unfinished one is dropped. The buffer goes once they are taken.
            self.end = self.scan = self.complete
        else:
            self._free()
        self.sock._forget(self)

    def write(self, data: bytes) -> bool:
        """Queue bytes to the peer; False (dropped) when its queue is over the bound."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            return False
        if transport.get_write_buffer_size() > self.sock.config.max_reply_bytes:
            return False
        if self.curve is not None and self.peer is not None:
            data = self._seal_all(data)
        transport.write(data)
        return True

    def _seal_all(self, data: bytes) -> bytes:
        """Plain ZMTP frames as CURVE MESSAGE commands, one a frame."""
        curve = self.curve
        assert curve is not None
        out = []
        pos, end = 0, len(data)
        while pos < end:
            flags = data[pos]
            if flags & 0x02:
                size, head = int.from_bytes(data[pos + 1 : pos + 9], "big"), 9
            else:
                size, head = data[pos + 1], 2
            out.append(curve.seal(flags & 0x05, data[pos + head : pos + head + size]))
            pos += head + size
        return b"".join(out)


class ZmtpSocket:
    """One bound ZeroMQ socket of type ``kind`` served by taproom's transport.

    ``protocol``/``name``: the metric labels and the listener's name. ``max_message_bytes``:
    the most a message may take on the wire. ``subscribe``: topics a SUB sends every peer.
    """

    def __init__(
        self,
        kind: str,
        *,
        hub: Hub,
        protocol: str,
        name: str,
        max_message_bytes: int,
        subscribe: tuple[bytes, ...] = (),
        config: ZmtpConfig | None = None,
        holder: Holder | None = None,
        access: ListenerAccess | None = None,
    ) -> None:
        if kind.encode() not in _KINDS:
            raise ValueError(f"taproom's transport has no {kind} socket")
        self.kind = kind.encode()
        self.hub = hub
        self.protocol = protocol
        self.name = name
        self.max_message_bytes = max_message_bytes
        self.subscriptions = subscribe
        self.config = config or zmtp_config(hub)
        self.holder = holder or buffer_holder(hub)
        # who may connect (taproom.access): the allowlist is checked at accept
        self.access = access or access_for(hub.config, name, hub.metrics)
        self.buffered = 0  # bytes reserved by this socket's connections
        self.address = ""
        self._server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._connections: set[_Connection] = set()
        self._ready: deque[_Connection] = deque()
        self._readable = asyncio.Event()
        self._routes: dict[bytes, _Connection] = {}
        self._next_id = itertools.count(random.getrandbits(31))
        self._rlog = _RateLimitedLog()
        self._guard = hub.supervisor.guard(f"zmtp.{name}", protocol=protocol, logger=log)
        self._ext = zmqburst.active() == "ext"
        ffi, lib = zmqburst.ffi_lib()
        self._ffi, self._lib = ffi, lib
        self._scanned: Any = ffi.new("zt_scanned *") if self._ext else None
        metrics = hub.metrics
        self._m_connections = metrics.connections(protocol, name)
        metrics.gauge(
            "zmtp",
            "buffered",
            "bytes",
            "Connection buffer bytes reserved by a ZeroMQ listener's peers (budget: connections)",
            ("listener",),
        ).labels(listener=name).set_function(lambda: self.buffered)
        self._m_dropped = metrics.counter(
            "zmtp",
            "replies_dropped",
            "messages",
            "Replies dropped because the peer had max_reply_bytes queued or had gone",
            ("listener",),
        ).labels(listener=name)

    # --- binding -------------------------------------------------------------------------------

    async def bind(self, host: str, port: int) -> str:
        """Listen on ``host:port`` (0: any free port); returns ``host:port`` as bound."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(
            lambda: _Connection(self), host or None, port, backlog=ACCEPT_BATCH
        )
        deepen_accept_queue(server.sockets, 4096)
        self._server = server
        bound = server.sockets[0].getsockname()[1]
        self.address, self._sweeper = listening(self.hub, self.name, host, bound, self._sweep, loop)
        return self.address

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._connections):
            conn.close()
        while self._ready:  # nobody takes them now: their room goes back
            conn = self._ready.popleft()
            conn.ready = False
            conn._free()

    # --- the service's side --------------------------------------------------------------------

    @property
    def readable(self) -> bool:
        return bool(self._ready)

    async def wait_readable(self, timeout: float | None = None) -> bool:
        """Until a whole message is ready (True), or ``timeout`` seconds passed (False). No
        ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that races its
        timeout, and a loop that ignores its cancel hangs the service's stop."""
        if timeout is None:
            while not self._ready:
                self._readable.clear()
                await self._readable.wait()
            return True
        if not self._ready:
            self._readable.clear()
            wake = asyncio.get_running_loop().call_later(timeout, self._readable.set)
            try:
                await self._readable.wait()
            finally:
                wake.cancel()
        return bool(self._ready)

    def reader(self, max_frames: int) -> zmqburst.Reader:
        """A burst reader (compiled or pure Python, as taproom.zmqburst selects): every whole
        message ready, up to a count and a byte budget, across peers in turn."""
        if self._ext:
            return ExtReader(self, max_frames)
        return PyReader(self, max_frames)

    def send(self, frames: list[bytes] | tuple[bytes, ...]) -> bool:
        """A ROUTER's message to the peer its first frame names; False when it is gone or
        has max_reply_bytes queued (dropped and counted, as libzmq's ROUTER drops)."""
        conn = self._routes.get(frames[0])
        if conn is None or not conn.write(zp.encode_message(frames[1:])):
            self._m_dropped.inc()
            return False
        return True

    def send_encoded(self, routing_id: bytes, data: bytes) -> bool:
        """Like :meth:`send` with the frames after the routing id already encoded."""
        conn = self._routes.get(routing_id)
        if conn is None or not conn.write(data):
            self._m_dropped.inc()
            return False
        return True

    def send_encoded_many(self, replies: list[tuple[bytes, bytes]]) -> None:
        """:meth:`send_encoded` for many replies: one write per peer (a write is a system call
        when nothing is queued), in order per peer."""
        if len(replies) == 1:
            self.send_encoded(*replies[0])
            return
        per_peer: dict[bytes, list[bytes]] = {}
        for routing_id, data in replies:
            chunks = per_peer.get(routing_id)
            if chunks is None:
                per_peer[routing_id] = [data]
            else:
                chunks.append(data)
        for routing_id, chunks in per_peer.items():
            conn = self._routes.get(routing_id)
            if conn is None or not conn.write(b"".join(chunks)):
                self._m_dropped.inc(len(chunks))

    def peers(self) -> int:
        return sum(1 for conn in self._connections if conn.peer is not None)

    # --- the connections' side -----------------------------------------------------------------

    def _adopt(self, conn: _Connection, host: str | None) -> bool:
        assert conn.transport is not None
        if not self.access.allows(host):
            # counted now; the peer is told at the handshake (it is bounded like any other)
            self.access.refused(conn.address, "address_not_allowed", "not in allow")
            conn.denied = True
        if self._server is None or len(self._connections) >= self.config.max_connections:
            self._refused("too_many_connections", f"{conn.address}: over max_connections")
            conn.transport.abort()
            conn.closed = True
            return False
        self._connections.add(conn)
        self._m_connections.inc()
        return True

    def _peer_ready(self, conn: _Connection) -> bool:
        peer = conn.peer
        assert peer is not None and conn.transport is not None
        if self.kind == b"ROUTER":
            identity = peer.identity
            if identity and identity[0] != 0:
                # as libzmq's ROUTER without ROUTER_HANDOVER: a taken identity is refused
                if identity in self._routes:
                    conn.refuse("identity_in_use", f"identity {identity!r} is connected")
                    return False
                routing_id = identity
            else:  # libzmq's generated ids: a zero byte, then a 32-bit counter
                routing_id = b"\x00" + (next(self._next_id) & 0xFFFFFFFF).to_bytes(4, "big")
            conn.prefix = routing_id
            self._routes[routing_id] = conn
        for topic in self.subscriptions:
            conn.write(zp.subscribe_message(topic, peer.minor))
        return True

    def _forget(self, conn: _Connection) -> None:
        """A connection closed (its whole messages, if any, stay ready until taken)."""
        if conn in self._connections:
            self._connections.discard(conn)
            self._m_connections.dec()
        if conn.prefix is not None and self._routes.get(conn.prefix) is conn:
            del self._routes[conn.prefix]

    def _mark_ready(self, conn: _Connection) -> None:
        conn.ready = True
        self._ready.append(conn)
        self._readable.set()

    def _unmark_ready(self, conn: _Connection) -> None:
        if conn.ready:
            conn.ready = False
            with contextlib.suppress(ValueError):
                self._ready.remove(conn)

    def _refused(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected(self.protocol, reason)
        self._rlog("zmtp: %s refused %s (%s)", self.name, detail, reason)

    def _failed(self, exc: Exception, conn: _Connection) -> None:
        """A read the transport failed on unexpectedly (taproom.supervise): counted as an
        ``internal_error`` of the protocol and logged with its traceback; that connection
        closes (its buffer is in no known state; the whole messages before it are still
        delivered), the listener and every other connection go on."""
        self._guard.failed(exc, f"read from {conn.address}")
        conn.close()

    def _cbuf(self, buf: bytearray) -> Any:
        return self._ffi.from_buffer("unsigned char[]", buf) if self._ext else None

    def _scan(self, conn: _Connection) -> tuple[int, int, int, int, int, int, int, int]:
        limit, commands = self.max_message_bytes, self.config.max_command_bytes
        if not self._ext:
            assert conn.buf is not None
            return zp.scan(
                conn.buf, conn.scan, conn.end, conn.complete, conn.partial, limit, commands
            )
        r = self._scanned
        self._lib.zt_scan(
            conn.cbuf, conn.scan, conn.end, conn.complete, conn.partial, limit, commands, r
        )
        return r.status, r.pos, r.complete, r.messages, r.partial, r.want, r.body, r.size

    async def _sweep(self) -> None:
        """Handshake and unfinished-message timeouts; buffers of idle peers given back."""
        cfg = self.config
        while True:
            await asyncio.sleep(_SWEEP_S)
            now = time.monotonic()
            for conn in list(self._connections):
                if conn.peer is None:
                    if now - conn.connected_at > cfg.handshake_timeout_s:
                        conn.refuse("handshake_timeout", "no READY in time", tell=False)
                    continue
                stalled = conn.partial_since and now - conn.partial_since > cfg.partial_timeout_s
                # not read because the hub is full: not its fault; waiting for room it holds
                # part of the budget for a message that may never end: its fault
                if stalled and (not conn.paused or conn.waiting is not None):
                    conn.refuse("partial_timeout", "a message left unfinished")
                    continue
                if not conn.active and conn.buf is not None and conn.start == conn.end:
                    conn._free()
                conn.active = False
