"""Logjam over ZeroMQ, sans-I/O: lists of frames in, typed messages out, and back.

A logjam data message is four ZeroMQ frames: ``app-env``, ``topic``, a (possibly compressed)
JSON ``body`` and a binary ``meta`` frame (seed ``logjam-consumer.txt``). The package parses
and validates such frame lists and builds them for output:

* ``codec``: the meta frame (22 and 24 bytes), compression with a size bound, the error types;
* ``messages``: the app-env/topic grammar, :func:`parse_message`, the ROUTER envelope;
* ``ingest``: :class:`IngestParser`, the hot path writing journal records directly;
* ``output``: :class:`OutputMapper`, any stored record as a logjam message;
* ``replay``: requests of the replay side channel.

It imports nothing from socket, asyncio or zmq and never reads the clock: the caller passes
"now" where a message needs a time. The pyzmq glue is :mod:`taproom.servers.logjam`.
"""

from __future__ import annotations

from .codec import (
    ACCEPTED,
    BAD_REQUEST,
    EMPTY_META,
    HEARTBEAT_APP_ENV,
    META_TAG,
    META_TAG_SWAPPED,
    META_VERSION,
    PING,
    PING_OK,
    Compression,
    LogjamError,
    LogjamLimit,
    Meta,
    compress,
    compression_by_name,
    decompress,
    encode_meta,
    parse_meta,
)
from .ingest import BURST_FULL, BurstFull, IngestedBody, IngestParser, Pushed
from .messages import (
    GRAMMARS,
    MAX_CREATED_MS,
    UNKNOWN_APP_ENV,
    DataMessage,
    PingMessage,
    created_ns,
    encode_message,
    is_valid_app_env,
    is_valid_topic,
    parse_message,
    reply_frames,
    topic_text,
    well_formed_stream_name,
    well_formed_topic,
)
from .output import OutputMapper
from .replay import (
    MAX_PREFIX_BYTES,
    ReplayMode,
    ReplayRequest,
    matches_prefixes,
    parse_replay_request,
    replay_error,
)

__all__ = [
    "ACCEPTED",
    "BAD_REQUEST",
    "BURST_FULL",
    "EMPTY_META",
    "GRAMMARS",
    "HEARTBEAT_APP_ENV",
    "MAX_CREATED_MS",
    "MAX_PREFIX_BYTES",
    "META_TAG",
    "META_TAG_SWAPPED",
    "META_VERSION",
    "PING",
    "PING_OK",
    "UNKNOWN_APP_ENV",
    "BurstFull",
    "Compression",
    "DataMessage",
    "IngestParser",
    "IngestedBody",
    "LogjamError",
    "LogjamLimit",
    "Meta",
    "OutputMapper",
    "PingMessage",
    "Pushed",
    "ReplayMode",
    "ReplayRequest",
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
    "replay_error",
    "reply_frames",
    "topic_text",
    "well_formed_stream_name",
    "well_formed_topic",
]
