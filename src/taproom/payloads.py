"""Decoding stored payloads for people and outputs (``taproom tail``, logjam PUB, live views).

The ack path stores payload bytes untouched with a ``content_type``; this module turns them
into JSON-ready values off that path. Protocol modules register decoders for their own types
(``protobuf``, ``bson``, ``lager``) with :func:`register_decoder`.
"""

from __future__ import annotations

import base64
import datetime
from collections.abc import Callable

import orjson

__all__ = ["decode_payload", "json_ready", "register_decoder"]

_DECODERS: dict[str, Callable[[bytes], object]] = {}
# Content types whose decoders live in a protocol module, imported on first use.
_LAZY = {"protobuf": "taproom.protocols.logtk.entries", "bson": "taproom.protocols.logtk.entries"}


def register_decoder(content_type: str, decoder: Callable[[bytes], object]) -> None:
    """Make ``decode_payload`` use ``decoder`` for ``content_type``."""
    _DECODERS[content_type] = decoder


def json_ready(value: object) -> object:
    """``value`` with only JSON types left. Dates carry their zone (a naive one is UTC, as BSON
    and msgpack dates are), bytes become ``{"base64": ...}``, anything else its ``str``."""
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    if isinstance(value, datetime.datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=datetime.UTC)
        return value.isoformat()
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)  # ObjectId, Regex, Decimal128, out-of-range dates, ...


def _json(payload: bytes) -> object:
    return orjson.loads(payload)


register_decoder("json", _json)
register_decoder("kv", _json)


def _msgpack(payload: bytes) -> object:
    import msgpack

    def ext(code: int, data: bytes) -> object:
        return {"ext": code, "base64": base64.b64encode(data).decode("ascii")}

    # timestamp=3: the timestamp extension as an aware UTC datetime
    value = msgpack.unpackb(payload, raw=False, strict_map_key=False, timestamp=3, ext_hook=ext)
    return json_ready(value)


register_decoder("msgpack", _msgpack)


def decode_payload(content_type: str, payload: bytes) -> object:
    """A JSON-ready value for ``payload``; text or ``{"base64": ...}`` when it cannot decode."""
    decoder = _DECODERS.get(content_type)
    if decoder is None and content_type in _LAZY:
        import importlib

        try:
            importlib.import_module(_LAZY.pop(content_type))
        except ImportError:
            pass
        decoder = _DECODERS.get(content_type)
    if decoder is not None:
        try:
            return decoder(payload)
        except Exception:  # a stored payload that does not decode is shown, not fatal
            pass
    try:
        return payload.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(payload).decode("ascii")}
