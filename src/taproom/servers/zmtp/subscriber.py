"""One subscriber of a :class:`~.publisher.ZmtpPublisher`: its handshake, subscriptions and
queue (see the publisher's docstring for the accounting: every message offered is delivered,
dropped and counted by reason, or still queued).

A subscriber is a plain non-blocking socket on the event loop: a message goes straight to the
kernel when nothing is queued; what the kernel does not take is queued as views of the shared
burst bytes (or a copy of a small remainder) and written with ``sendmsg`` when the socket is
writable. Control bytes (handshake replies, PONGs) go between whole messages only.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections import deque
from typing import TYPE_CHECKING

from ...protocols import zmtp as zp
from ...protocols.zmtp.curve import CurveServer
from ...protocols.zmtp.pubsub import (
    Burst,
    Filter,
    command_subscription,
    message_subscription,
    seal_messages,
)
from .listener import handshake_refusal

if TYPE_CHECKING:
    from .publisher import ZmtpPublisher

__all__ = ["DISCONNECTED", "HWM", "OUTPUT_BUDGET", "SUBSCRIBER_BYTES", "Subscriber"]

_READ = 65536  # bytes read from a subscriber at a time (subscriptions are tens of bytes)
_IOV = 64  # queued pieces written in one sendmsg (well under any IOV_MAX)

# drop reasons (taproom_output_dropped_messages_total{output, reason})
HWM = "hwm"
SUBSCRIBER_BYTES = "subscriber_bytes"
OUTPUT_BUDGET = "output_budget"
DISCONNECTED = "disconnected"


class _Shared:
    """A burst's wire bytes held by subscriber queues: reserved from the holder once, released
    when the last queue lets go."""

    __slots__ = ("burst", "refs", "reserved")

    def __init__(self, burst: Burst) -> None:
        self.burst = burst
        self.refs = 0
        self.reserved = 0


class _Item:
    """Part of a burst queued for one subscriber: wire bytes ``pos .. end`` still to write,
    covering messages ``first .. last - 1`` (the first may be partly written already)."""

    __slots__ = ("charge", "end", "first", "last", "pos", "shared")

    def __init__(self, shared: _Shared, pos: int, end: int, first: int, last: int, charge: int):
        self.shared = shared
        self.pos = pos
        self.end = end
        self.first = first
        self.last = last
        self.charge = charge  # what this item counts against the subscriber's bounds


class Subscriber:
    """One connected SUB / XSUB peer: its handshake, subscriptions and queue."""

    def __init__(self, pub: ZmtpPublisher, sock: socket.socket, address: str) -> None:
        self.pub = pub
        self.sock = sock
        self.fd = sock.fileno()
        self.address = address
        keys = pub.access.curve
        self.curve: CurveServer | None = None
        if keys is not None:
            self.curve = CurveServer(keys.public, keys.secret, pub.kind, pub.access.curve_allows)
        self.handshake = zp.Handshake(
            pub.kind, max_bytes=pub.config.max_handshake_bytes, mechanism=self.curve
        )
        self.peer: zp.Peer | None = None
        self.denied = False
        self.filter = Filter(pub.config.max_subscriptions)
        self.rbuf = bytearray()
        self.queue: deque[_Item] = deque()
        self.control = bytearray()  # handshake replies, PONGs: written before any message
        self.queued = 0  # messages queued (not yet wholly handed to the kernel)
        self.pinned = 0  # bytes this subscriber's queue counts against its bounds
        self.writing = False
        self.closed = False
        self.connected_at = time.monotonic()

    # --- reading: the handshake, then subscriptions --------------------------------------------

    def readable(self) -> None:
        try:
            self._read()
        except Exception as exc:  # a bug, met by what this peer sent: this subscriber only
            self.pub._failed(exc, self)

    def _read(self) -> None:
        try:
            data = self.sock.recv(_READ)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.close()
            return
        if not data:
            if self.peer is None and self.curve is not None and self.handshake.received:
                # a libzmq NULL peer of a CURVE listener hangs up on reading our greeting
                self.pub.access.refused(self.address, "handshake_failed", "hung up")
            self.close()
            return
        if self.peer is None:
            self._handshake(data)
        else:
            self.rbuf += data
            self._frames()

    def _handshake(self, data: bytes) -> None:
        hs = self.handshake
        try:
            out = hs.receive_data(data)
        except zp.ZmtpError as exc:
            reason, access = handshake_refusal(exc, self.curve is not None)
            self.refuse(reason, str(exc), tell=hs.greeted, access=access)
            return
        if self.denied and hs.greeted:
            # as libzmq answers a ZAP refusal: ERROR "400" where READY (or WELCOME) was due
            self._write_control(zp.error_command("400"))
            self.close()
            return
        if out:
            self._write_control(out)
        if hs.peer is None:
            return
        self.peer = hs.peer
        self.pub._joined(self)
        if hs.leftover:
            self.rbuf += hs.leftover
            self._frames()

    def _frames(self) -> None:
        """Every whole frame read so far: a subscription, a command, or (CURVE) a MESSAGE box
        opened first. A frame is bounded before its body is waited for."""
        buf = self.rbuf
        pub = self.pub
        # a 3.0 subscription message is 1 + the prefix; a 3.1 command its name too; a CURVE
        # box adds a nonce, a tag and the command's own head
        limit = pub.max_subscription_bytes + 16 + (128 if self.curve is not None else 0)
        pos = 0
        try:
            while not self.closed and len(buf) - pos >= 2:
                flags = buf[pos]
                if flags & 0x02:
                    if len(buf) - pos < 9:
                        break
                    size, head = int.from_bytes(buf[pos + 1 : pos + 9], "big"), 9
                else:
                    size, head = buf[pos + 1], 2
                bound = max(limit, pub.config.max_command_bytes) if flags & 0x04 else limit
                if size > bound:
                    self.refuse("message_too_large", f"a {size}-byte frame to a publisher")
                    return
                if len(buf) - pos - head < size:
                    break
                body = bytes(buf[pos + head : pos + head + size])
                pos += head + size
                if self.curve is not None:
                    name, data = zp.parse_command(body)
                    if name != b"MESSAGE":
                        if name == b"ERROR":
                            self.close()
                            return
                        continue  # PING/PONG travel inside the boxes under CURVE
                    flags, body = self.curve.open_message(data)
                self._frame(flags, body)
        except zp.ZmtpError as exc:
            self.refuse(exc.reason, str(exc))
            return
        del buf[:pos]

    def _frame(self, flags: int, body: bytes) -> None:
        if flags & 0x04:
            sub = command_subscription(body)
            if sub is None:
                name, data = zp.parse_command(body)
                if name == b"PING":
                    self._write_control(zp.pong_command(data))
                elif name == b"ERROR":
                    self.close()
                return  # other commands are ignored, as 23/ZMTP asks
        elif flags & 0x01 or self._in_message:
            # a multi-part message is no subscription: its frames are skipped
            self._in_message = bool(flags & 0x01)
            return
        else:
            sub = message_subscription(body)
            if sub is None:
                return
        self.pub._subscription(self, sub)

    _in_message = False

    # --- writing ---------------------------------------------------------------------------------

    def _write_control(self, data: bytes) -> None:
        """Handshake replies and PONGs: small, never dropped, written between messages (ahead
        of the queued ones when no message is half written)."""
        if self.curve is not None and self.peer is not None:
            data = self._seal_all(data)
        self.control += data
        self._flush()

    def _at_boundary(self) -> bool:
        """No message is half written: control bytes may go now."""
        if not self.queue:
            return True
        head = self.queue[0]
        return head.pos == head.shared.burst.start(head.first)

    def _seal_all(self, data: bytes) -> bytes:
        burst = Burst(data, [len(data)])
        sealed, _ends = seal_messages(data, 0, burst.ends, self._seal)
        return sealed

    def _seal(self, flags: int, body: bytes) -> bytes:
        assert self.curve is not None
        return self.curve.seal(flags, body)

    def offer(self, burst: Burst, shared: _Shared | None) -> None:
        """Messages this subscriber's filter takes: written now when nothing is queued, the
        rest queued within its bounds, the others dropped and counted."""
        pub = self.pub
        n = len(burst.ends)
        pub._m_sent.inc(n)
        if self.closed:
            pub._dropped(DISCONNECTED, n)
            return
        if self.curve is not None:
            self._offer_sealed(burst, 0, n)
            return
        first, pos = 0, 0
        if not self.queue and not self.control:
            # nothing waits: straight to the kernel, no copy, nothing held
            try:
                written = self.sock.send(burst.wire)
            except (BlockingIOError, InterruptedError):
                written = 0
            except OSError:
                pub._dropped(DISCONNECTED, n)
                self.close()
                return
            first = burst.count_before(written)
            pub._m_delivered.inc(first)
            if first == n:
                return
            pos = written
        # a message the kernel took part of must be finished whatever the bounds say
        mandatory = first + 1 if pos > burst.start(first) else first
        self._enqueue(burst, shared, pos, first, mandatory, n)

    def _enqueue(
        self, burst: Burst, shared: _Shared | None, pos: int, first: int, mandatory: int, n: int
    ) -> None:
        pub = self.pub
        by_count = min(n, max(mandatory, first + pub.hwm - self.queued))
        size = len(burst.wire)
        room = self.pub._limit() - self.pinned
        last = by_count
        # the bytes of messages first .. last - 1 from pos; kept as a view of the shared bytes
        # (the whole burst counts against the bounds: it stays in memory) or, when that part
        # is under a quarter of the burst, as a copy of its own (only its bytes count)
        span = burst.ends[last - 1] - pos if last > first else 0
        view = span * 4 >= size
        if (size if view else span) > room:
            cut = min(room, (size - 1) // 4)
            last = max(mandatory, min(by_count, burst.count_before(pos + cut)))
            span = burst.ends[last - 1] - pos if last > first else 0
            view = span * 4 >= size
        if n > by_count:
            pub._dropped(HWM, n - by_count)
        if by_count > last:
            pub._dropped(SUBSCRIBER_BYTES, by_count - last)
        if last == first:
            return
        if view:
            if shared is None:
                shared = _Shared(burst)
            if not shared.reserved and not pub._reserve(shared, force=mandatory > first):
                # the output_queues holder is full: only a half-written message goes on
                if mandatory == first:
                    pub._dropped(OUTPUT_BUDGET, last - first)
                    return
                pub._dropped(OUTPUT_BUDGET, last - mandatory)
                last = mandatory
                span = burst.ends[last - 1] - pos
                view = False  # copied below, charged whatever the bound
        if view:
            assert shared is not None
            shared.refs += 1
            item = _Item(shared, pos, burst.ends[last - 1], first, last, size)
        else:
            # from pos: what of a half-written message the kernel took is not kept
            ends = [end - pos for end in burst.ends[first:last]]
            own = _Shared(Burst(burst.wire[pos : burst.ends[last - 1]], ends))
            if not pub._reserve(own, force=mandatory > first):
                pub._dropped(OUTPUT_BUDGET, last - first)
                return
            own.refs = 1
            item = _Item(own, 0, ends[-1], 0, last - first, span)
        self.queue.append(item)
        self.queued += item.last - item.first
        self.pinned += item.charge
        pub.queued_messages += item.last - item.first
        pub.queued_bytes += item.charge
        if not self.writing:
            self._want_write()

    def _offer_sealed(self, burst: Burst, first: int, n: int) -> None:
        """CURVE: each frame sealed for this subscriber (its own nonces), so nothing is shared;
        what fits is sealed and queued, in order, then written as usual."""
        pub = self.pub
        by_count = min(n, first + max(0, pub.hwm - self.queued))
        room = pub._limit() - self.pinned
        last = min(by_count, burst.count_before(burst.start(first) + max(0, room)))
        if n > by_count:
            pub._dropped(HWM, n - by_count)
        if by_count > last:
            pub._dropped(SUBSCRIBER_BYTES, by_count - last)
        if last == first:
            return
        sealed, ends = seal_messages(
            burst.wire, burst.start(first), burst.ends[first:last], self._seal
        )
        own = _Shared(Burst(sealed, ends))
        if not pub._reserve(own, force=False):
            pub._dropped(OUTPUT_BUDGET, last - first)
            return
        own.refs = 1
        item = _Item(own, 0, len(sealed), 0, last - first, len(sealed))
        self.queue.append(item)
        self.queued += last - first
        self.pinned += item.charge
        pub.queued_messages += last - first
        pub.queued_bytes += item.charge
        self._flush()

    def _want_write(self) -> None:
        if not self.writing and not self.closed:
            self.writing = True
            self.pub.loop.add_writer(self.fd, self._flush)

    def _flush(self) -> None:
        """Write what the kernel takes: control bytes at a message boundary, queued pieces
        many per call (only the half-written one while control bytes wait)."""
        if self.closed:
            return
        sock = self.sock
        queue = self.queue
        try:
            while self.control or queue:
                if self.control and self._at_boundary():
                    n = sock.send(self.control)
                    del self.control[:n]
                    if self.control:
                        self._want_write()
                        return
                    continue
                count = 1 if self.control else min(_IOV, len(queue))
                pieces = [
                    memoryview(queue[i].shared.burst.wire)[queue[i].pos : queue[i].end]
                    for i in range(count)
                ]
                written = sock.sendmsg(pieces) if count > 1 else sock.send(pieces[0])
                total = sum(map(len, pieces))
                self._written(written)
                if written < total:
                    self._want_write()
                    return
        except (BlockingIOError, InterruptedError):
            self._want_write()
            return
        except OSError:
            self.close()
            return
        if self.writing:
            self.writing = False
            self.pub.loop.remove_writer(self.fd)

    def _written(self, n: int) -> None:
        """The kernel took ``n`` bytes from the head of the queue."""
        pub = self.pub
        queue = self.queue
        delivered = 0
        while n and queue:
            item = queue[0]
            take = min(n, item.end - item.pos)
            item.pos += take
            n -= take
            burst = item.shared.burst
            done = min(item.last, burst.count_before(item.pos))
            delivered += done - item.first
            self.queued -= done - item.first
            pub.queued_messages -= done - item.first
            item.first = done
            if item.pos == item.end:
                queue.popleft()
                self._let_go(item)
        if delivered:
            pub._m_delivered.inc(delivered)

    def _let_go(self, item: _Item) -> None:
        self.pinned -= item.charge
        self.pub.queued_bytes -= item.charge
        shared = item.shared
        shared.refs -= 1
        if not shared.refs and shared.reserved:
            self.pub.holder.release(shared.reserved)
            shared.reserved = 0

    # --- ends ------------------------------------------------------------------------------------

    def refuse(self, reason: str, detail: str, *, tell: bool = True, access: bool = False) -> None:
        """Count, log (rate-limited, with the address) and disconnect (as the ingest side)."""
        if self.closed:
            return
        if access:
            self.pub.access.refused(self.address, reason, detail)
        else:
            self.pub._refused(reason, f"{self.address}: {detail}")
        if tell:
            with contextlib.suppress(OSError):
                self.sock.send(zp.error_command(reason))
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        pub = self.pub
        loop = pub.loop
        loop.remove_reader(self.fd)
        if self.writing:
            loop.remove_writer(self.fd)
            self.writing = False
        with contextlib.suppress(OSError):
            self.sock.close()
        if self.queued:
            pub._dropped(DISCONNECTED, self.queued)
            pub.queued_messages -= self.queued
            self.queued = 0
        while self.queue:
            self._let_go(self.queue.popleft())
        pub._left(self)
