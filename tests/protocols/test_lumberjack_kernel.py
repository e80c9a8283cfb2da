"""The Lumberjack window kernel (zmqburst/lumberjack.c: lw_run) against the Python decoder.

The kernel may take a J frame only when the Python path would store it, and must then write
the very record Python writes (stream and topic along the configured paths with JSON's rules,
the @timestamp's nanoseconds); everything else it leaves to Python, which then refuses, stalls
or stores it as before. So a window decoded with the kernel must give exactly the windows, acks,
fingerprints, refusals and out-of-range counts of the Python decoder alone: fuzzed documents
(duplicate keys, escapes, long and multi-byte names, every timestamp form, long numbers, deep
nesting, mutated bytes) in fuzzed windows (versions, D frames, C frames, limits, chunking,
room) go through both. tests/protocols/test_lumberjack.py runs the decoder's own tests on both
paths too; the servers use the kernel whenever the compiled path is selected.
"""

from __future__ import annotations

import itertools
import random
import struct
import zlib
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from taproom import zmqburst
from taproom.protocols.lumberjack import (
    STALL_INFLATE,
    STALL_ROOM,
    Limits,
    LumberjackError,
    LumberjackLimit,
    ServerConnection,
    Window,
)
from taproom.servers.lumberjack.kernel import WindowKernels
from tests.support import fuzz_examples

PATHS = (("fields.app", "beat.name", "agent.name"), ("type", "fields.type"))


class Counting:
    """WindowKernels that count the events their kernels take (a test that the kernel ran)."""

    def __init__(self, inner: WindowKernels) -> None:
        self.inner = inner
        self.taken = 0

    def for_paths(self, stream: Sequence[str], topic: Sequence[str]) -> Any:
        kernel = self.inner.for_paths(stream, topic)
        if kernel is None:
            return None
        outer = self

        class Spy:
            def run(self, *args: Any) -> Any:
                res = kernel.run(*args)
                outer.taken += res.events
                return res

            def records(self) -> bytes:
                return kernel.records()

        return Spy()


@pytest.fixture(scope="module")
def kernels() -> WindowKernels:
    """The compiled kernels; fails (never skips) when the compiled module is not built."""
    before = zmqburst.active()
    zmqburst.select("ext")
    try:
        made = WindowKernels.create()
    finally:
        zmqburst.select(before)
    assert made is not None
    return made


def _decode(
    data: bytes,
    kernels: Any,
    *,
    limits: Limits = Limits(),
    paths: tuple[Sequence[str], Sequence[str]] = PATHS,
    chunks: Sequence[int] = (),
    room: int | None = None,
) -> tuple[list[tuple[Any, ...]], tuple[str, str] | None, int]:
    """Everything a decoder hands over for ``data`` (cut at ``chunks``), the error that ended
    it, and the out-of-range times it counted. With ``room``, journal and inflate room are
    granted that much at a time, as the glue does."""
    conn = ServerConnection(
        "10.1.2.3:5044", limits=limits, stream_fields=paths[0], topic_fields=paths[1],
        kernels=kernels,
    )  # fmt: skip
    if room is not None:
        conn.room = conn.inflate_room = room
    windows: list[Window] = []
    error = None
    cuts = [0, *sorted(c % (len(data) + 1) for c in chunks), len(data)]
    try:
        for a, b in itertools.pairwise(cuts):
            windows += conn.receive_data(data[a:b], 77)
            for _ in range(100_000):
                if conn.stalled == STALL_ROOM:
                    assert room is not None
                    conn.room += max(conn.room_wanted, room)
                elif conn.stalled == STALL_INFLATE:
                    conn.inflate_room = conn.inflate_wanted
                elif not conn.more_buffered:
                    break
                windows += conn.receive_data(b"", 77)
        last = conn.flush(ending=True)
        if last is not None:
            windows.append(last)
    except (LumberjackError, LumberjackLimit) as exc:
        windows += exc.windows
        error = (type(exc).__name__, exc.reason)
    summary = [
        (w.batch.count, w.batch.body, w.ack_seq, w.version, w.done, w.fingerprints, w.skipped)
        for w in windows
    ]
    return summary, error, conn.times.take()


