"""The CHP dialect's collector (the ØMQ Guide's Clone model 5 PULL or model 6 SUB) and the ttl
expiry of keys (clonesrv5/6 ``flush_ttl``).

kvmsg updates become bus events (``protocols.eventbus.kvmsg`` maps the fields) and join the
seed's PUBs in the same hashmap, sequence and journal through :meth:`_accept_events`. A key
whose ``ttl`` has passed is deleted as the Guide's server does it: a new event, numbered,
journaled and broadcast with an empty body.
"""

from __future__ import annotations

import asyncio
import heapq
import time
import uuid as uuid_mod

from ... import zmqburst
from ...errors import HubStopped
from ...eventtime import TIME_OUT_OF_RANGE
from ...protocols.eventbus import Event, EventBusError, kvmsg
from .collector import Collector
from .state import PROTOCOL, chp_data
from .wire import MAX_FRAMES, now_iso


class ChpDialect(Collector):
    """Reads kvmsg updates from the CHP collector; deletes expired keys."""

    async def _chp_collector_loop(self) -> None:
        reader = self._chp_collector.reader(MAX_FRAMES)
        while True:
            await self._chp_collector.wait_readable()
            await self.hub.wait_capacity()
            try:
                self._drain_chp_collector(reader)
            except HubStopped:
                return

    def _drain_chp_collector(self, reader: zmqburst.Reader) -> None:
        """One burst of kvmsg updates, bounded as the seed's PUBs are (_drain_collector)."""
        cfg = self.config
        limits = self.limits
        received = now_iso()
        received_ns = time.time_ns()
        now_ms = received_ns // 1_000_000
        active = self.fsm.active
        events: list[Event] = []
        times = self._times
        guard = self._chp_collector_guard
        no_uuid = 0
        for count, msg in zmqburst.drain(
            reader, cfg.max_burst, cfg.max_burst_bytes, cfg.burst_read_ms / 1000
        ):
            # One update's unexpected error refuses it alone (taproom.supervise).
            try:
                if count > MAX_FRAMES:
                    self._reject("frame_count", f"CHP collector: message over {MAX_FRAMES} frames")
                    continue
                try:
                    update = kvmsg.parse_update(msg, limits, times)
                except EventBusError as exc:
                    self._reject(exc.reason, f"CHP collector: {exc}")
                    continue
                event_uuid = update.uuid
                if not event_uuid:  # the Guide's C clonecli5: no uuid of its own
                    event_uuid = str(uuid_mod.uuid4())
                    no_uuid += 1
                event = Event(
                    update.topic,
                    0,
                    update.producer,
                    update.timestamp or received,
                    event_uuid,
                    chp_data(update.body),
                    update.ts_ns if update.timestamp else received_ns,
                    (update.properties, update.body),
                    now_ms + update.ttl_ms if update.ttl_ms else 0,
                )
                if active:
                    events.append(event)
                else:
                    self._hold(event)
            except Exception as exc:
                guard.failed(exc, "CHP update")
        odd = times.take()
        if odd:
            self.hub.metrics.odd(PROTOCOL, TIME_OUT_OF_RANGE, odd)
        if no_uuid:
            self.hub.metrics.odd(PROTOCOL, "empty_uuid", no_uuid)
        if events:
            self._accept_events(events)

    async def _expiry_loop(self) -> None:
        interval = self.config.ttl_check_ms / 1000
        while True:
            await asyncio.sleep(interval)
            if self.fsm.active and not self._stopping:
                try:
                    self._expire(time.time_ns())
                except HubStopped:
                    return

    def _expire(self, now_ns: int) -> None:
        """Delete the keys whose ttl has passed and that no later update replaced."""
        now_ms = now_ns // 1_000_000
        heap = self._expiry
        deletions = []
        timestamp = now_iso()
        while heap and heap[0][0] <= now_ms:
            _expires, topic, seq = heapq.heappop(heap)
            current = self._accepted.get(topic)
            if current is None or current[0] != seq:
                continue  # replaced or deleted since
            deletions.append(
                Event(
                    topic.decode(),
                    0,
                    self.name,
                    timestamp,
                    str(uuid_mod.uuid4()),
                    b"",
                    now_ns,
                    (b"", b""),
                )
            )
        if deletions:
            self._m_expired.inc(self._accept_events(deletions))
