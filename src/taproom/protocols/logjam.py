"""Logjam over ZeroMQ, sans-I/O: lists of frames in, typed messages out, and back.

A logjam data message is four ZeroMQ frames: ``app-env``, ``topic``, a (possibly compressed)
JSON ``body`` and a binary ``meta`` frame (seed ``logjam-consumer.txt``). This module parses and
validates such frame lists (grammar, meta frame, decompression with a size bound, JSON), builds
them for output, maps any stored :class:`~taproom.records.Record` to a logjam message by the
rules in ``docs/protocols/logjam.md``, and parses the replay side channel's requests.

It imports nothing from socket, asyncio or zmq and never reads the clock: the caller passes
"now" where a message needs a time.
"""

from __future__ import annotations

import re
import struct
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import IntEnum

import cramjam
import lz4.block
import orjson

from ..errors import LimitExceeded, ProtocolError
from ..records import RECORD_HEAD, RECORD_HEAD_AFTER_LEN, BatchBuilder, EncodedBatch, Record

__all__ = [
    "ACCEPTED",
    "BAD_REQUEST",
    "HEARTBEAT_APP_ENV",
    "META_TAG",
    "META_TAG_SWAPPED",
    "META_VERSION",
    "PING",
    "PING_OK",
    "Compression",
    "DataMessage",
    "IngestParser",
    "IngestedBody",
    "LogjamError",
    "LogjamLimit",
    "Meta",
    "OutputMapper",
    "PingMessage",
    "ReplayMode",
    "ReplayRequest",
    "RouterMessage",
    "compress",
    "compression_by_name",
    "created_ns",
    "decompress",
    "encode_message",
    "encode_meta",
    "is_valid_app_env",
    "is_valid_topic",
    "matches_prefixes",
    "parse_message",
    "parse_meta",
    "parse_replay_request",
    "parse_router_frames",
    "replay_error",
    "reply_frames",
]

# --- constants quoting the seed -------------------------------------------------------------

META_TAG = 0xCABD  # "tag = %xCABD ; tag is used internally to detect programming errors"
# A sender that forgot network byte order writes the tag (and every other field) little-endian.
META_TAG_SWAPPED = 0xBDCA
META_VERSION = 1  # "version = %x1"

ACCEPTED = b"202 Accepted"
BAD_REQUEST = b"400 Bad Request"
PING = b"ping"
PING_OK = b"200 OK"
HEARTBEAT_APP_ENV = b"heartbeat"

_U64 = (1 << 64) - 1


class Compression(IntEnum):
    """``compression-method`` of the meta frame."""

    NONE = 0  # "no-compression = %x0"
    ZLIB = 1  # "zlib-compression = %x1" (RFC 1950; gzip RFC 1952 accepted too)
    SNAPPY = 2  # "snappy-compression = %x2" (a raw snappy block, no framing)
    LZ4 = 3  # "lz4-compression = %x3" (4-byte big-endian size, then a raw LZ4 block)


_COMPRESSION_NAMES = {c.name.lower(): c for c in Compression}


class LogjamError(ProtocolError):
    """A logjam message broke the protocol; ``reply`` is the ``400 Bad Request`` status."""

    def __init__(self, message: str, *, reason: str = "malformed") -> None:
        super().__init__(message, reason=reason, reply=BAD_REQUEST)


class LogjamLimit(LogjamError, LimitExceeded):
    """A logjam frame or decompressed body is over its configured bound."""


# --- meta frame -----------------------------------------------------------------------------

# Seed form (22 bytes): tag u16, compression u8, version u8, device u16, created u64, seq u64.
_META22 = struct.Struct("!HBBHQQ")
_META22_LE = struct.Struct("<HBBHQQ")
# logjam-tools form (24 bytes): the device number is a u32 there.
_META24 = struct.Struct("!HBBIQQ")
_META24_LE = struct.Struct("<HBBIQQ")


@dataclass(frozen=True, slots=True)
class Meta:
    """The decoded meta frame. ``size`` is 22 (seed) or 24 (logjam-tools)."""

    compression: Compression
    device: int
    created_ms: int
    sequence: int
    version: int = META_VERSION
    size: int = 24
    swapped: bool = False