def _same(data: bytes, kernels: WindowKernels, **kwargs: Any) -> int:
    """Both paths give the same; returns how many events the kernel took."""
    spy = Counting(kernels)
    with_kernel = _decode(data, spy, **kwargs)
    assert with_kernel == _decode(data, None, **kwargs)
    return spy.taken


def _frame(version: bytes, kind: bytes, *fields: int) -> bytes:
    return version + kind + b"".join(struct.pack(">I", f) for f in fields)


def J(seq: int, payload: bytes, v: bytes = b"2") -> bytes:
    return _frame(v, b"J", seq, len(payload)) + payload


def W(n: int, v: bytes = b"2") -> bytes:
    return _frame(v, b"W", n)


def C(frames: bytes, v: bytes = b"2") -> bytes:
    body = zlib.compress(frames, 1)
    return _frame(v, b"C", len(body)) + body


def D(seq: int, pairs: dict[str, str], v: bytes = b"1") -> bytes:
    out = _frame(v, b"D", seq, len(pairs))
    for key, value in pairs.items():
        k, val = key.encode(), value.encode()
        out += struct.pack(">I", len(k)) + k + struct.pack(">I", len(val)) + val
    return out


# -- documents --------------------------------------------------------------------------------

_TIMES = [
    "2026-01-01T00:00:00.000Z", "2026-11-26T17:04:05.123Z", "2026-11-26T17:04:05Z",
    "2026-11-26T17:04:05.123456789Z", "2026-11-26T17:04:05.1234567891Z", "2026-11-26t17:04:05z",
    "2026-11-26 17:04:05.5Z", "2026-11-26T17:04:05+00:00", "2026-11-26T17:04:05.25+00:00",
    "2026-11-26T17:04:05+01:00", "2026-11-26T17:04:05", "2026-11-26", "1970-01-01T00:00:00Z",
    "1969-12-31T23:59:59.999Z", "2261-12-31T23:59:59.999999999Z", "2262-04-11T23:47:16Z",
    "2262-04-12T00:00:00Z", "9999-12-31T23:59:59Z", "0001-01-01T00:00:00Z",
    "2024-02-29T12:00:00Z", "2026-02-29T12:00:00Z", "2026-13-01T00:00:00Z",
    "2026-11-26T24:00:00Z", "2026-11-26T23:59:60Z", "2026-11-26T17:04:05.Z", "",
    "not a time", "2026-11-26T17:04:05.123Z ", "\\u0032026-11-26T17:04:05Z",
    "\uff12\uff10\uff12\uff16-11-26T17:04:05Z",  # fullwidth digits
    "2026-11-26T17:04:05.12a4Z", "2026-11-26T17:04:05.123ZZ",
]  # fmt: skip
_NAMES = [
    "shop", "", "a" * 255, "a" * 256, "é" * 255, "é" * 256, "日本" * 100, "x\\\"y", "tab\\t",
    "\\u0041pp", "web-1", "😀" * 255, "😀" * 256, "ascii with spaces", "\x7f",
]  # fmt: skip
_KEYS = ["fields", "app", "type", "beat", "name", "agent", "@timestamp", "message", "x", ""]
_ESCAPED_KEYS = ["fi\\u0065lds", "typ\\u0065", "\\u0040timestamp", "a\\\\pp", "t\\/ype"]
_NUMBERS = [
    "0", "-0", "1", "-17", "3.25", "1e5", "1E+2", "-2.5e-3", "123456789012345",
    "1234567890123456", "12345678901234567890", "1.5e300", "1e400", "0.1234567890123456",
    "-9223372036854775808", "18446744073709551616",
]  # fmt: skip


def _string(rng: random.Random) -> str:
    if rng.random() < 0.5:
        return rng.choice(_NAMES)
    return "".join(rng.choice("abc é日😀\\n") for _ in range(rng.randrange(8))).replace(
        "\\", "\\\\"
    )


