"""taproom's own ZeroMQ transport (ZMTP 3.x over asyncio) for the sockets it binds and reads
from: see ``transport`` and docs/architecture.md decision 12. The sans-I/O core is
``taproom.protocols.zmtp``; the ``[zmtp]`` section is in ``config``."""

from __future__ import annotations

from .config import ZmtpConfig
from .holder import Holder, buffer_holder
from .transport import ZmtpSocket

__all__ = ["Holder", "ZmtpConfig", "ZmtpSocket", "buffer_holder"]
