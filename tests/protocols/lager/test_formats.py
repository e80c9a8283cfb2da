"""protocols/lager/formats.py: the seed's "Data Formats" rules, row codecs, round trips."""

from __future__ import annotations

import math
import struct
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom.protocols.lager.formats import (
    TYPES,
    DataFormat,
    FormatError,
    Item,
    keg_xml,
    parse_format_xml,
    parse_keg_xml,
)
from tests.protocols.lager.nasa_peer import XsdError, check_format_xml, check_keg_xml

SAMPLE_ITEMS = """
            <item name="uint1" offset="0" size="4" type="uint32_t"/>
            <item name="int1" offset="4" size="4" type="int32_t"/>
            <item name="double1" offset="8" size="8" type="float64"/>
            <item name="ushort1" offset="16" size="2" type="uint16_t"/>
            <item name="short1" offset="18" size="2" type="int16_t"/>
            <item name="ubyte1" offset="20" size="1" type="uint8_t"/>
            <item name="byte1" offset="21" size="1" type="int8_t"/>
            <item name="float1" offset="22" size="4" type="float32"/>"""
SAMPLE_FORMAT = (
    f'<?xml version="1.0" encoding="UTF-8"?>\n<format version="BEERR01">{SAMPLE_ITEMS}\n</format>'
)
SAMPLE_KEG = f"""<?xml version="1.0" encoding="UTF-8" standalone="no" ?>
<keg>
    <formats>
        <format uuid="72657b2f-4c2d-4cde-a37f-a961a45ee559" version="BEERR01">{SAMPLE_ITEMS}
        </format>
    </formats>
    <metadata>
        <meta key="notes" value="Ran a test with some parameters"/>
    </metadata>
</keg>"""


def fmt(*items: str, version: str = "BEERR01") -> str:
    return f'<format version="{version}">' + "".join(items) + "</format>"


def item(name: str = "a", type: str = "uint8", size: object = 1, offset: object = 0) -> str:
    return f'<item name="{name}" type="{type}" size="{size}" offset="{offset}"/>'


class TestNasaSchema:
    """What nasa/lager's Mug accepts (data_format.xsd with Xerces, Val_Always) and its keg tools
    read (keg_schema.xsd, lagr2hdf5.py): the rules are in tests/protocols/lager/nasa_peer.py."""

    ALL_TYPES = fmt(
        item("a", "uint32", 4, 0),
        item("b", "double", 8, 4),
        item("c", "int8_t", 1, 12),
        item("d", "float32[3]", 12, 13),
        item("e", "bool", 1, 25),
        item("f", "string", 6, 26),
        item("g", "uint64", 8, 32),
    )

    def test_the_checker_refuses_what_xerces_refuses(self) -> None:
        with pytest.raises(XsdError, match="missing required attribute 'key'"):
            check_format_xml(fmt(item()))  # the seed's form (taproom's old output)
        for bad in (
            '<format key="/k/" version="BEERR01" group="x">' + item() + "</format>",
            '<format key="/k/" version="BEERR0100">' + item() + "</format>",
            '<format key="/k/" version="BEERR01"></format>',
            '<format key="/k/" version="BEERR01"><item name="a" type="u" size="-1" '
            'offset="0"/></format>',
            '<format key="/k/" version="BEERR01">x' + item() + "</format>",
        ):
            with pytest.raises(XsdError):
                check_format_xml(bad)

    def test_registration_xml_as_nasa_lager_writes_it(self) -> None:
        f = parse_format_xml(self.ALL_TYPES)
        xml = f.to_xml(key="/RobotA/Arm/")
        check_format_xml(xml)
        assert xml.startswith(
            '<?xml version="1.0" encoding="UTF-8" standalone="no" ?>'
            '<format key="/RobotA/Arm/" version="BEERR01">'
            '<item name="a" offset="0" size="4" type="uint32_t"/>'
            '<item name="b" offset="4" size="8" type="float64"/>'
            '<item name="c" offset="12" size="1" type="int8_t"/>'
        )
        types = [i.get("type") for i in ET.fromstring(xml)]
        assert types == ["uint32_t", "float64", "int8_t", "float32", "bool", "string", "uint64_t"]
        again = parse_format_xml(xml)
        assert again.key == "/RobotA/Arm/" and again.with_key("") == f
        assert again.decode_row(again.encode_row({"a": 1, "b": 2.5, "c": -3, "d": (1, 2, 3),
            "e": True, "f": "hi", "g": 5})) == f.decode_row(f.encode_row({"a": 1, "b": 2.5,
            "c": -3, "d": (1, 2, 3), "e": True, "f": "hi", "g": 5}))  # fmt: skip

    def test_keg_xml_has_key_uuid_and_version(self) -> None:
        u = "72657b2f-4c2d-4cde-a37f-a961a45ee559"
        f = parse_format_xml(self.ALL_TYPES)
        for metadata in ({}, {"notes": "<&>"}):
            text = keg_xml({u: f.with_key("/R/T/")}, metadata)
            check_keg_xml(text)
            formats, meta = parse_keg_xml(text)
            assert formats[u].key == "/R/T/" and meta == metadata
        check_keg_xml(keg_xml({u: f}))  # no key known: the uuid names the tap
        assert parse_keg_xml(keg_xml({u: f}))[0][u].key == u
        with pytest.raises(XsdError, match="'key'"):
            check_keg_xml(SAMPLE_KEG)  # the seed's sample has no key: nasa/lager refuses it


