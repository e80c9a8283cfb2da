"""taproom's one exception tree.

Every exception taproom raises on purpose derives from :class:`TaproomError`::

    TaproomError
     ├── ProtocolError          the remote broke its protocol; carries the protocol's own reply
     │    └── (one subclass per protocol: LumberjackError, LogTKError, LogjamError, ...)
     ├── LimitExceeded          a ProtocolError for a configured bound (size, count, window)
     ├── ConfigError            a configuration problem; carries file, line and key
     ├── JournalError           the journal cannot do what was asked
     │    ├── CorruptSegment    a CRC or framing check failed inside a segment
     │    ├── DiskFull          ENOSPC while appending: acks stop until space returns
     │    ├── JournalFailed     an fsync or write failed; the journal refuses further appends
     │    ├── OffsetsDeleted    a reader asked for offsets retention deleted (HTTP 410)
     │    ├── HubUnavailable    a hub's journal read API could not be reached or refused
     │    └── CorruptTransfer   a batch read from a hub failed its CRC on the way
     ├── HubStopped             ingest after shutdown began
     └── StartupError           serve cannot start: an address in use, a journal it cannot open

Decoders raise only :class:`ProtocolError` subclasses. Anything else escaping a decoder is a
bug and servers turn it into an internal-error close that leaks no detail.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "CorruptSegment",
    "CorruptTransfer",
    "DiskFull",
    "HubStopped",
    "HubUnavailable",
    "JournalError",
    "JournalFailed",
    "LimitExceeded",
    "OffsetsDeleted",
    "ProtocolError",
    "StartupError",
    "TaproomError",
]


class TaproomError(Exception):
    """Root of every exception taproom raises on purpose."""


class ProtocolError(TaproomError):
    """The remote peer broke the protocol.

    ``reason`` is a short, bounded, metric-safe label (``"bad_version"``, ``"frame_too_large"``);
    ``reply`` is what the protocol prescribes sending back before closing (a close frame, a
    ``400`` message, ...) or ``None`` when the protocol says to just close.
    """

    def __init__(self, message: str, *, reason: str = "malformed", reply: object = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.reply = reply


class LimitExceeded(ProtocolError):
    """A size, count or window read from the wire is over its configured bound."""

    def __init__(self, message: str, *, reason: str = "limit", reply: object = None) -> None:
        super().__init__(message, reason=reason, reply=reply)


class ConfigError(TaproomError):
    """The configuration is invalid. ``str()`` reads ``file:line: key: message``."""

    def __init__(
        self, message: str, *, file: str | None = None, line: int | None = None, key: str = ""
    ) -> None:
        self.file = file
        self.line = line
        self.key = key
        self.message = message
        where = file or "<config>"
        if line is not None:
            where = f"{where}:{line}"
        super().__init__(f"{where}: {key}: {message}" if key else f"{where}: {message}")


class JournalError(TaproomError):
    """The journal cannot do what was asked."""


class CorruptSegment(JournalError):
    """A batch inside a segment failed its CRC or framing check."""

    def __init__(self, message: str, *, segment: str = "", position: int = 0) -> None:
        super().__init__(message)
        self.segment = segment
        self.position = position


class DiskFull(JournalError):
    """Appending hit ENOSPC. Acks stop; appends resume when space returns."""


class JournalFailed(JournalError):
    """A write or fsync failed. The descriptor is never trusted again: reopen to recover."""


class OffsetsDeleted(JournalError):
    """Offsets a reader had not read were deleted by retention: an explicit loss, never a
    silent skip. ``first_offset`` is the oldest offset still held."""

    def __init__(self, message: str, *, requested: int, first_offset: int) -> None:
        super().__init__(message)
        self.requested = requested
        self.first_offset = first_offset


class HubUnavailable(JournalError):
    """A hub's journal read API could not be reached, or refused a request. The message names
    the hub; a streaming query fails its micro-batch and resumes from its checkpoint."""


class CorruptTransfer(JournalError):
    """A batch read from a hub did not pass its CRC: damaged on the way, never turned into
    rows. Reading it again (a task retry) fetches it again."""

    def __init__(self, message: str, *, journal_id: str, offset: int) -> None:
        super().__init__(message)
        self.journal_id = journal_id
        self.offset = offset


class HubStopped(TaproomError):
    """The hub is shutting down and takes no more ingest."""


class StartupError(TaproomError):
    """``taproom serve`` cannot start (a runtime problem, exit 1): a listener address in use,
    a journal directory it cannot create. The message names the key or address and the cause."""
