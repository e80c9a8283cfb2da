"""Mapping stored records of any protocol to logjam messages, for the PUB output and replay
(rules in docs/protocols/logjam.md, "Output mapping")."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import orjson

from ...records import Record

__all__ = ["OutputMapper"]

# A stream of another protocol becomes the app-env only where it names an application and an
# environment the way an importer splits them (extract_app_env in logjam-tools'
# src/logjam-util.c: at the last "-", both sides non-empty) with names it can use as database
# and file names (letters, digits, "_"). Stricter than what logjam-device takes from an agent
# (well_formed_stream_name, in messages.py) on purpose: here taproom picks the app-env, and a
# file path or a host:port is no application name; such streams get default_app_env.
_NAMED_APP_ENV = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_\-]*-[A-Za-z0-9_]+")


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
            if protocol == "logjam" or _NAMED_APP_ENV.fullmatch(stream):
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
