"""Checkpoint files: state a service saves beside the journal so a restart reads only the
journal's tail (the Event BUS hashmap, the LogTK idempotency index).

One file per checkpoint: a magic line naming the format, the CRC-32 of the body (4 bytes, big
endian), the body. It is written atomically (temp file, fsync, rename, fsync of the directory),
so a crash leaves the old checkpoint or the new one, never a mix; one that fails its magic or
CRC is ignored (logged) and the caller falls back to the journal, the only truth.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Iterable

__all__ = ["load_checkpoint", "save_checkpoint"]

log = logging.getLogger("taproom.checkpoint")

_CRC = struct.Struct(">I")


def save_checkpoint(path: str, magic: bytes, body: Iterable[bytes | memoryview]) -> None:
    """Write ``magic``, the CRC and the ``body`` parts (not joined: a body may be large)."""
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
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def load_checkpoint(path: str, magic: bytes) -> bytes | None:
    """The body saved at ``path``; None when there is none or it does not verify."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except FileNotFoundError:
        return None
    head = len(magic) + _CRC.size
    if not blob.startswith(magic) or len(blob) < head:
        log.warning("%s is not a checkpoint of this kind; the journal is read instead", path)
        return None
    body = blob[head:]
    if zlib.crc32(body) != _CRC.unpack_from(blob, len(magic))[0]:
        log.warning("%s fails its CRC; the journal is read instead", path)
        return None
    return body
