"""Admission of updates into the bus: limits, dedup, numbering, the journal batch, replication.

Both collectors (the seed's and the CHP dialect's), the updates a passive server held, and ttl
expiries end here. What is admitted is decided at accept time on ``_accepted`` (the hashmap as
it will be once every accepted burst is applied), so limits and expiries never race a burst
that is still on its way to the disk.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Iterable
from typing import Any

import zmq

from ...protocols.eventbus import SEQUENCE, Event, replicate_frames
from ...records import BatchBuilder, EncodedBatch
from .base import Batch, Burst, BusBase
from .state import (
    CHP,
    EXPIRES_MS,
    FRAMES,
    KV,
    PROTOCOL,
    SEQ,
    Entry,
    entry_bytes,
    journal_event,
    kv_frames,
)
from .wire import rearm

log = logging.getLogger("taproom.eventbus")

# Duplicate acknowledgements kept for the next HUGZ; beyond it the oldest go (their
# producers retry again and are told in a later HUGZ).
MAX_DUP_ACKS = 4096


class Acceptor(BusBase):
    """Turns valid updates into journal batches (bursts) for the broadcaster."""

    def _track(self, topic: bytes, seq: int, size: int) -> None:
        """Count an entry (size 0: a deletion) in ``_accepted`` without limits (replication:
        the active peer admitted it under the same bound)."""
        previous = self._accepted.pop(topic, None)
        if previous is not None:
            self._accepted_bytes -= previous[1]
            self._hashmap_holder.release(previous[1])
        if size:
            self._accepted[topic] = (seq, size)
            self._accepted_bytes += size
            self._hashmap_holder.charge(size)

    def _install(self, hashmap: dict[bytes, Entry]) -> None:
        """Take ``hashmap`` as the state (start, or a copy from the peer): the admission table,
        the ttl heap and, with the CHP dialect on, every entry's kvmsg frames."""
        chp = self._chp_publisher is not None
        for topic, entry in hashmap.items():
            if chp and entry[KV] is None:
                seq, frames, event_chp, expires_ms, _ = entry
                hashmap[topic] = (seq, frames, event_chp, expires_ms, kv_frames(frames, event_chp))
        self.hashmap = hashmap
        self._accepted = {t: (e[SEQ], entry_bytes(e[FRAMES], e[CHP])) for t, e in hashmap.items()}
        self._hashmap_holder.release(self._accepted_bytes)
        self._accepted_bytes = sum(size for _seq, size in self._accepted.values())
        # What the journal (or the peer's copy) holds is kept whatever the bound: it was
        # admitted under it (the bound lowered since is honoured by refusing what comes next).
        self._hashmap_holder.charge(self._accepted_bytes)
        self._expiry = [(e[EXPIRES_MS], t, e[SEQ]) for t, e in hashmap.items() if e[EXPIRES_MS]]
        heapq.heapify(self._expiry)

    def _admit(self, topic: bytes, seq: int, size: int) -> bool:
        """Whether an entry of ``size`` bytes (0: a deletion) fits the hashmap's limits; if it
        does, it is counted. On every accepted update's path, so it does its own counting."""
        if not size:
            self._track(topic, seq, 0)
            return True
        accepted = self._accepted
        previous = accepted.get(topic)
        if previous is None:
            if len(accepted) >= self.config.max_keys:
                self._reject("too_many_keys", f"{self.config.max_keys} topics already")
                return False
            grow = size
        else:
            grow = size - previous[1]
        holder = self._hashmap_holder
        if grow > 0 and (holder.used + grow > holder.bound or not holder.try_reserve(grow)):
            self._reject("hashmap_full", f"{self._accepted_bytes} bytes held already")
            return False
        if grow < 0:
            holder.release(-grow)
        accepted[topic] = (seq, size)
        self._accepted_bytes += grow
        return True

    def _duplicate(self, key: str) -> None:
        """A repeat of a known event: dropped, and its sequence told in the next HUGZ."""
        self._m_duplicates.inc()
        seq = self.dedup.seq_of(key)
        if seq:
            self._dup_acks.pop(key, None)
            self._dup_acks[key] = seq
            if len(self._dup_acks) > MAX_DUP_ACKS:
                del self._dup_acks[next(iter(self._dup_acks))]

    def _submit(
        self,
        batch: EncodedBatch,
        entries: list[Entry],
        events: list[Event],
        wire: tuple[Any, Any, Any, int] | None = None,
        kv_wire: tuple[Any, Any, Any, int] | None = None,
    ) -> None:
        """Journal a burst and queue it for the broadcaster (after replicating it); ``wire``
        (and ``kv_wire``): its BROADCASTs (and kvmsgs) as a collector's kernel laid them out."""
        burst = Burst(entries, False, None, wire, kv_wire)
        self._journal_burst(batch, burst)
        self.assigned_seq = entries[-1][SEQ]
        self.hub.metrics.accepted(PROTOCOL, len(entries), len(batch.body))
        # after the submit, as before: the commit's callback comes at the earliest at the end
        # of this turn of the loop, so the burst waits for the peer's ack if it needs one
        burst.needs_peer_ack = self._replicate(events) if events else False

    def _replicate(self, events: list[Event]) -> bool:
        """Send a burst to the passive peer; True when the broadcast must wait for its ack.

        Sent whether or not the peer's last HUGZ is recent: on a busy server that HUGZ may
        simply be unread, and a burst not sent is a gap that costs the peer a full copy. A
        dead peer's connection is gone, and ``IMMEDIATE`` then refuses the send at once."""
        # Chunks whose body stays under the peer's MAXMSGSIZE (the same settings on both).
        budget = self._max_frame - 65536
        chunks: list[list[Event]] = [[]]
        size = 0
        for e in events:
            cost = len(e.data) + 4 * (len(e.topic) + len(e.producer)) + len(e.timestamp) + 64
            if e.chp is not None:
                cost += len(e.chp[0]) + len(e.chp[1])
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

    def _accept_one(self, event: Event, batch: Batch) -> None:
        """Admit one parsed event into ``batch`` (its record, entry and replica, numbered
        after the batch's last). One update's unexpected error refuses it alone
        (taproom.supervise): its admission is undone, nothing of it is journaled."""
        try:
            if event.uuid in self.dedup:
                self._duplicate(event.uuid)
                return
            seq = batch.seq + 1
            timestamp = event.timestamp.encode()
            frames = (
                event.topic.encode(),
                SEQUENCE.pack(seq),
                event.producer.encode(),
                timestamp,
                event.uuid.encode(),
                event.data,
            )
            size = entry_bytes(frames, event.chp) if event.data else 0
            previous = self._accepted.get(frames[0])
            accepted_bytes = self._accepted_bytes
            if not self._admit(frames[0], seq, size):
                return
            builder = BatchBuilder(batch.received_ns)
            try:
                journal_event(builder, event, seq, timestamp)  # appends only if whole
            except Exception:
                if previous is None:
                    self._accepted.pop(frames[0], None)
                else:
                    self._accepted[frames[0]] = previous
                self._accepted_bytes = accepted_bytes
                raise
            record = builder.build()
        except Exception as exc:
            self._accept_guard.failed(exc, "update")
            return
        batch.seq = seq
        batch.parts.append(record.body)
        if record.kinds:
            batch.kinds |= record.kinds
        self.dedup.add(event.uuid, seq)
        batch.entries.append((seq, frames, event.chp, event.expires_ms, None))
        if self.config.role != "standalone":
            batch.events.append(event._replace(sequence=seq))

    def _submit_batch(self, batch: Batch, wire: Any = None, kv_wire: Any = None) -> int:
        """Journal ``batch`` (when it holds anything): how many events it holds."""
        if not batch.entries:
            return 0
        body = EncodedBatch(len(batch.entries), b"".join(batch.parts), frozenset(batch.kinds))
        self._submit(body, batch.entries, batch.events, wire, kv_wire)
        return len(batch.entries)

    def _accept_events(self, events: Iterable[Event]) -> int:
        """Admit parsed events (CHP updates, held updates, expiries) as one journal batch;
        returns how many."""
        batch = Batch(self.assigned_seq, False, set())
        for event in events:
            self._accept_one(event, batch)
        return self._submit_batch(batch)

    # --- a passive server's held updates (issue 16 defect 1; clonesrv6's pending list) ---------

    @staticmethod
    def _held_size(event: Event) -> int:
        return 256 + len(event.data) + (len(event.chp[1]) if event.chp is not None else 0)

    def _hold(self, event: Event) -> None:
        """A client update to a passive server: kept (bounded) until the active server's copy
        of it arrives, or applied if this server takes over first."""
        if event.uuid in self.dedup or event.uuid in self._held:
            return  # the active server's copy came first
        self._held[event.uuid] = event
        self._held_bytes += self._held_size(event)
        self._m_held.labels(kind="held").inc()
        while self._held and (
            len(self._held) > self.config.max_held or self._held_bytes > self.config.max_held_bytes
        ):
            oldest = self._held.pop(next(iter(self._held)))
            self._held_bytes -= self._held_size(oldest)
            self._reject("held_overflow", "passive server's held updates are full")

    def _release_held(self, key: str) -> None:
        """The active server's copy of a held update arrived: the held one is not needed."""
        event = self._held.pop(key, None)
        if event is not None:
            self._held_bytes -= self._held_size(event)

    def _apply_held(self) -> None:
        """At takeover: the held updates the old active server never replicated, in order."""
        if not self._held:
            return
        held = list(self._held.values())
        self._held.clear()
        self._held_bytes = 0
        applied = self._accept_events(held)
        self._m_held.labels(kind="applied").inc(applied)
        log.warning("eventbus: applied %d of %d held updates at takeover", applied, len(held))
