"""The broadcaster: committed bursts go into the hashmap and out as BROADCAST; the HUGZ heartbeat."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid as uuid_mod

import zmq
import zmq.asyncio

from ...protocols.eventbus import (
    BStarState,
    hugz_frames,
    replicated_frames,
)
from .base import Burst
from .bstar import BinaryStarPeer
from .wire import now_iso, rearm, send_event

log = logging.getLogger("taproom.eventbus")


class Broadcaster(BinaryStarPeer):
    """Applies committed bursts in order and publishes them; sends HUGZ."""

    async def _broadcast_loop(self) -> None:
        pub = self._publisher_raw
        while True:
            burst = await self._inflight.get()
            try:
                await self._apply(burst, pub)
            finally:
                self._inflight.task_done()

    async def _apply(self, burst: Burst, pub: zmq.Socket[bytes]) -> None:
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
                send_event(pub, frames)
        if broadcast:
            self._m_broadcast.inc(len(burst.entries))
        self.last_seq = max(self.last_seq, burst.entries[-1][0])
        self._applied_offset = max(self._applied_offset, commit.end_offset)
        if burst.reply_to is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._collector_raw.send_multipart(
                    [burst.reply_to, *replicated_frames(self.last_seq)], zmq.NOBLOCK
                )
            rearm(self._collector)

    # --- heartbeat ---------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_ms / 1000
        while True:
            frames = hugz_frames(
                self.last_seq,
                self.name,
                now_iso(),
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
