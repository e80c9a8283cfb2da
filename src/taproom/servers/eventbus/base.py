"""The shared state of the Event BUS service, which the parts below build on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from ...eventtime import EventTimes
from ...hub import Hub
from ...hub.core import Commit
from ...protocols.eventbus import BinaryStar, Event
from ...records import EncodedBatch
from ...supervise import Guard
from ...zmqaccess import ZmqAccess
from ..zmtp import ZmtpPublisher, ZmtpSocket
from .config import EventBusConfig
from .state import PROTOCOL, Dedup, Entry

log = logging.getLogger("taproom.eventbus")


@dataclass(slots=True)
class Burst:
    """Events submitted as one journal batch, waiting to be applied (and broadcast)."""

    entries: list[Entry]
    needs_peer_ack: bool = False
    reply_to: bytes | None = None  # mirror bursts: the active peer's identity, to REPLICATED
    # The entries' BROADCASTs laid out by the collector's kernel (buffer, frame ends, frame
    # counts, messages: ZmtpPublisher.publish_prepared), or None: built from the entries.
    wire: tuple[Any, Any, Any, int] | None = None
    # ... and their kvmsgs for the CHP publisher (the CHP collector's kernel), or None.
    kv_wire: tuple[Any, Any, Any, int] | None = None
    # Set by the hub's commit callback: durable (its Commit) or refused (the error).
    resolved: bool = False
    commit: Commit | None = None
    error: BaseException | None = None


class Batch:
    """One journal batch on its way, built by a collector: records, hashmap entries,
    replicas, the last sequence, the records' kinds."""

    __slots__ = ("entries", "events", "kinds", "parts", "received_ns", "seq", "wire")

    def __init__(self, seq: int, wire: bool, kinds: set[str], received_ns: int = 0) -> None:
        self.parts: list[bytes] = []
        self.entries: list[Entry] = []
        self.events: list[Event] = []
        self.seq = seq
        # one receive time per batch, as BatchBuilder does
        self.received_ns = received_ns or time.time_ns()
        self.wire = wire  # every BROADCAST of the batch is laid out by a kernel
        self.kinds = kinds  # EncodedBatch.kinds of the records in parts


