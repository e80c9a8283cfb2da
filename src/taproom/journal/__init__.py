"""The durable, segmented journal every accepted event goes through."""

from .check import check_journal
from .cursors import CursorStore
from .identity import ID_FILE, journal_id, read_journal_id
from .journal import FSYNC_POLICIES, Journal, SegmentInfo
from .reader import JournalReader
from .segments import Damage

__all__ = [
    "FSYNC_POLICIES",
    "ID_FILE",
    "CursorStore",
    "Damage",
    "Journal",
    "JournalReader",
    "SegmentInfo",
    "check_journal",
    "journal_id",
    "read_journal_id",
]
