"""taproom's own ZeroMQ transport (ZMTP 3.x over asyncio) for the sockets it binds: those it
reads from (``transport``) and its publishers (``publisher``); docs/architecture.md decision 12. The sans-I/O core is
``taproom.protocols.zmtp``; the ``[zmtp]`` section is in ``config``."""

from __future__ import annotations

from .config import ZmtpConfig
from .holder import Holder, buffer_holder
from .publisher import Subscriber, ZmtpPublisher
from .transport import ZmtpSocket

__all__ = ["Holder", "Subscriber", "ZmtpConfig", "ZmtpPublisher", "ZmtpSocket", "buffer_holder"]
