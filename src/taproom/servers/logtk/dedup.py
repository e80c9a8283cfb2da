"""Exactly-once by idempotency: the index of committed (app, client id, idem) keys."""

from __future__ import annotations

from collections import deque

__all__ = ["DedupIndex", "parse_event_id"]


class DedupIndex:
    """Committed (app, client id, idem) keys seen within ``window_s``.

    Keys are ints (``slot << 32 | idem``, one slot per app and client id) in one set for
    lookups, and listed in time buckets for expiry: a whole bucket expires at once, and over
    ``max_entries`` the oldest bucket is dropped early (``evicted`` counts those keys).
    """

    BUCKETS = 16

    def __init__(self, window_s: float, max_entries: int) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._bucket_s = window_s / self.BUCKETS
        self._keys: set[int] = set()
        self._buckets: deque[tuple[float, list[int]]] = deque()
        self._slots: dict[tuple[str, int], int] = {}
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._keys)

    def slot(self, app: str, client_id: int) -> int:
        """The key prefix of one (app, client id): ``slot << 32``."""
        key = (app, client_id)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = len(self._slots) + 1
        return slot << 32

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def add(self, key: int, when: float) -> None:
        """Remember ``key`` as committed at wall-clock ``when`` (seconds)."""
        if key in self._keys:
            return
        start = when - when % self._bucket_s
        if not self._buckets or self._buckets[-1][0] < start:
            self._buckets.append((start, []))
        self._buckets[-1][1].append(key)
        self._keys.add(key)
        while len(self._keys) > self.max_entries and len(self._buckets) > 1:
            self.evicted += self._drop_oldest()

    def add_many(self, keys: list[int], when: float) -> None:
        """:meth:`add` for a commit's worth of keys."""
        before = len(self._keys)
        self._keys.update(keys)
        if len(self._keys) - before != len(keys):
            # Some were known already (a rebuild racing a resend): keep one entry per key.
            self._keys.difference_update(keys)
            self._keys.update(keys)
            for key in keys:
                self.add(key, when)
            return
        start = when - when % self._bucket_s
        if not self._buckets or self._buckets[-1][0] < start:
            self._buckets.append((start, []))
        self._buckets[-1][1].extend(keys)
        while len(self._keys) > self.max_entries and len(self._buckets) > 1:
            self.evicted += self._drop_oldest()

    def _drop_oldest(self) -> int:
        _, dropped = self._buckets.popleft()
        self._keys.difference_update(dropped)
        return len(dropped)

    def expire(self, now: float) -> None:
        cutoff = now - self.window_s - self._bucket_s
        while self._buckets and self._buckets[0][0] < cutoff:
            self._drop_oldest()


def parse_event_id(event_id: str) -> tuple[str, int, int] | None:
    """``"<app>:<client id hex>:<idem hex>"`` back to its parts."""
    parts = event_id.rsplit(":", 2)
    if len(parts) != 3:
        return None
    try:
        return parts[0], int(parts[1], 16), int(parts[2], 16)
    except ValueError:
        return None