def parse_meta(frame: bytes) -> Meta:
    """Decode a meta frame of either size; raises :class:`LogjamError`."""
    n = len(frame)
    if n == 24:
        big, little = _META24, _META24_LE
    elif n == 22:
        big, little = _META22, _META22_LE
    else:
        raise LogjamError(f"meta frame is {n} bytes, expected 22 or 24", reason="bad_meta_size")
    tag, method, version, device, created, seq = big.unpack(frame)
    swapped = False
    if tag == META_TAG_SWAPPED:
        tag, method, version, device, created, seq = little.unpack(frame)
        swapped = True
    if tag != META_TAG:
        raise LogjamError(f"meta tag {tag:#06x}, expected 0xcabd", reason="bad_meta_tag")
    if version != META_VERSION:
        raise LogjamError(f"meta version {version}, expected 1", reason="bad_meta_version")
    try:
        compression = Compression(method)
    except ValueError:
        raise LogjamError(
            f"unknown compression method {method}", reason="bad_compression"
        ) from None
    return Meta(compression, device, created, seq, version, n, swapped)


def encode_meta(
    compression: Compression | int,
    device: int,
    created_ms: int,
    sequence: int,
    *,
    size: int = 24,
) -> bytes:
    """A network-order meta frame; ``size=22`` gives the seed's form (device must fit u16)."""
    if size == 24:
        return _META24.pack(META_TAG, compression, META_VERSION, device, created_ms, sequence)
    if size == 22:
        return _META22.pack(META_TAG, compression, META_VERSION, device, created_ms, sequence)
    raise ValueError("meta size is 22 or 24")


# --- compression ----------------------------------------------------------------------------


def compression_by_name(name: str) -> Compression:
    """``"none" | "zlib" | "snappy" | "lz4"`` -> :class:`Compression`."""
    try:
        return _COMPRESSION_NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown compression {name!r}") from None


def compress(method: Compression | int, data: bytes) -> bytes:
    """The body bytes for ``method`` (zlib emits RFC 1950, as logjam-tools does)."""
    if method == Compression.NONE:
        return data
    if method == Compression.ZLIB:
        return zlib.compress(data, 1)
    if method == Compression.SNAPPY:
        return bytes(cramjam.snappy.compress_raw(data))
    if method == Compression.LZ4:
        return struct.pack("!I", len(data)) + lz4.block.compress(data, store_size=False)
    raise ValueError(f"unknown compression method {method}")


def _snappy_length(data: bytes) -> int:
    """The uncompressed length a raw snappy block announces (a little-endian varint)."""
    result = shift = 0
    for i, byte in enumerate(data[:10]):
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result
        shift += 7
        if i == 4:  # snappy lengths are u32: at most 5 varint bytes
            break
    raise LogjamError("snappy block has no valid length", reason="bad_body")


def _inflate(data: bytes, wbits: int, max_size: int) -> bytes:
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(data, max_size + 1)
    except zlib.error as exc:
        raise LogjamError(f"zlib: {exc}", reason="bad_body") from None
    if len(out) > max_size:
        raise LogjamLimit(f"body inflates beyond {max_size} bytes", reason="decompressed_too_large")
    if not d.eof:
        raise LogjamError("zlib stream truncated", reason="bad_body")
    if d.unused_data:
        raise LogjamError("bytes after the end of the zlib stream", reason="bad_body")
    return out


