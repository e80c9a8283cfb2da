"""A journal's identity: a UUID created with the journal and kept in its directory.

Readers far from the hub (a Spark cluster reading several hubs over the network) key their
offsets by it, so it must never change while the journal's offsets mean the same events: the
file is written once and never replaced. It is created atomically and without replacing: a
temporary file is written and fsynced, then hard-linked to ``journal.id`` (which fails if
another process created it first: both then use the winner's) and the directory fsynced.

A journal made before identities existed gets one the first time the hub (or a Spark source
reading the directory) opens it. A damaged file is an error, never silently replaced: a new
identity would make every reader take the same offsets for new events and read them again.
"""

from __future__ import annotations

import contextlib
import os
import uuid

from ..errors import JournalError
from .segments import fsync_dir

__all__ = ["ID_FILE", "journal_id", "read_journal_id"]

ID_FILE = "journal.id"


def read_journal_id(path: str | os.PathLike[str]) -> str | None:
    """The identity of the journal in directory ``path``, or None if it has none yet."""
    file = os.path.join(str(path), ID_FILE)
    try:
        with open(file, "rb") as f:
            raw = f.read(64)
    except FileNotFoundError:
        return None
    try:
        return str(uuid.UUID(raw.decode("ascii").strip()))
    except (UnicodeDecodeError, ValueError):
        raise JournalError(
            f"{file} is damaged ({raw[:40]!r}): restore it from a backup of this journal; "
            "deleting it gives the journal a new identity and readers will read it all again"
        ) from None


def journal_id(path: str | os.PathLike[str]) -> str:
    """The identity of the journal in ``path``, created now if it has none."""
    found = read_journal_id(path)
    if found is not None:
        return found
    directory = str(path)
    final = os.path.join(directory, ID_FILE)
    tmp = os.path.join(directory, f".{ID_FILE}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        os.write(fd, f"{uuid.uuid4()}\n".encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        with contextlib.suppress(FileExistsError):  # another process was first: use its id
            os.link(tmp, final)
    finally:
        os.unlink(tmp)
    fsync_dir(directory)
    created = read_journal_id(directory)
    assert created is not None
    return created
