"""The kegs (``*.lgr``) in ``[console] kegs``: size, rows, time span and a preview, read-only.

Reading a keg means reading the whole file, so only kegs up to :data:`MAX_READ_BYTES` are
opened (larger ones are listed with their size); results are kept per (size, mtime) so a page
that polls does not re-read a keg that did not change. Called in worker threads.
"""

from __future__ import annotations

import os
from typing import Any

from ..protocols.lager.keg import KegError, read_keg

__all__ = ["MAX_KEGS", "MAX_READ_BYTES", "KegIndex", "UnknownKeg"]

MAX_KEGS = 1000  # files listed; a keg directory holds one file per recording
MAX_READ_BYTES = 256 * 1024 * 1024  # a keg is read whole: bound the memory one listing takes


class UnknownKeg(ValueError):
    """A name that is not a keg file directly in the keg directory."""


class KegIndex:
    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._summaries: dict[str, tuple[tuple[int, int], dict[str, Any]]] = {}

    def _files(self) -> list[os.DirEntry[str]]:
        try:
            with os.scandir(self.directory) as entries:
                found = [e for e in entries if e.name.endswith(".lgr") and e.is_file()]
        except FileNotFoundError:
            return []
        return sorted(found, key=lambda e: e.name)[:MAX_KEGS]

    def listing(self) -> dict[str, Any]:
        kegs = [self._summary(entry) for entry in self._files()]
        live = {k["name"] for k in kegs}
        for name in list(self._summaries):
            if name not in live:
                del self._summaries[name]
        return {"directory": self.directory, "kegs": kegs}

    def _summary(self, entry: os.DirEntry[str]) -> dict[str, Any]:
        stat = entry.stat()
        version = (stat.st_size, stat.st_mtime_ns)
        cached = self._summaries.get(entry.name)
        if cached is not None and cached[0] == version:
            return cached[1]
        summary: dict[str, Any] = {
            "name": entry.name,
            "bytes": stat.st_size,
            "modified": stat.st_mtime,
            "rows": None,
            "first_ns": None,
            "last_ns": None,
            "taps": None,
            "problem": "",
        }
        if stat.st_size > MAX_READ_BYTES:
            summary["problem"] = "too large to read here"
        else:
            try:
                keg = read_keg(entry.path)
            except (KegError, OSError) as exc:
                summary["problem"] = str(exc).replace(self.directory, "").lstrip("/")
            else:
                summary["rows"] = keg.record_count
                summary["taps"] = len(keg.formats)
                if keg.record_count:
                    summary["first_ns"] = int(keg.timestamps.min())
                    summary["last_ns"] = int(keg.timestamps.max())
                if keg.problem:
                    summary["problem"] = keg.problem
        self._summaries[entry.name] = (version, summary)
        return summary

    def preview(self, name: str, rows: int) -> dict[str, Any]:
        """The first ``rows`` records of keg ``name``, decoded."""
        if os.sep in name or name.startswith(".") or not name.endswith(".lgr"):
            raise UnknownKeg("name must be a keg file name from /api/kegs")
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise UnknownKeg("no such keg")
        if os.path.getsize(path) > MAX_READ_BYTES:
            raise UnknownKeg("keg too large to preview here")
        try:
            keg = read_keg(path)
        except KegError as exc:
            raise UnknownKeg(str(exc).replace(self.directory, "").lstrip("/")) from None
        out = []
        for n, (uuid_text, ts_ns, row) in enumerate(keg.rows()):
            if n >= rows:
                break
            out.append({"tap": uuid_text, "ts_ns": ts_ns, "values": row})
        return {"name": name, "rows": out, "formats": {u: f.names for u, f in keg.formats.items()}}
