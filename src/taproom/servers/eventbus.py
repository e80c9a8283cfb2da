"""Event BUS server: the durable Clone-pattern bus (SNAPSHOT, PUBLISHER, COLLECTOR) with failover.

Glue between :mod:`taproom.protocols.eventbus` and pyzmq on the hub's event loop:

* COLLECTOR (ROUTER, P+2): PUB commands are drained in bursts, validated, deduplicated by
  event UUID, given the next bus sequence and submitted to the journal as one batch. Bursts are
  committed in submit order; the broadcaster awaits each commit (and, with a synced Binary Star
  peer, the peer's REPLICATED) before it publishes the burst, so a BROADCAST is never taken
  back and sequences go out strictly increasing.
* PUBLISHER (PUB, P+1): BROADCAST commands, and a HUGZ heartbeat every ``heartbeat_ms``
  carrying the current sequence and the Binary Star state.
* SNAPSHOT (ROUTER, P): SYNCSTART gets the latest event per topic (the Clone hashmap) in the
  requested subtrees above the sequence filter, then SYNCEND with the snapshot's cut.

State after a restart is rebuilt from the journal: every ``protocol = "eventbus"`` record is
one bus event (``seq`` is the bus sequence, the producer's ISO timestamp is in ``attrs``), and
a record with ``attrs = {"eventbus": "reset"}`` starts a full state copied from the peer.

Roles (``[eventbus] role``): ``standalone`` is always active. ``primary`` / ``backup`` form a
Binary Star pair (zguide chapter 4): each subscribes to the other's HUGZ, the active one sends
every committed burst to the passive one's COLLECTOR as REPLICATE, and the passive one copies
a full snapshot from the active one whenever it is not in step. A passive server becomes
active only when its peer has been silent for ``peer_timeout_ms`` and a client asks it for a
snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import struct
import time
import uuid as uuid_mod
import zlib
from collections import deque
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from ..config import config_section, setting
from ..errors import ConfigError, HubStopped
from ..hub import Hub
from ..hub.core import Commit
from ..protocols.eventbus import (
    SEQUENCE,
    BinaryStar,
    BStarState,
    Command,
    Event,
    EventBusError,
    Heartbeat,
    Limits,
    SyncEnd,
    hugz_frames,
    parse_broadcast,
    parse_pub,
    parse_replicate,
    parse_replicated,
    parse_snapshot_reply,
    parse_syncstart,
    replicate_frames,
    replicated_frames,
    syncend_frames,
    syncstart_frames,
)
from ..records import BatchBuilder
from ..zmqframes import recv_frames

__all__ = [
    "BusState",
    "EventBusConfig",
    "EventBusService",
    "checkpoint_path",
    "create_service",
    "read_checkpoint",
    "rebuild_state",
    "write_checkpoint",
]

log = logging.getLogger("taproom.eventbus")

PROTOCOL = "eventbus"
_RESET_ATTRS = b'{"eventbus":"reset"}'
_SYNC = Command.SYNC.value


@config_section("eventbus")
@dataclass(frozen=True)
class EventBusConfig:
    enabled: bool = setting(True, "the durable Clone-pattern bus")
    host: str = setting("127.0.0.1", "loopback until an operator opts in to exposure")
    port: int = setting(
        5556,
        "P: SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2 (the seed; zguide's 5556)",
        min=0,
        max=65533,
    )
    role: str = setting(
        "standalone",
        "one bus needs no peer; primary/backup form a Binary Star pair (set peer too)",
        choices=("standalone", "primary", "backup"),
    )
    peer: str = setting(
        "", "the other server's host:P when role is primary or backup (zguide uses 5556/5566)"
    )
    heartbeat_ms: int = setting(
        1000, "HUGZ once a second, as the Clone pattern does", min=10, max=60_000
    )
    peer_timeout_ms: int = setting(
        3000,
        "a peer silent for 3 heartbeats is taken as dead (bstar uses 2; one spare for GC pauses)",
        min=20,
        max=600_000,
    )
    replicate_timeout_ms: int = setting(
        2000,
        "longest a broadcast waits for the peer's REPLICATED before going out unreplicated",
        min=10,
        max=600_000,
    )
    snapshot_timeout_ms: int = setting(
        10_000, "a snapshot (to a client or from the peer) that takes longer is abandoned", min=100
    )
    max_topic_bytes: int = setting(1024, "topics are paths, not payloads", min=8, max=65535)
    max_producer_bytes: int = setting(256, "a producer id names a process", min=1, max=65535)
    max_data_bytes: int = setting(
        1024 * 1024,
        "events are state updates; a MiB is far above any sane one",
        min=64,
        max=63 * 1024 * 1024,  # under the journal's 64 MiB per record, with room for the rest
    )
    max_subtrees: int = setting(64, "subtrees per SYNCSTART", min=1, max=4096)
    max_snapshots: int = setting(
        16, "snapshots sent at once; more SYNCSTARTs wait (each holds a list of its keys)", min=1
    )
    dedup_window: int = setting(
        100_000, "event UUIDs remembered to drop a retrying producer's duplicates", min=0
    )
    max_burst: int = setting(
        4096, "PUB commands drained into one journal batch before yielding", min=1, max=65536
    )
    collector_hwm: int = setting(
        10_000, "PUB commands ZeroMQ queues before the COLLECTOR stops reading peers", min=1
    )
    publisher_hwm: int = setting(
        100_000,
        "BROADCASTs queued per subscriber before ZeroMQ drops (a client then sees a gap)",
        min=1,
    )
    snapshot_hwm: int = setting(
        100_000, "SYNC commands queued per snapshot client: a 100k-key snapshot in one go", min=1
    )
    checkpoint_interval_s: float = setting(
        60.0,
        "how often the hashmap is saved beside the journal so a restart reads only the tail "
        "(0: never; the whole journal is scanned)",
        min=0,
    )
    resync_buffer: int = setting(
        1_000_000,
        "replicated events a passive server holds while it copies a snapshot from its peer",
        min=1,
    )

    def validate(self) -> None:
        if self.role != "standalone" and not self.peer:
            raise ConfigError("role primary/backup needs peer = 'host:port'", key="peer")
        if self.peer:
            host, _, port = self.peer.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65533:
                raise ConfigError("peer must be 'host:port' (the peer's P)", key="peer")

    def limits(self) -> Limits:
        return Limits(
            self.max_topic_bytes, self.max_producer_bytes, self.max_data_bytes, self.max_subtrees
        )


# One hashmap entry: the event's bus sequence and its six BROADCAST frames, ready to send.
Entry = tuple[int, tuple[bytes, bytes, bytes, bytes, bytes, bytes]]


@dataclass
class BusState:
    """What a restart must get back: the Clone hashmap, the sequence, the recent UUIDs."""

    hashmap: dict[bytes, Entry] = field(default_factory=dict)
    sequence: int = 0
    recent_uuids: list[str] = field(default_factory=list)
    offset: int = 0  # journal offset the state covers (everything before it is applied)
    from_checkpoint: bool = False


_CHECKPOINT_MAGIC = b"TAPROOM-EVENTBUS-CHECKPOINT-1\n"


def checkpoint_path(hub: Hub) -> str:
    return os.path.join(hub.config.journal.dir, "eventbus", "checkpoint")


def write_checkpoint(path: str, state: BusState) -> None:
    """Save ``state`` atomically: temp file, fsync, rename, fsync the directory."""
    body = msgpack.packb(
        [
            state.offset,
            state.sequence,
            [list(frames) for _seq, frames in state.hashmap.values()],
            state.recent_uuids,
        ],
        use_bin_type=True,
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, _CHECKPOINT_MAGIC + struct.pack(">I", zlib.crc32(body)) + body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_checkpoint(path: str) -> BusState | None:
    """The saved state, or None when there is none or it does not verify."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    head = len(_CHECKPOINT_MAGIC)
    if not blob.startswith(_CHECKPOINT_MAGIC) or len(blob) < head + 4:
        log.warning("eventbus: %s is not a checkpoint; scanning the journal", path)
        return None
    (crc,) = struct.unpack_from(">I", blob, head)
    body = blob[head + 4 :]
    if zlib.crc32(body) != crc:
        log.warning("eventbus: %s fails its CRC; scanning the journal", path)
        return None
    try:
        offset, sequence, rows, uuids = msgpack.unpackb(body, raw=False, use_list=False)
        state = BusState(offset=offset, sequence=sequence, from_checkpoint=True)
        state.recent_uuids = list(uuids)
        for row in rows:
            seq = SEQUENCE.unpack(row[1])[0]
            state.hashmap[row[0]] = (seq, tuple(row))
    except (ValueError, TypeError, struct.error) as exc:  # a bug, not disk damage (CRC passed)
        log.warning("eventbus: %s unreadable (%s); scanning the journal", path, exc)
        return None
    return state


