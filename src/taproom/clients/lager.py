"""Lager clients: :class:`Tap` (a data source), :class:`Mug` (a data sink), :class:`KegWriter`,
and the ``taproom keg`` command (dump, verify, convert, record).

Threading: Tap and Mug are synchronous and single-threaded -- each owns its ZeroMQ sockets and
must be used from one thread (ZeroMQ sockets are not thread-safe). ``Mug.recv`` polls the
registrar updates and the data socket together, so HUGZ and updates are processed while data
flows. :class:`KegWriter` runs one Mug in its own thread.

No lost first samples (nasa/lager's PUB slow-joiner defect):

* Tap -> bartender: the tap's registration and data sockets are XPUB, not PUB. An XPUB sees
  the bartender's subscription arrive; ``Tap.register`` waits for it on both sockets before
  returning, so the first ``log`` is never sent into a pipe that would drop it. The
  registration is also re-sent until the registrar echoes it (when ``watch`` is on).
* bartender -> mug: ``Mug.subscribe`` subscribes to the chosen taps and then to a unique
  "hello" topic; the forwarder echoes the hello, and because one ZeroMQ pipe applies
  subscriptions in order, every data subscription is in place when the hello arrives.
  ``subscribe`` returns only then. Start logging after that and no sample is lost.

Counted loss: a mug that falls behind loses rows inside ZeroMQ (its HWM), silently. A taproom
bartender publishes per-tap marks (cumulative rows forwarded, see ``servers/lager.py``) in the
same pipe as the rows; the Mug subscribes to the marks of its taps and, at each mark, compares
the rows it received since the previous mark with the bartender's count. The difference is
added to ``Mug.lost`` / ``Mug.lost_by_tap`` and reported through ``on_gap(key, missed)``.
Every row after ``subscribe()`` returns is accounted for: received, or counted as lost.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import secrets
import sys
import threading
import time
import uuid as uuid_module
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
import zmq.backend

from ..errors import ProtocolError, TaproomError
from ..protocols.lager.chp import (
    Command,
    Registration,
    parse_update,
    registration_frames,
    snapshot_request_frames,
)
from ..protocols.lager.formats import DataFormat, parse_format_xml
from ..protocols.lager.keg import KegContents, KegError, KegFileWriter, read_keg
from ..protocols.lager.messages import DataMessage, parse_data_message
from ..zmqframes import recv_frames

__all__ = [
    "DuplicateTap",
    "KegWriter",
    "LagerClientError",
    "Mug",
    "Sample",
    "Tap",
    "register_commands",
]

# Must match taproom.servers.lager.HELLO_PREFIX (clients do not import the server).
HELLO_PREFIX = b"\x00taproom-lager-hello/"
# Must match taproom.servers.lager.MARK_PREFIX: topic MARK_PREFIX + uuid, u64 count, u64 epoch.
MARK_PREFIX = b"\x00taproom-lager-mark/"
_MARK_TOPIC_BYTES = len(MARK_PREFIX) + 16
_MAX_DATA_FRAMES = 1028  # the bartender forwards 5; bounded like its input
_TS_BYTES = 8
# Plain ints and the backend send: pyzmq's wrappers cost more than the send itself.
_SNDMORE = int(zmq.SNDMORE)
_MORE_NOBLOCK = int(zmq.SNDMORE) | int(zmq.NOBLOCK)
_raw_send = zmq.backend.Socket.send


class LagerClientError(TaproomError):
    """A Lager client could not do what was asked (timeout, bad address, unknown tap)."""


class DuplicateTap(LagerClientError):
    """The registrar holds this tap's key for another uuid ("avoid duplicate Tap registration")."""


def _base(address: str) -> tuple[str, int]:
    address = address.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LagerClientError(f"address {address!r} is not host:port")
    return host, int(port)


