"""LogTK codec and state machines: the seed's and PEERS.md's byte sequences, splits, fuzz."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import taproom.protocols.logtk as logtk
import taproom.protocols.logtk.frames as frames_module
from taproom.eventtime import EventTimes
from taproom.payloads import decode_payload
from taproom.protocols.logtk import (
    Ack,
    AckReceived,
    Auth,
    AuthDenied,
    Authenticated,
    AuthFailed,
    ClientConnection,
    Close,
    CloseCode,
    CloseReceived,
    ConnectionDead,
    Data,
    FrameDecoder,
    Init,
    Initialized,
    LogTKError,
    OversizeData,
    Ping,
    PingTimeout,
    Pong,
    PongPolicy,
    Ready,
    ServerConnection,
    ServerSettings,
    State,
    Violation,
    decode_log_entry,
    decode_varuint32,
    encode_frame,
    encode_log_entry,
    encode_varuint32,
    time_reader,
)
from tests.support import fuzz_examples


def h(text: str) -> bytes:
    return bytes.fromhex(text.replace(" ", ""))


MALFORMED_CLOSE = h("00 01 fe 02 18 6d616c666f726d6564206672616d65207265636569766564 00")
INVALID_AUTH_CLOSE = h("00 01 ff 02 0c 696e76616c69642061757468 00")
CLIENT_INIT = h("02 01 70726f746f62756600 02 285db4ad 03 a708 04 01 00")
SERVER_INIT = h("02 01 70726f746f62756600 03 8768 04 01 00")
DATA = h("03 01 08 12345678deadbeef 02 3a7bd946 00")
ACK = h("04 01 3a7bd946 00")
# The seed's WebSocket header token: "This key is 64 bytes long and can have binary data in it"
# followed by 8 binary bytes.
TOKEN = base64.b64decode(
    "VGhpcyBrZXkgaXMgNjQgYnl0ZXMgbG9uZyBhbmQgY2FuIGhhdmUgYmluYXJ5IGRhdGEgaW4gaXTerb7vi63wDQ=="
)
SEED_AUTH_48 = h(
    "01 01 6c9f50a14f40475ee4f68398e819ba298579af0884441bfc486ae2bcd22c233cb5edb168be03bf7460"
    "a9b11a5d8da678 00"
)


def decode_all(data: bytes) -> list[object]:
    decoder = FrameDecoder()
    frames = decoder.feed(data)
    assert decoder.error is None, decoder.error
    assert decoder.buffered == 0
    return list(frames)


class TestFieldEncodingPeers:
    """PEERS.md: varuint32 is big-endian base-128; uint32 is 4 bytes big-endian."""

    @pytest.mark.parametrize(
        ("value", "wire"),
        [(5000, "a708"), (182, "8136"), (1000, "8768"), (0, "00"), (127, "7f"), (128, "8100")],
    )
    def test_varuint32(self, value, wire):
        assert encode_varuint32(value) == h(wire)
        assert decode_varuint32(h(wire)) == (value, len(h(wire)))

    def test_varuint32_bounds(self):
        assert decode_varuint32(encode_varuint32(0xFFFFFFFF))[0] == 0xFFFFFFFF
        with pytest.raises(LogTKError):
            decode_varuint32(h("9f ff ff ff 7f"))  # 35 bits
        with pytest.raises(LogTKError):
            decode_varuint32(h("81 81 81 81 81 01"))  # six bytes
        with pytest.raises(ValueError):
            encode_varuint32(1 << 32)


class TestSeedClose:
    def test_malformed_close(self):
        frame = Close(0xFE, "malformed frame received")
        assert decode_all(MALFORMED_CLOSE) == [frame]
        assert encode_frame(frame) == MALFORMED_CLOSE

    def test_normal_close_and_close_ack(self):
        assert decode_all(h("00 01 00 00")) == [Close(0)]
        assert encode_frame(Close(0)) == h("00 01 00 00")
        assert decode_all(h("00 00")) == [Close()]
        assert Close().is_ack and Close(0).wants_ack and not Close(0x80).wants_ack


class TestSeedAuth:
    def test_accept_and_deny(self):
        assert decode_all(h("01 02 01 00")) == [Auth(status=True)]
        assert encode_frame(Auth(status=True)) == h("01 02 01 00")
        assert encode_frame(Auth(status=False)) == h("01 02 00 00")
        assert decode_all(INVALID_AUTH_CLOSE) == [Close(0xFF, "invalid auth")]

    def test_token_is_64_bytes(self):
        wire = b"\x01\x01" + TOKEN + b"\x00"
        assert decode_all(wire) == [Auth(token=TOKEN)]
        assert encode_frame(Auth(token=TOKEN)) == wire
        assert "This key" not in repr(Auth(token=TOKEN))  # tokens never reach logs

    def test_decision_seed_48_byte_token_example_is_incomplete(self):
        """Decision: the field is byte(64), as the reference decoder reads it. The seed's
        48-byte examples are not whole frames: the decoder waits for 16 more bytes."""
        decoder = FrameDecoder()
        assert decoder.feed(SEED_AUTH_48) == []
        assert decoder.error is None and decoder.buffered == len(SEED_AUTH_48)
        # 15 more bytes complete the 64-byte token; the next byte must end the frame.
        frames = decoder.feed(bytes(15) + b"\x00")
        assert len(frames) == 1 and len(frames[0].token) == 64


class TestSeedInit:
    def test_client_and_server_examples(self):
        client = Init("protobuf", 0x285DB4AD, 5000, True)
        server = Init("protobuf", None, 1000, True)
        assert decode_all(CLIENT_INIT) == [client]
        assert decode_all(SERVER_INIT) == [server]
        assert encode_frame(client) == CLIENT_INIT
        assert encode_frame(server) == SERVER_INIT

    def test_decision_ping_interval_is_2500ms(self):
        """Decision: the formula max(5000, 1000)/2 = 2500 ms wins over the example's "every
        5 seconds" comment (the next comment of the seed says 2500 ms)."""
        conn = ServerConnection(ServerSettings(ping_min_delta_ms=1000), now=0, app="a")
        events = conn.receive_data(CLIENT_INIT, now=0)
        assert events == [Initialized("protobuf", 0x285DB4AD, 2500)]
        assert conn.data_to_send() == SERVER_INIT

    def test_no_ping_min_delta_example(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        events = conn.receive_data(h("02 01 70726f746f62756600 02 285db4ad 04 01 00"), now=0)
        assert [type(e) for e in events] == [Violation]
        assert conn.data_to_send() == MALFORMED_CLOSE
        assert conn.closed

    def test_reference_ws_client_init_without_delta_and_no_pings(self):
        """logtkjs over WebSocket sends ping_recv false and no ping_min_delta: accepted."""
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        init = encode_frame(Init("bson", 0xFFFFFFFF, None, False))
        assert conn.receive_data(init, now=0) == [Initialized("bson", 0xFFFFFFFF, 0)]
        assert decode_all(conn.data_to_send()) == [Init("bson", None, 1000, True)]
        assert conn.tick(100) == [] and conn.data_to_send() == b""  # no pings


class TestSeedDataAckPingPong:
    def test_data_and_ack(self):
        assert decode_all(DATA) == [Data(h("12345678deadbeef"), 0x3A7BD946)]
        assert encode_frame(Data(h("12345678deadbeef"), 0x3A7BD946)) == DATA
        assert decode_all(ACK) == [Ack(0x3A7BD946)]
        assert encode_frame(Ack(0x3A7BD946)) == ACK

    def test_decision_ack_example_arrows(self):
        """Decision: the ack section's arrows are reversed in the seed; data always flows
        client -> server and ack server -> client (the data section's example)."""
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        conn.receive_data(CLIENT_INIT, now=0)
        conn.data_to_send()
        (data,) = conn.receive_data(DATA, now=0)
        conn.ack([data.idem])
        assert conn.data_to_send() == ACK
        client = ClientConnection("ws", 1, now=0)
        client.receive_data(SERVER_INIT, now=0)
        client.data_to_send()
        assert client.receive_data(DATA, now=0) == []  # "If the client receives a data frame,
        # it SHOULD ignore it."

    def test_ping_pong(self):
        assert decode_all(h("80 01 deadbeef 00")) == [Ping(0xDEADBEEF)]
        assert decode_all(h("81 01 deadbeef 00")) == [Pong(0xDEADBEEF)]
        client = ClientConnection("ws", 1, now=0)
        client.receive_data(SERVER_INIT, now=0)
        client.data_to_send()
        client.receive_data(h("80 01 deadbeef 00"), now=1)
        assert client.data_to_send() == h("81 01 deadbeef 00")


ALL_EXAMPLES = [
    MALFORMED_CLOSE,
    h("00 01 00 00"),
    h("00 00"),
    b"\x01\x01" + TOKEN + b"\x00",
    h("01 02 01 00"),
    h("01 02 00 00"),
    INVALID_AUTH_CLOSE,
    CLIENT_INIT,
    SERVER_INIT,
    DATA,
    ACK,
    h("80 01 deadbeef 00"),
    h("81 01 deadbeef 00"),
]


class TestSplitFeeding:
    def test_whole_every_split_and_byte_by_byte(self):
        stream = b"".join(ALL_EXAMPLES)
        expected = decode_all(stream)
        assert len(expected) == len(ALL_EXAMPLES)
        for cut in range(len(stream) + 1):
            decoder = FrameDecoder()
            got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
            assert got == expected, cut
        decoder = FrameDecoder()
        got = []
        for i in range(len(stream)):
            got += decoder.feed(stream[i : i + 1])
        assert got == expected and decoder.error is None


class TestMalformedAndLimits:
    @pytest.mark.parametrize(
        ("wire", "reason"),
        [
            ("05 00", "unknown_frame_type"),
            ("03 07 00", "unknown_op"),
            ("03 02 00000001 00", "data_missing_field"),
            ("04 00", "missing_field"),
            ("00 02 02 ff fe 00", "bad_utf8"),
        ],
    )
    def test_malformed(self, wire, reason):
        decoder = FrameDecoder()
        assert decoder.feed(ACK + h(wire) + ACK) == [Ack(0x3A7BD946)]
        assert decoder.error is not None and decoder.error.reason == reason
        assert decoder.error.reply == Close(0xFE, "malformed frame received")
        assert decoder.feed(ACK) == []  # stays stopped

    def test_data_over_limit_before_buffering(self):
        decoder = FrameDecoder(max_frame_bytes=1000, max_data_bytes=100)
        assert decoder.feed(b"\x03\x01" + encode_varuint32(101)) == []
        assert decoder.error is not None and decoder.error.reason == "data_too_large"
        assert decoder.error.reply == Close(CloseCode.LIMIT, "limit exceeded")

    def test_unfinished_frame_over_limit(self):
        decoder = FrameDecoder(max_frame_bytes=64, max_data_bytes=64)
        assert decoder.feed(b"\x02\x01" + b"json") == []
        assert decoder.error is None
        # An init that repeats a field forever never ends: cut once over the frame limit.
        decoder = FrameDecoder(max_frame_bytes=100, max_data_bytes=100)
        decoder.feed(b"\x02" + b"\x03\x01" * 40)
        assert decoder.error is None and decoder.buffered == 81
        decoder.feed(b"\x03\x01" * 20)
        assert decoder.error is not None and decoder.error.reason == "frame_too_large"

    def test_format_cstring_bounded(self):
        decoder = FrameDecoder()
        decoder.feed(b"\x02\x01" + b"x" * 100)
        assert decoder.error is not None and decoder.error.reason == "bad_format"


class TestIncrementalDecoding:
    """Issue 19 item 11: an unfinished frame is read once, not again from its start on each
    read (a peer trickling a long frame cost the hub's loop 83-124 ms per byte)."""

    def test_each_op_of_an_unfinished_frame_is_read_once(self, monkeypatch):
        calls = 0
        read_varuint = frames_module._varuint

        def counting(buf, pos, end):
            nonlocal calls
            calls += 1
            return read_varuint(buf, pos, end)

        monkeypatch.setattr(frames_module, "_varuint", counting)
        ops = 1000  # init's ping_min_delta op repeated: legal, every value overwrites the last
        stream = b"\x02" + h("03 87 68") * ops + h("02 00000007 00")
        decoder = FrameDecoder()
        got: list[object] = []
        feeds = 0
        for i in range(0, len(stream), 2):
            got += decoder.feed(stream[i : i + 2])
            feeds += 1
        assert got == [Init(None, 7, 1000, None)] and decoder.error is None
        # Each op is read once, plus at most one unfinished attempt per read.
        assert calls <= ops + feeds

    def test_a_long_data_field_is_not_reparsed(self):
        decoder = FrameDecoder()
        frame = encode_frame(Data(bytes(range(256)) * 1000, 9))
        got: list[object] = []
        for i in range(0, len(frame), 1000):
            got += decoder.feed(frame[i : i + 1000])
            assert decoder.buffered <= i + 1000
        assert got == [Data(bytes(range(256)) * 1000, 9)]


class TestOversizeEntries:
    """Issue 17 item 6: on a server, an entry over max_data_bytes is cut, never fatal."""

    ENTRY = bytes(range(256)) * 40

    @pytest.mark.parametrize("step", [None, 1000, 7, 1])
    def test_cut_to_max_data_whatever_the_split(self, step):
        stream = encode_frame(Data(self.ENTRY, 9)) + encode_frame(Data(b"next", 10))
        decoder = FrameDecoder(max_frame_bytes=300, max_data_bytes=200, truncate_data=True)
        got: list[object] = []
        peak = 0
        step = step or len(stream)
        for i in range(0, len(stream), step):
            got += decoder.feed(stream[i : i + step])
            peak = max(peak, decoder.buffered)
        assert got == [OversizeData(self.ENTRY[:200], 9, len(self.ENTRY)), Data(b"next", 10)]
        assert decoder.error is None and peak <= 300  # the tail was never held

    def test_frame_limit_still_holds_after_a_cut(self):
        decoder = FrameDecoder(max_frame_bytes=300, max_data_bytes=200, truncate_data=True)
        decoder.feed(b"\x03\x01" + encode_varuint32(len(self.ENTRY)) + self.ENTRY)
        decoder.feed(h("02 00000001") * 30)  # repeated idem ops that never end the frame
        assert decoder.error is not None and decoder.error.reason == "frame_too_large"

    def test_server_connection_cuts_after_init_only(self):
        conn = ServerConnection(ServerSettings(max_data_bytes=100), now=0, app="a")
        conn.receive_data(encode_frame(Init("json", 1, None, False)), now=0)
        (event,) = conn.receive_data(encode_frame(Data(self.ENTRY, 3)), now=0)
        assert event == OversizeData(self.ENTRY[:100], 3, len(self.ENTRY))
        assert conn.unacked == 1 and not conn.closed
        # Before auth (TCP) nothing is cut: only the auth frame may come.
        conn = tcp_server(max_data_bytes=100)
        events = conn.receive_data(encode_frame(Data(self.ENTRY, 3)), now=0)
        assert conn.closed and [e.reason for e in events] == ["data_too_large"]


def tcp_server(**kw):
    settings = ServerSettings(**kw)
    tokens = {TOKEN: "myapp"}
    return ServerConnection(settings, now=0, authenticate=tokens.get)


class TestServerConnection:
    def test_seed_conversation_over_tcp(self):
        conn = tcp_server()
        assert conn.state is State.AUTH
        assert conn.receive_data(b"\x01\x01" + TOKEN + b"\x00", now=0) == [Authenticated("myapp")]
        assert conn.data_to_send() == h("01 02 01 00")
        assert conn.receive_data(CLIENT_INIT, now=0)[0].client_id == 0x285DB4AD
        assert conn.data_to_send() == SERVER_INIT
        data2 = encode_frame(Data(b"second", 7))
        events = conn.receive_data(DATA + data2, now=1)
        assert [e.idem for e in events] == [0x3A7BD946, 7]
        assert conn.unacked == 2
        conn.ack([0x3A7BD946, 7])
        conn.settled(2)
        assert conn.data_to_send() == ACK + h("04 01 00000007 00") and conn.unacked == 0
        # "close 0x80 client exiting": high bit set, no close-ack
        assert conn.receive_data(encode_frame(Close(0x80, "client exiting")), now=2) == [
            CloseReceived(0x80, "client exiting")
        ]
        assert conn.closed and conn.data_to_send() == b""

    def test_close_code_zero_gets_close_ack_and_nothing_after(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        conn.receive_data(CLIENT_INIT, now=0)
        conn.data_to_send()
        events = conn.receive_data(h("00 01 00 00") + DATA, now=0)
        assert events == [CloseReceived(0, None)]
        assert conn.data_to_send() == h("00 00")
        conn.ack([1])  # forbidden after a close: nothing goes out
        assert conn.data_to_send() == b""

    def test_server_close_waits_for_close_ack(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        conn.close(CloseCode.NORMAL, "bye")
        assert conn.state is State.CLOSING
        assert conn.receive_data(DATA, now=0) == []
        conn.receive_data(h("00 00"), now=0)
        assert conn.closed

    def test_invalid_auth(self):
        conn = tcp_server()
        events = conn.receive_data(b"\x01\x01" + bytes(64) + b"\x00" + CLIENT_INIT, now=0)
        assert events == [AuthFailed()]
        assert conn.data_to_send() == h("01 02 00 00") + INVALID_AUTH_CLOSE
        assert conn.closed

    @pytest.mark.parametrize("first", [DATA, CLIENT_INIT, h("81 01 00000001 00")])
    def test_frames_before_auth_close_invalid_auth(self, first):
        conn = tcp_server()
        events = conn.receive_data(first, now=0)
        assert events == [Violation("not_authenticated", events[0].message)]
        assert conn.data_to_send() == INVALID_AUTH_CLOSE and conn.closed

    def test_unfinished_frame_before_auth_is_bounded(self):
        # Issue 19 item 11: an unauthenticated peer gets room for the auth frame, no more.
        conn = tcp_server(max_auth_frame_bytes=100)
        events = conn.receive_data(b"\x01" + b"\x02\x01" * 30, now=0)
        assert events == [] and not conn.closed  # 61 bytes: could still become an auth frame
        events = conn.receive_data(b"\x02\x01" * 1000, now=0)
        assert [e.reason for e in events] == ["auth_frame_too_large"]
        assert conn.closed and conn.data_to_send() == INVALID_AUTH_CLOSE

    def test_frames_pipelined_after_auth_get_the_normal_bounds(self):
        conn = tcp_server(max_auth_frame_bytes=100)
        big = encode_frame(Data(bytes(5000), 1))
        events = conn.receive_data(b"\x01\x01" + TOKEN + b"\x00" + CLIENT_INIT + big, now=0)
        assert [type(e).__name__ for e in events] == ["Authenticated", "Initialized", "Data"]
        assert events[2] == Data(bytes(5000), 1)

    def test_auth_frames_after_auth_are_ignored(self):
        conn = tcp_server()
        conn.receive_data(b"\x01\x01" + TOKEN + b"\x00", now=0)
        conn.data_to_send()
        assert conn.receive_data(b"\x01\x01" + bytes(64) + b"\x00", now=0) == []
        assert conn.data_to_send() == b"" and conn.state is State.INIT

    def test_data_before_init(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        assert conn.receive_data(DATA, now=0) == [Violation("data_before_init", "data before init")]
        assert decode_all(conn.data_to_send()) == [Close(0xFE, "data before init")]

    def test_unknown_format_and_missing_id(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        conn.receive_data(encode_frame(Init("xml", 1, None, False)), now=0)
        assert decode_all(conn.data_to_send()) == [Close(0xFD, "unsupported format")]
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        conn.receive_data(encode_frame(Init("json", None, None, False)), now=0)
        assert conn.data_to_send() == MALFORMED_CLOSE

    def test_default_format_and_second_init_ignored(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        assert conn.receive_data(encode_frame(Init(None, 5, None, False)), now=0) == [
            Initialized("protobuf", 5, 0)
        ]
        conn.data_to_send()
        assert conn.receive_data(encode_frame(Init("json", 6, None, False)), now=0) == []
        assert conn.format == "protobuf" and conn.data_to_send() == b""

    def test_malformed_frame_after_good_data(self):
        conn = ServerConnection(ServerSettings(), now=0, app="a")
        conn.receive_data(CLIENT_INIT, now=0)
        conn.data_to_send()
        events = conn.receive_data(DATA + h("09 00"), now=0)
        assert isinstance(events[0], Data) and isinstance(events[1], Violation)
        assert conn.data_to_send() == MALFORMED_CLOSE

    def test_timeouts(self):
        conn = ServerConnection(ServerSettings(handshake_timeout_s=5), now=0, app="a")
        assert conn.tick(4.9) == []
        assert conn.tick(5.0)[0].reason == "handshake_timeout"
        assert decode_all(conn.data_to_send()) == [Close(0xFA, "handshake timeout")]
        conn = ServerConnection(ServerSettings(idle_timeout_s=30), now=0, app="a")
        conn.receive_data(encode_frame(Init("json", 1, None, False)), now=1)
        assert conn.tick(30) == []
        assert conn.tick(31.5)[0].reason == "idle_timeout"

    def test_transport_liveness_counts_as_activity(self):
        # Issue 17 item 1: an answered WebSocket ping keeps a quiet connection open.
        conn = ServerConnection(ServerSettings(idle_timeout_s=30), now=0, app="a")
        conn.receive_data(encode_frame(Init("json", 1, None, False)), now=1)
        for now in range(20, 200, 20):
            conn.alive(now)
            assert conn.tick(now + 10) == []
        assert conn.tick(180 + 30)[0].reason == "idle_timeout"  # the pongs stopped


def open_with_pings(policy: PongPolicy) -> ServerConnection:
    conn = ServerConnection(
        ServerSettings(pong_policy=policy, ping_min_delta_ms=1000), now=0, app="a"
    )
    conn.receive_data(encode_frame(Init("json", 1, 1000, True)), now=0)
    conn.data_to_send()
    assert conn.ping_interval_s == 0.5
    return conn


class TestPingPong:
    def test_always_two_missed_pongs_close(self):
        conn = open_with_pings(PongPolicy.ALWAYS)
        assert conn.tick(0.5) == [] and decode_all(conn.data_to_send()) == [Ping(1)]
        assert conn.tick(1.0) == [] and decode_all(conn.data_to_send()) == [Ping(2)]
        events = conn.tick(1.5)
        assert isinstance(events[0], PingTimeout)
        assert decode_all(conn.data_to_send()) == [Close(0xFB, "ping timeout")]

    def test_pong_resets(self):
        conn = open_with_pings(PongPolicy.ALWAYS)
        for i in range(1, 10):
            conn.tick(i * 0.5)
            (ping,) = decode_all(conn.data_to_send())
            conn.receive_data(encode_frame(Pong(ping.ackid)), now=i * 0.5)
        assert not conn.closed

    def test_decision_reference_client_that_never_pongs_is_tolerated(self):
        conn = open_with_pings(PongPolicy.AFTER_FIRST_PONG)
        for i in range(1, 20):
            assert conn.tick(i * 0.5) == []
        assert not conn.closed

    def test_after_first_pong_enforced(self):
        conn = open_with_pings(PongPolicy.AFTER_FIRST_PONG)
        conn.tick(0.5)
        conn.receive_data(encode_frame(Pong(1)), now=0.6)
        conn.tick(1.0)
        conn.tick(1.5)
        assert isinstance(conn.tick(2.0)[0], PingTimeout)

    def test_never(self):
        conn = open_with_pings(PongPolicy.NEVER)
        conn.tick(0.5)
        conn.receive_data(encode_frame(Pong(1)), now=0.6)
        for i in range(2, 10):
            assert conn.tick(i * 0.5) == []


def pump(client: ClientConnection, server: ServerConnection, now: float) -> list[object]:
    """Move bytes both ways until quiet; returns the client's events."""
    events: list[object] = []
    for _ in range(10):
        up = client.data_to_send()
        if up:
            server.receive_data(up, now)
        down = server.data_to_send()
        if down:
            events += client.receive_data(down, now)
        if not up and not down:
            break
    return events


class TestClientConnection:
    def test_tcp_handshake_data_ack(self):
        client = ClientConnection("tcp", 42, now=0, token=TOKEN, format="json")
        server = tcp_server()
        events = pump(client, server, 0)
        assert events == [Ready("json", 500)] and server.client_id == 42
        client.send(9, b"{}")
        received = server.receive_data(client.data_to_send(), 0)
        assert received == [Data(b"{}", 9)]
        server.ack([9])
        assert client.receive_data(server.data_to_send(), 0) == [AckReceived((9,))]

    def test_tcp_auth_denied(self):
        client = ClientConnection("tcp", 42, now=0, token=bytes(64))
        events = pump(client, tcp_server(), 0)
        assert events == [AuthDenied(), CloseReceived(0xFF, "invalid auth")]
        assert client.closed

    def test_client_pongs_and_detects_dead_server(self):
        client = ClientConnection("ws", 1, now=0, format="json")
        server = ServerConnection(ServerSettings(pong_policy=PongPolicy.ALWAYS), now=0, app="a")
        pump(client, server, 0)
        for i in range(1, 10):
            server.tick(i * 0.5)
            pump(client, server, i * 0.5)
        assert not server.closed and server.ever_ponged
        assert client.tick(5.0) == []
        assert client.tick(6.1) == [ConnectionDead()]

    def test_server_close_wanting_ack_gets_one(self):
        client = ClientConnection("ws", 1, now=0, format="json")
        server = ServerConnection(ServerSettings(), now=0, app="a")
        pump(client, server, 0)
        server.close(CloseCode.NORMAL, "bye")
        assert pump(client, server, 0) == [CloseReceived(0, "bye")]
        assert server.closed and client.closed


# --- fuzz -----------------------------------------------------------------------------------

frames = st.one_of(
    st.builds(Close, st.none() | st.integers(0, 255), st.none() | st.text(max_size=20)),
    st.builds(Auth, st.none() | st.binary(min_size=64, max_size=64), st.none() | st.booleans()),
    st.builds(
        Init,
        st.none() | st.text(st.characters(min_codepoint=1, max_codepoint=127), max_size=10),
        st.none() | st.integers(0, 0xFFFFFFFF),
        st.none() | st.integers(0, 0xFFFFFFFF),
        st.none() | st.booleans(),
    ),
    st.builds(Data, st.binary(max_size=300), st.integers(0, 0xFFFFFFFF)),
    st.builds(Ack, st.integers(0, 0xFFFFFFFF)),
    st.builds(Ping, st.integers(0, 0xFFFFFFFF)),
    st.builds(Pong, st.integers(0, 0xFFFFFFFF)),
)


@settings(
    max_examples=fuzz_examples(5_000, 200_000),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.lists(frames, max_size=6), st.integers(0, 10_000))
def test_fuzz_round_trip_any_split(items, cut):
    wire = b"".join(encode_frame(f) for f in items)
    cut %= len(wire) + 1
    decoder = FrameDecoder()
    assert decoder.feed(wire[:cut]) + decoder.feed(wire[cut:]) == items
    assert decoder.error is None and decoder.buffered == 0


@settings(
    max_examples=fuzz_examples(20_000, 200_000),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_never_crash(data):
    """Random input gives frames and/or a documented LogTKError, or waits; never anything
    else. The server machine stays consistent whatever comes in."""
    decoder = FrameDecoder(max_frame_bytes=128, max_data_bytes=64)
    decoder.feed(data)
    assert decoder.error is None or isinstance(decoder.error, LogTKError)
    assert decoder.buffered <= 128
    conn = ServerConnection(
        ServerSettings(max_frame_bytes=128, max_data_bytes=64),
        now=0,
        authenticate={TOKEN: "a"}.get,
    )
    for event in conn.receive_data(data, now=0):
        assert isinstance(event, Data | Violation | Authenticated | AuthFailed | CloseReceived)
    conn.data_to_send()


# --- payload formats ------------------------------------------------------------------------


def _entry_class():
    """LogEntry built by the protobuf runtime from a descriptor matching logtk_entry.proto."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fdp = descriptor_pb2.FileDescriptorProto(
        name="taproom_test_logtk_entry.proto", package="taproom.logtk", syntax="proto3"
    )
    F = descriptor_pb2.FieldDescriptorProto
    trace = fdp.message_type.add(name="Trace")
    trace.field.add(name="file", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    trace.field.add(name="line", number=2, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    trace.field.add(name="col", number=3, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    entry = fdp.message_type.add(name="LogEntry")
    entry.field.add(name="time", number=1, type=F.TYPE_UINT64, label=F.LABEL_OPTIONAL)
    entry.field.add(
        name="trace",
        number=2,
        type=F.TYPE_MESSAGE,
        type_name=".taproom.logtk.Trace",
        label=F.LABEL_OPTIONAL,
    )
    entry.field.add(name="level", number=3, type=F.TYPE_UINT32, label=F.LABEL_OPTIONAL)
    entry.field.add(name="message", number=4, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    fields_entry = entry.nested_type.add(name="FieldsEntry")
    fields_entry.options.map_entry = True
    fields_entry.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    fields_entry.field.add(name="value", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    entry.field.add(
        name="fields",
        number=5,
        type=F.TYPE_MESSAGE,
        type_name=".taproom.logtk.LogEntry.FieldsEntry",
        label=F.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("taproom.logtk.LogEntry"))


class TestLogEntry:
    def test_proto_file_ships_beside_the_module(self):
        text = (Path(logtk.__file__).parent / "logtk_entry.proto").read_text()
        for line in ("uint64 time = 1;", "Trace trace = 2;", "uint32 level = 3;"):
            assert line in text
        assert "string message = 4;" in text and "map<string, string> fields = 5;" in text

    def test_hand_codec_agrees_with_protobuf_runtime(self):
        cls = _entry_class()
        ours = encode_log_entry(
            time_ms=1_700_000_000_123,
            level=40,
            message="disk full ✓",
            trace={"file": "app.py", "line": 12, "col": 3},
            fields={"logger": "db", "thread": "main"},
        )
        parsed = cls.FromString(ours)
        assert parsed.time == 1_700_000_000_123 and parsed.level == 40
        assert parsed.message == "disk full ✓" and parsed.trace.file == "app.py"
        assert parsed.trace.line == 12 and dict(parsed.fields) == {"logger": "db", "thread": "main"}
        theirs = cls(time=5, level=20, message="hi", fields={"k": "v"})
        theirs.trace.file = "x.js"
        theirs.trace.line = 7
        decoded = decode_payload("protobuf", theirs.SerializeToString())
        assert decoded == {
            "time": 5,
            "level": 20,
            "message": "hi",
            "trace": {"file": "x.js", "line": 7, "col": 0},
            "fields": {"k": "v"},
        }

    def test_malformed_protobuf_shown_not_fatal(self):
        with pytest.raises(ValueError):
            decode_log_entry(b"\x0a\x05ab")
        assert decode_payload("protobuf", b"\x0a\x05\xffb") == {"base64": "CgX/Yg=="}


def test_bson_reference_record_decodes():
    import datetime

    import bson

    record = {
        "$level": 3,
        "$message": "hello",
        "$time": datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.UTC),
        "$trace": {"file": "index.js", "line": 10, "col": 2},
        "blob": b"\x00\x01",
    }
    decoded = decode_payload("bson", bson.encode(record))
    assert decoded["$message"] == "hello" and decoded["$level"] == 3
    assert decoded["$time"] == "2024-01-02T03:04:05+00:00"
    assert decoded["$trace"] == {"file": "index.js", "line": 10, "col": 2}
    assert decoded["blob"] == {"base64": "AAE="}


def logtkjs_bson(doc: dict[str, object]) -> bytes:
    """A flat document as logtkjs writes BSON (its lib/format.js, as PEERS.md describes it):
    right total size, but a string's length prefix is JavaScript's ``length + 1``, in UTF-16
    code units, while its bytes are UTF-8. Strings, ints, doubles and dates only."""
    import datetime

    body = b""
    for key, value in doc.items():
        name = key.encode() + b"\x00"
        if isinstance(value, str):
            units = len(value.encode("utf-16-le")) // 2
            body += b"\x02" + name + struct.pack("<I", units + 1) + value.encode() + b"\x00"
        elif isinstance(value, datetime.datetime):
            ms = int(value.timestamp() * 1000)
            body += b"\x09" + name + struct.pack("<q", ms)
        elif isinstance(value, float):
            body += b"\x01" + name + struct.pack("<d", value)
        else:
            assert isinstance(value, int)
            body += b"\x10" + name + struct.pack("<i", value)
    return struct.pack("<I", len(body) + 5) + body + b"\x00"


class TestLogtkjsBson:
    """Issue 25: logtkjs's BSON with non-ASCII text is invalid BSON (UTF-16 string lengths);
    taproom reads it as logtkjs meant it, so its time is read and tail shows it."""

    WHEN_MS = 1_795_464_988_673

    def _doc(self) -> bytes:
        import datetime

        when = datetime.datetime.fromtimestamp(self.WHEN_MS / 1000, datetime.UTC)
        return logtkjs_bson(
            {"$message": "héllo wörld ✓ 😀", "$time": when, "$level": 6, "n": "ascii"}
        )

    def test_strict_bson_refuses_it(self):
        import bson

        with pytest.raises(bson.errors.InvalidBSON):
            bson.decode(self._doc())

    def test_its_time_is_read(self):
        assert time_reader("bson")(self._doc(), EventTimes()) == self.WHEN_MS * 10**6

    def test_tail_shows_it(self):
        decoded = decode_payload("bson", self._doc())
        assert decoded == {
            "$message": "héllo wörld ✓ 😀",
            "$time": "2026-11-23T20:16:28.673000+00:00",
            "$level": 6,
            "n": "ascii",
        }

    def test_a_length_that_is_neither_bytes_nor_code_units_is_refused(self):
        doc = bytearray(self._doc())
        at = doc.index(b"h\xc3\xa9llo") - 4
        doc[at : at + 4] = struct.pack("<I", 5)  # too short for either reading
        assert decode_payload("bson", bytes(doc)) == {"base64": base64.b64encode(doc).decode()}

    def test_the_12_byte_entry_that_hung_the_hub(self):
        """A string element of length -7 sent the old walker back to the same element
        forever (issue 25, part 2): now it is refused at once and the entry has no time."""
        entry = bytes.fromhex("0c000000026100f9ffffff00")
        assert time_reader("bson")(entry, EventTimes()) == 0
        assert isinstance(decode_payload("bson", entry), dict | str)


class TestEventTime:
    """Issue 17 item 3: records get ``ts_ns`` from the entry's own time field."""

    NS = 1_795_464_988_673_000_000  # 2026-11-23T20:16:28.673Z

    def test_protobuf_time_field_is_milliseconds(self):
        entry = encode_log_entry(time_ms=self.NS // 10**6, level=6, message="hi")
        assert time_reader("protobuf")(entry, EventTimes()) == self.NS
        # field 1 anywhere among the others, as a protobuf writer may order them
        later = encode_log_entry(message="hi") + encode_log_entry(time_ms=self.NS // 10**6)
        assert time_reader("protobuf")(later, EventTimes()) == self.NS

    def test_bson_time_as_logtkjs_writes_it(self):
        import datetime

        import bson

        when = datetime.datetime(2026, 11, 23, 20, 16, 28, 673000, tzinfo=datetime.UTC)
        record = {
            "user": "x" * 300,
            "$level": {"level": 6, "repr": "info"},
            "$message": "hello",
            "$time": when,
            "$trace": {"file": "index.js", "line": 10, "col": 2},
        }
        assert time_reader("bson")(bson.encode(record), EventTimes()) == self.NS
        assert (
            time_reader("bson")(bson.encode({"$time": self.NS // 10**6}), EventTimes()) == self.NS
        )

    @pytest.mark.parametrize(
        "payload",
        [
            b'{"$time": "2026-11-23T20:16:28.673Z", "time": 5}',
            b'{"time": "2026-11-23T22:16:28.673+02:00"}',
            b'{"timestamp": "2026-11-23T20:16:28.673"}',
            b'{"@timestamp": 1795464988.673}',
            b'{"ts": 1795464988673}',
            b'{"ts": 1795464988673000}',
            b'{"ts": 1795464988673000000}',
            # logtkjs's "json" format: pretty-printed JavaScript, a Date as [Date: ...]
            b'{ "$level": { "level": 6,\n    "repr": "info" },\n  "$message": "hello",\n'
            b'  "$time": [Date: 2026-11-23T20:16:28.673Z] }\n',
        ],
    )
    def test_json_time_fields(self, payload):
        assert time_reader("json")(payload, EventTimes()) == self.NS

    def test_json_seconds(self):
        assert time_reader("json")(b'{"time": 1795464988}', EventTimes()) == 1_795_464_988 * 10**9

    @pytest.mark.parametrize(
        ("content_type", "payload"),
        [
            ("json", b'{"message": "no time"}'),
            ("json", b'{"time": true}'),
            ("json", b'{"time": "yesterday"}'),
            ("json", b'[{"time": 1795464988}]'),
            ("json", b'{"nested": {"time": 1795464988}}'),
            ("json", b"not json, time"),
            ("bson", b"\x05\x00\x00\x00"),
            ("bson", b"\xff\xff\xff\x7f\x09$ti"),
            ("protobuf", b"\x08"),
            ("protobuf", encode_log_entry(message="no time")),
            ("kv", b'{"time": 1795464988}'),
        ],
    )
    def test_no_readable_time_is_zero(self, content_type, payload):
        assert time_reader(content_type)(payload, EventTimes()) == 0

    def test_a_time_before_1970_is_a_time(self):
        assert time_reader("json")(b'{"time": -5}', EventTimes()) == -5 * 10**9

    @pytest.mark.parametrize(
        ("content_type", "payload"),
        [
            ("json", b'{"$time": "2426-01-01T00:00:00Z"}'),
            ("json", b'{"time": 1e30}'),
            ("json", b'{"ts": 18446744073709551615}'),
            ("protobuf", encode_log_entry(time_ms=2**62)),
            ("protobuf", b"\x08" + b"\xff" * 9 + b"\x01"),  # 2^64-1 ms
        ],
    )
    def test_a_time_the_journal_cannot_hold_is_absent_and_counted(self, content_type, payload):
        times = EventTimes()
        assert time_reader(content_type)(payload, times) == 0
        assert times.take() == 1

    def test_bson_times_out_of_range(self):
        import datetime

        import bson

        times = EventTimes()
        year_9999 = datetime.datetime(9999, 1, 1, tzinfo=datetime.UTC)
        assert time_reader("bson")(bson.encode({"$time": year_9999}), times) == 0
        assert time_reader("bson")(bson.encode({"$time": 2**62}), times) == 0
        assert times.take() == 2

    @settings(max_examples=fuzz_examples(200, 5000), deadline=None)
    @given(content_type=st.sampled_from(["json", "bson", "protobuf"]), payload=st.binary())
    def test_never_raises(self, content_type, payload):
        ts_ns = time_reader(content_type)(payload, EventTimes())
        assert -(2**63) <= ts_ns < 2**63
