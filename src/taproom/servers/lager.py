"""Lager Bartender: the CHP registrar and the data forwarder, as pyzmq glue on the hub's loop.

Registrar (seed, "Registrar"): SNAPSHOT ROUTER at P answers ``ICANHAZ?``; PUBLISHER PUB at
P+1 sends each hashmap change and ``HUGZ`` when idle; COLLECTOR SUB at P+2 takes tap
registrations. A registration is committed to the journal (content type
``lager-registration``, stream = tap key, producer = tap uuid, payload = the format XML) before
the hashmap changes and the update is published, so the journal is the source of truth.
``<journal dir>/lager-registrar.json`` is a checkpoint of the hashmap plus the journal offset it
covers (written atomically at most every ``checkpoint_interval_s`` and at stop); on start the
checkpoint is loaded and the journal replayed from that offset (from the start if there is no
checkpoint), so registrations survive a restart and even a SIGKILL.

Forwarder (seed, "Forwarder"): taps publish data messages to a SUB socket at P (subscribed to
everything, so nasa/lager PUB taps and taproom's XPUB taps both work); mugs subscribe by tap
uuid at an XPUB at P+1. Each message is checked against its tap's registered format, committed
(content type ``lager``, stream = tap key, producer = tap uuid, ts_ns = the message timestamp,
payload = the row) and only then forwarded (DESIGN.md decision 4). The forwarder also answers
"hello" subscriptions (``HELLO_PREFIX``) with one frame, so a mug knows its subscriptions
reached the bartender before it asks a tap to start (no lost first samples).

Counted loss (``MARK_PREFIX``): ZeroMQ drops silently for a mug that falls behind its HWM. After
each forwarded batch (of at most 256 distinct taps; else at the next HUGZ round) the forwarder
publishes, per tap in it, a mark ``[MARK_PREFIX + uuid, u64 rows of that tap forwarded so far,
u64 epoch of this process]`` on the same XPUB, so marks travel the mug's pipe in order with the
rows. A mug subscribed to a tap's marks counts the rows it got between two marks
and knows exactly how many it lost (marks themselves may be dropped: the counts are cumulative).
Before each hello reply the forwarder sends the marks of every tap with rows so far (the mug's
baseline; a tap without a mark then had none) and the reply carries the epoch. Marks are
repeated once a ``hugz_interval_s`` for taps active in the last ``mark_repeat`` rounds.

Hot path (issue 7): data frames are read as ZeroMQ frames (their ``more`` flag is far cheaper
than ``getsockopt(RCVMORE)`` in pyzmq), journal records are written directly with
:data:`~taproom.records.RECORD_HEAD` from per-tap constant parts (:class:`DataRecords`, proven
byte-identical to ``BatchBuilder`` by a test), and rows are forwarded as the received frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import struct
import time
import uuid as uuid_module
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import orjson
import zmq
import zmq.asyncio
import zmq.backend

from ..config import config_section, setting
from ..errors import HubStopped, ProtocolError
from ..hub import Hub
from ..protocols.lager.chp import (
    ChpError,
    Registrar,
    Registration,
    hugz_frames,
    kthxbai_frames,
    parse_registration,
    parse_snapshot_request,
)
from ..protocols.lager.formats import parse_format_xml
from ..protocols.lager.messages import MESSAGE_VERSION, parse_data_message
from ..records import (
    MAX_PAYLOAD_BYTES,
    RECORD_HEAD,
    RECORD_HEAD_AFTER_LEN,
    BatchBuilder,
    EncodedBatch,
    iter_batch,
)
from ..zmqframes import recv_frames

__all__ = [
    "HELLO_PREFIX",
    "MARK_PREFIX",
    "DataRecords",
    "LagerConfig",
    "LagerService",
    "create_service",
]

log = logging.getLogger("taproom.lager")

# A mug subscribes to HELLO_PREFIX + a random token after its data subscriptions; the forwarder
# publishes that topic back once. ZeroMQ applies one pipe's subscriptions in order, so when the
# hello arrives every earlier subscription is in place. The NUL first byte keeps it out of any
# uuid prefix a real mug subscribes to.
HELLO_PREFIX = b"\x00taproom-lager-hello/"
# Loss accounting marks: topic MARK_PREFIX + tap uuid, then a u64 count (see the docstring).
MARK_PREFIX = b"\x00taproom-lager-mark/"
_BATCH_MARKS = 256  # taps per batch marked right after it; more wait for the HUGZ round
REGISTRATION_CONTENT_TYPE = "lager-registration"
DATA_CONTENT_TYPE = "lager"
_STATE_VERSION = 1


@config_section("lager")
@dataclass(frozen=True)
class LagerConfig:
    enabled: bool = setting(True, "robot telemetry taps and mugs")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    registrar_port: int = setting(
        12345, "CHP registrar: SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2", min=0, max=65533
    )
    forwarder_port: int = setting(
        12348, "forwarder: taps publish to P, mugs subscribe at P+1", min=0, max=65534
    )
    hugz_interval_s: float = setting(
        1.0, "seed: 'a HUGZ message at an interval of 1Hz' when no update was sent", min=0.01
    )
    max_taps: int = setting(
        100_000, "hashmap entries; a fleet of robots is thousands, not millions", min=1
    )
    max_key_bytes: int = setting(255, "a /Namespace/Tap/ key is a short name", min=8, max=65535)
    max_format_bytes: int = setting(
        64 * 1024, "a BEERR01 format of ~1000 items fits; bounds XML parsing work", min=256
    )
    max_format_items: int = setting(1024, "items per row; rows are telemetry, not blobs", min=1)
    max_payload_bytes: int = setting(
        1024 * 1024, "one row; also ZMQ_MAXMSGSIZE on the forwarder input", min=64
    )
    max_message_frames: int = setting(
        1028, "5 frames per seed message; C++ taps send one frame per item (4 + items)", min=5
    )
    max_batch_messages: int = setting(
        8192, "data messages drained into one journal batch before yielding the loop", min=1
    )
    forward_hwm: int = setting(
        100_000,
        "messages queued per mug before ZeroMQ drops for that slow mug only (counted by the "
        "mug through marks); 100k 5-frame rows of 32 B is ~30 MB per stuck mug",
        min=1,
    )
    input_hwm: int = setting(
        100_000,
        "messages queued from taps before ZeroMQ pushes back on them; ~30 MB at 32 B rows",
        min=1,
    )
    mark_repeat: int = setting(
        60,
        "HUGZ rounds a tap's loss mark is repeated after its last row, so a mug that was "
        "behind (its marks dropped with the rows) still learns the final count",
        min=1,
    )
    checkpoint_interval_s: float = setting(
        1.0, "registrar checkpoint at most this often; the journal covers the rest", min=0.01
    )
    state_file: str = setting(
        "", "registrar checkpoint; empty means <journal dir>/lager-registrar.json"
    )
    port_retries: int = setting(50, "port 0: tries to find consecutive free ports", min=1)


def _endpoint(host: str, port: int | str) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def _bind_range(sockets: list[zmq.asyncio.Socket], host: str, port: int, retries: int) -> int:
    """Bind ``sockets`` to consecutive ports from ``port`` (0: any free base). Returns the base."""
    if port:
        for i, sock in enumerate(sockets):
            sock.bind(_endpoint(host, port + i))
        return port
    last: Exception | None = None
    for _ in range(retries):
        bound: list[tuple[zmq.asyncio.Socket, str]] = []
        try:
            sockets[0].bind(_endpoint(host, "*"))
            first = sockets[0].getsockopt(zmq.LAST_ENDPOINT)
            assert isinstance(first, bytes)
            bound.append((sockets[0], first.decode()))
            base = int(first.decode().rsplit(":", 1)[1])
            if base + len(sockets) - 1 > 65535:
                raise zmq.ZMQError(errno.EADDRINUSE)
            for i, sock in enumerate(sockets[1:], 1):
                endpoint = _endpoint(host, base + i)
                sock.bind(endpoint)
                bound.append((sock, endpoint))
            return base
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            last = exc
            for sock, endpoint in bound:
                with contextlib.suppress(zmq.ZMQError):
                    sock.unbind(endpoint)
    raise OSError(errno.EADDRINUSE, f"no {len(sockets)} consecutive free ports: {last}")


# Hot paths call the backend socket methods with plain ints: pyzmq's Python-level wrappers and
# its IntFlag constants cost more than the ZeroMQ call itself (measured ~2x per frame).
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_RCVMORE = int(zmq.RCVMORE)
_MORE_NOBLOCK = _NOBLOCK | _SNDMORE
_raw_recv = zmq.backend.Socket.recv
_raw_send = zmq.backend.Socket.send
_raw_get = zmq.backend.Socket.get


def _recv_bounded(sock: zmq.Socket[bytes], max_frames: int) -> list[bytes] | None:
    """One whole message (NOBLOCK; raises zmq.Again); None if it had more than ``max_frames``
    frames (the rest is read and discarded so the next message starts clean)."""
    frames = [_raw_recv(sock, _NOBLOCK)]
    while _raw_get(sock, _RCVMORE):
        frame = _raw_recv(sock, 0)
        if len(frames) < max_frames:
            frames.append(frame)
        else:
            frames = [b""] * (max_frames + 1)
    return None if len(frames) > max_frames else frames


def _readable(sock: zmq.Socket[bytes]) -> bool:
    events: Any = sock.getsockopt(zmq.EVENTS)
    return bool(events & zmq.POLLIN)


def _send(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, zmq.NOBLOCK | zmq.SNDMORE if i < last else zmq.NOBLOCK)


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


class LagerService:
    """The Bartender: registrar + forwarder. ``start()`` binds; ``stop()`` checkpoints."""

    def __init__(self, hub: Hub, config: LagerConfig) -> None:
        self.hub = hub
        self.config = config
        self.registrar = Registrar(max_taps=config.max_taps)
        self.state_path = config.state_file or os.path.join(
            hub.config.journal.dir, "lager-registrar.json"
        )
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._registered_offset = 0  # journal end covered by the hashmap
        self._dirty = False
        self._last_publish = 0.0
        self._closing = False
        self._inflight: set[asyncio.Future[Any]] = set()
        # uuid + flags + version -> DataRecords; cleared whenever the hashmap changes.
        self._records: dict[bytes, DataRecords] = {}
        self._forwarded_by_tap: dict[bytes, int] = {}  # uuid -> rows forwarded (marks)
        self._mark_rounds: dict[bytes, int] = {}  # uuid -> HUGZ rounds left to repeat its mark
        # Counts restart at zero with the process: the epoch tells a mug to take a new baseline.
        self._epoch = time.time_ns().to_bytes(8, "big")
        self._uuid_text: dict[bytes, str] = {}
        self._last_log: dict[str, float] = {}
        m = hub.metrics
        self._m_forwarded = m.counter("lager", "forwarded", "rows", "Data rows sent to mugs")
        self._m_hugz = m.counter("lager", "hugz", "messages", "HUGZ sent by the registrar")
        self._m_registered = m.counter(
            "lager", "registrations", "messages", "Registrations that changed the hashmap"
        )
        self._m_snapshots = m.counter("lager", "snapshots", "requests", "ICANHAZ? answered")
        m.gauge_fn("lager", "taps", "count", "Taps in the registrar's hashmap", self._tap_count)

    def _tap_count(self) -> float:
        return len(self.registrar)

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        cfg = self.config
        await asyncio.to_thread(self._restore)
        self._ctx = ctx = zmq.asyncio.Context()
        self.snapshot = ctx.socket(zmq.ROUTER)
        self.publisher = ctx.socket(zmq.PUB)
        self.collector = ctx.socket(zmq.SUB)
        self.fwd_in = ctx.socket(zmq.SUB)
        self.fwd_out = ctx.socket(zmq.XPUB)
        for sock in (self.snapshot, self.publisher, self.collector, self.fwd_in, self.fwd_out):
            sock.setsockopt(zmq.LINGER, 0)
        registrar_max = cfg.max_format_bytes + cfg.max_key_bytes
        self.collector.setsockopt(zmq.MAXMSGSIZE, registrar_max)
        self.collector.setsockopt(zmq.SUBSCRIBE, b"")
        self.snapshot.setsockopt(zmq.MAXMSGSIZE, cfg.max_key_bytes + 16)
        self.snapshot.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A snapshot is up to max_taps messages in one burst: the HWM must hold all of them.
        self.snapshot.setsockopt(zmq.SNDHWM, cfg.max_taps + 16)
        self.publisher.setsockopt(zmq.SNDHWM, cfg.max_taps + 16)
        self.fwd_in.setsockopt(zmq.MAXMSGSIZE, cfg.max_payload_bytes)
        self.fwd_in.setsockopt(zmq.RCVHWM, cfg.input_hwm)
        self.fwd_in.setsockopt(zmq.SUBSCRIBE, b"")
        self.fwd_out.setsockopt(zmq.SNDHWM, cfg.forward_hwm)
        self.fwd_out.setsockopt(zmq.MAXMSGSIZE, cfg.max_key_bytes + 64)
        try:
            reg_base = _bind_range(
                [self.snapshot, self.publisher, self.collector],
                cfg.host,
                cfg.registrar_port,
                cfg.port_retries,
            )
            fwd_base = _bind_range(
                [self.fwd_in, self.fwd_out], cfg.host, cfg.forwarder_port, cfg.port_retries
            )
        except (zmq.ZMQError, OSError):
            ctx.destroy(linger=0)  # the app never calls stop() for a service that failed
            self._ctx = None
            raise
        # Synchronous shadows of the same sockets for NOBLOCK bursts (DESIGN.md decision 3).
        self._snapshot_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.snapshot.underlying)
        self._publisher_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.publisher.underlying)
        self._collector_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.collector.underlying)
        self._fwd_in_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.fwd_in.underlying)
        self._fwd_out_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self.fwd_out.underlying)
        self._last_publish = time.monotonic()
        for loop in (
            self._collector_loop,
            self._snapshot_loop,
            self._hugz_loop,
            self._data_loop,
            self._hello_loop,
            self._checkpoint_loop,
        ):
            self._tasks.append(asyncio.create_task(self._guard(loop)))
        host = cfg.host
        return {
            "lager_registrar_snapshot": f"{host}:{reg_base}",
            "lager_registrar_publisher": f"{host}:{reg_base + 1}",
            "lager_registrar_collector": f"{host}:{reg_base + 2}",
            "lager_forwarder_in": f"{host}:{fwd_base}",
            "lager_forwarder_out": f"{host}:{fwd_base + 1}",
        }

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._inflight:  # rows already accepted: let their commits land and forward them
            await asyncio.wait(set(self._inflight), timeout=self.hub.config.hub.grace_period_s)
        self._closing = True
        if self._dirty:
            await asyncio.to_thread(self._checkpoint)
        for sock in (self.snapshot, self.publisher, self.collector, self.fwd_in, self.fwd_out):
            sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _guard(self, loop: Callable[[], Awaitable[None]]) -> None:
        """Keep a socket loop running: a bug is logged and counted, never a dead socket."""
        while not self._closing:
            try:
                await loop()
                return
            except asyncio.CancelledError:
                raise
            except HubStopped:
                return
            except Exception:
                log.exception("lager: %s failed; restarting it", loop.__name__)
                self.hub.metrics.rejected("lager", "internal_error")
                await asyncio.sleep(0.1)

    # --- bookkeeping ----------------------------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected("lager", reason)
        now = time.monotonic()
        if now - self._last_log.get(reason, 0.0) >= 1.0:  # a flood of bad input, one line a second
            self._last_log[reason] = now
            log.warning("lager: rejected (%s): %s", reason, detail[:200])

    def _uuid_str(self, raw: bytes) -> str:
        text = self._uuid_text.get(raw)
        if text is None:
            text = self._uuid_text[raw] = str(uuid_module.UUID(bytes=raw))
        return text

    # --- persistence ----------------------------------------------------------------------

    def _restore(self) -> None:
        """Checkpoint, then every registration the journal holds after it."""
        journal = self.hub.journal
        start = journal.first_offset
        try:
            with open(self.state_path, "rb") as f:
                state = orjson.loads(f.read())
            entries = []
            for tap in state["taps"]:
                fmt = parse_format_xml(tap["value"], max_bytes=1 << 30, max_items=1 << 20)
                entries.append(
                    Registration(
                        tap["key"], bytes.fromhex(tap["uuid"]), tap["value"], fmt, tap["sequence"]
                    )
                )
            self.registrar.restore(entries)
            self.registrar.sequence = max(self.registrar.sequence, int(state["sequence"]))
            start = max(start, int(state["journal_offset"]))
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, ProtocolError) as exc:
            log.error(
                "lager: checkpoint %s unreadable (%s); replaying the journal", self.state_path, exc
            )
            self.registrar = Registrar(max_taps=self.config.max_taps)
        replayed = 0
        marker = REGISTRATION_CONTENT_TYPE.encode()
        for base, _count, body in journal.read_batches(start):
            if marker not in body:  # data batches never mention it; skip decoding them
                continue

            for record in iter_batch(body, base):
                if record.offset < start or record.content_type != REGISTRATION_CONTENT_TYPE:
                    continue
                try:
                    reg = parse_registration(
                        [record.stream.encode(), bytes(8), uuid_module.UUID(record.producer).bytes,
                         b"", record.payload],
                        max_xml_bytes=1 << 30,
                        max_items=1 << 20,
                    )  # fmt: skip
                    if self.registrar.check(reg):
                        self.registrar.apply(reg)
                        replayed += 1
                except (ProtocolError, ValueError) as exc:
                    log.warning("lager: journal registration at %d skipped: %s", record.offset, exc)
        self._registered_offset = journal.end_offset
        self._dirty = replayed > 0
        log.info(
            "lager: %d taps registered (%d replayed from the journal)",
            len(self.registrar),
            replayed,
        )

    def _checkpoint(self) -> None:
        state = {
            "version": _STATE_VERSION,
            "journal_offset": self._registered_offset,
            "sequence": self.registrar.sequence,
            "taps": [
                {"key": r.key, "uuid": r.uuid.hex(), "value": r.value, "sequence": r.sequence}
                for r in self.registrar.snapshot()
            ],
        }
        tmp = self.state_path + ".tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.state_path)), exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(state))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.state_path)
        fd = os.open(os.path.dirname(os.path.abspath(self.state_path)), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.checkpoint_interval_s)
            if self._dirty:
                self._dirty = False
                try:
                    await asyncio.to_thread(self._checkpoint)
                except OSError as exc:
                    self._dirty = True
                    log.error("lager: checkpoint failed (%s); the journal still has it all", exc)

    # --- registrar ------------------------------------------------------------------------

    def _publish(self, frames: list[bytes]) -> None:
        try:
            _send(self._publisher_raw, frames)
        except zmq.Again:
            self.hub.metrics.rejected("lager", "publisher_hwm")
        self._last_publish = time.monotonic()

    async def _collector_loop(self) -> None:
        cfg = self.config
        raw = self._collector_raw
        while True:
            await self.hub.wait_capacity()
            if not _readable(raw):
                await self.collector.poll(timeout=1000)
            accepted: list[Registration] = []
            pending_keys: dict[str, Registration] = {}
            pending_uuids: dict[bytes, Registration] = {}
            echoes: list[list[bytes]] = []
            for _ in range(cfg.max_batch_messages):
                try:
                    frames = _recv_bounded(raw, 5)
                except zmq.Again:
                    break
                if frames is None:
                    self._reject("frame_count", "registration with more than 5 frames")
                    continue
                try:
                    reg = parse_registration(
                        frames,
                        max_key_bytes=cfg.max_key_bytes,
                        max_xml_bytes=cfg.max_format_bytes,
                        max_items=cfg.max_format_items,
                    )
                    held = pending_keys.get(reg.key)
                    other = pending_uuids.get(reg.uuid)
                    if held is not None and held.uuid != reg.uuid:
                        raise ChpError("key registered by another tap", reason="duplicate_key")
                    if other is not None and other.key != reg.key:
                        raise ChpError("uuid registered under another key", reason="duplicate_uuid")
                    changes = self.registrar.check(reg)
                except ProtocolError as exc:
                    self._reject(exc.reason, str(exc))
                    if exc.reason == "duplicate_key":
                        # Show the holder to the refused tap (it watches the publisher).
                        holder = pending_keys.get(reg.key) or self.registrar.by_key.get(reg.key)
                        if holder is not None:
                            echoes.append(holder.frames())
                    continue
                if changes and reg.key not in pending_keys:
                    pending_keys[reg.key] = reg
                    pending_uuids[reg.uuid] = reg
                    accepted.append(reg)
                elif reg.key in self.registrar.by_key:
                    echoes.append(self.registrar.by_key[reg.key].frames())  # a repeat: confirm it
            if accepted:
                builder = BatchBuilder()
                for reg in accepted:
                    builder.add(
                        "lager",
                        reg.value.encode("utf-8"),
                        stream=reg.key,
                        topic="registration",
                        producer=reg.uuid_str,
                        event_id=reg.uuid_str,
                        content_type=REGISTRATION_CONTENT_TYPE,
                        attrs={"version": reg.format.version},
                    )
                try:
                    commit = await self.hub.ingest(builder.build())
                except HubStopped:
                    return
                self._records.clear()  # a tap's format may have changed
                for reg in accepted:  # only this loop changes the map: the checks still hold
                    stored = self.registrar.apply(reg)
                    self._m_registered.inc()
                    self._publish(stored.frames())
                self._registered_offset = max(self._registered_offset, commit.end_offset)
                self._dirty = True
            for frames in echoes:
                self._publish(frames)
            await asyncio.sleep(0)  # a flood of refused registrations must not starve the loop

    async def _snapshot_loop(self) -> None:
        cfg = self.config
        raw = self._snapshot_raw
        while True:
            if not _readable(raw):
                await self.snapshot.poll(timeout=1000)
            for _ in range(256):
                try:
                    frames = _recv_bounded(raw, 3)
                except zmq.Again:
                    break
                if frames is None or len(frames) < 2:
                    self._reject("bad_request", "snapshot request framing")
                    continue
                identity, request = frames[0], frames[1:]
                try:
                    subtree = parse_snapshot_request(request, max_key_bytes=cfg.max_key_bytes)
                except ChpError as exc:
                    self._reject(exc.reason, str(exc))
                    continue
                self._m_snapshots.inc()
                try:
                    for reg in self.registrar.snapshot(subtree):
                        _send(raw, [identity, *reg.frames()])
                    _send(raw, [identity, *kthxbai_frames(self.registrar.sequence)])
                except zmq.ZMQError as exc:  # the mug went away (EHOSTUNREACH) or is stuck
                    self._reject("snapshot_undeliverable", str(exc))
                await asyncio.sleep(0)

    async def _hugz_loop(self) -> None:
        interval = self.config.hugz_interval_s
        while True:
            idle = time.monotonic() - self._last_publish
            if idle >= interval:
                self._publish(hugz_frames())
                self._m_hugz.inc()
                idle = 0.0
                self._repeat_marks()
            await asyncio.sleep(max(interval - idle, 0.001))

    def _repeat_marks(self) -> None:
        rounds = self._mark_rounds
        for raw_uuid, left in list(rounds.items()):
            self._send_mark(raw_uuid)
            if left <= 1:
                del rounds[raw_uuid]
            else:
                rounds[raw_uuid] = left - 1

    # --- forwarder ------------------------------------------------------------------------

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
            if not _readable(raw):
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
                self._inflight.add(future)
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
        self._inflight.discard(future)
        if future.cancelled() or future.exception() is not None or self._closing:
            return
        raw = self._fwd_out_raw
        send = _raw_send
        more = _MORE_NOBLOCK
        try:
            for f0, f1, f2, f3, f4 in forwards:
                send(raw, f0, more)
                send(raw, f1, more)
                send(raw, f2, more)
                send(raw, f3, more)
                send(raw, f4, _NOBLOCK)
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
            _raw_send(self._fwd_out_raw, MARK_PREFIX + raw_uuid, _MORE_NOBLOCK)
            _raw_send(self._fwd_out_raw, count.to_bytes(8, "big"), _MORE_NOBLOCK)
            _raw_send(self._fwd_out_raw, self._epoch, _NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("lager: mark not sent: %s", exc)

    async def _hello_loop(self) -> None:
        """Read mug subscriptions on the XPUB; answer hello topics."""
        raw = self._fwd_out_raw
        while True:
            # A send on the same socket can swallow the read signal; poll with a short timeout.
            if not _readable(raw):
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


def create_service(hub: Hub, section: LagerConfig) -> LagerService:
    return LagerService(hub, section)
