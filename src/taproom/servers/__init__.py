"""asyncio / pyzmq glue: one module per protocol, each a page or two.

Every server module declares its config section and a ``create_service(hub, section)`` that
returns an object following :class:`Service`. ``taproom serve`` starts every enabled section's
service and writes the addresses they report into the ready file.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["SERVICE_MODULES", "Service"]

# Section name -> module with ``create_service``; the order is the start order.
SERVICE_MODULES = {
    "lumberjack": "taproom.servers.lumberjack",
    "logtk": "taproom.servers.logtk",
    "logjam": "taproom.servers.logjam",
    "eventbus": "taproom.servers.eventbus",
    "lager": "taproom.servers.lager",
}


class Service(Protocol):
    """What ``taproom serve`` needs from a protocol server."""

    async def start(self) -> dict[str, str]:
        """Bind and start serving; listener name -> ``host:port`` actually bound."""
        ...

    async def stop(self) -> None:
        """Stop accepting, let in-flight commits finish and their acks go out, close."""
        ...
