"""Resend recognition for the Lumberjack listener: a cut-off window is stored once.

When a connection ends in the middle of a window (refused, cut off, reset), part of that window
may already be committed. A sender that saw the partial ack (go-lumber, v2) resends only the
rest; one that did not (v1's logstash-forwarder, or a v2 sender whose connection broke before
the ack arrived) resends the whole window, byte for byte. This memory keeps, per sender, the
fingerprints of what of such windows was committed; the decoder (``ServerConnection.resend``)
skips a resent window's first events while they match, in order, and acknowledges them.

Bounded by ``resend_memory_events`` (8 bytes each, an ``array('q')``); the oldest senders'
entries go first, and an entry is dropped once its window is taken whole. Not persisted: a
restart forgets it (the resend then stores the committed start again).
"""

from __future__ import annotations

import asyncio
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence

from ...hub import Commit
from ...metrics import Metrics
from ...protocols.lumberjack import Window

__all__ = ["Remembered", "ResendMemory", "SenderView"]


class ResendMemory:
    """Per sender (TLS subject CN, else IP address): the committed start of each window cut
    off, by the fingerprint of its first event."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.senders: OrderedDict[str, dict[int, array[int]]] = OrderedDict()
        self.events = 0
        metrics.gauge_fn(
            "lumberjack",
            "resend_memory",
            "events",
            "Events remembered of windows cut off, to recognise their resend",
            lambda: self.events,
        )
        self.m_skipped = metrics.counter(
            "lumberjack",
            "resent_skipped",
            "events",
            "Events of a resent window recognised as already stored (acked, not stored again)",
        )

    def view(self, sender: str) -> SenderView:
        return SenderView(self, sender)

    def keep(self, entry: Remembered) -> None:
        """``entry`` has (more) fingerprints: keep it, within the bound."""
        fps = entry.fingerprints
        entries = self.senders.get(entry.sender)
        if entries is None:
            entries = self.senders[entry.sender] = {}
        self.senders.move_to_end(entry.sender)
        key = fps[0]
        old = entries.get(key)
        if old is not None and old is not fps and old[: len(fps)] == fps:
            return  # an earlier try of this window got as far: keep that one
        entries[key] = fps
        # Entries grow in place (parts committed after the connection ended): recount.
        self.events = sum(len(v) for e in self.senders.values() for v in e.values())
        while self.events > self.limit and self.senders:
            sender, oldest = next(iter(self.senders.items()))
            key, dropped = next(iter(oldest.items()))
            del oldest[key]
            self.events -= len(dropped)
            if not oldest:
                del self.senders[sender]

    def forget(self, sender: str, key: int) -> None:
        """A resent window was taken whole: its remembered start is not needed any more."""
        entries = self.senders.get(sender)
        if entries is None:
            return
        fps = entries.pop(key, None)
        if fps is not None:
            self.events -= len(fps)
        if not entries:
            del self.senders[sender]


class SenderView:
    """One sender's entries as the decoder sees them (``resend``): a live view, so a
    connection that started before an entry was made still recognises the resend."""

    __slots__ = ("memory", "sender")

    def __init__(self, memory: ResendMemory, sender: str) -> None:
        self.memory = memory
        self.sender = sender

    def __bool__(self) -> bool:
        return self.sender in self.memory.senders

    def get(self, first: int, /) -> Sequence[int] | None:
        entries = self.memory.senders.get(self.sender)
        return entries.get(first) if entries else None


class Remembered:
    """The fingerprints of the committed start of one window, as its parts commit."""

    __slots__ = ("fingerprints", "memory", "sender")

    def __init__(self, memory: ResendMemory, sender: str) -> None:
        self.memory = memory
        self.sender = sender
        self.fingerprints = array("q")

    def add(self, window: Window) -> None:
        """A part of the window is committed (kept locally until :meth:`keep`)."""
        self.fingerprints.extend(window.skipped)
        self.fingerprints.extend(window.fingerprints)

    def keep(self) -> None:
        """The connection ended inside the window: into the memory (if anything is known)."""
        if self.fingerprints:
            self.memory.keep(self)

    def add_when_durable(self, window: Window) -> Callable[[asyncio.Future[Commit]], None]:
        """A done-callback for a part still being committed when the connection ended."""

        def durable(future: asyncio.Future[Commit]) -> None:
            if not future.cancelled() and future.exception() is None:
                self.add(window)
                self.keep()

        return durable
