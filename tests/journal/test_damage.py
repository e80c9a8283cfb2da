"""Damage in segments is quarantined, never cut: intact frames after it keep their offsets.

Only a torn tail (damage with no valid frame after it, in the active segment) may be cut.
Every reader (the journal itself, JournalReader in another process) walks past the same
damage, reports the same lost offsets, and hands out every other event at its acked offset.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from taproom.journal import Journal, JournalReader, check_journal
from taproom.journal.segments import FRAME, SEGMENT_HEADER, scan_segment, segment_name
from taproom.records import BatchBuilder, EncodedBatch
from tests.support import flip_byte


def batch(tag: str, n: int = 3, size: int = 40) -> EncodedBatch:
    b = BatchBuilder(received_ns=1)
    for i in range(n):
        b.add("test", f"{tag}-{i}".encode().ljust(size, b"."), stream="s", seq=i)
    return b.build()


def build(path: Path, commits: int, *, n: int = 3, size: int = 40, segment_bytes: int = 0) -> dict:
    """A closed journal of ``commits`` one-batch commits; ``{offset: payload}`` of every event."""
    j = Journal(path, segment_bytes=segment_bytes or 128 * 1024 * 1024)
    for k in range(commits):
        j.commit([batch(f"b{k}", n, size)])
    j.close()
    return {r.offset: r.payload for r in Journal(path).read(0)}


def frame_at(path: Path, base_offset: int) -> int:
    """File position of the frame holding ``base_offset`` in segment ``path``."""
    return dict(scan_segment(str(path)).index)[base_offset]


def lost(metrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "taproom_journal_lost_events_total", {"reason": reason}
    )
    return value or 0.0


def offsets(reader) -> dict:
    return {r.offset: r.payload for r in reader.read(0)}


class TestActiveSegment:
    def test_corrupt_frame_in_the_middle_is_quarantined_and_later_frames_kept(self, tmp_path):
        acked = build(tmp_path, 10)
        seg = tmp_path / segment_name(0)
        flip_byte(seg, frame_at(seg, 12) + FRAME.size + 30)  # inside the body of offsets 12-14
        j = Journal(tmp_path)
        intact = {o: p for o, p in acked.items() if not 12 <= o < 15}
        assert offsets(j) == intact  # every other event, at the offset it was acked with
        assert j.next_offset == 30
        (damage,) = j.damage()
        assert (damage.first_offset, damage.end_offset, damage.reason) == (12, 15, "crc_mismatch")
        assert lost(j.metrics, "crc_mismatch") == 3
        assert any("offsets 12-14 lost" in line for line in j.damage_summary())
        assert j.commit([batch("new")]) == [30]
        j.close()
        again = Journal(tmp_path)
        assert offsets(again) == {**intact, **{r.offset: r.payload for r in again.read(30)}}
        assert [d.first_offset for d in again.damage()] == [12]  # found again on every open

    @pytest.mark.parametrize(
        "field, value",
        [
            ("length", 0xFFFFFFF0),  # runs past the end of the file
            ("length", 7),  # a short length: the "next frame" lands inside this body
            ("crc", 0),
            ("base", 10**12),
            ("count", 0),
            ("count", 4),
        ],
    )
    def test_corrupt_frame_header_costs_only_its_frame(self, tmp_path, field, value):
        acked = build(tmp_path, 6)
        seg = tmp_path / segment_name(0)
        where = {"length": (0, "<I"), "crc": (4, "<I"), "base": (8, "<Q"), "count": (16, "<I")}
        delta, fmt = where[field]
        with open(seg, "r+b") as f:
            f.seek(frame_at(seg, 6) + delta)
            f.write(struct.pack(fmt, value))
        j = Journal(tmp_path)
        assert offsets(j) == {o: p for o, p in acked.items() if not 6 <= o < 9}
        assert [(d.first_offset, d.end_offset) for d in j.damage()] == [(6, 9)]
        assert j.next_offset == 18

    def test_damaged_header_of_the_last_segment_keeps_its_frames(self, tmp_path):
        acked = build(tmp_path, 8, n=50, size=10_000, segment_bytes=1024 * 1024)
        last = sorted(tmp_path.glob("*.seg"))[-1]
        assert last.name != segment_name(0)
        flip_byte(last, 3)
        j = Journal(tmp_path, segment_bytes=1024 * 1024)
        assert offsets(j) == acked
        assert j.next_offset == 400
        recoveries = j.metrics.registry.get_sample_value(
            "taproom_journal_recoveries_events_total", {"reason": "segment_header"}
        )
        assert recoveries == 1
        assert check_journal(tmp_path)["ok"]  # the header was written back from the file name

    def test_damaged_header_of_the_only_segment_keeps_the_journal(self, tmp_path):
        acked = build(tmp_path, 5)
        flip_byte(tmp_path / segment_name(0), 12)  # in the base offset
        j = Journal(tmp_path)
        assert offsets(j) == acked
        assert j.commit([batch("x")]) == [15]


class TestSealedSegments:
    @pytest.fixture
    def journal_dir(self, tmp_path) -> tuple[Path, dict]:
        acked = build(tmp_path, 12, n=50, size=10_000, segment_bytes=1024 * 1024)
        bases = sorted(int(p.stem) for p in tmp_path.glob("*.seg"))
        assert len(bases) >= 3
        return tmp_path, acked

    def test_every_reader_walks_past_the_same_damage(self, journal_dir):
        path, acked = journal_dir
        first, second = sorted(path.glob("*.seg"))[:2]
        flip_byte(first, frame_at(first, 50) + FRAME.size + 500)  # a frame in the middle
        flip_byte(second, 5)  # the header of the next sealed segment
        want = {o: p for o, p in acked.items() if not 50 <= o < 100}
        j = Journal(path, segment_bytes=1024 * 1024)  # opening checks only the active one
        assert j.damage() == []
        assert offsets(j) == want
        assert offsets(j) == want  # read twice, counted once
        assert lost(j.metrics, "crc_mismatch") == 50
        quarantined = j.metrics.registry.get_sample_value(
            "taproom_journal_quarantined_bytes_total", {"reason": "segment_header"}
        )
        assert quarantined == SEGMENT_HEADER.size
        assert [r.offset for r in j.read(40, 110)] == [*range(40, 50), *range(100, 110)]
        reader = JournalReader(path)
        assert offsets(reader) == want
        assert sorted((d.reason, d.lost_events) for d in reader.damage.values()) == [
            ("crc_mismatch", 50),
            ("segment_header", 0),
        ]

    def test_damage_at_the_end_of_a_sealed_segment_costs_up_to_the_next_segment(self, journal_dir):
        path, acked = journal_dir
        first, second = sorted(path.glob("*.seg"))[:2]
        last_frame = max(base for base, _pos in scan_segment(str(first)).index)
        with open(first, "r+b") as f:  # the last frame of the first segment is cut short
            f.truncate(os.path.getsize(first) - 100)
        end = int(second.stem)
        want = {o: p for o, p in acked.items() if not last_frame <= o < end}
        j = Journal(path, segment_bytes=1024 * 1024)
        assert offsets(j) == want
        assert [(d.first_offset, d.end_offset, d.reason) for d in j.damage()] == [
            (last_frame, end, "frame_header")
        ]
        assert offsets(JournalReader(path)) == want


class TestCheck:
    def test_reports_offsets_and_repair_leaves_lost_frames_alone(self, tmp_path):
        build(tmp_path, 10)
        seg = tmp_path / segment_name(0)
        flip_byte(seg, frame_at(seg, 3) + FRAME.size + 5)
        flip_byte(seg, 2)  # the segment header too
        with open(seg, "ab") as f:
            f.write(b"torn")
        report = check_journal(tmp_path)
        assert not report["ok"]
        assert report["events"] == 27 and report["lost_events"] == 3
        kinds = {p["kind"]: p for p in report["problems"]}
        assert set(kinds) == {"segment_header", "quarantined", "torn_tail"}
        assert (kinds["quarantined"]["first_offset"], kinds["quarantined"]["end_offset"]) == (3, 6)
        repaired = check_journal(tmp_path, repair=True)
        assert [p["repaired"] for p in repaired["problems"]] == [True, False, True]
        assert not repaired["ok"]  # offsets 3-5 are gone: no repair brings them back
        after = check_journal(tmp_path)
        assert [p["kind"] for p in after["problems"]] == ["quarantined"]
        assert offsets(JournalReader(tmp_path)).keys() == set(range(30)) - {3, 4, 5}


def taproom(*args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).with_name("taproom"))
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


class TestCheckCommand:
    """Exit status: 0 ok (or all repaired), 1 problems remain, 2 cannot check."""

    def test_exit_codes_follow_the_report(self, tmp_path):
        build(tmp_path, 4)
        seg = tmp_path / segment_name(0)
        check = ("journal", "check", "--journal", str(tmp_path), "--json")
        assert taproom(*check).returncode == 0
        with open(seg, "ab") as f:
            f.write(b"torn")
        assert taproom(*check).returncode == 1
        repaired = taproom(*check, "--repair")
        assert repaired.returncode == 0 and json.loads(repaired.stdout)["ok"] is True
        flip_byte(seg, frame_at(seg, 3) + FRAME.size + 5)
        for args in (check, (*check, "--repair")):
            result = taproom(*args)
            report = json.loads(result.stdout)
            assert (result.returncode, report["ok"], report["lost_events"]) == (1, False, 3)
        text = taproom("journal", "check", "--journal", str(tmp_path), "--repair")
        assert "offsets 3-5 lost" in text.stdout and "problems remain" in text.stdout
        missing = taproom("journal", "check", "--journal", str(tmp_path / "nope"))
        assert missing.returncode == 2 and "not a journal directory" in missing.stderr
        help_text = " ".join(taproom("journal", "check", "--help").stdout.split())
        assert (
            "Exit status: 0 nothing wrong (or all of it repaired), 1 problems remain" in help_text
        )
