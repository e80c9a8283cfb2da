"""The seed's COLLECTOR: PUB commands drained in bursts, validated, deduplicated, numbered,
journaled (and REPLICATE from the active peer, on a passive server)."""

from __future__ import annotations

import zmq
import zmq.asyncio

from ...errors import HubStopped
from ...protocols.eventbus import SEQUENCE, Command, Event, EventBusError, parse_pub
from ...records import BatchBuilder
from ...zmqframes import recv_frames
from .broadcast import Broadcaster
from .state import Entry, entry_bytes, journal_event
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
        """The seed's hot path: the frames received are the BROADCAST's frames but for the
        sequence and the (normalised) uuid and data."""
        raw = self._collector_raw
        limits = self.limits
        dedup = self.dedup
        builder: BatchBuilder | None = None
        entries: list[Entry] = []
        events: list[Event] = []
        active = self.fsm.active
        paired = self.config.role != "standalone"
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
                self._hold(event)
                continue
            if event.uuid in dedup:
                self._duplicate(event.uuid)
                continue
            frames = (msg[1], pack(seq + 1), msg[3], msg[4], event.uuid.encode(), event.data)
            if not self._admit(msg[1], seq + 1, entry_bytes(frames, None)):
                continue
            seq += 1
            dedup.add(event.uuid, seq)
            if builder is None:
                builder = BatchBuilder()
            journal_event(builder, event, seq, msg[4])
            entries.append(Entry(seq, frames))
            if paired:
                events.append(event._replace(sequence=seq))
        if builder is not None:
            self._submit(builder, entries, events)