class TestSeedSample:
    def test_sample_keg_format(self) -> None:
        formats, metadata = parse_keg_xml(SAMPLE_KEG)
        assert metadata == {"notes": "Ran a test with some parameters"}
        f = formats["72657b2f-4c2d-4cde-a37f-a961a45ee559"]
        assert f.row_size == 26
        assert f.names == [
            "uint1",
            "int1",
            "double1",
            "ushort1",
            "short1",
            "ubyte1",
            "byte1",
            "float1",
        ]
        row = struct.pack(">Iid", 7, -8, 2.25) + struct.pack(
            ">HhBbf", 65535, -32768, 255, -128, 1.5
        )
        assert f.decode_row(row) == {
            "uint1": 7, "int1": -8, "double1": 2.25, "ushort1": 65535, "short1": -32768,
            "ubyte1": 255, "byte1": -128, "float1": 1.5,
        }  # fmt: skip

    def test_registration_form_and_round_trip(self) -> None:
        f = parse_format_xml(SAMPLE_FORMAT)
        assert parse_format_xml(f.to_xml()) == f
        formats, _ = parse_keg_xml(
            keg_xml({"72657b2f-4c2d-4cde-a37f-a961a45ee559": f}, {"k": "<&>"})
        )
        assert next(iter(formats.values())).items == f.items

    def test_cpp_and_lager_spellings_agree(self) -> None:
        for cpp, lager in [("uint32_t", "uint32"), ("double", "float64"), ("float", "float32"),
                           ("int64_t", "int64"), ("std::string", "string")]:  # fmt: skip
            assert TYPES[cpp] is TYPES[lager]


