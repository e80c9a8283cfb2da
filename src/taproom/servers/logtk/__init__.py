"""LogTK server glue: WebSocket (``websockets``) and raw TCP (asyncio) around the sans-I/O core.

Both listeners feed :class:`taproom.protocols.logtk.ServerConnection`. Each read's data frames
become one journal batch; a frame is acknowledged only once the commit covering it resolved.
Exactly-once by idempotency: every stored event carries ``event_id = "<app>:<client id
hex>:<idem hex>"`` and a :class:`DedupIndex` keyed by (app, client id, idem) remembers every
committed token for ``dedup_window_s``. A token seen again is acknowledged again and counted,
never stored twice; one whose first copy is still being committed is acknowledged when that
commit resolves. The index is checkpointed beside the journal every
``dedup_checkpoint_interval_s`` and at stop; on start it is loaded and only the journal's LogTK
records after it are read (without a usable checkpoint: every record in the window), so the
guarantee survives restarts and SIGKILL and a restart stays quick with millions of keys.

Modules: ``config`` (the ``[logtk]`` section), ``dedup`` (the index), ``session`` (one
connection), ``service`` (listeners, auth, lifecycle).
"""

from .config import LogTKApp, LogTKConfig, hash_token
from .dedup import DedupIndex
from .service import LogTKService, create_service

__all__ = [
    "DedupIndex",
    "LogTKApp",
    "LogTKConfig",
    "LogTKService",
    "create_service",
    "hash_token",
]
