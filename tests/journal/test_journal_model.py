"""Journal against a model: appends, syncs, crashes at any point, reopen, read back.

A crash is modelled the way a power loss behaves: the process dies without closing, and the
active segment keeps everything up to its last successful fsync plus an arbitrary prefix of
what was written after it (possibly followed by garbage where a page was half-written). After
reopening, the journal must hold every synced batch exactly, plus whole unsynced batches in
order, and nothing else.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from taproom.journal import Journal
from taproom.records import BatchBuilder
from tests.support import fuzz_examples

SEGMENT_BYTES = 4096  # tiny, so segment rolls happen often


class JournalModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="journal-model-")
        self.journal = Journal(self.dir, fsync="off", segment_bytes=SEGMENT_BYTES)
        self.durable: list[list[bytes]] = []  # batches known on disk
        self.pending: list[list[bytes]] = []  # written, not yet synced
        self.counter = 0

    def teardown(self) -> None:
        try:
            self.journal.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _open(self) -> None:
        self.journal = Journal(self.dir, fsync="off", segment_bytes=SEGMENT_BYTES)

    @rule(n=st.integers(1, 20), size=st.integers(0, 400), sync=st.booleans())
    def append(self, n: int, size: int, sync: bool) -> None:
        builder = BatchBuilder()
        payloads = []
        for _ in range(n):
            self.counter += 1
            payload = f"{self.counter}:".encode() + b"p" * size
            builder.add("model", payload, seq=self.counter)
            payloads.append(payload)
        segments_before = len(self.journal.segments())
        self.journal.commit([builder.build()])
        if len(self.journal.segments()) > segments_before:
            # sealing the old segment fsyncs it: everything pending before is durable now
            self.durable += self.pending
            self.pending = []
        self.pending.append(payloads)
        if sync:
            self.journal.sync()
            self.durable += self.pending
            self.pending = []

    @rule(cut=st.floats(0, 1), garbage=st.binary(max_size=64))
    def crash(self, cut: float, garbage: bytes) -> None:
        active = self.journal.segments()[-1].path
        durable_pos = self.journal._durable_pos
        size = os.path.getsize(active)
        os.close(self.journal._fd)  # die without closing: no sync
        keep = durable_pos + int((size - durable_pos) * cut)
        with open(active, "r+b") as f:
            f.truncate(keep)
            if keep < size:
                f.seek(keep)
                f.write(garbage[: size - keep])
        self._open()
        recovered = [r.payload for r in self.journal.read(0)]
        flat_durable = [p for b in self.durable for p in b]
        assert recovered[: len(flat_durable)] == flat_durable
        survivors = recovered[len(flat_durable) :]
        expected: list[bytes] = []
        kept_batches = 0
        for b in self.pending:
            if survivors[: len(expected) + len(b)] == expected + b:
                expected += b
                kept_batches += 1
            else:
                break
        assert survivors == expected, "only whole unsynced batches, in order, may survive"
        self.durable += self.pending[:kept_batches]
        self.pending = []

    @precondition(lambda self: True)
    @rule()
    def clean_reopen(self) -> None:
        self.journal.close()
        self._open()
        self.durable += self.pending
        self.pending = []

    @invariant()
    def offsets_match_the_model(self) -> None:
        events = sum(len(b) for b in self.durable) + sum(len(b) for b in self.pending)
        assert self.journal.next_offset == events
        assert self.journal.end_offset == events


TestJournalModel = JournalModel.TestCase
TestJournalModel.settings = settings(
    max_examples=fuzz_examples(150, 5000), stateful_step_count=30, deadline=None
)
