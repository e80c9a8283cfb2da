"""LogTK frames: the wire codec (sans-I/O).

A frame is a type byte, then ``(op byte, value)`` pairs, then ``0x00`` where the next op would
be. This module holds the frame values, the field encodings (big-endian varuint32, uint32,
cstring, byte(64)), :func:`encode_frame` and the incremental :class:`FrameDecoder`, plus the
protocol's errors and close codes.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import ClassVar

from ...errors import LimitExceeded, ProtocolError

__all__ = [
    "DEFAULT_FORMAT",
    "HIGH_BIT",
    "INVALID_AUTH_REASON",
    "MALFORMED_REASON",
    "MAX_FORMAT_BYTES",
    "TOKEN_BYTES",
    "Ack",
    "Auth",
    "Close",
    "CloseCode",
    "Data",
    "Frame",
    "FrameDecoder",
    "FrameType",
    "Init",
    "LogTKError",
    "LogTKLimitExceeded",
    "Ping",
    "Pong",
    "decode_varuint32",
    "encode_frame",
    "encode_varuint32",
]


class FrameType(enum.IntEnum):
    """The frame types of the seed ("Packet types")."""

    CLOSE = 0x00  # "Either side of the connection may send this frame at any time"
    AUTH = 0x01  # "only necessary for endpoints listening using raw TCP"
    INIT = 0x02  # "sent to initialize a connection using shared information"
    DATA = 0x03  # "sent any time the client (application) performs an action"
    ACK = 0x04  # "sent by the server upon receipt of a data frame"
    PING = 0x80  # "THE ping FRAME IS ONLY SENT BY THE SERVER."
    PONG = 0x81  # "THE pong FRAME IS ONLY SENT BY THE CLIENT."


class CloseCode(enum.IntEnum):
    """Close codes. The seed names two; taproom's own all have the high bit set (no ack)."""

    NORMAL = 0x00  # "close: code 0" -- answered with a close-ack
    NO_ACK = 0x80  # "If the high bit of this field is set ... no close-ack frame is sent"
    INTERNAL_ERROR = 0xF8  # taproom: a bug or a failed commit; leaks no detail
    SHUTTING_DOWN = 0xF9  # taproom: the hub is stopping
    TIMEOUT = 0xFA  # taproom: handshake or idle timeout
    PING_TIMEOUT = 0xFB  # taproom: "If it misses two in a row, the connection is dead."
    LIMIT = 0xFC  # taproom: a configured limit (frame, data size)
    UNSUPPORTED_FORMAT = 0xFD  # taproom: init named a format this hub does not take
    MALFORMED = 0xFE  # "close: (fe) malformed frame received"
    INVALID_AUTH = 0xFF  # "close: (ff) invalid auth" (the reference client sends 0xff on exit)


HIGH_BIT = 0x80
# "token (op:1) {byte(64)}: Secret token": a fixed 64 raw bytes, as the reference decoder reads.
TOKEN_BYTES = 64
# "format (op:1) {cstring} (default: protobuf)"
DEFAULT_FORMAT = "protobuf"
# A format name is a short word ("protobuf", "bson", "json"); a longer cstring is garbage.
MAX_FORMAT_BYTES = 64
MALFORMED_REASON = "malformed frame received"
INVALID_AUTH_REASON = "invalid auth"
_U32 = struct.Struct(">I")
_U32_MAX = 0xFFFFFFFF


class LogTKError(ProtocolError):
    """The peer broke LogTK. ``reply`` is the :class:`Close` frame to send before closing."""

    def __init__(self, message: str, *, reason: str = "malformed", reply: object = None) -> None:
        if reply is None:
            reply = Close(CloseCode.MALFORMED, MALFORMED_REASON)
        super().__init__(message, reason=reason, reply=reply)


class LogTKLimitExceeded(LimitExceeded, LogTKError):
    """A frame or data field is over its configured bound."""

    def __init__(self, message: str, *, reason: str = "limit", reply: object = None) -> None:
        if reply is None:
            reply = Close(CloseCode.LIMIT, "limit exceeded")
        super().__init__(message, reason=reason, reply=reply)


