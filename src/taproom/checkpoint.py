"""Checkpoint files: state a service saves beside the journal so a restart reads only the
journal's tail (the Event BUS hashmap, the LogTK idempotency index), and when to write them.

One file per checkpoint: a magic line naming the format, the CRC-32 of the body (4 bytes, big
endian), the body. It is written atomically (temp file, fsync, rename, fsync of the directory),
so a crash leaves the old checkpoint or the new one, never a mix; one that fails its magic or
CRC is ignored (logged) and the caller falls back to the journal, the only truth.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import time
import zlib
from collections.abc import Awaitable, Callable, Iterable

from .metrics import Metrics

__all__ = ["CheckpointSchedule", "discard_checkpoint", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger("taproom.checkpoint")

_CRC = struct.Struct(">I")


def _fsync_dir(directory: str) -> None:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_checkpoint(
    path: str, magic: bytes, body: Iterable[bytes | memoryview], *, durable: bool = True
) -> None:
    """Write ``magic``, the CRC and the ``body`` parts (not joined: a body may be large).
    Without ``durable``, not fsynced: for derived files that are rebuilt when lost (the
    journal's index)."""
    parts = list(body)
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(magic + _CRC.pack(crc))
        for part in parts:
            f.write(part)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        _fsync_dir(directory)


def discard_checkpoint(path: str) -> None:
    """Delete a checkpoint that covers offsets the journal lost (a tail cut after a crash), so
    that it is never used once the journal has grown past them again with other records: a
    crash before the next checkpoint then costs a full read of the journal, not a wrong state."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    _fsync_dir(os.path.dirname(path) or ".")


def load_checkpoint(
    path: str, magic: bytes, *, instead: str = "the journal is read instead"
) -> bytes | None:
    """The body saved at ``path``; None when there is none or it does not verify (logged,
    with what the caller does ``instead``)."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    head = len(magic) + _CRC.size
    if not blob.startswith(magic) or len(blob) < head:
        log.warning("%s is not a file of this kind; %s", path, instead)
        return None
    body = blob[head:]
    if zlib.crc32(body) != _CRC.unpack_from(blob, len(magic))[0]:
        log.warning("%s fails its CRC; %s", path, instead)
        return None
    return body


class CheckpointSchedule:
    """When a service's checkpoint is due: by progress, not only by time.

    A restart loads the checkpoint (its cost grows with the state it holds) and re-applies the
    service's own records committed after it, one by one; the journal's index skips everything
    else (taproom.journal.kinds). So a checkpoint is due, checked every second or so, when:

    * the state was rebuilt from the journal at start and not saved since: at once, so that a
      crash loop makes progress (each start reads only what came after the previous one);
    * ``after_events`` of the service's own records were applied since the last one, and at
      least ``size_ratio`` x the entries the state holds (a big state is written less often:
      writing it then costs at most about ``1 / size_ratio`` entries per record applied);
    * anything changed (records applied, or only the journal's end moved on) and
      ``interval_s`` passed;

    and (but for the first case) never sooner than ``min_gap_s`` after the last one, nor
    after a failed one (each write runs in a thread and must not follow the last back to back). It also keeps the restart metrics of its service:
    ``taproom_restart_*{kind=<service>}``.
    """

    def __init__(
        self,
        metrics: Metrics,
        service: str,
        *,
        interval_s: float,
        after_events: int,
        size_ratio: float = 1.0,
        min_gap_s: float = 1.0,
    ) -> None:
        self.interval_s = interval_s
        self.after_events = after_events
        self.size_ratio = size_ratio
        self.min_gap_s = min_gap_s
        self.applied = 0  # own records applied since the state the last checkpoint saved
        self.covered = -1  # journal offset the last checkpoint covers (-1: none usable)
        self.unsaved = False  # the state holds records read from the journal and not saved
        self.last_at = time.monotonic()
        self._retry_at = 0.0  # after a failed write, nothing before this
        labels = {"kind": service}
        self._m_seconds = metrics.gauge(
            "restart",
            "rebuild",
            "seconds",
            "How long the service's state took to rebuild at the last start",
            ("kind",),
        ).labels(**labels)
        self._m_replayed = metrics.gauge(
            "restart",
            "replayed",
            "events",
            "Journal records the service re-applied at the last start (after its checkpoint)",
            ("kind",),
        ).labels(**labels)
        self._m_from_checkpoint = metrics.gauge(
            "restart",
            "from_checkpoint",
            "bool",
            "1 when the last start loaded the service's checkpoint, 0 when it read the journal",
            ("kind",),
        ).labels(**labels)
        self._m_written = metrics.counter(
            "restart", "checkpoints", "calls", "Checkpoints written", ("kind",)
        ).labels(**labels)
        self._m_write_seconds = metrics.counter(
            "restart", "checkpoint_write", "seconds", "Time spent writing checkpoints", ("kind",)
        ).labels(**labels)
        self._m_behind = metrics.gauge(
            "restart",
            "checkpoint_behind",
            "events",
            "Own records applied since the last checkpoint (a restart re-applies them)",
            ("kind",),
        ).labels(**labels)
        self._m_behind.set_function(lambda: self.applied)

    def started(self, *, seconds: float, replayed: int, covered: int | None) -> None:
        """The state was rebuilt: from a checkpoint covering ``covered`` (None: no usable
        one) and ``replayed`` records after it."""
        self._m_seconds.set(seconds)
        self._m_replayed.set(replayed)
        self._m_from_checkpoint.set(covered is not None)
        self.covered = covered if covered is not None else -1
        self.unsaved = replayed > 0  # nothing read: the journal has none of its records yet

    def due(self, now: float, covered: int, size: int) -> bool:
        """Whether to write now; ``covered``: the journal offset a checkpoint would cover,
        ``size``: the entries the state holds."""
        if now < self._retry_at:
            return False
        if self.unsaved:
            return True
        if now - self.last_at < self.min_gap_s:
            return False
        if self.applied >= max(self.after_events, self.size_ratio * size):
            return True
        changed = self.applied > 0 or covered > self.covered
        return changed and now - self.last_at >= self.interval_s

    def taken(self) -> int:
        """The state is being saved: the records applied so far are in it. Returns them, for
        :meth:`failed` to give back if the write fails."""
        taken, self.applied = self.applied, 0
        return taken

    def written(self, covered: int, seconds: float) -> None:
        self.covered = covered
        self.unsaved = False
        self.last_at = time.monotonic()
        self._m_written.inc()
        self._m_write_seconds.inc(seconds)

    def failed(self, taken: int) -> None:
        self.applied += taken
        self._retry_at = time.monotonic() + self.min_gap_s  # not in a tight loop

    async def run(
        self,
        *,
        check_s: float,
        applied: Callable[[], int] | None,
        covered: Callable[[], int],
        size: Callable[[], int],
        save: Callable[[], Awaitable[None]],
        what: str,
    ) -> None:
        """A service's checkpoint loop: every ``check_s``, ``save()`` when :meth:`due` (with
        ``applied()`` own records since the last save, when the service counts them so; else
        it adds to :attr:`applied` itself). A failed write is logged and tried again later."""
        while True:
            if applied is not None:
                self.applied = applied()
            if self.due(time.monotonic(), covered(), size()):
                try:
                    await save()
                except OSError as exc:
                    log.error("%s: checkpoint failed (%s); the journal still has it all", what, exc)
            await asyncio.sleep(check_s)
