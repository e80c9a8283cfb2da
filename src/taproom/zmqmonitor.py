"""Connections a ZeroMQ socket refused at the handshake, counted from its monitor events.

libzmq refuses a peer of the wrong socket type (a PUSH or PUB client on a ROUTER, a DEALER
on a PULL) or a garbage greeting without telling the application: no message arrives, and
the monitor reports the connection as accepted and then disconnected, with no
``HANDSHAKE_SUCCEEDED`` in between (a bad greeting may also give ``HANDSHAKE_FAILED_*``).
:class:`HandshakeTracker` turns that sequence into a count; :func:`watch_handshakes` feeds it
from a socket's monitor.

Each refusal has a reason: ``handshake_refused`` (the wrong socket type, a garbage greeting),
``mechanism_mismatch`` (a NULL peer on a CURVE listener, or the reverse),
``curve_handshake_failed`` (a CURVE peer that does not know the server's key) or ``zap`` (the
ZAP handler said no: :mod:`taproom.zmqaccess` has counted it already, with the peer's address,
which the monitor does not give).

What libzmq does not report cannot be counted here: a message over ``ZMQ_MAXMSGSIZE`` closes
its connection after a successful handshake, which the monitor shows as an ordinary
disconnect.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

__all__ = ["HandshakeTracker", "watch_handshakes"]

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
)
_PROTOCOL_REASONS: dict[int, str] = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "mechanism_mismatch",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "curve_handshake_failed",
}
EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


class HandshakeTracker:
    """Which accepted connections have not finished their handshake.

    libzmq gives ``HANDSHAKE_SUCCEEDED`` without the connection's file descriptor, so it is
    taken as the oldest pending connection's (handshakes take about the same time each); the
    count stays exact once the connections involved have closed.
    """

    def __init__(self) -> None:
        self._pending: dict[int, None] = {}  # accepted fds, oldest first

    def event(self, kind: int, value: int) -> str:
        """Feed one monitor event; the refusal's reason when it shows one, else ``""``."""
        if kind == zmq.EVENT_ACCEPTED:
            self._pending.pop(value, None)  # a reused descriptor starts over
            self._pending[value] = None
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self._pending:
                del self._pending[next(iter(self._pending))]
        elif kind in _FAILED:
            if self._pending:
                del self._pending[next(iter(self._pending))]
            if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                return "zap"
            return _PROTOCOL_REASONS.get(value, "handshake_refused")
        elif kind == zmq.EVENT_DISCONNECTED and value in self._pending:
            del self._pending[value]  # closed before its handshake succeeded
            return "handshake_refused"
        return ""


def watch_handshakes(
    sock: zmq.asyncio.Socket, on_refused: Callable[[str], None]
) -> Coroutine[Any, Any, None]:
    """A coroutine that calls ``on_refused(reason)`` for every connection ``sock`` refuses, until
    cancelled. The monitor starts now, not when the coroutine first runs, so that no
    connection made in between is missed."""
    return _watch(sock, sock.get_monitor_socket(EVENTS), on_refused)


async def _watch(
    sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket, on_refused: Callable[[str], None]
) -> None:
    raw: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
    tracker = HandshakeTracker()
    try:
        while True:
            # A timed poll, then drain: a ZeroMQ FD is edge-triggered, and an edge consumed by
            # another check must not leave events unread until the next connection.
            await monitor.poll(1000)
            while True:
                try:
                    event = parse_monitor_message(raw.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
                reason = tracker.event(int(event["event"]), int(event["value"]))
                if reason:
                    on_refused(reason)
    finally:
        with contextlib.suppress(zmq.ZMQError):
            sock.disable_monitor()
        monitor.close(0)