class BusBase:
    """The state every part of the bus shares: hashmap, sequences, queues, sockets, metrics."""

    # Bound by the service's start(); each libzmq one has a synchronous shadow for NOBLOCK hot
    # loops. The collectors and publishers are taproom's own ZeroMQ transport (servers.zmtp,
    # issue 26: bounded in bytes, every message a subscriber misses counted).
    _snapshot: zmq.asyncio.Socket
    _publisher: ZmtpPublisher
    _collector: ZmtpSocket
    _snapshot_raw: zmq.Socket[bytes]
    # The CHP dialect's group (config ``chp``): ROUTER, PUB, and a PULL or SUB collector.
    _chp_snapshot: zmq.asyncio.Socket
    _chp_collector: ZmtpSocket
    _chp_snapshot_raw: zmq.Socket[bytes]
    _chp_publisher: ZmtpPublisher | None = None
    # The Binary Star peer link (roles primary / backup).
    _peer_host: str
    _peer_base: int
    _peer_sub: zmq.asyncio.Socket
    _peer_sub_raw: zmq.Socket[bytes]
    _peer_dealer: zmq.asyncio.Socket
    _peer_dealer_raw: zmq.Socket[bytes]

    def __init__(self, hub: Hub, config: EventBusConfig) -> None:
        self.hub = hub
        self.config = config
        self.limits = config.limits()
        # Largest message a collector accepts, all frames (checked at each frame header, before
        # the frame is read), and the peer link's ZMQ_MAXMSGSIZE: one event's data, or a
        # REPLICATE chunk of at most a MiB, plus room for the rest (topic, producer, timestamp,
        # uuid, ZMTP framing: far below 64 KiB together).
        self._max_frame = max(self.limits.max_data_bytes, 1024 * 1024) + 65536
        self.name = hub.config.hub.name
        self.fsm = BinaryStar(config.role, config.peer_timeout_ms / 1000, time.monotonic())
        self.hashmap: dict[bytes, Entry] = {}
        self.last_seq = 0  # highest sequence committed and applied (the snapshot's cut)
        self.assigned_seq = 0  # highest sequence handed to the journal
        self._broadcast_seq = 0  # highest sequence this server has broadcast
        self.dedup = Dedup(config.dedup_window)
        self.synced = config.role != "backup"  # a passive server is in step with its peer
        self.peer_synced = False
        self.peer_acked = 0
        # The hashmap as it will be once every accepted burst is applied: topic -> (sequence,
        # bytes charged). Limits and ttl expiry are decided on it, at accept time.
        self._accepted: dict[bytes, tuple[int, int]] = {}
        self._accepted_bytes = 0
        # ... and that charge, held in the process budget (taproom.budget): an update that does
        # not fit in its share is refused (hashmap_full).
        self._hashmap_holder = hub.budget.holder("eventbus_hashmap")
        # A passive server's client updates, by UUID in arrival order (clonesrv6 "pending").
        self._held: dict[str, Event] = {}
        self._held_bytes = 0
        # Repeated PUBs of committed events: UUID -> sequence, told to producers in HUGZ.
        self._dup_acks: dict[str, int] = {}
        # (expiry ms, topic, sequence) of entries with a ttl, a heap.
        self._expiry: list[tuple[int, bytes, int]] = []
        self._ack_event = asyncio.Event()
        self._degraded_until = 0
        self._resyncing = False
        self._resync_buffer: list[tuple[bytes, list[Event]]] = []
        self._resync_buffered = 0
        self._resync_overflow = False
        # Bursts submitted and not yet applied, in submission order (the journal's): applied
        # from the front by the commit's own callback, or by the broadcaster task when the
        # front one waits for the peer's ack (broadcast.py).
        self._bursts: deque[Burst] = deque()
        self._broadcast_wake: asyncio.Future[None] | None = None  # the task, parked
        self._broadcast_busy = False  # the task is applying the front burst
        self._broadcast_guard: Guard | None = None  # set once the broadcaster runs
        # Bursts submitted and not yet applied (queued or being applied): while there are none,
        # every bus record in the journal is applied (a checkpoint covers the journal's end).
        self._bursts_open = 0
        # Bursts ever queued and ever done with (applied or failed), in queue order: a snapshot
        # waits until the bursts queued before its request are done (snapshot.py, _settle).
        self._bursts_queued = 0
        self._bursts_done = 0
        self._burst_done = asyncio.Event()
        self._cover_limit = 1 << 63  # a burst whose apply failed: checkpoints stay before it
        self._tasks: list[asyncio.Task[None]] = []
        self._resync_task: asyncio.Task[None] | None = None
        self._applied_offset = 0  # journal offset up to which bus records are applied
        self._snapshot_slots = asyncio.Semaphore(config.max_snapshots)
        self._snapshot_tasks: set[asyncio.Task[None]] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._zmq_access: ZmqAccess | None = None
        self._sockets: list[zmq.Socket[Any]] = []
        self._own: list[ZmtpSocket | ZmtpPublisher] = []  # on taproom's transport
        self._reject_log_budget = 0.0
        self._stopping = False
        # Producer times to ts_ns by the one rule (taproom.eventtime); counted per burst.
        self._times = EventTimes()
        # Per-message supervision of the loops that read sockets (taproom.supervise).
        supervisor = hub.supervisor
        self._collector_guard = supervisor.guard(
            "eventbus.collector", protocol=PROTOCOL, logger=log
        )
        self._chp_collector_guard = supervisor.guard(
            "eventbus.chp_collector", protocol=PROTOCOL, logger=log
        )
        self._accept_guard = supervisor.guard("eventbus.accept", protocol=PROTOCOL, logger=log)
        self._peer_hugz_guard = supervisor.guard(
            "eventbus.peer_hugz", protocol=PROTOCOL, logger=log
        )
        m = hub.metrics
        # a tally (taproom.metrics): counted for every burst, on the loop
        self._m_broadcast = m.tally("eventbus", "broadcast", "events", "BROADCASTs sent")
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
        self._m_held = m.counter(
            "eventbus",
            "held",
            "events",
            "Client updates a passive server held, and applied at takeover",
            ("kind",),
        )
        self._m_expired = m.counter("eventbus", "expired", "events", "Keys deleted by their ttl")
        self._m_transitions = m.counter(
            "eventbus", "failover_transitions", "calls", "Binary Star state changes", ("kind",)
        )
        m.gauge_fn("eventbus", "keys", "count", "Topics in the snapshot hashmap", self._keys)
        m.gauge_fn(
            "eventbus",
            "hashmap",
            "bytes",
            "Memory charged to the hashmap (max_hashmap_bytes)",
            self._hashmap_bytes,
        )
        m.gauge_fn("eventbus", "sequence", "count", "Last broadcast sequence", self._seq)
        m.gauge_fn(
            "eventbus", "bstar_state", "code", "1 primary 2 backup 3 active 4 passive", self._state
        )

    def _keys(self) -> float:
        return len(self.hashmap)

    def _hashmap_bytes(self) -> float:
        return self._accepted_bytes

    def _seq(self) -> float:
        return self.last_seq

    def _state(self) -> float:
        return int(self.fsm.state)

    def _journal_burst(self, batch: EncodedBatch, burst: Burst) -> None:
        """Submit ``burst``'s journal batch; the broadcaster applies it once it is committed,
        from the commit's own delivery (Hub.submit_callback: no future, no task woken for
        one update in flight, issue 32)."""

        def committed(commit: Commit | None, error: BaseException | None) -> None:
            burst.commit, burst.error, burst.resolved = commit, error, True
            self._pump_bursts()

        self.hub.submit_callback(batch, committed)  # never calls back before it returns
        self._bursts_open += 1
        self._bursts_queued += 1
        self._bursts.append(burst)

    def _pump_bursts(self) -> None:  # broadcast.py
        raise NotImplementedError

    async def _drained(self) -> None:
        """Until no burst is open (each applied or failed)."""
        while self._bursts_open:
            self._burst_done.clear()
            await self._burst_done.wait()

    async def _settle(self, timeout: float) -> bool:
        """Wait until every burst queued before now is applied (or failed): then the hashmap
        holds every update this server accepted before the call. False if ``timeout`` (s)
        passed first (a journal that does not commit)."""
        target = self._bursts_queued
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel (a stop)
            async with asyncio.timeout(timeout):
                while self._bursts_done < target:
                    self._burst_done.clear()
                    await self._burst_done.wait()
        except TimeoutError:
            return False
        return True

    def _socket(self, kind: int, **options: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        for name, value in options.items():
            sock.setsockopt(getattr(zmq, name), value)
        self._sockets.append(sock)
        return sock

    def _reject(self, reason: str, detail: str) -> None:
        self.hub.metrics.rejected(PROTOCOL, reason)
        now = time.monotonic()
        # At most ~10 reject lines a second: a broken producer must not flood the log.
        if now >= self._reject_log_budget:
            self._reject_log_budget = now + 0.1
            log.warning("eventbus: dropped command (%s): %s", reason, detail)
