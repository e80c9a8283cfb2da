"""One forwarder batch in the making (servers/lager/forwarder.py): its journal records and its
rows for the mugs, in the order taken, a chunk per stretch of rows the compiled kernel took
(wire bytes already laid out, servers/lager/kernel.py) and of rows the Python path took (frames
to encode), and the bursts each output gets from them."""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from operator import itemgetter

from ...protocols.zmtp.pubsub import Burst
from ..zmtp import ZmtpPublisher

__all__ = ["Batch", "KernelRows", "PyRows"]


@dataclass(slots=True)
class KernelRows:
    """Rows the kernel took: their wire (frames as received), the runs of one uuid, and the
    plain output's wire and ends when they differ (seed rows split per item)."""

    wire: bytes
    ends: array[int]
    runs: list[tuple[bytes, int]]
    plain: tuple[bytes, array[int]] | None


@dataclass(slots=True)
class PyRows:
    """Rows the Python path took: their frames, seed rows to split and rows a Mug cannot read
    (indexes into ``forwards``)."""

    forwards: list[list[bytes]]
    reframe: list[tuple[int, list[tuple[int, int]]]]
    not_plain: list[int]


class Batch:
    """One journal batch in the making: its records, and its rows for the mugs in the order
    taken, a chunk per stretch of the kernel's rows and of the Python path's."""

    __slots__ = ("chunks", "forwards", "not_plain", "parts", "per_tap", "reframe", "rows",
                 "unattributed")  # fmt: skip

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.chunks: list[KernelRows | PyRows] = []
        # the Python path's current chunk
        self.forwards: list[list[bytes]] = []
        self.reframe: list[tuple[int, list[tuple[int, int]]]] = []  # seed rows of several items
        self.not_plain: list[int] = []  # unattributed rows a real Mug could not read
        self.per_tap: Counter[bytes] = Counter()  # uuid -> rows (marks, the registrar's touch)
        self.rows = 0
        self.unattributed = 0

    def close_chunk(self) -> None:
        """The Python path's rows so far become a chunk (before a kernel run's, or at the end)."""
        forwards = self.forwards
        if forwards:
            self.chunks.append(PyRows(forwards, self.reframe, self.not_plain))
            self.per_tap.update(map(itemgetter(0), forwards))
            self.rows += len(forwards)
            self.forwards, self.reframe, self.not_plain = [], [], []

    def add_kernel_rows(
        self, records: bytes, wire: bytes, ends: array[int], runs: list[tuple[bytes, int]],
        plain: tuple[bytes, array[int]] | None, rows: int,
    ) -> None:  # fmt: skip
        self.close_chunk()
        self.parts.append(records)
        self.chunks.append(KernelRows(wire, ends, runs, plain))
        per_tap = self.per_tap
        for raw_uuid, n in runs:
            per_tap[raw_uuid] += n
        self.rows += rows

    def burst(self, *, plain: bool) -> Burst:
        """The rows as one burst for an output: as received (the counted output), or as a
        real Mug reads them (``plain``: see :func:`_plain_rows`)."""
        bursts = []
        for chunk in self.chunks:
            if isinstance(chunk, KernelRows):
                if plain and chunk.plain is not None:
                    bursts.append(Burst(*chunk.plain, chunk.runs))
                else:
                    bursts.append(Burst(chunk.wire, chunk.ends, chunk.runs))
                continue
            rows = _plain_rows(chunk.forwards, chunk.reframe, chunk.not_plain) if plain else (
                chunk.forwards
            )  # fmt: skip
            if rows:
                bursts.append(ZmtpPublisher.encode(rows))
        if len(bursts) == 1:
            return bursts[0]
        ends: list[int] = []
        offset = 0
        runs: list[tuple[bytes, int]] | None = []
        for burst in bursts:
            ends += [end + offset for end in burst.ends]
            offset += len(burst.wire)
            if runs is not None and burst.runs is not None:
                runs += burst.runs
            else:
                runs = None
        return Burst(b"".join(burst.wire for burst in bursts), ends, runs)


def _plain_rows(
    forwards: list[list[bytes]],
    reframe: list[tuple[int, list[tuple[int, int]]]],
    not_plain: list[int],
) -> list[list[bytes]]:
    """The rows as a real Mug reads them on the plain output: a seed-framed row of several
    items split into one frame per item, rows it could not read (``not_plain``) left out."""
    plain = forwards
    if reframe:
        plain = list(forwards)
        for index, cuts in reframe:
            head, row = forwards[index][:4], forwards[index][4]
            plain[index] = head + [row[start:end] for start, end in cuts]
    if not_plain:
        skip = set(not_plain)
        plain = [m for i, m in enumerate(plain) if i not in skip]
    return plain