def _tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


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
    collector P+2); ``forwarder`` the forwarder's base ``host:P`` (taps publish to P).
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
        forwarder: str,
        uuid: bytes | None = None,
        watch: bool = True,
        silence_s: float = 3.0,
        send_hwm: int = 100_000,
        on_duplicate: Callable[[Registration], None] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.key = key
        self.format = parse_format_xml(format) if isinstance(format, str) else format
        self.xml = format if isinstance(format, str) else self.format.to_xml()
        self.uuid = uuid or uuid_module.uuid4().bytes
        self.watch = watch
        self.silence_s = silence_s
        self.on_duplicate = on_duplicate
        self.dropped = 0
        self.sent = 0
        self.registered = False
        self.duplicate_of: Registration | None = None
        self._reg_host, self._reg_port = _base(registrar)
        self._fwd_host, self._fwd_port = _base(forwarder)
        self._ctx = context or zmq.Context.instance()
        self._send_hwm = send_hwm
        self._last_heard = 0.0
        self._next_check = 0.0
        self._collector: zmq.Socket[bytes] | None = None
        self._updates: zmq.Socket[bytes] | None = None
        self._data: zmq.Socket[bytes] | None = None

    @property
    def uuid_str(self) -> str:
        return str(uuid_module.UUID(bytes=self.uuid))

    def register(self, timeout: float = 10.0) -> Tap:
        """Register, and return once the data path to the bartender is up."""
        deadline = time.monotonic() + timeout
        ctx = self._ctx
        self._collector = ctx.socket(zmq.XPUB)
        self._collector.setsockopt(zmq.LINGER, 1000)
        self._collector.connect(_tcp(self._reg_host, self._reg_port + 2))
        if self.watch:
            self._updates = ctx.socket(zmq.SUB)
            self._updates.setsockopt(zmq.LINGER, 0)
            self._updates.setsockopt(zmq.SUBSCRIBE, self.key.encode("utf-8"))
            self._updates.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
            self._updates.connect(_tcp(self._reg_host, self._reg_port + 1))
        self._data = ctx.socket(zmq.XPUB)
        self._data.setsockopt(zmq.LINGER, 2000)
        self._data.setsockopt(zmq.SNDHWM, self._send_hwm)
        # At the HWM a send fails (log() returns False and counts it) instead of ZeroMQ
        # silently dropping the row, as PUB would.
        self._data.setsockopt(zmq.XPUB_NODROP, 1)
        self._data.connect(_tcp(self._fwd_host, self._fwd_port))
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
        return self

    def _confirm_by_snapshot(self, frames: list[bytes], deadline: float) -> None:
        """Without a publisher subscription: ask the snapshot socket for our key until the
        registrar holds it, so data sent after register() is never refused as unknown."""
        assert self._collector is not None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(_tcp(self._reg_host, self._reg_port))
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
        sock = self._data
        if sock is None:
            raise LagerClientError("register() first")
        ts = time.time_ns() if ts_ns is None else ts_ns
        send = _raw_send
        try:
            # NOBLOCK on the first frame only: ZeroMQ queues a message whole or not at all.
            send(sock, self.uuid, _MORE_NOBLOCK)
            send(sock, b"\x01\x00", _SNDMORE)
            send(sock, b"\x00\x00", _SNDMORE)
            send(sock, ts.to_bytes(_TS_BYTES, "big"), _SNDMORE)
            send(sock, row, 0)
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

    def close(self) -> None:
        for sock in (self._collector, self._updates, self._data):
            if sock is not None:
                sock.close()
        self._collector = self._updates = self._data = None

    def __enter__(self) -> Tap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(frozen=True, slots=True)
class Sample:
    """One decoded row."""

    key: str
    uuid: bytes
    ts_ns: int
    values: dict[str, Any]


