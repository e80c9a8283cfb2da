"""Exactly-once by idempotency: the index of committed (app, client id, idem) keys, and how it
survives a restart: a checkpoint beside the journal plus the journal's tail.

The journal stays the only truth. The checkpoint says up to which journal offset it covers every
LogTK record; a restart loads it and reads only the records after that offset. A checkpoint that
is missing, damaged (CRC) or ahead of the journal is ignored and the window is read from the
journal, as before checkpoints existed.
"""

from __future__ import annotations

import itertools
import logging
import struct
from collections import Counter, deque
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from ...checkpoint import discard_checkpoint, load_checkpoint, save_checkpoint
from ...journal import Journal
from ...journal.kinds import Kind
from ...records import RECORD_HEAD

__all__ = ["DedupIndex", "Snapshot", "read_checkpoint", "rebuild", "write_checkpoint"]

log = logging.getLogger("taproom.logtk")

_MAGIC = b"TAPROOM-LOGTK-DEDUP-1\n"
_U32 = np.dtype("<u4")
# Frozen keys are stored as ``key << TAG_BITS | tag``: sorted by key, each carrying its time
# bucket (an index into a table of bucket starts). A window holds at most BUCKETS + 2 live and
# as many frozen buckets, well under 2**TAG_BITS; a key then has 58 bits (2**26 slots).
TAG_BITS = 6
_TAG_MASK = (1 << TAG_BITS) - 1
_MAX_KEY = (1 << (64 - TAG_BITS)) - 1
_NONE = np.zeros(0, dtype=np.uint64)
LOGTK_KIND = Kind("logtk")
_CHUNK = 65536  # keys converted per step while the loop may want the GIL

U64Array = np.ndarray[Any, np.dtype[np.uint64]]


