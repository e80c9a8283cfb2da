"""The logjam meta frame and body compression: constants quoting the seed, the error types,
:class:`Meta` with its 22- and 24-byte forms, and bounded decompression."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from enum import IntEnum

import cramjam
import lz4.block

from ...errors import LimitExceeded, ProtocolError

__all__ = [
    "ACCEPTED",
    "BAD_REQUEST",
    "EMPTY_META",
    "HEARTBEAT_APP_ENV",
    "META_TAG",
    "META_TAG_SWAPPED",
    "META_VERSION",
    "PING",
    "PING_OK",
    "Compression",
    "LogjamError",
    "LogjamLimit",
    "Meta",
    "compress",
    "compression_by_name",
    "decompress",
    "encode_meta",
    "parse_meta",
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


# What logjam-device assumes when an old agent sends three frames, no meta (META_INFO_EMPTY in
# logjam-tools src/logjam-util.h): no compression, device 0, created-ms 0 (unknown), sequence 0.
EMPTY_META = encode_meta(Compression.NONE, 0, 0, 0)
