"""The bus state and how bus events become journal records (and back, after a restart)."""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ...protocols.eventbus import (
    Event,
)
from ...records import BatchBuilder

log = logging.getLogger("taproom.eventbus")

PROTOCOL = "eventbus"
RESET_ATTRS = b'{"eventbus":"reset"}'


# One hashmap entry: the event's bus sequence and its six BROADCAST frames, ready to send.
Entry = tuple[int, tuple[bytes, bytes, bytes, bytes, bytes, bytes]]


@dataclass
class BusState:
    """What a restart must get back: the Clone hashmap, the sequence, the recent UUIDs."""

    hashmap: dict[bytes, Entry] = field(default_factory=dict)
    sequence: int = 0
    recent_uuids: list[str] = field(default_factory=list)
    offset: int = 0  # journal offset the state covers (everything before it is applied)
    from_checkpoint: bool = False


class Dedup:
    """A bounded set of recent event UUIDs (FIFO eviction)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._order: deque[str] = deque()
        self._set: set[str] = set()

    def add(self, key: str) -> bool:
        """Remember ``key``; False if it was already there."""
        if key in self._set:
            return False
        if self.window:
            self._set.add(key)
            self._order.append(key)
            if len(self._order) > self.window:
                self._set.discard(self._order.popleft())
        return True

    def forget(self, key: str) -> None:
        self._set.discard(key)

    def recent(self) -> list[str]:
        return [key for key in self._order if key in self._set]


def stream_of(topic: str) -> str:
    """The topic root: ``/orders/eu/1`` -> ``orders``."""
    return topic.split("/", 2)[1] if topic.count("/") >= 1 else topic


def journal_event(builder: BatchBuilder, event: Event, seq: int, timestamp: bytes) -> None:
    """One bus event as a journal record. The original ISO timestamp rides in attrs, so a
    snapshot rebuilt from the journal replays it exactly."""
    builder.add(
        PROTOCOL,
        event.data,
        stream=stream_of(event.topic),
        topic=event.topic,
        producer=event.producer,
        seq=seq,
        event_id=event.uuid,
        ts_ns=event.ts_ns,
        content_type="msgpack",
        attrs=b'{"timestamp":"' + timestamp + b'"}',
    )
