"""taproom protocols/lager."""
