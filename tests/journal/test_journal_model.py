"""Journal against a model: appends, syncs, failed fsyncs, crashes at any point, reopen, read.

A crash is modelled the way a power loss behaves: the process dies without closing, and the
active segment keeps everything up to its last successful fsync plus an arbitrary prefix of
what was written after it (possibly followed by garbage where a page was half-written). After
reopening, the journal must hold every synced batch exactly, at the offsets it was given, plus
whole unsynced batches in order, and nothing else. Offsets are never handed out twice: after
a failed fsync the unsynced batches are gone and the next batch continues after their
offsets; a last frame cut because its CRC failed keeps its offsets too.

A failed fsync cannot be produced on this machine's filesystems (no device-mapper here), so
the model injects EIO at the ``os.fsync`` call the journal makes.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from unittest import mock

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from taproom.errors import JournalFailed
from taproom.journal import Journal
from taproom.records import BatchBuilder
from tests.support import fuzz_examples

SEGMENT_BYTES = 4096  # tiny, so segment rolls happen often

Batch = list[tuple[int, bytes]]  # (offset, payload) of each event of one committed batch


class JournalModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="journal-model-")
        self.journal = Journal(self.dir, fsync="interval", segment_bytes=SEGMENT_BYTES)
        self.durable: dict[int, bytes] = {}  # events known on disk, by offset
        self.pending: list[Batch] = []  # written, not yet synced
        self.next_offset = 0
        self.counter = 0

    def teardown(self) -> None:
        try:
            self.journal.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _open(self) -> None:
        self.journal = Journal(self.dir, fsync="interval", segment_bytes=SEGMENT_BYTES)

    def _settle(self, batches: list[Batch]) -> None:
        for batch in batches:
            self.durable.update(batch)

    @rule(n=st.integers(1, 20), size=st.integers(0, 400), sync=st.booleans())
    def append(self, n: int, size: int, sync: bool) -> None:
        builder = BatchBuilder()
        payloads = []
        for _ in range(n):
            self.counter += 1
            payload = f"{self.counter}:".encode() + b"p" * size
            builder.add("model", payload, seq=self.counter)
            payloads.append(payload)
        if self.journal.failed is not None:
            self.pending = []  # the reopen cuts back to durable data; their offsets stay used
        segments_before = len(self.journal.segments())
        [base] = self.journal.commit([builder.build()])
        assert base == self.next_offset, "offsets are handed out once, in order"
        if len(self.journal.segments()) > segments_before:
            # sealing the old segment fsyncs it: everything pending before is durable now
            self._settle(self.pending)
            self.pending = []
        self.pending.append([(base + i, p) for i, p in enumerate(payloads)])
        self.next_offset = base + n
        if sync:
            self.journal.sync()
            self._settle(self.pending)
            self.pending = []

    @rule()
    def fsync_fails(self) -> None:
        unsynced = self.journal._unsynced and self.journal._fd >= 0
        eio = OSError(errno.EIO, os.strerror(errno.EIO))
        with mock.patch("taproom.journal.journal.os.fsync", side_effect=eio):
            if unsynced:
                with pytest.raises(JournalFailed):
                    self.journal.sync()
                assert self.journal.failed is not None
            else:
                self.journal.sync()  # nothing unsynced: no fsync is made

    @rule(cut=st.floats(0, 1), garbage=st.binary(max_size=64))
    def crash(self, cut: float, garbage: bytes) -> None:
        active = self.journal.segments()[-1].path
        durable_pos = self.journal._durable_pos
        size = os.path.getsize(active)
        # Die without closing: no sync. The process's descriptors go with it: the active
        # segment's and the kind index's log (left open, each crash leaked them: ~665 in a run
        # of `make test`'s 150 examples, past the 20,000 a process may hold under `make soak`).
        if self.journal._fd >= 0:
            os.close(self.journal._fd)
        self.journal._kinds.close()  # its descriptor only: the kind index syncs nothing here
        keep = durable_pos + int((size - durable_pos) * cut)
        with open(active, "r+b") as f:
            f.truncate(keep)
            if keep < size:
                f.seek(keep)
                f.write(garbage[: size - keep])
        self._open()
        recovered = {r.offset: r.payload for r in self.journal.read(0)}
        kept: list[Batch] = []
        for batch in self.pending:
            if all(recovered.get(o) == p for o, p in batch):
                kept.append(batch)
            else:
                break
        self._settle(kept)
        assert recovered == self.durable, "only whole unsynced batches, in order, may survive"
        pending_start = self.pending[0][0][0] if self.pending else self.next_offset
        ends = {kept[-1][-1][0] + 1 if kept else pending_start}
        lost = self.pending[len(kept) :]
        if lost:
            # A whole last frame that fails its CRC is cut, but its offsets are not reused.
            ends.add(lost[0][-1][0] + 1)
        assert self.journal.next_offset in ends
        self.next_offset = self.journal.next_offset
        self.pending = []

    @rule()
    def clean_reopen(self) -> None:
        self.journal.close()
        self._open()
        # Closing synced the pending batches; after a failed fsync nothing cut them yet.
        self._settle(self.pending)
        self.pending = []
        assert {r.offset: r.payload for r in self.journal.read(0)} == self.durable

    @invariant()
    def offsets_match_the_model(self) -> None:
        assert self.journal.next_offset == self.next_offset
        assert self.journal.end_offset == self.next_offset


TestJournalModel = JournalModel.TestCase
TestJournalModel.settings = settings(
    max_examples=fuzz_examples(150, 5000), stateful_step_count=30, deadline=None
)
