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

from taproom.journal import JournalReader
from taproom.spark.arrowdecode import scan_frames, verified_end
from taproom.spark.sources import LocalSource, read_partition

from .generate import write_damaged_journal


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, set[int]]:
    path = tmp_path / "j"
    return path, write_damaged_journal(path)


def test_plan_and_read_skip_damage_and_keep_offsets(damaged: tuple[Path, set[int]]) -> None:
    path, intact = damaged
    got: list[int] = []
    for target in (1 << 20, 64 << 10):  # few and many slices
        got = []
        for part in LocalSource(str(path)).plan(0, None, target):
            for batch in read_partition(part, ["offset"]):
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
