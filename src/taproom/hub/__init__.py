"""Hub core: ingest, commit-then-ack, committed-tail fan-out."""

from .core import Commit, CommittedBatch, Hub, Subscription

__all__ = ["Commit", "CommittedBatch", "Hub", "Subscription"]
