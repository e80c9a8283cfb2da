"""Lumberjack frames as values: version and type bytes, errors, sequence arithmetic.

Every frame is ``version(1) type(1) payload``, all integers uint32 big-endian (seed
``lumberjack-v1.txt``; v2 is the same framing with version byte ``'2'``). Clients, tests and docs
build frames with these classes; the server's decoder (:mod:`.decoder`) reads the bytes directly
for speed and raises only the two errors defined here.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from ...errors import LimitExceeded, ProtocolError

if TYPE_CHECKING:
    from .window import Window

__all__ = [
    "PROTOCOL",
    "SEQ_MASK",
    "AckFrame",
    "CompressedFrame",
    "DataFrame",
    "FrameType",
    "JsonFrame",
    "LumberjackError",
    "LumberjackLimit",
    "Version",
    "WindowSizeFrame",
    "encode_ack",
    "next_seq",
    "seq_after",
]

PROTOCOL = "lumberjack"
SEQ_MASK = 0xFFFFFFFF
_HALF = 0x80000000


class Version(IntEnum):
    """The first byte of every frame."""

    V1 = 0x31  # "version(1)" -- ASCII '1' (logstash-forwarder, lumberjack-protocol)
    V2 = 0x32  # '2' -- the Beats protocol (go-lumber, Filebeat, Logstash beats input)


class FrameType(IntEnum):
    """The second byte of every frame."""

    WINDOW = 0x57  # "'window size' frame type ... ASCII 'W' aka byte value 0x57"
    DATA = 0x44  # "'data' frame type ... ASCII 'D' aka byte value 0x44"
    JSON = 0x4A  # "'json' frame type ... ASCII 'J' aka byte value 0x4a"
    COMPRESSED = 0x43  # "'compressed' frame type ... ASCII 'C' aka byte value 0x43"
    ACK = 0x41  # "'ack' frame type ... ASCII 'A' aka byte value 0x41"


class LumberjackError(ProtocolError):
    """The peer broke the Lumberjack protocol; the connection is closed without a reply.

    ``windows`` holds the windows completed before the bad frame: they are valid, get
    committed and acknowledged before the close.
    """

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        super().__init__(message, reason=reason, reply=None)
        self.windows: list[Window] = []


class LumberjackLimit(LimitExceeded):
    """A size, count or nesting depth read from the wire is over its configured bound."""

    def __init__(self, message: str, *, reason: str = "limit") -> None:
        super().__init__(message, reason=reason, reply=None)
        self.windows: list[Window] = []


def seq_after(a: int, b: int) -> bool:
    """``a`` comes after ``b`` in uint32 serial-number order (RFC 1982), across roll-over."""
    return 0 < ((a - b) & SEQ_MASK) < _HALF


def next_seq(seq: int) -> int:
    """The sequence number after ``seq``. Skips 0 on roll-over: 0 is the keepalive ack."""
    seq = (seq + 1) & SEQ_MASK
    return seq or 1


# --- frames as values (clients, tests, docs) ---------------------------------------------------

_U32 = struct.Struct(">I")
_U32X2 = struct.Struct(">II")
_FRAME_U32 = struct.Struct(">BBI")
_FRAME_U32X2 = struct.Struct(">BBII")


@dataclass(frozen=True, slots=True)
class WindowSizeFrame:
    """``W``: the sender will have at most ``size`` data frames unacknowledged."""

    size: int
    version: Version = Version.V2

    def serialize(self) -> bytes:
        return _FRAME_U32.pack(self.version, FrameType.WINDOW, self.size)


@dataclass(frozen=True, slots=True)
class DataFrame:
    """``D`` (v1): string key/value pairs."""

    seq: int
    pairs: tuple[tuple[str, str], ...]
    version: Version = Version.V1

    @classmethod
    def from_mapping(
        cls, seq: int, data: Mapping[str, object], version: Version = Version.V1
    ) -> DataFrame:
        return cls(seq, tuple((str(k), str(v)) for k, v in data.items()), version)

    def serialize(self) -> bytes:
        parts = [_FRAME_U32X2.pack(self.version, FrameType.DATA, self.seq, len(self.pairs))]
        for key, value in self.pairs:
            k = key.encode()
            v = value.encode()
            parts += (_U32.pack(len(k)), k, _U32.pack(len(v)), v)
        return b"".join(parts)


@dataclass(frozen=True, slots=True)
class JsonFrame:
    """``J`` (v2): one JSON document."""

    seq: int
    payload: bytes
    version: Version = Version.V2

    def serialize(self) -> bytes:
        head = _FRAME_U32X2.pack(self.version, FrameType.JSON, self.seq, len(self.payload))
        return head + self.payload


@dataclass(frozen=True, slots=True)
class CompressedFrame:
    """``C``: a zlib stream (with header) whose content is a complete frame sequence."""

    payload: bytes
    version: Version = Version.V2

    @classmethod
    def compress(cls, frames: bytes, level: int = 3, version: Version = Version.V2) -> bytes:
        """The serialized ``C`` frame wrapping ``frames``."""
        return cls(zlib.compress(frames, level), version).serialize()

    def serialize(self) -> bytes:
        head = _FRAME_U32.pack(self.version, FrameType.COMPRESSED, len(self.payload))
        return head + self.payload


@dataclass(frozen=True, slots=True)
class AckFrame:
    """``A``: everything up to and including ``seq`` is acknowledged (0: keepalive, v2)."""

    seq: int
    version: Version = Version.V2

    def serialize(self) -> bytes:
        return _FRAME_U32.pack(self.version, FrameType.ACK, self.seq)


def encode_ack(version: int, seq: int) -> bytes:
    """The ``A`` frame bytes; ``version`` is the byte of the frames being acknowledged."""
    return _FRAME_U32.pack(version, FrameType.ACK, seq & SEQ_MASK)
