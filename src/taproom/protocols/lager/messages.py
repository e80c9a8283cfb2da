"""Lager data messages: what taps publish to the forwarder and mugs receive from it.

Seed, "Data Message"::

    frame 0:  uuid, 16 bytes
    frame 1:  version, 2 bytes, major/minor
    frame 2:  flags, 2 bytes
    frame 3:  timestamp, epoch nanoseconds, 8 bytes unsigned
    frame 4:  payload, (length defined by Data Format)

nasa/lager's C++ taps send the format version string ("BEERR01") in frame 1, a 1-byte flags
frame and one payload frame per item. taproom accepts both on input (payload frames are
joined in order) and always emits the seed's five frames. Pure code: no I/O, no clock.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from ...errors import ProtocolError

__all__ = [
    "MESSAGE_VERSION",
    "DataMessage",
    "Flags",
    "MessageError",
    "check_row_header",
    "parse_data_message",
]

_TS = struct.Struct(">Q")
# "version, 2 bytes, major/minor": taproom speaks 1.0.
MESSAGE_VERSION = b"\x01\x00"
# The longest version frame accepted: the C++ sends the 7-character format version.
_MAX_VERSION_BYTES = 8
# "epoch nanoseconds, 8 bytes unsigned": every u64 is a valid timestamp by the seed. The
# journal's ts_ns is a signed 64-bit value, so a row from 2^63 ns (year 2262) on is stored
# without an event time and counted (taproom.eventtime), never refused; the message itself,
# and its timestamp as sent, are what this module returns and what mugs receive.


class Flags(IntEnum):
    """ "flags is a 2 byte register to give various TBD flags (compression, etc)". None defined;
    taproom sends 0 and stores what it receives."""

    NONE = 0


class MessageError(ProtocolError):
    """A data message that does not follow the seed's layout."""


@dataclass(frozen=True, slots=True)
class DataMessage:
    """One row from one tap."""

    uuid: bytes
    ts_ns: int
    payload: bytes
    version: bytes = MESSAGE_VERSION
    flags: int = 0

    def frames(self) -> list[bytes]:
        """The seed's five frames."""
        return [
            self.uuid,
            self.version,
            self.flags.to_bytes(2, "big"),
            _TS.pack(self.ts_ns),
            self.payload,
        ]


def parse_data_message(frames: Sequence[bytes], *, max_frames: int = 1028) -> DataMessage:
    """Validate the framing of one data message (the payload size is checked by the caller,
    which knows the tap's format). Raises :class:`MessageError`."""
    n = len(frames)
    if n < 5:
        raise MessageError(f"data message has {n} frames, expected 5", reason="frame_count")
    if n > max_frames:
        raise MessageError(
            f"data message has {n} frames, at most {max_frames}", reason="frame_count"
        )
    uuid, version, flags, ts = frames[0], frames[1], frames[2], frames[3]
    if len(uuid) != 16:
        raise MessageError(f"uuid frame is {len(uuid)} bytes, expected 16", reason="bad_uuid")
    if not 1 <= len(version) <= _MAX_VERSION_BYTES:
        raise MessageError(f"version frame is {len(version)} bytes", reason="bad_version")
    if len(flags) not in (1, 2):
        raise MessageError(f"flags frame is {len(flags)} bytes, expected 2", reason="bad_flags")
    if len(ts) != 8:
        raise MessageError(
            f"timestamp frame is {len(ts)} bytes, expected 8", reason="bad_timestamp"
        )
    ts_ns = _TS.unpack(ts)[0]
    payload = frames[4] if n == 5 else b"".join(frames[4:])
    return DataMessage(
        bytes(uuid), ts_ns, bytes(payload), bytes(version), int.from_bytes(flags, "big")
    )


def check_row_header(version: bytes, flags: bytes, format_version: str) -> None:
    """The version and flags frames of a row against its tap's format, as a registration's
    version is checked (formats.py: only a version whose layout is known). Two framings:

    * nasa/lager's Tap (src/tap.cpp, publisherThread): the format's version string
      (``BEERR01``, the only one a registration may carry) and its ``uint8_t flags``: 1 byte;
    * the seed's: a 2-byte major/minor message version, major 1 (what taproom speaks; a minor
      version may only add), and 2 bytes of flags.

    Anything else (``BEERR99``, ``BEERR01`` with 2 bytes of flags, version 2.0) is a row whose
    layout is not the one registered. Raises :class:`MessageError` (``bad_version``,
    ``bad_flags``)."""
    if len(version) == 2:
        framing, version_ok, flags_size = "the seed's", version[0] == MESSAGE_VERSION[0], 2
    else:
        framing, version_ok, flags_size = "nasa/lager's", version == format_version.encode(), 1
    if not version_ok:
        raise MessageError(
            f"version frame {bytes(version)[:8]!r} is neither 1.x nor the format's "
            f"{format_version}",
            reason="bad_version",
        )
    if len(flags) != flags_size:
        raise MessageError(
            f"flags frame is {len(flags)} bytes, {framing} framing has {flags_size}",
            reason="bad_flags",
        )
