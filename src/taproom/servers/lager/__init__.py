"""Lager Bartender: the CHP registrar and the data forwarder, as pyzmq glue on the hub's loop.

``registrar`` (CHP: snapshot, publisher, collector; journal-backed hashmap), ``forwarder``
(validate, commit, then fan out to mugs; loss marks and the hello handshake), ``service``
(both on one ZeroMQ context), ``config`` (the ``[lager]`` section), ``sockets`` (pyzmq
helpers). The sans-I/O protocol is ``taproom.protocols.lager``.
"""

from __future__ import annotations

from .config import LagerConfig
from .forwarder import HELLO_PREFIX, MARK_PREFIX, DataRecords, Forwarder
from .registrar import RegistrarServer
from .service import LagerService, create_service

__all__ = [
    "HELLO_PREFIX",
    "MARK_PREFIX",
    "DataRecords",
    "Forwarder",
    "LagerConfig",
    "LagerService",
    "RegistrarServer",
    "create_service",
]
