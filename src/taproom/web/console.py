"""The console: static pages and the JSON API under ``/api/``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

if TYPE_CHECKING:
    from .server import WebServer

__all__ = ["add_routes"]


def add_routes(app: web.Application, server: WebServer) -> None:
    pass
