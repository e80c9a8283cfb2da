"""Write failures: the journal drops the descriptor, reopens, cuts back to durable data.

A real write failure (EFBIG from RLIMIT_FSIZE, in a child process): the retried commit gets the
same offsets. A failed fsync under ``fsync = "interval"``: later batches keep their offsets.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
from unittest import mock

import pytest

from taproom.errors import JournalFailed
from taproom.journal import Journal
from taproom.records import BatchBuilder, EncodedBatch

CHILD = textwrap.dedent(
    """
    import os, resource, signal, sys
    from taproom.errors import JournalFailed
    from taproom.journal import Journal
    from taproom.records import BatchBuilder

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
    path = sys.argv[1]
    j = Journal(path)
    b = BatchBuilder()
    b.add("t", b"small")
    assert j.commit([b.build()]) == [0]
    seg = j.segments()[-1].path
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(seg) + 1000, hard))
    big = BatchBuilder()
    for i in range(10):
        big.add("t", bytes([65 + i]) * 500)
    batch = big.build()
    try:
        j.commit([batch])
    except JournalFailed as exc:
        print("failed:", exc)
    else:
        raise SystemExit("expected JournalFailed")
    assert j.failed is not None
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert j.commit([batch]) == [1]   # reopened, cut back, same offsets handed out again
    assert j.failed is None
    j.close()
    payloads = [r.payload[:1] for r in Journal(path).read(0)]
    print("payloads:", b"".join(payloads).decode())
    """
)


def test_failed_write_reopens_and_retries(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "j")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "failed: write failed: File too large" in result.stdout
    assert "payloads: sABCDEFGHIJ" in result.stdout


def test_failed_fsync_under_interval_keeps_every_later_batch(tmp_path):
    """fsync = "interval": one failed fsync cuts back what it did not cover, and every batch
    after it is written, synced and readable at the offset it was acked with. EIO from fsync
    cannot be produced on this machine's filesystems, so it is injected at the os.fsync call."""
    j = Journal(tmp_path, fsync="interval")
    assert j.commit([_batch("a")]) == [0]
    j.sync()
    assert j.commit([_batch("b")]) == [3]  # acked under "interval", not yet synced
    eio = OSError(errno.EIO, os.strerror(errno.EIO))
    with (
        mock.patch("taproom.journal.journal.os.fsync", side_effect=eio),
        pytest.raises(JournalFailed),
    ):
        j.sync()
    # b was acked with offsets 3-5: they are never handed out again for other events.
    assert j.commit([_batch("c")]) == [6]
    j.sync()
    assert j.commit([_batch("d")]) == [9]
    j.sync()
    want = {0: b"a0", 1: b"a1", 2: b"a2", 6: b"c0", 7: b"c1", 8: b"c2", 9: b"d0", 10: b"d1"}
    want[11] = b"d2"
    assert {r.offset: r.payload for r in j.read(0)} == want
    lost = j.metrics.registry.get_sample_value(
        "taproom_journal_lost_events_total", {"reason": "cut_after_failure"}
    )
    assert lost == 3
    j.close()
    reopened = Journal(tmp_path, fsync="interval")
    assert {r.offset: r.payload for r in reopened.read(0)} == want
    assert reopened.next_offset == 12
    reopened.close()


def _batch(tag: str) -> EncodedBatch:
    b = BatchBuilder()
    for i in range(3):
        b.add("t", f"{tag}{i}".encode())
    return b.build()
