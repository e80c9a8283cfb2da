"""The seed's COLLECTOR: PUB commands drained in bursts, validated, deduplicated, numbered,
journaled (and REPLICATE from the active peer, on a passive server)."""

from __future__ import annotations

import time

from ... import zmqburst
from ...errors import HubStopped
from ...eventtime import TIME_OUT_OF_RANGE
from ...protocols.eventbus import SEQUENCE, Command, Event, EventBusError, parse_pub
from ...records import EncodedBatch
from .broadcast import Broadcaster
from .state import ENTRY_OVERHEAD, PROTOCOL, Entry, seed_record
from .wire import MAX_FRAMES


class Collector(Broadcaster):
    """Turns PUB commands into journal batches (bursts) for the broadcaster."""

    async def _collector_loop(self) -> None:
        """Supervised as ``eventbus.collector``: per message in :meth:`_drain_collector`, and
        restarted by the hub's supervisor if it still dies."""
        # a burst per call (taproom.zmqburst: compiled, or pyzmq per frame)
        reader = self._collector.reader(MAX_FRAMES)
        while True:
            await self._collector.wait_readable()
            await self.hub.wait_capacity()
            try:
                self._drain_collector(reader)
            except HubStopped:
                return

    def _drain_collector(self, reader: zmqburst.Reader) -> None:
        """The seed's hot path: the frames received are the BROADCAST's frames but for the
        sequence and the (normalised) uuid and data. One journal batch: at most ``max_burst``
        commands, read until ``max_burst_bytes`` are received (the rest waits in ZeroMQ for
        the hub's capacity check, wait_capacity)."""
        cfg = self.config
        limits = self.limits
        dedup = self.dedup
        parts: list[bytes] = []
        received_ns = time.time_ns()  # one receive time per batch, as BatchBuilder does
        entries: list[Entry] = []
        events: list[Event] = []
        active = self.fsm.active
        paired = self.config.role != "standalone"
        seq = self.assigned_seq
        pack = SEQUENCE.pack
        known = dedup.seqs
        admit = self._admit
        new_entry = Entry._make
        times = self._times
        guard = self._collector_guard
        for count, msg in zmqburst.drain(
            reader, cfg.max_burst, cfg.max_burst_bytes, cfg.burst_read_ms / 1000
        ):
            # One message's unexpected error refuses that message alone (counted as
            # internal_error, logged): the burst's other messages are kept (taproom.supervise).
            # Nothing below changes the bus state before the last step that can fail.
            try:
                if count > MAX_FRAMES:
                    self._reject("frame_count", f"COLLECTOR: message over {MAX_FRAMES} frames")
                    continue
                if len(msg) == 3 and msg[1] == Command.REPLICATE.value:
                    self._on_replicate(msg[0], msg[1:])
                    continue
                try:
                    event = parse_pub(msg[1:], limits, times)
                except EventBusError as exc:
                    self._reject(exc.reason, str(exc))
                    continue
                if not active:
                    self._hold(event)
                    continue
                if event.uuid in known:
                    self._duplicate(event.uuid)
                    continue
                topic = msg[1]
                next_seq = seq + 1
                frames = (topic, pack(next_seq), msg[3], msg[4], event.uuid.encode(), event.data)
                # entry_bytes(frames, None), inline on this path
                size = ENTRY_OVERHEAD + len(topic) + len(msg[3]) + len(msg[4]) + len(event.data)
                record = seed_record(
                    topic, msg[3], msg[4], frames[4], event.data, next_seq, event.ts_ns, received_ns
                )
                if not admit(topic, next_seq, size):
                    continue
            except Exception as exc:
                guard.failed(exc, "COLLECTOR message")
                continue
            seq = next_seq
            dedup.add(event.uuid, seq)
            parts += record
            entries.append(new_entry((seq, frames, None, 0, None)))
            if paired:
                events.append(event._replace(sequence=seq))
        odd = times.take()
        if odd:
            self.hub.metrics.odd(PROTOCOL, TIME_OUT_OF_RANGE, odd)
        if entries:
            self._submit(EncodedBatch(len(entries), b"".join(parts)), entries, events)
