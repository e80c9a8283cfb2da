"""The Lager :class:`Mug`: synchronises the tap list, watches updates and HUGZ, subscribes to
taps and decodes their rows.

Synchronous and single-threaded: a Mug owns its ZeroMQ sockets and must be used from one
thread. ``Mug.recv`` polls the registrar updates and the data socket together, so HUGZ and
updates are processed while data flows.

Which forwarder output: a taproom bartender has a *counted* output at F+2 (data, loss marks,
hello replies in one pipe); nasa/lager's has only F+1 (data). The Mug connects to F+2 and, at
its first ``subscribe``, waits up to ``fallback_s`` for the ZeroMQ handshake there: if it
comes, the mug is :attr:`Mug.counted`; if not (a real bartender: nothing listens at F+2), it
moves to F+1 and behaves as nasa/lager's Mug does: no hello, no marks, and ``subscribe`` waits
``join_wait_s`` for its subscriptions to reach the forwarder (the PUB slow joiner: rows sent
before that are lost, as with nasa/lager itself).

No lost first samples on the bartender -> mug hop (counted output): ``Mug.subscribe``
subscribes to the chosen taps and then to a unique "hello" topic; the forwarder echoes the
hello, and because one ZeroMQ pipe applies subscriptions in order, every data subscription is
in place when the hello arrives. ``subscribe`` returns only then. Start logging after that and
no sample is lost.

Counted loss: a mug that falls behind loses rows inside ZeroMQ (its HWM), silently. A taproom
bartender publishes per-tap marks (cumulative rows forwarded, see ``servers/lager``) in the
same pipe as the rows; the Mug subscribes to the marks of its taps and, at each mark, compares
the rows it received since the previous mark with the bartender's count. The difference is
added to ``Mug.lost`` / ``Mug.lost_by_tap`` and reported through ``on_gap(key, missed)``.
Every row after ``subscribe()`` returns is accounted for: received, or counted as lost.
"""

from __future__ import annotations

import secrets
import time
import uuid as uuid_module
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from ... import zmqburst
from ...errors import ProtocolError
from ...protocols.lager.chp import Command, Registration, parse_update, snapshot_request_frames
from ...protocols.lager.messages import DataMessage, parse_data_message
from ...zmqaccess import Curve, curve_client
from ...zmqframes import recv_frames
from .common import HELLO_PREFIX, MARK_PREFIX, LagerClientError, base, forwarder_base, tcp

__all__ = ["Mug", "Rows", "Sample"]

_MARK_TOPIC_BYTES = len(MARK_PREFIX) + 16
_MAX_DATA_FRAMES = 1028  # 4 + one frame per item; bounded like the bartender's input
# One compiled burst read: at most this many messages and bytes (the reader's buffers).
_BURST_MESSAGES = 8192
_BURST_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class Sample:
    """One decoded row."""

    key: str
    uuid: bytes
    ts_ns: int
    values: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Rows:
    """Consecutive rows of one tap as received (:meth:`Mug.recv_rows`): ``payload`` holds
    ``len(ts_ns)`` rows of ``row_size`` bytes back to back, network order, each the message's
    payload frames joined (what ``DataFormat.decode_buffer`` reads). ``key`` is the tap's
    key, or None for a uuid this mug has no registration for."""

    key: str | None
    uuid: bytes
    ts_ns: np.ndarray[Any, Any]  # uint64
    payload: bytes
    row_size: int

    def __len__(self) -> int:
        return len(self.ts_ns)


