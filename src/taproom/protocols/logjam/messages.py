"""Logjam data messages: the app-env and topic grammar, validation of four frames into a
:class:`DataMessage` or :class:`PingMessage`, the ROUTER envelope and reply, and building the
frames of a message for output."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import orjson

from ...eventtime import MAX_MS, EventTimes
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
    "GRAMMARS",
    "UNKNOWN_APP_ENV",
    "DataMessage",
    "PingMessage",
    "created_ns",
    "encode_message",
    "is_valid_app_env",
    "is_valid_topic",
    "parse_message",
    "reply_frames",
    "topic_text",
    "well_formed_stream_name",
    "well_formed_topic",
]

# --- grammar --------------------------------------------------------------------------------

# "device" (the default) is logjam-device's own acceptance, function for function; "seed" is
# logjam-consumer.txt's ABNF, for operators who want only that. logjam-device (logjam-tools
# src/logjam-device.c, read_zmq_message_and_forward and read_router_message_and_forward) checks
# the app-env with well_formed_stream_name and the routing key with well_formed_topic, both in
# src/logjam-util.c:
#   well_formed_stream_name: every byte is 32..127 (the test is `s[i] < 32 || s[i] > 127` on a
#     char: a byte of 128 or more refuses whether char is signed or not, 127 passes) and at
#     least one is "-". Nothing else: "my app-production", "-production", "myapp-" pass.
#   well_formed_topic: the key starts with "logs", "javascript", "events", "frontend.page",
#     "frontend.ajax" or "mobile" (strncmp of the prefix; case matters). Nothing after the
#     prefix is checked: "logs.my app", "logs/x", "logs.\xc3\xa4pp" pass, "Logs.x" does not.
# So a device app-env is printable ASCII (stored as text); a device topic is any bytes after its
# prefix (stored as they came: records keep fields with surrogateescape).
GRAMMARS = ("device", "seed")
_DEVICE_STREAM_BYTES = re.compile(rb"[\x20-\x7f]*")
_DEVICE_TOPIC_PREFIXES = (
    b"logs",
    b"javascript",
    b"events",
    b"frontend.page",
    b"frontend.ajax",
    b"mobile",
)
# application = ALPHA *(ALPHA / "_" / "-"); environment = ALPHA *(ALPHA / "_")
_SEED_APP_ENV = re.compile(rb"[A-Za-z][A-Za-z_\-]*-[A-Za-z][A-Za-z_]*")
# logs / javascript / events *(ALPHA / "."), frontend.page, frontend.ajax
_SEED_TOPIC = re.compile(rb"(?:logs|javascript|events)[A-Za-z.]*|frontend\.page|frontend\.ajax")


def well_formed_stream_name(value: bytes) -> bool:
    """logjam-device's app-env check (logjam-tools src/logjam-util.c, same name)."""
    return b"-" in value and _DEVICE_STREAM_BYTES.fullmatch(value) is not None


def well_formed_topic(value: bytes) -> bool:
    """logjam-device's routing-key check (logjam-tools src/logjam-util.c, same name)."""
    return value.startswith(_DEVICE_TOPIC_PREFIXES)


def is_valid_app_env(value: bytes, *, grammar: str = "device") -> bool:
    if grammar == "device":
        return well_formed_stream_name(value)
    return _SEED_APP_ENV.fullmatch(value) is not None


def is_valid_topic(value: bytes, *, grammar: str = "device") -> bool:
    if grammar == "device":
        return well_formed_topic(value)
    return _SEED_TOPIC.fullmatch(value) is not None


def topic_text(topic: bytes) -> str:
    """A routing key as a record's topic: UTF-8, and any bytes that are not kept as they came
    (surrogateescape, as records.py stores every field), so outputs send the agent's bytes."""
    return topic.decode("utf-8", "surrogateescape")


# --- messages -------------------------------------------------------------------------------

# The first frame of logjam-device's reply when the request had no frame after the empty one.
UNKNOWN_APP_ENV = b"unknown-unknown"


@dataclass(frozen=True, slots=True)
class DataMessage:
    """A validated data message; ``body`` is decompressed, JSON (``content_type`` "json") or,
    as logjam-device forwards any body, whatever else the agent sent ("raw")."""

    app_env: str
    topic: str
    body: bytes
    meta: Meta
    content_type: str = "json"

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
            content_type=self.content_type,
        )


# Event times are stored as i64 nanoseconds (taproom.eventtime); a created-ms beyond that
# (year 2262) is garbage from the sender and is stored as 0, absent, and counted, rather than
# refusing the message. 0 is logjam-device's "unknown" and stays 0.
MAX_CREATED_MS = MAX_MS


def created_ns(created_ms: int, times: EventTimes | None = None) -> int:
    """A meta frame's created-ms as a record's ``ts_ns`` by the event-time rule."""
    return (times or EventTimes()).ms(created_ms)


@dataclass(frozen=True, slots=True)
class PingMessage:
    """``ping`` in the app-env position: the agent checks the device is alive."""

    app_env: str  # what the agent sent in the topic position (its own app-env), may be ""
    meta: Meta


def parse_message(
    frames: Sequence[bytes],
    *,
    max_body: int,
    max_decompressed: int,
    grammar: str = "device",
) -> DataMessage | PingMessage:
    """Validate four frames ``app-env topic body meta``; raises :class:`LogjamError`.

    A body that is not JSON is kept as it came (``content_type`` "raw"): logjam-device
    forwards bodies without looking at them, and refusing one would lose an agent's data."""
    if len(frames) != 4:
        raise LogjamError(f"{len(frames)} frames, expected 4", reason="bad_frame_count")
    app_env, topic, body, meta_frame = frames
    meta = parse_meta(meta_frame)
    if app_env == PING:
        # The ping's second frame is the agent's app-env (or empty); nothing is stored.
        return PingMessage(topic.decode("ascii", "replace")[:255], meta)
    if not is_valid_app_env(app_env, grammar=grammar):
        raise LogjamError("app-env does not match the grammar", reason="bad_app_env")
    if not is_valid_topic(topic, grammar=grammar):
        raise LogjamError("topic does not match the grammar", reason="bad_topic")
    if len(body) > max_body:
        raise LogjamLimit(f"body is {len(body)} bytes, at most {max_body}", reason="body_too_large")
    data = decompress(meta.compression, body, max_decompressed)
    try:
        orjson.loads(data)
    except orjson.JSONDecodeError:
        content_type = "raw"
    else:
        content_type = "json"
    # Both grammars keep app-envs to ASCII; a device routing key is any bytes after its prefix.
    return DataMessage(app_env.decode("ascii"), topic_text(topic), data, meta, content_type)


def reply_frames(
    routing_id: bytes, content: Sequence[bytes], status: bytes, *more: bytes
) -> list[bytes]:
    """The ROUTER's reply to a message that asked for one (an empty frame after the routing
    id), as logjam-device builds it in read_router_message_and_forward: the routing id, the
    message's first frame after the empty one (its app-env, or "ping"; ``unknown-unknown``
    when there is none), the status, then for a ping the device's host name."""
    return [routing_id, content[0] if content else UNKNOWN_APP_ENV, status, *more]


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
