"""Restart: the hashmap checkpoint file beside the journal, and the state rebuilt from it plus
the journal tail."""

from __future__ import annotations

import logging
import os
import struct
from collections import deque

import msgpack

from ...checkpoint import discard_checkpoint, load_checkpoint, save_checkpoint
from ...hub import Hub
from ...journal.kinds import Kind
from ...protocols.eventbus import SEQUENCE
from .state import CHP, EXPIRES_MS, FRAMES, PROTOCOL, SEQ, BusState, replay_entries

log = logging.getLogger("taproom.eventbus")

# Version 2 adds each entry's CHP part and expiry, and each recent UUID's sequence. A version 1
# file is not read: the state then comes from the journal alone, as without a checkpoint.
_CHECKPOINT_MAGIC = b"TAPROOM-EVENTBUS-CHECKPOINT-2\n"
BUS_KIND = Kind(PROTOCOL)
# Hashmap entries packed in one msgpack call while a checkpoint is written (~2-3 ms of GIL).
PACK_RUN = 2048


def checkpoint_path(hub: Hub) -> str:
    return os.path.join(hub.config.journal.dir, "eventbus", "checkpoint")


def write_checkpoint(path: str, state: BusState) -> None:
    """Save ``state`` atomically (:func:`taproom.checkpoint.save_checkpoint`). It runs in a
    thread beside the loop, and one msgpack call holds the GIL to its end: the entries are
    packed :data:`PACK_RUN` at a time (100,000 keys packed in one call held the loop for
    110-130 ms; issue 32), the same bytes as :func:`packed_whole`'s one call."""
    packer = msgpack.Packer(use_bin_type=True)
    entries = list(state.hashmap.values())
    head = (
        packer.pack_array_header(4)
        + packer.pack(state.offset)
        + packer.pack(state.sequence)
        + packer.pack_array_header(len(entries))
    )
    body: list[bytes | memoryview] = [head]
    for start in range(0, len(entries), PACK_RUN):
        # each run's rows made and dropped in turn: 100,000 rows alive at once set off a full
        # collection of the cyclic GC (tens of ms, GIL held) in the middle of the checkpoint
        run = [[*e[FRAMES], e[CHP], e[EXPIRES_MS]] for e in entries[start : start + PACK_RUN]]
        # a run as an array, less its header: 1 byte up to 15 items, else 3 (PACK_RUN < 65536)
        body.append(memoryview(packer.pack(run))[1 if len(run) < 16 else 3 :])
    body.append(packer.pack(state.recent_uuids))
    save_checkpoint(path, _CHECKPOINT_MAGIC, body)


def packed_whole(state: BusState) -> bytes:
    """The checkpoint's body packed in one call: what :func:`write_checkpoint` writes."""
    return msgpack.packb(
        [
            state.offset,
            state.sequence,
            [[*e[FRAMES], e[CHP], e[EXPIRES_MS]] for e in state.hashmap.values()],
            state.recent_uuids,
        ],
        use_bin_type=True,
    )


def read_checkpoint(path: str) -> BusState | None:
    """The saved state, or None when there is none or it does not verify."""
    body = load_checkpoint(path, _CHECKPOINT_MAGIC)
    if body is None:
        return None
    try:
        offset, sequence, rows, uuids = msgpack.unpackb(body, raw=False, use_list=False)
        state = BusState(offset=offset, sequence=sequence, from_checkpoint=True)
        state.recent_uuids = [(key, seq) for key, seq in uuids]
        for row in rows:
            frames = tuple(row[:6])
            chp = (row[6][0], row[6][1]) if row[6] is not None else None
            state.hashmap[row[0]] = (SEQUENCE.unpack(row[1])[0], frames, chp, row[7], None)
    except (ValueError, TypeError, IndexError, struct.error) as exc:  # a bug (the CRC passed)
        log.warning("eventbus: %s unreadable (%s); scanning the journal", path, exc)
        return None
    return state


def rebuild_state(hub: Hub, dedup_window: int, path: str | None = None) -> BusState:
    """The checkpoint at ``path`` (if any and usable) plus the bus records after it; run it in
    a thread. Without a checkpoint every bus record of the journal is read. Either way the
    journal's index (taproom.journal.kinds) skips the frames holding no bus record."""
    journal = hub.journal
    state = read_checkpoint(path) if path else None
    if state is not None and state.offset > journal.opened_end_offset:
        # The journal lost a tail the checkpoint had seen (fsync = "interval" and a crash):
        # its offsets may hold other events now, so trust the journal alone.
        log.warning(
            "eventbus: the checkpoint covers offsets up to %d, past the journal's end (%d) "
            "when it was opened; reading the journal",
            state.offset,
            journal.opened_end_offset,
        )
        assert path is not None
        discard_checkpoint(path)
        state = None
    if state is None:
        state = BusState()
    else:
        state.checkpoint_offset = state.offset
        if state.offset < journal.first_offset:
            log.warning(
                "eventbus: retention deleted offsets %d-%d before a checkpoint covered them; "
                "their bus events are not in the state",
                state.offset,
                journal.first_offset - 1,
            )
    hashmap = state.hashmap
    uuids: deque[tuple[str, int]] = deque(state.recent_uuids, maxlen=max(dedup_window, 1))
    start = max(state.offset, journal.first_offset)
    end = journal.end_offset
    replayed = 0
    sequence = state.sequence
    for base, _count, body in journal.read_batches(start, end, kind=BUS_KIND):
        for seq, entry, uuid in replay_entries(body, base, start, end):
            replayed += 1
            if entry is None:  # a reset marker: the state copied from a Binary Star peer
                hashmap.clear()
                sequence = seq
                continue
            topic = entry[FRAMES][0]
            current = hashmap.get(topic)
            if current is None or current[SEQ] < seq:
                if entry[FRAMES][5]:
                    hashmap[topic] = entry
                else:  # a deletion
                    hashmap.pop(topic, None)
            if seq > sequence:
                sequence = seq
            uuids.append((uuid, seq))
    state.sequence = sequence
    state.recent_uuids = list(uuids) if dedup_window else []
    state.offset = end
    state.replayed = replayed
    return state
