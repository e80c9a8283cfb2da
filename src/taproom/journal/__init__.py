"""The durable, segmented journal every accepted event goes through."""

from .check import check_journal
from .cursors import CursorStore
from .journal import FSYNC_POLICIES, Journal, SegmentInfo
from .reader import JournalReader
from .segments import Damage

__all__ = [
    "FSYNC_POLICIES",
    "CursorStore",
    "Damage",
    "Journal",
    "JournalReader",
    "SegmentInfo",
    "check_journal",
]
