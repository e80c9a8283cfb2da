"""The seed's COLLECTOR: PUB commands drained in bursts, validated, deduplicated, numbered,
journaled (and REPLICATE from the active peer, on a passive server)."""

from __future__ import annotations

from typing import Any

from ... import zmqburst
from ...errors import HubStopped
from ...eventtime import TIME_OUT_OF_RANGE
from ...protocols.eventbus import SEQUENCE, Command, Event, EventBusError, parse_pub
from ...records import EncodedBatch
from .base import Batch
from .broadcast import Broadcaster
from .kernel import SeedKernel
from .state import ENTRY_OVERHEAD, PROTOCOL, SEED_KINDS, seed_record
from .wire import MAX_FRAMES


class Collector(Broadcaster):
    """Turns PUB commands into journal batches (bursts) for the broadcaster."""

    _kernel: SeedKernel | None = None

    async def _collector_loop(self) -> None:
        """Supervised as ``eventbus.collector``: per message in :meth:`_drain_collector`, and
        restarted by the hub's supervisor if it still dies."""
        # a burst per call (the transport's reader: compiled or Python, one Burst shape)
        reader = self._collector.reader(MAX_FRAMES)
        cfg = self.config
        self._kernel = SeedKernel.create(self.limits, cfg.max_burst, cfg.max_burst_bytes)
        stopped = False

        def direct() -> bool:
            # Served in the read callback while this task is parked on the socket (no task
            # wake-up before the work; issue 32); the task takes over when the hub is full,
            # more is ready, or the hub is stopping.
            nonlocal stopped
            if not self.hub.has_capacity:
                return False
            try:
                self._drain_collector(reader)
            except HubStopped:
                stopped = True
                return False
            # True: the socket commits what was submitted now (Hub.commit_now)
            return not self._collector.readable

        while True:
            await self._collector.wait_readable(direct=direct)
            if stopped:
                return
            await self.hub.wait_capacity()
            try:
                self._drain_collector(reader)
            except HubStopped:
                return
            if not self._collector.readable:
                # Nothing more to read: the burst's commit (and its BROADCAST, by the
                # commit's callback) needs no turn of its own when nothing else is ready to
                # run (Hub.commit_now; issue 32).
                self.hub.commit_now()

    def _drain_collector(self, reader: zmqburst.Reader) -> None:
        """The seed's hot path: the frames received are the BROADCAST's frames but for the
        sequence and the (normalised) uuid and data. One journal batch: bursts read while
        commands are ready (zmqburst.bursts' bounds: at most ``max_burst`` commands, until
        ``max_burst_bytes`` are received, no new burst after ``burst_read_ms``; the rest waits
        in ZeroMQ for the hub's capacity check, wait_capacity). An active server's compiled
        bursts go through the kernel (validated, recorded and laid out as BROADCASTs in C);
        what it leaves, and everything on the Python path, is handled a message at a time."""
        cfg = self.config
        kernel = self._kernel if self.fsm.active else None
        batch = Batch(
            self.assigned_seq, kernel is not None and self._chp_publisher is None, set(SEED_KINDS)
        )
        if kernel is not None:
            kernel.start_batch()
        one = self._collect_one
        collector = self._collector
        for burst in zmqburst.bursts(
            reader, cfg.max_burst, cfg.max_burst_bytes, cfg.burst_read_ms / 1000
        ):
            compiled = zmqburst.view(burst) if kernel is not None else None
            if compiled is None:
                for count, msg in burst.messages():
                    one(count, msg, batch)
                batch.wire = False
            else:
                assert kernel is not None
                self._collect_compiled(kernel, *compiled, batch)
            if not collector.readable:
                # nothing else is whole: the reader's next burst would be empty (a lone
                # update's path pays for no read that finds nothing; issue 32)
                break
        odd = self._times.take()
        if odd:
            self.hub.metrics.odd(PROTOCOL, TIME_OUT_OF_RANGE, odd)
        if batch.entries:
            wire = kernel.broadcasts() if kernel is not None and batch.wire else None
            parts = batch.parts
            self._submit(
                EncodedBatch(
                    len(batch.entries), parts[0] if len(parts) == 1 else b"".join(parts), SEED_KINDS
                ),
                batch.entries,
                batch.events,
                wire,
            )

    def _collect_compiled(
        self, kernel: SeedKernel, burst: Any, ends: list[int], starts: list[int], batch: Batch
    ) -> None:
        """A compiled burst: runs of commands the kernel validates are deduplicated, admitted
        and numbered here and recorded by the kernel; a command it leaves goes to
        :meth:`_collect_one` (parse_pub's refusal and reason, or a form the kernel does not
        take), then the kernel goes on after it."""
        known = self.dedup.seqs
        admit = self._admit
        add = self.dedup.add
        pack = SEQUENCE.pack
        paired = self.config.role != "standalone"
        guard = self._collector_guard
        data = zmqburst.buffer_bytes(burst)
        entries, events = batch.entries, batch.events
        start, n = 0, burst.n
        while start < n:
            res = kernel.scan(burst, start, starts[start])
            scanned, nxt, slow = res.scanned, res.next, res.slow
            if scanned:
                uuids = kernel.ffi.buffer(kernel.uuids, 36 * scanned)[:]
                ts_ns = kernel.ts_ns
                firsts: list[int] = []
                seqs: list[int] = []
                items: list[int] = []
                seq = batch.seq
                for k in range(scanned):
                    # as _collect_one: an unexpected error refuses this message alone, and
                    # nothing changes the bus state before the last step that can fail
                    try:
                        f = starts[start + k]
                        uuid_b = uuids[36 * k : 36 * k + 36]
                        key = uuid_b.decode()
                        if key in known:
                            self._duplicate(key)
                            continue
                        topic = data[ends[f + 1] : ends[f + 2]]
                        producer = data[ends[f + 3] : ends[f + 4]]
                        timestamp = data[ends[f + 4] : ends[f + 5]]
                        payload = data[ends[f + 6] : ends[f + 7]]
                        size = ENTRY_OVERHEAD + len(topic) + len(producer) + len(timestamp)
                        if not admit(topic, seq + 1, size + len(payload)):
                            continue
                    except Exception as exc:
                        guard.failed(exc, "COLLECTOR message")
                        continue
                    seq += 1
                    add(key, seq)
                    frames = (topic, pack(seq), producer, timestamp, uuid_b, payload)
                    entries.append((seq, frames, None, 0, None))
                    firsts.append(f)
                    seqs.append(seq)
                    items.append(k)
                    if paired:
                        events.append(
                            Event(
                                topic.decode(),
                                seq,
                                producer.decode(),
                                timestamp.decode(),
                                key,
                                payload,
                                ts_ns[k],
                            )
                        )
                if seqs:
                    batch.parts.append(
                        kernel.emit(burst, firsts, seqs, items, batch.received_ns, 2 * burst.size)
                    )
                    batch.seq = seq
            if not slow:
                break
            # the message the kernel left: the Python path decides, then the kernel goes on
            count = burst.counts()[nxt]
            self._collect_one(count, burst.frames(nxt), batch)
            batch.wire = False
            start = nxt + 1

    def _collect_one(self, count: int, msg: list[bytes], batch: Batch) -> None:
        """One COLLECTOR message on the Python path (the kernel's twin).

        One message's unexpected error refuses that message alone (counted as
        internal_error, logged): the burst's other messages are kept (taproom.supervise).
        Nothing below changes the bus state before the last step that can fail."""
        try:
            if count > MAX_FRAMES:
                self._reject("frame_count", f"COLLECTOR: message over {MAX_FRAMES} frames")
                return
            if len(msg) == 3 and msg[1] == Command.REPLICATE.value:
                self._on_replicate(msg[0], msg[1:])
                return
            try:
                event = parse_pub(msg[1:], self.limits, self._times)
            except EventBusError as exc:
                self._reject(exc.reason, str(exc))
                return
            if not self.fsm.active:
                self._hold(event)
                return
            if event.uuid in self.dedup.seqs:
                self._duplicate(event.uuid)
                return
            topic = msg[1]
            next_seq = batch.seq + 1
            frames = (
                topic,
                SEQUENCE.pack(next_seq),
                msg[3],
                msg[4],
                event.uuid.encode(),
                event.data,
            )
            # entry_bytes(frames, None), inline on this path
            size = ENTRY_OVERHEAD + len(topic) + len(msg[3]) + len(msg[4]) + len(event.data)
            record = seed_record(
                topic,
                msg[3],
                msg[4],
                frames[4],
                event.data,
                next_seq,
                event.ts_ns,
                batch.received_ns,
            )
            if not self._admit(topic, next_seq, size):
                return
        except Exception as exc:
            self._collector_guard.failed(exc, "COLLECTOR message")
            return
        batch.seq = next_seq
        self.dedup.add(event.uuid, next_seq)
        batch.parts += record
        batch.entries.append((next_seq, frames, None, 0, None))
        if self.config.role != "standalone":
            batch.events.append(event._replace(sequence=next_seq))
