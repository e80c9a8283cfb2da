"""Restart: the hashmap checkpoint file beside the journal, and the state rebuilt from it plus
the journal tail."""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import deque

import msgpack

from ...hub import Hub
from ...protocols.eventbus import (
    SEQUENCE,
)
from .state import PROTOCOL, BusState

log = logging.getLogger("taproom.eventbus")

_CHECKPOINT_MAGIC = b"TAPROOM-EVENTBUS-CHECKPOINT-1\n"


def checkpoint_path(hub: Hub) -> str:
    return os.path.join(hub.config.journal.dir, "eventbus", "checkpoint")


def write_checkpoint(path: str, state: BusState) -> None:
    """Save ``state`` atomically: temp file, fsync, rename, fsync the directory."""
    body = msgpack.packb(
        [
            state.offset,
            state.sequence,
            [list(frames) for _seq, frames in state.hashmap.values()],
            state.recent_uuids,
        ],
        use_bin_type=True,
    )
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, _CHECKPOINT_MAGIC + struct.pack(">I", zlib.crc32(body)) + body)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def read_checkpoint(path: str) -> BusState | None:
    """The saved state, or None when there is none or it does not verify."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    head = len(_CHECKPOINT_MAGIC)
    if not blob.startswith(_CHECKPOINT_MAGIC) or len(blob) < head + 4:
        log.warning("eventbus: %s is not a checkpoint; scanning the journal", path)
        return None
    (crc,) = struct.unpack_from(">I", blob, head)
    body = blob[head + 4 :]
    if zlib.crc32(body) != crc:
        log.warning("eventbus: %s fails its CRC; scanning the journal", path)
        return None
    try:
        offset, sequence, rows, uuids = msgpack.unpackb(body, raw=False, use_list=False)
        state = BusState(offset=offset, sequence=sequence, from_checkpoint=True)
        state.recent_uuids = list(uuids)
        for row in rows:
            seq = SEQUENCE.unpack(row[1])[0]
            state.hashmap[row[0]] = (seq, tuple(row))
    except (ValueError, TypeError, struct.error) as exc:  # a bug, not disk damage (CRC passed)
        log.warning("eventbus: %s unreadable (%s); scanning the journal", path, exc)
        return None
    return state


def rebuild_state(hub: Hub, dedup_window: int, path: str | None = None) -> BusState:
    """The checkpoint at ``path`` (if any and usable) plus the journal after it; run it in a
    thread. Without a checkpoint every bus record of the journal is read."""
    journal = hub.journal
    state = read_checkpoint(path) if path else None
    if state is not None and state.offset > journal.end_offset:
        # The journal lost a tail the checkpoint had seen (fsync = "interval" and a crash):
        # the offsets no longer match, so trust the journal alone.
        log.warning("eventbus: checkpoint is ahead of the journal; scanning the journal")
        state = None
    if state is None:
        state = BusState()
    hashmap = state.hashmap
    uuids: deque[str] = deque(state.recent_uuids, maxlen=max(dedup_window, 1))
    pack = SEQUENCE.pack
    for record in journal.read(max(state.offset, journal.first_offset)):
        if record.protocol != PROTOCOL:
            continue
        if record.attrs.get("eventbus") == "reset":
            hashmap.clear()
            state.sequence = record.seq
            continue
        topic = record.topic.encode()
        current = hashmap.get(topic)
        if current is None or current[0] < record.seq:
            hashmap[topic] = (
                record.seq,
                (
                    topic,
                    pack(record.seq),
                    record.producer.encode(),
                    str(record.attrs.get("timestamp", "")).encode(),
                    record.event_id.encode(),
                    record.payload,
                ),
            )
        state.sequence = max(state.sequence, record.seq)
        uuids.append(record.event_id)
    state.recent_uuids = list(uuids) if dedup_window else []
    state.offset = journal.end_offset
    return state