# --- frames ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Close:
    """``close`` 0x00. Both fields absent is the close-ack (``00 00``)."""

    code: int | None = None
    reason: str | None = None
    type: ClassVar[FrameType] = FrameType.CLOSE

    @property
    def is_ack(self) -> bool:
        return self.code is None

    @property
    def wants_ack(self) -> bool:
        return self.code is not None and not self.code & HIGH_BIT


@dataclass(frozen=True, slots=True)
class Auth:
    """``auth`` 0x01: ``token`` from the client, ``status`` from the server."""

    token: bytes | None = None
    status: bool | None = None
    type: ClassVar[FrameType] = FrameType.AUTH

    def __repr__(self) -> str:  # tokens never reach logs, not even through a repr
        token = None if self.token is None else f"<{len(self.token)} bytes>"
        return f"Auth(token={token}, status={self.status})"


@dataclass(frozen=True, slots=True)
class Init:
    """``init`` 0x02."""

    format: str | None = None
    id: int | None = None
    ping_min_delta: int | None = None
    ping_recv: bool | None = None
    type: ClassVar[FrameType] = FrameType.INIT


@dataclass(frozen=True, slots=True)
class Data:
    """``data`` 0x03: one serialized log entry and its idempotency token."""

    data: bytes
    idem: int
    type: ClassVar[FrameType] = FrameType.DATA


@dataclass(frozen=True, slots=True)
class Ack:
    """``ack`` 0x04."""

    idem: int
    type: ClassVar[FrameType] = FrameType.ACK


@dataclass(frozen=True, slots=True)
class Ping:
    """``ping`` 0x80 (server to client)."""

    ackid: int
    type: ClassVar[FrameType] = FrameType.PING


@dataclass(frozen=True, slots=True)
class Pong:
    """``pong`` 0x81 (client to server)."""

    ackid: int
    type: ClassVar[FrameType] = FrameType.PONG


Frame = Close | Auth | Init | Data | Ack | Ping | Pong


# --- field codecs ---------------------------------------------------------------------------


def encode_varuint32(value: int) -> bytes:
    """Big-endian base-128: most significant group first, 0x80 on all but the last byte."""
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"varuint32 out of range: {value}")
    out = [value & 0x7F]
    value >>= 7
    while value:
        out.append(0x80 | (value & 0x7F))
        value >>= 7
    out.reverse()
    return bytes(out)


class _Incomplete(Exception):
    """More bytes are needed to finish the frame (internal to the decoder)."""


def _varuint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    value = 0
    for _ in range(5):
        if pos >= end:
            raise _Incomplete
        byte = buf[pos]
        pos += 1
        value = (value << 7) | (byte & 0x7F)
        if not byte & 0x80:
            if value > _U32_MAX:
                raise LogTKError("varuint32 over 32 bits", reason="bad_varuint")
            return value, pos
    raise LogTKError("varuint32 longer than 5 bytes", reason="bad_varuint")


def decode_varuint32(buf: bytes, pos: int = 0) -> tuple[int, int]:
    """``(value, next position)``; raises :class:`LogTKError` when incomplete or invalid."""
    try:
        return _varuint(buf, pos, len(buf))
    except _Incomplete:
        raise LogTKError("truncated varuint32", reason="bad_varuint") from None


def _u32(value: int, name: str) -> bytes:
    if not 0 <= value <= _U32_MAX:
        raise ValueError(f"{name} out of uint32 range: {value}")
    return _U32.pack(value)