class _Block:
    """Consecutive data messages of one uuid and one frame layout, out of a compiled burst, in
    one bytes object: message i is ``data[i * stride : (i + 1) * stride]`` and its frames are
    cut at ``layout`` (offsets in a message, 0 first). Rows ``start..stop`` are not taken yet.
    Only messages that ``parse_data_message`` accepts are blocked (see ``_classify``)."""

    __slots__ = ("data", "layout", "start", "stop", "stride", "uuid")

    def __init__(self, uuid: bytes, data: bytes, stride: int, layout: tuple[int, ...]) -> None:
        self.uuid, self.data, self.stride, self.layout = uuid, data, stride, layout
        self.start, self.stop = 0, len(data) // stride

    def frames(self, i: int) -> list[bytes]:
        base, data = i * self.stride, self.data
        return [data[base + a : base + b] for a, b in pairwise(self.layout)]

    def take(self, k: int) -> tuple[np.ndarray[Any, Any], bytes]:
        """The next ``k`` rows' timestamps (uint64) and payloads (back to back), taken."""
        start, stop = self.start, self.start + k
        self.start = stop
        ts_at, payload_at, stride = self.layout[3], self.layout[4], self.stride
        size = stride - payload_at
        names, formats, offsets = ["ts"], [">u8"], [ts_at]
        if size:
            names.append("p")
            formats.append(f"V{size}")
            offsets.append(payload_at)
        dtype = np.dtype(
            {"names": names, "formats": formats, "offsets": offsets, "itemsize": stride}
        )
        table = np.frombuffer(self.data, dtype, count=stop - start, offset=start * stride)
        payload = table["p"].tobytes() if size else b""
        return table["ts"].astype(np.uint64), payload


