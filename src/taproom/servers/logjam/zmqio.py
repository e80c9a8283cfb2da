"""The pyzmq calls the logjam loops make outside taproom.zmqburst, made cheap, and the helpers
they share.

pyzmq's Socket.send is a Python wrapper (routing ids, groups) around the Cython send; the hot
loops call the Cython method directly, which halves the cost of a frame (DESIGN.md decision 3).
pyzmq's IntFlag constants cost an __index__ call per use, so the loops use plain ints.
"""

from __future__ import annotations

import zmq
import zmq.asyncio
import zmq.backend

__all__ = ["MAX_FRAMES", "NOBLOCK", "SNDMORE", "raw_send", "readable"]

# routing id + empty delimiter + four frames; anything longer is refused without keeping it.
MAX_FRAMES = 6

raw_send = zmq.backend.Socket.send
NOBLOCK = int(zmq.NOBLOCK)
SNDMORE = int(zmq.SNDMORE)


async def readable(asock: zmq.asyncio.Socket, sock: zmq.Socket) -> None:
    """Return when ``sock`` has input. ZMQ_FD is edge-triggered and replies sent on the
    same socket (acks) can consume the edge, so the wait re-checks every 100 ms."""
    while not int(sock.get(zmq.EVENTS)) & zmq.POLLIN:
        await asock.poll(100, zmq.POLLIN)  # type: ignore[call-arg]
