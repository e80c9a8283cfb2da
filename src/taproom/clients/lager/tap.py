"""The Lager :class:`Tap`: registers a data format with the registrar, then logs rows.

Synchronous and single-threaded: a Tap owns its ZeroMQ sockets and must be used from one
thread. No lost first samples on the tap -> bartender hop: the tap's registration and data
sockets are XPUB, not PUB. An XPUB sees the bartender's subscription arrive; ``Tap.register``
waits for it on both sockets before returning, so the first ``log`` is never sent into a pipe
that would drop it. The registration is also re-sent until the registrar echoes it (when
``watch`` is on).
"""

from __future__ import annotations

import time
import uuid as uuid_module
from collections.abc import Callable
from itertools import accumulate
from typing import Any

import numpy as np
import zmq
import zmq.backend

from ... import zmqburst
from ...errors import ProtocolError
from ...protocols.lager.chp import (
    Command,
    Registration,
    parse_update,
    registration_frames,
    snapshot_request_frames,
)
from ...protocols.lager.formats import DataFormat, FormatError, parse_format_xml
from ...zmqaccess import Curve, curve_client
from .common import DuplicateTap, LagerClientError, base, forwarder_base, tcp

__all__ = ["Tap"]

_TS_BYTES = 8
_FLAGS = b"\x00"  # nasa/lager's Tap: a uint8_t, no flag defined
# Plain ints and the backend send: pyzmq's wrappers cost more than the send itself.
_SNDMORE = int(zmq.SNDMORE)
_MORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_raw_send = zmq.backend.Socket.send


