"""Small pyzmq helpers shared by the bus's sockets (hot-loop sends, endpoints, re-arming)."""

from __future__ import annotations

from datetime import UTC, datetime

import zmq
import zmq.asyncio


def endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


# pyzmq's Socket.send / recv_multipart wrap the Cython methods in Python that costs several
# microseconds a frame; the hot loops call the Cython methods directly with int flags.
base_send = zmq.backend.Socket.send
MORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
# The most frames of any command here (ROUTER identity + SYNC + 6 event frames is 8): a longer
# message is refused before its frames are kept.
MAX_FRAMES = 16
# Frames this large are lent to ZeroMQ rather than copied (pyzmq's own copy_threshold).
LEND_BYTES = 65536


def send_last(sock: zmq.Socket[bytes], data: bytes) -> None:
    """The last frame of a message. A large value is lent to ZeroMQ (copy=False) rather than
    duplicated for every send; a small one is copied, which is cheaper than lending."""
    if len(data) < LEND_BYTES:
        base_send(sock, data, 0)
    else:
        base_send(sock, data, 0, False)


def rearm(sock: zmq.asyncio.Socket) -> None:
    """After a send on a synchronous shadow: a ZeroMQ FD is edge-triggered and the send may
    have consumed the edge a pending asyncio receive on the same socket waits for. Reading
    EVENTS through the asyncio socket makes pyzmq re-check and wake that receive."""
    sock.get(zmq.EVENTS)


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="microseconds")
