"""asyncio / pyzmq glue: one module per protocol, each a page or two.

Every server module declares its config section and a ``create_service(hub, section)`` that
returns an object following :class:`Service`. ``taproom serve`` starts every enabled section's
service and writes the addresses they report into the ready file.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable
from typing import Protocol

__all__ = ["ACCEPT_BATCH", "SERVICE_MODULES", "Service", "deepen_accept_queue", "defer_accept"]

# asyncio's default backlog, which is also how many connections it accepts per wakeup: larger
# batches let a connect/RST flood's reset connections pile up unread (and /health wait).
ACCEPT_BATCH = 100

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


class Listening(Protocol):
    """A listening socket as asyncio's servers show it (``TransportSocket``)."""

    @property
    def family(self) -> int: ...

    @property
    def type(self) -> int: ...

    def fileno(self) -> int: ...

    def setsockopt(self, level: int, optname: int, value: int, /) -> None: ...


def deepen_accept_queue(sockets: Iterable[Listening], backlog: int) -> None:
    """Give listening sockets a kernel accept queue of ``backlog`` (capped by
    net.core.somaxconn) while asyncio keeps accepting the batch it was created with.

    asyncio passes one ``backlog`` to both ``listen()`` and its accept loop; a full kernel queue
    drops SYNs, which clients retry only after 1 s. Listening again on a duplicate descriptor
    of the same socket changes the queue alone.
    """
    for listening in sockets:
        with socket.fromfd(listening.fileno(), listening.family, listening.type) as dup:
            dup.listen(backlog)


def defer_accept(sockets: Iterable[Listening], seconds: float) -> None:
    """For protocols whose client speaks first: a connection is queued for accept only once
    its first bytes arrived (TCP_DEFER_ACCEPT, nginx's "deferred"; Linux only), so a
    connect/RST flood never reaches the event loop. A silent connection is queued after about
    ``seconds`` and meets the server's own handshake timeout then."""
    if not hasattr(socket, "TCP_DEFER_ACCEPT"):
        return
    for listening in sockets:
        listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, max(1, round(seconds)))