def decompress(method: Compression | int, body: bytes, max_size: int) -> bytes:
    """Undo ``method``; never allocates more than ``max_size`` bytes of output."""
    if method == Compression.NONE:
        if len(body) > max_size:
            raise LogjamLimit(f"body over {max_size} bytes", reason="decompressed_too_large")
        return body
    if method == Compression.ZLIB:
        # The Ruby agent sends gzip under method 1: recognise it by its magic bytes.
        if body[:2] == b"\x1f\x8b":
            return _inflate(body, 31, max_size)
        return _inflate(body, 15, max_size)
    if method == Compression.SNAPPY:
        size = _snappy_length(body)
        if size > max_size:
            raise LogjamLimit(
                f"snappy block announces {size} bytes, at most {max_size}",
                reason="decompressed_too_large",
            )
        try:
            out = bytes(cramjam.snappy.decompress_raw(body))
        except Exception as exc:  # cramjam raises its own DecompressionError
            raise LogjamError(f"snappy: {exc}", reason="bad_body") from None
        if len(out) != size:
            raise LogjamError("snappy length mismatch", reason="bad_body")
        return out
    if method == Compression.LZ4:
        if len(body) < 4:
            raise LogjamError("lz4 body shorter than its size prefix", reason="bad_body")
        (size,) = struct.unpack_from("!I", body)
        if size > max_size:
            raise LogjamLimit(
                f"lz4 block announces {size} bytes, at most {max_size}",
                reason="decompressed_too_large",
            )
        if size == 0:
            if len(body) > 5 or body[4:] not in (b"", b"\x00"):
                raise LogjamError("lz4 block longer than announced", reason="bad_body")
            return b""
        try:
            out = lz4.block.decompress(body[4:], uncompressed_size=size)
        except Exception as exc:  # lz4.block.LZ4BlockError
            raise LogjamError(f"lz4: {exc}", reason="bad_body") from None
        if len(out) != size:
            raise LogjamError("lz4 length mismatch", reason="bad_body")
        return out
    raise LogjamError(f"unknown compression method {method}", reason="bad_compression")


# --- grammar --------------------------------------------------------------------------------

# app-env = application "-" environment; application = ALPHA *(ALPHA / "_" / "-");
# environment = ALPHA *(ALPHA / "_"). The split is at the last "-" (environment has none).
_APP_ENV_SEED = re.compile(rb"[A-Za-z][A-Za-z_\-]*-[A-Za-z][A-Za-z_]*")
# topic = logs *(ALPHA / ".") / javascript *(...) / events *(...) / frontend.page / frontend.ajax
_TOPIC_SEED = re.compile(rb"(?:logs|javascript|events)[A-Za-z.]*|frontend\.page|frontend\.ajax")
# "relaxed" grammar: real agents name apps with digits (web2) and put "-" in topics
# (logs.perf-ua.production); an operator may opt in to accepting those.
_APP_ENV_RELAXED = re.compile(rb"[A-Za-z0-9][A-Za-z0-9_\-]*-[A-Za-z0-9][A-Za-z0-9_]*")
_TOPIC_RELAXED = re.compile(
    rb"(?:logs|javascript|events)[A-Za-z0-9._\-]*|frontend\.page|frontend\.ajax"
)


def is_valid_app_env(value: bytes, *, relaxed: bool = False) -> bool:
    return (_APP_ENV_RELAXED if relaxed else _APP_ENV_SEED).fullmatch(value) is not None


def is_valid_topic(value: bytes, *, relaxed: bool = False) -> bool:
    return (_TOPIC_RELAXED if relaxed else _TOPIC_SEED).fullmatch(value) is not None


# --- messages -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DataMessage:
    """A validated data message; ``body`` is the decompressed JSON."""

    app_env: str
    topic: str
    body: bytes
    meta: Meta

    def add_to(self, builder: BatchBuilder) -> None:
        """Append this message as a record (see the mapping in docs/protocols/logjam.md)."""
        builder.add(
            "logjam",
            self.body,
            stream=self.app_env,
            topic=self.topic,
            producer=str(self.meta.device),
            seq=self.meta.sequence,
            ts_ns=created_ns(self.meta.created_ms),
            content_type="json",
        )


# Event times are stored as i64 nanoseconds; a created-ms beyond that (year 2262) is garbage
# from the sender and is stored as 0, "unknown", rather than refusing the message.
_MAX_CREATED_MS = ((1 << 63) - 1) // 1_000_000


def created_ns(created_ms: int) -> int:
    return created_ms * 1_000_000 if created_ms <= _MAX_CREATED_MS else 0


