"""A ``C`` frame being read: one zlib stream fed as its compressed bytes arrive.

The decoder keeps a stack of these, outermost first (a ``C`` frame inside a ``C`` frame is a
stream fed from the inflated output of the one around it). Nothing here holds a whole frame:
``inbuf`` is compressed input not yet consumed (what one read brought, or one piece of the
enclosing stream), ``tail`` the inflated bytes not yet parsed (the start of an incomplete frame,
or compressed bytes of a nested frame).
"""

from __future__ import annotations

from zlib_ng import zlib_ng

__all__ = ["INFLATE_IN", "INFLATE_MIN", "INFLATE_STEP", "Level"]

# A window of Filebeat's inflates to about 1 MiB: one zlib call returns it whole, as bytes (the
# fast type to parse). Larger content is inflated a step at a time, each step parsed before the
# next, and one call of the decoder does about one step: a zlib bomb costs one step of time on
# the event loop (~1-4 ms) before other connections and /health get their turn.
INFLATE_STEP = 1024 * 1024
# With less inflate room than this left, a connection waits for more rather than inflating
# slivers (each call costs ~10 us besides its output).
INFLATE_MIN = 64 * 1024
# zlib-ng, not the standard library's zlib: the same streams and the same Decompress API
# (max_length, unconsumed_tail, eof), and it inflates ~1.8 times as fast here (issue 32: an
# 85 MB window of large events, 0.48 -> 0.26 s of CPU; inflating was half of the hub's CPU).
#
# Compressed input given to one zlib call: zlib hands back what it did not consume as a copy
# (``unconsumed_tail``), so a whole frame given at once would be copied again at every step.
INFLATE_IN = 256 * 1024


class Level:
    """One ``C`` frame: its zlib state, compressed bytes still to come from the level below
    (``remaining``), taken but not consumed (``inbuf``), and inflated but unparsed (``tail``)."""

    __slots__ = ("decomp", "fill", "inbuf", "inpos", "remaining", "tail")

    @property
    def pending(self) -> int:
        """Compressed bytes taken and not yet consumed."""
        return len(self.inbuf) - self.inpos

    def __init__(self, length: int) -> None:
        self.decomp = zlib_ng.decompressobj()
        self.remaining = length
        self.inbuf: bytes | bytearray = b""
        self.inpos = 0  # how much of inbuf zlib has consumed
        # bytes; or, while a large frame is inflated a step at a time, a bytearray of the whole
        # frame's size, allocated once and filled up to ``fill``
        self.tail: bytes | bytearray = b""
        self.fill = 0

    def held(self) -> int:
        """Inflated bytes in ``tail``."""
        tail = self.tail
        return self.fill if type(tail) is bytearray else len(tail)
