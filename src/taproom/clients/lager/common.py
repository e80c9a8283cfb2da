"""What the Lager clients share: errors, addresses, and the taproom-only topics."""

from __future__ import annotations

from ...errors import TaproomError

__all__ = [
    "FORWARDER_OFFSET",
    "HELLO_PREFIX",
    "MARK_PREFIX",
    "DuplicateTap",
    "LagerClientError",
    "base",
    "forwarder_base",
    "tcp",
]

# Must match taproom.servers.lager.HELLO_PREFIX (clients do not import the server).
HELLO_PREFIX = b"\x00taproom-lager-hello/"
# Must match taproom.servers.lager.MARK_PREFIX: topic MARK_PREFIX + uuid, u64 count, u64 epoch.
MARK_PREFIX = b"\x00taproom-lager-mark/"
# nasa/lager's layout: the forwarder's tap side is the registrar's base port + 10.
FORWARDER_OFFSET = 10


class LagerClientError(TaproomError):
    """A Lager client could not do what was asked (timeout, bad address, unknown tap)."""


class DuplicateTap(LagerClientError):
    """The registrar holds this tap's key for another uuid ("avoid duplicate Tap registration")."""


def base(address: str) -> tuple[str, int]:
    address = address.removeprefix("tcp://")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise LagerClientError(f"address {address!r} is not host:port")
    return host, int(port)


def tcp(host: str, port: int) -> str:
    return f"tcp://{host}:{port}"


def forwarder_base(registrar: str, forwarder: str | None) -> tuple[str, int]:
    """The forwarder's base ``(host, F)``: as given, else nasa/lager's registrar port + 10."""
    if forwarder is not None:
        return base(forwarder)
    host, port = base(registrar)
    return host, port + FORWARDER_OFFSET