def rebuild_state(hub: Hub, dedup_window: int, path: str | None = None) -> BusState:
    """The checkpoint at ``path`` (if any and usable) plus the journal after it; run it in a
    thread. Without a checkpoint every bus record of the journal is read."""
    journal = hub.journal
    state = read_checkpoint(path) if path else None
    if state is not None and state.offset > journal.end_offset:
        # The journal lost a tail the checkpoint had seen (fsync = "interval" and a crash):
        # the offsets no longer match, so trust the journal alone.
        log.warning("eventbus: checkpoint is ahead of the journal; scanning the journal")
        state = None
    if state is None:
        state = BusState()
    hashmap = state.hashmap
    uuids: deque[str] = deque(state.recent_uuids, maxlen=max(dedup_window, 1))
    pack = SEQUENCE.pack
    for record in journal.read(max(state.offset, journal.first_offset)):
        if record.protocol != PROTOCOL:
            continue
        if record.attrs.get("eventbus") == "reset":
            hashmap.clear()
            state.sequence = record.seq
            continue
        topic = record.topic.encode()
        current = hashmap.get(topic)
        if current is None or current[0] < record.seq:
            hashmap[topic] = (
                record.seq,
                (
                    topic,
                    pack(record.seq),
                    record.producer.encode(),
                    str(record.attrs.get("timestamp", "")).encode(),
                    record.event_id.encode(),
                    record.payload,
                ),
            )
        state.sequence = max(state.sequence, record.seq)
        uuids.append(record.event_id)
    state.recent_uuids = list(uuids) if dedup_window else []
    state.offset = journal.end_offset
    return state


