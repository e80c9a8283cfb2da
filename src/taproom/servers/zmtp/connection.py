"""One peer of a :class:`~.transport.ZmtpSocket`: an ``asyncio.BufferedProtocol`` doing the
ZMTP handshake (NULL or CURVE), then reading into a buffer reserved from the process budget,
walking frame headers in place, and handing whole messages to its socket (the bounds are in
``transport``'s docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ...protocols import zmtp as zp
from ...protocols.zmtp.curve import CurveServer
from ...protocols.zmtp.wire import ScanStatus
from .listener import handshake_refusal

if TYPE_CHECKING:
    from .transport import ZmtpSocket

__all__ = ["Connection"]

log = logging.getLogger("taproom.zmtp")

_STUB = 256  # bytes a connection reads into while it has no buffer (handshake, waiting for room)
_CURVE_CHUNK = 65536  # what a CURVE connection reads at a time (MESSAGE boxes, then opened)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


class Connection(asyncio.BufferedProtocol):
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
        sock = self.sock
        sock._reading = True
        try:
            self._received(nbytes)
        except Exception as exc:  # a bug, met by what this peer sent: this connection only
            sock._failed(exc, self)
        finally:
            sock._reading = False
        if sock._deferred:
            sock._serve_deferred()

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
