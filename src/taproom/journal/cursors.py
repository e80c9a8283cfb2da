"""Named consumer cursors, persisted durably beside the journal.

A cursor is the next offset a named consumer wants. It is written to a temporary file, fsynced,
renamed over the old one and the directory fsynced, so a crash leaves the old or the new value,
never a torn one.
"""

from __future__ import annotations

import os
import re

import orjson

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
        dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def names(self) -> list[str]:
        return sorted(n[: -len(".cursor")] for n in os.listdir(self.path) if n.endswith(".cursor"))
