"""Lumberjack v1 and v2 (Beats), sans-I/O: bytes in, journal batches and acks out.

One :class:`ServerConnection` per TCP/TLS connection. ``receive_data(data, now_ns)`` parses
every complete frame, maps data frames straight into the journal's record encoding (no per-event
objects) and returns a :class:`Window` for each window that is complete; the glue submits
``window.batch`` to the hub and, once it is durable, sends ``encode_ack(window.version,
window.ack_seq)``. ``flush()`` closes a partial window when the connection goes idle (streaming
v1 clients never finish a window). :class:`ClientSession` is the sender's side: it encodes
windows, tracks them until acknowledged and tells what to resend after a reconnect.

Wire format (seed ``lumberjack-v1.txt``; v2 is the same framing with version byte ``'2'``)::

    version(1) type(1) payload...      all integers uint32 big-endian
    W size | D seq npairs (klen key vlen value)* | J seq len json | C len zlib | A seq

The decoder raises only :class:`LumberjackError` (a :class:`~taproom.errors.ProtocolError`)
or :class:`LumberjackLimit` (a :class:`~taproom.errors.LimitExceeded`); both carry the
windows completed before the bad frame in ``windows`` so nothing parsed before it is lost.
Decisions on the seed's ambiguities are in ``docs/protocols/lumberjack.md``.

The package is cut along its seams: :mod:`.frames` (frame values, errors, sequence arithmetic),
:mod:`.decoder` (:class:`ServerConnection`, the hub's hot path), :mod:`.session` (the client's
:class:`ClientSession`).
"""

from __future__ import annotations

from .decoder import STALL_INFLATE, STALL_ROOM, Limits, ServerConnection, Window, fingerprint
from .frames import (
    PROTOCOL,
    AckFrame,
    CompressedFrame,
    DataFrame,
    FrameType,
    JsonFrame,
    LumberjackError,
    LumberjackLimit,
    Version,
    WindowSizeFrame,
    encode_ack,
    next_seq,
    seq_after,
)
from .session import ClientSession, SentWindow, windows_of

__all__ = [
    "PROTOCOL",
    "STALL_INFLATE",
    "STALL_ROOM",
    "AckFrame",
    "ClientSession",
    "CompressedFrame",
    "DataFrame",
    "FrameType",
    "JsonFrame",
    "Limits",
    "LumberjackError",
    "LumberjackLimit",
    "SentWindow",
    "ServerConnection",
    "Version",
    "Window",
    "WindowSizeFrame",
    "encode_ack",
    "fingerprint",
    "next_seq",
    "seq_after",
    "windows_of",
]
