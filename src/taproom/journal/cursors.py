"""Named consumer cursors, persisted durably beside the journal.

A cursor is the next offset a named consumer wants. Readers report theirs after they commit
(the network read API, ``PUT /api/journal/cursors/<name>``); with ``[journal] retain_unread``
retention keeps what a registered cursor has not passed. A cursor is written to a temporary
file, fsynced, renamed over the old one and the directory fsynced, so a crash leaves the old or
the new value, never a torn one.
"""

from __future__ import annotations

import os
import re

import orjson

from .segments import fsync_dir

__all__ = ["CursorStore"]

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")


class CursorStore:
    def __init__(self, journal_dir: str | os.PathLike[str]) -> None:
        self.path = os.path.join(str(journal_dir), "cursors")
        os.makedirs(self.path, exist_ok=True)

    def _file(self, name: str) -> str:
        if not _NAME.match(name):
            raise ValueError(f"cursor name {name!r}: use 1-128 of A-Z a-z 0-9 _ . -")
        return os.path.join(self.path, f"{name}.cursor")

    def load(self, name: str) -> int | None:
        try:
            with open(self._file(name), "rb") as f:
                return int(orjson.loads(f.read())["offset"])
        except FileNotFoundError:
            return None

    def save(self, name: str, offset: int) -> None:
        final = self._file(name)
        tmp = final + ".tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, orjson.dumps({"offset": offset}))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        fsync_dir(self.path)

    def delete(self, name: str) -> bool:
        """Forget a cursor (a reader that is gone for good); False if there was none."""
        try:
            os.unlink(self._file(name))
        except FileNotFoundError:
            return False
        fsync_dir(self.path)
        return True

    def names(self) -> list[str]:
        return sorted(n[: -len(".cursor")] for n in os.listdir(self.path) if n.endswith(".cursor"))

    def offsets(self) -> dict[str, int]:
        """Every registered cursor and its offset (one deleted meanwhile is left out)."""
        found = {name: self.load(name) for name in self.names()}
        return {name: offset for name, offset in found.items() if offset is not None}
