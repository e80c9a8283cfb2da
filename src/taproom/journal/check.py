"""``taproom journal check``: verify every frame of every segment, and mend what can be mended.

Runs without opening the journal for writing. What it reports, per kind of problem:

* ``torn_tail``: damage at the end of the last segment with no valid frame after it (a write
  cut short by a crash; the hub cuts it on its next start). ``--repair`` truncates it.
* ``segment_header``: a damaged segment header; no frame is lost by it. ``--repair`` rewrites it
  from the file name.
* ``quarantined``: damaged frames with valid frames after them, or at the end of a sealed
  segment. Their offsets are lost; readers skip them and every other frame keeps its offset.
  Nothing can bring them back, so ``--repair`` leaves them (and the report) as they are.
* ``gap``: offsets between two segments that no segment holds (older repairs, or data cut back
  after a failed fsync under ``fsync = "interval"``). Not repairable either.

The report's ``ok`` is true when nothing unrepaired is left; the command exits 0 then, 1 when
problems remain (their offsets are in the report), 2 when the journal cannot be checked.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import JournalError
from .segments import (
    Damage,
    cut_segment,
    scan_segment,
    segment_bases,
    segment_name,
    write_segment_header,
)

__all__ = ["check_journal"]


def _entry(kind: str, damage: Damage) -> dict[str, Any]:
    return {
        "segment": damage.segment,
        "kind": kind,
        "reason": damage.reason,
        "problem": damage.describe(),
        "position": damage.position,
        "bytes": damage.nbytes,
        "first_offset": damage.first_offset,
        "end_offset": damage.end_offset,
        "lost_events": damage.lost_events,
        "repaired": False,
    }


def check_journal(path: str | os.PathLike[str], *, repair: bool = False) -> dict[str, Any]:
    """Verify every CRC of every segment; with ``repair`` cut a torn tail and rewrite damaged
    segment headers (run it with the hub stopped). Returns the report described above."""
    root = Path(path)
    if not root.is_dir():
        raise JournalError(f"{path}: not a journal directory")
    bases = segment_bases(str(root))
    names = [segment_name(base) for base in bases]
    problems: list[dict[str, Any]] = []
    report: dict[str, Any] = {"segments": len(names), "batches": 0, "events": 0}
    expected: int | None = None
    for i, name in enumerate(names):
        seg_path = str(root / name)
        last = i == len(names) - 1
        result = scan_segment(seg_path, end_bound=None if last else bases[i + 1])
        report["batches"] += len(result.index)
        report["events"] += result.events
        if expected is not None and result.base_offset > expected:
            problems.append(
                {
                    "segment": name,
                    "kind": "gap",
                    "problem": f"offsets {expected}-{result.base_offset - 1} are in no segment",
                    "first_offset": expected,
                    "end_offset": result.base_offset,
                    "lost_events": result.base_offset - expected,
                    "repaired": False,
                }
            )
        if result.header is not None:
            entry = _entry("segment_header", result.header)
            if repair:
                write_segment_header(seg_path, result.base_offset)
                entry["repaired"] = True
            problems.append(entry)
        problems += [_entry("quarantined", damage) for damage in result.damage]
        expected = result.next_offset
        if result.tail is not None and not last:
            problems.append(_entry("quarantined", result.tail))
            expected = bases[i + 1]
        elif result.tail is not None:
            entry = _entry("torn_tail", result.tail)
            if repair:
                cut_segment(seg_path, result.tail.position)
                entry["repaired"] = True
            problems.append(entry)
    report["lost_events"] = sum(p["lost_events"] for p in problems if p["kind"] != "torn_tail")
    report["problems"] = problems
    report["ok"] = all(p["repaired"] for p in problems)
    return report
