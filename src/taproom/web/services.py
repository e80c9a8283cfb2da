"""Read-only views of the running Lager and Event BUS services for the console.

The console reads two in-memory maps: the Lager registrar (tap key -> registration with its
format) and the Event BUS Clone hashmap (topic -> latest event). Both are read through the two
attributes named here, ``registrar`` and ``hashmap``, on the objects in ``App.services``, on the
event loop (so a page never sees a map mid-change). A service that is disabled, or
that no longer has the attribute, reads as absent (``None``), never as an error.
"""

from __future__ import annotations

import uuid as uuid_module
from collections.abc import Mapping
from typing import Any

import orjson

from ..payloads import decode_payload

__all__ = ["bus_entries", "lager_format", "lager_taps"]

PREVIEW_CHARS = 200  # a table cell; the whole value is in the journal record


def _preview(data: bytes) -> str:
    """The event's MessagePack data as JSON text, cut to a table cell."""
    value = decode_payload("msgpack", data)
    text = orjson.dumps(value, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    return text[:PREVIEW_CHARS]


def _registrar(services: Mapping[str, Any]) -> Any:
    """The registrar's map (a :class:`~taproom.protocols.lager.chp.Registrar`): the service's
    ``registrar``, or that object's own ``registrar`` where the service wraps the map in a
    server. Looked up on every call: a restore replaces the map."""
    node = services.get("lager")
    for _ in range(2):
        node = getattr(node, "registrar", None)
        if node is None or hasattr(node, "by_key"):
            return node
    return None


def lager_taps(services: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """Registered taps by key: uuid, registrar sequence and their items."""
    registrar = _registrar(services)
    if registrar is None:
        return None
    return [
        {
            "key": reg.key,
            "uuid": str(uuid_module.UUID(bytes=reg.uuid)),
            "sequence": reg.sequence,
            "row_size": reg.format.row_size,
            "items": [
                {
                    "name": item.name,
                    "type": item.type.name,
                    "count": item.count,
                    "numeric": item.type.name != "string",
                }
                for item in reg.format.items
            ],
        }
        for reg in registrar.snapshot()
    ]


def lager_format(services: Mapping[str, Any], key: str) -> Any:
    """The DataFormat registered for tap ``key``, or None."""
    registrar = _registrar(services)
    reg = None if registrar is None else registrar.by_key.get(key)
    return None if reg is None else reg.format


def bus_entries(
    services: Mapping[str, Any], subtree: str, limit: int
) -> tuple[list[dict[str, Any]], int] | None:
    """Hashmap entries whose topic starts with ``subtree`` (by topic, at most ``limit``) and
    how many matched in all; None without a running Event BUS."""
    hashmap = getattr(services.get("eventbus"), "hashmap", None)
    if hashmap is None:
        return None
    prefix = subtree.encode()
    # An entry is (sequence, the six BROADCAST frames, ...); empty data marks a deletion.
    matching = sorted(
        (key, entry[0], entry[1])
        for key, entry in list(hashmap.items())
        if key.startswith(prefix) and entry[1][5]
    )
    rows = []
    for _, seq, frames in matching[:limit]:
        topic, _, producer, timestamp, event_uuid, data = frames
        rows.append(
            {
                "topic": topic.decode("utf-8", "replace"),
                "sequence": seq,
                "producer": producer.decode("utf-8", "replace"),
                "timestamp": timestamp.decode("utf-8", "replace"),
                "uuid": event_uuid.decode("utf-8", "replace"),
                "size": len(data),
                "value": _preview(data),
            }
        )
    return rows, len(matching)
