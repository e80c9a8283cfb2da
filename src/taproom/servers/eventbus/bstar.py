"""Binary Star failover: the peer link, replication to the passive server, mirror and resync."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import zmq
import zmq.asyncio

from ...protocols.eventbus import (
    BStarState,
    Event,
    EventBusError,
    Heartbeat,
    SyncEnd,
    parse_broadcast,
    parse_replicate,
    parse_replicated,
    parse_snapshot_reply,
    replicate_frames,
    syncstart_frames,
)
from ...records import BatchBuilder
from ...zmqframes import recv_frames
from .base import Burst, BusBase
from .state import PROTOCOL, RESET_ATTRS, Entry, journal_event
from .wire import MAX_FRAMES, endpoint, rearm, send_event

log = logging.getLogger("taproom.eventbus")


class BinaryStarPeer(BusBase):
    """The Binary Star pair: HUGZ from the peer, REPLICATE / REPLICATED, full resync."""

    def _connect_peer(self) -> None:
        host, _, port_text = self.config.peer.rpartition(":")
        self._peer_host, self._peer_base = host, int(port_text)
        self._peer_sub = self._socket(zmq.SUB, RCVHWM=1000)
        self._peer_sub.setsockopt(zmq.SUBSCRIBE, b"HUGZ")
        self._peer_sub.connect(endpoint(host, self._peer_base + 1))
        self._peer_dealer = self._socket(zmq.DEALER, SNDHWM=10_000, IMMEDIATE=1)
        self._peer_dealer.connect(endpoint(host, self._peer_base + 2))
        self._peer_dealer_raw: zmq.Socket[bytes] = zmq.Socket.shadow(self._peer_dealer.underlying)

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
            rearm(self._peer_dealer)
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
            journal_event(builder, e, e.sequence, e.timestamp.encode())
            frames = tuple(e.frames())
            entries.append((e.sequence, frames))  # type: ignore[arg-type]
            self.dedup.add(e.uuid)
        self.assigned_seq = fresh[-1].sequence
        self._m_replicated.inc(len(fresh))
        self._recent_mirror.extend(entries)
        future = self.hub.submit(builder.build())
        self._inflight.put_nowait(Burst(future, entries, False, identity))

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
            dealer.connect(endpoint(self._peer_host, self._peer_base))
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
                        frames = recv_frames(raw, MAX_FRAMES)
                    except zmq.Again:
                        break
                    if frames is None:
                        log.warning("eventbus: peer snapshot message over %d frames", MAX_FRAMES)
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
            builder.add(PROTOCOL, b"", seq=cut, attrs=RESET_ATTRS)
            hashmap: dict[bytes, Entry] = {}
            for e in copied.values():
                journal_event(builder, e, e.sequence, e.timestamp.encode())
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

    # --- the peer's heartbeat and state changes -----------------------------------------------

    _peer_state = 0
    _peer_seq = 0

    def _rebroadcast_uncertain(self, key: str) -> None:
        """A retried PUB of an event copied from the dead active, maybe never broadcast."""
        entry = self._uncertain.pop(key, None)
        if entry is None or not self.fsm.active:
            return
        send_event(self._publisher_raw, entry[1])
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
