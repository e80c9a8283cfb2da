"""Requests of the replay side channel, where a consumer fetches events it missed."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from .codec import LogjamError

__all__ = [
    "MAX_PREFIX_BYTES",
    "ReplayMode",
    "ReplayRequest",
    "matches_prefixes",
    "parse_replay_request",
    "replay_error",
]

_U64 = (1 << 64) - 1

# A replay prefix, like a consumer's subscription, is an app-env prefix: 255 bytes is plenty.
MAX_PREFIX_BYTES = 255


class ReplayMode(IntEnum):
    """How a replay request names where to start."""

    OFFSET = 1  # "offset" FROM MAX [PREFIX...]: journal offsets from FROM, at most MAX events
    SEQ = 2  # "seq" FROM TO [PREFIX...]: the PUB messages numbered FROM..TO (inclusive)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    mode: ReplayMode
    start: int
    limit: int  # OFFSET: max count; SEQ: the last sequence number wanted
    prefixes: tuple[bytes, ...]


_DECIMAL = re.compile(rb"[0-9]{1,20}")


def _decimal(frame: bytes, what: str) -> int:
    if _DECIMAL.fullmatch(frame) is None:
        raise LogjamError(f"{what} is not a decimal number", reason="bad_replay_request")
    value = int(frame)
    if value > _U64:
        raise LogjamError(f"{what} exceeds 64 bits", reason="bad_replay_request")
    return value


def parse_replay_request(
    frames: Sequence[bytes], *, max_count: int, max_prefixes: int = 16
) -> ReplayRequest:
    """Parse the frames after the envelope: ``mode from (max|to) [prefix ...]``."""
    if len(frames) < 3:
        raise LogjamError("replay request needs mode, from, count", reason="bad_replay_request")
    if len(frames) > 3 + max_prefixes:
        raise LogjamError("too many prefixes", reason="bad_replay_request")
    mode_name = frames[0]
    start = _decimal(frames[1], "from")
    second = _decimal(frames[2], "count")
    prefixes = tuple(frames[3:])
    if any(len(p) > MAX_PREFIX_BYTES for p in prefixes):
        raise LogjamError(
            f"prefix longer than {MAX_PREFIX_BYTES} bytes", reason="bad_replay_request"
        )
    if mode_name == b"offset":
        return ReplayRequest(ReplayMode.OFFSET, start, min(second, max_count), prefixes)
    if mode_name == b"seq":
        if second < start:
            raise LogjamError("seq range ends before it starts", reason="bad_replay_request")
        if second - start + 1 > max_count:
            second = start + max_count - 1
        return ReplayRequest(ReplayMode.SEQ, start, second, prefixes)
    raise LogjamError("replay mode must be 'offset' or 'seq'", reason="bad_replay_request")


def replay_error(status: bytes, reason: str) -> list[bytes]:
    """Frames of a failed replay reply: status, reason."""
    return [status, reason.encode()]


def matches_prefixes(app_env: bytes, prefixes: Sequence[bytes]) -> bool:
    """ZeroMQ subscription semantics: no prefixes or an empty one matches everything."""
    if not prefixes:
        return True
    return any(app_env.startswith(p) for p in prefixes)
