"""What a Lumberjack connection hands the glue (:class:`Window`), the bounds it works in
(:class:`Limits`), what the glue may give it (resend memory, compiled window kernels), and the
journal record layout its hot paths write directly."""

from __future__ import annotations

import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from ...records import RECORD_HEAD, RECORD_HEAD_AFTER_LEN, EncodedBatch
from .frames import FrameType, Version

STALL_ROOM = 1  # the next event needs more journal room (``room_wanted``)
STALL_INFLATE = 2  # inflating needs more room (``inflate_wanted``)
_UNBOUNDED = sys.maxsize


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds checked before anything read from the wire is allocated (see the server config).

    There is no bound on a window's or a ``C`` frame's size: they are streamed. A ``C`` frame
    holds at most the rest of its window (go-lumber's reader stops there too).
    """

    max_window: int = 10_000
    max_event_bytes: int = 12 * 1024 * 1024
    max_pairs: int = 1024
    max_nesting: int = 3
    max_batch_bytes: int = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Window:
    """Events ready for the journal: one part of a sender's window (or all of it).

    ``ack_seq`` is the sequence number to acknowledge once ``batch`` is durable (the highest
    received, never a count), or ``None`` when this part is not to be acknowledged (v1 parts
    before the window's end: a v1 client takes any ack as its window's). ``batch.count`` may
    be 0 (``W 0``, an idle flush with nothing new, or a part whose events were all recognised
    as already stored): the ack is owed at once, in order.

    ``done``: this part ends the sender's window. Parts of a window that is not done carry
    ``fingerprints`` (one per event of ``batch``, in order); ``skipped`` are the fingerprints
    of events at the start of this part recognised as already stored (not in ``batch``), and
    ``resent_of`` the key of the remembered window they matched (0: none).
    """

    batch: EncodedBatch
    ack_seq: int | None
    version: int
    done: bool = True
    fingerprints: tuple[int, ...] = ()
    skipped: tuple[int, ...] = ()
    resent_of: int = 0


# Journal record head (records.py layout): u32 rest, i64 received_ns, i64 ts_ns, u64 seq,
# u8 lp, u8 lc, u16 ls, lt, lr, le, u32 la, lp. Encoded here directly: records.BatchBuilder.add
# costs ~2.5 us per event, more than the whole rest of the v2 path; the format is checked
# against records.iter_batch by the tests.
_REC_HEAD = RECORD_HEAD
_REC_AFTER_LEN = RECORD_HEAD_AFTER_LEN
_SEQ_IN_HEAD = struct.Struct("<Q")  # at offset 20 of the head: after rest, received_ns, ts_ns
_U32LE = struct.Struct("<I")  # the head's first field (the rest's length); payload length at 42
_MAX_NAME_CHARS = 255  # a stream/topic value longer than this is not a name: ignored

_CT_KV = b"kv"
_CT_JSON = b"json"
# The journal's label for what a window holds (EncodedBatch.kinds): any content type.
_KINDS = frozenset({"lumberjack/*"})
_ATTRS = {0x31: b'{"v":"1"}', 0x32: b'{"v":"2"}'}
# Plain ints for the hot loop: comparing with IntEnum members is several times slower.
_VER1 = int(Version.V1)
_VER2 = int(Version.V2)
_T_W = int(FrameType.WINDOW)
_T_D = int(FrameType.DATA)
_T_J = int(FrameType.JSON)
_T_C = int(FrameType.COMPRESSED)
_T_A = int(FrameType.ACK)
_JSONDecodeError = orjson.JSONDecodeError


class ResendMemory(Protocol):
    """What the glue remembers of a sender's cut-off windows (a mapping will do)."""

    def __bool__(self) -> bool: ...

    def get(self, first: int, /) -> Sequence[int] | None: ...


class WindowKernel(Protocol):
    """The compiled window kernel of one set of paths (``servers.lumberjack.kernel.PathKernel``)."""

    def run(
        self,
        view: bytes,
        pos: int,
        end: int,
        version: int,
        max_event: int,
        tail: bytes,
        producer_len: int,
        received_ns: int,
        max_events: int,
        batch_room: int,
        room: int,
        count: int,
        high: int,
    ) -> Any: ...

    def records(self) -> bytes: ...


class WindowKernels(Protocol):
    """What the glue gives a connection: kernels by paths (``servers.lumberjack.kernel``)."""

    def for_paths(
        self, stream_fields: Sequence[str], topic_fields: Sequence[str]
    ) -> WindowKernel | None: ...


# lw_run's stops after which the frame at its position is Python's (the others: call again)
_KERNEL_HANDS_OVER = frozenset({0, 1, 2, 3})


def fingerprint(seq: int, payload: bytes) -> int:
    """What identifies an event in a resent window: its sequence number and its bytes (a
    resending sender numbers and encodes the window as before)."""
    return hash((seq, payload))


def _fingerprints(body: bytes) -> tuple[int, ...]:
    """The fingerprint of every record of a batch body, read from the records (each ends with
    its payload; the sequence number is in the head)."""
    unpack_len = _U32LE.unpack_from
    unpack_seq = _SEQ_IN_HEAD.unpack_from
    view = memoryview(body)  # hashes as the bytes it shows, without a copy
    found = []
    pos, end = 0, len(body)
    while pos < end:
        stop = pos + 4 + unpack_len(body, pos)[0]
        size = unpack_len(body, pos + 42)[0]
        found.append(hash((unpack_seq(body, pos + 20)[0], view[stop - size : stop])))
        pos = stop
    return tuple(found)


def _compile_paths(paths: Sequence[str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``"fields.app"`` -> ``("fields", ("app",))``: first key, then the rest of the walk."""
    compiled = []
    for path in paths:
        if path:
            first, *rest = path.split(".")
            compiled.append((first, tuple(rest)))
    return tuple(compiled)
