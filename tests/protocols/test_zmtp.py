"""protocols/zmtp: ZMTP 3.x greeting, handshake, frames, and the frame scanner (Python and its C
twin ``zt_scan`` / ``zt_take``) fed whole, split at every offset and one byte at a time."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom import zmqburst
from taproom.protocols import zmtp as zp
from taproom.protocols.zmtp.wire import ScanStatus
from tests.support import fuzz_examples

BIG = 1 << 20


def client_greeting(major=3, minor=1, mechanism=b"NULL", padding=bytes(8)):
    return (
        b"\xff" + padding + b"\x7f" + bytes((major, minor)) + mechanism.ljust(20, b"\x00")
        + b"\x00" + bytes(31)
    )  # fmt: skip


def ready(socket_type=b"DEALER", **extra):
    props = {b"Socket-Type": socket_type, **{k.encode(): v for k, v in extra.items()}}
    return zp.encode_command(b"READY", zp.encode_metadata(props))


class TestGreeting:
    def test_round_trip(self):
        g = zp.Greeting(3, 1, b"NULL", True)
        data = g.serialize()
        assert len(data) == zp.GREETING_SIZE
        assert zp.Greeting.parse(data) == g

    def test_libzmq_padding_is_accepted(self):
        # libzmq puts its routing-id length + 1 in the padding
        g = zp.Greeting.parse(client_greeting(padding=(1).to_bytes(8, "big")))
        assert (g.major, g.minor, g.mechanism, g.as_server) == (3, 1, b"NULL", False)

    @pytest.mark.parametrize(
        ("data", "reason"),
        [
            (client_greeting(major=2), "bad_version"),
            (b"\x01\x00" + client_greeting()[2:], "bad_greeting"),  # ZMTP 1.0: a length
            (client_greeting()[:9] + b"\x00" + client_greeting()[10:], "bad_greeting"),
        ],
    )
    def test_refused(self, data, reason):
        with pytest.raises(zp.ZmtpError) as info:
            zp.Greeting.parse(data)
        assert info.value.reason == reason


def feed(hs, data, step):
    out = b""
    for i in range(0, len(data), step):
        out += hs.receive_data(data[i : i + step])
        if hs.done:
            rest = data[i + step :]
            return out, hs.leftover + rest
    return out, b""


class TestHandshake:
    """23/ZMTP "The NULL Security Mechanism" and "The Socket Type property"."""

    def test_null_ready_whole_split_and_bytewise(self):
        traffic = zp.encode_message([b"a", b"b"])
        data = client_greeting() + ready(b"DEALER", Identity=b"agent-1") + traffic
        results = set()
        for step in (len(data), 1, 7, 63, 64, 65):
            hs = zp.Handshake(b"ROUTER")
            assert hs.initial[:10] == b"\xff" + bytes(8) + b"\x7f"
            out, leftover = feed(hs, data, step)
            assert hs.peer == zp.Peer(
                b"DEALER",
                b"agent-1",
                1,
                {b"socket-type": b"DEALER", b"identity": b"agent-1"},
            )
            results.add((out, leftover))
        # our READY is sent once the peer's greeting is in, whatever the split
        assert results == {(ready(b"ROUTER"), traffic)}

    def test_split_at_every_offset(self):
        data = client_greeting(minor=0) + ready(b"PUSH")
        for cut in range(1, len(data)):
            hs = zp.Handshake(b"PULL")
            hs.receive_data(data[:cut])
            assert not hs.done
            hs.receive_data(data[cut:])
            assert hs.peer is not None and hs.peer.minor == 0

    @pytest.mark.parametrize(
        ("ours", "theirs"),
        [(b"ROUTER", b"PUB"), (b"PULL", b"PULL"), (b"SUB", b"PUSH"), (b"ROUTER", b"")],
    )
    def test_incompatible_socket_types_are_refused(self, ours, theirs):
        hs = zp.Handshake(ours)
        with pytest.raises(zp.ZmtpError) as info:
            hs.receive_data(client_greeting() + ready(theirs))
        assert info.value.reason == "socket_type"
        assert hs.greeted  # an ERROR can be sent

    def test_compatible_pairs(self):
        for ours, theirs in [
            (b"ROUTER", b"DEALER"), (b"ROUTER", b"REQ"), (b"ROUTER", b"ROUTER"),
            (b"PULL", b"PUSH"), (b"SUB", b"PUB"), (b"SUB", b"XPUB"),
        ]:  # fmt: skip
            hs = zp.Handshake(ours)
            hs.receive_data(client_greeting() + ready(theirs))
            assert hs.done

    @pytest.mark.parametrize(
        ("data", "reason"),
        [
            (client_greeting(mechanism=b"PLAIN"), "mechanism"),
            (client_greeting(mechanism=b"CURVE"), "mechanism"),
            (client_greeting() + zp.encode_frame(b"data"), "bad_handshake"),
            (client_greeting() + zp.encode_command(b"HELLO"), "bad_handshake"),
            (client_greeting() + zp.error_command("go away"), "peer_error"),
            (client_greeting() + b"\x04\x03\x05ab", "bad_command"),
            (client_greeting() + zp.encode_command(b"READY", b"\x05Socket"), "bad_metadata"),
            (client_greeting() + b"\x06" + (1 << 40).to_bytes(8, "big"), "handshake_too_large"),
        ],
    )
    def test_broken_handshakes(self, data, reason):
        with pytest.raises(zp.ZmtpError) as info:
            zp.Handshake(b"ROUTER").receive_data(data)
        assert info.value.reason == reason

    def test_handshake_bytes_are_bounded(self):
        hs = zp.Handshake(b"ROUTER", max_bytes=512)
        with pytest.raises(zp.ZmtpError) as info:
            hs.receive_data(client_greeting() + ready(Identity=b"x" * 255, Padding=b"y" * 400))
        assert info.value.reason == "handshake_too_large"


class TestCommands:
    def test_ping_pong_echoes_the_context(self):
        ping = zp.ping_command(30, b"ctx")
        name, data = zp.parse_command(ping[2:])
        assert (name, data) == (b"PING", b"\x00\x1ectx")
        assert zp.pong_command(data) == zp.encode_command(b"PONG", b"ctx")

    def test_subscriptions_by_version(self):
        assert zp.subscribe_message(b"t", 1) == zp.encode_command(b"SUBSCRIBE", b"t")
        assert zp.subscribe_message(b"t", 1, cancel=True) == zp.encode_command(b"CANCEL", b"t")
        assert zp.subscribe_message(b"t", 0) == b"\x00\x02\x01t"
        assert zp.subscribe_message(b"t", 0, cancel=True) == b"\x00\x02\x00t"

    def test_long_frames(self):
        body = b"x" * 300
        frame = zp.encode_frame(body, zp.Flag.MORE)
        assert frame[:9] == b"\x03" + (300).to_bytes(8, "big")
        assert zp.encode_frame(b"x" * 255)[:2] == b"\x00\xff"


# --- the scanner --------------------------------------------------------------------------------


def _c():
    ffi, lib = zmqburst._FFI, zmqburst._LIB
    if lib is None:
        pytest.fail(f"the compiled module is not usable: {zmqburst.ext_status()}")
    return ffi, lib


def scan_c(buf, pos, end, complete, partial, max_message, max_command):
    ffi, lib = _c()
    res = ffi.new("zt_scanned *")
    cbuf = ffi.from_buffer("unsigned char[]", buf)
    lib.zt_scan(cbuf, pos, end, complete, partial, max_message, max_command, res)
    return zp.Scan(
        ScanStatus(res.status),
        res.pos,
        res.complete,
        res.messages,
        res.partial,
        res.want,
        res.body,
        res.size,
    )


def take_c(buf, pos, complete, max_messages, max_frames, max_bytes, prefix):
    ffi, lib = _c()
    res = ffi.new("zt_taken *")
    cap = 2 * len(buf) + 64 * (len(prefix or b"") + 1) + 64
    out = ffi.new("char[]", cap)
    ends = ffi.new("size_t[]", cap)
    counts = ffi.new("int[]", cap)
    lib.zt_take(
        ffi.from_buffer("unsigned char[]", buf),
        pos,
        complete,
        prefix if prefix is not None else ffi.NULL,
        len(prefix or b""),
        max_frames,
        max_messages,
        max_bytes,
        out,
        cap,
        ends,
        cap,
        counts,
        res,
    )
    data = ffi.buffer(out, res.bytes)[:]
    edges = [0, *ffi.unpack(ends, res.frames)]
    frames = [data[a:b] for a, b in itertools.pairwise(edges)]
    messages = []
    for count in ffi.unpack(counts, res.messages):
        kept = min(count, max_frames)
        messages.append((count, frames[:kept]))
        frames = frames[kept:]
    return res.pos, messages, res.bytes


SCANNERS = {"py": zp.scan, "ext": scan_c}
TAKERS = {"py": zp.take, "ext": take_c}


def walk(kind, stream, chunks, max_message=BIG, max_command=255):
    """Feed ``stream`` to the scanner in ``chunks`` as a connection does: (messages taken,
    commands seen, the status it ended on)."""
    scan, take = SCANNERS[kind], TAKERS[kind]
    buf = bytearray()
    start = pos = complete = partial = 0
    taken, commands = [], []
    for chunk in chunks:
        buf += chunk
        while True:
            r = scan(bytes(buf), pos, len(buf), complete, partial, max_message, max_command)
            pos, complete, partial = r.pos, r.complete, r.partial
            if r.status == ScanStatus.COMMAND:
                commands.append(bytes(buf[r.body : r.body + r.size]))
                pos = r.body + r.size
                if not partial and complete == r.pos:
                    complete = pos
                continue
            if r.status != ScanStatus.NEED:
                return taken, commands, r.status
            break
        mark, got, _ = take(bytes(buf), start, complete, 1 << 30, 64, 1 << 40, None)
        taken += got
        start = mark
    return taken, commands, ScanStatus.NEED


messages_st = st.lists(
    st.lists(st.binary(max_size=300), min_size=1, max_size=5), min_size=1, max_size=8
)


def stream_of(messages, pings):
    out = b""
    for k, message in enumerate(messages):
        if k < len(pings) and pings[k]:
            out += zp.ping_command(10, b"%d" % k)
        out += zp.encode_message(message)
    return out


class TestScanner:
    @pytest.mark.parametrize("kind", ["py", "ext"])
    def test_whole_split_everywhere_and_bytewise(self, kind):
        messages = [[b"a", b"x" * 300, b""], [b"b"], [b"c" * 256, b"d"]]
        stream = stream_of(messages, [True, False, True])
        expected = [(len(m), m) for m in messages]
        pings = [zp.parse_command(zp.ping_command(10, b"0")[2:]), None]
        assert walk(kind, stream, [stream])[:2] == (
            expected,
            [zp.ping_command(10, b"0")[2:], zp.ping_command(10, b"2")[2:]],
        )
        assert pings[0][0] == b"PING"
        for cut in range(1, len(stream)):
            assert walk(kind, stream, [stream[:cut], stream[cut:]])[0] == expected
        assert walk(kind, stream, [stream[i : i + 1] for i in range(len(stream))])[0] == expected

    @pytest.mark.parametrize("kind", ["py", "ext"])
    def test_a_message_over_the_bound_is_refused_at_its_header(self, kind):
        # 40 x 1 MiB frames flagged MORE: only the headers (and the first frames) are here
        head = b"\x03" + (1 << 20).to_bytes(8, "big")
        stream = head + b"x" * (1 << 20) + head + b"x" * 10
        r = SCANNERS[kind](stream, 0, len(stream), 0, 0, (1 << 20) + 100, 255)
        assert r.status == ScanStatus.TOO_LARGE and r.pos == (1 << 20) + 9
        huge = b"\x02" + (2**64 - 1).to_bytes(8, "big")
        assert SCANNERS[kind](huge, 0, 9, 0, 0, BIG, 255).status == ScanStatus.TOO_LARGE

    @pytest.mark.parametrize("kind", ["py", "ext"])
    def test_need_says_what_the_frame_takes(self, kind):
        stream = zp.encode_frame(b"x" * 1000)
        r = SCANNERS[kind](stream, 0, 12, 0, 0, BIG, 255)
        assert (r.status, r.want) == (ScanStatus.NEED, 1009)
        r = SCANNERS[kind](stream, 0, 5, 0, 0, BIG, 255)  # the long header is not whole
        assert (r.status, r.want) == (ScanStatus.NEED, 9)

    @pytest.mark.parametrize("kind", ["py", "ext"])
    def test_bad_commands(self, kind):
        long_command = zp.encode_command(b"PING", b"x" * 300)
        assert walk(kind, long_command, [long_command])[2] == ScanStatus.BAD_COMMAND
        more = b"\x05\x05\x04PING"
        assert walk(kind, more, [more])[2] == ScanStatus.BAD_COMMAND

    @pytest.mark.parametrize("kind", ["py", "ext"])
    def test_take_keeps_max_frames_adds_the_prefix_and_stops_at_budgets(self, kind):
        messages = [[b"f%d" % j for j in range(n)] for n in (1, 3, 8, 2)]
        stream = b"".join(zp.encode_message(m) for m in messages)
        take = TAKERS[kind]
        mark, got, size = take(stream, 0, len(stream), 100, 4, 1 << 30, b"\x00rid!")
        assert mark == len(stream)
        assert got == [(len(m) + 1, ([b"\x00rid!", *m])[:4]) for m in messages]
        assert size == sum(len(f) for _, frames in got for f in frames)
        mark, got, _ = take(stream, 0, len(stream), 2, 4, 1 << 30, None)
        assert [c for c, _ in got] == [1, 3]
        assert take(stream, mark, len(stream), 100, 4, 1 << 30, None)[1][0][0] == 8
        _, got, _ = take(stream, 0, len(stream), 100, 4, 1, None)
        assert len(got) == 1  # the byte budget is reached after the first message

    @settings(max_examples=fuzz_examples(300, 20_000), database=None)
    @given(messages_st, st.lists(st.booleans(), max_size=8), st.data())
    def test_python_and_c_agree_on_split_streams(self, messages, pings, data):
        stream = stream_of(messages, pings)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        py = walk("py", stream, chunks)
        assert py == walk("ext", stream, chunks)
        assert py[0] == [(len(m), m) for m in messages]

    @settings(max_examples=fuzz_examples(500, 50_000), database=None)
    @given(st.binary(max_size=400), st.integers(0, 600), st.integers(0, 300))
    def test_python_and_c_agree_on_any_bytes(self, blob, max_message, max_command):
        assert walk("py", blob, [blob], max_message, max_command) == walk(
            "ext", blob, [blob], max_message, max_command
        )