class TestSchemaRules:
    @pytest.mark.parametrize(
        ("xml", "reason", "words"),
        [
            (fmt(item(), version="BEERR01X9"), "bad_version", "longer than 8"),
            (fmt(item(), version="BEERR02"), "bad_version", "BEERR02"),
            ('<format><item name="a" type="uint8" size="1" offset="0"/></format>', "missing_attribute", "version"),
            (fmt('<item type="uint8" size="1" offset="0"/>'), "missing_attribute", "'name'"),
            (fmt('<item name="a" size="1" offset="0"/>'), "missing_attribute", "'type'"),
            (fmt('<item name="a" type="uint8" offset="0"/>'), "missing_attribute", "'size'"),
            (fmt('<item name="a" type="uint8" size="1"/>'), "missing_attribute", "'offset'"),
            (fmt(item(type="uint128", size=16)), "unknown_type", "uint128"),
            (fmt(item(type="uint32", size=3)), "bad_size", "multiple"),
            (fmt(item(type="uint32", size=0)), "bad_size", "at least 1"),
            (fmt(item(type="uint32", size=-4)), "bad_size", "non-negative"),
            (fmt(item(type="uint32[3]", size=8)), "bad_size", "needs size 12"),
            (fmt(item(offset=-1)), "bad_offset", "non-negative"),
            (fmt(item(offset="x")), "bad_offset", "non-negative"),
            (fmt(item("a", "uint32", 4, 0), item("b", "uint16", 2, 2)), "overlap", "'b'"),
            (fmt(item("a", "uint32", 4, 0), item("b", "uint16", 2, 5)), "outside_row", "'b'"),
            (fmt(item("a", "uint8", 1, 1)), "outside_row", "'a'"),
            (fmt(item("a"), item("a", offset=1)), "duplicate_name", "'a'"),
            (fmt(), "no_items", "at least one"),
            ("<format version='BEERR01'><item", "xml_malformed", "parse"),
            ("<keg/>", "bad_root", "<keg>"),
            (fmt("<thing/>"), "bad_element", "thing"),
            ('<!DOCTYPE x [<!ENTITY a "aaaa">]>' + fmt(item()), "xml_forbidden", "DOCTYPE"),
            (fmt(item(name="&a;")), "xml_malformed", "parse"),
        ],
    )  # fmt: skip
    def test_rule(self, xml: str, reason: str, words: str) -> None:
        with pytest.raises(FormatError) as info:
            parse_format_xml(xml)
        assert info.value.reason == reason
        assert words in str(info.value)

    def test_size_is_bounded_before_parsing(self) -> None:
        big = fmt(*(item(f"i{n}", offset=n) for n in range(3000)))
        with pytest.raises(FormatError) as info:
            parse_format_xml(big, max_bytes=10_000)
        assert info.value.reason == "xml_too_large"
        with pytest.raises(FormatError) as info:
            parse_format_xml(big, max_bytes=1 << 20, max_items=100)
        assert info.value.reason == "too_many_items"

    def test_billion_laughs_refused_without_expansion(self) -> None:
        bomb = (
            '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol">'
            + "".join(
                f'<!ENTITY lol{i} "{"&lol" + str(i - 1) + ";" if i else "&lol;"}' * 10 + '">'
                for i in range(1, 9)
            )
            + ']><format version="BEERR01"><item name="&lol8;" type="uint8" size="1" offset="0"/></format>'
        )
        with pytest.raises(FormatError) as info:
            parse_format_xml(bomb)
        assert info.value.reason == "xml_forbidden"

    def test_valid_variants(self) -> None:
        f = parse_format_xml(
            fmt(item("s", "string", 5, 13), item("arr", "float32", 12, 1), item("b", "bool", 1, 0),
                item("v", "uint16[2]", 4, 18))
        )  # fmt: skip
        assert f.row_size == 22
        values = {"s": "héy", "arr": (1.0, 2.5, -3.0), "b": True, "v": (1, 65535)}
        row = f.encode_row(values)
        assert f.decode_row(row) == values
        cols = f.decode_rows([row, row])
        assert cols["arr"].shape == (2, 3) and cols["arr"][1, 1] == 2.5
        assert cols["s"].tolist() == ["héy", "héy"] and cols["b"].tolist() == [True, True]

    def test_encode_errors(self) -> None:
        f = parse_format_xml(fmt(item("s", "string", 2, 0), item("n", "uint8", 1, 2)))
        with pytest.raises(FormatError, match="'s'"):
            f.encode_row({"s": "abc", "n": 1})
        with pytest.raises(FormatError, match="'n'"):
            f.encode_row({"s": "a"})
        with pytest.raises(FormatError) as info:
            f.encode_row({"s": "a", "n": 256})
        assert info.value.reason == "bad_value"
        with pytest.raises(FormatError) as info:
            f.decode_row(b"\0" * 4)
        assert info.value.reason == "payload_size"


