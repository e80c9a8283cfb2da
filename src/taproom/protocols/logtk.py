"""LogTK: frame codec and connection state machines, sans-I/O.

LogTK (the logtkjs "WebSocket protocol", also spoken over raw TCP) frames are a type byte,
then ``(op byte, value)`` pairs, then ``0x00`` where the next op would be. This module turns
bytes into frozen frame values and back (:class:`FrameDecoder`, :func:`encode_frame`), and runs
one connection's rules on top: :class:`ServerConnection` (auth, init, data, ack, ping, close
as the hub speaks them) and :class:`ClientConnection` (what taproom's client speaks). Neither
touches a socket or a clock: bytes go in with ``now`` (seconds, any monotonic origin) and
events plus bytes to send come out. docs/protocols/logtk.md states every decision taken where
the seed contradicts itself.

The module also carries the codecs of the payload formats LogTK carries (``protobuf`` as
taproom's ``LogEntry``, ``bson``) and registers their decoders with :mod:`taproom.payloads`.
"""

from __future__ import annotations

import base64
import datetime as _dt
import enum
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import LimitExceeded, ProtocolError
from ..payloads import register_decoder

__all__ = [
    "DEFAULT_FORMAT",
    "TOKEN_BYTES",
    "Ack",
    "AckReceived",
    "Auth",
    "AuthDenied",
    "AuthFailed",
    "Authenticated",
    "ClientConnection",
    "Close",
    "CloseCode",
    "CloseReceived",
    "ConnectionDead",
    "Data",
    "FrameDecoder",
    "FrameType",
    "Init",
    "Initialized",
    "LogTKError",
    "LogTKLimitExceeded",
    "Ping",
    "PingTimeout",
    "Pong",
    "PongPolicy",
    "Ready",
    "ServerConnection",
    "ServerSettings",
    "State",
    "Violation",
    "decode_bson_payload",
    "decode_log_entry",
    "decode_varuint32",
    "encode_frame",
    "encode_log_entry",
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


# --- connection events ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Authenticated:
    """TCP: the auth frame carried a known token (``app`` is the app it belongs to)."""

    app: str


@dataclass(frozen=True, slots=True)
class AuthFailed:
    """TCP: the auth frame's token was refused; the connection is closing with 0xff."""


@dataclass(frozen=True, slots=True)
class Initialized:
    """The init exchange is done. ``ping_interval_ms`` is 0 when no pings are sent."""

    format: str
    client_id: int
    ping_interval_ms: int


@dataclass(frozen=True, slots=True)
class CloseReceived:
    """The peer sent ``close`` (``code`` None: a close-ack). The connection is closed."""

    code: int | None
    reason: str | None


@dataclass(frozen=True, slots=True)
class Violation:
    """The peer broke the protocol or a limit; the close prescribed is already queued."""

    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class PingTimeout:
    """Two pings went unanswered (server) or no ping came in twice the interval (client)."""


class State(enum.Enum):
    AUTH = "auth"  # TCP only: waiting for the auth frame
    INIT = "init"  # waiting for init
    OPEN = "open"  # data flows
    CLOSING = "closing"  # we sent a close that wants a close-ack
    CLOSED = "closed"  # nothing more may be sent; the transport should close


class PongPolicy(enum.Enum):
    """When two missed pongs close a connection (``logtk.pong_policy``)."""

    ALWAYS = "always"  # the seed's rule for everyone
    AFTER_FIRST_PONG = "after_first_pong"  # for clients that have shown they answer pings
    NEVER = "never"  # rely on the idle timeout and TCP alone


@dataclass(frozen=True, slots=True)
class ServerSettings:
    """The knobs of one server connection (taken from the ``[logtk]`` section)."""

    formats: tuple[str, ...] = ("protobuf", "bson", "json")
    max_frame_bytes: int = 1 << 20
    max_data_bytes: int = 1 << 20
    ping_recv: bool = True
    ping_min_delta_ms: int = 1000
    pong_policy: PongPolicy = PongPolicy.AFTER_FIRST_PONG
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0


def ping_interval_ms(client: Init, server_delta_ms: int, server_recv: bool) -> int:
    """``pingDelta = max(clientDelta, serverDelta)/2``, or 0 when either side declines."""
    if not (client.ping_recv and server_recv):
        return 0
    return max(client.ping_min_delta or 0, server_delta_ms) // 2


class ServerConnection:
    """One LogTK connection as the hub sees it.

    ``app`` is given for WebSocket connections (authenticated by the HTTP upgrade); TCP
    connections start in :attr:`State.AUTH` and call ``authenticate(token) -> app | None``
    on the auth frame. Feed bytes with :meth:`receive_data`; the events are
    :class:`Data` frames (to commit, then :meth:`ack`) and the event classes above. Send
    :meth:`data_to_send` after every call; close the transport once :attr:`closed`.
    """

    def __init__(
        self,
        settings: ServerSettings,
        *,
        now: float,
        app: str | None = None,
        authenticate: Callable[[bytes], str | None] | None = None,
    ) -> None:
        if app is None and authenticate is None:
            raise ValueError("a connection needs an app (WebSocket) or authenticate (TCP)")
        self.settings = settings
        self.app = app
        self._authenticate = authenticate
        self.state = State.INIT if app is not None else State.AUTH
        self._decoder = FrameDecoder(settings.max_frame_bytes, settings.max_data_bytes)
        self._out: list[bytes] = []
        self.opened_at = now
        self.last_received = now
        self.format = ""
        self.client_id = 0
        self.ping_interval_s = 0.0
        self._next_ping = 0.0
        self._ping_seq = 0
        self._outstanding: list[int] = []  # ackids of unanswered pings, oldest first
        self.ever_ponged = False
        self.unacked = 0

    # --- outgoing -------------------------------------------------------------------------

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    def close(self, code: int = CloseCode.NORMAL, reason: str | None = None) -> None:
        """Start closing: with the high bit set the connection is done at once."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._out.append(encode_frame(Close(code, reason)))
        self.state = State.CLOSED if code & HIGH_BIT else State.CLOSING

    def ack(self, idems: Iterable[int]) -> None:
        """Acknowledge committed data frames; nothing goes out once the connection is closing
        ("FORBIDDEN from sending ... anything other than a close-ack frame")."""
        if self.state is State.OPEN:
            pack = _U32.pack
            self._out.extend(b"\x04\x01" + pack(idem) + b"\x00" for idem in idems)

    def settled(self, count: int) -> None:
        """``count`` data frames are done with (acked or abandoned): frees the window."""
        self.unacked = max(0, self.unacked - count)

    # --- incoming -------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> list[object]:
        """Decode ``data`` and apply it; returns :class:`Data` frames and events."""
        if self.state is State.CLOSED:
            return []
        self.last_received = now
        events: list[object] = []
        received = 0
        for frame in self._decoder.feed(data):
            if type(frame) is Data and self.state is State.OPEN:  # the hot path
                events.append(frame)
                received += 1
                continue
            if self.state is State.CLOSED:
                break  # nothing is taken after a close
            self._apply(frame, events)
        self.unacked += received
        error = self._decoder.error
        if error is not None and self.state not in (State.CLOSED, State.CLOSING):
            events.append(Violation(error.reason, str(error)))
            reply = error.reply
            assert isinstance(reply, Close) and reply.code is not None
            self.close(reply.code, reply.reason)
        return events

    def _violation(
        self, events: list[object], reason: str, message: str, code: int, text: str
    ) -> None:
        events.append(Violation(reason, message))
        self.close(code, text)

    def _apply(self, frame: Frame, events: list[object]) -> None:
        state = self.state
        if isinstance(frame, Close):
            if state is State.CLOSING:
                if frame.is_ack or not frame.wants_ack:
                    self.state = State.CLOSED
                    events.append(CloseReceived(frame.code, frame.reason))
                return
            # "Once the receiving end sees this, it is FORBIDDEN from sending or receiving
            # anything other than a close-ack frame."
            if frame.wants_ack:
                self._out.append(b"\x00\x00")
            self.state = State.CLOSED
            events.append(CloseReceived(frame.code, frame.reason))
            return
        if state is State.CLOSING:
            return
        if state is State.AUTH:
            if not isinstance(frame, Auth):
                self._violation(
                    events,
                    "not_authenticated",
                    f"{frame.type.name.lower()} before auth",
                    CloseCode.INVALID_AUTH,
                    INVALID_AUTH_REASON,
                )
                return
            app = None
            if self._authenticate is not None:
                # A missing token is checked as an empty one so the glue counts it too.
                app = self._authenticate(frame.token or b"")
            if app is None:
                self._out.append(encode_frame(Auth(status=False)))
                events.append(AuthFailed())
                self.close(CloseCode.INVALID_AUTH, INVALID_AUTH_REASON)
                return
            self.app = app
            self._out.append(encode_frame(Auth(status=True)))
            self.state = State.INIT
            events.append(Authenticated(app))
            return
        if isinstance(frame, Auth):
            return  # "Once authenticated, the server MUST ignore all auth frames it receives."
        if state is State.INIT:
            if isinstance(frame, Init):
                self._init(frame, events)
            elif isinstance(frame, Data):
                self._violation(
                    events,
                    "data_before_init",
                    "data before init",
                    CloseCode.MALFORMED,
                    "data before init",
                )
            return  # pings, pongs and acks before init carry nothing to act on
        # OPEN
        # (data on an open connection never gets here: receive_data takes it directly)
        if isinstance(frame, Pong) and frame.ackid in self._outstanding:
            self._outstanding.clear()
            self.ever_ponged = True
        # A second init "SHOULD be ignored"; ack and ping are server frames: ignored.

    def _init(self, frame: Init, events: list[object]) -> None:
        s = self.settings
        if frame.id is None:
            self._violation(
                events, "init_without_id", "init without id", CloseCode.MALFORMED, MALFORMED_REASON
            )
            return
        if frame.ping_recv and frame.ping_min_delta is None:
            # The seed's "No ping_min_delta" example: closed as a malformed frame.
            self._violation(
                events,
                "init_without_ping_delta",
                "ping_recv without ping_min_delta",
                CloseCode.MALFORMED,
                MALFORMED_REASON,
            )
            return
        fmt = frame.format if frame.format is not None else DEFAULT_FORMAT
        if fmt not in s.formats:
            self._violation(
                events,
                "unsupported_format",
                "unsupported format",
                CloseCode.UNSUPPORTED_FORMAT,
                "unsupported format",
            )
            return
        self.format = fmt
        self.client_id = frame.id
        interval = ping_interval_ms(frame, s.ping_min_delta_ms, s.ping_recv)
        answer = Init(
            format=fmt,
            ping_min_delta=s.ping_min_delta_ms if s.ping_recv else None,
            ping_recv=s.ping_recv,
        )
        self._out.append(encode_frame(answer))
        self.state = State.OPEN
        self.ping_interval_s = interval / 1000
        self._next_ping = self.last_received + self.ping_interval_s
        events.append(Initialized(fmt, frame.id, interval))

    # --- timers ---------------------------------------------------------------------------

    def _pongs_enforced(self) -> bool:
        policy = self.settings.pong_policy
        if policy is PongPolicy.ALWAYS:
            return True
        return policy is PongPolicy.AFTER_FIRST_PONG and self.ever_ponged

    def tick(self, now: float) -> list[object]:
        """Run the timers: handshake and idle timeouts, pings, missed pongs."""
        events: list[object] = []
        s = self.settings
        if self.state in (State.AUTH, State.INIT):
            if now - self.opened_at >= s.handshake_timeout_s:
                self._violation(
                    events,
                    "handshake_timeout",
                    "handshake timeout",
                    CloseCode.TIMEOUT,
                    "handshake timeout",
                )
            return events
        if self.state is not State.OPEN:
            return events
        if now - self.last_received >= s.idle_timeout_s:
            self._violation(
                events, "idle_timeout", "idle timeout", CloseCode.TIMEOUT, "idle timeout"
            )
            return events
        if self.ping_interval_s and now >= self._next_ping:
            if len(self._outstanding) >= 2 and self._pongs_enforced():
                events.append(PingTimeout())
                self._violation(
                    events,
                    "ping_timeout",
                    "two pings unanswered",
                    CloseCode.PING_TIMEOUT,
                    "ping timeout",
                )
                return events
            self._ping_seq = (self._ping_seq + 1) & _U32_MAX
            self._outstanding = [*self._outstanding[-3:], self._ping_seq]
            self._out.append(encode_frame(Ping(self._ping_seq)))
            self._next_ping = now + self.ping_interval_s
        return events


# --- client ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    """The server answered init; data may flow. ``ping_interval_ms`` 0: no pings."""

    format: str
    ping_interval_ms: int


@dataclass(frozen=True, slots=True)
class AuthDenied:
    """TCP: the server refused the token."""


@dataclass(frozen=True, slots=True)
class AckReceived:
    """The server acknowledged these idempotency tokens."""

    idems: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ConnectionDead:
    """No ping arrived in twice the ping interval: reconnect."""


@dataclass
class ClientConnection:
    """taproom's client side of one connection (sans-I/O).

    ``transport`` is ``"tcp"`` (auth frame first) or ``"ws"`` (authenticated by the HTTP
    upgrade). Always answers pings. Events: :class:`Ready`, :class:`AckReceived`,
    :class:`AuthDenied`, :class:`CloseReceived`, :class:`ConnectionDead`, :class:`Violation`.
    """

    transport: str
    client_id: int
    now: float
    token: bytes | None = None
    format: str = DEFAULT_FORMAT
    ping_min_delta_ms: int = 1000
    ping_recv: bool = True
    max_frame_bytes: int = 1 << 20
    state: State = State.AUTH
    ping_interval_s: float = 0.0
    last_ping: float = 0.0
    _out: list[bytes] = field(default_factory=list)
    _decoder: FrameDecoder = field(init=False)

    def __post_init__(self) -> None:
        self._decoder = FrameDecoder(self.max_frame_bytes, self.max_frame_bytes)
        if self.transport == "tcp":
            if self.token is None or len(self.token) != TOKEN_BYTES:
                raise ValueError(f"a TCP client needs a {TOKEN_BYTES}-byte token")
            self._out.append(encode_frame(Auth(token=self.token)))
            self.state = State.AUTH
        else:
            self._send_init()

    def _send_init(self) -> None:
        self._out.append(
            encode_frame(
                Init(
                    format=self.format,
                    id=self.client_id,
                    ping_min_delta=self.ping_min_delta_ms,
                    ping_recv=self.ping_recv,
                )
            )
        )
        self.state = State.INIT

    def data_to_send(self) -> bytes:
        out = b"".join(self._out)
        self._out.clear()
        return out

    @property
    def ready(self) -> bool:
        return self.state is State.OPEN

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    def send(self, idem: int, data: bytes) -> None:
        """Queue one data frame (only once :attr:`ready`)."""
        if self.state is not State.OPEN:
            raise RuntimeError("connection not ready")
        self._out.append(encode_frame(Data(data, idem)))

    def close(self, code: int = CloseCode.NO_ACK, reason: str | None = "client exiting") -> None:
        if self.state in (State.CLOSING, State.CLOSED):
            return
        self._out.append(encode_frame(Close(code, reason)))
        self.state = State.CLOSED if code & HIGH_BIT else State.CLOSING

    def receive_data(self, data: bytes, now: float) -> list[object]:
        if self.state is State.CLOSED:
            return []
        frames = self._decoder.feed(data)
        events: list[object] = []
        acks: list[int] = []
        for frame in frames:
            if self.state is State.CLOSED:
                break
            if type(frame) is Ack:
                if self.state is State.OPEN:
                    acks.append(frame.idem)
            elif isinstance(frame, Close):
                if frame.wants_ack and self.state is not State.CLOSING:
                    self._out.append(b"\x00\x00")
                self.state = State.CLOSED
                events.append(CloseReceived(frame.code, frame.reason))
            elif self.state is State.CLOSING:
                continue
            elif isinstance(frame, Auth) and self.state is State.AUTH:
                if frame.status:
                    self._send_init()
                else:
                    events.append(AuthDenied())
            elif isinstance(frame, Init) and self.state is State.INIT:
                if frame.format != self.format:
                    events.append(Violation("format_mismatch", f"server chose {frame.format!r}"))
                    self.close(CloseCode.UNSUPPORTED_FORMAT, "unsupported format")
                    continue
                server = Init(ping_min_delta=self.ping_min_delta_ms, ping_recv=self.ping_recv)
                interval = ping_interval_ms(
                    server, frame.ping_min_delta or 0, bool(frame.ping_recv)
                )
                self.ping_interval_s = interval / 1000
                self.last_ping = now
                self.state = State.OPEN
                events.append(Ready(frame.format, interval))
            elif isinstance(frame, Ping):
                self.last_ping = now
                self._out.append(encode_frame(Pong(frame.ackid)))
        if acks:
            events.append(AckReceived(tuple(acks)))
        error = self._decoder.error
        if error is not None and self.state is not State.CLOSED:
            events.append(Violation(error.reason, str(error)))
            self.close(CloseCode.MALFORMED, MALFORMED_REASON)
        return events

    def tick(self, now: float) -> list[object]:
        """``ConnectionDead`` once no ping came in ``2 * pingDelta``."""
        if (
            self.state is State.OPEN
            and self.ping_interval_s
            and now - self.last_ping > 2 * self.ping_interval_s
        ):
            self.state = State.CLOSED
            return [ConnectionDead()]
        return []


# --- payload formats ------------------------------------------------------------------------
# taproom's LogEntry (logtk_entry.proto next to this module), hand-coded: five fields do not
# justify generated code, and no protoc is needed at build time. Field numbers follow the
# reference client's ``logtk.LogMessage`` (1 time, 2 trace, 3 level, 4 message) so its
# messages decode too; ``fields`` (5) is taproom's addition.


def _pb_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _pb_read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = 0
    shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint too long")


def _pb_bytes(number: int, value: bytes) -> bytes:
    return _pb_varint(number << 3 | 2) + _pb_varint(len(value)) + value


def encode_log_entry(
    *,
    time_ms: int = 0,
    level: int = 0,
    message: str = "",
    trace: Mapping[str, object] | None = None,
    fields: Mapping[str, str] | None = None,
) -> bytes:
    """Serialize a ``taproom.logtk.LogEntry`` (proto3 wire format, default values omitted)."""
    out = bytearray()
    if time_ms:
        out += _pb_varint(1 << 3) + _pb_varint(time_ms)
    if trace:
        inner = bytearray()
        if trace.get("file"):
            inner += _pb_bytes(1, str(trace["file"]).encode("utf-8"))
        for number, key in ((2, "line"), (3, "col")):
            value = int(trace.get(key) or 0)  # type: ignore[call-overload]
            if value:
                inner += _pb_varint(number << 3) + _pb_varint(value)
        out += _pb_bytes(2, bytes(inner))
    if level:
        out += _pb_varint(3 << 3) + _pb_varint(level)
    if message:
        out += _pb_bytes(4, message.encode("utf-8"))
    for key, value in (fields or {}).items():
        entry = _pb_bytes(1, key.encode("utf-8")) + _pb_bytes(2, str(value).encode("utf-8"))
        out += _pb_bytes(5, entry)
    return bytes(out)


def _pb_fields(buf: bytes) -> list[tuple[int, int, object]]:
    """(field number, wire type, value) for every field; unknown fields are kept, not fatal."""
    out: list[tuple[int, int, object]] = []
    pos = 0
    while pos < len(buf):
        key, pos = _pb_read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        value: object
        if wire == 0:
            value, pos = _pb_read_varint(buf, pos)
        elif wire == 1:
            if pos + 8 > len(buf):
                raise ValueError("truncated fixed64")
            value = buf[pos : pos + 8]
            pos += 8
        elif wire == 2:
            n, pos = _pb_read_varint(buf, pos)
            if pos + n > len(buf):
                raise ValueError("truncated length-delimited field")
            value = buf[pos : pos + n]
            pos += n
        elif wire == 5:
            if pos + 4 > len(buf):
                raise ValueError("truncated fixed32")
            value = buf[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        out.append((number, wire, value))
    return out


def decode_log_entry(payload: bytes) -> dict[str, object]:
    """A ``LogEntry`` as a JSON-ready dict; raises ``ValueError`` on a malformed message."""
    entry: dict[str, object] = {"time": 0, "level": 0, "message": "", "trace": None, "fields": {}}
    fields: dict[str, str] = {}
    for number, wire, value in _pb_fields(payload):
        if number == 1 and wire == 0:
            entry["time"] = value
        elif number == 2 and wire == 2:
            assert isinstance(value, bytes)
            trace: dict[str, object] = {"file": "", "line": 0, "col": 0}
            for n, w, v in _pb_fields(value):
                if n == 1 and w == 2:
                    assert isinstance(v, bytes)
                    trace["file"] = v.decode("utf-8")
                elif n == 2 and w == 0:
                    trace["line"] = v
                elif n == 3 and w == 0:
                    trace["col"] = v
            entry["trace"] = trace
        elif number == 3 and wire == 0:
            entry["level"] = value
        elif number == 4 and wire == 2:
            assert isinstance(value, bytes)
            entry["message"] = value.decode("utf-8")
        elif number == 5 and wire == 2:
            assert isinstance(value, bytes)
            key = text = ""
            for n, w, v in _pb_fields(value):
                if w == 2 and n in (1, 2):
                    assert isinstance(v, bytes)
                    if n == 1:
                        key = v.decode("utf-8")
                    else:
                        text = v.decode("utf-8")
            fields[key] = text
    entry["fields"] = fields
    return entry


def _json_ready(value: object) -> object:
    if isinstance(value, dict):
        return {str(k): _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, _dt.datetime):
        return value.isoformat()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # ObjectId, Regex, Decimal128, Timestamp, ...


def decode_bson_payload(payload: bytes) -> object:
    """A BSON document (the reference client's ``$level``/``$message``/... records)."""
    import bson  # from pymongo; imported here so the wire path never pays for it

    return _json_ready(bson.decode(payload))


register_decoder("protobuf", decode_log_entry)
register_decoder("bson", decode_bson_payload)
