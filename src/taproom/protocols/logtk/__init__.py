"""LogTK: frame codec, connection state machines and payload formats, sans-I/O.

LogTK (the logtkjs "WebSocket protocol", also spoken over raw TCP) frames are a type byte,
then ``(op byte, value)`` pairs, then ``0x00`` where the next op would be. The package is cut
along its seams: :mod:`.frames` turns bytes into frozen frame values and back
(:class:`FrameDecoder`, :func:`encode_frame`); :mod:`.session` runs one connection's rules on
top (:class:`ServerConnection` as the hub speaks them, :class:`ClientConnection` as taproom's
client does), bytes in with ``now`` and events plus bytes to send out, no socket or clock;
:mod:`.entries` holds the payload formats LogTK carries (``protobuf`` as taproom's
``LogEntry``, ``bson``) and registers their decoders with :mod:`taproom.payloads`.
docs/protocols/logtk.md states every decision taken where the seed contradicts itself.
"""

from __future__ import annotations

from .entries import decode_bson_payload, decode_log_entry, encode_log_entry, time_reader
from .frames import (
    DEFAULT_FORMAT,
    TOKEN_BYTES,
    Ack,
    Auth,
    Close,
    CloseCode,
    Data,
    FrameDecoder,
    FrameType,
    Init,
    LogTKError,
    LogTKLimitExceeded,
    OversizeData,
    Ping,
    Pong,
    decode_varuint32,
    encode_frame,
    encode_varuint32,
)
from .session import (
    AckReceived,
    AuthDenied,
    Authenticated,
    AuthFailed,
    ClientConnection,
    CloseReceived,
    ConnectionDead,
    Initialized,
    PingTimeout,
    PongPolicy,
    Ready,
    ServerConnection,
    ServerSettings,
    State,
    Violation,
)

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
    "OversizeData",
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
    "time_reader",
]
