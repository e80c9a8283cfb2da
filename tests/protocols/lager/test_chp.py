"""protocols/lager/chp.py and messages.py: registration frames, the hashmap, data messages."""

from __future__ import annotations

import struct
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.errors import ProtocolError
from taproom.protocols.lager.chp import (
    ChpError,
    Command,
    Registrar,
    decode_sequence,
    encode_sequence,
    hugz_frames,
    kthxbai_frames,
    parse_registration,
    parse_snapshot_request,
    parse_update,
    registration_frames,
    valid_key,
)
from taproom.protocols.lager.formats import FormatError
from taproom.protocols.lager.messages import (
    DataMessage,
    MessageError,
    check_row_header,
    parse_data_message,
)
from tests.support import fuzz_examples

XML = '<format version="BEERR01"><item name="a" type="uint8" size="1" offset="0"/></format>'
U1, U2 = uuid.UUID(int=1).bytes, uuid.UUID(int=2).bytes


class TestRegistration:
    @pytest.mark.parametrize(
        ("key", "ok"),
        [("/RobotA/MotionController/", True), ("/a/b/c/", True), ("/sample_format", True),
         ("/a/", True), ("a/b/", True), ("/a//b/", True), ("/a b/c/", True), ("x" * 255, True),
         ("", False), ("/a\x00b/", False), ("/a\nb/", False), ("/a\x7f/", False),
         ("HUGZ", False), ("KTHXBAI", False), ("ICANHAZ?", False), ("x" * 256, False)],
    )  # fmt: skip
    def test_keys(self, key: str, ok: bool) -> None:
        assert valid_key(key) is ok
        frames = registration_frames(key, U1, XML)
        if ok:
            assert parse_registration(frames).key == key
        else:
            with pytest.raises(ChpError) as info:
                parse_registration(frames)
            assert info.value.reason == "bad_key"

    @pytest.mark.parametrize(
        ("frames", "reason"),
        [
            ([b"/a/b/", bytes(8), U1, b""], "frame_count"),
            ([b"/a/b/", bytes(7), U1, b"", XML.encode()], "bad_sequence"),
            ([b"/a/b/", bytes(8), U1[:15], b"", XML.encode()], "bad_uuid"),
            ([b"/a/b/", bytes(8), U1, b"", b"\xff"], "xml_malformed"),
            ([b"/a/b/", bytes(8), U1, b"", b"<format/>"], "missing_attribute"),
            ([b"/\xff/b/", bytes(8), U1, b"", XML.encode()], "bad_key"),
        ],
    )
    def test_malformed(self, frames: list[bytes], reason: str) -> None:
        with pytest.raises(ProtocolError) as info:
            parse_registration(frames)
        assert info.value.reason == reason

    def test_cpp_double_sequence_and_properties_ignored(self) -> None:
        reg = parse_registration([b"/a/b/", struct.pack("=d", 3.0), U1, b"x=1", XML.encode()])
        assert reg.uuid == U1 and reg.format.row_size == 1


class TestSequenceEncoding:
    """nasa/lager's registrar and client exchange the sequence as a host-order C++ double; the
    ØMQ Guide's kvmsg (and the seed's text) use 8 big-endian bytes. taproom speaks the former."""

    @pytest.mark.parametrize("n", [0, 1, 127, 128, 240, 255, 256, 65_535, 1 << 40])
    def test_host_order_double(self, n: int) -> None:
        assert encode_sequence(n) == struct.pack("=d", float(n))
        assert decode_sequence(encode_sequence(n)) == n
        if n >= 128:
            assert encode_sequence(n) != n.to_bytes(8, "big")

    def test_descriptions_and_kthxbai_carry_it(self) -> None:
        reg = parse_registration(registration_frames("/n/a/", U1, XML)).with_sequence(240)
        assert reg.frames()[1] == encode_sequence(240)
        assert kthxbai_frames(240)[1] == encode_sequence(240)
        assert hugz_frames()[1] == bytes(8) == encode_sequence(0)
        update = parse_update(reg.frames())
        assert update.sequence == 240

    @pytest.mark.parametrize(
        "frame",
        [bytes(7), bytes(9)]
        + [struct.pack("=d", bad) for bad in (-1.0, 0.5, float("inf"), float("nan"), 2.0**60)],
    )
    def test_refuses_what_is_not_a_count(self, frame: bytes) -> None:
        with pytest.raises(ChpError) as info:
            decode_sequence(frame)
        assert info.value.reason == "bad_sequence"


