"""The durable, segmented journal every accepted event goes through."""

from .cursors import CursorStore
from .journal import FSYNC_POLICIES, Journal, SegmentInfo, check_journal
from .reader import JournalReader

__all__ = [
    "FSYNC_POLICIES",
    "CursorStore",
    "Journal",
    "JournalReader",
    "SegmentInfo",
    "check_journal",
]