class DedupIndex:
    """Committed keys (``slot << 32 | idem``, one slot per app and client id) seen within
    ``window_s``.

    Keys committed while running are *live*: one set for lookups, and lists per time bucket
    for expiry (a whole bucket expires at once; over ``max_entries`` the oldest goes early and
    ``evicted`` counts its keys). Keys loaded from a checkpoint stay *frozen*: one sorted numpy
    array of ``key << TAG_BITS | bucket tag``, loaded without making a Python object per key
    (millions load in a fraction of a second), searched by bisection, shrinking as its buckets
    expire. Frozen buckets are never newer than live ones, so they go first.
    """

    BUCKETS = 16

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._bucket_s = window_s / self.BUCKETS
        self._keys: set[int] = set()
        self._buckets: deque[tuple[float, list[int]]] = deque()
        self._slots: dict[tuple[str, int], int] = {}
        # A slot number lives while a session holds it or a key in the index carries it; then
        # expire() frees it for reuse, so clients that come and go (or change their client id)
        # never grow the table beyond the keys and sessions it has to serve.
        self._slot_keys: Counter[int] = Counter()  # slot -> keys in the index
        self._held: Counter[int] = Counter()  # slot -> sessions (with commits in flight)
        self._free: list[int] = []  # numbers given back, reused before new ones
        self._next_slot = 1
        self._frozen: U64Array = _NONE
        self._frozen_starts: list[float] = []  # tag -> bucket start
        self.evicted = 0
        self.added = 0  # keys added since the index was made (checkpoints by progress)
        # Every LogTK record below this journal offset is in the index (see Snapshot).
        self.covered_offset = 0

    def __len__(self) -> int:
        return len(self._keys) + len(self._frozen)

    @property
    def frozen(self) -> int:
        """Keys loaded from a checkpoint and not expired yet."""
        return len(self._frozen)

    @property
    def slots(self) -> int:
        """(app, client id) pairs with a slot number now."""
        return len(self._slots)

    def slot(self, app: str, client_id: int) -> int:
        """The key prefix of one (app, client id): ``slot << 32``."""
        key = (app, client_id)
        slot = self._slots.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                slot = self._next_slot
                self._next_slot += 1
            self._slots[key] = slot
        return slot << 32

    def acquire(self, app: str, client_id: int) -> int:
        """:meth:`slot`, held for a session until :meth:`release` (its number is not reused
        while the session may still commit keys under it)."""
        prefix = self.slot(app, client_id)
        self._held[prefix >> 32] += 1
        return prefix

    def release(self, prefix: int) -> None:
        slot = prefix >> 32
        self._held[slot] -= 1
        if self._held[slot] <= 0:
            del self._held[slot]

    def __contains__(self, key: object) -> bool:
        if key in self._keys:
            return True
        frozen = self._frozen
        if not len(frozen) or not isinstance(key, int) or key > _MAX_KEY:
            return False
        i = int(frozen.searchsorted(np.uint64(key << TAG_BITS)))
        return i < len(frozen) and int(frozen[i]) >> TAG_BITS == key

    def known(self, keys: list[int]) -> Container[int]:
        """The subset of ``keys`` remembered, the frozen part searched once for all of them."""
        if not len(self._frozen):
            return self
        found = {key for key in keys if key in self._keys}
        wanted = np.array(
            [key for key in keys if key not in found and key <= _MAX_KEY], dtype=np.uint64
        )
        frozen = self._frozen
        at = frozen.searchsorted(wanted << TAG_BITS).clip(0, len(frozen) - 1)
        found.update(wanted[frozen[at] >> TAG_BITS == wanted].tolist())
        return found

    def add(self, key: int, when: float) -> None:
        """Remember ``key`` as committed at wall-clock ``when`` (seconds)."""
        if key in self._keys:
            return
        self._bucket(when).append(key)
        self._keys.add(key)
        self._slot_keys[key >> 32] += 1
        self.added += 1
        self._bound()

    def add_many(self, keys: list[int], when: float) -> None:
        """:meth:`add` for a commit's worth of keys."""
        before = len(self._keys)
        self._keys.update(keys)
        if len(self._keys) - before != len(keys):
            # Some were known already (a rebuild racing a resend): keep one entry per key.
            self._keys.difference_update(keys)
            for key in keys:
                self.add(key, when)
            return
        self._bucket(when).extend(keys)
        self._slot_keys.update(key >> 32 for key in keys)
        self.added += len(keys)
        self._bound()

    def _bucket(self, when: float) -> list[int]:
        start = when - when % self._bucket_s
        if not self._buckets or self._buckets[-1][0] < start:
            self._buckets.append((start, []))
        return self._buckets[-1][1]

    def _bound(self) -> None:
        while len(self) > self.max_entries and (self.frozen or len(self._buckets) > 1):
            self.evicted += self._drop_oldest()

    def _drop_oldest(self) -> int:
        if self.frozen:
            tags = np.unique(self._frozen & _TAG_MASK).tolist()
            oldest = min(tags, key=self._frozen_starts.__getitem__)
            return self._drop_frozen([oldest])
        _, dropped = self._buckets.popleft()
        self._keys.difference_update(dropped)
        self._slot_keys.subtract(key >> 32 for key in dropped)
        return len(dropped)

    def _drop_frozen(self, tags: list[int]) -> int:
        drop = np.isin(self._frozen & _TAG_MASK, tags)
        self._count_frozen(self._frozen[drop], -1)
        self._frozen = self._frozen[~drop]
        return int(drop.sum())

    def _count_frozen(self, frozen: U64Array, sign: int) -> None:
        slots, counts = np.unique(frozen >> np.uint64(32 + TAG_BITS), return_counts=True)
        self._slot_keys.update(dict(zip(slots.tolist(), (sign * counts).tolist(), strict=True)))

    def _free_slots(self) -> None:
        """Give back the numbers of slots no session holds and no key carries."""
        unused = {slot for slot, n in self._slot_keys.items() if n <= 0}
        for slot in unused:
            del self._slot_keys[slot]
        for pair, slot in list(self._slots.items()):
            if slot not in self._slot_keys and slot not in self._held:
                del self._slots[pair]
                self._free.append(slot)

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s - self._bucket_s
        while self._buckets and self._buckets[0][0] < cutoff:
            self._drop_oldest()
        if self.frozen:
            old = [tag for tag, start in enumerate(self._frozen_starts) if start < cutoff]
            if old:
                self._drop_frozen(old)
        self._free_slots()

    # --- checkpoint -----------------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """What a checkpoint needs, taken in one step on the loop; :func:`write_checkpoint`
        does the rest in a thread (live bucket lists only grow, frozen arrays never change)."""
        return Snapshot(
            self.covered_offset,
            dict(self._slots),
            [(start, keys, len(keys)) for start, keys in self._buckets],
            self._frozen,
            list(self._frozen_starts),
        )

    def restore(self, snapshot: Snapshot, now: float) -> None:
        """Take a loaded checkpoint's keys as the frozen part (the index must be empty)."""
        assert not len(self) and not self._slots, "restore into an empty index"
        self._slots = dict(snapshot.slots)
        self._next_slot = max(self._slots.values(), default=0) + 1
        self._frozen = snapshot.frozen
        self._count_frozen(self._frozen, 1)
        self._frozen_starts = list(snapshot.frozen_starts)
        self.covered_offset = snapshot.covered_offset
        self.expire(now)
        self._bound()


@dataclass
class Snapshot:
    """The index at one moment, as a checkpoint stores it."""

    covered_offset: int
    slots: dict[tuple[str, int], int]
    live: list[tuple[float, list[int], int]] = field(default_factory=list)  # (start, keys, n)
    frozen: U64Array = field(default_factory=lambda: _NONE)  # key << TAG_BITS | tag, sorted
    frozen_starts: list[float] = field(default_factory=list)


