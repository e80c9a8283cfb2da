"""The files of a rollup table, as Spark would read them: only committed ones.

``taproom spark rollup`` writes a table with a batch job (its files appear by rename at commit);
``taproom spark stream`` writes it with Spark's file sink, which records every committed
micro-batch's files in ``<table>/_spark_metadata/`` (``N`` deltas, ``N.compact`` every few
batches). Files of a micro-batch that was killed half-way are in the directory but not in the
log: Spark's own reader ignores them, and so does the console, or a drill-down table would
show such requests twice. Listings are cached by the log's (or the partition's) file names,
sizes and modification times. Called in worker threads.
"""

from __future__ import annotations

import json
import os
import re
import threading
from urllib.parse import unquote, urlsplit

__all__ = ["TableFiles"]

_LOG = "_spark_metadata"
_BATCH = re.compile(r"^(\d+)(\.compact)?$")
_DATE_DIR = re.compile(r"^date=(\d{4}-\d{2}-\d{2})$")
# Listings kept (tables x logs); each a few KB to a few MB for a long-running stream.
_CACHED = 32


def _fingerprint(path: str) -> tuple[tuple[str, int, int], ...]:
    try:
        with os.scandir(path) as entries:
            found = [
                (e.name, st.st_size, st.st_mtime_ns)
                for e in entries
                if e.is_file() and (st := e.stat())
            ]
    except (FileNotFoundError, NotADirectoryError):
        return ()
    return tuple(sorted(found))


class TableFiles:
    """Committed Parquet files of the tables under ``directory`` (``<directory>/<table>``)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._logs: dict[str, tuple[object, dict[str, set[str]]]] = {}

    def table_dir(self, table: str) -> str:
        return os.path.join(self.directory, table)

    def streamed(self, table: str) -> bool:
        """True when the table was written by a streaming query (it has a sink log)."""
        return os.path.isdir(os.path.join(self.table_dir(table), _LOG))

    def dates(self, table: str) -> list[str]:
        """The table's date partitions, newest first."""
        try:
            names = os.listdir(self.table_dir(table))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((m.group(1) for n in names if (m := _DATE_DIR.match(n))), reverse=True)

    def files(self, table: str, date: str) -> list[str]:
        """Absolute paths of the committed Parquet files of ``table`` for ``date``."""
        part = os.path.join(self.table_dir(table), f"date={date}")
        if self.streamed(table):
            committed = self._committed(table).get(f"date={date}", set())
            return sorted(os.path.join(part, name) for name in committed)
        try:
            names = os.listdir(part)
        except (FileNotFoundError, NotADirectoryError):
            return []
        # Spark's committed files; "_"- and "."-names are its markers and checksums.
        return sorted(
            os.path.join(part, n) for n in names if n.endswith(".parquet") and n[0] not in "._"
        )

    def fingerprint(self, table: str, date: str) -> tuple[object, ...]:
        """Changes whenever the committed files of ``table`` for ``date`` may have changed."""
        part = os.path.join(self.table_dir(table), f"date={date}")
        log = os.path.join(self.table_dir(table), _LOG)
        return (_fingerprint(part), _fingerprint(log) if os.path.isdir(log) else ())

    def _committed(self, table: str) -> dict[str, set[str]]:
        """partition directory name -> committed file names, from the sink's log."""
        log = os.path.join(self.table_dir(table), _LOG)
        key = _fingerprint(log)
        with self._lock:
            cached = self._logs.get(table)
            if cached is not None and cached[0] == key:
                return cached[1]
        batches: dict[int, bool] = {}  # batch id -> compact
        for name, _, _ in key:
            if m := _BATCH.match(name):
                batches[int(m.group(1))] = bool(m.group(2))
        compacts = [b for b, compact in batches.items() if compact]
        start = max(compacts) if compacts else 0
        files: dict[str, set[str]] = {}
        for batch in sorted(b for b in batches if b >= start):
            name = f"{batch}.compact" if batches[batch] else str(batch)
            for entry in _entries(os.path.join(log, name)):
                path = unquote(urlsplit(str(entry.get("path", ""))).path)
                parent, base = os.path.split(path)
                partition = os.path.basename(parent)
                if entry.get("action") == "delete":
                    files.get(partition, set()).discard(base)
                elif not entry.get("isDir"):
                    files.setdefault(partition, set()).add(base)
        with self._lock:
            self._logs[table] = (key, files)
            while len(self._logs) > _CACHED:
                self._logs.pop(next(iter(self._logs)))
        return files


def _entries(path: str) -> list[dict[str, object]]:
    """The JSON lines of one log file after its version line ("v1")."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (FileNotFoundError, UnicodeDecodeError):
        return []
    out = []
    for line in lines[1:]:
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # not an entry: Spark writes each log file whole (temp file, rename)
        if isinstance(entry, dict):
            out.append(entry)
    return out
