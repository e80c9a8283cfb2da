"""protocols/lager/keg.py: the seed's keg layout, finishing, and recovery of unfinished kegs."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import numpy as np
import pytest

from taproom.protocols.lager.formats import FormatError, parse_format_xml
from taproom.protocols.lager.keg import (
    HEADER_SIZE,
    KegError,
    KegFileWriter,
    read_keg,
    sidecar_path,
)

F8 = parse_format_xml(
    '<format version="BEERR01"><item name="x" type="double" size="8" offset="0"/></format>'
)
F5 = parse_format_xml(
    '<format version="BEERR01"><item name="n" type="uint32_t" size="4" offset="1"/>'
    '<item name="ok" type="bool" size="1" offset="0"/></format>'
)
U1, U2 = uuid.UUID(int=1), uuid.UUID(int=2)


def write_two_taps(path: Path, n: int) -> KegFileWriter:
    w = KegFileWriter(path, {str(U1): F8}, {"notes": "test"}, fsync=False)
    w.add_format(U2.bytes, F5)
    for i in range(n):
        w.write(U1.bytes, 1000 + i, F8.encode_row({"x": i / 2}))
        w.write(U2.bytes, 2000 + i, F5.encode_row({"n": i, "ok": i % 2 == 0}))
    return w


class TestLayout:
    def test_header_records_and_trailer_follow_the_seed(self, tmp_path: Path) -> None:
        path = tmp_path / "a.lgr"
        write_two_taps(path, 1).close()
        blob = path.read_bytes()
        version, offset = struct.unpack(">HQ", blob[:10])
        assert version == 1
        assert blob[10:26] == U1.bytes and struct.unpack(">Q", blob[26:34])[0] == 1000
        assert struct.unpack(">d", blob[34:42])[0] == 0.0
        assert blob[42:58] == U2.bytes and blob[66:71] == b"\x01\0\0\0\0"
        assert offset == 71 and blob[offset:].startswith(b"<?xml")
        assert not Path(sidecar_path(path)).exists()

    def test_read_finished(self, tmp_path: Path) -> None:
        path = tmp_path / "a.lgr"
        write_two_taps(path, 100).close()
        keg = read_keg(path)
        assert not keg.recovered_unfinished and keg.dropped_bytes == 0
        assert keg.record_count == 200 and keg.metadata == {"notes": "test"}
        assert keg.counts() == {str(U1): 100, str(U2): 100}
        t1 = keg.table(str(U1))
        assert t1["timestamp_ns"].tolist() == list(range(1000, 1100))
        assert t1["x"].tolist() == [i / 2 for i in range(100)]
        t2 = keg.table(str(U2))
        assert t2["n"].tolist() == list(range(100)) and t2["ok"][:3].tolist() == [True, False, True]
        rows = list(keg.rows())
        assert rows[3] == (str(U2), 2001, {"ok": False, "n": 1})

    def test_write_many_same_stride(self, tmp_path: Path) -> None:
        path = tmp_path / "m.lgr"
        with KegFileWriter(path, {str(U1): F8, str(U2): F8}, fsync=False) as w:
            ts = np.arange(5000, dtype=np.uint64)
            w.write_many(U1.bytes, ts, np.arange(5000, dtype=">f8").tobytes())
            w.write(U2.bytes, 9, F8.encode_row({"x": 1.0}))
        keg = read_keg(path)
        assert keg.record_count == 5001
        assert keg.table(str(U1))["x"].tolist() == list(map(float, range(5000)))
        assert keg.table(str(U2))["timestamp_ns"].tolist() == [9]

    def test_same_row_size_different_layouts(self, tmp_path: Path) -> None:
        pair = parse_format_xml(
            '<format version="BEERR01"><item name="hi" type="uint32" size="4" offset="0"/>'
            '<item name="lo" type="int32" size="4" offset="4"/></format>'
        )
        path = tmp_path / "s.lgr"
        with KegFileWriter(path, {str(U1): F8, str(U2): pair}, fsync=False) as w:
            for i in range(50):
                w.write(U1.bytes, i, F8.encode_row({"x": i + 0.5}))
                w.write(U2.bytes, 100 + i, pair.encode_row({"hi": i, "lo": -i}))
        keg = read_keg(path)
        assert keg.table(str(U1))["x"].tolist() == [i + 0.5 for i in range(50)]
        t2 = keg.table(str(U2))
        assert t2["lo"].tolist() == [-i for i in range(50)]
        assert t2["timestamp_ns"].tolist() == list(range(100, 150))

    def test_wrong_row_size_refused(self, tmp_path: Path) -> None:
        w = KegFileWriter(tmp_path / "w.lgr", {str(U1): F8}, fsync=False)
        with pytest.raises(Exception, match="8"):
            w.write(U1.bytes, 1, b"1234")
        with pytest.raises(KegError):
            w.write(U2.bytes, 1, b"12345678")
        with pytest.raises(FormatError, match="u64"):
            w.write(U1.bytes, -1, b"12345678")
        w.close()


class TestRecovery:
    @pytest.mark.parametrize("extra", [0, 1, 23, 24, 30])
    def test_unfinished_keg_recovered_up_to_last_whole_record(
        self, tmp_path: Path, extra: int
    ) -> None:
        path = tmp_path / "u.lgr"
        w = write_two_taps(path, 50)
        w.abandon()  # the writer "dies": header never patched, sidecar left behind
        whole = path.stat().st_size
        with open(path, "ab") as f:
            f.write(U1.bytes[: min(extra, 16)] + bytes(max(0, extra - 16)))
        keg = read_keg(path)
        assert keg.recovered_unfinished
        assert keg.record_count == 100
        assert keg.dropped_bytes == path.stat().st_size - whole
        assert (keg.problem != "") == (extra > 0)
        assert keg.table(str(U2))["n"].tolist() == list(range(50))

    def test_every_truncation_point(self, tmp_path: Path) -> None:
        path = tmp_path / "t.lgr"
        write_two_taps(path, 3).abandon()
        blob = path.read_bytes()
        sizes = [24 + 8, 24 + 5] * 3
        for cut in range(HEADER_SIZE, len(blob) + 1):
            path.write_bytes(blob[:cut])
            keg = read_keg(path)
            whole, pos = 0, HEADER_SIZE
            for s in sizes:
                if pos + s > cut:
                    break
                whole, pos = whole + 1, pos + s
            assert keg.record_count == whole, cut
            assert keg.dropped_bytes == cut - pos

    def test_unfinished_without_sidecar_is_an_error(self, tmp_path: Path) -> None:
        path = tmp_path / "n.lgr"
        write_two_taps(path, 1).abandon()
        Path(sidecar_path(path)).unlink()
        with pytest.raises(KegError, match="sidecar"):
            read_keg(path)

    def test_garbage_record_stops_the_walk(self, tmp_path: Path) -> None:
        path = tmp_path / "g.lgr"
        write_two_taps(path, 2).abandon()
        with open(path, "ab") as f:
            f.write(uuid.UUID(int=99).bytes + bytes(40))
        keg = read_keg(path)
        assert keg.record_count == 4 and "unknown" in keg.problem and keg.dropped_bytes == 56

    def test_bad_headers(self, tmp_path: Path) -> None:
        path = tmp_path / "b.lgr"
        path.write_bytes(b"\0\1")
        with pytest.raises(KegError, match="shorter"):
            read_keg(path)
        path.write_bytes(struct.pack(">HQ", 9, 0))
        with pytest.raises(KegError, match="version"):
            read_keg(path)
        path.write_bytes(struct.pack(">HQ", 1, 999))
        with pytest.raises(KegError, match="outside"):
            read_keg(path)
