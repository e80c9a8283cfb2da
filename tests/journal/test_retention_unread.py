"""Retention that knows its readers: segments a cursor has not passed stay, up to a hard cap."""

from __future__ import annotations

from pathlib import Path

from taproom.journal import Journal
from taproom.metrics import Metrics
from taproom.records import BatchBuilder

SEGMENT_BYTES = 1 << 20


def _journal(path: Path) -> Journal:
    """About eight 1 MiB segments of 100-event batches (~100 KiB each)."""
    journal = Journal(path, fsync="off", segment_bytes=SEGMENT_BYTES, metrics=Metrics())
    for _ in range(80):
        builder = BatchBuilder()
        for i in range(100):
            builder.add("test", b"x" * 1000, seq=i)
        journal.commit([builder.build()])
    assert len(journal.segments()) >= 7
    return journal


def _unread_deleted(journal: Journal) -> float:
    sample = journal.metrics.registry.get_sample_value(
        "taproom_journal_unread_deleted_events_total"
    )
    return sample or 0.0


def test_without_cursors_retention_deletes_as_before(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    deleted = journal.enforce_retention(2 * SEGMENT_BYTES, 0, unread={}, unread_max_bytes=1 << 40)
    assert deleted >= 5 and journal.total_bytes <= 2 * SEGMENT_BYTES
    assert _unread_deleted(journal) == 0


def test_unread_segments_are_kept_until_the_cursor_passes(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    segments = journal.segments()
    cursor = segments[2].base_offset + 10  # in the third segment
    deleted = journal.enforce_retention(
        2 * SEGMENT_BYTES, 0, unread={"spark": cursor}, unread_max_bytes=1 << 40
    )
    assert deleted == 2  # the two the reader has passed; the one it is reading stays
    assert journal.first_offset == segments[2].base_offset
    # Age-based retention too: a reader that has not passed a segment keeps it.
    assert (
        journal.enforce_retention(
            0, 1, now=1e12, unread={"spark": cursor}, unread_max_bytes=1 << 40
        )
        == 0
    )
    # The reader moves on: what it passed goes.
    assert (
        journal.enforce_retention(
            2 * SEGMENT_BYTES,
            0,
            unread={"spark": segments[5].base_offset},
            unread_max_bytes=1 << 40,
        )
        == 3
    )
    # The slowest of several readers decides.
    assert (
        journal.enforce_retention(
            2 * SEGMENT_BYTES,
            0,
            unread={"fast": journal.end_offset, "slow": segments[5].base_offset},
            unread_max_bytes=1 << 40,
        )
        == 0
    )
    assert _unread_deleted(journal) == 0


def test_past_the_cap_the_oldest_go_and_the_loss_is_counted(tmp_path: Path) -> None:
    journal = _journal(tmp_path / "j")
    segments = journal.segments()
    cap = 4 * SEGMENT_BYTES + SEGMENT_BYTES // 2
    deleted = journal.enforce_retention(
        SEGMENT_BYTES, 0, unread={"stuck": 50}, unread_max_bytes=cap
    )
    assert journal.total_bytes <= cap and deleted == len(segments) - len(journal.segments())
    lost = journal.first_offset - 50  # every offset from the cursor up to what is left
    assert lost > 0 and _unread_deleted(journal) == lost