def encode_frame(frame: Frame) -> bytes:
    """The wire bytes of ``frame``, fields in op order, ending with the ``0x00`` terminator."""
    if isinstance(frame, Data):
        return b"".join(
            (
                b"\x03\x01",
                encode_varuint32(len(frame.data)),
                frame.data,
                b"\x02",
                _u32(frame.idem, "idem"),
                b"\x00",
            )
        )
    if isinstance(frame, Ack):
        return b"\x04\x01" + _u32(frame.idem, "idem") + b"\x00"
    parts = [bytes((frame.type,))]
    if isinstance(frame, Close):
        if frame.code is not None:
            if not 0 <= frame.code <= 0xFF:
                raise ValueError(f"close code out of range: {frame.code}")
            parts.append(bytes((1, frame.code)))
        if frame.reason is not None:
            reason = frame.reason.encode("utf-8")
            parts += (b"\x02", encode_varuint32(len(reason)), reason)
    elif isinstance(frame, Auth):
        if frame.token is not None:
            if len(frame.token) != TOKEN_BYTES:
                raise ValueError(f"auth token must be {TOKEN_BYTES} bytes")
            parts += (b"\x01", frame.token)
        if frame.status is not None:
            parts.append(b"\x02\x01" if frame.status else b"\x02\x00")
    elif isinstance(frame, Init):
        if frame.format is not None:
            name = frame.format.encode("utf-8")
            if b"\x00" in name or len(name) > MAX_FORMAT_BYTES:
                raise ValueError("format must be a short string without NUL")
            parts += (b"\x01", name, b"\x00")
        if frame.id is not None:
            parts += (b"\x02", _u32(frame.id, "id"))
        if frame.ping_min_delta is not None:
            parts += (b"\x03", encode_varuint32(frame.ping_min_delta))
        if frame.ping_recv is not None:
            parts.append(b"\x04\x01" if frame.ping_recv else b"\x04\x00")
    elif isinstance(frame, Ping | Pong):
        parts += (b"\x01", _u32(frame.ackid, "ackid"))
    else:  # pragma: no cover - the union is closed
        raise TypeError(f"not a LogTK frame: {frame!r}")
    parts.append(b"\x00")
    return b"".join(parts)


def _unknown_op(ftype: int, op: int) -> LogTKError:
    # Ops carry no length, so an unknown op leaves the rest of the stream unreadable.
    return LogTKError(f"unknown op {op:#04x} in frame type {ftype:#04x}", reason="unknown_op")


def _parse_frame(buf: bytes, pos: int, end: int, max_data: int) -> tuple[Frame, int]:
    """One frame starting at ``pos``; raises ``_Incomplete`` or :class:`LogTKError`."""
    ftype = buf[pos]
    p = pos + 1
    if ftype == 0x03:  # data: the hot path
        # Canonical layout first (data then idem, length in 1-2 bytes), as every client sends.
        if p + 2 < end and buf[p] == 1:
            b0 = buf[p + 1]
            if b0 < 0x80:
                n, q = b0, p + 2
            else:
                b1 = buf[p + 2]
                n, q = ((b0 & 0x7F) << 7 | b1, p + 3) if b1 < 0x80 else (-1, 0)
            e = q + n
            if 0 <= n <= max_data and e + 6 <= end and buf[e] == 2 and buf[e + 5] == 0:
                return Data(buf[q:e], _U32.unpack_from(buf, e + 1)[0]), e + 6
        data: bytes | None = None
        idem: int | None = None
        while True:
            if p >= end:
                raise _Incomplete
            op = buf[p]
            p += 1
            if op == 0:
                break
            if op == 1:
                n, p = _varuint(buf, p, end)
                if n > max_data:
                    raise LogTKLimitExceeded(
                        f"data field of {n} bytes, at most {max_data}", reason="data_too_large"
                    )
                if p + n > end:
                    raise _Incomplete
                data = buf[p : p + n]
                p += n
            elif op == 2:
                if p + 4 > end:
                    raise _Incomplete
                idem = _U32.unpack_from(buf, p)[0]
                p += 4
            else:
                raise _unknown_op(ftype, op)
        if data is None or idem is None:
            raise LogTKError("data frame without data or idem", reason="data_missing_field")
        return Data(data, idem), p
    if ftype in (0x04, 0x80, 0x81):
        value: int | None = None
        while True:
            if p >= end:
                raise _Incomplete
            op = buf[p]
            p += 1
            if op == 0:
                break
            if op != 1:
                raise _unknown_op(ftype, op)
            if p + 4 > end:
                raise _Incomplete
            value = _U32.unpack_from(buf, p)[0]
            p += 4
        if value is None:
            raise LogTKError("frame without its uint32 field", reason="missing_field")
        if ftype == 0x04:
            return Ack(value), p
        return (Ping(value) if ftype == 0x80 else Pong(value)), p
    if ftype == 0x00:
        code: int | None = None
        reason: str | None = None
        while True:
            if p >= end:
                raise _Incomplete
            op = buf[p]
            p += 1
            if op == 0:
                break
            if op == 1:
                if p >= end:
                    raise _Incomplete
                code = buf[p]
                p += 1
            elif op == 2:
                n, p = _varuint(buf, p, end)
                if n > max_data:
                    raise LogTKLimitExceeded("close reason too long", reason="reason_too_long")
                if p + n > end:
                    raise _Incomplete
                try:
                    reason = buf[p : p + n].decode("utf-8")
                except UnicodeDecodeError:
                    raise LogTKError("close reason is not UTF-8", reason="bad_utf8") from None
                p += n
            else:
                raise _unknown_op(ftype, op)
        return Close(code, reason), p
    if ftype == 0x01:
        token: bytes | None = None
        status: bool | None = None
        while True:
            if p >= end:
                raise _Incomplete
            op = buf[p]
            p += 1
            if op == 0:
                break
            if op == 1:
                if p + TOKEN_BYTES > end:
                    raise _Incomplete
                token = buf[p : p + TOKEN_BYTES]
                p += TOKEN_BYTES
            elif op == 2:
                if p >= end:
                    raise _Incomplete
                status = buf[p] != 0  # the reference decoder: any non-zero byte is true
                p += 1
            else:
                raise _unknown_op(ftype, op)
        return Auth(token, status), p
    if ftype == 0x02:
        fmt: str | None = None
        ident: int | None = None
        delta: int | None = None
        recv: bool | None = None
        while True:
            if p >= end:
                raise _Incomplete
            op = buf[p]
            p += 1
            if op == 0:
                break
            if op == 1:
                nul = buf.find(b"\x00", p, min(end, p + MAX_FORMAT_BYTES + 1))
                if nul < 0:
                    if end - p > MAX_FORMAT_BYTES:
                        raise LogTKError("format cstring too long", reason="bad_format")
                    raise _Incomplete
                try:
                    fmt = buf[p:nul].decode("ascii")
                except UnicodeDecodeError:
                    raise LogTKError("format is not ASCII", reason="bad_format") from None
                p = nul + 1
            elif op == 2:
                if p + 4 > end:
                    raise _Incomplete
                ident = _U32.unpack_from(buf, p)[0]
                p += 4
            elif op == 3:
                delta, p = _varuint(buf, p, end)
            elif op == 4:
                if p >= end:
                    raise _Incomplete
                recv = buf[p] != 0
                p += 1
            else:
                raise _unknown_op(ftype, op)
        return Init(fmt, ident, delta, recv), p
    raise LogTKError(f"unknown frame type {ftype:#04x}", reason="unknown_frame_type")


