"""Lager clients: :class:`Tap` (a data source), :class:`Mug` (a data sink), :class:`KegWriter`,
and the ``taproom keg`` command (dump, verify, convert, record).

``tap``, ``mug``, ``keg`` (the keg writer), ``cli`` (``taproom keg``), ``common`` (errors,
addresses). Tap and Mug are synchronous and single-threaded -- each owns its ZeroMQ sockets and
must be used from one thread (ZeroMQ sockets are not thread-safe). :class:`KegWriter` runs one
Mug in its own thread.
"""

from __future__ import annotations

from .cli import register_commands
from .common import DuplicateTap, LagerClientError
from .keg import KegWriter
from .mug import Mug, Rows, Sample
from .tap import Tap

__all__ = [
    "DuplicateTap",
    "KegWriter",
    "LagerClientError",
    "Mug",
    "Rows",
    "Sample",
    "Tap",
    "register_commands",
]
