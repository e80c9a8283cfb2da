"""Query parameters of the console's API, each bounded; a bad one is a 400 with a JSON reason."""

from __future__ import annotations

import re

import orjson
from aiohttp import web

__all__ = ["DATE", "bad_request", "choice", "date", "integer", "text"]

DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
MAX_TEXT = 256  # a filter, a key prefix or an app name; longer is a mistake or an attack


def bad_request(reason: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(
        text=orjson.dumps({"error": "bad_request", "reason": reason}).decode(),
        content_type="application/json",
    )


def integer(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    if len(raw) > 20 or not re.fullmatch(r"-?\d+", raw):
        raise bad_request(f"{name} must be an integer")
    value = int(raw)
    if not low <= value <= high:
        raise bad_request(f"{name} must be between {low} and {high}")
    return value


def text(request: web.Request, name: str, max_len: int = MAX_TEXT) -> str:
    value = request.query.get(name, "")
    if len(value) > max_len:
        raise bad_request(f"{name} is longer than {max_len} characters")
    if any(ord(c) < 32 for c in value):
        raise bad_request(f"{name} holds control characters")
    return value


def choice(request: web.Request, name: str, allowed: tuple[str, ...], default: str) -> str:
    value = request.query.get(name, default)
    if value not in allowed:
        raise bad_request(f"{name} must be one of {', '.join(allowed)}")
    return value


def date(request: web.Request, name: str = "date") -> str:
    value = request.query.get(name, "")
    if value and not DATE.match(value):
        raise bad_request(f"{name} must be YYYY-MM-DD")
    return value