def _live_keys(bucket: list[int], count: int) -> U64Array:
    """The first ``count`` keys of a live bucket as an array (those within the checkpoint's key
    space), converted a chunk at a time so the event loop is never held up for long."""
    parts = [
        np.fromiter(itertools.islice(bucket, at, min(at + _CHUNK, count)), dtype=np.uint64)
        for at in range(0, count, _CHUNK)
    ]
    keys = np.concatenate(parts) if parts else _NONE
    return keys[keys <= _MAX_KEY] if len(keys) and keys.max() > _MAX_KEY else keys


def _merge(a: U64Array, b: U64Array) -> U64Array:
    """Two sorted arrays as one, in linear time after a search of the smaller in the larger."""
    if not len(a) or not len(b):
        return b if not len(a) else a
    if len(a) < len(b):
        a, b = b, a
    at = a.searchsorted(b) + np.arange(len(b))
    out = np.empty(len(a) + len(b), dtype=np.uint64)
    from_a = np.ones(len(out), dtype=bool)
    from_a[at] = False
    out[at] = b
    out[from_a] = a
    return out


def write_checkpoint(path: str, snapshot: Snapshot) -> int:
    """Save ``snapshot`` (in a thread); returns the number of keys saved. Layout after the
    checkpoint header: u32 length of a JSON header, the header (padded so what follows is
    8-byte aligned), then the keys as ``key << TAG_BITS | tag`` (u64, little endian, sorted)."""
    # Number the buckets anew, oldest first, keeping only those with keys.
    frozen = snapshot.frozen
    used = (
        np.flatnonzero(np.bincount(frozen & _TAG_MASK, minlength=1)).tolist() if len(frozen) else []
    )
    starts = sorted(
        {snapshot.frozen_starts[t] for t in used} | {s for s, _, n in snapshot.live if n}
    )
    if len(starts) > _TAG_MASK + 1:
        raise ValueError(f"{len(starts)} time buckets: more than a checkpoint can tag")
    tag_of = {start: tag for tag, start in enumerate(starts)}
    if len(frozen):
        renumber = np.zeros(_TAG_MASK + 1, dtype=np.uint64)
        for old in used:
            renumber[old] = tag_of[snapshot.frozen_starts[old]]
        frozen = (frozen & ~np.uint64(_TAG_MASK)) | renumber[frozen & _TAG_MASK]
    live = []
    for start, bucket, count in snapshot.live:
        if count:
            # A key beyond _MAX_KEY (past 2**26 clients) is left out, never wrapped around.
            keys = _live_keys(bucket, count)
            if len(keys) < count:
                log.warning("logtk: %d keys beyond the checkpoint's key space", count - len(keys))
            live.append((keys << TAG_BITS) | np.uint64(tag_of[start]))
    fresh = np.concatenate(live) if live else _NONE
    fresh.sort()
    keys = _merge(frozen, fresh)
    # A key both frozen and live (resent after a restart): keep the newer, which sorts last.
    if len(keys) > 1:
        newest = np.ones(len(keys), dtype=bool)
        newest[:-1] = keys[:-1] >> TAG_BITS != keys[1:] >> TAG_BITS
        keys = keys[newest]
    header = orjson.dumps(
        {
            "covered_offset": snapshot.covered_offset,
            "starts": starts,
            "slots": [[app, client, slot] for (app, client), slot in snapshot.slots.items()],
            "keys": len(keys),
        }
    )
    header += b" " * (-(4 + len(header)) % 8)
    length = np.array([len(header)], dtype=_U32).tobytes()
    save_checkpoint(path, _MAGIC, [length, header, keys.astype("<u8", copy=False).data])
    return len(keys)


def read_checkpoint(path: str) -> Snapshot | None:
    """The snapshot saved at ``path``; None when there is none or it is not usable."""
    body = load_checkpoint(path, _MAGIC)
    if body is None:
        return None
    try:
        (size,) = np.frombuffer(body, dtype=_U32, count=1)
        header = orjson.loads(body[4 : 4 + size])
        keys = np.frombuffer(body, dtype="<u8", count=int(header["keys"]), offset=4 + int(size))
        slots = {(str(app), int(client)): int(slot) for app, client, slot in header["slots"]}
        return Snapshot(
            int(header["covered_offset"]),
            slots,
            frozen=keys.astype(np.uint64, copy=False),
            frozen_starts=[float(s) for s in header["starts"]],
        )
    except (ValueError, KeyError, TypeError) as exc:  # a bug, not disk damage (CRC passed)
        log.warning("logtk: %s unreadable (%s); the journal is read instead", path, exc)
        return None


