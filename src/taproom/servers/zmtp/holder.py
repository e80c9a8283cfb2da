"""What taproom's ZeroMQ connections reserve their buffers from: the process budget's
connection buffers (``taproom.budget``, shared with Lumberjack's and LogTK's incomplete frames)."""

from __future__ import annotations

from typing import Protocol

from ...budget import CONNECTION_BUFFERS
from ...hub import Hub

__all__ = ["Holder", "buffer_holder"]


class Holder(Protocol):
    """A share of the process memory budget (``taproom.budget.Holder``): reserve first."""

    def try_reserve(self, n: int) -> bool: ...

    async def reserve(self, n: int) -> None: ...

    def release(self, n: int) -> None: ...


def buffer_holder(hub: Hub) -> Holder:
    """The holder every ZeroMQ connection buffer of this hub reserves from."""
    return hub.budget.holder(CONNECTION_BUFFERS)
