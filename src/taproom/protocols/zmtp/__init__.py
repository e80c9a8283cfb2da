"""ZMTP 3.x, taproom's own ZeroMQ transport for the sockets it binds (issue 26).

libzmq keeps every frame of an unfinished multi-part message until the last one arrives, and
its limits count frames or messages, never bytes: a few peers sending frames flagged MORE and
never the last made a hub hold hundreds of MiB, uncounted. taproom therefore reads the
sockets it binds as ZMTP itself (docs/architecture.md, decision 12): this package is the
sans-I/O core, ``taproom.servers.zmtp`` the asyncio glue.

* ``wire``: greeting, frames, commands, metadata, the socket-type rules, and the frame
  scanner that walks a connection's receive buffer in place (its C twin is ``zt_scan`` /
  ``zt_take`` in taproom/zmqburst/burst.c).
* ``handshake``: the accepting side up to READY (NULL; CURVE in ``curve``).
"""

from __future__ import annotations

from .handshake import Handshake, Mechanism, Peer
from .wire import (
    COMPATIBLE,
    GREETING_SIZE,
    Flag,
    Greeting,
    Scan,
    ScanStatus,
    ZmtpError,
    encode_command,
    encode_frame,
    encode_message,
    encode_metadata,
    error_command,
    parse_command,
    parse_metadata,
    ping_command,
    pong_command,
    scan,
    subscribe_message,
    take,
)

__all__ = [
    "COMPATIBLE",
    "GREETING_SIZE",
    "Flag",
    "Greeting",
    "Handshake",
    "Mechanism",
    "Peer",
    "Scan",
    "ScanStatus",
    "ZmtpError",
    "encode_command",
    "encode_frame",
    "encode_message",
    "encode_metadata",
    "error_command",
    "parse_command",
    "parse_metadata",
    "ping_command",
    "pong_command",
    "scan",
    "subscribe_message",
    "take",
]
