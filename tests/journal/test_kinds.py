"""The journal's index of kinds (journal/kinds.py): a reader asking for one kind gets every
frame holding it, whatever happened to the index files (missing, damaged, stale, torn, longer
than a segment cut after a crash), and skips the rest."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.journal import Journal
from taproom.journal.kinds import ANY, Kind, body_labels, covers, declared_cover
from taproom.journal.segments import segment_name
from taproom.records import BatchBuilder, EncodedBatch, iter_batch
from tests.support import flip_byte, fuzz_examples

PROTOCOLS = ("lumberjack", "logtk", "eventbus", "lager")
CONTENT = {"lumberjack": ("json",), "logtk": ("bson", "json"), "eventbus": ("msgpack", "raw"),
           "lager": ("lager", "lager-registration")}  # fmt: skip
KINDS = [Kind("eventbus"), Kind("logtk"), Kind("lager", "lager-registration"), Kind("lager"),
         Kind("lumberjack", "raw"), Kind("absent")]  # fmt: skip
SEGMENT = 4096


def make_batch(rng: random.Random, tag: int, *, declared: bool = True) -> EncodedBatch:
    """A batch of one or (rarely) two protocols, as a server makes it."""
    builder = BatchBuilder(received_ns=tag)
    protocols = [rng.choice(PROTOCOLS)]
    if rng.random() < 0.1:
        protocols.append(rng.choice(PROTOCOLS))
    for i in range(rng.randint(1, 6)):
        protocol = protocols[i % len(protocols)]
        builder.add(
            protocol,
            f"{tag}-{i}".encode() * rng.randint(1, 8),
            seq=tag * 100 + i,
            content_type=rng.choice(CONTENT[protocol]),
        )
    batch = builder.build()
    return batch if declared else EncodedBatch(batch.count, batch.body)


def wanted(journal: Journal, kind: Kind) -> list[int]:
    """Offsets of the records of ``kind``, from a plain read of everything."""
    return [
        r.offset
        for r in journal.read(0)
        if r.protocol == kind.protocol
        and (kind.content_type is None or r.content_type == kind.content_type)
    ]


def by_kind(journal: Journal, kind: Kind) -> tuple[list[int], int]:
    """The same through the index, and how many frames it read."""
    found = []
    frames = 0
    for base, _count, body in journal.read_batches(0, kind=kind):
        frames += 1
        for r in iter_batch(body, base, kind.protocol.encode()):
            if kind.content_type is None or r.content_type == kind.content_type:
                found.append(r.offset)
    return found, frames


def assert_index_agrees(journal: Journal) -> None:
    for kind in KINDS:
        found, _frames = by_kind(journal, kind)
        assert found == wanted(journal, kind), kind


def write(path: Path, rng: random.Random, n: int, start: int = 0, **kw: bool) -> Journal:
    j = Journal(path, segment_bytes=SEGMENT, fsync="off")
    for tag in range(start, start + n):
        j.commit([make_batch(rng, tag, **kw) for _ in range(rng.randint(1, 3))])
    return j


class TestLabels:
    def test_labels_and_cover(self):
        b = BatchBuilder()
        b.add("eventbus", b"x", content_type="msgpack")
        b.add("lager", b"y", content_type="lager-registration")
        b.add("eventbus", b"z", content_type="msgpack")
        batch = b.build()
        assert (
            batch.kinds
            == body_labels(batch.body)
            == {"eventbus/msgpack", "lager/lager-registration"}
        )
        assert covers(batch.kinds, Kind("eventbus"))
        assert covers(batch.kinds, Kind("lager", "lager-registration"))
        assert not covers(batch.kinds, Kind("lager", "lager"))
        assert covers({"lager/*"}, Kind("lager", "lager-registration"))
        assert covers({ANY}, Kind("anything"))
        assert not covers(set(), Kind("eventbus"))
        assert declared_cover({"eventbus/*"}, {"eventbus/raw", "eventbus/msgpack"})
        assert not declared_cover({"eventbus/msgpack"}, {"eventbus/raw"})

    def test_a_body_that_does_not_parse_may_hold_anything(self):
        assert body_labels(b"\x05\x00\x00") == {ANY}


class TestReadsByKind:
    @settings(max_examples=fuzz_examples(20, 300))
    @given(st.integers(0, 2**32), st.booleans())
    def test_same_records_as_a_full_read(self, tmp_path_factory, seed, declared):
        path = tmp_path_factory.mktemp("j")
        j = write(path, random.Random(seed), 60, declared=declared)
        assert_index_agrees(j)
        j.close()
        reopened = Journal(path, segment_bytes=SEGMENT)
        assert_index_agrees(reopened)
        assert reopened.metrics.render().count(b"index_rebuilt") >= 1
        reopened.close()

    def test_frames_of_other_kinds_are_not_read(self, tmp_path):
        j = Journal(tmp_path, segment_bytes=SEGMENT)
        rng = random.Random(5)
        for tag in range(200):
            j.commit([make_batch(rng, tag)])
        one = Kind("lager", "lager-registration")
        _found, frames = by_kind(j, one)
        holding = sum(1 for _b, _c, body in j.read_batches(0) if covers(body_labels(body), one))
        assert frames == holding < 200 / 3, "only the frames holding registrations are read"
        j.close()
        _found, frames = by_kind(Journal(tmp_path, segment_bytes=SEGMENT), Kind("absent"))
        assert frames == 0

    def test_from_offset_inside_a_run(self, tmp_path):
        j = Journal(tmp_path, segment_bytes=1 << 20)
        for tag in range(50):
            b = BatchBuilder()
            b.add("eventbus", f"{tag}".encode(), seq=tag)
            j.commit([b.build()])
        got = [
            r.seq
            for base, _c, body in j.read_batches(20, 30, kind=Kind("eventbus"))
            for r in iter_batch(body, base)
        ]
        assert got == list(range(20, 30))


class TestIndexFiles:
    def test_missing_index_is_rebuilt_from_the_segments(self, tmp_path):
        j = write(tmp_path, random.Random(1), 80)
        j.close()
        shutil.rmtree(tmp_path / "index")
        reopened = Journal(tmp_path, segment_bytes=SEGMENT)
        assert_index_agrees(reopened)
        sealed = len(reopened.segments()) - 1
        assert sealed > 2
        assert _rebuilt(reopened) == sealed + 1  # each segment read once, the active at open
        assert_index_agrees(reopened)
        assert _rebuilt(reopened) == sealed + 1
        reopened.close()
        again = Journal(tmp_path, segment_bytes=SEGMENT)
        assert_index_agrees(again)
        assert _rebuilt(again) == 0, "the rebuilt index was kept"
        again.close()

    @pytest.mark.parametrize("ext", ["kinds", "runs"])
    def test_damaged_files_are_not_trusted(self, tmp_path, ext, caplog):
        j = write(tmp_path, random.Random(2), 80)
        j.close()
        for f in (tmp_path / "index").glob(f"*.{ext}"):
            flip_byte(f, os.path.getsize(f) - 3)
        reopened = Journal(tmp_path, segment_bytes=SEGMENT)
        assert_index_agrees(reopened)
        assert _rebuilt(reopened) > 0
        reopened.close()

    def test_stale_summaries_are_not_trusted(self, tmp_path):
        """A summary of another journal, or of a segment file since replaced, is rebuilt."""
        rng = random.Random(3)
        j = write(tmp_path / "a", rng, 80)
        j.close()
        other = write(tmp_path / "b", rng, 80)
        other.close()
        index = tmp_path / "a" / "index"
        both = {f.name for f in index.iterdir()} & {
            f.name for f in (tmp_path / "b" / "index").iterdir()
        }
        assert len(both) >= 2
        for name in both:  # another journal's files for segments of the same base
            shutil.copy(tmp_path / "b" / "index" / name, index / name)
        reopened = Journal(tmp_path / "a", segment_bytes=SEGMENT)
        assert_index_agrees(reopened)
        assert _rebuilt(reopened) == len({name.split(".")[0] for name in both})
        reopened.close()
        for name in both:  # only the runs are another journal's
            if name.endswith(".runs"):
                shutil.copy(tmp_path / "b" / "index" / name, index / name)
        again = Journal(tmp_path / "a", segment_bytes=SEGMENT)
        assert_index_agrees(again)
        assert _rebuilt(again) >= 1
        again.close()
        # A sealed segment replaced by another file with the same base (restored from a backup,
        # say) is read again: its summary was sealed at another size.
        first = tmp_path / "a" / segment_name(0)
        with open(first, "ab") as f:
            f.write(b"\0" * 100)  # damage at the end of a sealed segment
        last = Journal(tmp_path / "a", segment_bytes=SEGMENT)
        assert_index_agrees(last)
        assert _rebuilt(last) == 1
        last.close()

    def test_a_torn_runs_log_is_completed_from_the_segment(self, tmp_path):
        j = write(tmp_path, random.Random(4), 80)
        active = j.segments()[-1].base_offset
        j.close()
        runs = tmp_path / "index" / f"{active:020d}.runs"
        os.truncate(runs, os.path.getsize(runs) - 7)  # the last chunk, torn
        reopened = Journal(tmp_path, segment_bytes=SEGMENT)
        assert_index_agrees(reopened)
        assert _rebuilt(reopened) == 0  # only the frames the log lost were read
        reopened.close()

    def test_runs_of_a_lost_tail_never_describe_new_frames(self, tmp_path):
        """A crash loses the last frames (fsync = interval): the runs log still describes them,
        the same offsets get other frames, and the index must follow the new ones."""
        rng = random.Random(6)
        j = Journal(tmp_path, segment_bytes=1 << 20, fsync="off")
        for tag in range(30):
            j.commit([make_batch(rng, tag)])
        keep = j.segments()[-1].size
        for tag in range(30, 40):
            b = BatchBuilder()
            b.add("eventbus", b"lost", seq=tag)
            j.commit([b.build()])
        j.close()
        os.truncate(tmp_path / segment_name(0), keep)  # the tail never reached the disk
        for cycle in range(2):
            reopened = Journal(tmp_path, segment_bytes=1 << 20, fsync="off")
            assert_index_agrees(reopened)
            for tag in range(40 + 10 * cycle, 50 + 10 * cycle):
                b = BatchBuilder()
                b.add("lager", b"new", seq=tag, content_type="lager-registration")
                reopened.commit([b.build()])
            assert_index_agrees(reopened)
            assert by_kind(reopened, Kind("eventbus"))[0] == wanted(reopened, Kind("eventbus"))
            reopened.close()

    def test_the_summary_is_on_disk_before_any_frame_of_its_kind(self, tmp_path, monkeypatch):
        j = Journal(tmp_path, segment_bytes=SEGMENT)
        index = tmp_path / "index"
        real = j._write_all

        def check(parts: list[bytes]) -> None:
            base = j.segments()[-1].base_offset
            on_disk = j._kinds.load_summary(base)
            assert on_disk is not None
            for part in parts[1::2]:
                assert declared_cover(on_disk, body_labels(part))
            real(parts)

        monkeypatch.setattr(j, "_write_all", check)
        rng = random.Random(7)
        for tag in range(60):
            j.commit([make_batch(rng, tag)])
        assert len(list(index.glob("*.kinds"))) == len(j.segments()) > 2
        j.close()

    def test_damaged_frames_are_skipped_as_by_a_full_read(self, tmp_path):
        j = write(tmp_path, random.Random(8), 80)
        j.close()
        sealed = tmp_path / segment_name(0)
        flip_byte(sealed, os.path.getsize(sealed) // 2)
        reopened = Journal(tmp_path, segment_bytes=SEGMENT)
        assert_index_agrees(reopened)
        assert reopened.damage()
        reopened.close()

    def test_retention_deletes_the_index_of_a_deleted_segment(self, tmp_path):
        j = write(tmp_path, random.Random(9), 80)
        before = len(j.segments())
        j.enforce_retention(SEGMENT * 2, 0)
        left = {f"{s.base_offset:020d}" for s in j.segments()}
        assert len(left) < before
        assert {f.stem for f in (tmp_path / "index").iterdir()} == left
        assert_index_agrees(j)
        j.close()

    def test_more_kinds_than_a_segment_can_name(self, tmp_path):
        j = Journal(tmp_path, segment_bytes=1 << 20)
        for i in range(80):
            b = BatchBuilder()
            b.add(f"p{i}", b"x", content_type=f"c{i}")
            j.commit([b.build()])
        for i in (0, 40, 79):
            assert [r.offset for r in j.read(0) if r.protocol == f"p{i}"] == [i]
            found = [
                r.offset
                for base, _c, body in j.read_batches(0, kind=Kind(f"p{i}"))
                for r in iter_batch(body, base, f"p{i}".encode())
            ]
            assert found == [i]
        j.close()


def _rebuilt(journal: Journal) -> int:
    text = journal.metrics.render().decode()
    for line in text.splitlines():
        if line.startswith("taproom_journal_index_rebuilt_segments_total "):
            return int(float(line.split()[1]))
    return 0


def test_a_long_run_of_one_kind_is_logged_now_and_then(tmp_path):
    """Groups that start no run are logged with the next chunk (at most every few MiB): the
    log stays small, and an open reads the frames it does not describe from the segment."""
    j = Journal(tmp_path, segment_bytes=64 << 20, fsync="off")
    b = BatchBuilder()
    b.add("lumberjack", b"x" * 1000, content_type="json")
    same = b.build()
    for _ in range(3000):  # 3 MB of one kind
        j.commit([same])
    e = BatchBuilder()
    e.add("eventbus", b"y", content_type="msgpack")
    j.commit([e.build()])
    for _ in range(10):
        j.commit([same])
    runs = tmp_path / "index" / f"{0:020d}.runs"
    assert os.path.getsize(runs) < 400, "a few chunks, not one per commit"
    assert_index_agrees(j)
    j.close()
    reopened = Journal(tmp_path, segment_bytes=64 << 20)
    assert _rebuilt(reopened) == 0
    assert by_kind(reopened, Kind("eventbus")) == ([3000], 1)
    assert_index_agrees(reopened)
    reopened.close()