class Mug:
    """A Lager data sink: synchronise the tap list, watch updates and HUGZ, subscribe, decode.

    ``on_silence()`` is called once when no HUGZ or update arrived for ``silence_s``;
    ``on_update(registration)`` for every hashmap change after :meth:`sync`;
    ``on_gap(key, missed)`` when a mark shows rows of a tap that this mug did not receive
    (``key`` is the tap key, or the uuid string for a tap not in :attr:`taps`). ``lost`` and
    ``lost_by_tap`` keep the totals; ``received`` counts data messages read.

    ``forwarder`` is the forwarder's base ``host:F`` (default: the registrar's port + 10, as in
    nasa/lager); see the module docstring for ``fallback_s`` and ``join_wait_s``.
    """

    def __init__(
        self,
        *,
        registrar: str,
        forwarder: str | None = None,
        fallback_s: float = 1.0,
        join_wait_s: float = 0.5,
        silence_s: float = 3.0,
        recv_hwm: int = 1_000_000,
        recv_buffer_bytes: int = 0,
        on_silence: Callable[[], None] | None = None,
        on_update: Callable[[Registration], None] | None = None,
        on_gap: Callable[[str, int], None] | None = None,
        context: zmq.Context[Any] | None = None,
        curve: Curve | None = None,
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
        # Data messages read and accounted for, not yet returned: one message's frames, or a
        # _Block of many (the compiled path).
        self._pending: deque[list[bytes] | _Block] = deque()
        self._hello_token: bytes | None = None
        self._hello_seen = False
        self._reg_host, self._reg_port = base(registrar)
        self._fwd_host, self._fwd_port = forwarder_base(registrar, forwarder)
        self.fallback_s = fallback_s
        self.join_wait_s = join_wait_s
        # None until the first subscribe() finds out which bartender this is.
        self.counted: bool | None = None
        self._ctx = context or zmq.Context.instance()
        self._curve = curve
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
        self._updates = self._socket(zmq.SUB)
        self._updates.setsockopt(zmq.LINGER, 0)
        self._data = self._socket(zmq.SUB)
        self._data.setsockopt(zmq.LINGER, 0)
        self._data.setsockopt(zmq.RCVHWM, recv_hwm)
        if recv_buffer_bytes:  # the kernel's receive buffer (ZMQ_RCVBUF; 0: the OS default)
            self._data.setsockopt(zmq.RCVBUF, recv_buffer_bytes)
        self._handshakes: zmq.Socket[bytes] | None = self._data.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        )
        self._data.connect(self._counted_address)
        # zmqburst's compiled reader when selected: every ready message in one C call, sorted
        # with numpy a burst at a time (~0.7 us a row against ~8 for pyzmq's per-frame
        # receives); None: the pure-Python twin, message by message.
        # The module's ffi is kept with it: a later zmqburst.select("py") (tests switch paths)
        # changes what new readers take, never this one's bursts.
        self._ffi, _lib = zmqburst.ffi_lib()
        self._reader = (
            zmqburst.reader(self._data, _MAX_DATA_FRAMES) if self._ffi is not None else None
        )
        self._poller = zmq.Poller()
        self._poller.register(self._updates, zmq.POLLIN)
        self._poller.register(self._data, zmq.POLLIN)
        self._subscribed: set[bytes] = set()

    # --- registration flow ----------------------------------------------------------------

    def _socket(self, kind: int) -> zmq.Socket[bytes]:
        """A socket of our context, a CURVE client when the bartender wants one."""
        sock: zmq.Socket[bytes] = self._ctx.socket(kind)
        if self._curve is not None:
            curve_client(sock, *self._curve)
        return sock

    def sync(self, subtree: str = "", timeout: float = 10.0) -> dict[str, Registration]:
        """Snapshot of the taps under ``subtree`` (CHP: subscribe to updates first, then
        ``ICANHAZ?``; updates older than the snapshot are ignored)."""
        self.subtree = subtree
        self._updates.setsockopt(zmq.SUBSCRIBE, subtree.encode("utf-8"))
        self._updates.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        self._updates.connect(tcp(self._reg_host, self._reg_port + 1))
        dealer = self._socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(tcp(self._reg_host, self._reg_port))
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

    @property
    def _counted_address(self) -> str:
        return tcp(self._fwd_host, self._fwd_port + 2)

    def _choose_output(self, wait_s: float) -> None:
        """taproom's counted output if a ZeroMQ peer answers there within ``wait_s``, else
        nasa/lager's data output (see the module docstring)."""
        monitor = self._handshakes
        assert monitor is not None
        counted = False
        deadline = time.monotonic() + wait_s
        while not counted:
            left = deadline - time.monotonic()
            if not monitor.poll(max(int(left * 1000), 0)):
                break
            event = recv_monitor_message(monitor)
            counted = event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
        self._data.disable_monitor()
        monitor.close(linger=0)
        self._handshakes = None
        self.counted = counted
        if not counted:
            self._data.disconnect(self._counted_address)
            self._data.connect(tcp(self._fwd_host, self._fwd_port + 1))

    def subscribe(self, *taps: str | bytes | Registration, everything: bool = False,
                  timeout: float = 10.0, confirm: bool = True) -> None:  # fmt: skip
        """Subscribe to taps (keys, uuids or registrations; ``everything`` for all) and
        return once the bartender has the subscriptions (see the module docstring).
        ``confirm=False`` returns at once (no hello, no join wait; at the first call the
        counted output is used only if its handshake is already done)."""
        if self.counted is None:
            self._choose_output(self.fallback_s if confirm else 0.0)
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
                if topic and self.counted:  # "" already receives every mark
                    self._data.setsockopt(zmq.SUBSCRIBE, MARK_PREFIX + topic)
                self._subscribed.add(topic)
        if not confirm:
            return
        if not self.counted:
            time.sleep(self.join_wait_s)  # nasa/lager's forwarder has no handshake to offer
            return
        token = HELLO_PREFIX + secrets.token_hex(8).encode()
        self._data.setsockopt(zmq.SUBSCRIBE, token)
        deadline = time.monotonic() + timeout
        # Read until the hello comes back: data that raced it is kept, marks counted, and
        # what follows it in the same read is taken after it, in order (_take).
        self._hello_token, self._hello_seen = token, False
        try:
            while not self._hello_seen:
                left = deadline - time.monotonic()
                if left <= 0 or not self._data.poll(int(left * 1000) + 1):
                    raise LagerClientError("forwarder did not confirm the subscription in time")
                self._fill(_BURST_MESSAGES, until_hello=True)
        finally:
            self._hello_token = None
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
        elif first == self._hello_token and not self._hello_seen:
            self._hello_seen = True
            if len(frames) == 2 and len(frames[1]) == 8:  # a bartender that marks
                self._hello_epoch = int.from_bytes(frames[1], "big")
        # anything else (other mugs' hellos, foreign control topics) is not data

    def _take_block(self, block: _Block) -> None:
        """``_take`` of a block's messages (one uuid): queued and counted at once."""
        n = block.stop - block.start
        self._pending.append(block)
        self.received += n
        first = block.uuid
        state = self._marks.get(first)
        if state is not None:
            state[2] += n
        elif self._hello_epoch is not None:
            self._unmarked[first] = self._unmarked.get(first, 0) + n

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

    def _wait_pending(self, limit: int, timeout: float) -> None:
        """With nothing pending: read up to ``limit`` messages, waiting up to ``timeout``
        seconds for the first (the registrar's updates are read meanwhile)."""
        if not self._pending:
            self._fill(limit)
            if not self._pending and timeout > 0:
                self.poll_registrar()
                if self._data.poll(max(int(timeout * 1000), 1)):
                    self._fill(limit)

    def recv_frames(self, max_messages: int = 4096, timeout: float = 0.0) -> list[list[bytes]]:
        """Up to ``max_messages`` data messages as raw frames (the fast path: no decoding),
        waiting up to ``timeout`` seconds for the first. Loss accounting is applied."""
        pending = self._pending
        self._wait_pending(max_messages, timeout)
        out: list[list[bytes]] = []
        while pending and len(out) < max_messages:
            item = pending[0]
            if isinstance(item, list):
                pending.popleft()
                out.append(item)
                continue
            stop = min(item.stop, item.start + max_messages - len(out))
            out += map(item.frames, range(item.start, stop))
            item.start = stop
            if item.start == item.stop:
                pending.popleft()
        return out

    def recv_rows(self, max_rows: int = 65536, timeout: float = 0.0) -> list[Rows]:
        """Up to ``max_rows`` data rows, waiting up to ``timeout`` seconds for the first, as
        :class:`Rows`: each a run of consecutive rows of one tap with one row size, in the
        order received (the fast path: a few Python objects a run, not a row). Messages
        ``recv_message`` would skip (bad framing) are skipped; loss accounting is applied."""
        pending = self._pending
        self._wait_pending(max_rows, timeout)
        runs: list[tuple[bytes, int, list[np.ndarray[Any, Any]], list[bytes]]] = []
        taken = 0
        while pending and taken < max_rows:
            item = pending[0]
            if isinstance(item, list):
                pending.popleft()
                taken += 1
                if len(item) < 5:
                    continue
                try:
                    msg = parse_data_message(item)
                except ProtocolError:
                    continue
                raw_uuid, payload = msg.uuid, msg.payload
                ts = np.array([msg.ts_ns], np.uint64)
            else:
                k = min(item.stop - item.start, max_rows - taken)
                taken += k
                ts, payload = item.take(k)
                raw_uuid = item.uuid
                if item.start == item.stop:
                    pending.popleft()
            size = len(payload) // len(ts)
            if runs and runs[-1][0] == raw_uuid and runs[-1][1] == size:
                runs[-1][2].append(ts)
                runs[-1][3].append(payload)
            else:
                runs.append((raw_uuid, size, [ts], [payload]))
        out = []
        for raw_uuid, size, ts_parts, payloads in runs:
            reg = self.lookup(raw_uuid)
            out.append(
                Rows(
                    reg.key if reg is not None else None,
                    raw_uuid,
                    ts_parts[0] if len(ts_parts) == 1 else np.concatenate(ts_parts),
                    payloads[0] if len(payloads) == 1 else b"".join(payloads),
                    size,
                )
            )
        return out

    def _fill(self, limit: int, until_hello: bool = False) -> None:
        """Read what the data socket holds (up to ``limit`` messages), without blocking;
        with ``until_hello``, stop after the read that brought the awaited hello."""
        if self._reader is not None:
            self._fill_bursts(self._reader, limit, until_hello)
            return
        sock = self._data
        for _ in range(limit):
            try:
                frames = recv_frames(sock, _MAX_DATA_FRAMES)
            except zmq.Again:
                return
            if frames is not None:
                self._take(frames)
                if until_hello and self._hello_seen:
                    return

    def _fill_bursts(self, reader: zmqburst.Reader, limit: int, until_hello: bool) -> None:
        while limit > 0:
            burst = reader.recv(min(limit, _BURST_MESSAGES), _BURST_BYTES)
            if not burst.n:
                return
            limit -= burst.n
            self._classify(burst)
            if until_hello and self._hello_seen:
                return

    def _classify(self, burst: Any) -> None:
        """Sort a compiled burst as ``_take`` sorts messages one at a time, in order, but with
        numpy over the burst's frame table: runs of data messages of one uuid and one frame
        layout become one :class:`_Block` each (counted at once); any other message (marks,
        hellos, a message ``parse_data_message`` refuses) goes through ``_take`` alone."""
        ffi = self._ffi
        n, frames_kept = burst.n, burst.frames_kept
        counts = np.frombuffer(ffi.buffer(burst.counts_c, 4 * n), np.int32).astype(np.int64)
        ends = np.zeros(frames_kept + 1, np.int64)
        ends[1:] = np.frombuffer(ffi.buffer(burst.frame_end, 8 * frames_kept), np.uint64)
        buf = ffi.buffer(burst.buf, burst.size)
        lengths = ends[1:] - ends[:-1]
        kept = np.minimum(counts, _MAX_DATA_FRAMES)
        first = np.zeros(n + 1, np.int64)  # each message's first frame in the burst
        np.cumsum(kept, out=first[1:])
        last = len(lengths) - 1

        def frame_len(j: int) -> np.ndarray[Any, Any]:
            return lengths[np.minimum(first[:-1] + j, last)]

        # What parse_data_message accepts (5..1028 frames, uuid 16, version 1..8, flags 1..2,
        # timestamp 8); a message of more than 1028 frames is dropped (recv_frames' None).
        version, flags = frame_len(1), frame_len(2)
        valid = (
            (counts >= 5)
            & (counts <= _MAX_DATA_FRAMES)
            & (frame_len(0) == 16)
            & (version >= 1)
            & (version <= 8)
            & ((flags == 1) | (flags == 2))
            & (frame_len(3) == 8)
        )
        same = np.zeros(n, bool)
        if n > 1:
            # A message joins the run of the one before when both are valid rows with the same
            # frame lengths. Lengths are compared for the burst's most common frame count k (a
            # row's framing; marks between runs have 3): a message of another count starts a
            # run of its own (correct, only slower for mixed framings). Column by column: numpy
            # is slow at reducing many short rows (~10x).
            k = int(np.bincount(np.where(valid, counts, 0)).argmax())
            at = np.flatnonzero(valid & (counts == k))
            firsts = first[at]
            join = at[1:] == at[:-1] + 1
            if k <= 64:
                for j in range(k):
                    column = lengths[firsts + j]
                    join &= column[1:] == column[:-1]
            else:
                table = lengths[firsts[:, None] + np.arange(k)].view(f"V{8 * k}").ravel()
                join &= table[1:] == table[:-1]
            same[at[1:]] = join
        heads = np.flatnonzero(~same)
        # Per run (heads to the next head), its first frame and where its first message ends.
        run_first = first[heads].tolist()
        run_next = first[heads + 1].tolist()
        run_ends = np.append(heads[1:], n).tolist()
        run_valid = valid[heads].tolist()
        run_count = counts[heads].tolist()
        for s, e, f0, f1, ok, count in zip(
            heads.tolist(), run_ends, run_first, run_next, run_valid, run_count, strict=True
        ):
            cuts = ends[f0 : f1 + 1].tolist()
            a = cuts[0]
            if not ok:
                if count <= _MAX_DATA_FRAMES:
                    self._take([buf[x:y] for x, y in pairwise(cuts)])
                continue
            stride = cuts[-1] - a
            layout = tuple(x - a for x in cuts)
            # A run of one layout has a fixed stride: its uuids are read in place (two u64 a
            # row, unaligned) and the run is split where the uuid changes.
            splits = [0, e - s]
            if e - s > 1:
                uuids = np.ndarray((e - s, 2), np.uint64, buf, a, (stride, 8))
                change = (uuids[1:, 0] != uuids[:-1, 0]) | (uuids[1:, 1] != uuids[:-1, 1])
                splits[1:1] = (np.flatnonzero(change) + 1).tolist()
            for p, q in pairwise(splits):
                at_p = a + p * stride
                self._take_block(_Block(buf[at_p : at_p + 16],
                                        buf[at_p : a + q * stride], stride, layout))  # fmt: skip

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
                item = pending[0]
                if isinstance(item, list):
                    pending.popleft()
                    frames = item
                else:
                    frames = item.frames(item.start)
                    item.start += 1
                    if item.start == item.stop:
                        pending.popleft()
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
        if self._handshakes is not None:
            self._data.disable_monitor()
            self._handshakes.close(linger=0)
        self._updates.close()
        self._data.close()

    def __enter__(self) -> Mug:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
