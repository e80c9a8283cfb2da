"""Logjam data messages: the app-env and topic grammar, validation of four frames into a
:class:`DataMessage` or :class:`PingMessage`, the ROUTER envelope and reply, and building the
frames of a message for output."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from ...records import BatchBuilder
from .codec import (
    PING,
    Compression,
    LogjamError,
    LogjamLimit,
    Meta,
    compress,
    decompress,
    encode_meta,
    parse_meta,
)

__all__ = [
    "DataMessage",
    "PingMessage",
    "RouterMessage",
    "created_ns",
    "encode_message",
    "is_valid_app_env",
    "is_valid_topic",
    "parse_message",
    "parse_router_frames",
    "reply_frames",
]

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
