"""Lumberjack v1/v2 server (config, connection, service; kernel: the compiled window kernel;
resend: the memory of cut-off windows): asyncio glue around :class:`taproom.protocols.lumberjack.ServerConnection`.

One listener speaks both versions (the version byte of each frame decides). Each connection is
an :class:`asyncio.Protocol` (cheaper than streams for 10,000 idle connections): bytes go to the
sans-I/O parser, every batch it hands over goes to ``hub.submit`` at once (pipelining), and acks
go out in order once the commit covering them resolves (v2: a partial ack per committed part of
a large window).

Memory comes from the hub's budget (``taproom.budget``), reserved before the parser makes it:
journal room from ``pending`` (a step at a time; the batches it builds are handed to the hub
with their reservation), inflated bytes from ``inflate``, and an incomplete frame's bytes past
a small allowance from ``connection_buffers``. A connection stops reading (``pause_reading``)
while any hold is on: the hub is out of capacity; the parser has more buffered (the rest runs
on the next loop turn, so a large window or a zlib bomb never holds the loop for long); or it
waits for room in one of those holders (FIFO). One sweep task per listener closes connections
that completed no frame for ``idle_timeout_s``; a connection owns a timer only while a v2
window waits for its commit (keepalives).

When a connection ends in the middle of a window, the fingerprints of what of it was committed
are remembered per sender (``resend_memory_events``), and the sender's resend skips them: a
refused or cut-off window is stored once even when the sender resends it whole.
"""

from __future__ import annotations

from .config import LumberjackConfig, server_ssl_context
from .service import LumberjackServer, create_service

__all__ = ["LumberjackConfig", "LumberjackServer", "create_service", "server_ssl_context"]
