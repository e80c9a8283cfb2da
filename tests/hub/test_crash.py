"""Crash test: SIGKILL the hub at random moments; every acked event survives, exactly once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from taproom.journal import Journal
from tests.hub.crash_writer import payload
from tests.support import fuzz_examples

ROOT = Path(__file__).resolve().parents[2]


def run_cycles(journal_dir: Path, cycles: int, seed: int) -> list[tuple[int, int, int, int, int]]:
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
    return acked


def verify(journal_dir: Path, acked: list[tuple[int, int, int, int, int]]) -> int:
    journal = Journal(journal_dir)
    try:
        by_offset = {r.offset: r.payload for r in journal.read(0)}
    finally:
        journal.close()
    for first, count, run, producer, i in acked:
        for j in range(count):
            assert by_offset.get(first + j) == payload(run, producer, i, j), (
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
