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
from typing import Any, ClassVar

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
    "OversizeData",
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
# The decoder reads a read's bytes, or its own buffer while a frame is unfinished.
Buffer = bytes | bytearray


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
class OversizeData:
    """A ``data`` frame whose entry is over ``max_data_bytes`` (decoded so only where the
    decoder's ``truncate_data`` is on): ``data`` is the entry's first ``max_data_bytes``,
    ``size`` its whole length. The rest was skipped as it arrived, never held."""

    data: bytes
    idem: int
    size: int
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


Frame = Close | Auth | Init | Data | OversizeData | Ack | Ping | Pong


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
    """More bytes are needed to finish the frame (internal to the decoder).

    ``at`` is where reading resumes (the start of the op that did not finish), ``ftype`` and
    ``fields`` the frame's type and the ops read so far, so no op is ever read twice.
    """

    def __init__(
        self, at: int = 0, ftype: int = -1, fields: dict[int, Any] | None = None, skip: int = 0
    ):
        self.at = at
        self.ftype = ftype
        self.fields = fields if fields is not None else {}
        # > 0: the bytes from ``at`` on belong to a cut entry's tail, and ``skip`` more follow
        self.skip = skip


def _varuint(buf: Buffer, pos: int, end: int) -> tuple[int, int]:
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
    elif isinstance(frame, OversizeData):
        raise ValueError("an oversize entry was cut on receipt: it cannot be sent again")
    else:  # pragma: no cover - the union is closed
        raise TypeError(f"not a LogTK frame: {frame!r}")
    parts.append(b"\x00")
    return b"".join(parts)


def _unknown_op(ftype: int, op: int) -> LogTKError:
    # Ops carry no length, so an unknown op leaves the rest of the stream unreadable.
    return LogTKError(f"unknown op {op:#04x} in frame type {ftype:#04x}", reason="unknown_op")


# How each op's value is encoded, per frame type (docs/protocols/logtk.md, "Frames"). Ops carry
# no length, so an op missing here leaves the rest of the stream unreadable.
_BYTE, _BOOL, _UINT32, _VARUINT, _CSTRING, _STRING, _TOKEN, _VARBYTES = range(8)
_OPS: dict[int, dict[int, int]] = {
    FrameType.CLOSE: {1: _BYTE, 2: _STRING},
    FrameType.AUTH: {1: _TOKEN, 2: _BOOL},
    FrameType.INIT: {1: _CSTRING, 2: _UINT32, 3: _VARUINT, 4: _BOOL},
    FrameType.DATA: {1: _VARBYTES, 2: _UINT32},
    FrameType.ACK: {1: _UINT32},
    FrameType.PING: {1: _UINT32},
    FrameType.PONG: {1: _UINT32},
}


# fields key of a data frame's whole entry length once its entry was cut (op 0 is never a field)
_CUT_FROM = 0


def _read_ops(
    buf: Buffer,
    p: int,
    end: int,
    ftype: int,
    fields: dict[int, Any],
    max_data: int,
    truncate: bool = False,
) -> int:
    """Reads ops from ``p`` into ``fields`` up to the frame's ``0x00``; returns the position
    after it. Raises :class:`_Incomplete` (resumable at the unfinished op) or LogTKError.
    With ``truncate``, a data entry over ``max_data`` keeps its first ``max_data`` bytes."""
    ops = _OPS[ftype]
    while True:
        if p >= end:
            raise _Incomplete(p, ftype, fields)
        op = buf[p]
        if op == 0:
            return p + 1
        kind = ops.get(op)
        if kind is None:
            raise _unknown_op(ftype, op)
        q = p + 1
        try:
            if kind == _UINT32:
                if q + 4 > end:
                    raise _Incomplete
                fields[op] = _U32.unpack_from(buf, q)[0]
                q += 4
            elif kind in (_VARBYTES, _STRING):
                n, q = _varuint(buf, q, end)
                if n > max_data and truncate and kind == _VARBYTES:
                    if q + max_data > end:
                        raise _Incomplete
                    fields[op] = bytes(buf[q : q + max_data])
                    fields[_CUT_FROM] = n
                    q += max_data
                    tail = n - max_data
                    if q + tail > end:  # skip the rest as it comes: p is past this op then
                        raise _Incomplete(q, ftype, fields, skip=tail - (end - q))
                    p = q + tail
                    continue
                if n > max_data:
                    if kind == _STRING:
                        raise LogTKLimitExceeded("close reason too long", reason="reason_too_long")
                    raise LogTKLimitExceeded(
                        f"data field of {n} bytes, at most {max_data}", reason="data_too_large"
                    )
                if q + n > end:
                    raise _Incomplete
                if kind == _STRING:
                    try:
                        fields[op] = buf[q : q + n].decode("utf-8")
                    except UnicodeDecodeError:
                        raise LogTKError("close reason is not UTF-8", reason="bad_utf8") from None
                else:
                    fields[op] = bytes(buf[q : q + n])
                q += n
            elif kind in (_BYTE, _BOOL):
                if q >= end:
                    raise _Incomplete
                # boolean: the reference decoder takes any non-zero byte as true
                fields[op] = buf[q] if kind == _BYTE else buf[q] != 0
                q += 1
            elif kind == _VARUINT:
                fields[op], q = _varuint(buf, q, end)
            elif kind == _TOKEN:
                if q + TOKEN_BYTES > end:
                    raise _Incomplete
                fields[op] = bytes(buf[q : q + TOKEN_BYTES])
                q += TOKEN_BYTES
            else:  # _CSTRING: the format name
                nul = buf.find(b"\x00", q, min(end, q + MAX_FORMAT_BYTES + 1))
                if nul < 0:
                    if end - q > MAX_FORMAT_BYTES:
                        raise LogTKError("format cstring too long", reason="bad_format")
                    raise _Incomplete
                try:
                    fields[op] = buf[q:nul].decode("ascii")
                except UnicodeDecodeError:
                    raise LogTKError("format is not ASCII", reason="bad_format") from None
                q = nul + 1
        except _Incomplete as more:
            if more.skip:
                raise
            raise _Incomplete(p, ftype, fields) from None
        p = q


