"""The Bartender's forwarder: tap data in, validated, committed, then out to mugs.

Taps publish data messages to a SUB socket at F (subscribed to everything, so nasa/lager PUB
taps and taproom's XPUB taps both work); mugs subscribe by tap uuid at an XPUB at F+1. Each
message is checked against its tap's registered format, committed (content type ``lager``,
stream = tap key, producer = tap uuid, ts_ns = the message timestamp, payload = the row) and
only then forwarded (DESIGN.md decision 4). The forwarder also answers "hello" subscriptions
(``HELLO_PREFIX``) with one frame, so a mug knows its subscriptions reached the bartender
before it asks a tap to start (no lost first samples).

Counted loss (``MARK_PREFIX``): ZeroMQ drops silently for a mug that falls behind its HWM.
After each forwarded batch (of at most 256 distinct taps; else at the next HUGZ round) the
forwarder publishes, per tap in it, a mark ``[MARK_PREFIX + uuid, u64 rows of that tap
forwarded so far, u64 epoch of this process]`` on the same XPUB, so marks travel the mug's pipe
in order with the rows. A mug subscribed to a tap's marks counts the rows it got between two
marks and knows exactly how many it lost (marks themselves may be dropped: the counts are
cumulative). Before each hello reply the forwarder sends the marks of every tap with rows so
far (the mug's baseline; a tap without a mark then had none) and the reply carries the epoch.
Marks are repeated once a ``hugz_interval_s`` for taps active in the last ``mark_repeat``
rounds.

Hot path (issue 7): data frames are read as ZeroMQ frames (their ``more`` flag is far cheaper
than ``getsockopt(RCVMORE)`` in pyzmq), journal records are written directly with
:data:`~taproom.records.RECORD_HEAD` from per-tap constant parts (:class:`DataRecords`, proven
byte-identical to ``BatchBuilder`` by a test), and rows are forwarded as the received frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import struct
import time
import uuid as uuid_module
from collections import Counter
from collections.abc import Awaitable, Callable
from operator import itemgetter
from typing import Any

import orjson
import zmq
import zmq.asyncio

from ...errors import HubStopped, ProtocolError
from ...hub import Hub
from ...protocols.lager.chp import Registrar
from ...protocols.lager.messages import MESSAGE_VERSION, parse_data_message
from ...records import MAX_PAYLOAD_BYTES, RECORD_HEAD, RECORD_HEAD_AFTER_LEN, EncodedBatch
from ...zmqframes import recv_frames
from .config import LagerConfig
from .sockets import MORE_NOBLOCK, NOBLOCK, bind_range, raw_send, readable

__all__ = ["DATA_CONTENT_TYPE", "HELLO_PREFIX", "MARK_PREFIX", "DataRecords", "Forwarder"]

log = logging.getLogger("taproom.lager")

# A mug subscribes to HELLO_PREFIX + a random token after its data subscriptions; the forwarder
# publishes that topic back once. ZeroMQ applies one pipe's subscriptions in order, so when the
# hello arrives every earlier subscription is in place. The NUL first byte keeps it out of any
# uuid prefix a real mug subscribes to.
HELLO_PREFIX = b"\x00taproom-lager-hello/"
# Loss accounting marks: topic MARK_PREFIX + tap uuid, then a u64 count (see the docstring).
MARK_PREFIX = b"\x00taproom-lager-mark/"
_BATCH_MARKS = 256  # taps per batch marked right after it; more wait for the HUGZ round
DATA_CONTENT_TYPE = "lager"


# The record head split around ts_ns: [length, received_ns] | ts_ns | [seq, field lengths].
_PREFIX = struct.Struct("<Iq")
_TAIL = struct.Struct("<" + RECORD_HEAD.format[4:])
assert _PREFIX.size + 8 + _TAIL.size == RECORD_HEAD.size
_PROTOCOL = b"lager"


class DataRecords:
    """The constant parts of one tap's data records (per message version and flags).

    A data record differs from the next one of the same tap only in ``ts_ns`` and the payload
    (and ``received_ns`` per batch), so the head after ``ts_ns`` and the fixed fields are packed
    once; :meth:`parts` then yields a record as four byte strings for the batch body. The
    result is byte-identical to ``BatchBuilder.add`` (tests/servers/test_lager_fastpath.py).
    """

    __slots__ = ("length", "prefix", "received_ns", "row_size", "tail")

    def __init__(self, key: str, uuid_text: str, attrs: bytes, row_size: int) -> None:
        content = DATA_CONTENT_TYPE.encode()
        stream = key.encode("utf-8", "surrogateescape")
        producer = uuid_text.encode()
        if len(stream) > 65535 or row_size > MAX_PAYLOAD_BYTES:
            raise ValueError("tap key or row size over the record's limits")
        fixed = _PROTOCOL + content + stream + producer + attrs  # topic, event_id: empty
        self.row_size = row_size
        self.length = RECORD_HEAD_AFTER_LEN + len(fixed) + row_size
        self.tail = (
            _TAIL.pack(0, len(_PROTOCOL), len(content), len(stream), 0, len(producer), 0,
                       len(attrs), row_size)
            + fixed
        )  # fmt: skip
        self.received_ns = -1
        self.prefix = b""

    def parts(self, received_ns: int, ts_be: bytes, payload: bytes) -> tuple[bytes, ...]:
        """One record: ``ts_be`` is the seed's big-endian u64 (below 2^63), ``payload`` one
        row of ``row_size`` bytes (both checked by the caller)."""
        if received_ns != self.received_ns:
            self.prefix = _PREFIX.pack(self.length, received_ns)
            self.received_ns = received_ns
        return (self.prefix, ts_be[::-1], self.tail, payload)


def _data_attrs(version: bytes, flags: bytes) -> bytes:
    return orjson.dumps({"version": version.hex(), "flags": str(int.from_bytes(flags, "big"))})


class Forwarder:
    """The forwarder's sockets and loops. ``registrar`` is the live hashmap (read only here)."""

    def __init__(
        self,
        hub: Hub,
        config: LagerConfig,
        registrar: Callable[[], Registrar],
        reject: Callable[[str, str], None],
    ) -> None:
        self.hub = hub
        self.config = config
        self._registrar = registrar
        self._reject = reject
        self.closing = False
        self.inflight: set[asyncio.Future[Any]] = set()
        # uuid + flags + version -> DataRecords; cleared whenever the hashmap changes.
        self._records: dict[bytes, DataRecords] = {}
        self._forwarded_by_tap: dict[bytes, int] = {}  # uuid -> rows forwarded (marks)
        self._mark_rounds: dict[bytes, int] = {}  # uuid -> HUGZ rounds left to repeat its mark
        # Counts restart at zero with the process: the epoch tells a mug to take a new baseline.
        self._epoch = time.time_ns().to_bytes(8, "big")
        self._uuid_text: dict[bytes, str] = {}
        self._m_forwarded = hub.metrics.counter(
            "lager", "forwarded", "rows", "Data rows sent to mugs"
        )

    @property
    def registrar(self) -> Registrar:
        return self._registrar()

    def open(self, ctx: zmq.asyncio.Context) -> None:
        cfg = self.config
        self.fwd_in = ctx.socket(zmq.SUB)
        self.fwd_out = ctx.socket(zmq.XPUB)
        for sock in self.sockets:
            sock.setsockopt(zmq.LINGER, 0)
        self.fwd_in.setsockopt(zmq.MAXMSGSIZE, cfg.max_payload_bytes)
        self.fwd_in.setsockopt(zmq.RCVHWM, cfg.input_hwm)
        self.fwd_in.setsockopt(zmq.SUBSCRIBE, b"")
        self.fwd_out.setsockopt(zmq.SNDHWM, cfg.forward_hwm)
        self.fwd_out.setsockopt(zmq.MAXMSGSIZE, cfg.max_key_bytes + 64)

    @property
    def sockets(self) -> tuple[zmq.asyncio.Socket, ...]:
        return (self.fwd_in, self.fwd_out)

    def bind(self) -> dict[str, str]:
        cfg = self.config
        base = bind_range(list(self.sockets), cfg.host, cfg.forwarder_port, cfg.port_retries)
        self._fwd_in_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.fwd_in.underlying)
        self._fwd_out_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.fwd_out.underlying)
        return {
            "lager_forwarder_in": f"{cfg.host}:{base}",
            "lager_forwarder_out": f"{cfg.host}:{base + 1}",
        }

    @property
    def loops(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        return (self._data_loop, self._hello_loop)

    def formats_changed(self) -> None:
        """A registration changed the hashmap: a tap's format may be different now."""
        self._records.clear()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close(linger=0)

    def _uuid_str(self, raw: bytes) -> str:
        text = self._uuid_text.get(raw)
        if text is None:
            text = self._uuid_text[raw] = str(uuid_module.UUID(bytes=raw))
        return text

    def repeat_marks(self) -> None:
        """At a HUGZ round: marks again for the taps active in the last ``mark_repeat``."""
        rounds = self._mark_rounds
        for raw_uuid, left in list(rounds.items()):
            self._send_mark(raw_uuid)
            if left <= 1:
                del rounds[raw_uuid]
            else:
                rounds[raw_uuid] = left - 1

    async def _data_loop(self) -> None:
        cfg = self.config
        raw = self._fwd_in_raw
        hub = self.hub
        max_frames = cfg.max_message_frames
        max_batch = cfg.max_batch_messages
        records = self._records
        recv = recv_frames
        while True:
            await hub.wait_capacity()
            if not readable(raw):
                await self.fwd_in.poll(timeout=1000)
            received_ns = time.time_ns()  # one receive time per batch, as BatchBuilder does
            parts: list[bytes] = []
            forwards: list[list[bytes]] = []
            for _ in range(max_batch):
                try:
                    frames = recv(raw, max_frames)
                except zmq.Again:
                    break
                if frames is None:
                    self._reject("frame_count", f"data message over {max_frames} frames")
                    continue
                if (
                    len(frames) == 5
                    and len(frames[0]) == 16
                    and len(frames[1]) == 2
                    and len(frames[2]) == 2
                    and len(frames[3]) == 8
                    and frames[3][0] < 0x80
                ):
                    # The seed's framing: checked inline, forwarded as received.
                    raw_uuid, version, flags, ts, payload = frames
                    forward = frames
                else:
                    try:
                        msg = parse_data_message(frames, max_frames=max_frames)
                    except ProtocolError as exc:
                        self._reject(exc.reason, str(exc))
                        continue
                    raw_uuid, payload, version = msg.uuid, msg.payload, msg.version
                    flags = msg.flags.to_bytes(2, "big")
                    ts = msg.ts_ns.to_bytes(8, "big")  # parse_data_message refused >= 2^63
                    # nasa/lager framing (version string, 1-byte flags, a frame per item):
                    # forwarded in the seed's 5-frame form.
                    forward = [raw_uuid, MESSAGE_VERSION, flags, frames[3], payload]
                tap = records.get(raw_uuid + flags + version)
                if tap is None:
                    tap = self._tap_records(raw_uuid, version, flags)
                    if tap is None:
                        continue
                if len(payload) != tap.row_size:
                    reg = self.registrar.by_uuid[raw_uuid]
                    self._reject(
                        "payload_size",
                        f"{reg.key}: row of {len(payload)} bytes, format has {tap.row_size}",
                    )
                    continue
                parts += tap.parts(received_ns, ts, payload)
                forwards.append(forward)
            if forwards:
                hub.metrics.accepted("lager", len(forwards))
                try:
                    future = hub.submit(EncodedBatch(len(forwards), b"".join(parts)))
                except HubStopped:
                    return
                self.inflight.add(future)
                future.add_done_callback(functools.partial(self._forward, forwards))
            # Yield after every burst, even one that was all rejected: a flood of bad messages
            # must not starve the registrar, the commit callbacks or the forwards.
            await asyncio.sleep(0)

    def _tap_records(self, raw_uuid: bytes, version: bytes, flags: bytes) -> DataRecords | None:
        """The record parts for a tap's (version, flags); None (rejected) for an unknown tap."""
        reg = self.registrar.by_uuid.get(raw_uuid)
        if reg is None:
            self._reject("unknown_tap", f"data from unregistered uuid {raw_uuid.hex()}")
            return None
        try:
            tap = DataRecords(
                reg.key, self._uuid_str(raw_uuid), _data_attrs(version, flags), reg.format.row_size
            )
        except ValueError as exc:
            self._reject("bad_record", f"{reg.key}: {exc}")
            return None
        if len(self._records) >= 4 * self.config.max_taps:  # versions/flags vary: stay bounded
            self._records.clear()
        self._records[raw_uuid + flags + version] = tap
        return tap

    def _forward(self, forwards: list[list[bytes]], future: asyncio.Future[Any]) -> None:
        """Runs once the batch is durable: fan out to mugs (committed data only), then one
        loss-accounting mark per tap in the batch."""
        self.inflight.discard(future)
        if future.cancelled() or future.exception() is not None or self.closing:
            return
        raw = self._fwd_out_raw
        send = raw_send
        more = MORE_NOBLOCK
        try:
            for f0, f1, f2, f3, f4 in forwards:
                send(raw, f0, more)
                send(raw, f1, more)
                send(raw, f2, more)
                send(raw, f3, more)
                send(raw, f4, NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("lager: forwarding stopped: %s", exc)
            return
        self._m_forwarded.inc(len(forwards))
        counts = self._forwarded_by_tap
        rounds = self._mark_rounds
        repeat = self.config.mark_repeat
        per_tap = Counter(map(itemgetter(0), forwards))
        # A batch from a few busy taps gets its marks at once; one spread over many taps
        # (a fleet at low rates: a mark per row or so) leaves them to the next HUGZ round.
        now = len(per_tap) <= _BATCH_MARKS
        for raw_uuid, n in per_tap.items():
            counts[raw_uuid] = counts.get(raw_uuid, 0) + n
            rounds[raw_uuid] = repeat
            if now:
                self._send_mark(raw_uuid)
        if len(counts) > 2 * self.config.max_taps:  # re-registered uuids: forget the gone ones
            known = self.registrar.by_uuid
            for raw_uuid in [u for u in counts if u not in known]:
                del counts[raw_uuid]
                rounds.pop(raw_uuid, None)

    def _send_mark(self, raw_uuid: bytes) -> None:
        """Publish a tap's forwarded-row count (dropped like data for a mug that is behind)."""
        count = self._forwarded_by_tap.get(raw_uuid, 0)
        try:
            raw_send(self._fwd_out_raw, MARK_PREFIX + raw_uuid, MORE_NOBLOCK)
            raw_send(self._fwd_out_raw, count.to_bytes(8, "big"), MORE_NOBLOCK)
            raw_send(self._fwd_out_raw, self._epoch, NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("lager: mark not sent: %s", exc)

    async def _hello_loop(self) -> None:
        """Read mug subscriptions on the XPUB; answer hello topics."""
        raw = self._fwd_out_raw
        while True:
            # A send on the same socket can swallow the read signal; poll with a short timeout.
            if not readable(raw):
                await self.fwd_out.poll(timeout=100)
            for _ in range(1024):
                try:
                    frame = raw.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                while raw.getsockopt(zmq.RCVMORE):
                    raw.recv()
                if frame[:1] == b"\x01" and frame[1:].startswith(HELLO_PREFIX):
                    # Marks first: the mug's baseline for every tap, in its pipe before the
                    # hello (its subscriptions, marks included, are already in place).
                    for raw_uuid in self._forwarded_by_tap:
                        self._send_mark(raw_uuid)
                    with contextlib.suppress(zmq.Again):  # [hello topic, epoch of the marks]
                        raw.send_multipart([frame[1:], self._epoch], zmq.NOBLOCK)
            await asyncio.sleep(0)
