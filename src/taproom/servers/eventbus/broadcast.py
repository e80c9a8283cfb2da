"""The broadcaster: committed bursts go into the hashmap and out as BROADCAST (and as kvmsg on
the CHP publisher); the HUGZ heartbeat."""

from __future__ import annotations

import asyncio
import heapq
import logging
import time

from ...protocols.eventbus import BStarState, replicated_frames
from ..zmtp import ZmtpPublisher
from .base import Burst
from .bstar import BinaryStarPeer
from .state import EXPIRES_MS, FRAMES, SEQ, kv_frames

log = logging.getLogger("taproom.eventbus")


class Broadcaster(BinaryStarPeer):
    """Applies committed bursts in order and publishes them; sends HUGZ."""

    async def _broadcast_loop(self) -> None:
        """Supervised as ``eventbus.broadcast``. Committed bursts are applied, in order, by
        the commit's own callback (:meth:`_pump_bursts`); this task takes the front burst
        only while it waits for the peer's ack, and applies what the callbacks could not
        (a burst committed before it ran)."""
        self._broadcast_guard = self.hub.supervisor.guard(
            "eventbus.broadcast", output="eventbus_broadcast"
        )
        loop = asyncio.get_running_loop()
        bursts = self._bursts
        while True:
            self._pump_bursts()
            if not bursts or not bursts[0].resolved:
                self._broadcast_wake = loop.create_future()
                try:
                    await self._broadcast_wake  # a burst committed that the callback left here
                finally:
                    self._broadcast_wake = None
                continue
            burst = bursts[0]  # committed, waiting for the peer to confirm it
            self._broadcast_busy = True
            try:
                confirmed = await self._wait_peer_ack(burst.entries[-1][SEQ])
            finally:
                self._broadcast_busy = False
            bursts.popleft()
            self._apply_guarded(burst, confirmed)

    def _pump_bursts(self) -> None:
        """Apply the committed bursts at the front, in order, on the spot; the first that
        must wait for the peer's ack goes to the broadcaster task (and those behind it wait)."""
        guard = self._broadcast_guard
        if guard is None or self._broadcast_busy:
            return  # the task is not running yet, or holds the front burst: it goes on after
        bursts = self._bursts
        while bursts and bursts[0].resolved:
            burst = bursts[0]
            if (
                burst.needs_peer_ack
                and burst.error is None
                and self.peer_acked < burst.entries[-1][SEQ]
            ):
                wake = self._broadcast_wake
                if wake is not None and not wake.done():
                    wake.set_result(None)
                return
            bursts.popleft()
            self._apply_guarded(burst, burst.needs_peer_ack)

    def _apply_guarded(self, burst: Burst, confirmed: bool) -> None:
        """:meth:`_apply`; a burst whose apply fails unexpectedly is counted
        (``output="eventbus_broadcast"``) and logged; the admission table is counted again
        from the hashmap, and the next burst goes on."""
        try:
            self._apply(burst, confirmed)
        except Exception as exc:
            assert self._broadcast_guard is not None
            self._broadcast_guard.failed(exc, "committed burst", len(burst.entries))
            self._install(self.hashmap)
            # The hashmap may lack this burst: no checkpoint may cover it (a restart then
            # reads it from the journal again).
            self._cover_limit = min(self._cover_limit, self._applied_offset)
        finally:
            self._bursts_open -= 1
            self._bursts_done += 1
            self._burst_done.set()

    def _apply(self, burst: Burst, confirmed: bool) -> None:
        """Once ``burst`` is durable (and confirmed by the peer, if it needs that): hashmap,
        BROADCAST, ack."""
        commit = burst.commit
        if commit is None:  # the hub is stopping or the journal failed
            log.error("eventbus: commit of %d events failed: %s", len(burst.entries), burst.error)
            for entry in burst.entries:
                self.dedup.forget(entry[FRAMES][4].decode())
            # Their admission is void: count again from what is really in the hashmap.
            self._install(self.hashmap)
            return
        pub = self._publisher
        hashmap = self.hashmap
        broadcast = self.fsm.active
        chp_pub = self._chp_publisher
        if broadcast and not confirmed and self.config.role != "standalone":
            self._m_unreplicated.inc(len(burst.entries))
        sent = 0
        broadcast_seq = self._broadcast_seq
        if (
            burst.wire is not None
            and broadcast
            and (chp_pub is None or burst.kv_wire is not None)
            and burst.entries[0][SEQ] > broadcast_seq
        ):
            # a collector's kernel laid the BROADCASTs (and kvmsgs) out as one burst: the
            # hashmap here, their wire bytes in one C call, written to every subscriber (an
            # empty data frame is a deletion; a kvmsg's ttl is a deadline on the heap); their
            # topics go with the wire bytes, so no subscriber's filter parses a frame
            runs: list[tuple[bytes, int]] = []
            for entry in burst.entries:
                frames = entry[FRAMES]
                topic = frames[0]
                runs.append((topic, 1))
                current = hashmap.get(topic)
                if current is None or current[SEQ] < entry[SEQ]:
                    if frames[5]:
                        hashmap[topic] = entry
                    else:
                        hashmap.pop(topic, None)
                if entry[EXPIRES_MS]:
                    heapq.heappush(self._expiry, (entry[EXPIRES_MS], topic, entry[SEQ]))
            # (one BROADCAST an entry: the kernel laid out those it was given, in order)
            pub.publish_prepared(*burst.wire, runs if len(runs) == burst.wire[3] else None)
            if chp_pub is not None and burst.kv_wire is not None:
                chp_pub.publish_prepared(*burst.kv_wire)
            sent = len(burst.entries)
            broadcast_seq = burst.entries[-1][SEQ]
        else:
            sent, broadcast_seq = self._apply_entries(burst, pub, broadcast, broadcast_seq)
        self._broadcast_seq = broadcast_seq
        if sent:
            self._m_broadcast.inc(sent)
        self.last_seq = max(self.last_seq, burst.entries[-1][SEQ])
        self._applied_offset = max(self._applied_offset, commit.end_offset)
        if burst.reply_to is not None:  # dropped (and counted) if the peer went away
            self._collector.send([burst.reply_to, *replicated_frames(self.last_seq)])

    def _apply_entries(
        self, burst: Burst, pub: ZmtpPublisher, broadcast: bool, broadcast_seq: int
    ) -> tuple[int, int]:
        """The hashmap and the BROADCASTs (and kvmsgs) of a burst, entry by entry: how many
        were sent, and the last sequence broadcast."""
        hashmap = self.hashmap
        chp_pub = self._chp_publisher
        sent = 0
        # BROADCASTs (and kvmsgs) go out as one burst per batch, built once for every
        # subscriber (servers.zmtp.ZmtpPublisher)
        out: list[tuple[bytes, ...]] = []
        kv_out: list[tuple[bytes, ...]] = []
        for entry in burst.entries:
            seq, frames, chp, expires_ms, kv = entry
            if chp_pub is not None and kv is None:
                kv = kv_frames(frames, chp)
                entry = (seq, frames, chp, expires_ms, kv)
            topic = frames[0]
            current = hashmap.get(topic)
            if current is None or current[SEQ] < seq:
                if frames[5]:
                    hashmap[topic] = entry
                else:  # a deletion
                    hashmap.pop(topic, None)
            if expires_ms:
                heapq.heappush(self._expiry, (expires_ms, topic, seq))
            # A server never broadcasts a sequence at or below one it has broadcast (the seed:
            # "strictly incremental"); copied events it had already passed are only stored.
            if broadcast and seq > broadcast_seq:
                out.append(frames)
                if chp_pub is not None and kv is not None:
                    kv_out.append(kv)
                broadcast_seq = seq
                sent += 1
        self._flush(pub, out, chp_pub, kv_out)
        return sent, broadcast_seq

    @staticmethod
    def _flush(
        pub: ZmtpPublisher,
        out: list[tuple[bytes, ...]],
        chp_pub: ZmtpPublisher | None,
        kv_out: list[tuple[bytes, ...]],
    ) -> None:
        """Send the BROADCASTs and kvmsgs gathered so far, in order, and clear the lists."""
        if out:
            pub.send(out)
            out.clear()
        if kv_out and chp_pub is not None:
            chp_pub.send(kv_out)
            kv_out.clear()

    # --- heartbeat -------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_ms / 1000
        while True:
            self._send_hugz()
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