class TestRegistrar:
    def test_duplicates_refused_and_repeats_are_no_change(self) -> None:
        r = Registrar(max_taps=2)
        a = parse_registration(registration_frames("/n/a/", U1, XML))
        assert r.check(a) is True
        assert r.apply(a).sequence == 1
        assert r.check(a) is False
        with pytest.raises(ChpError) as info:
            r.check(parse_registration(registration_frames("/n/a/", U2, XML)))
        assert info.value.reason == "duplicate_key"
        with pytest.raises(ChpError) as info:
            r.check(parse_registration(registration_frames("/n/other/", U1, XML)))
        assert info.value.reason == "duplicate_uuid"
        r.apply(parse_registration(registration_frames("/m/b/", U2, XML)))
        with pytest.raises(ChpError) as info:
            r.check(parse_registration(registration_frames("/z/c/", uuid.uuid4().bytes, XML)))
        assert info.value.reason == "too_many_taps"

    def test_snapshot_subtree_and_restore(self) -> None:
        r = Registrar()
        for i, key in enumerate(["/RobotA/Motion/", "/RobotA/Arm/", "/RobotB/Motion/"]):
            r.apply(parse_registration(registration_frames(key, uuid.UUID(int=i + 1).bytes, XML)))
        assert [e.key for e in r.snapshot()] == [
            "/RobotA/Arm/",
            "/RobotA/Motion/",
            "/RobotB/Motion/",
        ]
        assert [e.key for e in r.snapshot("/RobotA/")] == ["/RobotA/Arm/", "/RobotA/Motion/"]
        assert r.snapshot("/RobotC") == []
        again = Registrar()
        again.restore(r.snapshot())
        assert again.sequence == 3 and again.snapshot() == r.snapshot()

    def test_update_frames_round_trip(self) -> None:
        r = Registrar()
        stored = r.apply(parse_registration(registration_frames("/n/a/", U1, XML)))
        up = parse_update(stored.frames())
        assert up.command is None and up.sequence == 1 and up.registration == stored
        assert parse_update(kthxbai_frames(7)) == parse_update(
            [b"KTHXBAI", struct.pack("=d", 7.0), b"", b"", b""]
        )
        assert parse_update(kthxbai_frames(7)).sequence == 7
        assert parse_update(hugz_frames()).command is Command.HUGZ

    def test_snapshot_request(self) -> None:
        assert parse_snapshot_request([b"ICANHAZ?", b"/a/"]) == "/a/"
        assert parse_snapshot_request([b"ICANHAZ?"]) == ""
        for bad in ([b"GIMME", b""], [b"ICANHAZ?", b"", b""], [b"ICANHAZ?", b"\xff"]):
            with pytest.raises(ChpError):
                parse_snapshot_request(bad)


class TestDataMessage:
    def test_seed_layout_round_trip(self) -> None:
        msg = DataMessage(U1, 123456789, b"\x01\x02", flags=3)
        frames = msg.frames()
        assert [len(f) for f in frames] == [16, 2, 2, 8, 2] and frames[2] == b"\0\3"
        assert parse_data_message(frames) == msg

    def test_cpp_form_accepted(self) -> None:
        frames = [U1, b"BEERR01", b"\x00", (5).to_bytes(8, "big"), b"\x01", b"\x02\x03"]
        msg = parse_data_message(frames)
        assert msg.payload == b"\x01\x02\x03" and msg.version == b"BEERR01" and msg.ts_ns == 5

    @pytest.mark.parametrize(
        ("frames", "reason"),
        [
            ([U1, b"\1\0", b"\0\0", bytes(8)], "frame_count"),
            ([U1[:4], b"\1\0", b"\0\0", bytes(8), b""], "bad_uuid"),
            ([U1, b"", b"\0\0", bytes(8), b""], "bad_version"),
            ([U1, b"\1\0", b"\0\0\0", bytes(8), b""], "bad_flags"),
            ([U1, b"\1\0", b"\0\0", bytes(4), b""], "bad_timestamp"),
            ([U1, b"\1\0", b"\0\0", bytes(8)] + [b"x"] * 2000, "frame_count"),
        ],
    )
    def test_malformed(self, frames: list[bytes], reason: str) -> None:
        with pytest.raises(MessageError) as info:
            parse_data_message(frames)
        assert info.value.reason == reason

    @pytest.mark.parametrize(
        ("version", "flags", "reason"),
        [
            (b"BEERR01", b"\x00", None),  # nasa/lager's Tap: the format's version, uint8_t flags
            (b"\x01\x00", b"\x00\x00", None),  # the seed's: version 1.0, 2 bytes of flags
            (b"\x01\x02", b"\x00\x05", None),  # a minor version only adds
            (b"BEERR99", b"\x00", "bad_version"),
            (b"BEERR0", b"\x00", "bad_version"),
            (b"\x02\x00", b"\x00\x00", "bad_version"),
            (b"BEERR01", b"\x00\x00", "bad_flags"),
            (b"\x01\x00", b"\x00", "bad_flags"),
        ],
    )
    def test_row_header_against_the_format(
        self, version: bytes, flags: bytes, reason: str | None
    ) -> None:
        """Issue 28: the version and flags frames are checked as a registration's version is:
        a row whose header is not its format's was journaled and forwarded."""
        if reason is None:
            check_row_header(version, flags, "BEERR01")
            return
        with pytest.raises(MessageError) as info:
            check_row_header(version, flags, "BEERR01")
        assert info.value.reason == reason


_frame = st.binary(max_size=40) | st.sampled_from([U1, bytes(8), b"/a/b/", XML.encode(), b""])


@settings(max_examples=fuzz_examples(4_000, 200_000))
@given(st.lists(_frame, max_size=7))
def test_fuzz_decoders_raise_only_protocol_errors(frames: list[bytes]) -> None:
    for decode in (parse_registration, parse_data_message, parse_update):
        try:
            decode(frames)
        except (ProtocolError, FormatError):
            pass
    try:
        parse_snapshot_request(frames)
    except ChpError:
        pass