# --- start-up -------------------------------------------------------------------------------


# The record head up to the producer's length: all a rebuild needs (records.RECORD_HEAD).
_KEY_HEAD = struct.Struct("<IqqQBBHHH")
_LOGTK = b"logtk"


def _read_keys(index: DedupIndex, journal: Journal, lo: int, hi: int, cutoff_ns: int) -> int:
    """Add the keys of the LogTK records in ``[lo, hi)`` received after ``cutoff_ns``, walked
    straight from the journal's bytes (a restart may read millions: ~1 us a record). The
    journal's index skips the frames of other protocols; damaged frames are skipped by its
    reader, as everywhere. Returns the records read."""
    unpack = _KEY_HEAD.unpack_from
    head = RECORD_HEAD.size
    slots: dict[tuple[bytes, bytes], int] = {}
    bucket_ns = int(index.window_s / index.BUCKETS * 1e9)
    keys: list[int] = []  # of one time bucket, added at once (a set update, not one by one)
    bucket = when_ns = count = 0
    for base, _count, body in journal.read_batches(lo, hi, kind=LOGTK_KIND):
        offset = base
        pos = 0
        size = len(body)
        # A batch is one session's: the same app and client record after record.
        last: tuple[int, int, bytes] | None = None
        slot = -1
        while pos < size and offset < hi:
            length, received_ns, _ts, idem, lp, lc, ls, lt, lr = unpack(body, pos)
            q = pos + head
            if offset >= lo and received_ns >= cutoff_ns and body[q : q + lp] == _LOGTK:
                q += lp + lc
                ident = (ls, lt, body[q : q + ls + lt + lr])
                if ident != last:
                    last = ident
                    slot = _slot(index, slots, ident[2][:ls], ident[2][ls + lt :])
                if slot >= 0:
                    if received_ns // bucket_ns != bucket:
                        if keys:
                            index.add_many(keys, when_ns / 1e9)
                            count += len(keys)
                            keys = []
                        bucket = received_ns // bucket_ns
                    keys.append(slot | idem)
                    when_ns = received_ns
            pos += 4 + length
            offset += 1
    if keys:
        index.add_many(keys, when_ns / 1e9)
        count += len(keys)
    return count


def _slot(
    index: DedupIndex, slots: dict[tuple[bytes, bytes], int], stream: bytes, producer: bytes
) -> int:
    """The key prefix of one (app, client id); -1 for a producer that is no client id."""
    slot = slots.get((stream, producer))
    if slot is None:  # producer is the client id in hex (docs/protocols/logtk.md)
        try:
            client_id = int(producer, 16)
        except ValueError:
            return -1
        app = stream.decode("utf-8", "surrogateescape")
        slot = slots[(stream, producer)] = index.slot(app, client_id)
    return slot


def _window_start(journal: Journal, cutoff_ns: int) -> int:
    """The first offset worth reading: whole segments older than the window are skipped."""
    start = journal.first_offset
    for seg in reversed(journal.segments()):
        if seg.base_offset <= start:
            break
        first = next(journal.read(seg.base_offset, seg.base_offset + 1), None)
        if first is not None and first.received_ns < cutoff_ns:
            return seg.base_offset
    return start


def rebuild(
    index: DedupIndex, journal: Journal, path: str | None, max_records: int, now: float
) -> tuple[int, int | None]:
    """Fill the empty ``index``: the checkpoint at ``path`` when usable, then the journal's
    LogTK records after it (or, without one, every record in the window), at most the last
    ``max_records``. Run it in a thread. Returns the records read and the offset the checkpoint
    covered (None when none served)."""
    end = journal.end_offset
    snapshot = read_checkpoint(path) if path else None
    if snapshot is not None and snapshot.covered_offset > journal.opened_end_offset:
        # The journal lost a tail the checkpoint had seen (fsync = "interval" and a crash):
        # it may name records that are gone, and their offsets may hold others now, so
        # trust the journal alone.
        log.warning(
            "logtk: the idempotency checkpoint covers offsets up to %d, past the journal's "
            "end (%d) when it was opened; reading the journal",
            snapshot.covered_offset,
            journal.opened_end_offset,
        )
        assert path is not None
        discard_checkpoint(path)
        snapshot = None
    cutoff_ns = int((now - index.window_s) * 1e9)
    if snapshot is not None:
        index.restore(snapshot, now)
        start = max(snapshot.covered_offset, journal.first_offset)
    else:
        start = _window_start(journal, cutoff_ns)
    count = _read_keys(index, journal, max(start, end - max_records), end, cutoff_ns)
    index.covered_offset = end
    return count, None if snapshot is None else snapshot.covered_offset
