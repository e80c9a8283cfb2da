"""The Bartender's forwarder: tap data in, validated, committed, then out to mugs.

Three sockets, at nasa/lager's forwarder ports and one more:

* ``lager_forwarder_in`` (F): SUB subscribed to everything, so nasa/lager PUB taps and
  taproom's XPUB taps both work.
* ``lager_forwarder_out`` (F+1): XPUB carrying **only data messages, frames as received** --
  what nasa/lager's SUB->PUB forwarder carries. A real Mug subscribes to everything here and
  aborts on any message that is not a data message with one frame per item.
* ``lager_forwarder_counted`` (F+2, taproom only): XPUB carrying the same data messages plus
  taproom's control messages, in order in one queue per mug: the hello replies (no lost first
  samples) and the loss marks (counted loss). taproom's Mug reads here; no real Mug ever does.

Both outputs are taproom's own publishers (:class:`~taproom.servers.zmtp.ZmtpPublisher`):
each batch's rows are encoded once for every mug, a mug's queue is bounded in messages
(``forward_hwm``) and bytes, and every row a mug misses is counted
(``taproom_output_dropped_messages_total{output="lager_forwarder_out"|...}``).

Rows from a uuid the registrar does not know are *held* (bounded by ``max_held_bytes``) for
up to ``unknown_tap_hold_s``: a real Tap's registration and its first rows travel on
different connections, so rows may overtake it; once it is applied they go through in order,
under its key. When the hold ends (or the bound is reached) and still no registration names
the uuid, its rows are journaled **unattributed** (stream empty, ``attrs.unattributed``), and so
are its later rows: a restarted nasa/lager Tap (new uuid, same key) usually never registers
again (its CHP client finds its key with its format in the snapshot and is satisfied), and its
rows name no key. Nothing tells which key they belong to, so none is guessed (docs/protocols/
lager.md, "Restarted taps"). They are forwarded like any row. Once a registration names the
uuid, a ``lager-attribution`` record (stream = key, producer = uuid) links them to their key.

Each message is checked against its tap's registered format (uuid known, header frames, one
frame per item with the format's sizes, or the seed's single payload frame of the row size),
committed (content type ``lager``, stream = tap key, producer = tap uuid, ts_ns = the message
timestamp, payload = the row) and only then forwarded (DESIGN.md decision 4). Refused messages
are counted by reason and never published. An output nobody subscribes to is not sent to.

Hello: a mug subscribes (on F+2) to ``HELLO_PREFIX`` + a random token after its data
subscriptions; the forwarder sends that topic back to that mug. One connection's subscriptions
are applied in order, so when the hello arrives every earlier subscription is in place.

Counted loss (``MARK_PREFIX``, F+2 only): a mug that falls behind its bounds misses rows (the
hub counts them too; the mug learns its own count from the marks). After each forwarded batch (of at most 256 distinct taps; else at the next HUGZ round) the
forwarder publishes, per tap in it, a mark ``[MARK_PREFIX + uuid, u64 rows of that tap
forwarded so far, u64 epoch of this process]``, so marks travel the mug's queue in order with
the rows. A mug subscribed to a tap's marks counts the rows it got between two marks and knows
exactly how many it lost (marks themselves may be dropped: the counts are cumulative). Before
each hello reply the forwarder sends that mug the marks of every tap with rows so far (its
baseline; a tap without a mark then had none) and the reply carries the epoch. Marks are
repeated once a ``hugz_interval_s`` for taps active in the last ``mark_repeat`` rounds.

Hot path (issues 7, 15): data messages are read a burst per call and forwarded a batch per call
(taproom's transport; bursts in :mod:`taproom.zmqburst`'s shapes), journal records are written
directly with :data:`~taproom.records.RECORD_HEAD` from per-tap constant parts
(:class:`DataRecords`, proven byte-identical to ``BatchBuilder`` by a test), and rows are
forwarded as the received frames, encoded once per batch (in C where it is built).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import struct
import time
import uuid as uuid_module
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from ... import zmqburst
from ...errors import HubStopped, ProtocolError
from ...eventtime import TIME_OUT_OF_RANGE, EventTimes
from ...hub import Hub
from ...protocols.lager.chp import Registrar, Registration
from ...protocols.lager.formats import FORMAT_VERSION
from ...protocols.lager.messages import check_row_header, parse_data_message
from ...records import (
    MAX_PAYLOAD_BYTES,
    RECORD_HEAD,
    RECORD_HEAD_AFTER_LEN,
    BatchBuilder,
    EncodedBatch,
)
from ..zmtp import Subscriber, ZmtpPublisher, ZmtpSocket
from .batch import Batch
from .config import LagerConfig
from .kernel import LG_PYTHON, RowKernel, tap_key

__all__ = [
    "ATTRIBUTION_CONTENT_TYPE",
    "DATA_CONTENT_TYPE",
    "HELLO_PREFIX",
    "MARK_PREFIX",
    "DataRecords",
    "Forwarder",
]

log = logging.getLogger("taproom.lager")

# A mug subscribes to HELLO_PREFIX + a random token after its data subscriptions; the forwarder
# sends that topic back to it. One connection's subscriptions are applied in order, so when the
# hello arrives every earlier subscription is in place. The NUL first byte keeps it out of any
# uuid prefix a real mug subscribes to.
HELLO_PREFIX = b"\x00taproom-lager-hello/"
# Loss accounting marks: topic MARK_PREFIX + tap uuid, then a u64 count (see the docstring).
MARK_PREFIX = b"\x00taproom-lager-mark/"
_BATCH_MARKS = 256  # taps per batch marked right after it; more wait for the HUGZ round
_HELD_TICK_S = 0.1  # how often held rows are checked for the end of their hold
DATA_CONTENT_TYPE = "lager"
# Links rows journaled unattributed (producer = uuid) to the key a registration gave the uuid.
ATTRIBUTION_CONTENT_TYPE = "lager-attribution"
# Item frame sizes a real Mug reads (mug.cpp: 1, 2, 4 or 8 bytes; anything else aborts it).
_NASA_ITEM_SIZES = frozenset((1, 2, 4, 8))
_KINDS = frozenset({"lager/" + DATA_CONTENT_TYPE})  # the journal's label (EncodedBatch.kinds)


# The record head split around ts_ns: [length, received_ns] | ts_ns | [seq, field lengths].
_PREFIX = struct.Struct("<Iq")
_NO_TIME = bytes(8)  # a row's timestamp frame as journaled when the journal cannot hold it
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

    __slots__ = ("cuts", "item_sizes", "length", "prefix", "received_ns", "row_size", "tail")

    def __init__(
        self, key: str, uuid_text: str, attrs: bytes, row_size: int, item_sizes: list[int]
    ) -> None:
        content = DATA_CONTENT_TYPE.encode()
        stream = key.encode("utf-8", "surrogateescape")
        producer = uuid_text.encode()
        if len(stream) > 65535 or row_size > MAX_PAYLOAD_BYTES:
            raise ValueError("tap key or row size over the record's limits")
        fixed = _PROTOCOL + content + stream + producer + attrs  # topic, event_id: empty
        self.row_size = row_size
        self.item_sizes = item_sizes  # one frame per item (nasa/lager framing), in row order
        # Where a whole row (the seed's framing) splits into item frames; None for one item.
        ends = list(itertools.accumulate(item_sizes))
        self.cuts = list(zip([0, *ends[:-1]], ends, strict=True)) if len(item_sizes) > 1 else None
        self.length = RECORD_HEAD_AFTER_LEN + len(fixed) + row_size
        self.tail = (
            _TAIL.pack(0, len(_PROTOCOL), len(content), len(stream), 0, len(producer), 0,
                       len(attrs), row_size)
            + fixed
        )  # fmt: skip
        self.received_ns: int | None = None  # none yet: any int, even -1, packs a prefix
        self.prefix = b""

    def parts(self, received_ns: int, ts_be: bytes, payload: bytes) -> tuple[bytes, ...]:
        """One record: ``ts_be`` is the seed's big-endian u64 (below 2^63), ``payload`` one
        row of ``row_size`` bytes (both checked by the caller)."""
        if received_ns != self.received_ns:
            self.prefix = _PREFIX.pack(self.length, received_ns)
            self.received_ns = received_ns
        return (self.prefix, ts_be[::-1], self.tail, payload)


def _data_attrs(version: bytes, flags: bytes, *, unattributed: bool = False) -> bytes:
    attrs = {"version": version.hex(), "flags": str(int.from_bytes(flags, "big"))}
    if unattributed:  # no key: stream is empty (docs/protocols/lager.md, "Restarted taps")
        attrs["unattributed"] = "true"
    return orjson.dumps(attrs)


@dataclass(slots=True)
class _Held:
    """Rows of one unregistered uuid, waiting for it to get a key."""

    since: float
    messages: list[list[bytes]] = field(default_factory=list)
    nbytes: int = 0


class Forwarder:
    """The forwarder's sockets and loops. ``registrar`` is the live hashmap (read only here);
    ``touch`` tells the registrar which uuids sent rows (it decides when a tap is gone)."""

    def __init__(
        self,
        hub: Hub,
        config: LagerConfig,
        registrar: Callable[[], Registrar],
        reject: Callable[[str, str], None],
        *,
        touch: Callable[[Iterable[bytes], float], None],
    ) -> None:
        self.hub = hub
        self.config = config
        self._registrar = registrar
        self._reject = reject
        self._touch = touch
        self._held: dict[bytes, _Held] = {}
        self._held_bytes = 0
        self._held_over = False  # the bound was passed in this burst: release the oldest
        # uuids whose rows go to the journal unattributed -> rows since they last got a link
        # (bounded by max_taps: the oldest are forgotten, their next rows are held again)
        self._unattributed: dict[bytes, int] = {}
        # uuid + flags + version + row length -> record parts of unattributed rows
        self._unattributed_records: dict[bytes, DataRecords] = {}
        self._replay: deque[list[bytes]] = deque()  # held rows of a uuid that now has a key
        self.closing = False
        self.inflight: set[asyncio.Future[Any]] = set()
        # tap_key(uuid, flags, version) -> DataRecords; cleared whenever the hashmap changes
        # (and the compiled kernel's copy with it: it takes rows of these taps alone).
        self._records: dict[bytes, DataRecords] = {}
        self._kernel: RowKernel | None = None  # made by the data loop on the compiled path
        self._forwarded_by_tap: dict[bytes, int] = {}  # uuid -> rows forwarded (marks)
        self._mark_rounds: dict[bytes, int] = {}  # uuid -> HUGZ rounds left to repeat its mark
        # Counts restart at zero with the process: the epoch tells a mug to take a new baseline.
        self._epoch = time.time_ns().to_bytes(8, "big")
        self._uuid_text: dict[bytes, str] = {}
        # Rows' times by the event-time rule (its tally: rows from 2^63 ns on, stored absent),
        # and the per-row supervision of the data loop (taproom.supervise).
        self._times = EventTimes()
        self._data_guard = hub.supervisor.guard(
            "lager.forwarder.data", protocol="lager", logger=log
        )
        self._forward_guard = hub.supervisor.guard(
            "lager.forwarder.forward", output="lager_forwarder", logger=log
        )
        self._m_forwarded = hub.metrics.counter(
            "lager", "forwarded", "rows", "Data rows sent to mugs"
        )
        self._m_unattributed = hub.metrics.counter(
            "lager",
            "unattributed",
            "rows",
            "Rows journaled without a key: no registration named their uuid (a restarted tap)",
        )
        self._m_attributed = hub.metrics.counter(
            "lager",
            "attributed",
            "rows",
            "Unattributed rows linked to a key later, when a registration named their uuid",
        )
        hub.metrics.gauge_fn(
            "lager",
            "unattributed_taps",
            "count",
            "uuids whose rows are journaled unattributed now (no registration names them)",
            lambda: len(self._unattributed),
        )
        hub.metrics.gauge_fn(
            "lager",
            "held",
            "bytes",
            "Rows of unregistered uuids waiting for a key (max_held_bytes)",
            lambda: self._held_bytes,
        )

    @property
    def registrar(self) -> Registrar:
        return self._registrar()

    def open(self) -> None:
        cfg = self.config
        # taproom's own transport (servers.zmtp): a SUB that subscribes every tap to
        # everything; a message holds at most a row's payload, its framing and the header
        # frames, checked at each frame header before the frame is read
        self.fwd_in = ZmtpSocket(
            "SUB",
            hub=self.hub,
            protocol="lager",
            name="lager_forwarder_in",
            max_message_bytes=cfg.max_payload_bytes + 9 * cfg.max_message_frames + 4096,
            subscribe=(b"",),
        )
        # taproom's own publishers: forward_hwm rows and [zmtp]'s bytes per mug, every row a
        # mug misses counted. What a mug sends upstream is subscriptions: a topic is a uuid, a
        # mark or a hello (a longer one disconnects it, counted message_too_large).
        self.fwd_out, self.fwd_counted = (
            ZmtpPublisher(
                "XPUB",
                hub=self.hub,
                protocol="lager",
                name=name,
                hwm=cfg.forward_hwm,
                max_subscription_bytes=cfg.max_key_bytes + 64,
                on_subscription=on_subscription,
            )
            for name, on_subscription in (
                ("lager_forwarder_out", None),
                ("lager_forwarder_counted", self._counted_subscription),
            )
        )

    @property
    def sockets(self) -> tuple[ZmtpSocket | ZmtpPublisher, ...]:
        """At offsets 0, 1, 2 from the forwarder's base port."""
        return (self.fwd_in, self.fwd_out, self.fwd_counted)

    def bound(self, base: int) -> dict[str, str]:
        """The sockets are bound at ``base`` + 0, 1, 2: name the listeners."""
        host = self.config.host
        return {
            "lager_forwarder_in": f"{host}:{base}",
            "lager_forwarder_out": f"{host}:{base + 1}",
            "lager_forwarder_counted": f"{host}:{base + 2}",
        }

    @property
    def loops(self) -> tuple[Callable[[], Awaitable[None]], ...]:
        return (self._data_loop, self._held_loop)

    def formats_changed(self) -> None:
        """A registration changed the hashmap: a tap's format may be different now."""
        self._clear_records()

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()

    def _uuid_str(self, raw: bytes) -> str:
        text = self._uuid_text.get(raw)
        if text is None:
            text = self._uuid_text[raw] = str(uuid_module.UUID(bytes=raw))
        return text

    def repeat_marks(self) -> None:
        """At a HUGZ round: marks again for the taps active in the last ``mark_repeat``."""
        if not self.fwd_counted.has_subscribers:
            return
        rounds = self._mark_rounds
        self.fwd_counted.send(self._marks(rounds))
        for raw_uuid, left in list(rounds.items()):
            if left <= 1:
                del rounds[raw_uuid]
            else:
                rounds[raw_uuid] = left - 1

    async def _data_loop(self) -> None:
        cfg = self.config
        fwd_in = self.fwd_in
        hub = self.hub
        max_batch = cfg.max_batch_messages
        reader = fwd_in.reader(cfg.max_message_frames)
        replay = self._replay
        times = self._times
        kernel = self._kernel = RowKernel.create(4 * cfg.max_taps, max_batch)
        while True:
            await hub.wait_capacity()
            if not replay and not fwd_in.readable:
                # Short naps while rows are held: a takeover releases them into ``replay``.
                await fwd_in.wait_readable(0.1 if self._held else 1.0)
            received_ns = time.time_ns()  # one receive time per batch, as BatchBuilder does
            batch = Batch()
            if replay:  # rows held for a tap that has now registered go first, in order
                taken = [replay.popleft() for _ in range(min(max_batch, len(replay)))]
                self._take_messages([(len(frames), frames) for frames in taken], batch,
                                    received_ns)  # fmt: skip
            else:  # one burst (taproom.zmqburst: compiled, or pyzmq per frame)
                burst = reader.recv(max_batch, cfg.burst_bytes)
                if kernel is not None and zmqburst.compiled(burst):
                    self._take_burst(kernel, burst, batch, received_ns)
                else:
                    self._take_messages(burst.messages(), batch, received_ns)
            batch.close_chunk()
            if self._held_over:
                self._release_oldest()
            if batch.unattributed:
                self._m_unattributed.inc(batch.unattributed)
            out_of_range = times.take()
            if out_of_range:
                hub.metrics.odd("lager", TIME_OUT_OF_RANGE, out_of_range)
            if batch.rows:
                encoded = EncodedBatch(batch.rows, b"".join(batch.parts), _KINDS)
                hub.metrics.accepted("lager", batch.rows, len(encoded.body))
                # A tap is alive when its rows arrive, not when our disk has them: touched
                # after the commit, a live tap looked gone for as long as commits took.
                self._touch(batch.per_tap, time.monotonic())
                try:
                    future = hub.submit(encoded)
                except HubStopped:
                    return
                self.inflight.add(future)
                future.add_done_callback(functools.partial(self._forward, batch))
            # Yield after every burst, even one that was all rejected: a flood of bad messages
            # must not starve the registrar, the commit callbacks or the forwards.
            await asyncio.sleep(0)

    def _take_burst(self, kernel: RowKernel, burst: Any, batch: Batch, received_ns: int) -> None:
        """A compiled burst: runs of rows the kernel takes (records and wire in C), each
        message it leaves through :meth:`_take_messages`, in order. Should a kernel call
        itself fail (a bug), the rest of the burst is the Python path's: no row is lost."""
        n, max_frames = burst.n, self.config.max_message_frames
        kernel.size(burst.size, burst.frames_kept)
        times = self._times
        start = start_frame = 0
        while start < n:
            try:
                res = kernel.run(burst, start, start_frame, received_ns)
            except Exception as exc:  # a bug: the rest of the burst goes the Python way
                self._data_guard.failed(exc, "row kernel run")
                rest = itertools.islice(burst.messages(), start, None)
                self._take_messages(rest, batch, received_ns)
                return
            if res.rows:
                records, wire, ends, runs, plain = kernel.taken()
                batch.add_kernel_rows(records, wire, ends, runs, plain, res.rows)
                times.out_of_range += res.out_of_range
            start, start_frame = res.next, res.next_frame
            if res.stop == LG_PYTHON:  # this message is the Python path's
                count = burst.counts()[start]
                self._take_messages([(count, burst.frames(start))], batch, received_ns)
                start += 1
                start_frame += min(count, max_frames)

    def _take_messages(
        self, messages: Iterable[tuple[int, list[bytes]]], batch: Batch, received_ns: int
    ) -> None:
        """The Python path (the kernel's twin): each message checked against its tap's format,
        its record added to the batch and the message to the batch's forwards."""
        max_frames = self.config.max_message_frames
        records = self._records
        times = self._times
        guard = self._data_guard
        parts, forwards = batch.parts, batch.forwards
        reframe, not_plain = batch.reframe, batch.not_plain
        for count, frames in messages:
            # One row's unexpected error refuses it alone (taproom.supervise); nothing of
            # it is journaled or forwarded, the burst's other rows are.
            try:
                if count > max_frames:
                    self._reject("frame_count", f"data message over {max_frames} frames")
                    continue
                n = count
                if (
                    n >= 5
                    and len(frames[0]) == 16
                    and 1 <= len(frames[1]) <= 8
                    and 1 <= len(frames[2]) <= 2
                    and len(frames[3]) == 8
                ):
                    # The header of both framings, checked inline (the common case).
                    raw_uuid, version, flags, ts = frames[0], frames[1], frames[2], frames[3]
                else:
                    try:
                        parse_data_message(frames, max_frames=max_frames)
                    except ProtocolError as exc:
                        self._reject(exc.reason, str(exc))
                        continue
                    raw_uuid, version, flags, ts = frames[0], frames[1], frames[2], frames[3]
                if ts[0] >= 0x80:
                    # 2^63 ns and on (year 2262): a valid u64 for the seed, but the
                    # journal cannot hold it: stored absent (0) and counted, forwarded as
                    # received (the event-time rule, taproom.eventtime).
                    ts = _NO_TIME
                    times.out_of_range += 1
                tap = records.get(tap_key(raw_uuid, flags, version))
                if tap is None:
                    reg = self.registrar.by_uuid.get(raw_uuid)
                    if reg is None:
                        try:  # no format yet: BEERR01 is the only version any format has
                            check_row_header(version, flags, FORMAT_VERSION)
                        except ProtocolError as exc:
                            self._reject(exc.reason, f"uuid {raw_uuid.hex()}: {exc}")
                            continue
                        if raw_uuid not in self._unattributed:
                            self._hold(raw_uuid, frames)
                            continue
                        # no registration names it (a restarted tap): journaled without a key
                        unattributed = self._unattributed_row(raw_uuid, version, flags, frames)
                        if unattributed is None:
                            continue
                        tap, payload, plain = unattributed
                        parts += tap.parts(received_ns, ts, payload)
                        if not plain:
                            not_plain.append(len(forwards))
                        forwards.append(frames)
                        self._unattributed[raw_uuid] += 1
                        batch.unattributed += 1
                        continue
                    tap = self._tap_records(reg, raw_uuid, version, flags)
                    if tap is None:
                        continue
                if n == 5:  # the seed's one payload frame, or nasa/lager's single item
                    payload = frames[4]
                    if len(payload) != tap.row_size:
                        self._refuse_row(raw_uuid, [len(payload)], tap)
                        continue
                    if tap.cuts is not None:
                        reframe.append((len(forwards), tap.cuts))
                else:  # nasa/lager: one frame per item, each of the item's size
                    items = frames[4:]
                    if list(map(len, items)) != tap.item_sizes:
                        self._refuse_row(raw_uuid, list(map(len, items)), tap)
                        continue
                    payload = b"".join(items)
                parts += tap.parts(received_ns, ts, payload)
                forwards.append(frames)  # forwarded as received, as nasa/lager's forwarder does
            except Exception as exc:
                guard.failed(exc, "data message")

    def _tap_records(
        self, reg: Registration, raw_uuid: bytes, version: bytes, flags: bytes
    ) -> DataRecords | None:
        """The record parts for a tap's (version, flags); None (rejected) if they cannot be."""
        try:
            check_row_header(version, flags, reg.format.version)
        except ProtocolError as exc:
            self._reject(exc.reason, f"{reg.key}: {exc}")
            return None
        try:
            tap = DataRecords(
                reg.key,
                self._uuid_str(raw_uuid),
                _data_attrs(version, flags),
                reg.format.row_size,
                [item.size for item in reg.format.items],
            )
        except ValueError as exc:
            self._reject("bad_record", f"{reg.key}: {exc}")
            return None
        if len(self._records) >= 4 * self.config.max_taps:  # versions/flags vary: stay bounded
            self._clear_records()
        key = tap_key(raw_uuid, flags, version)
        self._records[key] = tap
        if self._kernel is not None:
            self._kernel.add(key, tap)
        return tap

    def _clear_records(self) -> None:
        self._records.clear()
        if self._kernel is not None:
            self._kernel.clear()

    def _unattributed_row(
        self, raw_uuid: bytes, version: bytes, flags: bytes, frames: list[bytes]
    ) -> tuple[DataRecords, bytes, bool] | None:
        """The record parts and payload of a row whose uuid no registration names (its header
        already checked), and whether a real Mug could read it on the plain output; None
        (rejected) if it cannot be stored. Without a format its items cannot be checked."""
        items = frames[4:]
        payload = items[0] if len(items) == 1 else b"".join(items)
        cache_key = tap_key(raw_uuid, flags, version) + len(payload).to_bytes(4, "big")
        tap = self._unattributed_records.get(cache_key)
        if tap is None:
            try:
                tap = DataRecords(
                    "",
                    self._uuid_str(raw_uuid),
                    _data_attrs(version, flags, unattributed=True),
                    len(payload),
                    [len(payload)],
                )
            except ValueError as exc:
                self._reject("bad_record", f"uuid {raw_uuid.hex()}: {exc}")
                return None
            if len(self._unattributed_records) >= self.config.max_taps:
                self._unattributed_records.clear()
            self._unattributed_records[cache_key] = tap
        plain = all(len(item) in _NASA_ITEM_SIZES for item in items)
        return tap, payload, plain

    def _refuse_row(self, raw_uuid: bytes, sizes: list[int], tap: DataRecords) -> None:
        key = self.registrar.by_uuid[raw_uuid].key
        if sum(sizes) != tap.row_size:
            self._reject("payload_size", f"{key}: row of {sum(sizes)} bytes, format has "
                         f"{tap.row_size}")  # fmt: skip
        else:
            self._reject("item_sizes", f"{key}: item frames of {sizes[:16]} bytes, format has "
                         f"{tap.item_sizes[:16]}")  # fmt: skip

    def _forward(self, batch: Batch, future: asyncio.Future[Any]) -> None:
        """Runs once the batch is durable: fan out to mugs (committed data only), then one
        loss-accounting mark per tap in the batch on the counted output. The plain output gets
        nasa/lager data messages only: a seed-framed row of several items goes there split into
        one frame per item (a real Mug reads nothing else), and an unattributed row (no format
        to split it by) only if its frames are what a real Mug reads."""
        self.inflight.discard(future)
        if future.cancelled() or future.exception() is not None or self.closing:
            return
        per_tap = batch.per_tap
        try:
            if self.fwd_out.has_subscribers:
                self.fwd_out.publish(batch.burst(plain=True))
            if self.fwd_counted.has_subscribers:
                self.fwd_counted.publish(batch.burst(plain=False))
        except Exception as exc:  # a bug: these rows are not forwarded (they are journaled)
            self._forward_guard.failed(exc, "committed batch", batch.rows)
            return
        self._m_forwarded.inc(batch.rows)
        counts = self._forwarded_by_tap
        rounds = self._mark_rounds
        repeat = self.config.mark_repeat
        # A batch from a few busy taps gets its marks at once; one spread over many taps
        # (a fleet at low rates: a mark per row or so) leaves them to the next HUGZ round.
        now = len(per_tap) <= _BATCH_MARKS and self.fwd_counted.has_subscribers
        for raw_uuid, n in per_tap.items():
            counts[raw_uuid] = counts.get(raw_uuid, 0) + n
            rounds[raw_uuid] = repeat
        if now:
            self.fwd_counted.send(self._marks(per_tap))
        if len(counts) > 2 * self.config.max_taps:  # re-registered uuids: forget the gone ones
            known = self.registrar.by_uuid
            for raw_uuid in [u for u in counts if u not in known]:
                del counts[raw_uuid]
                rounds.pop(raw_uuid, None)

    def _marks(self, uuids: Iterable[bytes]) -> list[list[bytes]]:
        """Marks of taps' forwarded-row counts (dropped like data for a mug that is behind,
        counted; the counts are cumulative, so the next mark tells the mug its loss)."""
        counts, epoch = self._forwarded_by_tap, self._epoch
        return [
            [MARK_PREFIX + raw_uuid, counts.get(raw_uuid, 0).to_bytes(8, "big"), epoch]
            for raw_uuid in uuids
        ]

    # --- rows of unregistered uuids -----------------------------------------------------------

    def _hold(self, raw_uuid: bytes, frames: list[bytes]) -> None:
        """Keep a row of an unregistered uuid until its registration is applied or its hold
        ends. Past ``max_held_bytes`` (checked after the burst, so at most one burst over) the
        oldest holds end early: their rows are journaled unattributed, never refused."""
        size = sum(map(len, frames))
        held = self._held.get(raw_uuid)
        if held is None:
            held = self._held[raw_uuid] = _Held(time.monotonic())
        held.messages.append(frames)
        held.nbytes += size
        self._held_bytes += size
        if self._held_bytes > self.config.max_held_bytes:
            self._held_over = True

    def _release_oldest(self) -> None:
        self._held_over = False
        while self._held_bytes > self.config.max_held_bytes and self._held:
            self._release(next(iter(self._held)), "max_held_bytes reached")

    def _release(self, raw_uuid: bytes, why: str) -> None:
        """No registration named ``raw_uuid`` in time: its held rows, then all its rows until
        one does, go to the journal unattributed (in order: held ones first)."""
        held = self._held.pop(raw_uuid)
        self._held_bytes -= held.nbytes
        unattributed = self._unattributed
        if len(unattributed) >= self.config.max_taps:
            del unattributed[next(iter(unattributed))]
        unattributed[raw_uuid] = unattributed.get(raw_uuid, 0)
        self._replay.extend(held.messages)
        log.warning(
            "lager: rows from tap %s are journaled without a key (%s): no registration names "
            "this uuid (a restarted nasa/lager Tap does not register again when the registrar "
            "already shows its key with its format); they are linked to a key when one does",
            self._uuid_str(raw_uuid), why,
        )  # fmt: skip

    def registered(self, reg: Registration) -> None:
        """``reg.uuid`` has a key now: its held rows go through next, before newer ones, and
        rows already journaled unattributed are linked to the key (a ``lager-attribution``
        record after them: forwarder batches are submitted in order, and none after this one
        is unattributed for this uuid)."""
        held = self._held.pop(reg.uuid, None)
        if held is not None:
            self._held_bytes -= held.nbytes
            self._replay.extend(held.messages)
        rows = self._unattributed.pop(reg.uuid, None)
        if not rows:
            return
        builder = BatchBuilder()
        builder.add(
            "lager",
            b"",
            stream=reg.key,
            topic="attribution",
            producer=reg.uuid_str,
            event_id=reg.uuid_str,
            content_type=ATTRIBUTION_CONTENT_TYPE,
            attrs={"rows": str(rows)},
        )
        try:
            future = self.hub.submit(builder.build())
        except HubStopped:
            return
        self.inflight.add(future)
        future.add_done_callback(self.inflight.discard)
        self._m_attributed.inc(rows)
        log.info("lager: %d unattributed rows of tap %s are %s's", rows, reg.uuid_str, reg.key)

    async def _held_loop(self) -> None:
        """End the holds that lasted ``unknown_tap_hold_s``."""
        hold_s = self.config.unknown_tap_hold_s
        while True:
            await asyncio.sleep(_HELD_TICK_S)
            now = time.monotonic()
            for raw_uuid, held in list(self._held.items()):
                if now - held.since >= hold_s:
                    self._release(raw_uuid, f"none came in {hold_s:g} s")

    def _counted_subscription(self, mug: Subscriber, topic: bytes, subscribed: bool) -> None:
        """A hello: marks first, that mug's baseline for every tap (its subscriptions, marks
        included, are in place: they came before on the same connection), then [hello topic,
        epoch]: to that mug alone, in its queue after everything sent to it so far."""
        if subscribed and topic.startswith(HELLO_PREFIX):
            self.fwd_counted.send_to(
                mug, [*self._marks(self._forwarded_by_tap), [topic, self._epoch]]
            )
