"""A real full disk (a small tmpfs) exactly when the journal must start a new segment.

The roll creates the next segment completely before letting go of the active one, so a full
disk there raises DiskFull, leaves no empty segment behind, and the same commit succeeds, with
the same offsets, as soon as space returns: no restart needed.
"""

from __future__ import annotations

import pytest

from taproom.errors import DiskFull
from taproom.journal import ID_FILE, Journal
from taproom.journal.segments import segment_name
from taproom.records import BatchBuilder, EncodedBatch, iter_batch
from tests.support import fill, fuzz_examples, needs_mount, small_tmpfs

SEGMENT_BYTES = 64 * 1024


def batch(tag: str, n: int, size: int) -> EncodedBatch:
    b = BatchBuilder()
    for i in range(n):
        b.add("test", f"{tag}:{i}:".encode().ljust(size, b"x"))
    return b.build()


@needs_mount
def test_disk_full_at_a_segment_roll_recovers_by_itself(tmp_path):
    with small_tmpfs(tmp_path / "mnt", "4m") as mnt:
        j = Journal(mnt / "j", segment_bytes=SEGMENT_BYTES)
        acked: dict[int, bytes] = {}
        expected_segments = 1
        for cycle in range(fuzz_examples(2, 40)):
            # Fill the active segment past segment_bytes: the next commit has to roll.
            while j.segments()[-1].size < SEGMENT_BYTES:
                big = batch(f"c{cycle}", 10, 2_000)
                [base] = j.commit([big])
                acked.update({base + i: p for i, p in enumerate(_payloads(big))})
            filler = fill(mnt)
            small = batch(f"r{cycle}", 3, 100)
            for _ in range(3):  # the same commit, retried as the hub does
                with pytest.raises(DiskFull):
                    j.commit([small])
            extra = {"cursors", "index", ID_FILE}
            assert sorted(p.name for p in (mnt / "j").iterdir() if p.name not in extra) == [
                segment_name(s.base_offset) for s in j.segments()
            ], "a failed roll leaves no empty or half-made segment"
            assert len(j.segments()) == expected_segments
            filler.unlink()
            [base] = j.commit([small])
            assert base == j.segments()[-1].base_offset  # the new segment starts with it
            expected_segments += 1
            acked.update({base + i: p for i, p in enumerate(_payloads(small))})
        j.close()
        reopened = Journal(mnt / "j", segment_bytes=SEGMENT_BYTES)
        assert {r.offset: r.payload for r in reopened.read(0)} == acked
        reopened.close()


def _payloads(b: EncodedBatch) -> list[bytes]:
    return [r.payload for r in iter_batch(b.body, 0)]
