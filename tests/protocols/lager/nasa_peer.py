"""Test peers that behave as nasa/lager's C++ programs do, read from its source (src/ of
github.com/nasa/lager): no C++ peer is available here, so these keep its observable rules.

* :class:`NasaChpClient` -- ClusteredHashmapClient's subscriber: the sequence frame is a
  host-order double; an update is applied only if its sequence is larger than the last message's
  (HUGZ included: the client stores every message's sequence).
"""

from __future__ import annotations

import struct

import zmq
import zmq.asyncio

__all__ = ["NasaChpClient"]

_DOUBLE = struct.Struct("=d")


class NasaChpClient:
    """The subscriber thread of nasa/lager's ClusteredHashmapClient, as an asyncio socket."""

    def __init__(self, ctx: zmq.asyncio.Context, publisher: str) -> None:
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 1)  # as the C++: "so messages don't stack up"
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publisher)
        self.sequence = -1.0
        self.hash_map: dict[bytes, bytes] = {}
        self.uuid_map: dict[bytes, bytes] = {}
        self.applied: list[bytes] = []

    async def handle_one(self, timeout: float) -> bool:
        """Read one message if one comes within ``timeout`` seconds; False otherwise."""
        if not await self.sub.poll(int(timeout * 1000)):
            return False
        key, seq, uuid, _empty, value = (await self.sub.recv_multipart())[:5]
        sequence = _DOUBLE.unpack(seq)[0]  # *(double*)msg.data()
        if key != b"HUGZ" and sequence > self.sequence:
            if value:
                self.hash_map[key] = value
                self.uuid_map[uuid] = key
                self.applied.append(key)
            else:
                self.hash_map.pop(key, None)
        self.sequence = sequence
        return True

    def close(self) -> None:
        self.sub.close(linger=0)
