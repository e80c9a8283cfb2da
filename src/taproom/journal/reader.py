"""Read-only access to a journal directory from another process (``taproom tail``, Spark).

Unlike :class:`~taproom.journal.Journal`, a reader never writes: it does not truncate a torn
tail, it stops before it. In the last segment damage that no valid frame follows is taken as
"still being written" and reading stops there. Any other damage (a corrupt frame with valid
frames after it, a corrupt sealed segment, a damaged segment header) is walked past exactly as
the hub does: it is logged, listed in :attr:`JournalReader.damage`, and its offsets are a gap.

With ``fsync = always`` a reader in another process may see a batch a few milliseconds before
its fsync returns; a crash in that window can take the batch back. Consumers that must never
see such a batch read through the hub's subscriptions instead.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

from ..errors import JournalError
from ..records import Record
from .identity import read_journal_id
from .segments import (
    SEGMENT_HEADER,
    Damage,
    records_in_range,
    segment_bases,
    segment_batches,
    segment_name,
)

__all__ = ["JournalReader"]

log = logging.getLogger("taproom.journal")


class JournalReader:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = str(path)
        if not os.path.isdir(self.path):
            raise JournalError(f"{self.path}: no journal directory here")
        # None for a journal no hub has opened since identities exist (a reader never writes).
        self.id = read_journal_id(self.path)
        self.damage: dict[tuple[str, int], Damage] = {}  # found so far, by (segment, position)

    def segment_bases(self) -> list[int]:
        return segment_bases(self.path)

    def _on_damage(self, damage: Damage) -> None:
        key = (damage.segment, damage.position)
        if key not in self.damage:
            self.damage[key] = damage
            log.warning("journal: skipping damage: %s", damage.describe())

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
            path = os.path.join(self.path, segment_name(base))
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                yield from segment_batches(
                    fd,
                    path,
                    (base, SEGMENT_HEADER.size),
                    from_offset,
                    end_offset,
                    sealed_end=bases[i + 1] if i + 1 < len(bases) else None,
                    on_damage=self._on_damage,
                )
            finally:
                os.close(fd)

    def read(self, from_offset: int = 0, end_offset: int | None = None) -> Iterator[Record]:
        return records_in_range(self.read_batches(from_offset, end_offset), from_offset, end_offset)

    def end_offset(self) -> int:
        """Offset after the last verified record (scans the last segment)."""
        bases = self.segment_bases()
        end = bases[-1] if bases else 0
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
