"""The shared checkpoint file: atomic, CRC-checked, ignored (never trusted) when damaged."""

from __future__ import annotations

import time

from taproom.checkpoint import CheckpointSchedule, load_checkpoint, save_checkpoint
from taproom.metrics import Metrics

MAGIC = b"TAPROOM-TEST-CHECKPOINT-1\n"


def test_round_trip_of_parts(tmp_path):
    path = str(tmp_path / "sub" / "checkpoint")
    save_checkpoint(path, MAGIC, [b"abc", memoryview(b"def"), b""])
    assert load_checkpoint(path, MAGIC) == b"abcdef"
    save_checkpoint(path, MAGIC, [b"newer"])  # replaces the old one whole
    assert load_checkpoint(path, MAGIC) == b"newer"
    assert not (tmp_path / "sub" / "checkpoint.tmp").exists()


def test_missing_damaged_or_foreign_is_none(tmp_path, caplog):
    path = tmp_path / "checkpoint"
    assert load_checkpoint(str(path), MAGIC) is None
    save_checkpoint(str(path), MAGIC, [b"x" * 100])
    damaged = bytearray(path.read_bytes())
    damaged[-1] ^= 1
    path.write_bytes(bytes(damaged))
    assert load_checkpoint(str(path), MAGIC) is None
    assert "fails its CRC" in caplog.text
    save_checkpoint(str(path), MAGIC, [b"x"])
    assert load_checkpoint(str(path), b"TAPROOM-OTHER-1\n") is None
    path.write_bytes(MAGIC[:5])
    assert load_checkpoint(str(path), MAGIC) is None


class TestSchedule:
    """Checkpoints by progress: due at once after a start that read the journal, after enough
    records (more for a big state), or after the interval when anything changed; never back
    to back."""

    def schedule(self, **kw: float) -> CheckpointSchedule:
        args = {"interval_s": 60.0, "after_events": 100, "size_ratio": 0.5, "min_gap_s": 1.0}
        args.update(kw)
        return CheckpointSchedule(Metrics(), "test", **args)  # type: ignore[arg-type]

    def test_a_state_read_from_the_journal_is_saved_at_once(self):
        s = self.schedule()
        s.started(seconds=2.0, replayed=5000, covered=None)
        assert s.due(s.last_at, covered=10, size=50)  # even within min_gap_s of the start
        s.written(10, 0.1)
        assert not s.due(s.last_at + 5, covered=10, size=50)
        s.started(seconds=0.1, replayed=0, covered=10)  # a checkpoint and nothing after it
        assert not s.due(s.last_at + 5, covered=10, size=50)
        s.started(seconds=0.1, replayed=0, covered=None)  # nothing of its own in the journal
        assert not s.due(s.last_at + 5, covered=10, size=0)

    def test_progress_scaled_by_the_state_size(self):
        s = self.schedule()
        s.started(seconds=0.1, replayed=0, covered=0)
        s.applied = 99
        assert not s.due(s.last_at + 2, covered=0, size=10)
        s.applied = 100
        assert s.due(s.last_at + 2, covered=0, size=10)
        assert not s.due(s.last_at + 2, covered=0, size=1000)  # 0.5 x 1000 = 500 needed
        s.applied = 500
        assert s.due(s.last_at + 2, covered=0, size=1000)
        assert not s.due(s.last_at + 0.5, covered=0, size=1000)  # min_gap_s

    def test_the_interval_when_anything_changed(self):
        s = self.schedule()
        s.started(seconds=0.1, replayed=0, covered=7)
        assert not s.due(s.last_at + 61, covered=7, size=5)  # nothing changed
        assert s.due(s.last_at + 61, covered=8, size=5)  # the journal moved on
        s.applied = 1
        assert not s.due(s.last_at + 59, covered=7, size=5)
        assert s.due(s.last_at + 61, covered=7, size=5)

    def test_a_failed_write_gives_back_what_it_took(self):
        s = self.schedule()
        s.started(seconds=0.1, replayed=0, covered=0)
        s.applied = 150
        taken = s.taken()
        assert s.applied == 0
        s.failed(taken)
        assert s.applied == 150
        assert not s.due(time.monotonic() + 0.5, covered=0, size=0)  # not in a tight loop
        assert s.due(time.monotonic() + 1.5, covered=0, size=0)
        s.taken()
        s.written(3, 0.2)
        assert (s.applied, s.covered, s.unsaved) == (0, 3, False)
