"""The Spark source's segment reading over quarantined damage: the same walk as the journal.

A corrupt frame (in a sealed segment or in the middle of the last one) and a damaged segment
header cost only their own frames: planning, streaming promises and reading skip them, and
every other event keeps its offset. Most checks call the source's functions directly; one reads
through Spark.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from taproom.journal import Journal, JournalReader
from taproom.journal.segments import FRAME, scan_segment
from taproom.records import BatchBuilder
from taproom.spark.arrowdecode import scan_frames, verified_end
from taproom.spark.datasource import _plan, _read_slice
from tests.support import flip_byte


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, set[int]]:
    """Four segments of 200-event batches; offsets of the events that are still intact."""
    path = tmp_path / "j"
    journal = Journal(path, segment_bytes=1 << 20)
    for k in range(16):
        b = BatchBuilder()
        for i in range(200):
            b.add("test", f'{{"k":{k},"i":{i}}}'.encode().ljust(1500, b" "), content_type="json")
        journal.commit([b.build()])
    journal.close()
    segments = sorted(path.glob("*.seg"))
    assert len(segments) >= 3
    lost: set[int] = set()
    for seg, pick in ((segments[0], 1), (segments[-1], 1)):
        index = scan_segment(str(seg)).index
        base, position = index[pick]
        assert pick + 1 < len(index)  # a valid frame follows the damaged one
        flip_byte(seg, position + FRAME.size + 700)
        lost |= set(range(base, index[pick + 1][0]))
    flip_byte(segments[1], 4)  # a sealed segment's header: no frame lost
    return path, set(range(3200)) - lost


def test_plan_and_read_skip_damage_and_keep_offsets(damaged: tuple[Path, set[int]]) -> None:
    path, intact = damaged
    got: list[int] = []
    for target in (1 << 20, 64 << 10):  # few and many slices
        got = []
        for part in _plan(str(path), 0, None, target):
            for batch in _read_slice(part, ["offset"]):
                got += batch.column("offset").to_pylist()
        assert got == sorted(intact)
    assert {r.offset for r in JournalReader(path).read(0)} == intact


def test_streaming_promise_goes_past_damage(damaged: tuple[Path, set[int]]) -> None:
    path, intact = damaged
    frames = scan_frames(str(path), 0)
    assert verified_end(str(path), frames) == max(intact) + 1


@pytest.mark.spark
def test_spark_reads_every_intact_event(spark: Any, damaged: tuple[Path, set[int]]) -> None:
    path, intact = damaged
    rows = spark.read.format("taproom").load(str(path)).select("offset").collect()
    assert sorted(r["offset"] for r in rows) == sorted(intact)