def _value(rng: random.Random, depth: int) -> str:
    kind = rng.randrange(9 if depth < 5 else 5)
    if kind == 0:
        return rng.choice(_NUMBERS)
    if kind == 1:
        return rng.choice(["true", "false", "null"])
    if kind in (2, 3):
        return '"' + _string(rng) + '"'
    if kind == 4:
        return '"' + rng.choice(_TIMES) + '"'
    if kind in (5, 6):
        return _object(rng, depth + 1)
    if kind == 7:
        items = [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
        return "[" + ", ".join(items) + "]"
    return "[" * 130 + "]" * 130 if rng.random() < 0.2 else "[[[]]]"


def _object(rng: random.Random, depth: int = 0) -> str:
    members = []
    for _ in range(rng.randrange(6 if depth else 9)):
        r = rng.random()
        if r < 0.6:
            key = rng.choice(_KEYS)
        elif r < 0.7:
            key = rng.choice(_ESCAPED_KEYS)
        else:
            key = _string(rng)
        if key == "@timestamp" and rng.random() < 0.7:
            value = '"' + rng.choice(_TIMES) + '"'
        elif key in ("app", "name", "type") and rng.random() < 0.6:
            value = '"' + rng.choice(_NAMES) + '"'
        else:
            value = _value(rng, depth)
        space = rng.choice(["", " ", "\n\t"])
        members.append(f'"{key}"{space}:{space}{value}')
    return "{" + ",".join(members) + "}"


def _document(rng: random.Random) -> bytes:
    r = rng.random()
    if r < 0.03:
        return rng.choice([b"[]", b'"s"', b"1", b"null", b" ", b"{", b"{}x", b"\xef\xbb\xbf{}"])
    text = _object(rng).encode()
    if rng.random() < 0.15:  # mutated: invalid JSON, invalid UTF-8, or still fine
        data = bytearray(text)
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(data) + 1)
            op = rng.randrange(3)
            if op == 0 and data:
                data[min(at, len(data) - 1)] = rng.randrange(256)
            elif op == 1:
                data[at:at] = bytes([rng.randrange(256)])
            else:
                del data[at : at + rng.randrange(1, 4)]
        text = bytes(data)
    return text


def _filebeat(i: int) -> bytes:
    return orjson.dumps(
        {
            "@timestamp": f"2026-11-26T17:04:{i % 60:02d}.{i % 1000:03d}Z",
            "message": f'GET /items/{i} 200 "quoted" é\n' * (1 + i % 5),
            "host": {"name": f"web-{i % 7}"},
            "fields": {"app": "shop", "n": i},
            "type": "access",
            "offset": i * 311,
        }
    )


# -- tests ------------------------------------------------------------------------------------


