"""What the two CHP (Clustered Hashmap Protocol) speakers in taproom truly share.

The Event BUS's CHP dialect (``eventbus/kvmsg.py``, the ØMQ Guide's Clone model 5/6) and
Lager's registrar (``lager/chp.py``, nasa/lager) both frame every message as a kvmsg of five
frames and use the same three command words, and both take a snapshot request as ``ICANHAZ?``
followed by an optional subtree. They do **not** share the sequence frame: the Guide's kvmsg
writes a big-endian 64-bit integer, nasa/lager's registrar a C++ ``double`` in host byte order;
each module keeps its own encoding (tests/protocols/test_clustered_hashmap.py shows both).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FRAMES", "HUGZ", "ICANHAZ", "KTHXBAI", "snapshot_subtree"]

ICANHAZ = b"ICANHAZ?"  # "ICANHAZ command: Frame 0: 'ICANHAZ?'" (a snapshot request)
KTHXBAI = b"KTHXBAI"  # the end of a snapshot
HUGZ = b"HUGZ"  # the heartbeat
FRAMES = 5  # key | sequence | uuid | properties | body


def snapshot_subtree(frames: Sequence[bytes]) -> bytes | None:
    """The subtree of an ``ICANHAZ?`` request (empty when the frame is missing), or None when
    the frames are not one. Bounds and error replies are each protocol's own."""
    if not 1 <= len(frames) <= 2 or frames[0] != ICANHAZ:
        return None
    return bytes(frames[1]) if len(frames) == 2 else b""
