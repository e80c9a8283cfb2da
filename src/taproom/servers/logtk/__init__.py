"""LogTK server glue: WebSocket (``websockets``) and raw TCP (asyncio) around the sans-I/O core.

Both listeners feed :class:`taproom.protocols.logtk.ServerConnection`. Each read's data frames
become one journal batch; a frame is acknowledged only once the commit covering it resolved.
Exactly-once by idempotency: every stored event carries ``event_id = "<app>:<client id
hex>:<idem hex>"`` and a :class:`DedupIndex` keyed by (app, client id, idem) remembers every
committed token for ``dedup_window_s``. A token seen again is acknowledged again and counted,
never stored twice; one whose first copy is still being committed is acknowledged when that
commit resolves. On start the index is rebuilt from the journal's LogTK records within the
window (in a thread, bounded by ``dedup_rebuild_max_records``), so the guarantee survives
restarts and SIGKILL without a second file to keep consistent with the journal.

Modules: ``config`` (the ``[logtk]`` section), ``dedup`` (the index), ``session`` (one
connection), ``service`` (listeners, auth, lifecycle).
"""

from .config import LogTKApp, LogTKConfig, hash_token
from .dedup import DedupIndex, parse_event_id
from .service import LogTKService, create_service

__all__ = [
    "DedupIndex",
    "LogTKApp",
    "LogTKConfig",
    "LogTKService",
    "create_service",
    "hash_token",
    "parse_event_id",
]
