"""The COLLECTOR: PUB commands drained in bursts, validated, deduplicated, numbered, journaled."""

from __future__ import annotations

import zmq
import zmq.asyncio

from ...errors import HubStopped
from ...protocols.eventbus import (
    SEQUENCE,
    Command,
    Event,
    EventBusError,
    parse_pub,
)
from ...records import BatchBuilder
from ...zmqframes import recv_frames
from .base import Burst
from .broadcast import Broadcaster
from .state import PROTOCOL, Entry, journal_event
from .wire import MAX_FRAMES


class Collector(Broadcaster):
    """Turns PUB commands into journal batches (bursts) for the broadcaster."""

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
                msg = recv_frames(raw, MAX_FRAMES)
            except zmq.Again:
                break
            if msg is None:
                self._reject("frame_count", f"COLLECTOR: message over {MAX_FRAMES} frames")
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
            journal_event(builder, event, seq, msg[4])
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
        self._inflight.put_nowait(Burst(future, entries, needs_ack))
