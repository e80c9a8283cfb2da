"""Decoding stored payloads for people and outputs (``taproom tail``, logjam PUB, live views).

The ack path stores payload bytes untouched with a ``content_type``; this module turns them
into JSON-ready values off that path. Protocol modules register decoders for their own types
(``protobuf``, ``bson``, ``lager``) with :func:`register_decoder`.
"""

from __future__ import annotations

import base64
from collections.abc import Callable

import orjson

__all__ = ["decode_payload", "register_decoder"]

_DECODERS: dict[str, Callable[[bytes], object]] = {}
# Content types whose decoders live in a protocol module, imported on first use.
_LAZY = {"protobuf": "taproom.protocols.logtk.entries", "bson": "taproom.protocols.logtk.entries"}


def register_decoder(content_type: str, decoder: Callable[[bytes], object]) -> None:
    """Make ``decode_payload`` use ``decoder`` for ``content_type``."""
    _DECODERS[content_type] = decoder


def _json(payload: bytes) -> object:
    return orjson.loads(payload)


register_decoder("json", _json)
register_decoder("kv", _json)


def _msgpack(payload: bytes) -> object:
    import msgpack

    return msgpack.unpackb(payload, raw=False, strict_map_key=False)


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
