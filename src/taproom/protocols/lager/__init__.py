"""Lager (nasa/lager's design): data formats, CHP registration, data messages and kegs.

Sans-I/O: ``formats`` (BEERR01 XML, row codecs), ``chp`` (registration flow and the
registrar's hashmap), ``messages`` (tap data messages), ``keg`` (``*.lgr`` files). The
Bartender glue is ``taproom.servers.lager``; Tap, Mug and KegWriter are in
``taproom.clients.lager``.
"""

from __future__ import annotations

from .formats import DataFormat, FormatError, parse_format_xml
from .keg import KegContents, KegFileWriter, read_keg

__all__ = [
    "DataFormat",
    "FormatError",
    "KegContents",
    "KegFileWriter",
    "parse_format_xml",
    "read_keg",
]