class TestKernel:
    def test_filebeat_windows_are_taken_whole(self, kernels: WindowKernels) -> None:
        # The shape the kernel is for: every event in C, byte for byte Python's records.
        frames = b"".join(J(i + 1, _filebeat(i)) for i in range(500))
        data = W(500) + frames + W(500) + C(frames)
        assert _same(data, kernels) == 1000
        assert _same(data, kernels, chunks=[7, 1000, 1001, 50_000]) == 1000

    def test_events_larger_than_its_buffer_go_to_python(self, kernels: WindowKernels) -> None:
        # The kernel's output buffer is 1 MiB whatever max_event_bytes is: a larger record is
        # Python's, and the kernel takes the events around it.
        big = orjson.dumps({"message": "x" * (3 << 19), "fields": {"app": "big"}})
        frames = [J(i + 1, big if i % 3 == 1 else _filebeat(i)) for i in range(9)]
        data = W(9) + b"".join(frames)
        assert _same(data, kernels) == 6
        assert _same(C(b"".join(frames)), kernels, room=1 << 22) == 6

    def test_windows_and_batches_end_where_python_ends_them(self, kernels: WindowKernels) -> None:
        frames = b"".join(J(i + 1, _filebeat(i)) for i in range(300))
        limits = Limits(max_window=100, max_batch_bytes=20_000)
        for data in (W(90) + frames, frames, W(70) + frames[: len(frames) // 2], C(frames)):
            assert _same(data, kernels, limits=limits) > 0
            assert _same(data, kernels, limits=limits, room=30_000) > 0

    def test_every_document_form(self, kernels: WindowKernels) -> None:
        # One frame per document, alone in its window: the kernel's answer for each is
        # compared on its own (a refusal ends the connection).
        rng = random.Random(32)
        taken = 0
        for _ in range(2000):
            doc = _document(rng)
            taken += _same(W(1) + J(5, doc), kernels)
        assert taken > 500  # the kernel took the ordinary ones

    def test_paths_of_every_shape(self, kernels: WindowKernels) -> None:
        docs = [
            b'{"a":{"b":{"c":"deep"}},"a":{"b":{"c":"last"}}}',
            b'{"a":{"b":{"c":"deep"}},"a":{"b":1}}',
            b'{"a":{"b":{"c":"x"},"b":{"d":"y"}}}',
            b'{"a":[{"b":{"c":"in a list"}}],"x":"y"}',
            b'{"":{"":"empty keys"},"@timestamp":"2026-11-26T17:04:05Z"}',
            b'{"a.b":"dotted key","a":{"b":"nested"}}',
            b'{"x":"first","x":"second","y":{"x":"inner"}}',
        ]
        shapes = [
            (("a.b.c", "x"), ("y.x", "")),
            (("", "a.b"), ("@timestamp", "a.b.c")),
            ((".",), ("a.b.c.d.e.f.g.h",)),
            (tuple(f"k{i}" for i in range(20)), ("x",)),  # too many for the kernel: Python
            (("a.b.c.d.e.f.g.h.i",), ()),  # too deep for the kernel: Python
        ]
        for paths in shapes:
            for doc in docs:
                _same(W(1) + J(9, doc), kernels, paths=paths)

    @given(st.integers(0, 2**64))
    @settings(max_examples=fuzz_examples(300, 20_000), deadline=None)
    def test_fuzzed_windows(self, kernels: WindowKernels, seed: int) -> None:
        rng = random.Random(seed)
        version = rng.choice([b"1", b"2"])
        frames = []
        for i in range(rng.randrange(1, 40)):
            r = rng.random()
            v = version if rng.random() < 0.9 else rng.choice([b"1", b"2"])
            seq = rng.choice([i + 1, rng.randrange(2**32), 0xFFFFFFFF - i])
            if r < 0.8:
                frames.append(J(seq, _filebeat(i) if rng.random() < 0.5 else _document(rng), v))
            elif r < 0.9:
                frames.append(D(seq, {"type": rng.choice(_NAMES), "m": "x" * i}, v))
            else:
                frames.append(W(rng.randrange(1, 30), v))
        body = b"".join(frames)
        if rng.random() < 0.3:
            body = C(body, version)
        data = W(rng.randrange(0, 50), version) + body
        limits = Limits(
            max_window=rng.choice([3, 10, 10_000]),
            max_event_bytes=rng.choice([1024, 4096, 1 << 20]),
            max_batch_bytes=rng.choice([500, 4096, 1 << 20]),
        )
        chunks = [rng.randrange(len(data) + 1) for _ in range(rng.randrange(4))]
        room = rng.choice([None, 300, 5000])
        _same(data, kernels, limits=limits, chunks=chunks, room=room)

    def test_resent_windows_are_recognised_on_both_paths(self, kernels: WindowKernels) -> None:
        # Resend recognition runs in Python: the kernel is not used while it matches, and the
        # fingerprints of parts it recorded match the Python ones.
        frames = [J(i + 1, _filebeat(i)) for i in range(40)]
        limits = Limits(max_batch_bytes=3000)
        first, _, _ = _decode(W(40) + b"".join(frames[:25]), kernels, limits=limits)
        fingerprints = [fp for part in first for fp in part[5]]
        assert len(fingerprints) > 10
        for with_kernels in (kernels, None):
            conn = ServerConnection("10.1.2.3:5044", limits=limits, kernels=with_kernels)
            conn.resend = {fingerprints[0]: fingerprints}
            windows = conn.receive_data(W(40) + b"".join(frames), 1)
            assert sum(len(w.skipped) for w in windows) == len(fingerprints)
            assert sum(w.batch.count for w in windows) == 40 - len(fingerprints)
