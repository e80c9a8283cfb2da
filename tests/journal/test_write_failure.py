"""A real write failure (EFBIG from RLIMIT_FSIZE, in a child process): the journal drops the
descriptor, reopens, cuts back to durable data, and the retried commit gets the same offsets."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
