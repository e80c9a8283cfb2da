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
from typing import Any

from ... import zmqburst
from ...errors import HubStopped
from ...eventtime import TIME_OUT_OF_RANGE
from ...protocols.eventbus import Event, EventBusError, kvmsg
from .base import Batch
from .collector import Collector
from .kernel import ChpKernel
from .state import CHP_KIND, PROTOCOL, chp_event
from .wire import MAX_FRAMES, now_iso


class ChpDialect(Collector):
    """Reads kvmsg updates from the CHP collector; deletes expired keys."""

    _chp_kernel: ChpKernel | None = None

    async def _chp_collector_loop(self) -> None:
        reader = self._chp_collector.reader(MAX_FRAMES)
        cfg = self.config
        self._chp_kernel = ChpKernel.create(self.limits, cfg.max_burst, cfg.max_burst_bytes)
        while True:
            await self._chp_collector.wait_readable()
            await self.hub.wait_capacity()
            try:
                self._drain_chp_collector(reader)
            except HubStopped:
                return
            if not self._chp_collector.readable:
                self.hub.commit_now()  # as the seed collector's loop (issue 32)

    def _drain_chp_collector(self, reader: zmqburst.Reader) -> None:
        """One journal batch of kvmsg updates, bounded as the seed's PUBs are
        (_drain_collector). An active server's compiled bursts go through the kernel
        (validated, recorded and laid out as BROADCASTs and kvmsgs in C); what it leaves, and
        everything on the Python path, is handled an update at a time (:meth:`_chp_one`)."""
        cfg = self.config
        received = now_iso()
        received_ns = time.time_ns()
        kernel = self._chp_kernel if self.fsm.active else None
        batch = Batch(self.assigned_seq, kernel is not None, set(), received_ns)
        if kernel is not None:
            kernel.start_batch(received.encode(), received_ns)
        no_uuid = 0
        for burst in zmqburst.bursts(
            reader, cfg.max_burst, cfg.max_burst_bytes, cfg.burst_read_ms / 1000
        ):
            compiled = zmqburst.view(burst) if kernel is not None else None
            if compiled is None:
                for count, msg in burst.messages():
                    no_uuid += self._chp_one(count, msg, batch, received)
                batch.wire = False
            else:
                assert kernel is not None
                no_uuid += self._chp_compiled(kernel, *compiled, batch, received)
        odd = self._times.take()
        if odd:
            self.hub.metrics.odd(PROTOCOL, TIME_OUT_OF_RANGE, odd)
        if no_uuid:
            self.hub.metrics.odd(PROTOCOL, "empty_uuid", no_uuid)
        if batch.entries:
            wire = kv_wire = None
            if kernel is not None and batch.wire:
                wire, kv_wire = kernel.wires()
            self._submit_batch(batch, wire, kv_wire)

    def _chp_compiled(
        self,
        kernel: ChpKernel,
        burst: Any,
        ends: list[int],
        starts: list[int],
        batch: Batch,
        received: str,
    ) -> int:
        """A compiled burst: runs of updates the kernel validates are deduplicated, admitted
        and numbered here and recorded by the kernel; an update it leaves goes to
        :meth:`_chp_one` (parse_update's refusal and reason, or a form the kernel does not
        take), then the kernel goes on after it. Returns the updates given a uuid here."""
        dedup = self.dedup
        known, window, remembered = dedup.seqs, dedup.window, dedup.order
        remember, forget_oldest = remembered.append, remembered.popleft
        admit = self._admit
        paired = self.config.role != "standalone"
        guard = self._chp_collector_guard
        data = zmqburst.buffer_bytes(burst)
        entries, events = batch.entries, batch.events
        append_entry = entries.append
        no_uuid = 0
        start, n = 0, burst.n
        while start < n:
            res = kernel.scan(burst, start, starts[start])
            scanned, nxt, slow = res.scanned, res.next, res.slow
            if scanned:
                uuids = kernel.ffi.buffer(kernel.uuids, 36 * scanned)[:]
                sizes, ttl_lens, expiries = kernel.item_fields(scanned)
                firsts: list[int] = []
                seqs: list[int] = []
                items: list[int] = []
                topics: list[bytes] = []
                uuid_frames: list[bytes] = []
                seq = batch.seq
                for k in range(scanned):
                    # as _accept_one: an unexpected error refuses this update alone, and
                    # nothing changes the bus state before the last step that can fail
                    try:
                        f = starts[start + k]
                        uuid_b = uuids[36 * k : 36 * k + 36]
                        key = uuid_b.decode()
                        if key in known:
                            self._duplicate(key)
                            continue
                        topic = data[ends[f] : ends[f + 1]]
                        if not admit(topic, seq + 1, sizes[k]):
                            continue
                    except Exception as exc:
                        guard.failed(exc, "CHP update")
                        continue
                    seq += 1
                    if window:  # Dedup.add, inline: the key is not known (checked above)
                        known[key] = seq
                        remember(key)
                        if len(remembered) > window:
                            known.pop(forget_oldest(), None)
                    firsts.append(f)
                    seqs.append(seq)
                    items.append(k)
                    topics.append(topic)
                    uuid_frames.append(uuid_b)
                if seqs:
                    records, bc, bc_ends, kv, kv_ends = kernel.emit(
                        burst, firsts, seqs, items, 2 * burst.size
                    )
                    batch.parts.append(records)
                    batch.kinds.add(CHP_KIND)
                    batch.seq = seq
                    # the entries' frames are the bytes sent: sliced from the BROADCASTs and
                    # kvmsgs just laid out (ends of frames from 0, 6 and 5 a message)
                    ts_ns = kernel.ts_ns
                    bcs, kvs = iter(bc_ends), iter(kv_ends)
                    for topic, uuid_b, number, k, (t, q, p, s, u, d), (_, _, w, r, b) in zip(
                        topics, uuid_frames, seqs, items,
                        zip(bcs, bcs, bcs, bcs, bcs, bcs, strict=True),
                        zip(kvs, kvs, kvs, kvs, kvs, strict=True), strict=True,
                    ):  # fmt: skip
                        sequence, body = bc[t:q], kv[r:b]
                        frames = (topic, sequence, bc[q:p], bc[p:s], uuid_b, bc[u:d])
                        kv_msg = (topic, sequence, kv[w - 16 : w], kv[w:r], body)
                        ttl_len = ttl_lens[k]
                        if ttl_len:  # the ttl line ends the kvmsg's properties
                            chp = (kv[r - 5 - ttl_len : r], body)
                            expires_ms = expiries[k]
                        else:
                            chp, expires_ms = (b"", body), 0
                        append_entry((number, frames, chp, expires_ms, kv_msg))
                        if paired:
                            events.append(
                                Event(
                                    topic.decode(),
                                    number,
                                    frames[2].decode(),
                                    frames[3].decode(),
                                    uuid_b.decode(),
                                    frames[5],
                                    ts_ns[k],
                                    chp,
                                    expires_ms,
                                )
                            )
            if not slow:
                break
            # the update the kernel left: the Python path decides, then the kernel goes on
            no_uuid += self._chp_one(burst.counts()[nxt], burst.frames(nxt), batch, received)
            batch.wire = False
            start = nxt + 1
        return no_uuid

    def _chp_one(self, count: int, msg: list[bytes], batch: Batch, received: str) -> int:
        """One kvmsg update on the Python path (the kernel's twin): refused with
        parse_update's reason, held (a passive server) or admitted into ``batch``. Returns 1
        when the update had no uuid and was given one here.

        One update's unexpected error refuses it alone (taproom.supervise)."""
        try:
            if count > MAX_FRAMES:
                self._reject("frame_count", f"CHP collector: message over {MAX_FRAMES} frames")
                return 0
            try:
                update = kvmsg.parse_update(msg, self.limits, self._times)
            except EventBusError as exc:
                self._reject(exc.reason, f"CHP collector: {exc}")
                return 0
            event_uuid = update.uuid
            no_uuid = 0
            if not event_uuid:  # the Guide's C clonecli5: no uuid of its own
                event_uuid = str(uuid_mod.uuid4())
                no_uuid = 1
            event = chp_event(update, event_uuid, received, batch.received_ns)
        except Exception as exc:
            self._chp_collector_guard.failed(exc, "CHP update")
            return 0
        if self.fsm.active:
            self._accept_one(event, batch)
        else:
            self._hold(event)
        return no_uuid

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