@dataclass(frozen=True, slots=True)
class PingMessage:
    """``ping`` in the app-env position: the agent checks the device is alive."""

    app_env: str  # what the agent sent in the topic position (its own app-env), may be ""
    meta: Meta


@dataclass(frozen=True, slots=True)
class RouterMessage:
    """What arrived on the ROUTER: the sender's routing id, whether it asked for a reply."""

    routing_id: bytes
    wants_reply: bool
    frames: Sequence[bytes]


def parse_message(
    frames: Sequence[bytes],
    *,
    max_body: int,
    max_decompressed: int,
    relaxed: bool = False,
    check_json: bool = True,
) -> DataMessage | PingMessage:
    """Validate four frames ``app-env topic body meta``; raises :class:`LogjamError`."""
    if len(frames) != 4:
        raise LogjamError(f"{len(frames)} frames, expected 4", reason="bad_frame_count")
    app_env, topic, body, meta_frame = frames
    meta = parse_meta(meta_frame)
    if app_env == PING:
        # The ping's second frame is the agent's app-env (or empty); nothing is stored.
        return PingMessage(topic.decode("ascii", "replace")[:255], meta)
    if not is_valid_app_env(app_env, relaxed=relaxed):
        raise LogjamError("app-env does not match the grammar", reason="bad_app_env")
    if not is_valid_topic(topic, relaxed=relaxed):
        raise LogjamError("topic does not match the grammar", reason="bad_topic")
    if len(body) > max_body:
        raise LogjamLimit(f"body is {len(body)} bytes, at most {max_body}", reason="body_too_large")
    data = decompress(meta.compression, body, max_decompressed)
    if check_json:
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:
            raise LogjamError("body is not JSON", reason="bad_json") from None
    # The grammar guarantees ASCII, so decoding cannot fail.
    return DataMessage(app_env.decode("ascii"), topic.decode("ascii"), data, meta)


# The fixed strings of every logjam record (records.py layout): protocol and content type.
_PROTOCOL = b"logjam"
_CONTENT_TYPE = b"json"
_FIELD_MAX = 65535  # records.py stores stream/topic/producer lengths as u16
_pack_head = RECORD_HEAD.pack


class IngestedBody(bytes):
    """The body of a batch :class:`IngestParser` built: logjam records only.

    The type is the mark: the PUB output, handed the same object by the hub, publishes such a
    batch without checking each record's protocol. Equal to (and stored as) plain bytes.
    """

    __slots__ = ()