def _build(ftype: int, fields: dict[int, Any]) -> Frame:
    """The frame value once its ``0x00`` was read; a required field missing is malformed."""
    if ftype == FrameType.DATA:
        if 1 not in fields or 2 not in fields:
            raise LogTKError("data frame without data or idem", reason="data_missing_field")
        if _CUT_FROM in fields:
            return OversizeData(fields[1], fields[2], fields[_CUT_FROM])
        return Data(fields[1], fields[2])
    if ftype == FrameType.CLOSE:
        return Close(fields.get(1), fields.get(2))
    if ftype == FrameType.AUTH:
        return Auth(fields.get(1), fields.get(2))
    if ftype == FrameType.INIT:
        return Init(fields.get(1), fields.get(2), fields.get(3), fields.get(4))
    if 1 not in fields:
        raise LogTKError("frame without its uint32 field", reason="missing_field")
    if ftype == FrameType.ACK:
        return Ack(fields[1])
    return Ping(fields[1]) if ftype == FrameType.PING else Pong(fields[1])


def _parse_frame(
    buf: bytes, pos: int, end: int, max_data: int, truncate: bool
) -> tuple[Frame, int]:
    """One frame starting at ``pos``; raises :class:`_Incomplete` or :class:`LogTKError`."""
    ftype = buf[pos]
    p = pos + 1
    if ftype == 0x03 and p + 2 < end and buf[p] == 1:  # data: the hot path
        # Canonical layout first (data then idem, length in 1-2 bytes), as every client sends.
        b0 = buf[p + 1]
        if b0 < 0x80:
            n, q = b0, p + 2
        else:
            b1 = buf[p + 2]
            n, q = ((b0 & 0x7F) << 7 | b1, p + 3) if b1 < 0x80 else (-1, 0)
        e = q + n
        if 0 <= n <= max_data and e + 6 <= end and buf[e] == 2 and buf[e + 5] == 0:
            return Data(buf[q:e], _U32.unpack_from(buf, e + 1)[0]), e + 6
    elif ftype == 0x04 and p + 5 < end and buf[p] == 1 and buf[p + 5] == 0:  # ack: the client's
        return Ack(_U32.unpack_from(buf, p + 1)[0]), p + 6
    if ftype not in _OPS:
        raise LogTKError(f"unknown frame type {ftype:#04x}", reason="unknown_frame_type")
    fields: dict[int, Any] = {}
    p = _read_ops(buf, p, end, ftype, fields, max_data, truncate)
    return _build(ftype, fields), p


def _cut_tail(fields: dict[int, Any]) -> int:
    """Bytes of a cut entry that were skipped (0 for any other frame)."""
    return fields[_CUT_FROM] - len(fields[1]) if _CUT_FROM in fields else 0


