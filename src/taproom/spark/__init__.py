"""taproom spark."""