class IngestParser:
    """The ingest hot path: validates four frames and appends the record to a batch.

    Same rules and errors as :func:`parse_message`, without building :class:`DataMessage`
    objects, and with the grammar checks of app-envs and topics already seen cached (bounded).

    Two ways in, byte-identical results (a test proves it):

    * :meth:`add` appends to a :class:`~taproom.records.BatchBuilder` (tests, odd shapes);
    * :meth:`push` appends to the parser's own batch, writing the record head with
      ``records.RECORD_HEAD`` directly: everything of a record but its head, times and body
      (protocol, content type, stream, topic, producer) is one cached byte string per
      (app-env, topic, device), so a message costs one ``struct.pack`` and three list items.
      :meth:`start_batch` / :meth:`take_batch` frame a burst.
    """

    __slots__ = (
        "_app_envs",
        "_fixed",
        "_parts",
        "_producers",
        "_push",
        "_topics",
        "max_body",
        "max_decompressed",
        "received_ns",
        "relaxed",
    )

    _CACHE = 4096  # distinct app-envs/topics remembered; beyond it they are checked each time

    def __init__(self, *, max_body: int, max_decompressed: int, relaxed: bool = False) -> None:
        self.max_body = max_body
        self.max_decompressed = max_decompressed
        self.relaxed = relaxed
        self._app_envs: dict[bytes, str] = {}
        self._topics: dict[bytes, str] = {}
        self._producers: dict[int, str] = {}
        # (app-env, topic, device) -> (the record's fixed bytes, head length field minus the
        # payload, len(stream), len(topic), len(producer))
        self._fixed: dict[tuple[bytes, bytes, int], tuple[bytes, int, int, int, int]] = {}
        self._parts: list[bytes] = []  # three per record: head, fixed part, payload
        self.received_ns = 0
        self._push = self._make_push()

    # --- the fast path: the parser's own batch ----------------------------------------------

    def start_batch(self, received_ns: int) -> None:
        """Start a batch whose records all carry ``received_ns`` (as one BatchBuilder does)."""
        self._parts.clear()
        self.received_ns = received_ns

    def pending(self) -> int:
        """Records pushed since :meth:`start_batch` (three parts each)."""
        return len(self._parts) // 3

    def take_batch(self) -> EncodedBatch:
        """The records pushed since :meth:`start_batch`, as one journal batch."""
        parts = self._parts
        batch = EncodedBatch(len(parts) // 3, IngestedBody(b"".join(parts)))
        parts.clear()
        return batch

    def push(
        self, app_env: bytes, topic: bytes, body: bytes, meta_frame: bytes
    ) -> PingMessage | None:
        """Validate one four-frame message and append its record to the current batch; a ping
        is returned, not stored. Raises :class:`LogjamError` like :func:`parse_message`."""
        return self._push(app_env, topic, body, meta_frame)

    def pusher(self) -> Callable[[bytes, bytes, bytes, bytes], PingMessage | None]:
        """:meth:`push` itself, for loops that call it per message."""
        return self._push

    def _make_push(self) -> Callable[[bytes, bytes, bytes, bytes], PingMessage | None]:
        # A closure rather than a method: what it needs per message is in its cells, not
        # behind attribute and global lookups (~0.5 us a message, measured). The bounds are
        # read once: a parser's settings do not change after construction.
        extend = self._parts.extend
        fixed_get = self._fixed.get
        fixed_part = self._fixed_part
        unpack24, unpack22 = _META24.unpack, _META22.unpack
        loads, json_error = orjson.loads, orjson.JSONDecodeError
        pack_head = _pack_head
        max_body, max_decompressed = self.max_body, self.max_decompressed
        max_created = _MAX_CREATED_MS
        tag_ok, version_ok, ping, field_max = META_TAG, META_VERSION, PING, _FIELD_MAX

        def push(
            app_env: bytes, topic: bytes, body: bytes, meta_frame: bytes
        ) -> PingMessage | None:
            size = len(meta_frame)
            if size == 24:
                tag, method, version, device, created, seq = unpack24(meta_frame)
            elif size == 22:
                tag, method, version, device, created, seq = unpack22(meta_frame)
            else:
                tag = 0
            if tag != tag_ok or version != version_ok or method > 3:
                meta = parse_meta(meta_frame)  # the byte-swapped form, or the precise error
                method, device, created, seq = (
                    meta.compression,
                    meta.device,
                    meta.created_ms,
                    meta.sequence,
                )
            if app_env == ping:  # rare: the full decode is fine here
                return PingMessage(topic.decode("ascii", "replace")[:255], parse_meta(meta_frame))
            fixed = fixed_get((app_env, topic, device))
            if fixed is None:
                if len(app_env) > field_max or len(topic) > field_max:
                    # Over records.py's u16 field bound: the builder's checks and errors, in
                    # its order (after the body's), rather than a second copy of them here.
                    builder = BatchBuilder(self.received_ns)
                    self._add(builder, app_env, topic, body, method, device, created, seq)
                    extend((builder.build().body, b"", b""))  # one record, three parts
                    return None
                fixed = fixed_part(app_env, topic, device)
            if len(body) > max_body:
                raise LogjamLimit(
                    f"body is {len(body)} bytes, at most {max_body}", reason="body_too_large"
                )
            data = decompress(method, body, max_decompressed) if method else body
            n = len(data)
            if n > max_decompressed:
                raise LogjamLimit(
                    "body over the decompressed bound", reason="decompressed_too_large"
                )
            try:
                loads(data)
            except json_error:
                raise LogjamError("body is not JSON", reason="bad_json") from None
            raw, after_len, ls, lt, lr = fixed
            extend(
                (
                    pack_head(
                        after_len + n,
                        self.received_ns,
                        created * 1_000_000 if created <= max_created else 0,
                        seq,
                        6,
                        4,
                        ls,
                        lt,
                        lr,
                        0,
                        0,
                        n,
                    ),
                    raw,
                    data,
                )
            )
            return None

        return push

    def _fixed_part(
        self, app_env: bytes, topic: bytes, device: int
    ) -> tuple[bytes, int, int, int, int]:
        """Validate app-env and topic (cached like :meth:`add`) and make the cache entry."""
        self._stream(app_env)
        self._topic(topic)
        producer = str(device).encode()
        raw = _PROTOCOL + _CONTENT_TYPE + app_env + topic + producer
        fixed = (raw, RECORD_HEAD_AFTER_LEN + len(raw), len(app_env), len(topic), len(producer))
        if len(self._fixed) < self._CACHE:
            self._fixed[(app_env, topic, device)] = fixed
        return fixed

    # --- the BatchBuilder path ----------------------------------------------------------------

    def add(self, builder: BatchBuilder, frames: Sequence[bytes]) -> PingMessage | None:
        """Append one data message to ``builder``; a ping is returned, not stored."""
        if len(frames) != 4:
            raise LogjamError(f"{len(frames)} frames, expected 4", reason="bad_frame_count")
        app_env, topic, body, meta_frame = frames
        size = len(meta_frame)
        if size == 24:
            tag, method, version, device, created, seq = _META24.unpack(meta_frame)
        elif size == 22:
            tag, method, version, device, created, seq = _META22.unpack(meta_frame)
        else:
            tag = 0
        if tag != META_TAG or version != META_VERSION or method > 3:
            meta = parse_meta(meta_frame)  # the byte-swapped form, or the precise error
            method, device, created, seq = (
                meta.compression,
                meta.device,
                meta.created_ms,
                meta.sequence,
            )
        if app_env == PING:  # rare: the full decode is fine here
            return PingMessage(topic.decode("ascii", "replace")[:255], parse_meta(meta_frame))
        self._add(builder, app_env, topic, body, method, device, created, seq)
        return None

    def _stream(self, app_env: bytes) -> str:
        stream = self._app_envs.get(app_env)
        if stream is None:
            if not is_valid_app_env(app_env, relaxed=self.relaxed):
                raise LogjamError("app-env does not match the grammar", reason="bad_app_env")
            stream = app_env.decode("ascii")
            if len(self._app_envs) < self._CACHE:
                self._app_envs[app_env] = stream
        return stream

    def _topic(self, topic: bytes) -> str:
        topic_str = self._topics.get(topic)
        if topic_str is None:
            if not is_valid_topic(topic, relaxed=self.relaxed):
                raise LogjamError("topic does not match the grammar", reason="bad_topic")
            topic_str = topic.decode("ascii")
            if len(self._topics) < self._CACHE:
                self._topics[topic] = topic_str
        return topic_str

    def _add(
        self,
        builder: BatchBuilder,
        app_env: bytes,
        topic: bytes,
        body: bytes,
        method: int,
        device: int,
        created: int,
        seq: int,
    ) -> None:
        stream = self._stream(app_env)
        topic_str = self._topic(topic)
        if len(body) > self.max_body:
            raise LogjamLimit(
                f"body is {len(body)} bytes, at most {self.max_body}", reason="body_too_large"
            )
        data = decompress(method, body, self.max_decompressed) if method else body
        if not method and len(data) > self.max_decompressed:
            raise LogjamLimit("body over the decompressed bound", reason="decompressed_too_large")
        try:
            orjson.loads(data)
        except orjson.JSONDecodeError:
            raise LogjamError("body is not JSON", reason="bad_json") from None
        producer = self._producers.get(device)
        if producer is None:
            producer = str(device)
            if len(self._producers) < self._CACHE:
                self._producers[device] = producer
        builder.add(
            "logjam",
            data,
            stream=stream,
            topic=topic_str,
            producer=producer,
            seq=seq,
            ts_ns=created * 1_000_000 if created <= _MAX_CREATED_MS else 0,
            content_type="json",
        )


def parse_router_frames(frames: Sequence[bytes]) -> RouterMessage:
    """Split a ROUTER message: ``routing-id [""] app-env topic body meta``.

    An empty frame after the routing id asks for a reply (logjam-device's synchronous mode).
    """
    if len(frames) < 2:
        raise LogjamError("ROUTER message without content", reason="bad_frame_count")
    if frames[1] == b"":
        return RouterMessage(frames[0], True, frames[2:])
    return RouterMessage(frames[0], False, frames[1:])


def reply_frames(routing_id: bytes, *status: bytes) -> list[bytes]:
    """ROUTER reply: the empty delimiter keeps it REQ-compatible; DEALERs see it first."""
    return [routing_id, b"", *status]


def encode_message(
    app_env: bytes,
    topic: bytes,
    json_body: bytes,
    *,
    compression: Compression | int,
    device: int,
    created_ms: int,
    sequence: int,
    meta_size: int = 24,
) -> list[bytes]:
    """The four frames of a data message, body compressed with ``compression``."""
    return [
        app_env,
        topic,
        compress(compression, json_body),
        encode_meta(compression, device, created_ms, sequence, size=meta_size),
    ]


# --- mapping stored records to logjam output ------------------------------------------------

_NOT_TOPIC_CHARS = re.compile(r"[^A-Za-z.]+")
_DOTS = re.compile(r"\.{2,}")


def _topic_suffix(topic: str) -> str:
    cleaned = _DOTS.sub(".", _NOT_TOPIC_CHARS.sub(".", topic)).strip(".")
    return cleaned


class OutputMapper:
    """Turns stored records into logjam messages for the PUB output and the replay channel.

    Rules (docs/protocols/logjam.md, "Output mapping"):

    * ``protocol == "logjam"``: app-env = stream, topic = topic, body = the stored JSON.
    * any other protocol: app-env = the stream when it is a valid app-env, else
      ``default_app_env`` with ``{protocol}`` filled in; topic = ``events.<protocol>[.<topic>]``
      for protocols in ``event_protocols``, else ``logs.<protocol>[.<topic>]``, where the
      record's topic keeps only letters and dots; body = a JSON object with ``taproom`` (the
      record's metadata, including its journal offset) and ``payload`` (the decoded payload).
    """

    def __init__(
        self,
        *,
        routes: Iterable[str] = ("*",),
        default_app_env: str = "taproom-{protocol}",
        event_protocols: Iterable[str] = ("eventbus", "lager"),
        payload_decoder: Callable[[str, bytes], object] | None = None,
    ) -> None:
        routes = tuple(routes)
        self.all_protocols = "*" in routes
        self.routes = frozenset(routes)
        self.default_app_env = default_app_env
        self.event_protocols = frozenset(event_protocols)
        self._decode = payload_decoder
        self._app_env_cache: dict[tuple[str, str], bytes] = {}
        self._topic_cache: dict[tuple[str, str], bytes] = {}

    def routed(self, protocol: str) -> bool:
        return self.all_protocols or protocol in self.routes

    def app_env(self, protocol: str, stream: str) -> bytes:
        key = (protocol, stream)
        cached = self._app_env_cache.get(key)
        if cached is None:
            raw = stream.encode("utf-8", "surrogateescape")
            if protocol == "logjam" or is_valid_app_env(raw):
                cached = raw
            else:
                cached = self.default_app_env.format(protocol=protocol).encode()
            if len(self._app_env_cache) < 65536:  # bounded: streams come from the wire
                self._app_env_cache[key] = cached
        return cached

    def topic(self, protocol: str, topic: str) -> bytes:
        key = (protocol, topic)
        cached = self._topic_cache.get(key)
        if cached is None:
            if protocol == "logjam":
                cached = topic.encode("utf-8", "surrogateescape")
            else:
                root = "events" if protocol in self.event_protocols else "logs"
                proto = _topic_suffix(protocol) or "unknown"
                suffix = _topic_suffix(topic)
                cached = (
                    f"{root}.{proto}.{suffix}".encode() if suffix else f"{root}.{proto}".encode()
                )
            if len(self._topic_cache) < 65536:
                self._topic_cache[key] = cached
        return cached

    def body(self, record: Record) -> bytes:
        if record.protocol == "logjam":
            return record.payload
        if self._decode is not None:
            payload = self._decode(record.content_type, record.payload)
        else:
            payload = record.payload.decode("utf-8", "replace")
        return orjson.dumps(
            {
                "taproom": {
                    "offset": record.offset,
                    "protocol": record.protocol,
                    "stream": record.stream,
                    "topic": record.topic,
                    "producer": record.producer,
                    "seq": record.seq,
                    "event_id": record.event_id,
                    "ts_ns": record.ts_ns,
                    "received_ns": record.received_ns,
                    "content_type": record.content_type,
                    "attrs": dict(record.attrs),
                },
                "payload": payload,
            }
        )

    def created_ms(self, record: Record, now_ms: int) -> int:
        """The original time when there is one (seed: keep a non-zero created-ms)."""
        if record.ts_ns > 0:
            return record.ts_ns // 1_000_000
        return now_ms

    def map(self, record: Record, now_ms: int) -> tuple[bytes, bytes, bytes, int]:
        """``(app_env, topic, json_body, created_ms)`` for one record."""
        return (
            self.app_env(record.protocol, record.stream),
            self.topic(record.protocol, record.topic),
            self.body(record),
            self.created_ms(record, now_ms),
        )


# --- replay side channel --------------------------------------------------------------------


class ReplayMode(IntEnum):
    """How a replay request names where to start."""

    OFFSET = 1  # "offset" FROM MAX [PREFIX...]: journal offsets from FROM, at most MAX events
    SEQ = 2  # "seq" FROM TO [PREFIX...]: the PUB messages numbered FROM..TO (inclusive)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    mode: ReplayMode
    start: int
    limit: int  # OFFSET: max count; SEQ: the last sequence number wanted
    prefixes: tuple[bytes, ...]


_DECIMAL = re.compile(rb"[0-9]{1,20}")


def _decimal(frame: bytes, what: str) -> int:
    if _DECIMAL.fullmatch(frame) is None:
        raise LogjamError(f"{what} is not a decimal number", reason="bad_replay_request")
    value = int(frame)
    if value > _U64:
        raise LogjamError(f"{what} exceeds 64 bits", reason="bad_replay_request")
    return value


def parse_replay_request(
    frames: Sequence[bytes], *, max_count: int, max_prefixes: int = 16
) -> ReplayRequest:
    """Parse the frames after the envelope: ``mode from (max|to) [prefix ...]``."""
    if len(frames) < 3:
        raise LogjamError("replay request needs mode, from, count", reason="bad_replay_request")
    if len(frames) > 3 + max_prefixes:
        raise LogjamError("too many prefixes", reason="bad_replay_request")
    mode_name = frames[0]
    start = _decimal(frames[1], "from")
    second = _decimal(frames[2], "count")
    prefixes = tuple(frames[3:])
    if any(len(p) > 255 for p in prefixes):
        raise LogjamError("prefix longer than 255 bytes", reason="bad_replay_request")
    if mode_name == b"offset":
        return ReplayRequest(ReplayMode.OFFSET, start, min(second, max_count), prefixes)
    if mode_name == b"seq":
        if second < start:
            raise LogjamError("seq range ends before it starts", reason="bad_replay_request")
        if second - start + 1 > max_count:
            second = start + max_count - 1
        return ReplayRequest(ReplayMode.SEQ, start, second, prefixes)
    raise LogjamError("replay mode must be 'offset' or 'seq'", reason="bad_replay_request")


def replay_error(status: bytes, reason: str) -> list[bytes]:
    """Frames of a failed replay reply: status, reason."""
    return [status, reason.encode()]


def matches_prefixes(app_env: bytes, prefixes: Sequence[bytes]) -> bool:
    """ZeroMQ subscription semantics: no prefixes or an empty one matches everything."""
    if not prefixes:
        return True
    return any(app_env.startswith(p) for p in prefixes)
