"""Read-only access to a journal directory from another process (``taproom tail``, Spark).

Unlike :class:`~taproom.journal.Journal`, a reader never writes: it does not truncate a torn
tail, it stops before it. In the last segment a frame that does not verify yet is taken as
"still being written" and reading stops there; in a sealed segment it is corruption.

With ``fsync = always`` a reader in another process may see a batch a few milliseconds before
its fsync returns; a crash in that window can take the batch back. Consumers that must never
see such a batch read through the hub's subscriptions instead.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

from ..errors import CorruptSegment, JournalError
from ..records import Record
from .segments import SEGMENT_HEADER, read_segment_header, records_in_range, segment_batches

__all__ = ["JournalReader"]


class JournalReader:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        if not os.path.isdir(self.path):
            raise JournalError(f"{self.path}: no journal directory here")

    def segment_bases(self) -> list[int]:
        names = [n for n in os.listdir(self.path) if n.endswith(".seg") and n[:-4].isdigit()]
        return sorted(int(n[:-4]) for n in names)

    def _path(self, base: int) -> str:
        return os.path.join(self.path, f"{base:020d}.seg")

    def read_batches(
        self, from_offset: int = 0, end_offset: int | None = None
    ) -> Iterator[tuple[int, int, bytes]]:
        """Verified batches ``(base, count, body)`` overlapping ``[from_offset, end_offset)``."""
        bases = self.segment_bases()
        start = 0
        for i, base in enumerate(bases):
            if base <= from_offset:
                start = i
        for i in range(start, len(bases)):
            base = bases[i]
            if end_offset is not None and base >= end_offset:
                return
            last = i == len(bases) - 1
            try:
                fd = os.open(self._path(base), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                if read_segment_header(fd) != base:
                    if last:
                        return
                    raise CorruptSegment(f"segment {base}: bad header", segment=self._path(base))
                yield from segment_batches(
                    fd,
                    self._path(base),
                    (base, SEGMENT_HEADER.size),
                    from_offset,
                    end_offset,
                    unfinished_ok=last,
                )
            finally:
                os.close(fd)

    def read(self, from_offset: int = 0, end_offset: int | None = None) -> Iterator[Record]:
        return records_in_range(self.read_batches(from_offset, end_offset), from_offset, end_offset)

    def end_offset(self) -> int:
        """Offset after the last verified record (scans the last segment)."""
        end = self.segment_bases()[-1] if self.segment_bases() else 0
        for base, count, _ in self.read_batches(end):
            end = base + count
        return end

    def follow(
        self, from_offset: int = 0, poll_s: float = 0.1, stop: object = None
    ) -> Iterator[Record]:
        """Records from ``from_offset`` on, waiting for new ones; ends when ``stop()`` is true."""
        offset = from_offset
        while True:
            progressed = False
            for record in self.read(offset):
                offset = record.offset + 1
                progressed = True
                yield record
            if callable(stop) and stop():
                return
            if not progressed:
                time.sleep(poll_s)