class Mug:
    """A Lager data sink: synchronise the tap list, watch updates and HUGZ, subscribe, decode.

    ``on_silence()`` is called once when no HUGZ or update arrived for ``silence_s``;
    ``on_update(registration)`` for every hashmap change after :meth:`sync`;
    ``on_gap(key, missed)`` when a mark shows rows of a tap that this mug did not receive
    (``key`` is the tap key, or the uuid string for a tap not in :attr:`taps`). ``lost`` and
    ``lost_by_tap`` keep the totals; ``received`` counts data messages read.
    """

    def __init__(
        self,
        *,
        registrar: str,
        forwarder: str,
        silence_s: float = 3.0,
        recv_hwm: int = 1_000_000,
        on_silence: Callable[[], None] | None = None,
        on_update: Callable[[Registration], None] | None = None,
        on_gap: Callable[[str, int], None] | None = None,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.on_gap = on_gap
        self.lost = 0
        self.lost_by_tap: dict[str, int] = {}
        self.received = 0
        # uuid -> [bartender epoch, its count at the last mark, rows received since]
        self._marks: dict[bytes, list[int]] = {}
        # After a confirmed subscribe: rows of taps that had no mark yet. The bartender marked
        # every tap with rows before its hello reply, so such a tap's count started at zero.
        self._hello_epoch: int | None = None
        self._unmarked: dict[bytes, int] = {}
        self._pending: deque[list[bytes]] = deque()
        self._reg_host, self._reg_port = _base(registrar)
        self._fwd_host, self._fwd_port = _base(forwarder)
        self._ctx = context or zmq.Context.instance()
        self.silence_s = silence_s
        self.on_silence = on_silence
        self.on_update = on_update
        self.taps: dict[str, Registration] = {}
        self.by_uuid: dict[bytes, Registration] = {}
        self.sequence = 0
        self.subtree = ""
        self.silent = False
        self.hugz = 0
        self._last_heard = time.monotonic()
        self._updates = self._ctx.socket(zmq.SUB)
        self._updates.setsockopt(zmq.LINGER, 0)
        self._data = self._ctx.socket(zmq.SUB)
        self._data.setsockopt(zmq.LINGER, 0)
        self._data.setsockopt(zmq.RCVHWM, recv_hwm)
        self._data.connect(_tcp(self._fwd_host, self._fwd_port + 1))
        self._poller = zmq.Poller()
        self._poller.register(self._updates, zmq.POLLIN)
        self._poller.register(self._data, zmq.POLLIN)
        self._subscribed: set[bytes] = set()

    # --- registration flow ----------------------------------------------------------------

    def sync(self, subtree: str = "", timeout: float = 10.0) -> dict[str, Registration]:
        """Snapshot of the taps under ``subtree`` (CHP: subscribe to updates first, then
        ``ICANHAZ?``; updates older than the snapshot are ignored)."""
        self.subtree = subtree
        self._updates.setsockopt(zmq.SUBSCRIBE, subtree.encode("utf-8"))
        self._updates.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        self._updates.connect(_tcp(self._reg_host, self._reg_port + 1))
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(_tcp(self._reg_host, self._reg_port))
        try:
            dealer.send_multipart(snapshot_request_frames(subtree))
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not dealer.poll(int(left * 1000) + 1):
                    raise LagerClientError("no snapshot from the registrar in time")
                update = parse_update(dealer.recv_multipart())
                if update.command is Command.KTHXBAI:
                    self.sequence = update.sequence
                    break
                if update.registration is not None:
                    self._store(update.registration)
        finally:
            dealer.close()
        self._last_heard = time.monotonic()
        return dict(self.taps)

    def _store(self, reg: Registration) -> None:
        old = self.taps.get(reg.key)
        if old is not None:
            self.by_uuid.pop(old.uuid, None)
        self.taps[reg.key] = reg
        self.by_uuid[reg.uuid] = reg

    def _handle_update(self, frames: list[bytes]) -> None:
        self._last_heard = time.monotonic()
        if self.silent:
            self.silent = False
        try:
            update = parse_update(frames)
        except ProtocolError:
            return
        if update.command is Command.HUGZ:
            self.hugz += 1
            return
        reg = update.registration
        if reg is None or (update.sequence <= self.sequence and reg.key in self.taps):
            return
        self.sequence = max(self.sequence, update.sequence)
        self._store(reg)
        if self.on_update is not None:
            self.on_update(reg)

    def poll_registrar(self) -> None:
        """Process pending updates/HUGZ and check for silence (``recv`` calls this)."""
        while True:
            try:
                frames = self._updates.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle_update(frames)
        if not self.silent and time.monotonic() - self._last_heard >= self.silence_s:
            self.silent = True
            if self.on_silence is not None:
                self.on_silence()

    # --- data -----------------------------------------------------------------------------

    def subscribe(self, *taps: str | bytes | Registration, everything: bool = False,
                  timeout: float = 10.0, confirm: bool = True) -> None:  # fmt: skip
        """Subscribe to taps (keys, uuids or registrations; ``everything`` for all) and
        return once the bartender has the subscriptions (see the module docstring).
        ``confirm=False`` skips that handshake (a bartender other than taproom)."""
        topics: list[bytes] = []
        if everything:
            topics.append(b"")
        for tap in taps:
            if isinstance(tap, Registration):
                topics.append(tap.uuid)
            elif isinstance(tap, bytes):
                topics.append(tap)
            else:
                reg = self.taps.get(tap)
                if reg is None:
                    raise LagerClientError(f"unknown tap {tap!r}; sync() first")
                topics.append(reg.uuid)
        for topic in topics:
            if topic not in self._subscribed:
                self._data.setsockopt(zmq.SUBSCRIBE, topic)
                if topic:  # "" already receives every mark
                    self._data.setsockopt(zmq.SUBSCRIBE, MARK_PREFIX + topic)
                self._subscribed.add(topic)
        if not confirm:
            return
        token = HELLO_PREFIX + secrets.token_hex(8).encode()
        self._data.setsockopt(zmq.SUBSCRIBE, token)
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._data.poll(int(left * 1000) + 1):
                    raise LagerClientError("forwarder did not confirm the subscription in time")
                try:
                    frames = recv_frames(self._data, _MAX_DATA_FRAMES)
                except zmq.Again:
                    continue
                if frames is not None and frames[0] == token:
                    if len(frames) == 2 and len(frames[1]) == 8:  # a bartender that marks
                        self._hello_epoch = int.from_bytes(frames[1], "big")
                    return
                if frames is not None:
                    self._take(frames)  # data that raced the hello is kept; marks counted
        finally:
            self._data.setsockopt(zmq.UNSUBSCRIBE, token)

    def _take(self, frames: list[bytes]) -> None:
        """Sort one forwarder message: data is queued and counted, a mark is accounted."""
        first = frames[0]
        if len(first) == 16:
            self._pending.append(frames)
            self.received += 1
            state = self._marks.get(first)
            if state is not None:
                state[2] += 1
            elif self._hello_epoch is not None:
                self._unmarked[first] = self._unmarked.get(first, 0) + 1
        elif first.startswith(MARK_PREFIX):
            self._mark(frames)
        # anything else (other mugs' hellos, foreign control topics) is not data

    def _mark(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[0]) != _MARK_TOPIC_BYTES or len(frames[1]) != 8:
            return
        raw_uuid = frames[0][len(MARK_PREFIX) :]
        count = int.from_bytes(frames[1], "big")
        epoch = int.from_bytes(frames[2], "big")
        state = self._marks.get(raw_uuid)
        if state is None and epoch == self._hello_epoch:
            # No mark before our hello reply: the tap had no rows then; count from zero.
            state = self._marks[raw_uuid] = [epoch, 0, self._unmarked.pop(raw_uuid, 0)]
        if state is None or state[0] != epoch or count < state[1]:
            # First mark (the baseline), or a restarted bartender counting from zero again.
            self._marks[raw_uuid] = [epoch, count, 0]
            self._unmarked.pop(raw_uuid, None)
            return
        missed = count - state[1] - state[2]
        state[1] = count
        state[2] = 0
        if missed > 0:
            reg = self.by_uuid.get(raw_uuid)
            key = reg.key if reg is not None else str(uuid_module.UUID(bytes=raw_uuid))
            self.lost += missed
            self.lost_by_tap[key] = self.lost_by_tap.get(key, 0) + missed
            if self.on_gap is not None:
                self.on_gap(key, missed)

    def recv_frames(self, max_messages: int = 4096, timeout: float = 0.0) -> list[list[bytes]]:
        """Up to ``max_messages`` data messages as raw frames (the fast path: no decoding),
        waiting up to ``timeout`` seconds for the first. Loss accounting is applied."""
        pending = self._pending
        if not pending:
            self._fill(max_messages)
            if not pending and timeout > 0:
                self.poll_registrar()
                if self._data.poll(max(int(timeout * 1000), 1)):
                    self._fill(max_messages)
        n = min(max_messages, len(pending))
        return [pending.popleft() for _ in range(n)]

    def _fill(self, limit: int) -> None:
        """Read what the data socket holds (up to ``limit`` messages), without blocking."""
        sock = self._data
        for _ in range(limit):
            try:
                frames = recv_frames(sock, _MAX_DATA_FRAMES)
            except zmq.Again:
                return
            if frames is not None:
                self._take(frames)

    def lookup(self, raw_uuid: bytes) -> Registration | None:
        """The registration for a data message's uuid. Updates and data travel on different
        connections, so a new tap's first row can overtake its update: read pending updates
        once before giving up."""
        reg = self.by_uuid.get(raw_uuid)
        if reg is None:
            self.poll_registrar()
            reg = self.by_uuid.get(raw_uuid)
        return reg

    def recv_message(self, timeout: float | None = None) -> DataMessage | None:
        """The next data message (undecoded), or None after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = self._pending
        while True:
            if not pending:
                self._fill(1024)
            while pending:
                frames = pending.popleft()
                if len(frames) < 5:
                    continue
                try:
                    return parse_data_message(frames)
                except ProtocolError:
                    continue
            self.poll_registrar()
            wait = 200.0 if deadline is None else min(200.0, (deadline - time.monotonic()) * 1000)
            if wait <= 0:
                return None
            self._poller.poll(max(int(wait), 1))

    def recv(self, timeout: float | None = None) -> Sample | None:
        """The next row decoded to typed values, or None after ``timeout`` seconds."""
        while True:
            msg = self.recv_message(timeout)
            if msg is None:
                return None
            reg = self.lookup(msg.uuid)
            if reg is None or len(msg.payload) != reg.format.row_size:
                continue  # a tap this mug has no (current) format for
            return Sample(reg.key, msg.uuid, msg.ts_ns, reg.format.decode_row(msg.payload))

    def recv_columns(
        self, max_rows: int = 100_000, timeout: float = 0.1
    ) -> dict[str, dict[str, np.ndarray[Any, Any]]]:
        """Drain up to ``max_rows`` rows and decode them per tap key as numpy columns
        (``timestamp_ns`` plus one array per item)."""
        rows: dict[bytes, tuple[list[int], list[bytes]]] = {}
        first = self.recv_message(timeout)
        msg = first
        n = 0
        while msg is not None and n < max_rows:
            if msg.uuid in self.by_uuid:
                ts, payloads = rows.setdefault(msg.uuid, ([], []))
                ts.append(msg.ts_ns)
                payloads.append(msg.payload)
                n += 1
            msg = self.recv_message(0)
        out: dict[str, dict[str, np.ndarray[Any, Any]]] = {}
        for raw_uuid, (ts, payloads) in rows.items():
            reg = self.by_uuid[raw_uuid]
            columns = {"timestamp_ns": np.array(ts, dtype=np.uint64)}
            columns.update(reg.format.decode_rows(payloads))
            out[reg.key] = columns
        return out

    def close(self) -> None:
        self._updates.close()
        self._data.close()

    def __enter__(self) -> Mug:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KegWriter:
    """A mug that records the chosen taps into one keg (``*.lgr``), in its own thread.

    ``start()`` synchronises, adds the formats (the sidecar is written before any record),
    subscribes and returns once the subscriptions are confirmed. ``stop()`` finishes the keg.
    Taps registered later under the subtree are added when ``follow`` is set.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        registrar: str,
        forwarder: str,
        subtree: str = "",
        taps: Iterable[str] | None = None,
        follow: bool = True,
        metadata: Mapping[str, str] | None = None,
        flush_interval_s: float = 0.1,
        fsync: bool = False,
    ) -> None:
        self.path = os.fspath(path)
        self.registrar = registrar
        self.forwarder = forwarder
        self.subtree = subtree
        self.keys = list(taps) if taps is not None else None
        self.follow = follow and taps is None
        self.metadata = dict(metadata or {})
        self.flush_interval_s = flush_interval_s
        self.fsync = fsync
        self.records = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mug: Mug | None = None
        self._file: KegFileWriter | None = None

    def start(self, timeout: float = 10.0) -> KegWriter:
        mug = self._mug = Mug(registrar=self.registrar, forwarder=self.forwarder)
        mug.sync(self.subtree, timeout)
        keys = self.keys if self.keys is not None else list(mug.taps)
        chosen = []
        for key in keys:
            reg = mug.taps.get(key)
            if reg is None:
                raise LagerClientError(f"tap {key!r} is not registered")
            chosen.append(reg)
        self._file = KegFileWriter(
            self.path,
            {reg.uuid_str: reg.format for reg in chosen},
            self.metadata,
            fsync=self.fsync,
        )
        if self.follow:
            mug.subscribe(everything=True, timeout=timeout)
        else:
            mug.subscribe(*chosen, timeout=timeout)
        self._thread = threading.Thread(target=self._run, name="taproom-keg-writer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        mug, keg = self._mug, self._file
        assert mug is not None and keg is not None
        next_flush = time.monotonic() + self.flush_interval_s
        try:
            while not self._stop.is_set():
                msg = mug.recv_message(timeout=0.05)
                while msg is not None:
                    reg = mug.lookup(msg.uuid)
                    if reg is not None and len(msg.payload) == reg.format.row_size:
                        if not keg.has(msg.uuid):
                            keg.add_format(reg.uuid_str, reg.format)
                        keg.write(msg.uuid, msg.ts_ns, msg.payload)
                        self.records += 1
                    if time.monotonic() >= next_flush:
                        break
                    msg = mug.recv_message(timeout=0)
                if time.monotonic() >= next_flush:
                    keg.flush()
                    next_flush = time.monotonic() + self.flush_interval_s
        except BaseException as exc:  # reported by stop(); the keg stays recoverable
            self.error = exc

    def stop(self) -> KegContents | None:
        """Finish the keg (append formats, patch the header). Returns nothing on error."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._file is not None:
            self._file.close()
        if self._mug is not None:
            self._mug.close()
        if self.error is not None:
            raise LagerClientError(f"keg writer failed: {self.error}")
        return None


# --- taproom keg ----------------------------------------------------------------------------


def _flat_columns(fmt: DataFormat, columns: Mapping[str, np.ndarray[Any, Any]]) -> dict[str, Any]:
    """Arrays become ``name[i]`` columns so CSV and Parquet get one scalar per cell."""
    out: dict[str, Any] = {}
    for name, column in columns.items():
        if column.ndim == 2:
            for i in range(column.shape[1]):
                out[f"{name}[{i}]"] = column[:, i]
        else:
            out[name] = column
    return out


def _cmd_dump(args: argparse.Namespace) -> int:
    keg = read_keg(args.file)
    print(f"# keg {args.file}: version {keg.version}, {keg.record_count} records, "
          f"{len(keg.formats)} taps" + (", recovered unfinished" if keg.recovered_unfinished else ""))  # fmt: skip
    for key, value in keg.metadata.items():
        print(f"# meta {key} = {value}")
    for text, fmt in keg.formats.items():
        print(f"# tap {text}: {', '.join(f'{i.name}:{i.type.name}' for i in fmt.items)}")
    for n, (text, ts, row) in enumerate(keg.rows()):
        if args.limit is not None and n >= args.limit:
            break
        print(text, ts, " ".join(f"{k}={v}" for k, v in row.items()))
    if keg.dropped_bytes:
        print(f"# dropped {keg.dropped_bytes} bytes at the end: {keg.problem}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        keg = read_keg(args.file)
    except (KegError, OSError) as exc:
        print(f"{args.file}: unreadable: {exc}")
        return 2
    status = "finished" if not keg.recovered_unfinished else "unfinished (recovered from sidecar)"
    print(f"{args.file}: {status}; {keg.record_count} records; {len(keg.formats)} taps")
    for text, count in sorted(keg.counts().items()):
        print(f"  {text}: {count}")
    if keg.dropped_bytes:
        print(f"  dropped {keg.dropped_bytes} bytes: {keg.problem}")
    return 0 if not keg.recovered_unfinished and not keg.dropped_bytes else 1


def _cmd_convert(args: argparse.Namespace) -> int:
    keg = read_keg(args.file)
    stem = args.output or os.path.splitext(args.file)[0]
    single = len(keg.formats) == 1
    written = []
    for text, fmt in keg.formats.items():
        columns = _flat_columns(fmt, keg.table(text))
        path = f"{stem}.{args.to}" if single else f"{stem}.{text}.{args.to}"
        if args.to == "csv":
            names = list(columns)
            with open(path, "w", newline="", encoding="utf-8") as f:
                writer = csv.writer(f)
                writer.writerow(names)
                writer.writerows(zip(*(columns[n].tolist() for n in names), strict=True))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            arrow = pa.table({name: pa.array(col) for name, col in columns.items()})
            pq.write_table(
                arrow.replace_schema_metadata({"lager_uuid": text, "lager_xml": fmt.to_xml()}),
                path,
            )
        written.append(path)
    for path in written:
        print(path)
    return 0


def _cmd_record(args: argparse.Namespace) -> int:
    writer = KegWriter(
        args.file,
        registrar=args.registrar,
        forwarder=args.forwarder,
        subtree=args.subtree,
        taps=args.tap or None,
        metadata=dict(m.split("=", 1) for m in args.meta),
        flush_interval_s=args.flush_interval,
    )
    writer.start(args.timeout)
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, args.ready_file)
    stop = threading.Event()
    with contextlib.suppress(KeyboardInterrupt):
        import signal

        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        deadline = None if args.duration is None else time.monotonic() + args.duration
        while not stop.wait(0.2):
            if deadline is not None and time.monotonic() >= deadline:
                break
    writer.stop()
    print(f"{args.file}: {writer.records} records", file=sys.stderr)
    return 0


def register_commands(subparsers: Any) -> None:
    keg = subparsers.add_parser("keg", help="Lager kegs (*.lgr): dump, verify, convert, record")
    sub = keg.add_subparsers(dest="keg_command", required=True)
    p = sub.add_parser("dump", help="print formats, metadata and rows")
    p.add_argument("file")
    p.add_argument("--limit", type=int, default=None, help="at most N rows")
    p.set_defaults(func=_cmd_dump)
    p = sub.add_parser("verify", help="exit 0 finished and whole, 1 recovered/torn, 2 unreadable")
    p.add_argument("file")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("convert", help="write CSV or Parquet (one file per tap)")
    p.add_argument("file")
    p.add_argument("--to", choices=("csv", "parquet"), required=True)
    p.add_argument("--output", default=None, help="output path stem (default: FILE minus .lgr)")
    p.set_defaults(func=_cmd_convert)
    p = sub.add_parser("record", help="record taps from a bartender until SIGTERM")
    p.add_argument("file")
    p.add_argument("--registrar", default="127.0.0.1:12345", help="host:P (snapshot port)")
    p.add_argument("--forwarder", default="127.0.0.1:12348", help="host:P (tap side port)")
    p.add_argument("--subtree", default="")
    p.add_argument("--tap", action="append", default=[], help="tap key (default: all, follow)")
    p.add_argument("--meta", action="append", default=[], help="KEY=VALUE metadata")
    p.add_argument("--flush-interval", type=float, default=0.1, help="seconds")
    p.add_argument("--duration", type=float, default=None, help="seconds, then finish")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--ready-file", default=None, help="written once recording")
    p.set_defaults(func=_cmd_record)