def _wait_subscription(sock: zmq.Socket[bytes], deadline: float, what: str) -> None:
    """On an XPUB: block until a subscriber's subscription message arrives."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LagerClientError(f"no {what} subscription from the bartender in time")
        if sock.poll(int(left * 1000) + 1, zmq.POLLIN):
            frame = sock.recv()
            if frame[:1] == b"\x01":
                return


class Tap:
    """A Lager data source.

    Configuration phase: ``Tap(key, format, registrar=, forwarder=)`` then :meth:`register`.
    Execution phase: :meth:`log` (typed values) or :meth:`log_row` (an encoded row).

    ``registrar`` is the registrar's base address ``host:P`` (snapshot P, publisher P+1,
    collector P+2); ``forwarder`` the forwarder's base ``host:F`` (taps publish to F), by
    default P+10 as in nasa/lager. Rows go out as nasa/lager's Tap sends them: uuid, the format
    version (``BEERR01``), a 1-byte flags frame, the timestamp, then one frame per item, so a
    real Mug behind any forwarder can read them.
    With ``watch`` (default) the tap subscribes to the registrar's publisher: registration
    is confirmed by the echo, a duplicate key raises :class:`DuplicateTap` (and later calls
    ``on_duplicate``), and ``log`` returns whether the bartender was heard from within
    ``silence_s`` (HUGZ at 1 Hz or updates). Without ``watch`` the registration is confirmed
    once through the snapshot socket (``ICANHAZ?`` for the tap's key). Either way
    ``register`` returns only when the registrar holds the tap, so no row is refused as
    coming from an unknown tap.
    """

    def __init__(
        self,
        key: str,
        format: DataFormat | str,
        *,
        registrar: str,
        forwarder: str | None = None,
        uuid: bytes | None = None,
        watch: bool = True,
        silence_s: float = 3.0,
        send_hwm: int = 100_000,
        on_duplicate: Callable[[Registration], None] | None = None,
        context: zmq.Context[Any] | None = None,
        curve: Curve | None = None,
    ) -> None:
        self.key = key
        self.format = parse_format_xml(format) if isinstance(format, str) else format
        # Always nasa/lager's form (key attribute, C++ type names): its Mug validates every
        # registration against a schema that requires them.
        self.xml = self.format.to_xml(key=key)
        self.uuid = uuid or uuid_module.uuid4().bytes
        self.watch = watch
        self.silence_s = silence_s
        self.on_duplicate = on_duplicate
        self.dropped = 0
        self.sent = 0
        self.registered = False
        self.duplicate_of: Registration | None = None
        self._reg_host, self._reg_port = base(registrar)
        self._fwd_host, self._fwd_port = forwarder_base(registrar, forwarder)
        self._version = self.format.version.encode()
        # Where each item's frame starts and ends in a row (items tile the row in order).
        self._cuts = [(item.offset, item.offset + item.size) for item in self.format.items]
        self._ctx = context or zmq.Context.instance()
        self._curve = curve
        self._send_hwm = send_hwm
        self._last_heard = 0.0
        self._next_check = 0.0
        self._collector: zmq.Socket[bytes] | None = None
        self._updates: zmq.Socket[bytes] | None = None
        self._data: zmq.Socket[bytes] | None = None
        # The row's message laid out for zmqburst's compiled send (tb_send: one C call a row
        # instead of 8 pyzmq sends, ~1.4 us a row against ~3.7): the constant head (uuid,
        # version, flags) and where each frame ends in ``head + timestamp + row``. Set by
        # register() while the compiled path is selected; None: the Python twin.
        self._head = self.uuid + self._version + _FLAGS
        self._send_c: Callable[[bytes], int] | None = None
        self._send_many_c: Callable[[Any, int], int] | None = None
        # log_rows lays n messages out back to back: head, timestamp, row.
        self._messages_dtype = np.dtype(
            [("head", f"V{len(self._head)}"), ("ts", ">u8"), ("row", f"V{self.format.row_size}")]
        )

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        """A socket of our context, a CURVE client when the bartender wants one."""
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        if self._curve is not None:
            curve_client(sock, *self._curve)
        return sock

    @property
    def uuid_str(self) -> str:
        return str(uuid_module.UUID(bytes=self.uuid))

    def register(self, timeout: float = 10.0) -> Tap:
        """Register, and return once the data path to the bartender is up."""
        deadline = time.monotonic() + timeout
        self._collector = self._socket(zmq.XPUB)
        self._collector.setsockopt(zmq.LINGER, 1000)
        self._collector.connect(tcp(self._reg_host, self._reg_port + 2))
        if self.watch:
            self._updates = self._socket(zmq.SUB)
            self._updates.setsockopt(zmq.LINGER, 0)
            self._updates.setsockopt(zmq.SUBSCRIBE, self.key.encode("utf-8"))
            self._updates.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
            self._updates.connect(tcp(self._reg_host, self._reg_port + 1))
        self._data = self._socket(zmq.XPUB)
        self._data.setsockopt(zmq.LINGER, 2000)
        self._data.setsockopt(zmq.SNDHWM, self._send_hwm)
        # At the HWM a send fails (log() returns False and counts it) instead of ZeroMQ
        # silently dropping the row, as PUB would.
        self._data.setsockopt(zmq.XPUB_NODROP, 1)
        self._data.connect(tcp(self._fwd_host, self._fwd_port))
        _wait_subscription(self._collector, deadline, "collector")
        frames = registration_frames(self.key, self.uuid, self.xml)
        if self.watch:
            assert self._updates is not None
            while not self.registered:
                self._collector.send_multipart(frames)
                # Resend until echoed: the first may precede our SUB's subscription upstream.
                until = min(deadline, time.monotonic() + 0.5)
                while time.monotonic() < until and not self.registered:
                    if self._updates.poll(max(int((until - time.monotonic()) * 1000), 1)):
                        self._handle_update(self._updates.recv_multipart())
                    if self.duplicate_of is not None:
                        raise DuplicateTap(
                            f"{self.key} is registered by tap {self.duplicate_of.uuid_str}"
                        )
                if time.monotonic() >= deadline and not self.registered:
                    raise LagerClientError(f"registrar did not confirm {self.key} in time")
        else:
            self._confirm_by_snapshot(frames, deadline)
        _wait_subscription(self._data, deadline, "forwarder")
        self._send_c = self._compiled_send(self._data)
        return self

    def _compiled_send(self, sock: zmq.Socket[bytes]) -> Callable[[bytes], int] | None:
        """One row's whole message in one C call (zmqburst's ``tb_send``: every frame
        NOBLOCK). An XPUB with XPUB_NODROP refuses a message at its first frame only (libzmq
        checks the HWM against whole messages written), so 0 means nothing of it was queued:
        the same push-back as the per-frame sends."""
        ffi, lib = zmqburst.ffi_lib()
        if lib is None:
            return None
        sizes = [len(self.uuid), len(self._version), len(_FLAGS), _TS_BYTES]
        sizes += [stop - start for start, stop in self._cuts]
        ends = list(accumulate(sizes))
        frame_end = ffi.new("size_t[]", ends)
        counts = ffi.new("int[]", [len(ends)])
        handle, tb_send = zmqburst.handle(sock), lib.tb_send
        stride = ends[-1]

        def send(message: bytes) -> int:
            return int(tb_send(handle, message, frame_end, counts, 1))

        def send_many(messages: Any, n: int) -> int:
            """The ``n`` messages of a laid-out array, one call each (a call a message, not
            one for all: tb_send skips a refused message and goes on, so only a call per
            message keeps what was queued a prefix). Returns the index of the first refused."""
            at = ffi.from_buffer(messages)
            for i in range(n):
                if not tb_send(handle, at + i * stride, frame_end, counts, 1):
                    return i
            return n

        # the arrays live as long as the closures
        send.keep = send_many.keep = (frame_end, counts)  # type: ignore[attr-defined]
        self._send_many_c = send_many
        return send

    def _confirm_by_snapshot(self, frames: list[bytes], deadline: float) -> None:
        """Without a publisher subscription: ask the snapshot socket for our key until the
        registrar holds it, so data sent after register() is never refused as unknown."""
        assert self._collector is not None
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(tcp(self._reg_host, self._reg_port))
        try:
            while True:
                self._collector.send_multipart(frames)
                dealer.send_multipart(snapshot_request_frames(self.key))
                holder = None
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                        raise LagerClientError(f"registrar did not confirm {self.key} in time")
                    update = parse_update(dealer.recv_multipart())
                    if update.command is Command.KTHXBAI:
                        break
                    if update.registration and update.registration.key == self.key:
                        holder = update.registration
                if holder is not None and holder.uuid == self.uuid:
                    self.registered = True
                    return
                if holder is not None:
                    self.duplicate_of = holder
                    raise DuplicateTap(f"{self.key} is registered by tap {holder.uuid_str}")
                time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))
        finally:
            dealer.close()

    def _handle_update(self, frames: list[bytes]) -> None:
        self._last_heard = time.monotonic()
        try:
            update = parse_update(frames)
        except ProtocolError:
            return
        reg = update.registration
        if reg is None or reg.key != self.key:
            return
        if reg.uuid == self.uuid:
            self.registered = True
        else:
            self.duplicate_of = reg
            if self.on_duplicate is not None:
                self.on_duplicate(reg)

    def _poll_registrar(self) -> None:
        sock = self._updates
        if sock is None:
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle_update(frames)

    @property
    def alive(self) -> bool:
        """Whether the bartender was heard from within ``silence_s`` (True without watch)."""
        if self._updates is None:
            return True
        return time.monotonic() - self._last_heard < self.silence_s

    def log(self, ts_ns: int | None = None, **values: Any) -> bool:
        """Encode and send one row. Returns False when the row could not be queued or (with
        ``watch``) the bartender has gone silent."""
        return self.log_row(self.format.encode_row(values), ts_ns)

    def log_row(self, row: bytes, ts_ns: int | None = None) -> bool:
        """Send one encoded row (network byte order, the format's row size)."""
        sock = self._data
        if sock is None:
            raise LagerClientError("register() first")
        if len(row) != self.format.row_size:
            raise FormatError(
                f"row is {len(row)} bytes, the format needs {self.format.row_size}",
                reason="payload_size",
            )
        ts = time.time_ns() if ts_ns is None else ts_ns
        send_c = self._send_c
        if send_c is not None:
            if not send_c(self._head + ts.to_bytes(_TS_BYTES, "big") + row):
                self.dropped += 1
                return False
        else:
            try:
                self._send_frames(sock, row, ts)
            except zmq.Again:
                self.dropped += 1
                return False
        self.sent += 1
        if self._updates is not None:
            now = time.monotonic()
            if now >= self._next_check:  # poll the registrar at most every 50 ms
                self._next_check = now + 0.05
                self._poll_registrar()
            return time.monotonic() - self._last_heard < self.silence_s
        return True

    def log_rows(self, rows: bytes | memoryview, ts_ns: Any = None) -> int:
        """Send encoded rows stored back to back in ``rows`` (a multiple of the format's row
        size), with ``ts_ns`` one timestamp per row (a sequence or numpy array of ints; None:
        now, for all). Returns how many rows were queued, in order: fewer than all when the
        bartender pushes back (as ``log_row`` returning False; send the rest again later).
        The batch form of ``log_row`` (the same messages): the messages are laid out with
        numpy and sent one C call each, ~1.3 us a row against ~1.9 through ``log_row``."""
        sock = self._data
        if sock is None:
            raise LagerClientError("register() first")
        size = self.format.row_size
        if len(rows) % size:
            raise FormatError(
                f"rows are {len(rows)} bytes, not whole {size}-byte rows", reason="payload_size"
            )
        n = len(rows) // size
        if ts_ns is None:
            stamps: Any = time.time_ns()
        else:
            stamps = np.asarray(ts_ns)
            if stamps.shape != (n,):
                raise ValueError(f"{n} rows need {n} timestamps, not {stamps.shape}")
            if stamps.size and (stamps.min() < 0 or int(stamps.max()) >= 1 << 64):
                raise OverflowError("a timestamp is out of the u64 range")
        send_many = self._send_many_c
        if send_many is not None:
            messages = np.empty(n, self._messages_dtype)
            messages["head"] = np.frombuffer(self._head, messages.dtype["head"])[0]
            messages["ts"] = stamps
            messages["row"] = np.frombuffer(rows, messages.dtype["row"])
            queued = send_many(messages, n)
        else:
            queued = 0
            view = memoryview(rows)
            for i in range(n):
                ts = int(stamps if ts_ns is None else stamps[i])
                try:
                    self._send_frames(sock, bytes(view[i * size : (i + 1) * size]), ts)
                except zmq.Again:
                    break
                queued += 1
        self.sent += queued
        if queued < n:
            self.dropped += 1
        if self._updates is not None and time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + 0.05
            self._poll_registrar()
        return queued

    def _send_frames(self, sock: zmq.Socket[bytes], row: bytes, ts: int) -> None:
        """The pure-Python twin of the compiled send: frame by frame (raises zmq.Again)."""
        send = _raw_send
        cuts = self._cuts
        # NOBLOCK on the first frame only: ZeroMQ queues a message whole or not at all.
        send(sock, self.uuid, _MORE_NOBLOCK)
        send(sock, self._version, _SNDMORE)
        send(sock, _FLAGS, _SNDMORE)
        send(sock, ts.to_bytes(_TS_BYTES, "big"), _SNDMORE)
        for start, end in cuts[:-1]:
            send(sock, row[start:end], _SNDMORE)
        send(sock, row[cuts[-1][0] :], 0)

    def close(self) -> None:
        for sock in (self._collector, self._updates, self._data):
            if sock is not None:
                sock.close()
        self._collector = self._updates = self._data = None
        self._send_c = self._send_many_c = None

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