class FrameDecoder:
    """Incremental decoder: :meth:`feed` bytes in any split, get whole frames out.

    After a malformed or over-limit frame the decoder stops for good and keeps the error in
    :attr:`error`; the frames decoded before it in the same :meth:`feed` are still returned.
    """

    __slots__ = ("_buf", "error", "max_data_bytes", "max_frame_bytes")

    def __init__(self, max_frame_bytes: int = 1 << 20, max_data_bytes: int = 1 << 20) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_data_bytes = min(max_data_bytes, max_frame_bytes)
        self._buf = b""
        self.error: LogTKError | None = None

    @property
    def buffered(self) -> int:
        """Bytes of an unfinished frame held back."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[Frame]:
        if self.error is not None:
            return []
        buf = self._buf + data if self._buf else bytes(data)
        end = len(buf)
        pos = 0
        frames: list[Frame] = []
        max_frame = self.max_frame_bytes
        max_data = self.max_data_bytes
        try:
            while pos < end:
                try:
                    frame, nxt = _parse_frame(buf, pos, end, max_data)
                except _Incomplete:
                    if end - pos > max_frame:
                        raise LogTKLimitExceeded(
                            f"frame over {max_frame} bytes", reason="frame_too_large"
                        ) from None
                    break
                if nxt - pos > max_frame:
                    raise LogTKLimitExceeded(
                        f"frame of {nxt - pos} bytes, at most {max_frame}", reason="frame_too_large"
                    )
                frames.append(frame)
                pos = nxt
        except LogTKError as exc:
            self.error = exc
            self._buf = b""
            return frames
        self._buf = buf[pos:] if pos < end else b""
        return frames
