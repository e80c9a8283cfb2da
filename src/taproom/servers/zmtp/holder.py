"""What taproom's ZeroMQ connections reserve their buffers from: the process budget's holder for
connection buffers (``taproom.budget``), or, on a hub without one, a holder of their own."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from typing import Protocol

from ...hub import Hub

__all__ = ["Holder", "LocalHolder", "buffer_holder"]


class Holder(Protocol):
    """A share of the process memory budget (``taproom.budget``): reserve before holding."""

    def try_reserve(self, n: int) -> bool: ...

    async def reserve(self, n: int) -> None: ...

    def release(self, n: int) -> None: ...


class LocalHolder:
    """A holder of its own, FIFO-fair, for a hub without a process budget (``hub.budget``):
    ``try_reserve`` never jumps the queue of waiting ``reserve`` calls, and one request larger
    than the whole limit is let through alone (it is bounded by the message bound)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    def _fits(self, n: int) -> bool:
        return self.used + n <= self.limit or self.used == 0

    def try_reserve(self, n: int) -> bool:
        if self._waiters or not self._fits(n):
            return False
        self.used += n
        return True

    async def reserve(self, n: int) -> None:
        if self.try_reserve(n):
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, future)
        self._waiters.append(entry)
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release(n)  # granted as it was cancelled: give it back
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)
            raise

    def release(self, n: int) -> None:
        self.used -= n
        waiters = self._waiters
        while waiters and self._fits(waiters[0][0]):
            size, future = waiters.popleft()
            if future.done():
                continue
            self.used += size
            future.set_result(None)


_HOLDERS: weakref.WeakKeyDictionary[Hub, Holder] = weakref.WeakKeyDictionary()


def buffer_holder(hub: Hub) -> Holder:
    """The holder every ZeroMQ connection buffer of this hub reserves from: the process
    budget's connection buffers when the hub has one, else one of its own bounded by
    ``max_pending_bytes``."""
    budget = getattr(hub, "budget", None)
    if budget is not None:
        return budget.holder("connections")
    holder = _HOLDERS.get(hub)
    if holder is None:
        holder = _HOLDERS[hub] = LocalHolder(hub.config.hub.max_pending_bytes)
    return holder
