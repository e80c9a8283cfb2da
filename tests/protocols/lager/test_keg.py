"""protocols/lager/keg.py: the seed's keg layout, finishing, and recovery of unfinished kegs."""

from __future__ import annotations

import struct
import uuid
from pathlib import Path

import numpy as np
import pytest

from taproom.cli import main as taproom_main
from taproom.protocols.lager.formats import FormatError, parse_format_xml
from taproom.protocols.lager.keg import (
    HEADER_SIZE,
    KegError,
    KegFileWriter,
    read_keg,
    sidecar_path,
)
from tests.protocols.lager.nasa_peer import (
    check_keg_xml,
    read_keg_like_lagr2hdf5,
    write_unfinished_keg,
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


class TestNasaLagerKegs:
    """Kegs as nasa/lager's programs write and read them."""

    ITEMS_A = (
        '<item name="uint1" offset="0" size="4" type="uint32_t"/>'
        '<item name="double1" offset="4" size="8" type="float64"/>'
    )
    ITEMS_B = '<item name="short1" offset="0" size="2" type="int16_t"/>'

    def write_real_unfinished(self, path: Path, n: int) -> None:
        records = []
        for i in range(n):
            records.append((str(U1), 1000 + i, struct.pack(">Id", i, i / 4)))
            records.append((str(U2), 2000 + i, struct.pack(">h", -i)))
        write_unfinished_keg(
            path, {str(U1): ("/R/A/", self.ITEMS_A), str(U2): ("/R/B/", self.ITEMS_B)}, records
        )

    def test_unfinished_real_keg_is_recovered(
        self, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        path = tmp_path / "20240101_120000.lgr"
        self.write_real_unfinished(path, 50)
        assert path.read_bytes()[:10] == bytes(10)  # version 0, offset 0
        keg = read_keg(path)
        assert keg.recovered_unfinished and keg.dropped_bytes == 0 and keg.version == 0
        assert keg.counts() == {str(U1): 50, str(U2): 50}
        assert {u: f.key for u, f in keg.formats.items()} == {str(U1): "/R/A/", str(U2): "/R/B/"}
        a = keg.table(str(U1))
        assert a["uint1"].tolist() == list(range(50)) and a["double1"][7] == 7 / 4
        assert keg.table(str(U2))["short1"].tolist() == [-i for i in range(50)]
        assert taproom_main(["keg", "verify", str(path)]) == 1
        out = capsys.readouterr().out
        assert "unfinished (recovered from sidecar)" in out and "version" not in out

    def test_torn_last_sidecar_document(self, tmp_path: Path) -> None:
        path = tmp_path / "t.lgr"
        self.write_real_unfinished(path, 3)
        with open(sidecar_path(path), "ab") as f:  # killed while appending another copy
            f.write(b'<?xml version="1.0" encoding="UTF-8" standalone="no" ?><keg><formats><for')
        keg = read_keg(path)
        assert keg.recovered_unfinished and keg.record_count == 6

    def test_finished_taproom_keg_reads_with_lagr2hdf5_rules(self, tmp_path: Path) -> None:
        fa = parse_format_xml(f'<format version="BEERR01">{self.ITEMS_A}</format>')
        path = tmp_path / "one.lgr"
        with KegFileWriter(path, {str(U1): fa.with_key("/R/A/")}, {"notes": "x"}) as w:
            for i in range(100):
                w.write(U1.bytes, 5000 + i, fa.encode_row({"uint1": i, "double1": i * 1.5}))
        check_keg_xml(path.read_bytes()[struct.unpack(">Q", path.read_bytes()[2:10])[0] :])
        columns, timestamps = read_keg_like_lagr2hdf5(path)
        assert columns == {
            "uint1|/R/A/": list(range(100)),
            "double1|/R/A/": [i * 1.5 for i in range(100)],
        }
        assert timestamps == [5000 + i for i in range(100)]

    def test_two_tap_taproom_keg_reads_with_lagr2hdf5_rules(self, tmp_path: Path) -> None:
        fa = parse_format_xml(f'<format version="BEERR01">{self.ITEMS_A}</format>')
        fb = parse_format_xml(f'<format version="BEERR01">{self.ITEMS_B}</format>')
        path = tmp_path / "two.lgr"
        with KegFileWriter(path, {str(U1): fa, str(U2): fb.with_key("/R/B/")}) as w:
            for i in range(40):
                w.write(U1.bytes, i, fa.encode_row({"uint1": i, "double1": 0.5}))
                w.write(U2.bytes, i, fb.encode_row({"short1": -i}))
        columns, _ = read_keg_like_lagr2hdf5(path)
        # The script stops once fewer bytes than one row of *every* format are left: the rows it
        # does read are taproom's, in order.
        shorts = columns["short1|/R/B/"]
        assert len(shorts) >= 38 and shorts == [-i for i in range(len(shorts))]
        assert columns[f"uint1|{U1}"] == list(range(len(columns[f"uint1|{U1}"])))
