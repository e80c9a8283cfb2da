"""Crash tests: SIGKILL the hub at random moments; every acked event survives, exactly once.

The corruption variant also damages the journal between kills (flipped bytes in any frame or
segment header, sealed segments cut short): only events of damaged frames may go missing,
every other acked event stays at its offset, and no offset ever shows a different event.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from collections.abc import Set as AbstractSet
from pathlib import Path

import pytest

from taproom.journal import Journal
from taproom.journal.segments import FRAME, SEGMENT_HEADER, scan_segment, segment_name
from tests.hub.crash_writer import payload
from tests.support import flip_byte, fuzz_examples

ROOT = Path(__file__).resolve().parents[2]


def run_cycles(
    journal_dir: Path,
    cycles: int,
    seed: int,
    between: Callable[[random.Random], None] | None = None,
) -> list[tuple[int, int, int, int, int]]:
    rng = random.Random(seed)
    acked = []
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for run in range(cycles):
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.hub.crash_writer", str(journal_dir), str(run)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env=env,
        )
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the hub is up and committing
        assert first, proc.stderr.read().decode() if proc.stderr else "writer died"
        time.sleep(rng.uniform(0.0, 0.4))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
        lines = [first, *out.splitlines(keepends=True)]
        for line in lines:
            if line.endswith(b"\n"):  # a line cut by the kill was never fully reported
                acked.append(tuple(int(x) for x in line.split()))
        if between is not None:
            between(rng)
    return acked


def verify(
    journal_dir: Path,
    acked: list[tuple[int, int, int, int, int]],
    damaged: AbstractSet[int] = frozenset(),
) -> int:
    journal = Journal(journal_dir)
    try:
        by_offset = {r.offset: r.payload for r in journal.read(0)}
    finally:
        journal.close()
    for first, count, run, producer, i in acked:
        for j in range(count):
            want = payload(run, producer, i, j)
            got = by_offset.get(first + j)
            if first + j in damaged:
                assert got in (None, want), f"offset {first + j} was given to another event"
                continue
            assert got == want, (
                f"acked event at offset {first + j} (run {run}) missing or different"
            )
    duplicates = [p for p, n in Counter(by_offset.values()).items() if n > 1]
    assert duplicates == []
    return len(by_offset)


def test_sigkill_loses_no_acked_event(tmp_path):
    acked = run_cycles(tmp_path / "journal", fuzz_examples(20, 200), seed=1)
    assert len(acked) > 20  # the writers really got acks in before being killed
    stored = verify(tmp_path / "journal", acked)
    assert stored >= sum(a[1] for a in acked)


@pytest.mark.soak
def test_sigkill_soak(tmp_path):
    acked = run_cycles(tmp_path / "journal", 200, seed=2)
    verify(tmp_path / "journal", acked)


class Corrupter:
    """Damages a stopped journal at random; remembers the offsets that damage may cost."""

    def __init__(self, journal_dir: Path) -> None:
        self.dir = journal_dir
        self.damaged: set[int] = set()
        self.kinds: Counter[str] = Counter()

    def __call__(self, rng: random.Random) -> None:
        bases = sorted(int(p.stem) for p in self.dir.glob("*.seg"))
        k = rng.randrange(len(bases))
        path = self.dir / segment_name(bases[k])
        scan = scan_segment(str(path))
        frames = [
            (base, pos, end) for (base, pos), end in zip(scan.index, _ends(scan), strict=True)
        ]
        last = k == len(bases) - 1
        kind = rng.choice(["frame", "frame", "header"] + ([] if last else ["cut"]))
        if not frames or kind == "header":
            flip_byte(path, rng.randrange(SEGMENT_HEADER.size), 0x10)  # costs no frame
            self.kinds["header"] += 1
            return
        f = rng.randrange(len(frames))
        base, position, end = frames[f]
        frame_end = frames[f + 1][1] if f + 1 < len(frames) else scan.valid_end
        if kind == "cut":  # a sealed segment loses its end: every frame from there on
            with open(path, "r+b") as file:
                file.truncate(rng.randrange(position, frame_end))
            self.damaged |= set(range(base, bases[k + 1]))
        else:
            # The header of the active segment's last frame is left alone: damage there cannot
            # be told from a torn write, which recovery cuts (docs/operations.md).
            low = position + FRAME.size if last and f == len(frames) - 1 else position
            flip_byte(path, rng.randrange(low, frame_end), 0x10)
            self.damaged |= set(range(base, end))
        self.kinds[kind] += 1


def _ends(scan) -> list[int]:
    """End offset of each frame of a scanned segment."""
    bases = [base for base, _pos in scan.index]
    return [*bases[1:], scan.next_offset] if bases else []


def test_sigkill_and_corruption_lose_only_damaged_frames(tmp_path):
    corrupter = Corrupter(tmp_path / "journal")
    acked = run_cycles(tmp_path / "journal", fuzz_examples(12, 200), seed=3, between=corrupter)
    assert len(acked) > 12
    verify(tmp_path / "journal", acked, corrupter.damaged)
    assert sum(corrupter.kinds.values()) == fuzz_examples(12, 200)
