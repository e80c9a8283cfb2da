"""Stored payloads rendered for people (``taproom tail``) and outputs: dates carry their zone."""

from __future__ import annotations

import datetime

import bson
import msgpack
import orjson

from taproom.payloads import decode_payload
from taproom.records import Record

WHEN = datetime.datetime(2026, 11, 23, 20, 16, 28, 673000, tzinfo=datetime.UTC)


class TestDatesCarryTheirZone:
    """Issue 17 item 4: a BSON date is UTC; printing it without a zone made it local time to
    every reader."""

    def test_bson_date(self):
        decoded = decode_payload("bson", bson.encode({"$time": WHEN, "$message": "hi"}))
        assert decoded == {"$time": "2026-11-23T20:16:28.673000+00:00", "$message": "hi"}

    def test_bson_date_outside_pythons_range_is_shown_not_fatal(self):
        raw = bson.encode({"$time": bson.DatetimeMS(-(10**15))})
        assert decode_payload("bson", raw) == {"$time": "DatetimeMS(-1000000000000000)"}

    def test_msgpack_timestamp(self):
        packed = msgpack.packb({"t": msgpack.Timestamp.from_datetime(WHEN), "x": 1})
        decoded = decode_payload("msgpack", packed)
        assert decoded == {"t": "2026-11-23T20:16:28.673000+00:00", "x": 1}

    def test_msgpack_extension_types_are_shown(self):
        packed = msgpack.packb([msgpack.ExtType(5, b"\x01\x02")])
        assert decode_payload("msgpack", packed) == [{"ext": 5, "base64": "AQI="}]

    def test_tail_line(self):
        # What `taproom tail` prints for a logtkjs BSON entry.
        record = Record("logtk", content_type="bson", payload=bson.encode({"$time": WHEN}))
        line = orjson.dumps(record.to_json_dict())
        assert b'"$time":"2026-11-23T20:16:28.673000+00:00"' in line
