"""Binary Star failover: the peer link, replication to the passive server, mirror and resync."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid as uuid_mod
from typing import Any

import zmq
import zmq.asyncio

from ...protocols.eventbus import (
    BStarState,
    Command,
    Event,
    EventBusError,
    Heartbeat,
    SyncEnd,
    hugz_frames,
    kvmsg,
    parse_broadcast,
    parse_replicate,
    parse_replicated,
    parse_snapshot_reply,
)
from ...records import BatchBuilder
from ...zmqframes import recv_frames
from .accept import Acceptor
from .base import Burst
from .state import FRAMES, PROTOCOL, RESET_ATTRS, Entry, entry_bytes, journal_event, new_entry
from .wire import MAX_FRAMES, endpoint, now_iso

log = logging.getLogger("taproom.eventbus")

# Duplicate acknowledgements carried by one HUGZ (about 50 bytes each).
ACKS_PER_HUGZ = 1024


class BinaryStarPeer(Acceptor):
    """The Binary Star pair: HUGZ from the peer, REPLICATE / REPLICATED, full resync."""

    def _connect_peer(self) -> None:
        host, _, port_text = self.config.peer.rpartition(":")
        self._peer_host, self._peer_base = host, int(port_text)
        # What the peer sends is bounded like any client's: HUGZ (with at most ACKS_PER_HUGZ
        # acks, ~50 bytes each) and REPLICATED (18 bytes).
        self._peer_sub = self._socket(zmq.SUB, RCVHWM=1000, MAXMSGSIZE=256 * 1024)
        self._peer_sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        self._peer_curve(self._peer_sub, "eventbus_publisher")
        self._peer_sub.connect(endpoint(host, self._peer_base + 1))
        self._peer_sub_raw = zmq.Socket.shadow(self._peer_sub.underlying)
        self._peer_dealer = self._socket(zmq.DEALER, SNDHWM=10_000, IMMEDIATE=1, MAXMSGSIZE=1024)
        self._peer_curve(self._peer_dealer, "eventbus_collector")
        self._peer_dealer.connect(endpoint(host, self._peer_base + 2))
        self._peer_dealer_raw = zmq.Socket.shadow(self._peer_dealer.underlying)

    def _peer_curve(self, sock: zmq.Socket[Any], listener: str) -> None:
        """With CURVE on our own ``listener``, the peer's is taken to use it too: a Binary
        Star pair is one service to its clients (who fail over with one server key), so both
        servers share a key pair, and each connects to the other with it as a client (its
        public key must then be among curve_allowed_clients, when a list is given)."""
        assert self._zmq_access is not None
        keys = self._zmq_access.policy(listener).curve
        if keys is not None:
            sock.curve_serverkey = keys.public_z85
            sock.curve_publickey = keys.public_z85
            sock.curve_secretkey = keys.secret_z85

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
        for e in events:
            self._release_held(e.uuid)
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
            journal_event(builder, e, e.sequence, e.timestamp.encode())
            entry = new_entry(e.sequence, tuple(e.frames()), e.chp, e.expires_ms)
            entries.append(entry)
            size = entry_bytes(entry[FRAMES], e.chp) if e.data else 0
            self._track(entry[FRAMES][0], e.sequence, size)
            self.dedup.add(e.uuid, e.sequence)
        self.assigned_seq = fresh[-1].sequence
        self._m_replicated.inc(len(fresh))
        self._journal_burst(builder.build(), Burst(entries, False, identity))

    async def _resync(self) -> None:
        """Copy the active peer's whole state (COPY on its SNAPSHOT port) into the journal and
        the hashmap."""
        assert self._ctx is not None
        self._resyncing = True
        self._resync_overflow = False
        self._resync_buffer = []
        self._resync_buffered = 0
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, self.config.snapshot_hwm)
        dealer.setsockopt(zmq.MAXMSGSIZE, self._max_frame)
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(dealer.underlying)
        try:
            self._peer_curve(dealer, "eventbus_snapshot")
            dealer.connect(endpoint(self._peer_host, self._peer_base))
            await dealer.send_multipart([Command.COPY.value])
            timeout = self.config.snapshot_timeout_ms
            copied: list[Event] = []
            end: SyncEnd | None = None
            while end is None:
                if not await dealer.poll(timeout):
                    log.warning("eventbus: copy from the peer timed out; will retry")
                    return
                while True:
                    try:
                        frames = recv_frames(raw, MAX_FRAMES)
                    except zmq.Again:
                        break
                    if frames is None:
                        log.warning("eventbus: peer copy message over %d frames", MAX_FRAMES)
                        continue
                    if frames[0] == Command.REPLICATE.value:
                        copied.extend(parse_replicate(frames, self.limits))
                        continue
                    reply = parse_snapshot_reply(frames, self.limits)
                    if isinstance(reply, SyncEnd):
                        end = reply
                        break
            cut = end.sequence
            # A reset marker, then every entry: a restart rebuilds exactly this state.
            futures = []
            builder = BatchBuilder()
            builder.add(PROTOCOL, b"", seq=cut, attrs=RESET_ATTRS)
            hashmap: dict[bytes, Entry] = {}
            for e in copied:
                journal_event(builder, e, e.sequence, e.timestamp.encode())
                entry = new_entry(e.sequence, tuple(e.frames()), e.chp, e.expires_ms)
                hashmap[entry[FRAMES][0]] = entry
                if len(builder) >= 10_000:
                    futures.append(self.hub.submit(builder.build()))
            futures.append(self.hub.submit(builder.build()))
            commits = await asyncio.gather(*futures)
            self._applied_offset = max(self._applied_offset, commits[-1].end_offset)
            self._install(hashmap)
            self.last_seq = self.assigned_seq = cut
            for e in copied:
                self.dedup.add(e.uuid, e.sequence)
                self._release_held(e.uuid)
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
            log.warning("eventbus: bad copy from the peer (%s); will retry", exc)
        finally:
            self._resyncing = False
            dealer.close(0)

    # --- replication acks (active side) -----------------------------------------------------

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
        """Supervised as ``eventbus.peer_ack``."""
        guard = self.hub.supervisor.guard("eventbus.peer_ack", protocol=PROTOCOL, logger=log)
        while True:
            frames = await self._peer_dealer.recv_multipart()
            try:
                self._on_peer_ack(frames)
            except Exception as exc:
                guard.failed(exc, "REPLICATED from the peer")

    def _on_peer_ack(self, frames: list[bytes]) -> None:
        try:
            acked = parse_replicated(frames)
        except EventBusError as exc:
            self._reject(exc.reason, f"from peer: {exc}")
            return
        if acked > self.peer_acked:
            self.peer_acked = acked
            self._ack_event.set()

    # --- the peer's heartbeat and state changes -----------------------------------------------

    _peer_state = 0

    async def _peer_hugz_loop(self) -> None:
        """Supervised as ``eventbus.peer_hugz``: a HUGZ that fails unexpectedly is counted
        and skipped (:meth:`_read_peer_hugz`)."""
        while True:
            await self._peer_sub.poll(1000)  # timed: the FD is edge-triggered
            self._read_peer_hugz()

    def _read_peer_hugz(self) -> None:
        """Apply every HUGZ of the peer already received. Also called before this server
        decides that its peer is dead: on a busy server the peer's HUGZ may be waiting unread,
        and taking over from a live peer makes two actives."""
        while True:
            try:
                frames = recv_frames(self._peer_sub_raw, MAX_FRAMES)
            except zmq.Again:
                return
            if frames is None:
                continue
            try:
                self._on_peer_hugz(frames)
            except Exception as exc:
                self._peer_hugz_guard.failed(exc, "HUGZ from the peer")

    def _on_peer_hugz(self, frames: list[bytes]) -> None:
        """One message from the peer's PUBLISHER: its state when it is a HUGZ."""
        try:
            beat = parse_broadcast(frames, self.limits)
        except EventBusError:
            return
        if not isinstance(beat, Heartbeat):
            return
        self._peer_state = beat.state
        self.peer_synced = beat.synced
        before = self.fsm.state
        self.fsm.on_peer(beat.state, time.monotonic())
        if self.fsm.state is not before:
            self._transition(before)
        if self.fsm.problem:
            log.error("eventbus: Binary Star conflict: %s", self.fsm.problem)
            self._m_transitions.labels(kind=self.fsm.problem.replace(" ", "_")).inc()
            self.fsm.problem = ""

    def _take_acks(self) -> list[tuple[str, int]]:
        """Duplicate acknowledgements whose events are applied (so durable and broadcast)."""
        acks = []
        for key, seq in list(self._dup_acks.items()):
            if seq <= self.last_seq:
                acks.append((key, seq))
                del self._dup_acks[key]
                if len(acks) == ACKS_PER_HUGZ:
                    break
        return acks

    def _send_hugz(self) -> None:
        """HUGZ on the seed's PUBLISHER (sequence, Binary Star state, duplicate acks) and, from
        an active server, on the CHP publisher: a Clone client takes any message as a sign of
        life, and a passive server serves it nothing."""
        active = self.fsm.active
        frames = hugz_frames(
            self.last_seq,
            self.name,
            now_iso(),
            str(uuid_mod.uuid4()),
            int(self.fsm.state),
            self.synced or active,
            self._take_acks() if active else (),
        )
        self._publisher.send([frames])
        if active and self._chp_publisher is not None:
            self._chp_publisher.send([kvmsg.hugz_frames(self.last_seq)])

    def _transition(self, before: BStarState) -> None:
        after = self.fsm.state
        log.warning("eventbus: %s -> %s", before.name.lower(), after.name.lower())
        self._m_transitions.labels(kind=after.name.lower()).inc()
        if after is BStarState.PASSIVE:
            self.synced = False  # copy the active peer's state before serving again
        if after is BStarState.ACTIVE:
            self.synced = True
            self.peer_synced = False
            # New sequences go above anything this server ever broadcast, so that its
            # broadcasts stay strictly increasing whatever it copied while passive.
            self.assigned_seq = max(self.assigned_seq, self._broadcast_seq)
            self._degraded_until = self.assigned_seq
            self._send_hugz()  # say so before the first broadcast as the active server
            self._apply_held()
