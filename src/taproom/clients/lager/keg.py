"""The :class:`KegWriter`: a Mug that records taps into one keg, in its own thread."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Mapping

from ...protocols.lager.keg import KegContents, KegFileWriter
from ...zmqaccess import Curve
from .common import LagerClientError
from .mug import Mug

__all__ = ["KegWriter"]


class KegWriter:
    """A mug that records the chosen taps into one keg (``*.lgr``), in its own thread.

    ``start()`` synchronises, adds the formats (the sidecar is written before any record),
    subscribes and returns once the subscriptions are confirmed. ``stop()`` finishes the keg.
    Taps registered later under the subtree are added when ``follow`` is set.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        registrar: str,
        forwarder: str | None = None,
        subtree: str = "",
        taps: Iterable[str] | None = None,
        follow: bool = True,
        metadata: Mapping[str, str] | None = None,
        flush_interval_s: float = 0.1,
        fsync: bool = False,
        curve: Curve | None = None,
    ) -> None:
        self.path = os.fspath(path)
        self.curve = curve
        self.registrar = registrar
        self.forwarder = forwarder
        self.subtree = subtree
        self.keys = list(taps) if taps is not None else None
        self.follow = follow and taps is None
        self.metadata = dict(metadata or {})
        self.flush_interval_s = flush_interval_s
        self.fsync = fsync
        self.records = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mug: Mug | None = None
        self._file: KegFileWriter | None = None

    def start(self, timeout: float = 10.0) -> KegWriter:
        mug = self._mug = Mug(registrar=self.registrar, forwarder=self.forwarder, curve=self.curve)
        mug.sync(self.subtree, timeout)
        keys = self.keys if self.keys is not None else list(mug.taps)
        chosen = []
        for key in keys:
            reg = mug.taps.get(key)
            if reg is None:
                raise LagerClientError(f"tap {key!r} is not registered")
            chosen.append(reg)
        self._file = KegFileWriter(
            self.path,
            {reg.uuid_str: reg.format.with_key(reg.key) for reg in chosen},
            self.metadata,
            fsync=self.fsync,
        )
        if self.follow:
            mug.subscribe(everything=True, timeout=timeout)
        else:
            mug.subscribe(*chosen, timeout=timeout)
        self._thread = threading.Thread(target=self._run, name="taproom-keg-writer", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        mug, keg = self._mug, self._file
        assert mug is not None and keg is not None
        next_flush = time.monotonic() + self.flush_interval_s
        try:
            while not self._stop.is_set():
                msg = mug.recv_message(timeout=0.05)
                while msg is not None:
                    reg = mug.lookup(msg.uuid)
                    if reg is not None and len(msg.payload) == reg.format.row_size:
                        if not keg.has(msg.uuid):
                            keg.add_format(reg.uuid_str, reg.format.with_key(reg.key))
                        keg.write(msg.uuid, msg.ts_ns, msg.payload)
                        self.records += 1
                    if time.monotonic() >= next_flush:
                        break
                    msg = mug.recv_message(timeout=0)
                if time.monotonic() >= next_flush:
                    keg.flush()
                    next_flush = time.monotonic() + self.flush_interval_s
        except BaseException as exc:  # reported by stop(); the keg stays recoverable
            self.error = exc

    def stop(self) -> KegContents | None:
        """Finish the keg (append formats, patch the header). Returns nothing on error."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._file is not None:
            self._file.close()
        if self._mug is not None:
            self._mug.close()
        if self.error is not None:
            raise LagerClientError(f"keg writer failed: {self.error}")
        return None
