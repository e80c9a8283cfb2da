"""Journal: append, read back, recovery of torn tails, retention, cursors, check/repair."""

from __future__ import annotations

import os

import pytest

from taproom.journal import CursorStore, Journal, JournalReader, check_journal
from taproom.journal.segments import SEGMENT_HEADER, segment_name
from taproom.records import BatchBuilder, EncodedBatch, Record


def batch(tag: str, n: int = 3, size: int = 20) -> EncodedBatch:
    b = BatchBuilder(received_ns=1)
    for i in range(n):
        b.add(
            "test", f"{tag}-{i}".encode().ljust(size, b"."), stream="s", seq=i, event_id=f"{tag}{i}"
        )
    return b.build()


def payloads(journal_or_reader) -> list[bytes]:
    return [r.payload for r in journal_or_reader.read(0)]


def active_path(j: Journal) -> str:
    return j.segments()[-1].path


class TestAppendAndRead:
    def test_offsets_are_contiguous_and_records_round_trip(self, tmp_path):
        j = Journal(tmp_path)
        assert j.commit([batch("a"), batch("b", 2)]) == [0, 3]
        assert j.commit([batch("c")]) == [5]
        records = list(j.read(0))
        assert [r.offset for r in records] == list(range(8))
        assert records[3].payload.startswith(b"b-0")
        assert records[0] == Record(
            protocol="test",
            stream="s",
            seq=0,
            event_id="a0",
            payload=b"a-0".ljust(20, b"."),
            received_ns=1,
            offset=0,
        )

    def test_a_commit_group_of_more_batches_than_writev_takes(self, tmp_path):
        # Linux's writev takes at most IOV_MAX (1024) pieces; a group of 3000 small batches is
        # 6000 (a header and a body each). It failed with EINVAL on every retry, acks stopped.
        j = Journal(tmp_path)
        assert os.sysconf("SC_IOV_MAX") < 6000
        group = [batch(f"g{i}", 1, 8) for i in range(3000)]
        assert j.commit(group) == list(range(3000))
        assert j.failed is None
        assert j.commit([batch("after", 2)]) == [3000]
        reopened = Journal(tmp_path)
        assert [r.offset for r in reopened.read(0)] == list(range(3002))
        assert [r.payload[:6] for r in reopened.read(2998, 3001)] == [
            b"g2998-",
            b"g2999-",
            b"after-",
        ]

    def test_read_from_the_middle_of_a_batch(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a", 5)])
        assert [r.offset for r in j.read(2, 4)] == [2, 3]

    def test_segments_roll_and_reads_cross_them(self, tmp_path):
        j = Journal(tmp_path, segment_bytes=1024 * 1024)
        big = batch("x", 100, 20_000)  # ~2 MB: each commit rolls the next
        for _ in range(3):
            j.commit([big])
        assert len(j.segments()) == 3
        assert [r.offset for r in j.read(150, 160)] == list(range(150, 160))
        j.close()
        j2 = Journal(tmp_path, segment_bytes=1024 * 1024)
        assert j2.next_offset == 300
        assert len(payloads(j2)) == 300

    def test_reader_in_another_process_view_matches(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a"), batch("b")])
        reader = JournalReader(tmp_path)
        assert payloads(reader) == payloads(j)
        assert reader.end_offset() == 6

    def test_empty_batch_is_refused(self, tmp_path):
        with pytest.raises(ValueError):
            Journal(tmp_path).commit([EncodedBatch(0, b"")])


class TestRecovery:
    def test_torn_tail_is_truncated_and_counted(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a")])
        j.commit([batch("b")])
        j.close()
        path = active_path(j)
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            f.truncate(size - 7)  # cut into the last frame
        j2 = Journal(tmp_path)
        assert payloads(j2) == [p for p in payloads(j) if p.startswith(b"a")]
        assert j2.next_offset == 3
        assert j2.metrics.registry.get_sample_value("taproom_journal_truncated_bytes_total") > 0
        # appends continue at the right offset and survive another reopen
        assert j2.commit([batch("c")]) == [3]
        j2.close()
        assert len(payloads(Journal(tmp_path))) == 6

    def test_zero_filled_tail_is_truncated(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a")])
        j.close()
        good_size = os.path.getsize(active_path(j))
        with open(active_path(j), "ab") as f:
            f.write(b"\0" * 4096)
        j2 = Journal(tmp_path)
        assert j2.next_offset == 3
        assert os.path.getsize(active_path(j2)) == good_size
        assert len(payloads(j2)) == 3

    def test_flipped_bit_in_last_batch_is_cut_and_its_offsets_not_reused(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a")])
        j.commit([batch("b")])
        j.close()
        path = active_path(j)
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) - 3)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x01]))
        assert check_journal(tmp_path)["ok"] is False
        j2 = Journal(tmp_path)
        # A complete last frame that fails its CRC is cut like a torn write, but its offsets
        # may have been acked: new events start after them, in a new segment.
        assert [r.offset for r in j2.read(0)] == [0, 1, 2]
        assert j2.next_offset == 6
        assert j2.commit([batch("c")]) == [6]
        lost = j2.metrics.registry.get_sample_value(
            "taproom_journal_lost_events_total", {"reason": "crc_mismatch"}
        )
        assert lost == 3
        j2.close()
        assert [r.offset for r in Journal(tmp_path).read(0)] == [0, 1, 2, 6, 7, 8]

    def test_torn_new_segment_header_is_removed(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a")])
        j.close()
        with open(tmp_path / segment_name(3), "wb") as f:
            f.write(b"TAPRO")  # crash while creating the next segment
        j2 = Journal(tmp_path)
        assert j2.next_offset == 3
        assert not (tmp_path / segment_name(3)).exists()

    def test_only_segment_with_torn_header_is_rewritten(self, tmp_path):
        (tmp_path / segment_name(0)).write_bytes(b"TAP")
        j = Journal(tmp_path)
        assert j.next_offset == 0
        assert j.commit([batch("a")]) == [0]
        assert os.path.getsize(active_path(j)) > SEGMENT_HEADER.size

    def test_reader_stops_before_an_unfinished_tail_and_walks_past_sealed_corruption(
        self, tmp_path
    ):
        j = Journal(tmp_path, segment_bytes=1024 * 1024)
        big = batch("x", 50, 40_000)
        j.commit([big])
        j.commit([big])
        j.close()
        first = j.segments()[0].path
        with open(active_path(j), "ab") as f:
            f.write(b"\1" * 30)  # half-written frame in the last segment
        reader = JournalReader(tmp_path)
        assert len(list(reader.read(0))) == 100
        assert reader.damage == {}  # an unfinished tail is not damage
        with open(first, "r+b") as f:
            f.seek(100)
            f.write(b"garbage!")
        reader = JournalReader(tmp_path)
        assert [r.offset for r in reader.read(0)] == list(range(50, 100))
        (damage,) = reader.damage.values()
        assert (damage.first_offset, damage.end_offset, damage.reason) == (0, 50, "crc_mismatch")


class TestCheck:
    def test_check_reports_and_repairs(self, tmp_path):
        j = Journal(tmp_path)
        j.commit([batch("a")])
        j.commit([batch("b")])
        j.close()
        with open(active_path(j), "ab") as f:
            f.write(b"junk")
        report = check_journal(tmp_path)
        assert not report["ok"] and report["events"] == 6
        repaired = check_journal(tmp_path, repair=True)
        assert repaired["problems"][0]["repaired"] is True
        assert check_journal(tmp_path)["ok"] is True


class TestRetention:
    def test_deletes_whole_sealed_segments_by_bytes(self, tmp_path):
        j = Journal(tmp_path, segment_bytes=1024 * 1024)
        big = batch("x", 10, 110_000)  # ~1.1 MB per commit: one segment each
        for _ in range(5):
            j.commit([big])
        assert len(j.segments()) == 5
        deleted = j.enforce_retention(retention_bytes=2_500_000, retention_age_s=0)
        assert deleted == 3
        assert j.first_offset == 30
        assert [r.offset for r in j.read(0)][:1] == [30]  # reads start at what is left

    def test_deletes_by_age_but_never_the_active_segment(self, tmp_path):
        j = Journal(tmp_path, segment_bytes=1024 * 1024)
        big = batch("x", 10, 110_000)
        for _ in range(3):
            j.commit([big])
        future = os.path.getmtime(active_path(j)) + 3600
        assert j.enforce_retention(0, 60, now=future) == 2
        assert len(j.segments()) == 1
        assert j.commit([batch("y")]) == [30]


class TestCursors:
    def test_save_load_and_survive_reopen(self, tmp_path):
        store = CursorStore(tmp_path)
        assert store.load("spark") is None
        store.save("spark", 42)
        store.save("spark", 43)
        assert CursorStore(tmp_path).load("spark") == 43
        assert store.names() == ["spark"]

    def test_names_are_checked(self, tmp_path):
        with pytest.raises(ValueError):
            CursorStore(tmp_path).save("../escape", 1)