class _Dedup:
    """A bounded set of recent event UUIDs (FIFO eviction)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._order: deque[str] = deque()
        self._set: set[str] = set()

    def add(self, key: str) -> bool:
        """Remember ``key``; False if it was already there."""
        if key in self._set:
            return False
        if self.window:
            self._set.add(key)
            self._order.append(key)
            if len(self._order) > self.window:
                self._set.discard(self._order.popleft())
        return True

    def forget(self, key: str) -> None:
        self._set.discard(key)

    def recent(self) -> list[str]:
        return [key for key in self._order if key in self._set]


@dataclass(slots=True)
class _Burst:
    """Events submitted as one journal batch, waiting to be applied (and broadcast)."""

    future: asyncio.Future[Commit]
    entries: list[Entry]
    needs_peer_ack: bool = False
    reply_to: bytes | None = None  # mirror bursts: the active peer's identity, to REPLICATED


def _stream(topic: str) -> str:
    """The topic root: ``/orders/eu/1`` -> ``orders``."""
    return topic.split("/", 2)[1] if topic.count("/") >= 1 else topic


def _journal_event(builder: BatchBuilder, event: Event, seq: int, timestamp: bytes) -> None:
    """One bus event as a journal record. The original ISO timestamp rides in attrs, so a
    snapshot rebuilt from the journal replays it exactly."""
    builder.add(
        PROTOCOL,
        event.data,
        stream=_stream(event.topic),
        topic=event.topic,
        producer=event.producer,
        seq=seq,
        event_id=event.uuid,
        ts_ns=event.ts_ns,
        content_type="msgpack",
        attrs=b'{"timestamp":"' + timestamp + b'"}',
    )


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# pyzmq's Socket.send / recv_multipart wrap the Cython methods in Python that costs several
# microseconds a frame; the hot loops call the Cython methods directly with int flags.
_base_send = zmq.backend.Socket.send
_MORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
# The most frames of any command here (ROUTER identity + SYNC + 6 event frames is 8): a longer
# message is refused before its frames are kept.
_MAX_FRAMES = 16


def _send_event(sock: zmq.Socket[bytes], frames: tuple[bytes, ...] | list[bytes]) -> None:
    """The six frames of a BROADCAST (PUB sockets never block)."""
    _base_send(sock, frames[0], _MORE)
    _base_send(sock, frames[1], _MORE)
    _base_send(sock, frames[2], _MORE)
    _base_send(sock, frames[3], _MORE)
    _base_send(sock, frames[4], _MORE)
    _base_send(sock, frames[5], 0)


def _rearm(sock: zmq.asyncio.Socket) -> None:
    """After a send on a synchronous shadow: a ZeroMQ FD is edge-triggered and the send may
    have consumed the edge a pending asyncio receive on the same socket waits for. Reading
    EVENTS through the asyncio socket makes pyzmq re-check and wake that receive."""
    sock.get(zmq.EVENTS)


def _now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")


class EventBusService:
    """The three sockets, the broadcaster, the heartbeat and the Binary Star peer link."""

    def __init__(self, hub: Hub, config: EventBusConfig) -> None:
        self.hub = hub
        self.config = config
        self.limits = config.limits()
        # Largest frame the COLLECTOR accepts (ZMQ_MAXMSGSIZE, checked before ZeroMQ allocates):
        # one event's data, or a REPLICATE chunk of at most a MiB, plus room for the rest.
        self._max_frame = max(self.limits.max_data_bytes, 1024 * 1024) + 65536
        self.name = hub.config.hub.name
        self.fsm = BinaryStar(config.role, config.peer_timeout_ms / 1000, time.monotonic())
        self.hashmap: dict[bytes, Entry] = {}
        self.last_seq = 0  # highest sequence committed and applied (the snapshot's cut)
        self.assigned_seq = 0  # highest sequence handed to the journal
        self.dedup = _Dedup(config.dedup_window)
        self.synced = config.role != "backup"  # a passive server is in step with its peer
        self.peer_synced = False
        self.peer_acked = 0
        self._ack_event = asyncio.Event()
        self._degraded_until = 0
        self._resyncing = False
        self._resync_buffer: list[tuple[bytes, list[Event]]] = []
        self._resync_buffered = 0
        self._resync_overflow = False
        self._inflight: asyncio.Queue[_Burst] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self._resync_task: asyncio.Task[None] | None = None
        self._applied_offset = 0  # journal offset up to which bus records are applied
        self._snapshot_slots = asyncio.Semaphore(config.max_snapshots)
        self._snapshot_tasks: set[asyncio.Task[None]] = set()
        self._checkpointed_offset = 0
        # The last copied events, and after a takeover those of them not known to be broadcast.
        self._recent_mirror: deque[Entry] = deque(maxlen=4 * config.max_burst)
        self._uncertain: dict[str, Entry] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._sockets: list[zmq.Socket[Any]] = []
        self._reject_log_budget = 0.0
        self._stopping = False
        m = hub.metrics
        self._m_broadcast = m.counter("eventbus", "broadcast", "events", "BROADCASTs sent")
        self._m_duplicates = m.counter(
            "eventbus", "duplicates", "events", "PUBs dropped as repeats of a known event UUID"
        )
        self._m_snapshots = m.counter("eventbus", "snapshots", "calls", "Snapshots served")
        self._m_replicated = m.counter(
            "eventbus", "replicated", "events", "Events copied from the Binary Star peer"
        )
        self._m_unreplicated = m.counter(
            "eventbus",
            "unreplicated",
            "events",
            "Events broadcast before the peer confirmed them (peer dead, slow or resyncing)",
        )
        self._m_transitions = m.counter(
            "eventbus", "failover_transitions", "calls", "Binary Star state changes", ("kind",)
        )
        m.gauge_fn("eventbus", "keys", "count", "Topics in the snapshot hashmap", self._keys)
        m.gauge_fn("eventbus", "sequence", "count", "Last broadcast sequence", self._seq)
        m.gauge_fn(
            "eventbus", "bstar_state", "code", "1 primary 2 backup 3 active 4 passive", self._state
        )

    def _keys(self) -> float:
        return len(self.hashmap)

    def _seq(self) -> float:
        return self.last_seq

    def _state(self) -> float:
        return int(self.fsm.state)

    # --- lifecycle --------------------------------------------------------------------------

    async def start(self) -> dict[str, str]:
        started = time.monotonic()
        state = await asyncio.to_thread(
            rebuild_state, self.hub, self.config.dedup_window, checkpoint_path(self.hub)
        )
        self.hashmap = state.hashmap
        self.last_seq = self.assigned_seq = state.sequence
        self._applied_offset = state.offset
        # A state rebuilt by a full scan is saved at the first chance.
        self._checkpointed_offset = state.offset if state.from_checkpoint else -1
        for key in state.recent_uuids:
            self.dedup.add(key)
        log.info(
            "eventbus: %d topics, sequence %d rebuilt from %s in %.2fs; role %s",
            len(self.hashmap),
            self.last_seq,
            "a checkpoint and the journal" if state.from_checkpoint else "the journal",
            time.monotonic() - started,
            self.config.role,
        )
        self._ctx = zmq.asyncio.Context()
        addresses = self._bind()
        loops = [
            self._collector_loop(),
            self._snapshot_loop(),
            self._broadcast_loop(),
            self._heartbeat_loop(),
            self._checkpoint_loop(),
        ]
        if self.config.role != "standalone":
            self._connect_peer()
            loops += [self._peer_hugz_loop(), self._peer_ack_loop()]
        self._tasks = [asyncio.create_task(c) for c in loops]
        return addresses

    def _socket(self, kind: int, **options: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        self._sockets.append(sock)
        return sock

    def _bind(self) -> dict[str, str]:
        """SNAPSHOT at P, PUBLISHER at P+1, COLLECTOR at P+2; port 0 finds three free ones."""
        cfg = self.config
        max_frame = self._max_frame
        for _attempt in range(100):
            snapshot = self._socket(
                zmq.ROUTER,
                SNDHWM=cfg.snapshot_hwm,
                ROUTER_MANDATORY=1,
                MAXMSGSIZE=self.limits.max_topic_bytes * self.limits.max_subtrees + 4096,
            )
            publisher = self._socket(zmq.PUB, SNDHWM=cfg.publisher_hwm)
            collector = self._socket(zmq.ROUTER, RCVHWM=cfg.collector_hwm, MAXMSGSIZE=max_frame)
            try:
                if cfg.port:
                    base = cfg.port
                    snapshot.bind(_endpoint(cfg.host, base))
                else:
                    snapshot.bind(_endpoint(cfg.host, 0).rsplit(":", 1)[0] + ":*")
                    endpoint = snapshot.getsockopt(zmq.LAST_ENDPOINT)
                    assert isinstance(endpoint, bytes)
                    base = int(endpoint.rsplit(b":", 1)[1])
                    if base > 65533:
                        raise zmq.ZMQError(errno.EADDRINUSE)
                publisher.bind(_endpoint(cfg.host, base + 1))
                collector.bind(_endpoint(cfg.host, base + 2))
            except zmq.ZMQError as exc:
                for sock in (snapshot, publisher, collector):
                    sock.close(0)
                    self._sockets.remove(sock)
                if cfg.port or exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self._snapshot, self._publisher, self._collector = snapshot, publisher, collector
            # Synchronous shadows of the same sockets: NOBLOCK sends and receives in hot loops
            # without a future per call.
            self._snapshot_raw: zmq.Socket[bytes] = zmq.Socket.shadow(snapshot.underlying)
            self._publisher_raw: zmq.Socket[bytes] = zmq.Socket.shadow(publisher.underlying)
            self._collector_raw: zmq.Socket[bytes] = zmq.Socket.shadow(collector.underlying)
            return {
                "eventbus_snapshot": f"{cfg.host}:{base}",
                "eventbus_publisher": f"{cfg.host}:{base + 1}",
                "eventbus_collector": f"{cfg.host}:{base + 2}",
            }
        raise OSError(errno.EADDRINUSE, "no three consecutive free ports for the event bus")

    def _connect_peer(self) -> None:
        host, _, port_text = self.config.peer.rpartition(":")
        self._peer_host, self._peer_base = host, int(port_text)
        self._peer_sub = self._socket(zmq.SUB, RCVHWM=1000)
        self._peer_sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        self._peer_sub.connect(_endpoint(host, self._peer_base + 1))
        self._peer_dealer = self._socket(zmq.DEALER, SNDHWM=10_000, IMMEDIATE=1)
        self._peer_dealer.connect(_endpoint(host, self._peer_base + 2))
        self._peer_dealer_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self._peer_dealer.underlying)

    async def stop(self) -> None:
        """Stop reading, let submitted bursts commit and go out, close the sockets."""
        self._stopping = True
        broadcaster = self._tasks[2] if len(self._tasks) > 2 else None
        others = [t for t in self._tasks if t is not broadcaster]
        if self._resync_task is not None:
            others.append(self._resync_task)
        others.extend(self._snapshot_tasks)
        for task in others:
            task.cancel()
        if broadcaster is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._inflight.join(), self.hub.config.hub.grace_period_s)
            broadcaster.cancel()
            others.append(broadcaster)
        for task in others:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []
        if self.config.checkpoint_interval_s:
            try:
                await self.checkpoint()
            except OSError as exc:
                log.warning("eventbus: checkpoint at stop failed: %s", exc)
        for sock in self._sockets:
            sock.close(0)
        self._sockets.clear()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # --- rejects ----------------------------------------------------------------------------

    def _reject(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected(PROTOCOL, reason)
        now = time.monotonic()
        # At most ~10 reject lines a second: a broken producer must not flood the log.
        if now >= self._reject_log_budget:
            self._reject_log_budget = now + 0.1
            log.warning("eventbus: dropped command (%s): %s", reason, detail)

    # --- COLLECTOR --------------------------------------------------------------------------

    async def _collector_loop(self) -> None:
        while True:
            await self._collector.poll()
            await self.hub.wait_capacity()
            try:
                self._drain_collector()
            except HubStopped:
                return

    def _drain_collector(self) -> None:
        raw = self._collector_raw
        limits = self.limits
        builder: BatchBuilder | None = None
        entries: list[Entry] = []
        events: list[Event] = []
        active = self.fsm.active
        seq = self.assigned_seq
        pack = SEQUENCE.pack
        for _ in range(self.config.max_burst):
            try:
                msg = recv_frames(raw, _MAX_FRAMES)
            except zmq.Again:
                break
            if msg is None:
                self._reject("frame_count", f"COLLECTOR: message over {_MAX_FRAMES} frames")
                continue
            if len(msg) == 3 and msg[1] == Command.REPLICATE.value:
                self._on_replicate(msg[0], msg[1:])
                continue
            try:
                event = parse_pub(msg[1:], limits)
            except EventBusError as exc:
                self._reject(exc.reason, str(exc))
                continue
            if not active:
                self._reject("not_active", "PUB to a server that is not active")
                continue
            if not self.dedup.add(event.uuid):
                self._m_duplicates.inc()
                self._rebroadcast_uncertain(event.uuid)
                continue
            seq += 1
            if builder is None:
                builder = BatchBuilder()
            _journal_event(builder, event, seq, msg[4])
            frames = (msg[1], pack(seq), msg[3], msg[4], event.uuid.encode(), event.data)
            entries.append((seq, frames))
            if self.config.role != "standalone":
                events.append(
                    Event(
                        event.topic,
                        seq,
                        event.producer,
                        event.timestamp,
                        event.uuid,
                        event.data,
                        event.ts_ns,
                    )
                )
        if builder is None:
            return
        future = self.hub.submit(builder.build())
        self.assigned_seq = seq
        self.hub.metrics.accepted(PROTOCOL, len(entries))
        needs_ack = self._replicate(events) if events else False
        self._inflight.put_nowait(_Burst(future, entries, needs_ack))

    def _replicate(self, events: list[Event]) -> bool:
        """Send a burst to the passive peer; True when the broadcast must wait for its ack."""
        now = time.monotonic()
        if not self.fsm.peer_alive(now):
            return False
        # Chunks whose body stays under the peer's MAXMSGSIZE (the same settings on both).
        budget = self._max_frame - 65536
        chunks: list[list[Event]] = [[]]
        size = 0
        for e in events:
            cost = len(e.data) + 4 * (len(e.topic) + len(e.producer)) + len(e.timestamp) + 64
            if chunks[-1] and size + cost > budget:
                chunks.append([])
                size = 0
            chunks[-1].append(e)
            size += cost
        try:
            for chunk in chunks:
                self._peer_dealer_raw.send_multipart(replicate_frames(chunk), zmq.NOBLOCK)
        except zmq.Again:
            self._degraded_until = max(self._degraded_until, events[-1].sequence)
            return False
        finally:
            _rearm(self._peer_dealer)
        return self.peer_synced and self.peer_acked >= self._degraded_until

    # --- mirror (passive side) ----------------------------------------------------------------

    def _on_replicate(self, identity: bytes, frames: list[bytes]) -> None:
        if self.fsm.active:
            self._reject("replicate_while_active", "REPLICATE to an active server")
            return
        try:
            events = parse_replicate(frames, self.limits)
        except EventBusError as exc:
            self._reject(exc.reason, f"REPLICATE: {exc}")
            return
        if self._resyncing:
            if self._resync_buffered + len(events) > self.config.resync_buffer:
                self._resync_buffer.clear()  # too far behind: the next resync starts over
                self._resync_overflow = True
                return
            if not self._resync_overflow:
                self._resync_buffer.append((identity, events))
                self._resync_buffered += len(events)
            return
        self._apply_mirror(identity, events)

    def _apply_mirror(self, identity: bytes, events: list[Event]) -> None:
        fresh = [e for e in events if e.sequence > self.assigned_seq]
        if not fresh:
            return
        if fresh[0].sequence != self.assigned_seq + 1:
            if self.synced:
                log.warning(
                    "eventbus: replication gap (have %d, got %d): resyncing from the peer",
                    self.assigned_seq,
                    fresh[0].sequence,
                )
            self.synced = False
            return
        builder = BatchBuilder()
        entries: list[Entry] = []
        for e in fresh:
            _journal_event(builder, e, e.sequence, e.timestamp.encode())
            frames = tuple(e.frames())
            entries.append((e.sequence, frames))  # type: ignore[arg-type]
            self.dedup.add(e.uuid)
        self.assigned_seq = fresh[-1].sequence
        self._m_replicated.inc(len(fresh))
        self._recent_mirror.extend(entries)
        future = self.hub.submit(builder.build())
        self._inflight.put_nowait(_Burst(future, entries, False, identity))

    async def _resync(self) -> None:
        """Copy the active peer's full snapshot into the journal and the hashmap."""
        assert self._ctx is not None
        self._resyncing = True
        self._resync_overflow = False
        self._resync_buffer = []
        self._resync_buffered = 0
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, self.config.snapshot_hwm)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        try:
            dealer.connect(_endpoint(self._peer_host, self._peer_base))
            await dealer.send_multipart(syncstart_frames((), 0))
            timeout = self.config.snapshot_timeout_ms
            copied: dict[str, Event] = {}
            end: SyncEnd | None = None
            while end is None:
                if not await dealer.poll(timeout):
                    log.warning("eventbus: peer snapshot timed out; will retry")
                    return
                while True:
                    try:
                        frames = recv_frames(raw, _MAX_FRAMES)
                    except zmq.Again:
                        break
                    if frames is None:
                        log.warning("eventbus: peer snapshot message over %d frames", _MAX_FRAMES)
                        continue
                    reply = parse_snapshot_reply(frames, self.limits)
                    if isinstance(reply, SyncEnd):
                        end = reply
                        break
                    copied[reply.topic] = reply
            cut = end.sequence
            # A reset marker, then every entry: a restart rebuilds exactly this state.
            futures = []
            builder = BatchBuilder()
            builder.add(PROTOCOL, b"", seq=cut, attrs=_RESET_ATTRS)
            hashmap: dict[bytes, Entry] = {}
            for e in copied.values():
                _journal_event(builder, e, e.sequence, e.timestamp.encode())
                frames = e.frames()
                hashmap[frames[0]] = (e.sequence, tuple(frames))  # type: ignore[assignment]
                if len(builder) >= 10_000:
                    futures.append(self.hub.submit(builder.build()))
            futures.append(self.hub.submit(builder.build()))
            commits = await asyncio.gather(*futures)
            self._applied_offset = max(self._applied_offset, commits[-1].end_offset)
            self.hashmap = hashmap
            self.last_seq = self.assigned_seq = cut
            for e in copied.values():
                self.dedup.add(e.uuid)
            buffered, self._resync_buffer = self._resync_buffer, []
            self._resyncing = False
            if self._resync_overflow:
                log.warning("eventbus: fell too far behind while copying; copying again")
                return
            self.synced = True
            for identity, events in buffered:
                self._apply_mirror(identity, events)
            log.info("eventbus: copied %d topics up to sequence %d from the peer", len(copied), cut)
        except EventBusError as exc:
            log.warning("eventbus: bad snapshot from the peer (%s); will retry", exc)
        finally:
            self._resyncing = False
            dealer.close(0)

    # --- broadcaster ----------------------------------------------------------------------

    async def _broadcast_loop(self) -> None:
        pub = self._publisher_raw
        while True:
            burst = await self._inflight.get()
            try:
                await self._apply(burst, pub)
            finally:
                self._inflight.task_done()

    async def _apply(self, burst: _Burst, pub: zmq.Socket[bytes]) -> None:
        """Once ``burst`` is durable (and confirmed by the peer): hashmap, BROADCAST, ack."""
        try:
            commit = await burst.future
        except Exception as exc:  # the hub is stopping or the journal failed
            log.error("eventbus: commit of %d events failed: %s", len(burst.entries), exc)
            for _seq, frames in burst.entries:
                self.dedup.forget(frames[4].decode())
            return
        confirmed = burst.needs_peer_ack and await self._wait_peer_ack(burst.entries[-1][0])
        hashmap = self.hashmap
        broadcast = self.fsm.active
        if broadcast and not confirmed and self.config.role != "standalone":
            self._m_unreplicated.inc(len(burst.entries))
        for seq, frames in burst.entries:
            current = hashmap.get(frames[0])
            if current is None or current[0] < seq:
                hashmap[frames[0]] = (seq, frames)
            if broadcast:
                _send_event(pub, frames)
        if broadcast:
            self._m_broadcast.inc(len(burst.entries))
        self.last_seq = max(self.last_seq, burst.entries[-1][0])
        self._applied_offset = max(self._applied_offset, commit.end_offset)
        if burst.reply_to is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._collector_raw.send_multipart(
                    [burst.reply_to, *replicated_frames(self.last_seq)], zmq.NOBLOCK
                )
            _rearm(self._collector)

    async def _wait_peer_ack(self, seq: int) -> bool:
        """True once the peer confirmed ``seq``; False after ``replicate_timeout_ms`` or when
        the peer went silent (later bursts then stop waiting until the peer catches up)."""
        deadline = time.monotonic() + self.config.replicate_timeout_ms / 1000
        while self.peer_acked < seq:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self.fsm.peer_alive(time.monotonic()):
                if self._degraded_until <= self.peer_acked:
                    log.warning("eventbus: peer did not confirm sequence %d; broadcasting", seq)
                self._degraded_until = max(self._degraded_until, self.assigned_seq)
                return False
            self._ack_event.clear()  # no await since the check: no ack can slip in between
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._ack_event.wait(), min(remaining, 0.05))
        return True

    async def _peer_ack_loop(self) -> None:
        while True:
            frames = await self._peer_dealer.recv_multipart()
            try:
                acked = parse_replicated(frames)
            except EventBusError as exc:
                self._reject(exc.reason, f"from peer: {exc}")
                continue
            if acked > self.peer_acked:
                self.peer_acked = acked
                self._ack_event.set()

    # --- SNAPSHOT ----------------------------------------------------------------------------

    async def _snapshot_loop(self) -> None:
        raw = self._snapshot_raw
        while True:
            await self._snapshot.poll()
            while True:
                try:
                    msg = recv_frames(raw, _MAX_FRAMES)
                except zmq.Again:
                    break
                if msg is None:
                    self._reject("frame_count", f"SNAPSHOT: message over {_MAX_FRAMES} frames")
                    continue
                try:
                    request = parse_syncstart(msg[1:], self.limits)
                except EventBusError as exc:
                    self._reject(exc.reason, f"SNAPSHOT: {exc}")
                    continue
                if not self._may_serve():
                    self._reject("not_active", "SYNCSTART to a server that is not active")
                    continue
                # Snapshots run side by side so one slow client holds up only itself; each
                # SYNC is sent whole between awaits, so their messages never interleave.
                await self._snapshot_slots.acquire()
                task = asyncio.create_task(
                    self._serve_snapshot(msg[0], request.subtrees, request.sequence)
                )
                self._snapshot_tasks.add(task)
                task.add_done_callback(self._snapshot_tasks.discard)

    async def _serve_snapshot(self, identity: bytes, subtrees: tuple[str, ...], floor: int) -> None:
        try:
            await self._send_snapshot(identity, subtrees, floor)
        except zmq.ZMQError as exc:  # the client went away (EHOSTUNREACH) mid-snapshot
            log.info("eventbus: snapshot abandoned: %s", exc)
        finally:
            self._snapshot_slots.release()
            _rearm(self._snapshot)

    def _may_serve(self) -> bool:
        if self.fsm.state is BStarState.PASSIVE and not self.synced:
            return False  # never become active with state the peer had not confirmed
        before = self.fsm.state
        allowed = self.fsm.on_client_request(time.monotonic())
        if self.fsm.state is not before:
            self._transition(before)
        return allowed

    async def _send_snapshot(self, identity: bytes, subtrees: tuple[str, ...], floor: int) -> None:
        cut = self.last_seq
        prefixes = tuple(s.encode() for s in subtrees)
        values = self.hashmap.values()
        if prefixes:
            entries = [f for s, f in values if s > floor and f[0].startswith(prefixes)]
        else:
            entries = [f for s, f in values if s > floor]
        raw = self._snapshot_raw
        more = _MORE
        first = _MORE | _NOBLOCK
        send = _base_send
        deadline = time.monotonic() + self.config.snapshot_timeout_ms / 1000
        for sent, frames in enumerate(entries, 1):
            while True:
                try:
                    send(raw, identity, first)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        log.warning("eventbus: snapshot to a slow client abandoned")
                        return
                    _rearm(self._snapshot)
                    await asyncio.sleep(0.001)
            send(raw, _SYNC, more)
            send(raw, frames[0], more)
            send(raw, frames[1], more)
            send(raw, frames[2], more)
            send(raw, frames[3], more)
            send(raw, frames[4], more)
            send(raw, frames[5], 0)
            if sent % 4096 == 0:
                _rearm(self._snapshot)
                await asyncio.sleep(0)  # let the collector and broadcaster run
        while True:
            try:
                raw.send_multipart([identity, *syncend_frames(subtrees, cut)], zmq.NOBLOCK)
                break
            except zmq.Again:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(0.001)
        self._m_snapshots.inc()

    # --- checkpoint ------------------------------------------------------------------------

    def _capture(self) -> BusState:
        """The applied state, taken in one step on the loop (entries are immutable tuples)."""
        return BusState(
            hashmap=dict(self.hashmap),
            sequence=self.last_seq,
            recent_uuids=list(self.dedup.recent()),
            offset=self._applied_offset,
        )

    async def checkpoint(self) -> None:
        """Save the applied state beside the journal (a no-op when nothing changed)."""
        if self._applied_offset == self._checkpointed_offset:
            return
        state = self._capture()
        await asyncio.to_thread(write_checkpoint, checkpoint_path(self.hub), state)
        self._checkpointed_offset = state.offset

    async def _checkpoint_loop(self) -> None:
        interval = self.config.checkpoint_interval_s
        if not interval:
            return
        while True:
            await asyncio.sleep(interval)
            try:
                await self.checkpoint()
            except OSError as exc:
                log.warning("eventbus: checkpoint failed: %s", exc)

    # --- heartbeat and Binary Star ---------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_ms / 1000
        while True:
            frames = hugz_frames(
                self.last_seq,
                self.name,
                _now_iso(),
                str(uuid_mod.uuid4()),
                int(self.fsm.state),
                self.synced or self.fsm.active,
            )
            with contextlib.suppress(zmq.ZMQError):
                self._publisher_raw.send_multipart(frames, zmq.NOBLOCK)
            if (
                self.config.role != "standalone"
                and not self.fsm.active
                and not self.synced
                and not self._resyncing
                and self._peer_state == BStarState.ACTIVE
                and self.fsm.peer_alive(time.monotonic())
                and not self._stopping
            ):
                self._resync_task = asyncio.create_task(self._resync())
            await asyncio.sleep(interval)

    _peer_state = 0
    _peer_seq = 0

    def _rebroadcast_uncertain(self, key: str) -> None:
        """A retried PUB of an event copied from the dead active, maybe never broadcast."""
        entry = self._uncertain.pop(key, None)
        if entry is None or not self.fsm.active:
            return
        _send_event(self._publisher_raw, entry[1])
        self._m_broadcast.inc()

    async def _peer_hugz_loop(self) -> None:
        while True:
            frames = await self._peer_sub.recv_multipart()
            try:
                beat = parse_broadcast(frames, self.limits)
            except EventBusError:
                continue
            if not isinstance(beat, Heartbeat):
                continue
            self._peer_state = beat.state
            self._peer_seq = beat.sequence
            self.peer_synced = beat.synced
            before = self.fsm.state
            self.fsm.on_peer(beat.state, time.monotonic())
            if self.fsm.state is not before:
                self._transition(before)
            if self.fsm.problem:
                log.error("eventbus: Binary Star conflict: %s", self.fsm.problem)
                self._m_transitions.labels(kind=self.fsm.problem.replace(" ", "_")).inc()
                self.fsm.problem = ""

    def _transition(self, before: BStarState) -> None:
        after = self.fsm.state
        log.warning("eventbus: %s -> %s", before.name.lower(), after.name.lower())
        self._m_transitions.labels(kind=after.name.lower()).inc()
        if after is BStarState.PASSIVE:
            self.synced = False  # copy the active peer's state before serving again
        if after is BStarState.ACTIVE:
            self.synced = True
            self.peer_synced = False
            self._degraded_until = self.assigned_seq
            # Copied events the old active may not have broadcast before it died: its last
            # HUGZ said how far it had got. A producer retrying one of them gets it broadcast.
            self._uncertain = {
                frames[4].decode(): (seq, frames)
                for seq, frames in self._recent_mirror
                if seq > self._peer_seq
            }
            self._recent_mirror.clear()


def create_service(hub: Hub, config: EventBusConfig) -> EventBusService:
    return EventBusService(hub, config)
