"""taproom spark/jobs."""
