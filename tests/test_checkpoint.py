"""The shared checkpoint file: atomic, CRC-checked, ignored (never trusted) when damaged."""

from __future__ import annotations

from taproom.checkpoint import load_checkpoint, save_checkpoint

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