# --- property tests: random formats and values round-trip -----------------------------------

_SCALARS = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
            "float32", "float64", "string"]  # fmt: skip


def _value(tname: str, size: int) -> st.SearchStrategy[object]:
    if tname == "bool":
        return st.booleans()
    if tname.startswith(("int", "uint")):
        bits = int(tname.lstrip("uint"))
        signed = not tname.startswith("u")
        lo, hi = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
        return st.integers(lo, hi)
    if tname == "float32":
        return st.floats(width=32, allow_nan=False)
    if tname == "float64":
        return st.floats(allow_nan=False)
    return st.text(st.characters(codec="utf-8", exclude_characters="\0"), max_size=size).filter(
        lambda s: len(s.encode()) <= size
    )


@st.composite
def formats_and_rows(draw: st.DrawFn) -> tuple[DataFormat, list[dict[str, object]]]:
    n = draw(st.integers(1, 12))
    specs = []
    for i in range(n):
        tname = draw(st.sampled_from(_SCALARS))
        count = 1 if tname == "string" else draw(st.integers(1, 4))
        size = draw(st.integers(1, 16)) if tname == "string" else TYPES[tname].size * count
        specs.append((f"f{i}", tname, count, size))
    order = draw(st.permutations(range(n)))
    offset, items = 0, []
    for idx in order:
        name, tname, count, size = specs[idx]
        items.append(Item(name, TYPES[tname], size, offset, count))
        offset += size
    shuffled = draw(st.permutations(items))
    f = DataFormat.from_items(shuffled)
    rows = []
    for _ in range(draw(st.integers(1, 4))):
        row: dict[str, object] = {}
        for name, tname, count, size in specs:
            if tname == "string" or count == 1:
                row[name] = draw(_value(tname, size))
            else:
                row[name] = tuple(draw(_value(tname, size)) for _ in range(count))
        rows.append(row)
    return f, rows


def _same(a: object, b: object, tname: str) -> bool:
    if tname == "float32":
        return bool(np.float32(a) == np.float32(b)) or (math.isinf(float(a)) and a == b)  # type: ignore[arg-type]
    return a == b


@settings(max_examples=400)
@given(formats_and_rows())
def test_round_trip_random_formats(case: tuple[DataFormat, list[dict[str, object]]]) -> None:
    f, rows = case
    again = parse_format_xml(f.to_xml())
    assert again == f
    encoded = [f.encode_row(r) for r in rows]
    assert all(len(e) == f.row_size for e in encoded)
    columns = f.decode_rows(encoded)
    for i, (row, raw) in enumerate(zip(rows, encoded, strict=True)):
        decoded = f.decode_row(raw)
        for it in f.items:
            want, got = row[it.name], decoded[it.name]
            if it.is_array:
                assert all(_same(w, g, it.type.name) for w, g in zip(want, got, strict=True))  # type: ignore[call-overload]
                assert [float(x) for x in columns[it.name][i]] == [float(x) for x in got]
            else:
                assert _same(want, got, it.type.name)
                col = columns[it.name][i]
                assert (col.item() if hasattr(col, "item") else col) == got or _same(
                    col, got, it.type.name
                )


@settings(max_examples=2000)
@given(st.binary(max_size=300) | st.text(max_size=300))
def test_random_xml_gives_format_error_or_format(blob: bytes | str) -> None:
    try:
        parse_format_xml(blob)
    except FormatError as exc:
        assert exc.reason


def test_identical_formats_parse_once_and_errors_repeat() -> None:
    xml = fmt(item("a", "uint32", 4, 0))
    assert parse_format_xml(xml) is parse_format_xml(xml.encode())
    for _ in range(2):
        with pytest.raises(FormatError, match="overlap"):
            parse_format_xml(fmt(item("a", "uint32", 4, 0), item("b", "uint8", 1, 3)))
    with pytest.raises(FormatError) as info:
        parse_format_xml(xml, max_items=0)  # the item limit is part of the cache key
    assert info.value.reason == "too_many_items"
