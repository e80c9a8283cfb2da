"""The sending side's bookkeeping, shared by the blocking and asyncio clients.

:class:`ClientSession` encodes windows (``W`` then the data frames, in one ``C`` unless the
compression level is 0), tracks them until acknowledged and tells what to resend after a
reconnect.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import orjson

from .frames import (
    _FRAME_U32,
    _FRAME_U32X2,
    CompressedFrame,
    DataFrame,
    FrameType,
    LumberjackError,
    Version,
    WindowSizeFrame,
    next_seq,
    seq_after,
)

__all__ = ["ClientSession", "SentWindow", "windows_of"]


@dataclass(slots=True)
class SentWindow:
    """One window on the wire: its events (for a resend) and its sequence range."""

    events: list[object]
    first_seq: int
    last_seq: int
    data: bytes


@dataclass
class ClientSession:
    """The sending side's bookkeeping, shared by the sync and asyncio clients.

    Sequence numbers count per connection from 1 (like pylogbeat and logstash-forwarder) and
    skip 0 on roll-over, so a ``2A 0`` keepalive can never be mistaken for an ack. An ack
    acknowledges every window whose last sequence number it reaches (bulk acks work).
    """

    version: Version = Version.V2
    compression_level: int = 3
    in_flight: deque[SentWindow] = field(default_factory=deque)
    next_seq: int = 1
    acked_events: int = 0
    keepalives: int = 0
    _buf: bytearray = field(default_factory=bytearray)

    def encode_window(self, events: Sequence[object]) -> SentWindow:
        """Frames for one window (W, then the data frames, in one C unless level is 0)."""
        version = self.version
        seq = self.next_seq
        first = seq
        frames: list[bytes] = []
        last = seq
        for event in events:
            last = seq
            if version == Version.V1 and isinstance(event, Mapping):
                frames.append(DataFrame.from_mapping(seq, event, version).serialize())
            else:
                if isinstance(event, bytes):
                    payload = event
                elif isinstance(event, str):
                    payload = event.encode()
                else:
                    payload = orjson.dumps(event)
                frames.append(
                    _FRAME_U32X2.pack(version, FrameType.JSON, seq, len(payload)) + payload
                )
            seq = next_seq(seq)
        self.next_seq = seq
        body = b"".join(frames)
        head = WindowSizeFrame(len(frames), version).serialize()
        if self.compression_level > 0:
            body = CompressedFrame.compress(body, self.compression_level, version)
        window = SentWindow(list(events), first, last, head + body)
        self.in_flight.append(window)
        return window

    def receive_data(self, data: bytes) -> list[SentWindow]:
        """Feed bytes from the server; return the windows now fully acknowledged."""
        self._buf += data
        done: list[SentWindow] = []
        buf = self._buf
        pos = 0
        while len(buf) - pos >= 6:
            version, ftype, seq = _FRAME_U32.unpack_from(buf, pos)
            pos += 6
            if ftype != FrameType.ACK or version not in (Version.V1, Version.V2):
                raise LumberjackError(
                    f"server sent frame {version:#04x}/{ftype:#04x}, expected an ack",
                    reason="unexpected_frame",
                )
            if seq == 0:
                self.keepalives += 1
                continue
            while self.in_flight:
                window = self.in_flight[0]
                if seq == window.last_seq or seq_after(seq, window.last_seq):
                    self.in_flight.popleft()
                    self.acked_events += len(window.events)
                    done.append(window)
                else:
                    break
        del buf[:pos]
        return done

    def reconnected(self) -> list[bytes]:
        """After a new connection: re-encode every unacknowledged window, in order."""
        pending = list(self.in_flight)
        self.in_flight.clear()
        self._buf.clear()
        self.next_seq = 1
        return [self.encode_window(w.events).data for w in pending]

    def unacked_events(self) -> int:
        return sum(len(w.events) for w in self.in_flight)


def windows_of(events: Iterable[object], size: int) -> Iterable[list[object]]:
    """Split ``events`` into lists of at most ``size``."""
    chunk: list[object] = []
    for event in events:
        chunk.append(event)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
