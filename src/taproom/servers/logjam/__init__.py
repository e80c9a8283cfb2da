"""Logjam over ZeroMQ: taproom as a logjam-device, on the hub's event loop.

* ``config``: the ``[logjam]`` section;
* ``ingest``: the ROUTER (DEALER agents, replies on request) and PULL (PUSH agents) loops;
* ``pub``: the XPUB output of committed events, heartbeats and the replay index;
* ``replay``: the ROUTER side channel that reads missed events back from the journal;
* ``zmqio``: the cheap per-frame pyzmq calls the loops share;
* ``service``: binds the sockets and runs the parts.

The protocol itself (frames, meta, grammar, output mapping) is :mod:`taproom.protocols.logjam`.
"""

from __future__ import annotations

from .config import LogjamConfig
from .service import LogjamService, create_service

__all__ = ["LogjamConfig", "LogjamService", "create_service"]