class FrameDecoder:
    """Incremental decoder: :meth:`feed` bytes in any split, get whole frames out.

    An unfinished frame is kept as the ops read so far plus the bytes of the op being read, so
    a long frame arriving in small pieces costs each byte once. ``max_frame_bytes`` bounds a
    frame's length (not counting the skipped tail of a cut entry). With ``truncate_data`` an
    entry over ``max_data_bytes`` becomes an :class:`OversizeData` holding its first
    ``max_data_bytes``; without, it is an error. After a malformed or over-limit frame the
    decoder stops for good and keeps the error in :attr:`error`; the frames decoded before it
    in the same :meth:`feed` are still returned.
    """

    __slots__ = (
        "_buf",
        "_held",
        "_skip",
        "_unfinished",
        "error",
        "max_data_bytes",
        "max_frame_bytes",
        "truncate_data",
    )

    def __init__(
        self,
        max_frame_bytes: int = 1 << 20,
        max_data_bytes: int = 1 << 20,
        *,
        truncate_data: bool = False,
    ) -> None:
        self.set_limits(max_frame_bytes, max_data_bytes)
        self.truncate_data = truncate_data
        self._buf = bytearray()  # bytes not decoded yet (from the unfinished op on)
        self._unfinished: tuple[int, dict[int, Any]] | None = None  # (type, ops read so far)
        self._held = 0  # length of the unfinished frame up to the bytes in _buf
        self._skip = 0  # bytes of a cut entry still to come, dropped on arrival
        self.error: LogTKError | None = None

    def set_limits(self, max_frame_bytes: int, max_data_bytes: int) -> None:
        """Bounds for the frames decoded from now on (a server tightens them before auth)."""
        self.max_frame_bytes = max_frame_bytes
        self.max_data_bytes = min(max_data_bytes, max_frame_bytes)

    @property
    def buffered(self) -> int:
        """Length of the unfinished frame so far plus the bytes not yet decoded, not counting
        the skipped tail of a cut entry."""
        fields = self._unfinished[1] if self._unfinished is not None else {}
        return self._held - _cut_tail(fields) + len(self._buf)

    def feed(self, data: bytes, max_frames: int = -1) -> list[Frame]:
        """The frames ``data`` completes; with ``max_frames`` >= 0 at most that many, the rest
        staying buffered for the next call."""
        if self.error is not None:
            return []
        frames: list[Frame] = []
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return frames
            data = data[self._skip :]
            self._skip = 0
        try:
            if self._unfinished is not None:
                rest = self._finish(data, frames)
                if rest is None:
                    return frames
                data = rest
            elif self._buf:  # whole frames left by a max_frames call
                data = bytes(self._buf) + data
                self._buf = bytearray()
            pos = self._decode(data, frames, max_frames)
        except LogTKError as exc:
            self.error = exc
            self._buf = bytearray()
            self._unfinished = None
            self._held = self._skip = 0
            return frames
        if pos < len(data):
            self._buf = bytearray(memoryview(data)[pos:])
        return frames

    def _finish(self, data: bytes, frames: list[Frame]) -> bytes | None:
        """Reads on in the unfinished frame: the bytes after it once it is whole, else None."""
        assert self._unfinished is not None
        buf = self._buf
        buf += data
        ftype, fields = self._unfinished
        try:
            pos = _read_ops(
                buf, 0, len(buf), ftype, fields, self.max_data_bytes, self.truncate_data
            )
        except _Incomplete as more:
            del buf[: self._suspend(more, 0, len(buf))]  # cheap: moves the bytearray's start
            return None
        self._check_size(self._held + pos - _cut_tail(fields))
        self._unfinished = None
        self._held = 0
        frames.append(_build(ftype, fields))
        rest = bytes(memoryview(buf)[pos:])
        self._buf = bytearray()
        return rest

    def _decode(self, buf: bytes, frames: list[Frame], max_frames: int) -> int:
        """Appends the whole frames of ``buf`` to ``frames``; returns how far it got (an
        unfinished frame's state is kept from the op it stopped in)."""
        end = len(buf)
        pos = 0
        max_frame = self.max_frame_bytes
        max_data = self.max_data_bytes
        truncate = self.truncate_data
        while pos < end and len(frames) != max_frames:
            try:
                frame, nxt = _parse_frame(buf, pos, end, max_data, truncate)
            except _Incomplete as more:
                self._held = 0
                return self._suspend(more, pos, end)
            if nxt - pos > max_frame:
                tail = frame.size - len(frame.data) if type(frame) is OversizeData else 0
                self._check_size(nxt - pos - tail)
            frames.append(frame)
            pos = nxt
        return pos

    def _suspend(self, more: _Incomplete, start: int, end: int) -> int:
        """Keeps an unfinished frame's state; returns where the bytes to keep begin."""
        self._unfinished = (more.ftype, more.fields)
        if more.skip:  # from more.at on, the bytes are a cut entry's: dropped, never held
            self._skip = more.skip
            self._held += end - start + more.skip
            kept = end
        else:
            self._held += more.at - start
            kept = more.at
        self._check_size(self._held + end - kept - _cut_tail(more.fields))
        return kept

    def _check_size(self, size: int) -> None:
        if size > self.max_frame_bytes:
            raise LogTKLimitExceeded(
                f"frame of {size} bytes or more, at most {self.max_frame_bytes}",
                reason="frame_too_large",
            )
